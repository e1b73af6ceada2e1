"""The one recorder counts a one-lane step and a scheduling choice the same way, from what
each says of itself: plain data, no process runs here."""

from __future__ import annotations

from faultlab.checks.invariants import (
    HISTORY_INVARIANTS,
    STEP_INVARIANTS,
    UNCLAIMED_HISTORY,
    Violation,
)
from faultlab.process.records import ProcessRecord
from faultlab.run.executor import checks_after
from faultlab.run.observation import Observation, worker_observation
from faultlab.search.recorder import Recorder
from faultlab.stores.sqlite import Snapshot
from faultlab.trace import Step, Verdict

P = {"amount": 1}


def _record(pid: int, exit_code: int, service: dict[str, object] | None = None
            ) -> ProcessRecord:
    response = None if service is None else {"service": service}
    return ProcessRecord(pid=pid, exit_code=exit_code, response=response, stdout="",
                         stderr="", elapsed=0.0)


def test_a_one_lane_step_counts_its_sigkills_checks_and_fired_point() -> None:
    recorder: Recorder = Recorder()
    killed = _record(11, -9, {"exit_code": -9})  # the dispatcher and its service
    step = Step("dispatch", crash="after_downstream_commit")
    recorder.observe(worker_observation(1, step, killed, Snapshot(), Snapshot(), ()))
    assert (recorder.steps, recorder.sigkills) == (1, 2)
    assert recorder.checks == len(STEP_INVARIANTS) + len(UNCLAIMED_HISTORY)  # TERM, ORDER
    assert (recorder.held, recorder.blocked) == (0, 0)
    assert recorder.crash_hits["after_downstream_commit"] == 1
    assert recorder.actions == {"dispatch": 1}
    no_process = ProcessRecord(pid=0, exit_code=0, response=None, stdout="", stderr="",
                               elapsed=0.0)
    cut = worker_observation(2, Step.power({"kind": "drop_all"}), no_process, Snapshot(),
                             Snapshot(), ())
    assert [o.processes for o in (
        worker_observation(1, step, killed, Snapshot(), Snapshot(), ()), cut)] == [2, 0]


def test_a_scheduling_choice_counts_held_and_blocked_lanes_and_each_ended_worker() -> None:
    recorder: Recorder = Recorder()
    ended = ((1, _record(21, 0)), (2, _record(22, 0)))
    recorder.observe(Observation(
        1, Step("release", lane=1), Snapshot(), Snapshot(), (), exited=ended,
        lanes=("dispatch @after_claim", "accept blocked"), sigkills=1,
        checks=checks_after(len(ended))))
    assert (recorder.held, recorder.blocked, recorder.sigkills) == (1, 1, 1)
    per_step = len(STEP_INVARIANTS) - 1  # QUIET is judged apart in lanes
    assert recorder.checks == 2 * per_step + len(HISTORY_INVARIANTS)
    recorder.observe(Observation(2, Step("tick", ticks=1), Snapshot(), Snapshot(), (),
                                 lanes=("-", "-"), checks=checks_after(0)))
    assert recorder.held == 1 and recorder.checks == 3 * per_step + 2 * len(HISTORY_INVARIANTS)


def test_finish_counts_operations_deliveries_processes_and_the_first_failure() -> None:
    lanes: Recorder = Recorder()
    steps = [Step("accept", "op-1", P, lane=1), Step("accept", "op-2", P, lane=2, hold=True),
             Step("release", lane=2), Step("service", "op-1", P, lane=1)]
    lanes.finish(steps, Verdict(), [], processes=3, live=True)
    one_violation = [Violation("DONE", "operation op-1 stayed pending")]
    lanes.finish(steps[:1], Verdict.of(1, one_violation), one_violation, processes=1)
    assert (lanes.examples, lanes.processes) == (2, 4)
    assert lanes.operations_per_example == {2: 1, 1: 1}
    assert lanes.deliveries_per_example == {1: 1, 0: 1}
    assert lanes.coverage.checked["LIVE"] == 1
    assert lanes.first_failure_examples == 2 and lanes.first_failure is not None
    assert lanes.first_failure[0] == steps[:1]
    one: Recorder = Recorder()
    one.finish([Step("accept", "op-1", P), Step("dispatch"), Step("service", "op-1", P)],
               Verdict(), [], processes=3)
    assert one.operations_per_example == {1: 1} and one.deliveries_per_example == {1: 1}
    assert one.first_failure is None and one.coverage.checked["LIVE"] == 0
