"""Fast unit tests of the pure functions under the search: shrinking, the could-the-machine-
draw-it filter, the enumerator's state key. No worker process runs here."""

from __future__ import annotations

import sqlite3
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from faultlab.checks.history import History
from faultlab.checks.invariants import Model, Violation
from faultlab.process.records import ProcessRecord
from faultlab.run.observation import Execution, Observation, worker_observation
from faultlab.search.enumeration import history_for, state_key
from faultlab.search.shrink import machine_could_draw, minimise
from faultlab.stores.sqlite import Operation, Snapshot
from faultlab.system import load_system
from faultlab.system.builtin.reference import ReferenceOutbox
from faultlab.trace import Step, Trace

NO_HISTORY = History(ordering_key=None)
RECORD = ProcessRecord(pid=1, exit_code=0, response=None, stdout="", stderr="", elapsed=0.0)


def execution_of(steps: list[Step], fails: Callable[[list[Step]], int | None],
                 before: Snapshot | None = None) -> Execution:
    """A synthetic execution: ``fails(steps)`` names the 1-based step that violates ONE."""
    failing = fails(steps)
    observations = []
    for index, step in enumerate(steps, 1):
        violations = (Violation("ONE", "two tickets"),) if index == failing else ()
        observations.append(worker_observation(index, step, RECORD, before or Snapshot(),
                                               Snapshot(), violations))
        if violations:
            break
    return Execution(observations, [])


A = Step("accept", "op-1", {"title": "a"})
B = Step("accept", "op-2", {"title": "b"})
CRASH = Step("dispatch", crash="after_downstream_commit")
RECOVER = Step("dispatch")


def needs_a_then_crash_then_recover(steps: list[Step]) -> int | None:
    """Fails at the first plain dispatch after an accept of op-1 and an armed dispatch."""
    seen_a = seen_crash = False
    for index, step in enumerate(steps, 1):
        seen_a = seen_a or step == A
        if seen_a and step.action == "dispatch" and step.crash is not None:
            seen_crash = True
        elif seen_crash and step == RECOVER:
            return index
    return None


def test_minimise_deletes_every_step_the_failure_does_not_need_and_runs_no_candidate_twice(
) -> None:
    noisy = [B, A, B, RECOVER, CRASH, B, RECOVER, B, RECOVER]
    runs: list[tuple[str, ...]] = []

    def run(steps: list[Step]) -> Execution:
        runs.append(tuple(step.describe() for step in steps))
        return execution_of(steps, needs_a_then_crash_then_recover)

    started = time.perf_counter()
    original = execution_of(noisy, needs_a_then_crash_then_recover)
    trace = Trace("reference", True, noisy, expected=original.verdict)
    shrunk, execution = minimise(trace, original, run)
    assert shrunk.steps == [A, CRASH, RECOVER]
    assert execution.verdict.step == 3 and execution.verdict.invariants == ("ONE",)
    assert len(runs) == len(set(runs)), "a candidate was executed twice"
    assert shrunk.meta["hypothesis_steps"] == len(noisy)
    assert time.perf_counter() - started < 0.5


def test_minimise_keeps_a_crash_the_failure_needs_and_drops_one_it_does_not() -> None:
    armed_accept = Step("accept", "op-1", {"title": "a"}, "during_accept")

    def fails(steps: list[Step]) -> int | None:
        return needs_a_then_crash_then_recover([A if s == armed_accept else s for s in steps])

    steps = [armed_accept, CRASH, RECOVER]
    original = execution_of(steps, fails)
    shrunk, _ = minimise(Trace("reference", True, steps, expected=original.verdict), original,
                         lambda candidate: execution_of(candidate, fails))
    assert shrunk.steps == [A, CRASH, RECOVER]  # accept disarmed, dispatch still armed


def test_minimise_returns_a_trace_that_cannot_shrink_unchanged() -> None:
    steps = [A, CRASH, RECOVER]
    original = execution_of(steps, needs_a_then_crash_then_recover)
    trace = Trace("reference", True, steps, expected=original.verdict)
    calls: list[int] = []

    def run(candidate: list[Step]) -> Execution:
        calls.append(len(candidate))
        return execution_of(candidate, needs_a_then_crash_then_recover)

    shrunk, execution = minimise(trace, original, run)
    assert shrunk is trace and execution is original
    assert calls  # it did try: every shorter candidate passed


