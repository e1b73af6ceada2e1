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
connection.execute("PRAGMA journal_mode=" + args["journal_mode"])  # rollback modes: per connection
connection.execute("PRAGMA synchronous=" + args["synchronous"])
side = os.open(args["side"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
started = time.perf_counter()
for row in range(args["first"], args["first"] + args["rows"]):
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
        # the child may be writing its last line as we read: only whole lines count
        *lines, _partial = side.read_text(encoding="utf-8").split("\n")
        for line in lines:
            if line.startswith("done "):
                done = json.loads(line[5:])
            elif line.isdigit():
                acked.append(int(line))
    return acked, done


def run_child(directory: Path, *, journal_mode: str, synchronous: str, rows: int = ROWS,
              kill_after: int | None = None, hold: bool = True, use_vfs: bool = True,
              payload: str = "row %d \U0001f600 " + "x" * 100, while_alive: Any = None,
              children: int = 1, first: int = 0, create: bool = True) -> Run:
    """Run ``children`` children at once on one database and one log (child k commits ids
    from ``first + 1000 * k``) until ``kill_after`` acknowledgements in all (None: until all
    are done), then SIGKILL them (with ``hold``; without, let them close and exit)."""
    directory.mkdir(parents=True, exist_ok=True)
    db = make_db(directory, journal_mode) if create else directory / "db.sqlite"
    log = directory / "log"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p])
    sides = [directory / f"side-{first}-{k}" for k in range(children)]
    stderr = directory / f"stderr-{first}"
    processes: list[subprocess.Popen[bytes]] = []
    try:
        with open(stderr, "wb") as errors:
            for k, side in enumerate(sides):
                arguments = {"vfs": use_vfs, "log": str(log), "db": str(db), "side": str(side),
                             "journal_mode": journal_mode,
                             "synchronous": synchronous, "rows": rows, "hold": hold,
                             "payload": payload, "first": first + 1000 * k}
                processes.append(subprocess.Popen(
                    [sys.executable, "-c", CHILD, json.dumps(arguments)],
                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errors,
                    env=env, cwd=directory))
        deadline = time.monotonic() + 120
        while True:
            states = [read_side(side) for side in sides]
            acked_so_far = sum(len(acked) for acked, _ in states)
            if all(done is not None for _, done in states):
                break
            if kill_after is not None and acked_so_far >= kill_after:
                break
            if any(child.poll() is not None for child in processes):
                break
            if time.monotonic() > deadline:
                raise AssertionError("the children made no progress in 120 s")
            time.sleep(0.002)
        if while_alive is not None and all(child.poll() is None for child in processes):
            while_alive(log)
        if hold or kill_after is not None:
            for child in processes:
                child.send_signal(signal.SIGKILL)
        exit_codes = [child.wait(timeout=60) for child in processes]
    finally:
        for child in processes:
            if child.poll() is None:
                child.kill()
                child.wait()
    if any(code not in (0, -signal.SIGKILL) for code in exit_codes):
        raise AssertionError(f"a child failed ({exit_codes}): {stderr.read_text()}")
    states = [read_side(side) for side in sides]
    acked = [row for side_acked, _ in states for row in side_acked]
    return Run(directory=directory, db=db, log=log, acked=acked, done=states[0][1],
               exit_code=exit_codes[0])


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


@pytest.mark.parametrize("synchronous", ["FULL", "NORMAL"])
def test_two_processes_share_one_log(tmp_path: Path, synchronous: str) -> None:
    """Two children commit concurrently to one WAL database, recording into one log (a sync by
    either covers what both wrote before it). FULL loses nothing, NORMAL loses commits; the
    database is intact either way."""
    run = run_child(tmp_path, journal_mode="WAL", synchronous=synchronous, children=2)
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report(f"two processes, WAL {synchronous}, drop_all", run, missing)
    assert len(run.acked) == 2 * ROWS
    if synchronous == "FULL":
        assert missing == []
    else:
        assert len(missing) > 0


def test_a_record_cut_short_by_a_kill_is_skipped(tmp_path: Path) -> None:
    """A SIGKILL can cut a large log record short, and another process then appends after the
    stump: the reader skips the stump (CRC) and the later records still rebuild the files."""
    first = run_child(tmp_path, journal_mode="WAL", synchronous="NORMAL", rows=20)
    log_file = first.log / vfs.LOG_NAME
    stump = log_file.read_bytes()[:60]
    with open(log_file, "ab") as log:
        log.write(stump)
    second = run_child(tmp_path, journal_mode="WAL", synchronous="NORMAL", rows=20, first=20,
                       create=False)
    acked = first.acked + second.acked
    described = vfs.summary(first.log)
    assert described["damaged_bytes"] == len(stump)
    saved = snapshot(tmp_path)
    keep_all = max(option["keep"] for option in vfs.choices(first.log)
                   if option["kind"] == "prefix")
    vfs.power_image(first.log, {"kind": "prefix", "keep": keep_all})
    assert vfs.opens_cleanly(first.db) is None
    assert rows_present(first.db) == set(acked)
    restore(tmp_path, saved)
    result = vfs.power_image(first.log, {"kind": "drop_all"})
    assert result["damaged_log_bytes"] == len(stump)
    assert vfs.opens_cleanly(first.db) is None
    assert rows_present(first.db) == set(), "all 40 NORMAL commits were unsynced"


@pytest.mark.parametrize(("journal_mode", "synchronous"), [
    ("DELETE", "EXTRA"), ("TRUNCATE", "FULL"), ("PERSIST", "FULL"), ("PERSIST", "NORMAL")])
