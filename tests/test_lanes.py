"""Several real workers at once: holds at points, blocked lanes, pauses, the virtual clock,
fencing, and the concurrency mutants with their minimal traces."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import explore_lanes

from faultlab.base.errors import UsageError
from faultlab.process import starter
from faultlab.process.spawn import Spawner
from faultlab.run.executor import Executor, execute
from faultlab.stores.sqlite import BUSY_TIMEOUT
from faultlab.system import System, concurrency_mutant_names, load_system
from faultlab.system.builtin import registry
from faultlab.system.builtin.race_mutants import OP, ConcurrencyMutant, NoFencing
from faultlab.system.builtin.reference import LEASE_TICKS
from faultlab.trace import Step, Trace, Verdict

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

ROOT = Path(__file__).resolve().parent.parent
P = {"title": "backlog"}


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_superseded_dispatcher_is_fenced_on_the_reference(reference: System) -> None:
    """Lane 1 claims, holds; its lease lapses; lane 2 claims and completes; lane 1's
    completion is refused: one ticket, lane 1 answers superseded, FENCE holds."""
    with Executor(reference, concurrency=2) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        held = ex.run(Step("dispatch", lane=1, hold=True))
        assert held.lanes == ("dispatch @before_dispatch", "-")
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
        assert len(last.snapshot.tickets) == 1
        assert [(c.lane, c.token) for c in ex.history.claims] == [(1, 1), (2, 2)]
        assert [(c.lease_until, c.at) for c in ex.history.claims] == [(10, 0), (20, 10)]
        assert ex.history.contested == 1  # EXCL had something to check, and held
        pids = {c.pid for c in ex.history.claims}
        assert len(pids) == 2
    assert all(_gone(pid) for pid in pids)


def test_a_lane_still_starting_is_not_judged_blocked() -> None:
    """A worker that computes past the block bound before its first point (an exec'd
    interpreter starting on a loaded machine) is working, not waiting on a lock: the step
    waits for it and it holds at its point. Seen on a loaded machine as false 'blocked'
    lanes, then a 'lane is busy' refusal, before lanes were judged by their CPU use."""
    system = load_system("systems_for_tests:SlowStartOutbox")
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", P, lane=1))
        started = ex.run(Step("dispatch", lane=2, hold=True))
        assert started.lanes == ("exit 0", "dispatch @before_dispatch")
        done = ex.run(Step("finish", lane=2))
        assert done.lanes == ("exit 0", "exit 0")
        assert len(done.snapshot.tickets) == 1


def test_a_lane_waits_for_a_lock_as_long_as_the_schedule_holds_it(reference: System) -> None:
    """The holder moves only when the schedule says: however long that takes in seconds
    (a loaded machine, a long trace), the blocked lane still gets the lock and the
    outcome is the same. With SQLite's ordinary busy timeout it gave up after 5 s."""
    with Executor(reference, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", P, lane=1, hold=True))
        blocked = ex.run(Step("accept", "op-2", P, lane=2))
        assert blocked.lanes == ("accept @during_accept", "accept blocked")
        time.sleep(BUSY_TIMEOUT + 1)
        done = ex.run(Step("finish", lane=1))
        ex.run(Step("finish", lane=2))
        final = ex.run(Step("tick", ticks=1))
        assert final.lanes == ("exit 0", "exit 0"), done.lanes
        assert [op.id for op in final.snapshot.operations] == ["op-1", "op-2"]


def test_a_lane_blocked_on_a_lock_is_scheduled_around(reference: System) -> None:
    """Lane 1 holds inside its accept transaction; lane 2's accept blocks on the lock and
    the step ends with it blocked; releasing lane 1 lets lane 2 on. Never a deadlock."""
    with Executor(reference, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", P, lane=1, hold=True))
        blocked = ex.run(Step("accept", "op-2", P, lane=2))
        assert blocked.lanes == ("accept @during_accept", "accept blocked")
        assert blocked.snapshot.operations == ()
        after = ex.run(Step("finish", lane=1))
        assert after.lanes[0] == "exit 0"
        assert after.lanes[1] == "accept @during_accept"  # lane 2 moved on to its point
        ex.run(Step("finish", lane=2))
        assert [op.id for op in ex.snapshot.operations] == ["op-1", "op-2"]
        observations, final = ex.settle()
        assert final == [] and len(ex.snapshot.tickets) == 2


def test_a_lane_sleeping_on_a_lock_is_blocked_before_the_bound(reference: System) -> None:
    """With a bound of 20 s, a lane waiting in SQLite's busy handler for the lock a held
    acceptor keeps is judged blocked in well under that (it sleeps: /proc says so); the
    held lane alone is never judged so (nothing else alive), and the blocked lane moves on
    once the holder finishes."""
    import time

    with Executor(reference, concurrency=2, block_bound=20.0) as ex:
        began = time.monotonic()
        assert ex.run(Step("accept", "op-1", P, lane=1, hold=True)).lanes == (
            "accept @during_accept", "-")
        blocked = ex.run(Step("accept", "op-2", P, lane=2))
        assert blocked.lanes == ("accept @during_accept", "accept blocked")
        assert time.monotonic() - began < 10.0
        ex.run(Step("finish", lane=1))
        ex.run(Step("finish", lane=2))
        assert [op.id for op in ex.snapshot.operations] == ["op-1", "op-2"]


def test_pause_stops_the_process_and_kill_ends_it(reference: System) -> None:
    with Executor(reference, concurrency=1, laned=True) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        ex.run(Step("dispatch", lane=1, hold=True))
        pid = ex.lanes[1].pid
        paused = ex.run(Step("pause", lane=1))
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert stat in ("T", "t") and paused.lanes == ("dispatch @before_dispatch paused",)
        with pytest.raises(UsageError, match="paused"):
            ex.run(Step("release", lane=1))
        killed = ex.run(Step("kill", lane=1))
        assert [r.exit_code for _, r in killed.exited] == [-9]
        assert killed.sigkills == 1 and _gone(pid)
        assert ex.snapshot.pending_outbox()  # killed before the call: still pending
        _, final = ex.settle()
        assert final == [] and len(ex.snapshot.tickets) == 1


def test_resume_continues_a_paused_lane(reference: System) -> None:
    with Executor(reference, concurrency=1, laned=True) as ex:
        ex.run(Step("accept", OP, P, lane=1, hold=True))
        ex.run(Step("pause", lane=1))
        resumed = ex.run(Step("resume", lane=1))
        assert resumed.lanes == ("accept @during_accept",)
        done = ex.run(Step("finish", lane=1))
        assert done.lanes == ("exit 0",) and len(done.snapshot.operations) == 1


def test_the_clock_file_is_what_workers_read(reference: System) -> None:
    with Executor(reference, concurrency=1, laned=True) as ex:
        assert ex.clock is not None
        ex.run(Step("tick", ticks=7))
        assert ex.clock.path.read_text().strip() == "7"


def test_exec_mode_lanes(reference: System) -> None:
    trace = list(NoFencing.minimal_trace)
    clean = execute(reference, trace, Spawner("exec"), concurrency=2, settle=True)
    assert clean.verdict.clean
    caught = execute(load_system("no-fencing"), trace, Spawner("exec"), concurrency=2, settle=True)
    assert caught.verdict.invariants == ("FENCE",)


@pytest.mark.parametrize("name", registry.names(lanes=2, postgres=False))
def test_concurrency_mutant_minimal_trace(name: str, reference: System) -> None:
    """Each concurrency mutant fails its minimal trace at exactly minimal_steps on an
    invariant it names; the same trace is clean on the reference (the control)."""
    system = load_system(name)
    assert isinstance(system, ConcurrencyMutant) and name in concurrency_mutant_names()
    trace = list(system.minimal_trace)
    caught = execute(system, trace, laned=True, concurrency=system.concurrency, settle=True)
    assert len(caught.executed_prefix()) == system.minimal_steps == len(trace)
    assert set(caught.verdict.invariants) <= set(system.caught_by)
    assert caught.verdict.invariants
    # lenient: a step the reference's lanes cannot take there (relay-cursor's second accept
    # waits on the reference's held acceptance transaction) is dropped, as in shrinking
    assert execute(reference, trace, concurrency=system.concurrency, lenient=True,
                   settle=True).verdict.clean


def test_every_concurrency_mutant_is_judged() -> None:
    """mutants judges every SQLite concurrency mutant (eight) and the PostgreSQL ones that
    are not twins; the twins are left to the PostgreSQL tests."""
    judged = concurrency_mutant_names()
    assert set(registry.names(lanes=2, postgres=False)) <= set(judged)
    assert len(registry.names(lanes=2, postgres=False)) == 8
    assert "no-fencing-pg" not in judged and "advisory-lock-pg" in judged


def test_minimiser_turns_a_held_start_released_to_its_end_into_a_run() -> None:
    """stale-rescue found with its acceptance held and then released (4 choices) shrinks
    to its minimal 3, the acceptance as a run: deletion alone cannot merge the two."""
    from faultlab.search.shrink import minimise

    system = load_system("stale-rescue")
    assert isinstance(system, ConcurrencyMutant)
    steps = [Step("accept", OP, P, lane=1, hold=True), Step("release", lane=1),
             Step("dispatch", lane=2, hold=True), Step("dispatch", lane=1)]
    execution = execute(system, steps, concurrency=2, settle=True)
    assert not execution.verdict.clean and len(execution.executed_prefix()) == 4
    trace = Trace(system=system.ref, deduplication=True, concurrency=2, steps=steps,
                  expected=execution.verdict)
    shrunk, _ = minimise(trace, execution, lambda candidate: execute(
        system, candidate, concurrency=2, lenient=True, settle=True))
    assert len(shrunk.steps) == system.minimal_steps == 3
    assert shrunk.steps[0].action == "accept" and not shrunk.steps[0].hold  # a run
    replay = execute(system, shrunk.steps, concurrency=2, settle=True)
    assert replay.verdict == shrunk.expected


def test_minimiser_turns_a_run_that_waited_on_a_lock_into_a_held_start() -> None:
    """eager-rescue found with a dispatcher that waited on a held acceptance's lock (4
    choices) shrinks to its minimal 3: the waiting run as a held start, which lets the
    acceptance run and its release go. Deletion and promotion alone stop at 4."""
    from faultlab.search.shrink import minimise

    system = load_system("eager-rescue")
    assert isinstance(system, ConcurrencyMutant)
    steps = [Step("accept", OP, P, lane=2, hold=True), Step("dispatch", lane=1),
             Step("release", lane=2), Step("dispatch", lane=2)]
    execution = execute(system, steps, concurrency=2, settle=True)
    assert execution.verdict.invariants == ("EXCL",)
    assert len(execution.executed_prefix()) == 4
    trace = Trace(system=system.ref, deduplication=True, concurrency=2, steps=steps,
                  expected=execution.verdict)
    shrunk, _ = minimise(trace, execution, lambda candidate: execute(
        system, candidate, concurrency=2, lenient=True, settle=True))
    assert len(shrunk.steps) == system.minimal_steps == 3
    assert [step.hold for step in shrunk.steps if step.action == "dispatch"].count(True) >= 1
    replay = execute(system, shrunk.steps, concurrency=2, settle=True)
    assert replay.verdict == shrunk.expected


def test_concurrent_finding_replays_identically_20_times() -> None:
    system = load_system("stale-rescue")
    assert isinstance(system, ConcurrencyMutant)
    runs = [execute(system, list(system.minimal_trace), concurrency=2, settle=True)
            for _ in range(20)]
    shown = {
        (r.verdict, tuple((o.lanes, o.snapshot) for o in r.observations)) for r in runs
    }
    assert len(shown) == 1


def test_trace_version_2_round_trip_and_version_1_still_reads(tmp_path: Path) -> None:
    trace = Trace(system="no-fencing", deduplication=True, concurrency=2,
                  steps=list(NoFencing.minimal_trace), expected=Verdict(5, ("FENCE",)))
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace.to_json()))
    loaded = Trace.load(path)
    assert isinstance(loaded, Trace) and loaded.steps == trace.steps
    assert loaded.expected == trace.expected and loaded.concurrency == 2
    for saved in sorted((ROOT / "corpus").glob("*.json")):
        version = json.loads(saved.read_text())["version"]
        assert isinstance(Trace.load(saved), Trace if version == 1 else Trace)


