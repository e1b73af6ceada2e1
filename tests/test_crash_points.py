"""Every reference crash point, and the statement points sql:K / commit:K, do what they say."""

from __future__ import annotations

import json
from typing import Any

import pytest

from faultlab.base.errors import UsageError
from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.run.observation import Observation
from faultlab.stores.sqlite import Snapshot
from faultlab.system import System
from faultlab.trace import Step

OP = "operation-001"
PAYLOAD = {"project": "demo-agent", "title": "crash points", "priority": "normal"}
CANONICAL = json.dumps(PAYLOAD, sort_keys=True, separators=(",", ":"))
RECEIPT = (OP, CANONICAL, '{"ticket_id":1}')

# point -> (worker exit, service exit or None, rows after the crash, recovery replays?)
# rows: (operation state/result, outbox state, tickets, receipts); None: no row.
DISPATCH_POINTS: dict[str, dict[str, Any]] = {
    "before_dispatch": {
        "exit": -9, "service_exit": None, "tickets": 0, "replayed": False,
    },
    "after_downstream_commit": {
        "exit": -9, "service_exit": None, "tickets": 1, "replayed": True,
    },
    "during_completion": {
        "exit": -9, "service_exit": None, "tickets": 1, "replayed": True,
    },
    "service_before_commit": {
        "exit": 4, "service_exit": -9, "tickets": 0, "replayed": False,
    },
    "service_after_commit": {
        "exit": 4, "service_exit": -9, "tickets": 1, "replayed": True,
    },
}


def test_reference_declares_the_documented_points(reference: System) -> None:
    declared = {p.name: p.role for p in reference.crash_points}
    assert declared == {
        "during_accept": "accept",
        "before_dispatch": "dispatch",
        "after_downstream_commit": "dispatch",
        "during_completion": "dispatch",
        "service_before_commit": "service",
        "service_after_commit": "service",
    }
    assert all(p.expected for p in reference.crash_points)


def _assert_recovered(observation: Observation) -> None:
    """Exactly one ticket, the operation and outbox row complete, results all agree."""
    after = observation.snapshot
    assert observation.record.exit_code == 0
    assert observation.violations == ()
    response = observation.record.response
    assert response is not None and response["result"] == {"ticket_id": 1}
    assert len(after.tickets) == 1
    assert [(o.id, o.state, o.result) for o in after.operations] == [
        (OP, "complete", '{"ticket_id":1}')
    ]
    assert [(o.operation_id, o.state) for o in after.outbox] == [(OP, "complete")]
    assert [tuple(r) for r in after.receipts] == [RECEIPT]


def test_during_accept_leaves_nothing_and_accepting_again_works(
    reference: System, fork_spawner: Spawner,
) -> None:
    execution = execute(reference, [
        Step("accept", OP, PAYLOAD, crash="during_accept"),
        Step("accept", OP, PAYLOAD),
        Step("dispatch"),
    ], fork_spawner)
    crashed, accept, recovery = execution.observations
    assert crashed.record.exit_code == -9
    assert crashed.record.response is None
    assert crashed.crashed
    assert crashed.snapshot == Snapshot()
    assert accept.record.exit_code == 0 and accept.snapshot.counts()["outbox_pending"] == 1
    _assert_recovered(recovery)
    assert execution.violations == []


@pytest.mark.parametrize("point", list(DISPATCH_POINTS))
def test_dispatch_crash_point(reference: System, fork_spawner: Spawner, point: str) -> None:
    expected = DISPATCH_POINTS[point]
    execution = execute(reference, [
        Step("accept", OP, PAYLOAD),
        Step("dispatch", crash=point),
        Step("dispatch"),
    ], fork_spawner, settle=True)
    accept, crashed, recovery = execution.observations
    assert accept.record.exit_code == 0
    record = crashed.record
    assert record.exit_code == expected["exit"]
    assert crashed.crashed
    if expected["service_exit"] is None:
        assert record.response is None  # killed before it could answer
    else:
        assert record.response is not None
        assert record.response["error"] == "downstream_failure"
        assert record.response["service"]["exit_code"] == expected["service_exit"]
        assert record.response["service"]["pid"] != record.pid
    after = crashed.snapshot
    # the caller never records completion: both rows still pending, no result
    assert [(o.id, o.state, o.result) for o in after.operations] == [(OP, "pending", None)]
    assert [(o.operation_id, o.state) for o in after.outbox] == [(OP, "pending")]
    assert len(after.tickets) == expected["tickets"]
    assert [tuple(r) for r in after.receipts] == ([RECEIPT] if expected["tickets"] else [])
    assert crashed.violations == ()

    _assert_recovered(recovery)
    assert recovery.record.response is not None
    assert recovery.record.response["replayed"] is expected["replayed"]
    assert recovery.record.pid != record.pid
    assert execution.final_violations == []  # settle found nothing left to do


@pytest.mark.parametrize("point", ["service_before_commit", "service_after_commit"])
def test_service_point_on_a_direct_service_call(
    reference: System, fork_spawner: Spawner, point: str,
) -> None:
    execution = execute(reference, [
        Step("accept", OP, PAYLOAD),
        Step("service", OP, PAYLOAD, crash=point),
    ], fork_spawner)
    service = execution.observations[-1]
    assert service.record.exit_code == -9
    assert service.record.response is None
    committed = point == "service_after_commit"
    assert len(service.snapshot.tickets) == int(committed)
    assert len(service.snapshot.receipts) == int(committed)