def test_rollback_journal_modes_that_lose_nothing(tmp_path: Path, journal_mode: str,
                                                  synchronous: str) -> None:
    """The rollback-journal settings whose commit point is itself synced lose nothing: DELETE
    + EXTRA syncs the directory after the unlink, TRUNCATE + FULL syncs the truncated journal,
    PERSIST syncs the zeroed journal header unless synchronous=OFF (pager.c)."""
    run = run_child(tmp_path, journal_mode=journal_mode, synchronous=synchronous)
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report(f"{journal_mode} {synchronous}, drop_all", run, missing)
    assert len(run.acked) == ROWS
    assert missing == []


@pytest.mark.parametrize(("journal_mode", "synchronous"), [
    ("DELETE", "NORMAL"), ("TRUNCATE", "NORMAL")])
def test_rollback_journal_modes_that_lose_the_last_commit(tmp_path: Path, journal_mode: str,
                                                          synchronous: str) -> None:
    """Journal and database are synced before the commit returns, but the commit point (the
    unlink; the truncate, synced only under FULL) is not: the journal comes back hot and
    the next open rolls the last commit back, and only it."""
    run = run_child(tmp_path, journal_mode=journal_mode, synchronous=synchronous)
    vfs.power_image(run.log, {"kind": "drop_all"})
    assert vfs.opens_cleanly(run.db) is None
    missing = lost(run)
    report(f"{journal_mode} {synchronous}, drop_all", run, missing)
    assert missing == [run.acked[-1]]


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
    rates: dict[str, list[float]] = {}
    expected = [[row, f"row {row} \U0001f600 " + "x" * 100] for row in range(rows)]
    for round_number in range(3):  # alternate, so a burst of load on the host hits both
        for synchronous in ("FULL", "OFF"):
            for use_vfs in (False, True):
                label = f"{synchronous} {'with' if use_vfs else 'without'} the VFS"
                run = run_child(tmp_path / f"{label.replace(' ', '_')}_{round_number}",
                                journal_mode="WAL", synchronous=synchronous, rows=rows,
                                hold=False, use_vfs=use_vfs)
                assert run.exit_code == 0 and run.done is not None
                assert run.done["read"] == expected
                with closing(sqlite3.connect(run.db)) as connection:
                    query = "SELECT id, payload FROM t ORDER BY id"
                    read = [list(r) for r in connection.execute(query)]
                assert read == expected
                rates.setdefault(label, []).append(rows / run.done["elapsed"])
                if use_vfs and synchronous == "FULL":
                    files = vfs.summary(run.log)["files"]
                    wal = files[str(run.db) + "-wal"]
                    assert wal["unsynced"] == 1, "the WAL's unlink at close is not dir-synced"
                    assert files[str(run.db)]["unsynced"] == 0, "the checkpoint synced the db"
                    vfs.power_image(run.log, {"kind": "drop_all"})
                    assert (run.db.parent / "db.sqlite-wal").exists(), "the unlink was undone"
                    assert vfs.opens_cleanly(run.db) is None
                    assert lost(run) == []
                elif not use_vfs:
                    assert not (run.log / vfs.LOG_NAME).exists()
    medians = {label: sorted(values)[1] for label, values in rates.items()}
    print("\ncommits/s (WAL, one row each, median of 3): "
          + ", ".join(f"{label}: {rate:.0f}" for label, rate in medians.items()))
    for synchronous in ("FULL", "OFF"):
        without = medians[f"{synchronous} without the VFS"]
        with_vfs = medians[f"{synchronous} with the VFS"]
        print(f"{synchronous}: {1e6 / with_vfs - 1e6 / without:+.0f} us per commit with the VFS")


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


PREPARED_CHILD = r"""
import json, os, resource, sqlite3, sys
from faultlab.run import worker
from faultlab.stores import vfs
worker.prepare_lanes("reference", "power")  # the lanes' helper's image; the fork server's too
log = sys.argv[1]
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # a recording worker, as the helper or the fork server forks it
    vfs.install(log)
    with sqlite3.connect(os.path.join(log, "db.sqlite")) as connection:
        connection.execute("CREATE TABLE t (id INTEGER)")
    started = resource.getrusage(resource.RUSAGE_CHILDREN)
    os.write(write, json.dumps({
        "children_faults": started.ru_minflt,
        "library": vfs.installed_library(),
        "extension": sys.modules["_sqlite3"].__file__,
    }).encode())
    os._exit(0)
os.close(write)
report = os.read(read, 65536)
_, status = os.waitpid(pid, 0)
print(report.decode() if status == 0 else "the worker failed")
"""


def test_a_recording_worker_forked_from_a_prepared_image_starts_no_program(
        tmp_path: Path) -> None:
    """A worker forked from the fork server's or the lanes' helper's image installs the VFS
    on the SQLite its image loaded: the copy the sqlite3 module links, found without a
    search. Each used to look the library up by name, which runs ``ldconfig`` (about 3 ms
    a recording worker); a program it started and waited for shows in its children's
    page faults."""
    result = subprocess.run([sys.executable, "-c", PREPARED_CHILD, str(tmp_path)],
                            capture_output=True, text=True, cwd=ROOT, timeout=60,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    assert report["children_faults"] == 0, "the recording worker started a program"
    assert report["library"] == report["extension"]
    assert (tmp_path / vfs.LOG_NAME).stat().st_size > 0, "the worker's commit was recorded"