@pytest.mark.parametrize("bad, message", [
    ({"action": "tick", "ticks": 0}, "tick needs"),
    ({"action": "release", "lane": 3}, "lane from 1 to 2"),
    ({"action": "start", "lane": 1, "role": "cook"}, "needs a role"),
    ({"action": "run", "lane": 1, "role": "accept", "payload": {}}, "operation_id"),
    ({"action": "jump"}, "not a concurrent trace step"),
])
def test_bad_version_2_steps_are_refused(tmp_path: Path, bad: dict[str, object],
                                         message: str) -> None:
    data = Trace(system="reference", deduplication=True, concurrency=2, steps=[]).to_json()
    data["steps"] = [bad]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError, match=message):
        Trace.load(path)


def test_a_step_on_a_lane_that_never_started_is_refused(reference: System) -> None:
    with Executor(reference, concurrency=2) as ex, pytest.raises(UsageError, match="never"):
        ex.run(Step("release", lane=2))


def test_no_process_descriptor_or_directory_left_behind(reference: System) -> None:
    """Kills, pauses and lanes left held at the end: every lane process is reaped, every
    pipe closed, the run directory removed."""
    fds_before = set(os.listdir("/proc/self/fd"))
    with Executor(reference, concurrency=3) as ex:
        directory = ex.directory
        ex.run(Step("accept", OP, P, lane=1))
        ex.run(Step("dispatch", lane=1, hold=True))
        ex.run(Step("service", OP, P, lane=2, hold=True))
        ex.run(Step("accept", "op-2", P, lane=3, hold=True))
        ex.run(Step("pause", lane=3))
        pids = [lane.pid for lane in ex.lanes.values()]
        assert not any(_gone(pid) for pid in pids)
    assert all(_gone(pid) for pid in pids)
    assert not directory.exists()
    assert set(os.listdir("/proc/self/fd")) <= fds_before | {"listing"}
    with pytest.raises(ChildProcessError):
        for pid in pids:
            os.waitpid(pid, os.WNOHANG)


