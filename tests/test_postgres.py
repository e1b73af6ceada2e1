"""PostgreSQL stores and reference-pg, against the real local server.

Skipped with a reason when no server answers; failed instead when
FAULTLAB_REQUIRE_SERVICES names ``postgres``. Every test checks that no
``faultlab_`` database it created is left on the server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, require_service

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.base.wall_clock import EPOCH
from faultlab.process.spawn import Spawner, child_environment
from faultlab.run.executor import Executor, execute
from faultlab.stores import postgres as pgstores
from faultlab.stores.sqlite import StoreError
from faultlab.system import load_system
from faultlab.system.builtin.reference import LEASE_TICKS
from faultlab.trace import Step
from faultlab.trials.scenarios import SCENARIOS

try:
    import psycopg
except ImportError:  # the postgres extra is not installed: the server tests skip (or fail)
    psycopg = None

DSN = os.environ.get("FAULTLAB_TEST_POSTGRES", "")
PAYLOAD = {"title": "invoice", "count": 3}


def _admin() -> Any:
    if psycopg is None:
        require_service("postgres", "psycopg (the postgres extra) is not installed")
    try:
        return psycopg.connect(pgstores.conninfo_for(DSN, dbname="postgres"), autocommit=True,
                               connect_timeout=3)
    except psycopg.OperationalError as error:
        require_service("postgres", str(error).strip().splitlines()[-1])


def _parent(pid: int) -> int | None:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _not_anothers(name: str) -> bool:
    """A faultlab database belongs to the run of the pid in its name. Databases of a live
    process that is neither this one nor one it started (another run on the same shared
    server, a developer's explore) are that run's business, not this test's."""
    try:
        pid = int(name.split("_")[1])
    except (IndexError, ValueError):
        return True
    me = os.getpid()
    walk: int | None = pid
    while walk is not None and walk > 1:
        if walk == me:
            return True
        walk = _parent(walk)
    return not Path(f"/proc/{pid}").exists()  # its run is gone: left behind


def _faultlab_databases(admin: Any) -> set[str]:
    return {name for name in pgstores.list_databases(admin) if _not_anothers(name)}


@pytest.fixture()
def server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """The admin connection; afterwards the run is closed and no new faultlab_ database exists.

    In-process tests run without the background pool (each clone made when asked: the
    teardown then drops only what the test used) unless marked ``pool``.
    """
    if request.node.get_closest_marker("pool") is None:
        monkeypatch.setattr(pgstores, "POOL_SIZE", 0)
    admin = _admin()
    before = _faultlab_databases(admin)
    pgstores.configure(DSN or None)
    try:
        yield admin
    finally:
        problems = pgstores.close_run()
        left = _faultlab_databases(admin) - before
        admin.close()
        assert problems == []
        assert left == set(), f"databases left behind: {sorted(left)}"


@pytest.fixture()
def reference_pg(server: Any) -> Any:
    return load_system("reference-pg")


def test_a_trace_gets_fresh_marked_databases_that_are_dropped(server: Any, tmp_path: Path,
                                                                reference_pg: Any) -> None:
    reference_pg.initialise(tmp_path)
    info = json.loads((tmp_path / pgstores.STORES_FILE).read_text())
    names = sorted(info["databases"].values())
    assert len(set(names)) == 2 and all(n.startswith(f"faultlab_{os.getpid()}_") for n in names)
    rows = server.execute(
        "SELECT datname, shobj_description(oid, 'pg_database') FROM pg_database "
        "WHERE datname = ANY(%s) ORDER BY 1", (names,)).fetchall()
    assert [r[0] for r in rows] == names
    assert all(r[1].startswith(pgstores.COMMENT_PREFIX) for r in rows)
    connection = pgstores.connect(tmp_path, "caller")
    try:
        assert connection.execute("SELECT count(*) FROM operations").fetchone() == (0,)
    finally:
        connection.close()
    assert reference_pg.snapshot(tmp_path).counts()["tickets"] == 0
    reference_pg.release(tmp_path)
    pgstores.close_run()
    assert not set(names) & _faultlab_databases(server)


@pytest.mark.pool
def test_the_pool_keeps_marked_clones_ready_and_the_run_drops_them(
        server: Any, tmp_path: Path, reference_pg: Any) -> None:
    reference_pg.initialise(tmp_path)
    run = pgstores.current_run()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(
            t.ready.qsize() < run.pool for t in run._templates.values()):
        time.sleep(0.05)
    ready = sorted(name for t in run._templates.values() for name in list(t.ready.queue))
    assert len(ready) == 2 * run.pool == 4
    rows = server.execute(
        "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = ANY(%s)",
        (ready,)).fetchall()
    assert len(rows) == 4 and all(r[0].startswith(pgstores.COMMENT_PREFIX) for r in rows)
    taken = json.loads((tmp_path / pgstores.STORES_FILE).read_text())["databases"]
    assert not set(taken.values()) & set(ready)
    reference_pg.release(tmp_path)
    assert pgstores.close_run() == []
    assert not (set(ready) | set(taken.values())) & _faultlab_databases(server)


def test_a_database_without_the_marker_is_neither_written_nor_dropped(server: Any,
                                                                      tmp_path: Path) -> None:
    foreign = f"fltest_foreign_{os.getpid()}"
    server.execute(f'CREATE DATABASE "{foreign}"')
    try:
        (tmp_path / pgstores.STORES_FILE).write_text(json.dumps({
            "conninfo": DSN, "run": "someone", "application": "x",
            "databases": {"caller": foreign}}))
        with pytest.raises(StoreError, match="no marker"):
            pgstores.connect(tmp_path, "caller")
        run = pgstores.current_run()
        with pytest.raises(StoreError, match="not created by this faultlab run"):
            run._drop(run._admin, foreign)
        assert server.execute("SELECT 1 FROM pg_database WHERE datname = %s",
                              (foreign,)).fetchone() == (1,)
    finally:
        server.execute(f'DROP DATABASE "{foreign}"')


def test_snapshot_queries_are_read_only(server: Any, tmp_path: Path, reference_pg: Any) -> None:
    reference_pg.initialise(tmp_path)
    try:
        with pytest.raises(StoreError, match="read-only transaction"):
            pgstores.query(tmp_path, "caller", {"x": "DELETE FROM operations RETURNING id"})
        with pytest.raises(StoreError, match="read-only transaction"):
            pgstores.query(tmp_path, "caller", {"x": "CREATE TABLE sneaky (id int)"})
        tables = pgstores.query(tmp_path, "caller", {"x": "SELECT count(*) FROM pg_tables "
                                                          "WHERE tablename = 'sneaky'"})
        assert tables == {"x": [(0,)]}
    finally:
        reference_pg.release(tmp_path)


@pytest.mark.e2e  # the five scenarios, as the suite runs them
def test_the_five_scenarios_pass_on_reference_pg_with_the_seed_figures(
        server: Any, fork_spawner: Spawner, reference_pg: Any) -> None:
    outcomes = {s.name: s.run(reference_pg, fork_spawner) for s in SCENARIOS}
    assert {name: o.failures for name, o in outcomes.items() if not o.passed} == {}
    summaries = {name: o.summary for name, o in outcomes.items()}
    assert summaries["crash_before_dispatch"] == {
        "crash_exit": -9, "tickets_before": 0, "tickets_after": 1, "caller_state": "complete",
        "ticket_id": 1}
    assert summaries["crash_after_downstream_commit"]["tickets_after"] == 1
    assert summaries["deduplication_disabled"]["tickets_after"] == 2
    assert summaries["crash_during_acceptance"] == {
        "crash_exit": -9, "partial_operations": 0, "partial_outbox": 0, "tickets_after": 1}
    assert summaries["changed_payload_rejected"] == {"exit_code": 3, "tickets_after": 1}


@pytest.mark.e2e  # two whole traces, caught and clean
def test_without_deduplication_the_recovery_duplicates_and_ONE_catches_it(
        server: Any, fork_spawner: Spawner, reference_pg: Any) -> None:
    steps = [Step("accept", "op-1", PAYLOAD), Step("dispatch", crash="during_completion"),
             Step("dispatch")]
    caught = execute(reference_pg, steps, fork_spawner, deduplication=False)
    assert caught.verdict.step == 3 and "ONE" in caught.verdict.invariants
    assert caught.observations[-1].snapshot.counts()["tickets"] == 2
    clean = execute(reference_pg, steps, fork_spawner, settle=True)
    assert clean.verdict.clean
    assert clean.observations[-1].snapshot.counts()["tickets"] == 1


@pytest.mark.e2e  # whole traces of a mutant and of the reference
@pytest.mark.parametrize(("name", "steps", "caught_by"), [
    ("no-dedup-pg", [Step("accept", "op-1", PAYLOAD),
                     Step("dispatch", crash="after_downstream_commit")], None),
    pytest.param("split-complete-pg", [Step("accept", "op-1", PAYLOAD),
                 Step("dispatch", crash="between_completion_commits")], "PAIR",
                 marks=pytest.mark.slow),
    pytest.param("claim-complete-first-pg", [Step("accept", "op-1", PAYLOAD),
                 Step("dispatch", crash="before_dispatch")], None, marks=pytest.mark.slow),
])
def test_each_postgres_mutant_is_caught_and_reference_pg_is_not(
        server: Any, fork_spawner: Spawner, name: str, steps: list[Step],
        caught_by: str | None) -> None:
    mutant = load_system(name)
    found = execute(mutant, steps, fork_spawner, settle=True)
    assert not found.verdict.clean, found.verdict
    if caught_by is not None:
        assert caught_by in found.verdict.invariants
    reference_steps = [s for s in steps if s.crash != "between_completion_commits"]
    assert execute(load_system("reference-pg"), reference_steps, fork_spawner,
                   settle=True).verdict.clean


def test_ambiguous_commits_are_judged_by_what_the_server_kept(
        server: Any, fork_spawner: Spawner, reference_pg: Any) -> None:
    with Executor(reference_pg, fork_spawner) as executor:
        accepted = executor.run(Step("accept", "op-1", PAYLOAD, crash="accept_commit_sent"))
        assert accepted.record.exit_code == -9 and accepted.record.response is None
        assert not accepted.violations
        # COMMIT was on the wire before the kill: the server committed both rows
        assert [r.state for r in accepted.snapshot.operations] == ["pending"]
        assert [r.state for r in accepted.snapshot.outbox] == ["pending"]
        dispatched = executor.run(Step("dispatch", crash="completion_commit_sent"))
        assert dispatched.record.exit_code == -9 and not dispatched.violations
        assert dispatched.snapshot.counts() == {
            "operations_pending": 0, "operations_complete": 1, "outbox_pending": 0,
            "outbox_complete": 1, "tickets": 1, "receipts": 1}
        executor.run(Step("accept", "op-2", PAYLOAD))
        failed = executor.run(Step("dispatch", crash="service_commit_sent"))
        assert failed.record.exit_code == 4 and not failed.violations
        assert failed.record.response["service"]["exit_code"] == -9
        observations, final = executor.settle()
        assert final == [] and all(not o.violations for o in observations)
        assert executor.snapshot.counts()["tickets"] == 2
        assert [o.record.response["replayed"] for o in observations] == [True]


@pytest.mark.parametrize(("crash", "operations"), [("sql:1", 0), ("sql:3", 0), ("commit:1", 1)])
def test_statement_crash_points_work_on_postgres(
        server: Any, fork_spawner: Spawner, reference_pg: Any, crash: str,
        operations: int) -> None:
    """accept runs SELECT, INSERT, INSERT, COMMIT: sql:K kills before the K-th, commit:1 after."""
    with Executor(reference_pg, fork_spawner) as executor:
        observation = executor.run(Step("accept", "op-1", PAYLOAD, crash=crash))
        assert observation.record.exit_code == -9
        assert len(observation.snapshot.operations) == operations
        assert len(observation.snapshot.outbox) == operations
        assert not observation.violations


def test_a_killed_dispatcher_s_row_lock_is_gone_before_the_next_step(
        server: Any, fork_spawner: Spawner, reference_pg: Any) -> None:
    """during_claim kills a client holding the claim's FOR UPDATE lock; SKIP LOCKED would
    skip the row if its backend were still there, and the recovery would answer idle."""
    with Executor(reference_pg, fork_spawner) as executor:
        executor.run(Step("accept", "op-1", PAYLOAD))
        crashed = executor.run(Step("dispatch", crash="during_claim"))
        assert crashed.record.exit_code == -9
        recovered = executor.run(Step("dispatch"))
        assert recovered.record.response is not None
        assert recovered.record.response.get("result") == {"ticket_id": 1}


@pytest.mark.slow
def test_a_lingering_backend_is_reported_not_waited_for(
        server: Any, fork_spawner: Spawner, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgstores, "BACKEND_EXIT_BOUND", 0.5)
    system = load_system("systems_for_tests:LingeringPg")
    with Executor(system, fork_spawner) as executor:
        started = time.monotonic()
        with pytest.raises(ExecutionError, match=r"still .* locks 0.5s after its worker ended"):
            executor.run(Step("accept", "op-1", PAYLOAD))
        elapsed = time.monotonic() - started
    assert elapsed < 6  # the child keeps the backend 8 s; faultlab gave up after 0.5 s
    time.sleep(max(0.0, 8.5 - elapsed))  # let the lingering child exit by itself


def _faultlab(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, cwd=ROOT, env=env or child_environment(), timeout=300,
                          check=False)


@pytest.mark.parametrize("dsn", [
    "host=127.0.0.1 port=1 connect_timeout=2", "host=127.0.0.1 user=no_such_faultlab_role",
    "not a dsn = = =",
])
def test_a_server_faultlab_cannot_use_is_one_line_and_exit_2(server: Any, dsn: str) -> None:
    completed = _faultlab("suite", "--system", "reference-pg", "--examples", "0",
                          "--postgres", dsn)
    assert completed.returncode == 2, completed.stderr
    assert completed.stdout == ""
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert completed.stderr.startswith("faultlab: error: ")


@pytest.mark.slow
def test_explore_reference_pg_is_clean_and_leaves_nothing(server: Any, tmp_path: Path) -> None:
    completed = _faultlab("explore", "--system", "reference-pg", "--examples", "8", "--seed", "1",
                          "--quiet", "--corpus", str(tmp_path / "corpus"))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "clean" in completed.stdout
    assert not (tmp_path / "corpus").exists() or not list((tmp_path / "corpus").iterdir())


@pytest.mark.slow
@pytest.mark.parametrize(("signum", "after"), [
    (signal.SIGTERM, 0.3), (signal.SIGINT, 0.7), (signal.SIGTERM, 1.1), (signal.SIGINT, 1.9),
])
def test_an_interrupted_run_drops_its_databases(server: Any, tmp_path: Path, signum: int,
                                                after: float) -> None:
    """Ctrl-C or SIGTERM at some moment of an exploration: exit 130/143 within 5 s, no
    database left.

    The teardown is the server's work: the run's last few databases are dropped one by one
    (about 0.75 s in all on an idle machine; two sessions dropping at once took no less).
    Beside a 20,000-step soak on the other core it took 2.1 s, so the bound leaves room for
    a loaded machine and still catches the 10-21 s this once took."""
    before = _faultlab_databases(server)
    process = subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--system", "reference-pg", "--examples",
         "1000", "--seed", "3", "--quiet", "--corpus", str(tmp_path / "corpus")],
        cwd=ROOT, env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and not (_faultlab_databases(server) - before):
        time.sleep(0.05)
    assert _faultlab_databases(server) - before, "the run never created a database"
    time.sleep(after)
    process.send_signal(signum)
    sent = time.monotonic()
    _, stderr = process.communicate(timeout=60)
    took = time.monotonic() - sent
    assert process.returncode == 128 + signum, stderr
    assert took < 5.0, f"{took:.1f} s from the signal to the exit (was 10-21 s)"
    name = signal.Signals(signum).name
    assert stderr.strip().splitlines()[-1] == (
        f"faultlab: interrupted by {name}; workers stopped, nothing reported or saved")
    assert _faultlab_databases(server) - before == set()
    assert not (tmp_path / "corpus").exists()