def test_a_point_of_another_role_is_refused_before_running(
    reference: System, fork_spawner: Spawner,
) -> None:
    before = fork_spawner.processes
    with pytest.raises(UsageError, match="unknown crash point 'before_dispatch'"):
        execute(reference, [Step("accept", OP, PAYLOAD, crash="before_dispatch")], fork_spawner)
    with pytest.raises(UsageError, match="unknown crash point"):
        execute(reference, [Step("dispatch", crash="nowhere")], fork_spawner)
    assert fork_spawner.processes == before


# --- statement points ---------------------------------------------------------------------

# An accept runs: PRAGMA application_id, PRAGMA synchronous, BEGIN IMMEDIATE, SELECT,
# INSERT operation, INSERT outbox, COMMIT. Killed before any of them: nothing is kept.
@pytest.mark.parametrize("point", [f"sql:{k}" for k in range(1, 8)])
def test_accept_killed_before_any_statement_keeps_nothing(
    reference: System, fork_spawner: Spawner, point: str,
) -> None:
    (observation,) = execute(reference, [Step("accept", OP, PAYLOAD, crash=point)],
                             fork_spawner).observations
    assert observation.record.exit_code == -9
    assert observation.record.response is None
    assert observation.snapshot == Snapshot()
    assert observation.violations == ()


def test_accept_killed_right_after_commit_keeps_both_rows(
    reference: System, fork_spawner: Spawner,
) -> None:
    execution = execute(reference, [Step("accept", OP, PAYLOAD, crash="commit:1")],
                        fork_spawner, settle=True)
    crashed = execution.observations[0]
    assert crashed.record.exit_code == -9
    assert crashed.record.response is None  # died before acknowledging
    assert [(o.id, o.payload, o.state, o.result) for o in crashed.snapshot.operations] == [
        (OP, CANONICAL, "pending", None)
    ]
    assert [(o.operation_id, o.state) for o in crashed.snapshot.outbox] == [(OP, "pending")]
    _assert_recovered(execution.observations[-1])
    assert execution.final_violations == []


def test_a_statement_point_never_reached_does_not_fire(
    reference: System, fork_spawner: Spawner,
) -> None:
    (observation,) = execute(reference, [Step("accept", OP, PAYLOAD, crash="sql:99")],
                             fork_spawner).observations
    assert observation.record.exit_code == 0
    assert observation.record.response == {"accepted": True, "operation_id": OP,
                                           "state": "pending"}
    assert not observation.crashed


# A dispatch runs PRAGMA, PRAGMA, SELECT on the caller; its service child is a separate
# process and is not armed; then PRAGMA, PRAGMA, BEGIN, UPDATE, UPDATE, COMMIT complete it.
DISPATCH_STATEMENTS = {
    "sql:3": (0, "pending"),       # before reading the outbox: no downstream call
    "sql:4": (1, "pending"),       # downstream committed, completion not started
    "sql:9": (1, "pending"),       # before the completion COMMIT: rolled back
    "commit:1": (1, "complete"),   # completion committed, killed before replying
}


@pytest.mark.parametrize(("mode", "point"), [
    *(("fork", point) for point in DISPATCH_STATEMENTS),
    # the points where a forked service used to inherit its dispatcher's armed counter
    ("exec", "sql:4"), ("exec", "commit:1"),
])
def test_dispatch_statement_points_match_in_both_modes(
    reference: System, fork_spawner: Spawner, exec_spawner: Spawner, point: str, mode: str,
) -> None:
    runner = fork_spawner if mode == "fork" else exec_spawner
    execution = execute(reference, [Step("accept", OP, PAYLOAD), Step("dispatch", crash=point)],
                        runner, settle=True)
    crashed = execution.observations[1]
    tickets, state = DISPATCH_STATEMENTS[point]
    assert crashed.record.exit_code == -9  # the dispatcher itself, not its service
    assert crashed.record.response is None
    assert len(crashed.snapshot.tickets) == tickets
    assert [o.state for o in crashed.snapshot.operations] == [state]
    assert [o.state for o in crashed.snapshot.outbox] == [state]
    assert execution.violations == []
    final = execution.observations[-1].snapshot
    assert [o.state for o in final.operations] == ["complete"] and len(final.tickets) == 1


def test_statement_point_on_a_service_step(reference: System, fork_spawner: Spawner) -> None:
    # service: PRAGMA, PRAGMA, BEGIN, SELECT receipt, INSERT ticket, INSERT receipt, COMMIT
    execution = execute(reference, [
        Step("accept", OP, PAYLOAD),
        Step("service", OP, PAYLOAD, crash="commit:1"),
        Step("dispatch"),
    ], fork_spawner)
    _, service, recovery = execution.observations
    assert service.record.exit_code == -9
    assert [tuple(r) for r in service.snapshot.receipts] == [RECEIPT]
    _assert_recovered(recovery)
    assert recovery.record.response is not None and recovery.record.response["replayed"] is True