ANNOUNCE = str(ROOT / "examples" / "standalone_outbox" / "system-announce.json")
ARGUMENT = str(ROOT / "examples" / "standalone_outbox" / "system.json")


def test_command_line_system_is_scheduled_through_its_announcements() -> None:
    """A program in another process, speaking only the announcement protocol: two
    dispatchers held at before_dispatch at once, one paused (really stopped), one killed
    there, the other finished: one ticket, three distinct PIDs, recovery clean."""
    system = load_system(ANNOUNCE)
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        both = ex.run(Step("dispatch", lane=2, hold=True))
        assert both.lanes == ("exit 0", "dispatch @before_dispatch")
        both = ex.run(Step("dispatch", lane=1, hold=True))
        assert both.lanes == ("dispatch @before_dispatch", "dispatch @before_dispatch")
        paused = ex.run(Step("pause", lane=1))
        pid = ex.lanes[1].pid
        stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        assert stat in ("T", "t") and paused.lanes[0].endswith("paused")
        ex.run(Step("resume", lane=1))
        killed = ex.run(Step("kill", lane=2))
        assert [r.exit_code for _, r in killed.exited] == [-9] and killed.snapshot.tickets == ()
        done = ex.run(Step("finish", lane=1))
        assert [r.exit_code for _, r in done.exited] == [0] and len(done.snapshot.tickets) == 1
        _, final = ex.settle()
        assert final == []
        pids = {record.pid for o in ex.observations for _, record in o.exited}
        assert len(pids) == 3


