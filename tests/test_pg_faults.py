"""Server faults on faultlab's private PostgreSQL server: ``server_crash`` steps (the whole
server SIGKILLed between two steps, then restarted through crash recovery) and the mutant
only they catch, ``async-commit-pg``.

Against real servers only: skipped with the reason when this machine cannot start a
private server (see tests/test_pgserver.py), failed instead when FAULTLAB_REQUIRE_SERVICES
names ``postgres``. The shared server on 5432, when there is one, is only ever read, to
show it was not touched. FAULTLAB_SLOW_TESTS=1 replays 20 times instead of 3.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, require_private_postgres

from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.run.observation import Execution
from faultlab.stores import pgserver
from faultlab.stores import postgres as pgstores
from faultlab.stores.pgserver import PrivateServer
from faultlab.system import load_system
from faultlab.trace import DROP_CONNECTION, SERVER_CRASH, Step, Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

PAYLOAD = {"title": "invoice", "count": 3}
REPLAYS = 20 if os.environ.get("FAULTLAB_SLOW_TESTS") else 3


def _require() -> None:
    require_private_postgres()


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    with capsys.disabled():
        print(f"\n[pg-faults] {line}")


def _shared_start_time() -> Any:
    """The shared server's start time, or None when there is none to compare with."""
    import psycopg

    try:
        with psycopg.connect(os.environ.get("FAULTLAB_TEST_POSTGRES", ""), dbname="postgres",
                             autocommit=True, connect_timeout=3) as connection:
            row = connection.execute("SELECT pg_postmaster_start_time()").fetchone()
    except psycopg.OperationalError:
        return None
    return row[0] if row else None


@pytest.fixture(scope="module")
def private() -> Iterator[PrivateServer]:
    """One private server for the module's in-process tests, the stores configured on it;
    afterwards the run is closed, the server stopped, its directory gone, and the shared
    server (if any) still the one that was running before."""
    _require()
    shared = _shared_start_time()
    server = PrivateServer()
    try:
        server.start()
        pgstores.configure(server.conninfo, server=server)
        yield server
    finally:
        pgstores.close_run()
        pgstores.configure(None)
        directory = server.directory
        server.stop()
    assert directory is None or not directory.exists()
    assert shared is None or _shared_start_time() == shared


def _outcome(execution: Execution) -> list[Any]:
    """What must replay identically: each step's stores, violations and exit status."""
    return [(o.step, o.phase, o.snapshot, o.violations, o.record.exit_code)
            for o in execution.observations] + [execution.final_violations]


def test_a_server_crash_loses_nothing_of_reference_pg_and_replays_identically(
        private: PrivateServer, fork_spawner: Spawner, capsys: pytest.CaptureFixture[str],
) -> None:
    system = load_system("reference-pg")
    steps = [Step("accept", "op-1", PAYLOAD), Step(SERVER_CRASH), Step("dispatch"),
             Step(SERVER_CRASH), Step("accept", "op-2", PAYLOAD), Step(SERVER_CRASH)]
    first = execute(system, steps, fork_spawner, settle=True)
    assert first.verdict.clean, first.violations
    assert [o.snapshot.counts()["operations_complete"] for o in first.observations][:4] \
        == [0, 0, 1, 1]
    began = time.monotonic()
    for _ in range(REPLAYS):
        assert _outcome(execute(system, steps, fork_spawner, settle=True)) == _outcome(first)
    per_trace = (time.monotonic() - began) / REPLAYS
    crashes = sorted(pgstores.crash_server() for _ in range(5))
    _report(capsys, f"{REPLAYS} replays identical; {per_trace:.2f} s per 6-step trace with 3 "
                    f"server crashes; a server_crash (SIGKILL, restart, crash recovery, "
                    f"connections reopened) median {crashes[2]:.3f} s, worst {crashes[-1]:.3f} s")