def test_the_sqlite_path_needs_no_psycopg(tmp_path: Path) -> None:
    """The README's suite runs with psycopg unimportable; reference-pg then says what to do."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "psycopg.py").write_text("raise ImportError('psycopg blocked by the test')\n")
    env = child_environment()
    env["PYTHONPATH"] = os.pathsep.join([str(blocker), env["PYTHONPATH"]])
    completed = _faultlab("suite", "--examples", "0", env=env)
    assert completed.returncode == 0, completed.stderr
    completed = _faultlab("systems", env=env)
    assert completed.returncode == 0, completed.stderr
    completed = _faultlab("suite", "--system", "reference-pg", "--examples", "0", env=env)
    assert completed.returncode == 2
    assert "pip install 'faultlab[postgres]'" in completed.stderr
    assert UsageError.exit_code == 2


@pytest.mark.slow
def test_two_runs_on_one_server_at_once_never_collide(server: Any, tmp_path: Path) -> None:
    """Names carry each run's pid and a random part; each run drops only its own databases."""
    before = _faultlab_databases(server)
    runs = [
        subprocess.Popen(
            [sys.executable, "-m", "faultlab", "explore", "--system", "reference-pg",
             "--examples", "6", "--seed", str(seed), "--quiet", "--corpus",
             str(tmp_path / f"corpus{seed}")],
            cwd=ROOT, env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True)
        for seed in (1, 2)
    ]
    seen: set[str] = set()
    while any(run.poll() is None for run in runs):
        seen |= _faultlab_databases(server) - before
        time.sleep(0.05)
    outputs = [run.communicate() for run in runs]
    assert [run.returncode for run in runs] == [0, 0], outputs
    prefixes = {"_".join(name.split("_")[:3]) for name in seen}
    assert len(prefixes) == 2, sorted(seen)  # each run made its own, under its own prefix
    assert _faultlab_databases(server) - before == set()


