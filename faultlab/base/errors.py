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
#: ``explore`` found nothing, but tested nothing either: no operation was ever accepted, an
#: invariant family never had anything to check, ``--power-loss`` took no power cut (OPEN
#: and DURABLE never checked), the declared crash points were armed and never fired, or
#: ``--concurrency`` workers never overlapped. Not clean (0), not a finding
#: (1): a system whose accept prints garbage and stores nothing must not pass a CI job.
#: (``faultlab worker`` keeps its own 4, downstream_failure: another command.)
EXIT_VACUOUS = 4
#: An invariant failed in an example, but the failure did not happen again when the example
#: was re-run (by Hypothesis, or by faultlab's replay of its trace): a result that cannot be
#: reproduced is neither clean (0) nor a finding (1). Its trace is kept apart from the
#: corpus, marked ``"expect": "flaky"``; ``replay`` of it exits 5 too unless it fails again.
EXIT_FLAKY = 5


class UsageError(Exception):
    """Bad input: reported on one line, exit status 2, nothing touched."""

    exit_code = EXIT_USAGE


class ExecutionError(Exception):
    """A run could not be completed (a worker missed its deadline, the fork server died).

    Exit status 3: the run failed, which is not a finding (1) and not bad input (2).
    """

    exit_code = EXIT_RUN_FAILED
