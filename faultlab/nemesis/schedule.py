"""Scheduling points, worker side: a worker faultlab schedules holds at every named point.

In a concurrent trace faultlab runs several workers at once, but decides who
moves: each worker stops at every named point it reaches (the points it
declares as crash points), announces ``held POINT`` on its control pipe and
blocks until faultlab answers one byte. ``c`` lets it run to its next point;
faultlab kills a worker where it is held with SIGKILL from outside (see
:mod:`faultlab.run.interleaving`), so a kill needs nothing from the worker. A worker also
announces the claims it takes (``claim OPERATION TOKEN``), which the fencing
invariant checks.

The pipe's two descriptors reach the worker in the environment variable
``FAULTLAB_SCHEDULE`` (``READ,WRITE``). :func:`arm_from_environment` takes them
out of the environment at worker start, so a service the worker starts (a
child process) never inherits them and never holds. Without the variable
(every sequential trace) every function here returns at once.
"""

from __future__ import annotations

import json
import os
import signal
from types import FrameType

SCHEDULE_ENV = "FAULTLAB_SCHEDULE"
#: Set (to 1) by faultlab when a scheduled Python worker also holds at ``sql:K`` (before
#: its K-th SQL statement) and ``commit:K`` (after its K-th COMMIT).
STATEMENTS_ENV = "FAULTLAB_SCHEDULE_STATEMENTS"
CONTINUE = b"c"
#: Seconds a scheduled worker's SQLite connection waits for a lock. In a concurrent trace
#: the lock's holder moves only when the schedule releases it, however many steps (and
#: seconds, on a loaded machine) that takes: a busy timeout would turn wall time into a
#: different outcome, so the executor, not a timer, decides (it kills every lane at the end).
SCHEDULED_BUSY_TIMEOUT = 3600.0

#: What the executor sends a scheduled worker it sees asleep in SQLite's busy handler: the
#: sleep ends at once (a handled signal interrupts nanosleep) and SQLite retries the lock
#: now, not up to 100 ms later. Asleep again after that retry, the worker waits for a lock
#: another lane holds: the executor knows in milliseconds, and knows it from what the
#: worker did, not from how long it slept. A signal whose default is to be ignored, so a
#: process without the handler is never harmed by it.
RETRY_SIGNAL = signal.SIGURG

_channel: tuple[int, int] | None = None


def _retry_now(signum: int, frame: FrameType | None) -> None:
    """Nothing to do: the signal's arrival already ended the busy handler's sleep."""


def disarm() -> None:
    """Forget an inherited channel (a forked service child must not hold at its points)."""
    global _channel
    _channel = None


def arm_from_environment() -> None:
    """Take the control pipe named by ``FAULTLAB_SCHEDULE`` (and remove the variable)."""
    global _channel
    value = os.environ.pop(SCHEDULE_ENV, "")
    if not value:
        return
    read_text, _, write_text = value.partition(",")
    _channel = (int(read_text), int(write_text))
    signal.signal(RETRY_SIGNAL, _retry_now)  # a forked service child inherits it


def active() -> bool:
    return _channel is not None


def _announce(line: str) -> bool:
    if _channel is None:
        return False
    try:
        os.write(_channel[1], (line + "\n").encode())
    except OSError:  # faultlab went away: run on as an unscheduled worker
        disarm()
        return False
    return True


def hold(point: str) -> None:
    """Announce ``held POINT`` and block until faultlab lets this worker continue.

    End of file on the control pipe (faultlab closed it) also continues: faultlab
    only closes it when it no longer schedules this worker.
    """
    channel = _channel
    if channel is None or not _announce(f"held {point}"):
        return
    try:
        os.read(channel[0], 1)
    except OSError:
        disarm()


def claimed(operation_id: str, token: int, lease_until: float | None = None) -> None:
    """Announce that this worker now holds the claim on ``operation_id`` with ``token``,
    leased until ``lease_until`` (``-`` when the claim has no lease). The id travels as a
    JSON string: one line, every id exactly (``op-1 `` is not ``op-1``, nor ``op-1_``)."""
    until = "-" if lease_until is None else repr(float(lease_until))
    _announce(f"claim {json.dumps(operation_id)} {int(token)} {until}")


class StatementHolds:
    """Statement scheduling points: hold at ``sql:K`` before the K-th SQL statement this
    process runs and at ``commit:K`` after its K-th COMMIT, as the statement crash points
    of :mod:`faultlab.nemesis.crash` count them (the same K names the same place)."""

    def __init__(self) -> None:
        self.statements = 0
        self.commits = 0
        self.committing = False

    def before_statement(self, sql: str) -> None:
        self.statements += 1
        hold(f"sql:{self.statements}")
        if sql.lstrip().upper().startswith(("COMMIT", "END")):
            self.commits += 1
            self.committing = True

    def after_statement(self) -> None:
        if self.committing:
            self.committing = False
            hold(f"commit:{self.commits}")


def statement_holds_requested() -> bool:
    """Whether faultlab asked for statement points (the variable is removed either way, so
    a service this worker starts never inherits it)."""
    return bool(os.environ.pop(STATEMENTS_ENV, "")) and active()
