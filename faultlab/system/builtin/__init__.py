"""The built-in systems: the reference outbox, reference-pg, and the bug zoo."""
