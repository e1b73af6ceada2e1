"""SQLite stores: initialise with faultlab's marker, connect, snapshot.

Every database faultlab creates carries ``PRAGMA application_id`` set to
:data:`APPLICATION_ID`. Workers and snapshots refuse a file without it, so
faultlab never writes to a database it did not initialise.
"""

from __future__ import annotations

import os
import sqlite3
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple
from urllib.parse import quote_from_bytes

APPLICATION_ID = 0x46544C42  # "FTLB"
#: Seconds a connection waits for another process's lock before failing.
BUSY_TIMEOUT = 5.0


class StoreError(Exception):
    """A store is missing, foreign (no faultlab marker) or unreadable."""


class Operation(NamedTuple):
    id: str
    payload: str
    state: str
    result: str | None


class OutboxRow(NamedTuple):
    operation_id: str
    state: str


class Ticket(NamedTuple):
    id: int
    operation_id: str
    payload: str


class Receipt(NamedTuple):
    operation_id: str
    payload: str
    result: str


TABLES = ("operations", "outbox", "tickets", "receipts")
ROW_TYPES: dict[str, type[Any]] = {
    "operations": Operation,
    "outbox": OutboxRow,
    "tickets": Ticket,
    "receipts": Receipt,
}


@dataclass(frozen=True)
class Snapshot:
    """Both stores at one instant, as faultlab's four-table model, in a stable order."""

    operations: tuple[Operation, ...] = ()
    outbox: tuple[OutboxRow, ...] = ()
    tickets: tuple[Ticket, ...] = ()
    receipts: tuple[Receipt, ...] = ()

    def operation(self, operation_id: str) -> Operation | None:
        return next((row for row in self.operations if row.id == operation_id), None)

    def outbox_row(self, operation_id: str) -> OutboxRow | None:
        return next((row for row in self.outbox if row.operation_id == operation_id), None)

    def receipt(self, operation_id: str) -> Receipt | None:
        return next((row for row in self.receipts if row.operation_id == operation_id), None)

    def tickets_for(self, operation_id: str) -> list[Ticket]:
        return [row for row in self.tickets if row.operation_id == operation_id]

    def pending_outbox(self) -> list[OutboxRow]:
        return [row for row in self.outbox if row.state == "pending"]

    def counts(self) -> dict[str, int]:
        """Pending/complete counts per caller table and row counts downstream."""
        return {
            "operations_pending": sum(r.state == "pending" for r in self.operations),
            "operations_complete": sum(r.state == "complete" for r in self.operations),
            "outbox_pending": sum(r.state == "pending" for r in self.outbox),
            "outbox_complete": sum(r.state == "complete" for r in self.outbox),
            "tickets": len(self.tickets),
            "receipts": len(self.receipts),
        }

    def to_json(self) -> dict[str, list[dict[str, Any]]]:
        return {name: [row._asdict() for row in getattr(self, name)] for name in TABLES}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Snapshot:
        return cls(
            **{
                name: tuple(ROW_TYPES[name](**row) for row in data.get(name, ()))
                for name in TABLES
            }
        )

    @classmethod
    def from_rows(cls, tables: dict[str, Iterable[Iterable[Any]]]) -> Snapshot:
        """Build from raw rows (in column order), sorting each table by its key."""
        built: dict[str, tuple[Any, ...]] = {}
        for name in TABLES:
            row_type = ROW_TYPES[name]
            rows = [row_type(*row) for row in tables.get(name, ())]
            built[name] = tuple(sorted(rows, key=lambda r: (str(r[0]), r)))
        if built["tickets"]:
            built["tickets"] = tuple(sorted(built["tickets"], key=lambda r: int(r.id)))
        return cls(**built)


def scratch_directory() -> str | None:
    """Where faultlab's own run directories go: a RAM-backed directory when there is one.

    Every commit of the system under test fsyncs (``synchronous=EXTRA``). A crash
    here is a SIGKILL, which the page cache survives, and a power cut
    (``--power-loss``) is rebuilt from :mod:`faultlab.stores.vfs`'s record of writes
    and syncs, not read from the disk, so a tmpfs changes nothing the checks can see
    and saves the disk flushes. ``None`` means the system's temporary directory.
    """
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK):
        return str(shm)
    return None


def uri(path: Path, mode: str) -> str:
    """An SQLite ``file:`` URI for ``path`` opened in ``mode`` (ro, rw, rwc).

    Built here rather than with ``Path.resolve().as_uri()``: on Python 3.13 that
    imports ``urllib.parse`` on first use, which a fork-mode worker would then pay
    for in every process (about 13 ms, three times the rest of the worker), and
    ``resolve`` costs a system call per path component. SQLite resolves symbolic
    links and ``..`` itself.
    """
    absolute = os.fspath(path) if os.path.isabs(path) else os.path.join(os.getcwd(), path)
    return f"file://{quote_from_bytes(os.fsencode(absolute))}?mode={mode}"


def initialise(path: Path, schema: str) -> None:
    """Create a new store with faultlab's marker; refuse to touch an existing file."""
    if path.exists():
        raise StoreError(f"{path}: already exists; faultlab only initialises new stores")
    connection = sqlite3.connect(uri(path, "rwc"), uri=True, isolation_level=None)
    try:
        connection.execute("PRAGMA synchronous=FULL")
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(f"PRAGMA application_id={APPLICATION_ID}")
        for statement in (s.strip() for s in schema.split(";")):
            if statement:
                connection.execute(statement)
        connection.execute("COMMIT")
    finally:
        connection.close()