def test_init_refuses_a_system_whose_stores_live_in_postgres(server: Any, tmp_path: Path) -> None:
    completed = _faultlab("init", str(tmp_path / "stores"), "--system", "reference-pg")
    assert completed.returncode == 2
    assert "dropped when the run ends" in completed.stderr
    assert not (tmp_path / "stores").exists()


@pytest.mark.slow
def test_concurrent_exploration_of_reference_pg_is_clean_and_leaves_nothing(
        server: Any, tmp_path: Path) -> None:
    """Two lanes: a snapshot taken while a held worker keeps its transaction open must not
    wait for that worker's backend (only a worker that has ended must have lost it)."""
    completed = _faultlab("explore", "--system", "reference-pg", "--concurrency", "2",
                          "--examples", "10", "--seed", "0", "--quiet",
                          "--corpus", str(tmp_path / "corpus"))
    assert completed.returncode == 0, completed.stdout + completed.stderr
    assert "clean" in completed.stdout


def _outbox_claims(directory: Path) -> list[tuple[str, int, float | None]]:
    """(operation, token, lease end in ticks, None when never leased) of each outbox row."""
    connection = pgstores.connect(directory, "caller", role="snapshot")
    try:
        return [(str(r[0]), int(r[1]), None if r[2] is None else float(r[2]))
                for r in connection.execute(
                    "SELECT operation_id, attempt, CASE WHEN lease_until = '-infinity' "
                    "THEN NULL ELSE extract(epoch FROM lease_until)::float8 - %s END "
                    "FROM outbox ORDER BY seq", (EPOCH,)).fetchall()]
    finally:
        connection.close()


