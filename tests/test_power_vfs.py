"""The recording VFS turns a SIGKILL into a power cut: real child processes, real SQLite files.

Each test runs a child (``python -c``) that installs :mod:`faultlab.stores.vfs`, commits rows
one by one in autocommit mode and appends the id of each acknowledged commit to a side file
(plain ``os.write``, so the acknowledgement survives the SIGKILL like the page cache does).
The child is killed, :func:`vfs.power_image` rebuilds the files as a power cut would leave
them, and this process (which never installs the VFS) opens the database with plain
:mod:`sqlite3` and counts. ``synchronous=FULL`` in WAL mode must lose nothing; NORMAL and OFF
must lose acknowledged commits (the negative controls: the check can fail).
"""

from __future__ import annotations

import json
import os
import random
import signal
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from faultlab.stores import vfs

ROOT = Path(__file__).resolve().parent.parent
ROWS = 50

CHILD = r"""
import json, os, sqlite3, sys, time
args = json.loads(sys.argv[1])
if args["vfs"]:
    from faultlab.stores import vfs
    vfs.install(args["log"])
connection = sqlite3.connect(args["db"], isolation_level=None)
connection.execute("PRAGMA synchronous=" + args["synchronous"])
side = os.open(args["side"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
started = time.perf_counter()
for row in range(args["rows"]):
    connection.execute("INSERT INTO t (id, payload) VALUES (?, ?)", (row, args["payload"] % row))
    os.write(side, b"%d\n" % row)
elapsed = time.perf_counter() - started
read = [list(r) for r in connection.execute("SELECT id, payload FROM t ORDER BY id")]
os.write(side, ("done " + json.dumps({"elapsed": elapsed, "read": read}) + "\n").encode())
if args["hold"]:
    time.sleep(120)
connection.close()
"""


@dataclass
class Run:
    """One child's run: where its files are and what it acknowledged."""

    directory: Path
    db: Path
    log: Path
    acked: list[int]
    done: dict[str, Any] | None
    exit_code: int


def make_db(directory: Path, journal_mode: str) -> Path:
    """Create the database and its table with plain sqlite3: durable before the child runs."""
    db = directory / "db.sqlite"
    with closing(sqlite3.connect(db)) as connection:
        connection.execute(f"PRAGMA journal_mode={journal_mode}")
        connection.execute("CREATE TABLE t (id INTEGER PRIMARY KEY, payload TEXT NOT NULL)")
        connection.commit()
    return db


def read_side(side: Path) -> tuple[list[int], dict[str, Any] | None]:
    acked: list[int] = []
    done: dict[str, Any] | None = None
    if side.exists():
        for line in side.read_text(encoding="utf-8").splitlines():
            if line.startswith("done "):
                done = json.loads(line[5:])
            elif line.isdigit():
                acked.append(int(line))
    return acked, done