def test_machine_could_draw_refuses_service_calls_the_rules_never_make() -> None:
    service = Step("service", "op-1", {"title": "a"})
    changed = Step("service", "op-1", {"title": "a", "revision": 1})
    pending = Snapshot(operations=(Operation("op-1", '{"title":"a"}', "pending", None),))
    complete = Snapshot(operations=(Operation("op-1", '{"title":"a"}', "complete",
                                              '{"ticket_id":1}'),))

    def one(step: Step, before: Snapshot) -> Execution:
        return Execution([worker_observation(1, step, RECORD, before, before, ())], [])

    assert machine_could_draw(one(service, pending))
    assert not machine_could_draw(one(service, Snapshot()))  # an operation the caller lacks
    assert not machine_could_draw(one(changed, pending))  # a changed payload before completion
    assert machine_could_draw(one(changed, complete))  # the seed's conflict case


def _store(directory: Path, rows: list[tuple[str, str]]) -> None:
    directory.mkdir()
    connection = sqlite3.connect(directory / "caller.db")
    connection.execute("CREATE TABLE operations (id TEXT PRIMARY KEY, payload TEXT)")
    connection.executemany("INSERT INTO operations VALUES (?, ?)", rows)
    connection.commit()
    connection.close()


def test_state_key_sees_store_content_and_the_model_and_nothing_else(tmp_path: Path) -> None:
    _store(tmp_path / "a", [("op-1", "{}")])
    _store(tmp_path / "b", [("op-1", "{}")])
    _store(tmp_path / "c", [("op-1", '{"x":1}')])
    (tmp_path / "b" / "caller.db-journal").write_bytes(b"left by a SIGKILL")
    model = Model(acknowledged={"op-1": "{}"}, submitted={"op-1"})
    started = time.perf_counter()
    key_a = state_key(tmp_path / "a", model, NO_HISTORY)
    assert state_key(tmp_path / "b", model, NO_HISTORY) == key_a  # a journal is not state
    assert state_key(tmp_path / "c", model, NO_HISTORY) != key_a  # a row's content is
    assert state_key(tmp_path / "a", Model(submitted={"op-1"}), NO_HISTORY) != key_a  # the model is
    assert time.perf_counter() - started < 0.5


def _accepted(order: list[tuple[str, int, int]], *, key: str | None = "title",
              direct: tuple[str, ...] = ()) -> History:
    """A history in which each (operation, step its accept began, step it was acknowledged)."""
    history = History(ordering_key=key)
    history.began = {operation: began for operation, began, _ in order}
    history.acknowledged_at = {operation: acked for operation, _, acked in order}
    history.direct = set(direct)
    return history


def test_state_key_sees_which_acceptances_a_caller_saw_in_order(tmp_path: Path) -> None:
    same = '{"title":"t"}'  # one ordering key
    _store(tmp_path / "a", [("op-1", same), ("op-2", same)])
    model = Model(acknowledged={"op-1": same, "op-2": same}, submitted={"op-1", "op-2"})
    in_order = _accepted([("op-1", 1, 1), ("op-2", 2, 2)])
    # the same order at other steps is the same state: ORDER compares, it does not count
    assert (state_key(tmp_path / "a", model, in_order)
            == state_key(tmp_path / "a", model, _accepted([("op-1", 2, 3), ("op-2", 5, 5)])))
    # op-1's accept began first, but was acknowledged only after op-2's: no order to keep
    overlapping = _accepted([("op-1", 1, 3), ("op-2", 2, 2)])
    assert state_key(tmp_path / "a", model, overlapping) != state_key(tmp_path / "a", model,
                                                                      in_order)
    # an operation delivered directly is exempt from ORDER: a different state
    assert state_key(tmp_path / "a", model, _accepted([("op-1", 1, 1), ("op-2", 2, 2)],
                                                      direct=("op-1",))) != state_key(
        tmp_path / "a", model, in_order)
    # two keys: ORDER never compares the two, so their order is no part of the state
    apart = Model(acknowledged={"op-1": same, "op-2": '{"title":"u"}'},
                  submitted={"op-1", "op-2"})
    assert state_key(tmp_path / "a", apart, overlapping) == state_key(tmp_path / "a", apart,
                                                                      in_order)
    # a system without an ordering key: the order is nothing ORDER will ever read
    assert (state_key(tmp_path / "a", model, _accepted([("op-1", 1, 3), ("op-2", 2, 2)], key=None))
            == state_key(tmp_path / "a", model, NO_HISTORY))