def test_reference_pg_claims_skip_locked_with_a_lease_and_fences_the_superseded(
        server: Any, reference_pg: Any) -> None:
    """Lane 1 holds inside its claim transaction (row locked): lane 2 skips the row, idle.
    Lane 1 commits its claim (token 1, lease 10 ticks) and holds before the downstream call;
    before the lease lapses lane 2 is idle, after it lane 2 claims (token 2) and completes;
    lane 1's completion is refused: superseded, one ticket, FENCE holds."""
    with Executor(reference_pg, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1))
        held = ex.run(Step("dispatch", lane=1, hold=True))
        assert held.lanes == ("dispatch @during_claim", "-")
        skipped = ex.run(Step("dispatch", lane=2))
        assert [r.response for _, r in skipped.exited] == [{"idle": True}]  # SKIP LOCKED
        assert _outbox_claims(ex.directory) == [("op-1", 0, None)]  # the claim is uncommitted
        claimed = ex.run(Step("release", lane=1))
        assert claimed.lanes[0] == "dispatch @before_dispatch"
        assert _outbox_claims(ex.directory) == [("op-1", 1, float(LEASE_TICKS))]
        ex.run(Step("tick", ticks=LEASE_TICKS - 1))
        early = ex.run(Step("dispatch", lane=2))
        assert [r.response for _, r in early.exited] == [{"idle": True}]  # lease still held
        ex.run(Step("tick", ticks=1))
        rescued = ex.run(Step("dispatch", lane=2))
        assert [r.response["result"] for _, r in rescued.exited] == [{"ticket_id": 1}]
        last = ex.run(Step("finish", lane=1))
        ((_, record),) = last.exited
        assert record.exit_code == 0 and record.response is not None
        assert record.response["superseded"] is True and record.response["attempt"] == 1
        assert last.violations == ()
        assert last.snapshot.counts()["tickets"] == 1
        assert [(c.lane, c.token) for c in ex.history.claims] == [(1, 1), (2, 2)]
        assert [(c.lease_until, c.at) for c in ex.history.claims] == [(10, 0), (20, 10)]
        names = set(pgstores.stores_info(ex.directory).databases.values())
        assert names <= _faultlab_databases(server)
    # the trace's databases go when its lane executor closes, not only when the run ends
    assert not names & _faultlab_databases(server)


