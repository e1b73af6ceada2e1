"""Statement crash points (``sql:K``, ``commit:K``) and the ambiguous commit, on psycopg.

:mod:`faultlab.nemesis.crash` counts a worker's SQLite statements by wrapping
``sqlite3.connect``; PostgreSQL connections of a Python system are opened through
``context.connect_postgres``, which hands out these traced classes when a statement
point is armed: ``Cursor.execute`` (and so ``Connection.execute``) and
``Connection.commit`` count exactly as the SQLite wrapper does. A COMMIT inside
``with connection.transaction():`` is psycopg's own and is not counted.

:func:`commit_or_crash` is the PostgreSQL-only crash: COMMIT is sent, the process is
SIGKILLed before the reply is read, so the worker cannot know whether the server
committed; the invariants judge what the server kept.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from faultlab.nemesis import crash
from faultlab.stores import postgres as pgstores

if TYPE_CHECKING:
    import psycopg


class CrashPoints(Protocol):
    """What :func:`commit_or_crash` needs of a worker context (the systems layer's)."""

    def crash_point(self, name: str) -> None: ...

_classes: type[Any] | None = None


def traced_connection_class() -> type[Any]:
    """A psycopg Connection subclass whose statements and commits hit the armed counter."""
    global _classes
    if _classes is not None:
        return _classes
    import psycopg

    class TracedCursor(psycopg.Cursor[Any]):
        def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
            counter = crash.armed_counter()
            if counter is not None:
                text = query if isinstance(query, str) else str(query)
                counter.before_statement(text)
            result = super().execute(query, params, **kwargs)
            if counter is not None:
                counter.after_statement()
            return result

    class TracedConnection(psycopg.Connection[Any]):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.cursor_factory = TracedCursor

        def commit(self) -> None:
            counter = crash.armed_counter()
            if counter is not None:
                counter.before_statement("COMMIT")
            super().commit()
            if counter is not None:
                counter.after_statement()

    _classes = TracedConnection
    return TracedConnection


def commit_or_crash(
    context: CrashPoints, connection: psycopg.Connection[Any], point: str
) -> None:
    """COMMIT; if ``point`` is armed, SIGKILL after sending COMMIT and before its reply.

    Counts as a COMMIT for ``sql:K``/``commit:K`` like ``connection.commit()``.
    """
    counter = crash.armed_counter()
    if counter is not None:
        counter.before_statement("COMMIT")
    pgstores.send_commit_then(connection, lambda: context.crash_point(point))
    if counter is not None:
        counter.after_statement()
