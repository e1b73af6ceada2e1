"""faultlab's version, in the ground floor so that any layer may print it."""

__version__ = "0.1.0"
