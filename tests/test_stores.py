"""Stores: faultlab's marker, refusing foreign files, snapshots, canonical payloads."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from faultlab.base.canonical import canonical_json, parse_payload
from faultlab.base.errors import UsageError
from faultlab.stores.sqlite import (
    APPLICATION_ID,
    Operation,
    OutboxRow,
    Receipt,
    Snapshot,
    StoreError,
    Ticket,
    connect,
    initialise,
    query,
    readers_kept_open,
)
from faultlab.system import System

SPEC_COLUMNS = {
    "caller.sqlite": {
        "operations": ["id", "payload", "state", "result"],
        "outbox": ["operation_id", "state"],
    },
    "downstream.sqlite": {
        "tickets": ["id", "operation_id", "payload"],
        "receipts": ["operation_id", "payload", "result"],
    },
}
#: What the reference adds to the spec's tables so several dispatchers can run at once: a
#: fencing token and a lease per outbox row. Snapshots never show them.
CLAIM_COLUMNS = {"outbox": ["attempt", "lease_until"]}


def test_reference_stores_have_the_specs_tables_and_marker(
    tmp_path: Path, reference: System,
) -> None:
    reference.initialise(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["caller.sqlite", "downstream.sqlite"]
    for filename, tables in SPEC_COLUMNS.items():
        connection = sqlite3.connect(tmp_path / filename)
        try:
            assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
            names = {row[0] for row in connection.execute(
                "SELECT name FROM sqlite_master WHERE type = 'table'")}
            assert names == set(tables)
            for table, columns in tables.items():
                info = connection.execute(f"PRAGMA table_info({table})").fetchall()
                assert [row[1] for row in info] == columns + CLAIM_COLUMNS.get(table, [])
        finally:
            connection.close()
    assert reference.snapshot(tmp_path) == Snapshot()


def test_initialise_refuses_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "caller.sqlite"
    path.write_bytes(b"precious")
    with pytest.raises(StoreError, match="already exists"):
        initialise(path, "CREATE TABLE t (x)")
    assert path.read_bytes() == b"precious"


def test_connect_opens_a_faultlab_store_in_autocommit_with_extra_sync(tmp_path: Path) -> None:
    path = tmp_path / "s.sqlite"
    initialise(path, "CREATE TABLE t (x)")
    connection = connect(path)
    try:
        assert connection.isolation_level is None
        # EXTRA: with a rollback journal, FULL loses the last commit on a power cut
        assert connection.execute("PRAGMA synchronous").fetchone()[0] == 3  # EXTRA
        connection.execute("BEGIN IMMEDIATE")
        connection.execute("INSERT INTO t VALUES (1)")
        connection.execute("COMMIT")
    finally:
        connection.close()


def test_connect_refuses_missing_foreign_and_garbage_files(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such store"):
        connect(tmp_path / "missing.sqlite")
    assert list(tmp_path.iterdir()) == []

    foreign = tmp_path / "foreign.sqlite"
    connection = sqlite3.connect(foreign)
    connection.execute("CREATE TABLE operations (id TEXT)")
    connection.commit()
    connection.close()
    garbage = tmp_path / "garbage.sqlite"
    garbage.write_bytes(b"not a database at all\n" * 100)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    with pytest.raises(StoreError, match="not initialised by faultlab"):
        connect(foreign)
    with pytest.raises(StoreError, match="not an SQLite database"):
        connect(garbage)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_store_locked_past_the_busy_timeout_is_said_to_be_locked(tmp_path: Path) -> None:
    """Not "not an SQLite database": a process holds its lock (another connection's
    exclusive transaction here), and the message says so."""
    store = tmp_path / "caller.sqlite"
    initialise(store, "CREATE TABLE t (x INTEGER)")
    holder = sqlite3.connect(store, isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        with pytest.raises(StoreError, match=r"cannot be read: database is locked \(a process "
                                             r"holds its lock past the 0.1 s busy timeout\)"):
            connect(store, timeout=0.1)
    finally:
        holder.close()
    connect(store, timeout=0.1).close()  # released: it opens


def test_a_snapshot_writes_nothing(tmp_path: Path, reference: System) -> None:
    reference.initialise(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    reference.snapshot(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_snapshot_order_is_stable_and_json_round_trips() -> None:
    snapshot = Snapshot.from_rows({
        "operations": [("b", "{}", "pending", None), ("a", "{}", "complete", '{"ticket_id":10}')],
        "outbox": [("b", "pending"), ("a", "complete")],
        "tickets": [(10, "a", "{}"), (9, "b", "{}")],
        "receipts": [("b", "{}", '{"ticket_id":9}'), ("a", "{}", '{"ticket_id":10}')],
    })
    assert [o.id for o in snapshot.operations] == ["a", "b"]
    assert [t.id for t in snapshot.tickets] == [9, 10]  # numeric, not "10" < "9"
    assert snapshot.operation("a") == Operation("a", "{}", "complete", '{"ticket_id":10}')
    assert snapshot.outbox_row("b") == OutboxRow("b", "pending")
    assert snapshot.tickets_for("a") == [Ticket(10, "a", "{}")]
    assert snapshot.receipt("b") == Receipt("b", "{}", '{"ticket_id":9}')
    assert snapshot.pending_outbox() == [OutboxRow("b", "pending")]
    assert snapshot.counts() == {
        "operations_pending": 1, "operations_complete": 1, "outbox_pending": 1,
        "outbox_complete": 1, "tickets": 2, "receipts": 2,
    }
    assert Snapshot.from_json(snapshot.to_json()) == snapshot
    assert list(snapshot.to_json()) == ["operations", "outbox", "tickets", "receipts"]


def test_canonical_json_is_the_specs() -> None:
    payload = {"title": "t", "priority": "normal", "project": "p"}
    assert canonical_json(payload) == '{"priority":"normal","project":"p","title":"t"}'
    assert parse_payload('{ "title" : "t", "project": "p",\n "priority": "normal" }') == (
        canonical_json(payload)
    )
    with pytest.raises(ValueError):
        canonical_json(float("nan"))
    for bad in ("NaN", "[Infinity]", "{", "1e999"):
        with pytest.raises(UsageError, match="not valid JSON"):
            parse_payload(bad)


@pytest.mark.parametrize("name", ["plain", "with space", "q?mark", "hash#tag", "per%cent", "ünï"])
def test_stores_open_by_uri_whatever_the_directory_is_called(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """faultlab builds its SQLite URIs itself; characters a URI treats specially
    must reach the file system as they are, absolute or relative."""
    directory = tmp_path / name
    directory.mkdir()
    initialise(directory / "store.sqlite", "CREATE TABLE t (a INTEGER)")
    assert sorted(p.name for p in directory.iterdir()) == ["store.sqlite"]
    monkeypatch.chdir(tmp_path)
    for path in (directory / "store.sqlite", Path(name) / "store.sqlite"):
        connection = connect(path)
        try:
            assert connection.execute("PRAGMA application_id").fetchone()[0] == APPLICATION_ID
        finally:
            connection.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == [name]


def _open_descriptors() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")
def test_kept_readers_see_every_commit_reopen_a_replaced_store_and_close(
    tmp_path: Path,
) -> None:
    """Inside readers_kept_open one connection serves every snapshot of a store: it sees
    what another process committed since, a store replaced at the same path is read
    anew (not the deleted file), and the block's end closes every connection."""
    store = tmp_path / "s.sqlite"
    initialise(store, "CREATE TABLE t (v INTEGER)")
    ask = {"t": "SELECT v FROM t ORDER BY v"}
    before = _open_descriptors()
    with readers_kept_open():
        assert query(store, ask) == {"t": []}
        kept = _open_descriptors() - before
        assert kept  # the connection (and its file) stays open between queries
        subprocess.run([sys.executable, "-c", (
            "import sqlite3, sys; c = sqlite3.connect(sys.argv[1], isolation_level=None); "
            "c.execute('INSERT INTO t VALUES (7)')"), str(store)], check=True)
        assert query(store, ask) == {"t": [(7,)]}  # another process's commit
        assert _open_descriptors() - before == kept  # and no second connection
        store.unlink()
        initialise(store, "CREATE TABLE t (v INTEGER)")  # same path, a new file: empty
        assert query(store, ask) == {"t": []}
    assert _open_descriptors() <= before | {"listing"}
    assert query(store, ask) == {"t": []}  # outside a block: opened and closed each time
    assert _open_descriptors() <= before | {"listing"}