def test_command_line_system_without_announcements_runs_free() -> None:
    system = load_system(ARGUMENT)
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        ran = ex.run(Step("dispatch", lane=1, hold=True))
        assert ran.lanes == ("exit 0", "-") and len(ran.snapshot.tickets) == 1
        assert ex.run(Step("pause", lane=1)).lanes == ("exit 0", "-")  # ended: nothing to do


def test_skip_judges_a_relay_by_the_leases_it_could_have_seen(reference: System) -> None:
    """The reference's relay reads the clock as it starts (tick 0, op-1 leased by a
    crashed dispatcher until tick 10), holds before its claim statement while the clock
    passes the lease, then reports idle. SKIP called that a skip (a false alarm: its read
    may fall anywhere in its run, and at tick 0 op-1 was leased); it judges a relay by
    the leases unexpired when it started. The same relay started after the lease lapsed
    claims op-1 (the control: what it could have seen, it takes)."""
    crashed = [Step("accept", "op-1", {}, lane=1),
               Step("dispatch", lane=1, crash="during_completion")]
    with Executor(reference, concurrency=2, statement_points=True) as ex:
        for step in [*crashed, Step("dispatch", lane=2, hold=True), Step("tick", ticks=10)]:
            assert not ex.run(step).violations, step
        assert ex.lanes[2].point == "sql:1" and ex.clock is not None and ex.clock.ticks == 10
        finished = ex.run(Step("finish", lane=2))
        (_, relay), = finished.exited
        assert relay.response == {"idle": True}  # it read the clock at tick 0
        assert not finished.violations
        assert not ex.history.vacuous("SKIP")  # judged (a lone idle relay, op-1 pending)
    with Executor(reference, concurrency=2, statement_points=True) as ex:
        for step in [*crashed, Step("tick", ticks=10), Step("dispatch", lane=2)]:
            ex.run(step)
        assert ex.observations[-1].exited[0][1].response["operation_id"] == "op-1"


def test_skip_names_the_row_a_relay_cursor_passes_over(reference: System) -> None:
    """SKIP, not LIVE, reports relay-cursor: the recovery's relay reports idle while op-1
    (committed below its high-water mark) is pending. The reference, given the same
    acceptances one after another and a relay, never trips it (vacuity shown too)."""
    system = load_system("relay-cursor")
    with Executor(system, concurrency=2) as ex:
        for step in system.minimal_trace:  # type: ignore[attr-defined]
            assert not ex.run(step).violations
        _, final = ex.settle()
        caught = [v for o in ex.observations for v in o.violations]
        assert [v.invariant for v in caught] == ["SKIP"] and not final
        assert "op-1" in caught[0].message and "op-2" not in caught[0].message
        assert not ex.history.vacuous("SKIP")
        assert [op.state for op in ex.snapshot.operations] == ["pending", "complete"]
    with Executor(reference, concurrency=2) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        ex.run(Step("accept", "op-2", P, lane=2))
        ex.run(Step("dispatch", lane=2))
        _, final = ex.settle()
        assert not final and not any(o.violations for o in ex.observations)
        assert ex.history.vacuous("SKIP")  # recovery's relays found work until none was left
        assert {op.state for op in ex.snapshot.operations} == {"complete"}