def run_child(directory: Path, *, journal_mode: str, synchronous: str, rows: int = ROWS,
              kill_after: int | None = None, hold: bool = True, use_vfs: bool = True,
              payload: str = "row %d \U0001f600 " + "x" * 100,
              while_alive: Any = None) -> Run:
    """Run one child to ``kill_after`` acknowledgements (None: to the end), then SIGKILL it
    (with ``hold``; without, let it close its connection and exit)."""
    directory.mkdir(parents=True, exist_ok=True)
    db = make_db(directory, journal_mode)
    side = directory / "side"
    log = directory / "log"
    arguments = {"vfs": use_vfs, "log": str(log), "db": str(db), "synchronous": synchronous,
                 "side": str(side), "rows": rows, "hold": hold, "payload": payload}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    stderr = directory / "stderr"
    with open(stderr, "wb") as errors:
        child = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(arguments)],
                                 stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                 stderr=errors, env=env, cwd=directory)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            acked, done = read_side(side)
            if done is not None or (kill_after is not None and len(acked) >= kill_after):
                break
            if child.poll() is not None:
                break
            time.sleep(0.002)
        else:
            raise AssertionError("the child made no progress in 120 s")
        if while_alive is not None and child.poll() is None:
            while_alive(log)
        if hold or kill_after is not None:
            child.send_signal(signal.SIGKILL)
        exit_code = child.wait(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    acked, done = read_side(side)
    if exit_code not in (0, -signal.SIGKILL):
        raise AssertionError(f"child failed ({exit_code}): {stderr.read_text()}")
    return Run(directory=directory, db=db, log=log, acked=acked, done=done,
               exit_code=exit_code)


def rows_present(db: Path) -> set[int]:
    with closing(sqlite3.connect(db)) as connection:
        return {row for (row,) in connection.execute("SELECT id FROM t")}


def lost(run: Run) -> list[int]:
    present = rows_present(run.db)
    return [row for row in run.acked if row not in present]


def snapshot(directory: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in directory.rglob("*") if path.is_file()}


def restore(directory: Path, saved: dict[Path, bytes]) -> None:
    """Put the recorded run back (files, -shm, log) so another choice can be tried on it."""
    for path in directory.rglob("*"):
        if path.is_file() and path not in saved:
            path.unlink()
    for path, content in saved.items():
        path.write_bytes(content)


def report(label: str, run: Run, missing: list[int], extra: str = "") -> None:
    print(f"\n{label}: {len(run.acked)} acknowledged, {len(missing)} lost "
          f"(exit {run.exit_code}){extra}")


@pytest.fixture
def rng() -> Iterator[random.Random]:
    seed = 20240607
    print(f"\nseed {seed}")
    yield random.Random(seed)


def test_wal_full_loses_no_acknowledged_commit(tmp_path: Path, rng: random.Random) -> None:
    """WAL + synchronous=FULL syncs the WAL at every commit: a power cut at a random moment
    loses nothing that was acknowledged, and the database is intact."""
    refused: list[str] = []

    def power_image_while_alive(log: Path) -> None:
        try:
            vfs.power_image(log, {"kind": "drop_all"})
        except vfs.RecorderBusy as error:
            refused.append(str(error))

    total = 0
    for attempt in range(3):
        moment = rng.randint(1, ROWS)
        run = run_child(tmp_path / f"run{attempt}", journal_mode="WAL", synchronous="FULL",
                        kill_after=moment, while_alive=power_image_while_alive)
        before = vfs.summary(run.log)
        done = vfs.power_image(run.log, {"kind": "drop_all"})
        assert vfs.opens_cleanly(run.db) is None
        missing = lost(run)
        report(f"WAL FULL, killed after {moment} acks", run, missing,
               f"; unsynced changes at the cut: "
               f"{sum(f['unsynced'] for f in before['files'].values())}")
        assert missing == []
        assert run.acked, "the child acknowledged nothing: the test tested nothing"
        assert done["files"], "nothing was recorded: the VFS did not take effect"
        total += len(run.acked)
    assert refused, "power_image must refuse while the recording child is alive"
    assert total >= 3


def test_wal_normal_loses_acknowledged_commits(tmp_path: Path) -> None:
    """Negative control: WAL + synchronous=NORMAL does not sync the WAL at commit, so a power
    cut loses acknowledged commits (the database stays consistent: WAL frames are checksummed).
    Keeping every unsynced write is the process-crash outcome: nothing lost."""
    run = run_child(tmp_path, journal_mode="WAL", synchronous="NORMAL")
    saved = snapshot(tmp_path)
    options = vfs.choices(run.log)
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report("WAL NORMAL, drop_all", run, missing, f"; {len(options)} choices")
    assert len(run.acked) == ROWS
    assert len(missing) > 0

    restore(tmp_path, saved)
    keep_all = max(option["keep"] for option in options if option["kind"] == "prefix")
    vfs.power_image(run.log, {"kind": "prefix", "keep": keep_all})
    assert vfs.opens_cleanly(run.db) is None
    assert lost(run) == []

    restore(tmp_path, saved)
    vfs.power_image(run.log, {"kind": "prefix", "keep": keep_all // 2})
    assert vfs.opens_cleanly(run.db) is None
    half = lost(run)
    print(f"prefix keep={keep_all // 2} of {keep_all}: {len(half)} lost")
    assert 0 < len(half) < len(missing)


def test_rollback_journal_extra_loses_nothing(tmp_path: Path) -> None:
    """DELETE mode + synchronous=EXTRA: the journal's unlink is followed by a directory sync,
    so even the last commit survives."""
    run = run_child(tmp_path, journal_mode="DELETE", synchronous="EXTRA")
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report("DELETE EXTRA, drop_all", run, missing)
    assert len(run.acked) == ROWS
    assert missing == []


@pytest.mark.parametrize("kill_after", [None, 17, 33])
def test_rollback_journal_full_loses_at_most_the_last_commit(tmp_path: Path,
                                                             kill_after: int | None) -> None:
    """DELETE mode + synchronous=FULL syncs journal and database before the commit returns,
    but commits by unlinking the journal without syncing the directory (SQLite documents
    this: EXTRA adds that sync). A power cut can bring the journal back; the next open rolls
    the last commit back. Earlier commits are safe: the next transaction's first journal sync
    also syncs the directory. The database is intact either way."""
    run = run_child(tmp_path, journal_mode="DELETE", synchronous="FULL", kill_after=kill_after)
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report(f"DELETE FULL, killed after {kill_after or 'all'} acks", run, missing)
    assert run.acked
    assert missing in ([], [run.acked[-1]])
    if kill_after is None:
        assert missing == [run.acked[-1]], "the last commit's unlink was not dir-synced"


@pytest.mark.parametrize("journal_mode", ["WAL", "DELETE"])
def test_synchronous_off_loses_rows(tmp_path: Path, journal_mode: str) -> None:
    """Negative control: synchronous=OFF syncs nothing; a power cut loses every commit."""
    run = run_child(tmp_path, journal_mode=journal_mode, synchronous="OFF")
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report(f"{journal_mode} OFF, drop_all", run, missing)
    assert len(run.acked) == ROWS
    assert len(missing) > 0


def test_torn_and_reordered_writes_give_a_clean_db_or_a_clear_error(tmp_path: Path) -> None:
    """A torn or reordered write either leaves a database that opens and passes
    integrity_check or one that fails with a sqlite3.DatabaseError, reported as text by
    opens_cleanly. With a rollback journal and synchronous=OFF some outcomes are corrupt
    (detected); in WAL mode the frame checksums keep every outcome clean."""
    outcomes: dict[str, dict[str, int]] = {}
    for journal_mode in ("WAL", "DELETE"):
        directory = tmp_path / journal_mode
        run = run_child(directory, journal_mode=journal_mode,
                        synchronous="NORMAL" if journal_mode == "WAL" else "OFF")
        saved = snapshot(directory)
        options = [option for option in vfs.choices(run.log)
                   if option["kind"] in ("torn", "reorder")]
        assert any(option["kind"] == "torn" for option in options)
        counts = {"clean": 0, "corrupt": 0}
        for option in options[:: max(1, len(options) // 40)]:
            restore(directory, saved)
            vfs.power_image(run.log, option)
            outcome = vfs.opens_cleanly(run.db)
            if outcome is None:
                counts["clean"] += 1
                rows_present(run.db)
            else:
                assert isinstance(outcome, str) and outcome
                counts["corrupt"] += 1
        outcomes[journal_mode] = counts
    print(f"\ntorn/reorder outcomes: {outcomes}")
    assert outcomes["WAL"]["corrupt"] == 0
    assert outcomes["WAL"]["clean"] > 0
    assert outcomes["DELETE"]["corrupt"] > 0, "no corrupt outcome: the model tears nothing"
    assert outcomes["DELETE"]["clean"] > 0


def test_opens_cleanly_reports_damage(tmp_path: Path) -> None:
    """Negative control for the checker itself: a damaged or missing file is reported."""
    db = make_db(tmp_path, "DELETE")
    with closing(sqlite3.connect(db)) as connection:
        connection.executemany("INSERT INTO t VALUES (?, ?)", [(i, "y" * 500) for i in range(50)])
        connection.commit()
    assert vfs.opens_cleanly(db) is None
    assert vfs.opens_cleanly(tmp_path / "absent.sqlite") is not None
    assert not (tmp_path / "absent.sqlite").exists()
    damaged = bytearray(db.read_bytes())
    damaged[4096 + 8:4096 + 64] = b"\xff" * 56  # page 2: the table's root, now garbage
    db.write_bytes(bytes(damaged))
    message = vfs.opens_cleanly(db)
    print(f"\ndamaged page: {message}")
    assert message is not None
    db.write_bytes(b"not a database" * 100)
    message = vfs.opens_cleanly(db)
    assert message is not None and "DatabaseError" in message


def test_vfs_is_transparent_and_cheap(tmp_path: Path) -> None:
    """With the VFS a process reads back exactly what it wrote, and so does a plain process
    afterwards; a clean exit (checkpoint, WAL deleted without a directory sync) followed by a
    power cut loses nothing in FULL. The cost is printed, not asserted (shared machine)."""
    rows = 200
    rates: dict[str, float] = {}
    for synchronous in ("FULL", "OFF"):
        for use_vfs in (False, True):
            label = f"{synchronous} {'with' if use_vfs else 'without'} the VFS"
            run = run_child(tmp_path / label.replace(" ", "_"), journal_mode="WAL",
                            synchronous=synchronous, rows=rows, hold=False, use_vfs=use_vfs)
            assert run.exit_code == 0 and run.done is not None
            expected = [[row, f"row {row} \U0001f600 " + "x" * 100] for row in range(rows)]
            assert run.done["read"] == expected
            with closing(sqlite3.connect(run.db)) as connection:
                query = "SELECT id, payload FROM t ORDER BY id"
                read = [list(r) for r in connection.execute(query)]
            assert read == expected
            rates[label] = rows / run.done["elapsed"]
            if use_vfs:
                assert vfs.summary(run.log)["records"] > 0
                if synchronous == "FULL":
                    vfs.power_image(run.log, {"kind": "drop_all"})
                    assert vfs.opens_cleanly(run.db) is None
                    assert lost(run) == []
    print("\ncommits/s (WAL, one row each): "
          + ", ".join(f"{label}: {rate:.0f}" for label, rate in rates.items()))


def test_choices_are_plain_data_and_validated(tmp_path: Path) -> None:
    """Choices round-trip through JSON, every listed one applies, and malformed ones are
    refused (a typo in a stored trace must not silently mean drop_all)."""
    run = run_child(tmp_path, journal_mode="WAL", synchronous="NORMAL", rows=10)
    options = vfs.choices(run.log)
    assert json.loads(json.dumps(options)) == options
    assert options[0] == {"kind": "drop_all"}
    assert {option["kind"] for option in options} == {"drop_all", "prefix", "torn", "reorder"}
    assert len({json.dumps(option, sort_keys=True) for option in options}) == len(options)
    described = vfs.summary(run.log)
    print(f"\nsummary after 10 NORMAL commits: {json.dumps(described)}")
    (wal,) = described["files"].values()
    assert wal["unsynced_writes"] > 0 and wal["unsynced_bytes"] > 0
    for bad in ({"kind": "drop_some"}, {"kind": "prefix"}, {"kind": "prefix", "keep": -1},
                {"kind": "prefix", "keep": True}, {"kind": "reorder", "drop": 1, "keep": 2},
                {"kind": "torn", "keep": 1, "sector": 0}, {}):
        with pytest.raises(ValueError):
            vfs.power_image(run.log, bad)
    saved = snapshot(tmp_path)
    for option in options:
        restore(tmp_path, saved)
        vfs.power_image(run.log, option)
        assert vfs.opens_cleanly(run.db) is None
    assert vfs.choices(run.log) == [{"kind": "drop_all"}], "power_image clears the log"