def test_async_commit_pg_loses_an_acknowledged_acceptance_to_a_server_crash(
        private: PrivateServer, fork_spawner: Spawner,
) -> None:
    mutant = load_system("async-commit-pg")
    minimal = list(mutant.minimal_trace)  # type: ignore[attr-defined]
    found = execute(mutant, minimal, fork_spawner, settle=True)
    assert found.verdict.step == 2
    assert set(found.verdict.invariants) == set(mutant.caught_by)
    # the same steps lose nothing with synchronous commits, and nothing without the crash
    assert execute(load_system("reference-pg"), minimal, fork_spawner, settle=True).verdict.clean
    assert execute(mutant, minimal[:1], fork_spawner, settle=True).verdict.clean


def test_a_server_crash_under_live_lanes_replays_identically(private: PrivateServer) -> None:
    """Lane 2 holds inside its claim transaction when the server dies: its worker lives
    on, meets the dead connection when released (an undeclared error, exit 70), and lane
    1's fresh dispatcher completes the entry the crash rolled back."""
    from faultlab.run.executor import execute

    system = load_system("reference-pg")
    steps = [Step("accept", "op-1", PAYLOAD, lane=1), Step("dispatch", lane=2, hold=True),
             Step(SERVER_CRASH), Step("finish", lane=2), Step("dispatch", lane=1)]

    def outcome() -> list[Any]:
        execution = execute(system, steps, concurrency=2, settle=True)
        return [(o.step, o.lanes, o.snapshot, o.violations,
                 tuple(record.exit_code for _, record in o.exited))
                for o in execution.observations] + [execution.final_violations]

    first = outcome()
    assert first[3][1][1] == "exit 70" and first[4][2].counts()["operations_complete"] == 1
    assert not any(row[3] for row in first[:-1]) and first[-1] == []
    for _ in range(REPLAYS):
        assert outcome() == first


def _lane_outcome(system_name: str, steps: list[Step]) -> list[Any]:
    from faultlab.run.executor import execute

    execution = execute(load_system(system_name), steps, concurrency=2, settle=True)
    return [(o.step, o.lanes, o.snapshot, o.violations,
             tuple(record.exit_code for _, record in o.exited))
            for o in execution.observations] + [execution.final_violations]


def test_a_dropped_connection_replays_identically_and_reference_pg_survives_it(
        private: PrivateServer) -> None:
    """Lane 1 holds inside its claim transaction when the server ends its session: the
    claim rolls back, lane 2 claims and completes, lane 1 meets its dead connection."""
    steps = [Step("accept", "op-1", PAYLOAD, lane=1), Step("dispatch", lane=1, hold=True),
             Step(DROP_CONNECTION, lane=1), Step("dispatch", lane=2),
             Step("finish", lane=1)]
    first = _lane_outcome("reference-pg", steps)
    assert first[3][2].counts()["operations_complete"] == 1
    assert first[4][1][0] == "exit 70"  # AdminShutdown at its next statement: undeclared
    assert not any(row[3] for row in first[:-1]) and first[-1] == []
    for _ in range(REPLAYS):
        assert _lane_outcome("reference-pg", steps) == first


def test_advisory_lock_pg_runs_one_job_twice_after_a_dropped_connection(
        private: PrivateServer) -> None:
    mutant = load_system("advisory-lock-pg")
    minimal = list(mutant.minimal_trace)  # type: ignore[attr-defined]
    found = _lane_outcome("advisory-lock-pg", minimal)
    assert [v.invariant for v in found[3][3]] == ["EXCL"]
    assert not any(row[3] for row in found[:3])
    assert not any(row[3] for row in _lane_outcome("reference-pg", minimal)[:-1])
    without_drop = [step for step in minimal if step.action != DROP_CONNECTION]
    assert not any(row[3] for row in _lane_outcome("advisory-lock-pg", without_drop)[:-1])
    # its one defect: a second relay skips the entry another session's lock holds and
    # takes only a later entry of another key, as reference-pg does (it took op-2 of the
    # same key once, breaking per-key order: ORDER without any dropped connection)
    overtaking = [Step("accept", "op-1", PAYLOAD, lane=2), Step("dispatch", lane=1, hold=True),
                  Step("accept", "op-2", PAYLOAD, lane=2), Step("dispatch", lane=2)]
    outcome = _lane_outcome("advisory-lock-pg", overtaking)
    assert not any(row[3] for row in outcome[:-1]) and not outcome[-1]