def test_quiet_judges_a_solitary_dispatcher_in_a_concurrent_trace(reference: System) -> None:
    """idle-resend (a sequential mutant caught by QUIET) is caught in lanes when its idle
    dispatcher runs alone; the reference on the same trace is clean; and with another lane
    alive meanwhile QUIET is not judged (the control for the solitary rule)."""
    trace = [Step("accept", OP, P, lane=1), Step("dispatch", lane=1),
             Step("dispatch", lane=2)]
    caught = execute(load_system("idle-resend"), trace, concurrency=2, settle=True)
    assert caught.verdict.invariants == ("QUIET",) and caught.verdict.step == 3
    assert execute(reference, trace, concurrency=2, settle=True).verdict.clean
    with Executor(load_system("idle-resend"), concurrency=2) as ex:
        for step in trace[:2]:
            ex.run(step)
        held = ex.run(Step("dispatch", lane=1, hold=True))  # another worker alive throughout
        assert held.lanes[0].startswith("dispatch @")
        assert not ex.run(Step("dispatch", lane=2)).violations
        assert "QUIET" not in ex.checked


def test_concurrent_explore_prints_invariant_coverage(tmp_path: Path) -> None:
    result = explore_lanes(load_system("reference"), examples=10,
                                seed_value=0)
    stats = result.stats()
    checked = stats["checked"]
    assert list(checked)[-6:] == ["TERM", "EXCL", "ORDER", "FENCE", "SKIP", "LIVE"]
    assert "OPEN" not in checked  # no power cut drawn: its invariants are not listed
    assert checked["LIVE"] == result.recorder.examples
    # counted in steps, as sequentially: more than one a trace, never more than the steps
    assert result.recorder.examples < checked["ATOM"] <= result.recorder.steps
    assert 0 < checked["TERM"] <= result.recorder.steps
    # crash points armed by the crash rule, and the ones that fired, as sequentially
    assert stats["crash_points_fired"] and all(
        0 < count <= stats["crash_points_armed"][point]
        for point, count in stats["crash_points_fired"].items())


def _points_until_exit(ex: Executor, lane: int) -> list[str]:
    shown = []
    while True:
        state = ex.run(Step("release", lane=lane)).lanes[lane - 1]
        if not state.startswith("accept @"):
            return shown
        shown.append(state.removeprefix("accept @"))


def test_statement_scheduling_points(reference: System) -> None:
    """With statement points a Python worker also holds before each SQL statement (sql:K)
    and after each COMMIT (commit:K), so a kill lands between any two statements: killed
    before its COMMIT an acceptance leaves nothing, killed after it both rows."""
    with Executor(reference, concurrency=1, statement_points=True) as ex:
        first = ex.run(Step("accept", OP, P, lane=1, hold=True)).lanes[0]
        points = [first.removeprefix("accept @"), *_points_until_exit(ex, 1)]
    assert points[0] == "sql:1" and "during_accept" in points and "commit:1" in points
    commit = points.index("commit:1")
    before_commit = points[commit - 1]
    assert before_commit.startswith("sql:")
    for point, rows in ((before_commit, 0), ("commit:1", 1)):
        with Executor(reference, concurrency=1, statement_points=True) as ex:
            ex.run(Step("accept", OP, P, lane=1, hold=True))
            while ex.lanes[1].point != point:
                ex.run(Step("release", lane=1))
            killed = ex.run(Step("kill", lane=1))
            assert killed.exited[0][1].killed
            assert len(killed.snapshot.operations) == len(killed.snapshot.outbox) == rows
    with Executor(reference, concurrency=1, laned=True) as ex:  # the control: named points only
        assert ex.run(Step("accept", OP, P, lane=1, hold=True)).lanes == ("accept @during_accept",)


def test_statement_points_refused_for_a_command_line_system() -> None:
    system = load_system(str(Path(__file__).resolve().parent.parent / "examples"
                             / "standalone_outbox" / "system.json"))
    with pytest.raises(UsageError, match="statement scheduling points"):
        Executor(system, concurrency=2, statement_points=True)