@pytest.mark.e2e  # a laned trace and its settling, twice
def test_no_fencing_pg_is_caught_at_its_minimal_trace_and_reference_pg_is_not(
        server: Any) -> None:
    """The PostgreSQL form of no-fencing: its known minimal trace fails FENCE in the final
    recovery (every step executed); the same trace is clean on reference-pg, where the
    superseded lane answers superseded."""
    mutant = load_system("no-fencing-pg")
    trace = list(mutant.minimal_trace)
    caught = execute(mutant, trace, laned=True, concurrency=mutant.concurrency, settle=True)
    assert len(caught.executed_prefix()) == mutant.minimal_steps == len(trace) == 5
    assert caught.verdict.invariants == ("FENCE",)
    # the receiver deduplicates, so one ticket: only the history (FENCE) shows the defect
    assert caught.observations[-1].snapshot.counts()["tickets"] == 1
    clean = execute(load_system("reference-pg"), trace, concurrency=2, settle=True)
    assert clean.verdict.clean, clean.verdict
    superseded = [r.response for o in clean.observations for _, r in o.exited
                  if r.response is not None and r.response.get("superseded")]
    assert [(a["operation_id"], a["attempt"]) for a in superseded] == [("op-1", 1)]


@pytest.mark.parametrize("check_ms", [50, 0])
def test_a_lane_killed_while_waiting_for_a_row_lock_loses_its_backend(
        server: Any, reference_pg: Any, monkeypatch: pytest.MonkeyPatch, check_ms: int) -> None:
    """Lane 2's accept waits on lane 1's uncommitted insert of the same id; SIGKILLed there,
    its backend would wait on until lane 1 ends (the server hears the closed socket only
    when it next talks to the client). The client connection check ends it at once; the
    control without the check (0) shows the lingering backend reported."""
    monkeypatch.setattr(pgstores, "BACKEND_EXIT_BOUND", 2.0)
    if check_ms == 0:  # the lanes' helper prepares its workers without the check
        import lane_probe

        from faultlab.run import interleaving
        monkeypatch.setattr(interleaving, "prepare_lanes", lane_probe.prepare_without_client_check)
    else:
        assert pgstores.CLIENT_CHECK_MS == check_ms  # the default the workers have
    with Executor(reference_pg, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1, hold=True))
        blocked = ex.run(Step("accept", "op-1", PAYLOAD, lane=2))
        assert blocked.lanes == ("accept @during_accept", "accept blocked")
        started = time.monotonic()
        if check_ms == 0:
            with pytest.raises(ExecutionError, match=r"still active with .* locks"):
                ex.run(Step("kill", lane=2))
            return
        killed = ex.run(Step("kill", lane=2))
        assert time.monotonic() - started < 1.5
        assert [r.exit_code for _, r in killed.exited] == [-9]
        assert killed.violations == ()
        finished = ex.run(Step("finish", lane=1))
        assert [r.exit_code for _, r in finished.exited] == [0]
        assert [op.id for op in finished.snapshot.operations] == ["op-1"]