def test_the_machine_draws_server_crashes_only_on_a_private_server(
        private: PrivateServer) -> None:
    from faultlab.search.machine import outbox_machine
    from faultlab.search.schedules import concurrent_machine

    assert hasattr(outbox_machine("reference-pg"), "server_crash")
    assert hasattr(concurrent_machine("reference-pg", concurrency=2), "server_crash")
    assert hasattr(concurrent_machine("reference-pg", concurrency=2), "drop_connection")
    # and may open an example with a claim whose session the server ends
    assert "sever" in concurrent_machine("reference-pg", concurrency=2).openings
    assert "sever" not in concurrent_machine("reference", concurrency=2).openings
    assert not hasattr(outbox_machine("reference"), "server_crash")  # SQLite stores
    pgstores.close_run()
    pgstores.configure(None)
    try:
        assert not hasattr(outbox_machine("reference-pg"), "server_crash")
        assert not hasattr(concurrent_machine("reference-pg", concurrency=2), "server_crash")
        assert not hasattr(concurrent_machine("reference-pg", concurrency=2),
                           "drop_connection")
        assert "sever" not in concurrent_machine("reference-pg", concurrency=2).openings
    finally:
        pgstores.configure(private.conninfo, server=private)


# -- the command line ------------------------------------------------------------------------

