"""faultlab: prove that a crash between two stores cannot lose or duplicate work.

The public surface is small on purpose: a system under test implements
:class:`faultlab.system.System`; everything else (the trace executor, the
invariants, the Hypothesis state machine) drives it through real processes.
"""

__version__ = "0.1.0"
