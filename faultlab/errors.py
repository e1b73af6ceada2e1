"""Errors that end a command with a one-line message.

A :class:`UsageError` is bad input from the user: the command prints it on one
line and exits with status 2 before anything is created or changed.
"""


class UsageError(Exception):
    """Bad input: reported on one line, exit status 2, nothing touched."""

    exit_code = 2


class ExecutionError(Exception):
    """A run could not be completed (a worker missed its deadline, the fork server died)."""

    exit_code = 1