def test_a_lane_closed_right_after_its_fork_is_killed_and_reaped(reference: System) -> None:
    """An interrupt can end a run just after a lane's fork, before the child has made its
    own process group: the kill must still reach it (it did not, about 1 run in 10, when
    only the child set its group), and close must not wait out a deadline for it."""
    for _ in range(20):
        began = time.monotonic()
        with Executor(reference, concurrency=1, laned=True) as ex:
            step = Step("accept", OP, P, lane=1, hold=True)
            assert ex._lanes is not None
            lane = ex._lanes.launch(step, ex._spec(step), ex.snapshot)  # no wait for its hold
        assert _gone(lane.pid)
        assert time.monotonic() - began < 5.0


def _store_descriptors(pid: int, directory: Path) -> set[str]:
    """The files of ``directory`` (the trace's stores) that process ``pid`` holds open."""
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(directory)):
            held.add(target)
    return held


def _watch_forks(monkeypatch: pytest.MonkeyPatch, directory: list[Path]) -> list[set[str]]:
    """Every fork of this process from now on, as the store files open in it at that
    moment (under ``directory[0]``)."""
    forks: list[set[str]] = []
    real_fork = os.fork

    def watched_fork() -> int:
        forks.append(_store_descriptors(os.getpid(), directory[0]))
        return real_fork()

    monkeypatch.setattr(os, "fork", watched_fork)
    return forks