def test_an_enumeration_keeps_the_acceptance_order_only_where_two_operations_share_a_key(
) -> None:
    reference = load_system("reference")
    # the reference orders by title, and enumerate gives each operation a title of its own
    assert reference.ordering_key == "title"
    assert history_for(reference, operations=3).ordering_key is None

    class ByPriority(ReferenceOutbox):
        ordering_key = "priority"  # every enumerated payload is "normal": one key

    assert history_for(ByPriority(), operations=2).ordering_key == "priority"
    assert history_for(ByPriority(), operations=1).ordering_key is None


def _leases(directory: Path, rows: list[tuple[str, float]]) -> Path:
    directory.mkdir()
    connection = sqlite3.connect(directory / "caller.sqlite")
    connection.execute("CREATE TABLE outbox (operation_id TEXT PRIMARY KEY, lease_until REAL)")
    connection.executemany("INSERT INTO outbox VALUES (?, ?)", rows)
    connection.commit()
    connection.close()
    return directory


def test_state_key_sees_the_order_of_stored_wall_clock_times_not_their_values(
    tmp_path: Path,
) -> None:
    since = time.time() - 1.0
    now = time.time()
    model = Model(submitted={"op-1", "op-2"})
    early = _leases(tmp_path / "early", [("op-1", now - 0.5), ("op-2", now - 0.2)])
    later = _leases(tmp_path / "later", [("op-1", now - 0.3), ("op-2", now - 0.1)])
    swapped = _leases(tmp_path / "swapped", [("op-1", now - 0.1), ("op-2", now - 0.3)])
    tied = _leases(tmp_path / "tied", [("op-1", now - 0.1), ("op-2", now - 0.1)])
    running = _leases(tmp_path / "running", [("op-1", now - 0.5), ("op-2", now + 60)])
    running_too = _leases(tmp_path / "running-too", [("op-1", now - 0.5), ("op-2", now + 61)])
    def key(directory: Path, *, exact: bool = False) -> str:
        return state_key(directory, model, NO_HISTORY, since=None if exact else since)

    # a dispatch an instant later leaves the same state: the next worker runs later still
    assert key(early) == key(later)
    assert key(early, exact=True) != key(later, exact=True)  # without since: exact values
    # which lease is older, and which are equal, a worker can tell apart
    assert key(swapped) != key(later)
    assert key(tied) != key(later)
    # a lease still running is kept exact
    assert key(running) != key(running_too)


# -- the same shrinker over scheduling choices (a concurrent trace), still without processes


def lane_execution(steps: list[Step], fails: Callable[[list[Step]], int | None]
                   ) -> Execution:
    """A synthetic concurrent execution run leniently as shrinking runs one: a ``release``
    of a lane with no held worker is dropped; ``fails(ran)`` names the 1-based failing step."""
    ran: list[Step] = []
    held: set[int | None] = set()
    for step in steps:
        if step.action == "release" and step.lane not in held:
            continue  # its worker's start was deleted: dropped, as execute does
        if step.hold:
            held.add(step.lane)
        elif step.action == "release":
            held.discard(step.lane)
        ran.append(step)
    failing = fails(ran)
    observations = []
    for index, step in enumerate(ran, 1):
        violations = (Violation("FENCE", "a stale holder completed"),) if index == failing \
            else ()
        observations.append(Observation(index, step, Snapshot(), Snapshot(), violations))
        if violations:
            break
    return Execution(observations, [], lanes=2)


ACCEPTED = {"title": "a"}


def needs_an_accept_ten_ticks_then_a_dispatch(steps: list[Step]) -> int | None:
    """Fails at a dispatch run after an acceptance ended (a run, or a start released later)
    and at least 10 ticks after it."""
    ended = False
    ticks = 0
    starts: dict[int | None, bool] = {}
    for index, step in enumerate(steps, 1):
        if step.action == "accept" and not step.hold:
            ended = True
        elif step.hold:
            starts[step.lane] = step.action == "accept"
        elif step.action == "release" and starts.pop(step.lane, False):
            ended = True
        elif step.action == "tick" and ended:
            ticks += step.ticks or 0
        elif step.action == "dispatch" and not step.hold and ended and ticks >= 10:
            return index
    return None