def _faultlab(*args: str, cwd: Path, timeout: float = 600,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _left_behind(pid: int) -> list[str]:
    """Server directories (socket and data inside) a faultlab process left."""
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path("/tmp")
    return sorted(str(path) for path in base.glob(f"{pgserver.DIRECTORY_PREFIX}{pid}-*"))


def _trace_file(tmp_path: Path, system: str, steps: list[Step]) -> Path:
    path = tmp_path / f"{system}.json"
    path.write_text(json.dumps(Trace(system, True, steps).to_json()), encoding="utf-8")
    return path


def test_a_server_crash_is_refused_without_a_private_server(tmp_path: Path) -> None:
    path = _trace_file(tmp_path, "reference-pg", [Step("accept", "op-1", PAYLOAD),
                                                   Step(SERVER_CRASH)])
    done = _faultlab("replay", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--postgres private" in lines[0]


def test_a_dropped_connection_is_refused_without_a_private_server(tmp_path: Path) -> None:
    trace = Trace(system="reference-pg", deduplication=True, concurrency=2, steps=[
        Step("dispatch", lane=1, hold=True), Step(DROP_CONNECTION, lane=1)])
    path = tmp_path / "drop.json"
    path.write_text(json.dumps(trace.to_json()), encoding="utf-8")
    done = _faultlab("replay", str(path), cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "drop_connection" in lines[0] and "--postgres private" in lines[0]


def test_a_power_cut_of_postgres_stores_is_refused_not_run(tmp_path: Path) -> None:
    """A power step rebuilds the SQLite files faultlab recorded: on a system whose stores
    are on a server it would cut nothing, and DURABLE would pass untested (an exploration
    would call itself clean with DURABLE checked after every such cut). Refused with one
    line, as a replay and as an exploration, before anything is made."""
    path = _trace_file(tmp_path, "reference-pg", [Step("accept", "op-1", PAYLOAD),
                                                   Step.power({"kind": "drop_all"})])
    laned = tmp_path / "laned.json"
    laned.write_text(json.dumps(Trace(
        system="reference-pg", deduplication=True, concurrency=2,
        steps=[Step("accept", "op-1", PAYLOAD, lane=1), Step.power({"kind": "drop_all"})],
    ).to_json()), encoding="utf-8")
    for trace in (path, laned):
        done = _faultlab("replay", str(trace), cwd=tmp_path)
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"faultlab: error: {trace}: "), lines
        assert "PostgreSQL" in lines[0] and "server_crash" in lines[0], lines
        assert done.stdout == ""
    laned.unlink()
    temporary = tmp_path / "tmp"  # the runs' TMPDIR: where a run directory would be made
    temporary.mkdir()
    for lanes in ("1", "2"):
        done = _faultlab("explore", "--system", "reference-pg", "--power-loss",
                         "--concurrency", lanes, "--examples", "5",
                         "--corpus", str(tmp_path / "corpus"), cwd=tmp_path,
                         env={"TMPDIR": str(temporary)})
        assert done.returncode == 2, done.stdout + done.stderr
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("faultlab: error: --power-loss: "), lines
        assert "reference-pg keeps its stores on PostgreSQL" in lines[0]
        assert done.stdout == ""
    assert sorted(tmp_path.iterdir()) == [path, temporary]  # no corpus
    assert list(temporary.iterdir()) == []  # no run directory


def test_server_crash_steps_are_written_only_when_used_and_checked_on_load() -> None:
    assert Step(SERVER_CRASH).to_json() == {"action": "server_crash"}
    assert Step.from_json({"action": "server_crash"}) == Step(SERVER_CRASH)
    assert Step.from_lane_json({"action": "server_crash"}).describe() == "server_crash"
    from faultlab.base.errors import UsageError

    for bad in ({"action": "server_crash", "operation_id": "op-1"},
                {"action": "server_crash", "crash": "during_accept"}):
        with pytest.raises(UsageError, match="takes no"):
            Step.from_json(bad)
        with pytest.raises(UsageError, match="takes no"):
            Step.from_lane_json({**bad, "lane": 1} if "crash" in bad else bad)


def test_explore_catches_async_commit_pg_and_shrinks_it_leaving_nothing(
        tmp_path: Path) -> None:
    _require()
    shared = _shared_start_time()
    process = subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--system", "async-commit-pg",
         "--postgres", "private", "--examples", "40", "--corpus", str(tmp_path / "corpus"),
         "--quiet"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    out, err = process.communicate(timeout=600)
    assert process.returncode == 1, err
    assert "FOUND: ACK+DURABLE at step 2, shrunk to 2 executed steps" in out, out
    assert "--postgres private" in out
    assert _left_behind(process.pid) == []
    saved = list((tmp_path / "corpus").glob("async-commit-pg-*.json"))
    assert len(saved) == 1
    trace = Trace.load(saved[0])
    assert [step.action for step in trace.steps] == ["accept", SERVER_CRASH]
    replayed = _faultlab("replay", str(saved[0]), "--postgres", "private", cwd=tmp_path)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert shared is None or _shared_start_time() == shared


#: Examples of the clean runs below: a few by default, more as slow tests.
CLEAN_EXAMPLES = [8, pytest.param(40, marks=pytest.mark.slow)]


@pytest.mark.parametrize("examples", CLEAN_EXAMPLES)
def test_explore_of_reference_pg_with_server_crashes_is_clean(tmp_path: Path,
                                                              examples: int) -> None:
    _require()
    done = _faultlab("explore", "--system", "reference-pg", "--postgres", "private",
                     "--examples", str(examples), "--corpus", str(tmp_path / "corpus"),
                     "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^step server_crash\s+[1-9]", done.stdout, re.MULTILINE), done.stdout


@pytest.mark.parametrize("examples", CLEAN_EXAMPLES)
def test_concurrent_explore_of_reference_pg_with_server_crashes_is_clean(
        tmp_path: Path, examples: int) -> None:
    _require()
    done = _faultlab("explore", "--system", "reference-pg", "--postgres", "private",
                     "--concurrency", "2", "--examples", str(examples), "--corpus",
                     str(tmp_path / "corpus"), "--quiet", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^step server_crash\s+[1-9]", done.stdout, re.MULTILINE), done.stdout


def test_the_zoo_judges_async_commit_pg_on_a_private_server_of_its_own(
        tmp_path: Path) -> None:
    _require()
    done = _faultlab("mutants", "--only", "async-commit-pg", "--corpus", str(tmp_path / "c"),
                     cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: 1 of 1 mutants caught" in done.stdout
    assert list((tmp_path / "c").glob("async-commit-pg-*.json"))


def test_the_zoo_says_why_async_commit_pg_is_not_judged_without_a_private_server(
        tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "faultlab", "mutants", "--only", "async-commit-pg", "--corpus",
         str(tmp_path / "c")], cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT), pgserver.BIN_ENV: str(tmp_path / "none")})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "not judged: needs --postgres private, which cannot start here" in done.stdout
    assert "not judged here: async-commit-pg" in done.stdout


def test_concurrent_explore_catches_advisory_lock_pg_and_shrinks_it(tmp_path: Path) -> None:
    """Seed 3 finds it in its fourth example (seed 0 in its second, as the zoo's table
    shows: every example may open with a claim whose session the server ends)."""
    _require()
    done = _faultlab("explore", "--system", "advisory-lock-pg", "--postgres", "private",
                     "--concurrency", "2", "--seed", "3", "--examples", "100", "--corpus",
                     str(tmp_path / "corpus"), "--quiet", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FOUND: EXCL at step 4, shrunk to 4 scheduling steps" in done.stdout, done.stdout
    assert "could not drop" not in done.stderr


def test_an_interrupted_run_leaves_no_server(tmp_path: Path) -> None:
    _require()
    process = subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--system", "reference-pg",
         "--postgres", "private", "--examples", "1000", "--corpus", str(tmp_path / "c")],
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    deadline = time.monotonic() + 60
    while not _left_behind(process.pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(2.0)  # well into the run: steps and server crashes under way
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert _left_behind(process.pid) == []


def test_a_dropped_connection_reaches_a_command_line_lanes_backends(
        private: PrivateServer, tmp_path: Path) -> None:
    """A command-line worker's connection strings name its lane's tag, not its pid (they are
    written before it exists): drop_connection ends its sessions by that tag. Lane 2 holds
    with its claim's transaction open; once dropped, the claim is rolled back and lane 1's
    dispatcher takes and completes the entry while lane 2 still lives."""
    from test_postgres_command_lanes import PAYLOAD as COMMAND_PAYLOAD
    from test_postgres_command_lanes import _announcing

    from faultlab.run.executor import Executor

    system = load_system(str(_announcing(tmp_path)))
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", COMMAND_PAYLOAD, lane=1))
        held = ex.run(Step("dispatch", lane=2, hold=True))
        assert held.lanes == ("exit 0", "dispatch @before_dispatch"), held.lanes
        application = pgstores.stores_info(ex.directory).application
        tag = ex.lanes[2].program.backend_tag if ex.lanes[2].program else None
        assert tag is not None
        sessions = f"{application}-worker-{tag}"

        def count() -> int:
            rows = private._on_admin(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (sessions,))
            return int(rows[0][0])

        assert count() >= 1  # the held lane's claim transaction
        dropped = ex.run(Step(DROP_CONNECTION, lane=2))
        assert count() == 0 and ex.lanes[2].alive, dropped.lanes
        rescued = ex.run(Step("dispatch", lane=1))
        assert rescued.snapshot.counts()["operations_complete"] == 1, rescued.lanes
        assert len(rescued.snapshot.tickets) == 1


@pytest.mark.slow
def test_each_server_fault_trace_replays_identically_20_times() -> None:
    """The three replay tests above, with 20 replays each (FAULTLAB_SLOW_TESTS=1): a
    sequential trace with server crashes, a concurrent one with a server crash under a
    live lane, one with a dropped connection."""
    _require()
    names = ("test_a_server_crash_loses_nothing_of_reference_pg_and_replays_identically",
             "test_a_server_crash_under_live_lanes_replays_identically",
             "test_a_dropped_connection_replays_identically_and_reference_pg_survives_it")
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-s", "-p", "no:cacheprovider",
         *(f"{__file__}::{name}" for name in names)],
        cwd=ROOT, capture_output=True, text=True, timeout=1800, check=False,
        env={**os.environ, "FAULTLAB_SLOW_TESTS": "1"})
    assert done.returncode == 0, done.stdout + done.stderr
    assert "3 passed" in done.stdout, done.stdout
    assert "20 replays identical" in done.stdout, done.stdout