def test_a_laned_trace_forks_nothing_here_and_keeps_its_readers_open(
        reference: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """SQLite forbids carrying an open connection across fork() (the child's copy of
    SQLite's own lock bookkeeping would name this process's connections). The lanes'
    helper is a fresh interpreter, not a fork of this process: a laned trace forks nothing
    here, so it keeps its snapshot connections open from its first step to its end, and
    the helper holds none of them."""
    directory = [Path()]
    forks = _watch_forks(monkeypatch, directory)
    with Executor(reference, concurrency=2, laned=True) as ex:
        directory[0] = ex.directory.resolve()
        kept = _store_descriptors(os.getpid(), directory[0])
        assert kept  # the readers, kept open
        ex.run(Step("accept", OP, P, lane=1, hold=True))
        assert ex._lanes is not None and ex._lanes._launcher._starter is not None
        helper = ex._lanes._launcher._starter.pid
        assert not _store_descriptors(helper, directory[0])
        observation = ex.run(Step("finish", lane=1))
        assert [op.id for op in observation.snapshot.operations] == [OP]
        assert _store_descriptors(os.getpid(), directory[0]) == kept  # the same, kept
        assert not _store_descriptors(helper, directory[0])
    assert forks == []  # this process forked nothing
    assert not _store_descriptors(os.getpid(), directory[0])  # closed with the trace


def test_without_a_helper_no_store_connection_is_carried_across_a_fork(
        reference: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the helper cannot watch its children (no ``pidfd_open``), this process forks
    each worker itself: its snapshot connections are closed before every such fork and
    opened again by the next snapshot."""
    monkeypatch.setattr(starter, "available", lambda: False)
    directory = [Path()]
    forks = _watch_forks(monkeypatch, directory)
    with Executor(reference, concurrency=2, laned=True) as ex:
        directory[0] = ex.directory.resolve()
        assert _store_descriptors(os.getpid(), directory[0])  # the readers, kept open
        ex.run(Step("accept", OP, P, lane=1, hold=True))
        assert ex._lanes is not None and ex._lanes._launcher._starter is None
        assert _store_descriptors(os.getpid(), directory[0])  # opened again by the snapshot
        observation = ex.run(Step("finish", lane=1))
        assert [op.id for op in observation.snapshot.operations] == [OP]
        ex.run(Step("dispatch", lane=2))
    assert forks == [set(), set()]  # two workers, forked here with no store open


def _zombie_children() -> list[int]:
    me = os.getpid()
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if fields[0] == "Z" and int(fields[1]) == me:
                found.append(int(entry))
    return found


def test_a_dispatcher_waiting_for_its_blocked_service_is_blocked_before_the_bound(
    reference: System,
) -> None:
    """With a bound of 20 s: a dispatcher whose service waits for the downstream lock
    (held by a direct delivery in lane 2, at its point inside the transaction) sleeps in
    poll, waiting for its service, which sleeps in SQLite's busy handler. The lane's
    process tree is looked at, so it is judged blocked in milliseconds, not at the bound
    (a second per such step by default), and moves on once the holder finishes."""
    with Executor(reference, concurrency=2, block_bound=20.0) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        ex.run(Step("service", OP, P, lane=2, hold=True))
        while ex.lanes[2].point != "service_before_commit":
            ex.run(Step("release", lane=2))
        ex.run(Step("dispatch", lane=1, hold=True))
        began = time.monotonic()
        while ex.lanes[1].status == "held":
            ex.run(Step("release", lane=1))
        assert ex.lanes[1].status == "blocked", ex.lanes[1].points
        assert time.monotonic() - began < 10.0
        leader = ex.lanes[1].pid
        assert Path(f"/proc/{leader}/task/{leader}/children").read_text().split()
        ex.run(Step("finish", lane=2))
        ex.run(Step("finish", lane=1))
        assert [lane.status for lane in ex.lanes.values()] == ["exited", "exited"]
        assert len(ex.snapshot.tickets) == 1


def test_a_dispatcher_killed_while_its_service_waits_leaves_no_zombie(
    reference: System,
) -> None:
    """A dispatcher whose service waits for the downstream lock (held by a direct delivery
    in lane 2, at its point inside the transaction) is blocked; kill it: its service (same
    group) dies too and is reaped at once (by the starter's helper, a child subreaper, or
    by this process, a child subreaper as the faultlab program is), not only when the trace
    ends: the lane starts another worker, and a long exploration would pile up zombies."""
    from faultlab.process.spawn import become_subreaper

    become_subreaper()
    before = set(_zombie_children())
    with Executor(reference, concurrency=2) as ex:
        ex.run(Step("accept", OP, P, lane=1))
        ex.run(Step("service", OP, P, lane=2, hold=True))
        while ex.lanes[2].point != "service_before_commit":
            ex.run(Step("release", lane=2))
        ex.run(Step("dispatch", lane=1, hold=True))
        while ex.lanes[1].status == "held":
            ex.run(Step("release", lane=1))
        assert ex.lanes[1].status == "blocked", ex.lanes[1].points
        leader = ex.lanes[1].pid  # its service is alive, waiting for the lock
        assert Path(f"/proc/{leader}/task/{leader}/children").read_text().split()
        ex.run(Step("kill", lane=1))
        ex.run(Step("finish", lane=2))
        ex.run(Step("dispatch", lane=1))  # lane 1 starts its next worker
        time.sleep(0.2)  # a zombie would have been reparented by now
        assert set(_zombie_children()) - before == set()


_BUSY_WAITER = """
import os, sqlite3, sys
from faultlab.nemesis import schedule
if sys.argv[2] == "scheduled":  # as a lane worker: the control pipe, and with it the handler
    read_end, write_end = os.pipe()
    os.environ[schedule.SCHEDULE_ENV] = f"{read_end},{write_end}"
    schedule.arm_from_environment()
connection = sqlite3.connect(sys.argv[1], timeout=schedule.SCHEDULED_BUSY_TIMEOUT,
                             isolation_level=None)
connection.execute("BEGIN IMMEDIATE")  # waits in SQLite's busy handler for the test's lock
connection.execute("COMMIT")
print("acquired", flush=True)
"""


def _woken_retries(pid: int, wakes: int, window: float) -> int:
    """How many of ``wakes`` wakes were followed, within ``window`` seconds, by the process
    sleeping again in nanosleep after running (a retry of its lock that failed)."""
    from faultlab.run.interleaving import _lock_waiting, _sleeps, _wake

    retried = 0
    for _ in range(wakes):
        before = _sleeps(pid)
        _wake(pid)
        end = time.monotonic() + window
        while time.monotonic() < end:
            if _sleeps(pid) > before and _lock_waiting(pid):
                retried += 1
                break
            time.sleep(0.0005)
        time.sleep(window)  # the next wake starts from a settled sleep
    return retried


@pytest.mark.parametrize("mode", ["scheduled", "unscheduled"])
def test_a_lane_worker_woken_in_the_busy_handler_retries_its_lock_at_once(
        tmp_path: Path, mode: str) -> None:
    """The executor judges a lane blocked on a lock in milliseconds because a scheduled
    worker, woken from SQLite's busy-handler sleep (which lasts up to 100 ms), retries its
    lock at once and sleeps again. A process without the handler (here: not a scheduled
    worker) ignores the signal and is not harmed: it retries only when its own sleep
    ends, so few wakes are followed by a retry in the window (the negative control)."""
    import sqlite3
    import subprocess
    import sys

    from faultlab.process.spawn import child_environment
    from faultlab.run.interleaving import _lock_waiting

    database = tmp_path / "lock.sqlite"
    holder = sqlite3.connect(database, isolation_level=None)
    holder.execute("CREATE TABLE t (x)")
    holder.execute("BEGIN IMMEDIATE")
    waiter = subprocess.Popen([sys.executable, "-c", _BUSY_WAITER, str(database), mode],
                              stdout=subprocess.PIPE, text=True, env=child_environment())
    try:
        end = time.monotonic() + 20
        while not _lock_waiting(waiter.pid) and time.monotonic() < end:
            time.sleep(0.01)
        time.sleep(0.5)  # past the busy handler's short first sleeps: 100 ms each now
        retried = _woken_retries(waiter.pid, wakes=20, window=0.02)
        assert waiter.poll() is None  # alive, still waiting for the lock
        if mode == "scheduled":
            assert retried >= 15, retried
        else:
            assert retried <= 10, retried
        holder.execute("COMMIT")
        assert waiter.communicate(timeout=20)[0] == "acquired\n"
        assert waiter.returncode == 0
    finally:
        if waiter.poll() is None:
            waiter.kill()
            waiter.wait()
        holder.close()


def test_one_executor_runs_both_kinds_of_trace_and_refuses_a_step_of_the_other(
        reference: System) -> None:
    """The one executor: a sequential trace runs one worker to its end per step (no lane,
    no clock unless the system asks for one); a laned trace keeps its workers in lanes.
    Each refuses, before any process starts, a step only the other kind can run."""
    with Executor(reference) as sequential:
        assert not sequential.laned and sequential.clock is None
        first = sequential.run(Step("accept", OP, P))
        assert first.lanes == () and first.record.exit_code == 0 and first.processes == 1
        with pytest.raises(UsageError, match="names no lane"):
            sequential.run(Step("dispatch", lane=1))
        assert len(sequential.observations) == 1
    with Executor(reference, concurrency=2) as laned:
        assert laned.laned and laned.clock is not None
        held = laned.run(Step("accept", OP, P, lane=1, hold=True))
        assert held.lanes[0].startswith("accept @") and held.processes == 1
        with pytest.raises(UsageError, match="needs a lane"):
            laned.run(Step("dispatch"))
        assert len(laned.observations) == 1 and laned.workers == 1


def _helpers_started(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The pids of the lanes' helpers this process starts from now on; and it must fork
    nothing itself (``os.fork`` fails the test)."""
    started: list[int] = []
    real_init = starter.Starter.__init__

    def watched_init(self: starter.Starter, *args: Any, **kwargs: Any) -> None:
        real_init(self, *args, **kwargs)
        started.append(self.pid)

    def no_fork() -> int:
        raise AssertionError("this process forked")

    monkeypatch.setattr(starter.Starter, "__init__", watched_init)
    monkeypatch.setattr(os, "fork", no_fork)
    return started


def test_a_run_starts_its_lanes_helper_once_and_ends_it_with_its_spawner(
        reference: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every laned trace of a run starts its workers through one helper, started at the
    run's first start (not once a trace), and ended with the run's spawner: no child of
    this process is left once it closes."""
    from faultlab.process.spawn import spawner as run_spawner
    from faultlab.search.explore import explore

    forked = _helpers_started(monkeypatch)
    with run_spawner("fork") as runner:
        outcome = explore(reference, runner, concurrency=2, examples=6, seed_value=1)
        assert outcome.trace is None
        assert outcome.stats()["examples"] >= 4  # several traces ...
        assert len(forked) == 1  # ... one helper
        helper = forked[0]
        assert Path(f"/proc/{helper}").exists()
    with pytest.raises(ChildProcessError):
        os.waitpid(helper, os.WNOHANG)  # ended and reaped as the spawner closed


def test_a_run_makes_its_lanes_helper_again_for_another_system(
        reference: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """A helper prepared with one system serves that system's traces only: a trace of
    another system (``mutants`` explores many in one run) gets a new helper, prepared with
    that system loaded (its workers import nothing from disk), and the first is ended and
    reaped then."""
    from faultlab.process.spawn import spawner as run_spawner

    forked = _helpers_started(monkeypatch)
    trace = [Step("accept", OP, P, lane=1), Step("dispatch", lane=2)]
    with run_spawner("fork") as runner:
        for system in (reference, reference, load_system("no-fencing")):
            execute(system, trace, runner, concurrency=2, settle=True)
        assert len(forked) == 2  # one helper for the reference's two traces, one more
        first, second = forked
        with pytest.raises(ChildProcessError):
            os.waitpid(first, os.WNOHANG)  # ended and reaped when the system changed
        assert Path(f"/proc/{second}").exists()
    with pytest.raises(ChildProcessError):
        os.waitpid(second, os.WNOHANG)


def test_an_enumeration_in_lanes_starts_one_helper_for_every_sequence(
        reference: System, monkeypatch: pytest.MonkeyPatch) -> None:
    """``enumerate --concurrency N`` runs every sequence through one spawner: one lanes'
    helper for the whole walk (not one per sequence), ended and reaped when the
    enumeration returns."""
    from faultlab.search.schedule_enumeration import enumerate_concurrent

    forked = _helpers_started(monkeypatch)
    result = enumerate_concurrent(reference, concurrency=2, max_steps=1)
    assert result.finding is None
    assert result.sequences >= 4  # several sequences ...
    assert len(forked) == 1  # ... one helper
    with pytest.raises(ChildProcessError):
        os.waitpid(forked[0], os.WNOHANG)  # ended and reaped with the enumeration's spawner