def test_one_shrinker_merges_ticks_and_turns_a_held_start_into_a_run_over_lanes() -> None:
    noisy = [Step("accept", "op-1", ACCEPTED, lane=1, hold=True), Step("release", lane=1),
             Step("tick", ticks=4), Step("tick", ticks=6),
             Step("dispatch", lane=2)]
    runs: list[tuple[str, ...]] = []

    def run(steps: list[Step]) -> Execution:
        runs.append(tuple(step.describe() for step in steps))
        return lane_execution(steps, needs_an_accept_ten_ticks_then_a_dispatch)

    original = lane_execution(noisy, needs_an_accept_ten_ticks_then_a_dispatch)
    assert original.verdict.step == 5
    trace = Trace(system="no-fencing", deduplication=True, concurrency=2, steps=noisy,
                  expected=original.verdict)
    shrunk, execution = minimise(trace, original, run)
    assert [step.describe() for step in shrunk.steps] == [
        "L1 run accept(op-1, {})", "tick(10)", "L2 run dispatch()"]
    assert execution.verdict.step == 3 and shrunk.expected == execution.verdict
    assert shrunk.meta["hypothesis_steps"] == 5 and shrunk.concurrency == 2
    assert len(runs) == len(set(runs)), "a candidate was executed twice"


def test_one_shrinker_makes_a_power_cut_its_simplest_in_either_kind_of_trace() -> None:
    """A power cut whose choice the failure does not need shrinks to drop_all, in a
    sequential trace and in a concurrent one alike."""
    kept_one = {"kind": "prefix", "keep": 1}

    def needs_a_power_cut(steps: list[Any]) -> int | None:
        return next((i for i, s in enumerate(steps, 1) if s.action == "power"), None)

    sequential = [A, Step.power(kept_one)]
    original = execution_of(sequential, needs_a_power_cut)
    shrunk, _ = minimise(Trace("reference-power", True, sequential, expected=original.verdict),
                         original, lambda steps: execution_of(steps, needs_a_power_cut))
    assert [step.choice for step in shrunk.steps] == [{"kind": "drop_all"}]

    lanes = [Step("accept", "op-1", ACCEPTED, lane=1), Step.power(kept_one)]
    started = lane_execution(lanes, needs_a_power_cut)
    shrunk_lanes, _ = minimise(
        Trace(system="reference-power", deduplication=True, concurrency=2, steps=lanes,
              expected=started.verdict),
        started, lambda steps: lane_execution(steps, needs_a_power_cut))
    assert [step.choice for step in shrunk_lanes.steps] == [{"kind": "drop_all"}]


def fails_with_an_even_number_of_accepts(steps: list[Step]) -> int | None:
    """Fails at a dispatch that comes after an even number of acceptances (none too)."""
    accepts = 0
    for index, step in enumerate(steps, 1):
        if step.action == "accept":
            accepts += 1
        elif step.action == "dispatch" and accepts % 2 == 0:
            return index
    return None


def test_the_lane_shrinker_deletes_two_steps_apart_that_only_go_together() -> None:
    """Neither acceptance can go alone, nor can any run of steps: only the two together.
    The shrinker deletes that pair (a trace this short tries every pair)."""
    noisy = [Step("accept", "op-1", ACCEPTED, lane=1), Step("tick", ticks=5),
             Step("accept", "op-2", ACCEPTED, lane=2), Step("dispatch", lane=1)]
    original = lane_execution(noisy, fails_with_an_even_number_of_accepts)
    assert original.verdict.step == 4
    trace = Trace(system="no-fencing", deduplication=True, concurrency=2, steps=noisy,
                  expected=original.verdict)
    shrunk, execution = minimise(trace, original, lambda steps: lane_execution(
        steps, fails_with_an_even_number_of_accepts))
    assert [step.describe() for step in shrunk.steps] == ["L1 run dispatch()"]
    assert execution.verdict.step == 1


def test_the_sequential_shrinker_deletes_two_steps_that_only_go_together() -> None:
    """The same pair deletion shrinks a sequential trace: neither acceptance can go alone."""
    steps = [A, B, RECOVER]
    original = execution_of(steps, fails_with_an_even_number_of_accepts)
    assert original.verdict.step == 3
    shrunk, execution = minimise(
        Trace("reference", True, steps, expected=original.verdict), original,
        lambda candidate: execution_of(candidate, fails_with_an_even_number_of_accepts))
    assert shrunk.steps == [RECOVER] and execution.verdict.step == 1