def connect(path: Path, *, timeout: float = BUSY_TIMEOUT) -> sqlite3.Connection:
    """Open an existing faultlab store for reading and writing.

    Refuses (StoreError) a missing file or one without the marker, before any write.
    The connection is in autocommit mode: callers write ``BEGIN IMMEDIATE`` ... ``COMMIT``.
    ``timeout`` is how long SQLite's busy handler waits for another writer's lock.
    """
    try:  # mode=rw never creates the file; why it failed is looked at only if it did
        connection = sqlite3.connect(
            uri(path, "rw"), uri=True, isolation_level=None, timeout=timeout
        )
    except sqlite3.Error as error:
        if not path.is_file():
            raise StoreError(
                f"{path}: no such store (initialise the directory with faultlab first)"
            ) from None
        raise StoreError(f"{path}: cannot open: {error}") from None
    try:
        marker = connection.execute("PRAGMA application_id").fetchone()[0]
    except sqlite3.DatabaseError as error:
        connection.close()
        if _busy(error):
            raise StoreError(f"{path}: cannot be read: {error} (a process holds its lock "
                             f"past the {timeout:g} s busy timeout)") from None
        raise StoreError(f"{path}: not an SQLite database: {error}") from None
    if marker != APPLICATION_ID:
        connection.close()
        raise StoreError(f"{path}: not initialised by faultlab (no marker); refusing to write")
    # EXTRA, not FULL: in the default rollback-journal mode FULL leaves the commit point
    # (the journal's unlink) without a directory sync, so a power cut loses the last
    # acknowledged commit (tests/test_power_vfs.py); EXTRA syncs the directory too.
    connection.execute("PRAGMA synchronous=EXTRA")
    return connection


def _busy(error: sqlite3.Error) -> bool:
    """SQLITE_BUSY or SQLITE_LOCKED: another connection holds the lock (the error code is
    there from Python 3.11; 3.10 has only the message)."""
    code = getattr(error, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in (5, 6)  # SQLITE_BUSY, SQLITE_LOCKED (extended codes too)
    return "locked" in str(error)


def query(path: Path, queries: dict[str, str]) -> dict[str, list[tuple[Any, ...]]]:
    """Run read-only queries on one faultlab store (one connection) and return their rows.

    Inside :func:`readers_kept_open` the connection stays open for the next query of the
    same file; otherwise it is opened and closed here."""
    if _kept is not None:
        return _kept.query(path, queries)
    connection = _reader(path)
    try:
        return _rows(connection, queries)
    finally:
        connection.close()


def _reader(path: Path) -> sqlite3.Connection:
    connection = connect(path)
    connection.execute("PRAGMA query_only=ON")
    return connection


def _rows(connection: sqlite3.Connection,
          queries: dict[str, str]) -> dict[str, list[tuple[Any, ...]]]:
    # fetchall ends each statement: no read lock outlives the query (a worker may write next)
    return {name: [tuple(row) for row in connection.execute(sql).fetchall()]
            for name, sql in queries.items()}


class KeptReaders:
    """Read-only connections kept open across queries while one trace runs.

    The executor snapshots both stores after every step; opening a connection (and
    checking the marker) cost about a fifth of faultlab's own CPU per step. Each query
    still runs in its own read transaction, so it sees every commit a worker made
    since, and a hot journal a SIGKILLed worker left is rolled back by it as by a fresh
    connection. A connection is reused only while the path still names the file it
    opened (same device and inode): a store replaced or copied over is opened anew.
    """

    def __init__(self) -> None:
        self._open: dict[str, tuple[tuple[int, int], sqlite3.Connection]] = {}

    def query(self, path: Path, queries: dict[str, str]) -> dict[str, list[tuple[Any, ...]]]:
        key = os.fspath(path)
        try:
            status = os.stat(key)
            identity = (status.st_dev, status.st_ino)
        except OSError:
            identity = (-1, -1)  # missing: connect() below says so
        kept = self._open.pop(key, None)
        if kept is not None and kept[0] != identity:
            kept[1].close()
            kept = None
        connection = kept[1] if kept is not None else _reader(path)
        self._open[key] = (identity, connection)
        return _rows(connection, queries)

    def connections(self) -> list[sqlite3.Connection]:
        return [connection for _, connection in self._open.values()]

    def close(self) -> None:
        for _, connection in self._open.values():
            connection.close()
        self._open.clear()


_kept: KeptReaders | None = None


def release_kept_readers() -> None:
    """Close the connections a :func:`readers_kept_open` block holds now, before this
    process forks a child that does not exec (SQLite: no open connection may be carried
    across ``fork()``); the block goes on, and its next query opens them again."""
    if _kept is not None:
        _kept.close()


def kept_connections() -> list[sqlite3.Connection]:
    """The connections a :func:`readers_kept_open` block holds now (a power cut must close
    them without a checkpoint: :func:`faultlab.stores.vfs.keep_wal_on_close`)."""
    return [] if _kept is None else _kept.connections()


@contextmanager
def readers_kept_open() -> Iterator[None]:
    """Keep :func:`query`'s connections open until the block ends (then close them all).

    For one trace on one set of stores, in the process that judges it. Not nested: an
    inner block shares the outer one's connections and leaves closing them to it. Not in
    a process that forks children without exec meanwhile (SQLite: an open connection must
    not be carried across fork()), unless it releases them first
    (:func:`release_kept_readers`)."""
    global _kept
    if _kept is not None:
        yield
        return
    _kept = KeptReaders()
    try:
        yield
    finally:
        kept, _kept = _kept, None
        kept.close()

