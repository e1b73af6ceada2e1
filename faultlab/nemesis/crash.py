"""Crash points: the worker SIGKILLs its own process at a precise place.

A crash is never an exception or a flag: :func:`kill_self` sends SIGKILL to the
current process, so no ``finally`` block, ``atexit`` hook or SQLite rollback in
the worker runs, and the parent observes exit status -9.

Three kinds of point can be armed on a step:

* a named point the system declares (``after_downstream_commit``), reached when
  worker code calls ``context.crash_point(name)``;
* ``sql:K``: immediately before the worker's K-th SQL statement;
* ``commit:K``: immediately after the worker's K-th ``COMMIT`` returns.

Statement points need no annotation of the system's code: the worker process
wraps :func:`sqlite3.connect` so every connection it opens is traced.
"""

from __future__ import annotations

import os
import re
import signal
import sqlite3
import time
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

_STATEMENT_POINT = re.compile(r"^(sql|commit):([1-9][0-9]*)$")


def kill_self() -> NoReturn:
    """SIGKILL the current process. Does not return."""
    os.kill(os.getpid(), signal.SIGKILL)
    while True:  # pragma: no cover - SIGKILL cannot be caught; wait for delivery
        time.sleep(1)


def statement_point(name: str) -> tuple[str, int] | None:
    """Parse ``sql:K`` / ``commit:K``; None for a named point."""
    match = _STATEMENT_POINT.match(name)
    if match is None:
        return None
    return match.group(1), int(match.group(2))


def is_statement_point(name: str) -> bool:
    return statement_point(name) is not None


@dataclass
class StatementCounter:
    """Counts this process's SQL statements and COMMITs; kills at the armed one."""

    kind: str
    index: int
    statements: int = 0
    commits: int = 0
    commit_armed: bool = False

    def before_statement(self, sql: str) -> None:
        self.statements += 1
        if self.kind == "sql" and self.statements == self.index:
            kill_self()
        if sql.lstrip().upper().startswith(("COMMIT", "END")):
            self.commits += 1
            if self.kind == "commit" and self.commits == self.index:
                self.commit_armed = True

    def after_statement(self) -> None:
        if self.commit_armed:
            kill_self()


class StatementObserver(Protocol):
    def before_statement(self, sql: str) -> None: ...

    def after_statement(self) -> None: ...


_counter: StatementObserver | None = None
_unpatched_connect = sqlite3.connect


class _TracedConnection(sqlite3.Connection):
    """A connection whose statements are counted for ``sql:K`` / ``commit:K`` crashes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if _counter is not None:
            self.set_trace_callback(_counter.before_statement)

    def execute(self, *args: Any, **kwargs: Any) -> sqlite3.Cursor:
        cursor = super().execute(*args, **kwargs)
        if _counter is not None:
            _counter.after_statement()
        return cursor

    def commit(self) -> None:
        super().commit()
        if _counter is not None:
            _counter.after_statement()


def disarm() -> None:
    """Forget any statement point armed in this process (a forked child starts clean).

    A dispatcher in a lane forks its service child; without this the child would
    inherit the dispatcher's armed counter and crash where an exec-mode service,
    a fresh interpreter, never would.
    """
    global _counter
    _counter = None
    sqlite3.connect = _unpatched_connect


def arm_statement_point(name: str) -> None:
    """Arm ``sql:K`` or ``commit:K`` for every connection this process opens from now on."""
    parsed = statement_point(name)
    if parsed is None:
        raise ValueError(f"not a statement crash point: {name}")
    observe_statements(StatementCounter(*parsed))


def observe_statements(observer: StatementObserver) -> None:
    """Call ``observer`` before every SQL statement and after every statement or COMMIT of
    every connection this process opens from now on (a statement crash point, or the
    statement scheduling points of :mod:`faultlab.nemesis.schedule`)."""
    global _counter
    _counter = observer
    original = sqlite3.connect

    def traced_connect(*args: Any, **kwargs: Any) -> sqlite3.Connection:
        kwargs.setdefault("factory", _TracedConnection)
        connection: sqlite3.Connection = original(*args, **kwargs)
        return connection

    sqlite3.connect = traced_connect  # type: ignore[assignment]


def armed_counter() -> StatementObserver | None:
    """The statement point armed in this process, if any (PostgreSQL connections use it too)."""
    return _counter
