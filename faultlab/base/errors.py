"""Errors that end a command with a one-line message, and the exit statuses they map to.

A :class:`UsageError` is bad input from the user: the command prints it on one
line and exits with status 2 before anything is created or changed.
"""

#: Exit statuses shared by the command line and the worker processes.
EXIT_OK = 0
EXIT_FOUND = 1
EXIT_USAGE = 2
#: The run itself failed (a deadline, a broken protocol, an unreadable store): no finding.
EXIT_RUN_FAILED = 3


class UsageError(Exception):
    """Bad input: reported on one line, exit status 2, nothing touched."""

    exit_code = EXIT_USAGE


class ExecutionError(Exception):
    """A run could not be completed (a worker missed its deadline, the fork server died).

    Exit status 3: the run failed, which is not a finding (1) and not bad input (2).
    """

    exit_code = EXIT_RUN_FAILED
