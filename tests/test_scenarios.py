"""The five regression scenarios (docs/guide/own-system.md): figures, rows and PIDs, both spawns."""

from __future__ import annotations

import json
from typing import Any

import pytest

from faultlab.process.spawn import Spawner
from faultlab.system import System, load_system
from faultlab.trials.scenarios import FIXTURE_PAYLOAD, OPERATION_ID, SCENARIOS, Outcome

# Copied from the docs by hand, not from faultlab.trials.scenarios, so a drift in either
# shows.
SPEC_SUMMARIES: dict[str, dict[str, Any]] = {
    "crash_before_dispatch": {
        "crash_exit": -9, "tickets_before": 0, "tickets_after": 1,
        "caller_state": "complete", "ticket_id": 1,
    },
    "crash_after_downstream_commit": {
        "crash_exit": -9, "tickets_before": 1, "tickets_after": 1,
        "caller_state": "complete", "ticket_id": 1,
    },
    "deduplication_disabled": {
        "crash_exit": -9, "tickets_before": 1, "tickets_after": 2,
        "caller_state": "complete", "ticket_id": 2,
    },
    "crash_during_acceptance": {
        "crash_exit": -9, "partial_operations": 0, "partial_outbox": 0, "tickets_after": 1,
    },
    "changed_payload_rejected": {"exit_code": 3, "tickets_after": 1},
}
DISPATCHER_SCENARIOS = (
    "crash_before_dispatch", "crash_after_downstream_commit", "deduplication_disabled",
)
CANONICAL_FIXTURE = json.dumps(FIXTURE_PAYLOAD, sort_keys=True, separators=(",", ":"))


def _run_all(system: System, runner: Spawner) -> dict[str, Outcome]:
    return {scenario.name: scenario.run(system, runner) for scenario in SCENARIOS}


@pytest.fixture(scope="module")
def fork_outcomes(reference: System, fork_spawner: Spawner) -> dict[str, Outcome]:
    return _run_all(reference, fork_spawner)


@pytest.fixture(scope="module")
def exec_outcomes(reference: System, exec_spawner: Spawner) -> dict[str, Outcome]:
    return _run_all(reference, exec_spawner)


def test_the_five_scenarios_are_the_specs() -> None:
    assert [s.name for s in SCENARIOS] == list(SPEC_SUMMARIES)


@pytest.mark.parametrize("name", list(SPEC_SUMMARIES))
def test_summary_is_exactly_the_specs(fork_outcomes: dict[str, Outcome], name: str) -> None:
    outcome = fork_outcomes[name]
    assert outcome.failures == []
    assert outcome.passed
    assert outcome.summary == SPEC_SUMMARIES[name]
    # key order is part of the printed summary line
    assert list(outcome.summary) == list(SPEC_SUMMARIES[name])


@pytest.mark.parametrize("name", DISPATCHER_SCENARIOS)
def test_dispatcher_scenario_rows(fork_outcomes: dict[str, Outcome], name: str) -> None:
    outcome = fork_outcomes[name]
    accept, crashed, recovery, idle = outcome.execution.observations
    expected = SPEC_SUMMARIES[name]

    assert accept.record.exit_code == 0
    assert accept.record.response == {
        "accepted": True, "operation_id": OPERATION_ID, "state": "pending",
    }
    assert crashed.record.exit_code == -9
    assert crashed.record.killed
    assert crashed.record.response is None  # it died before answering

    before = crashed.snapshot
    assert [tuple(r) for r in before.operations] == [
        (OPERATION_ID, CANONICAL_FIXTURE, "pending", None)
    ]
    assert [tuple(r) for r in before.outbox] == [(OPERATION_ID, "pending")]
    assert len(before.tickets) == expected["tickets_before"]

    after = recovery.snapshot
    response = recovery.record.response
    assert recovery.record.exit_code == 0
    assert response is not None
    assert response["result"] == {"ticket_id": expected["ticket_id"]}
    operation = after.operation(OPERATION_ID)
    assert operation is not None
    assert operation.state == "complete"
    assert json.loads(operation.result or "null") == response["result"]
    assert [tuple(r) for r in after.outbox] == [(OPERATION_ID, "complete")]
    assert [t.id for t in after.tickets] == list(range(1, expected["tickets_after"] + 1))
    assert all(t.payload == CANONICAL_FIXTURE for t in after.tickets)

    pids = {crashed.record.pid, recovery.record.pid, response["service"]["pid"]}
    assert len(pids) == 3

    assert idle.record.exit_code == 0
    assert idle.record.response == {"idle": True}
    assert idle.snapshot == idle.before == after


def test_receipt_replays_after_downstream_commit(fork_outcomes: dict[str, Outcome]) -> None:
    outcome = fork_outcomes["crash_after_downstream_commit"]
    _, crashed, recovery, _ = outcome.execution.observations
    # the crashed dispatcher's service committed ticket and receipt before the kill
    assert [tuple(r) for r in crashed.snapshot.receipts] == [
        (OPERATION_ID, CANONICAL_FIXTURE, '{"ticket_id":1}')
    ]
    assert recovery.record.response is not None
    assert recovery.record.response["replayed"] is True
    receipt = recovery.snapshot.receipt(OPERATION_ID)
    assert receipt is not None
    assert json.loads(receipt.result) == recovery.record.response["result"]
    assert not outcome.execution.violations


def test_before_dispatch_makes_the_first_ticket_on_recovery(
    fork_outcomes: dict[str, Outcome],
) -> None:
    _, crashed, recovery, _ = fork_outcomes["crash_before_dispatch"].execution.observations
    assert crashed.snapshot.tickets == () and crashed.snapshot.receipts == ()
    assert recovery.record.response is not None
    assert recovery.record.response["replayed"] is False
    receipt = recovery.snapshot.receipt(OPERATION_ID)
    assert receipt is not None and json.loads(receipt.result) == {"ticket_id": 1}


def test_deduplication_disabled_is_caught_as_a_duplicate(
    fork_outcomes: dict[str, Outcome],
) -> None:
    outcome = fork_outcomes["deduplication_disabled"]
    _, crashed, recovery, _ = outcome.execution.observations
    assert crashed.snapshot.receipts == () and recovery.snapshot.receipts == ()
    assert [t.operation_id for t in recovery.snapshot.tickets] == [OPERATION_ID] * 2
    assert "ONE" in {v.invariant for v in outcome.execution.violations}
    assert outcome.passed  # the negative control passes by finding the duplicate


def test_crash_during_acceptance_rows(fork_outcomes: dict[str, Outcome]) -> None:
    outcome = fork_outcomes["crash_during_acceptance"]
    crashed, accept, dispatch, idle = outcome.execution.observations
    assert crashed.record.exit_code == -9
    assert crashed.record.response is None
    assert crashed.snapshot.operations == () and crashed.snapshot.outbox == ()
    assert accept.record.response is not None and accept.record.response["accepted"] is True
    assert "already_accepted" not in accept.record.response
    assert dispatch.record.response is not None
    assert dispatch.record.response["result"] == {"ticket_id": 1}
    after = dispatch.snapshot
    assert [(o.state, o.result) for o in after.operations] == [("complete", '{"ticket_id":1}')]
    assert [o.state for o in after.outbox] == ["complete"]
    assert len(after.tickets) == 1 and len(after.receipts) == 1
    assert idle.record.response == {"idle": True} and idle.snapshot == after
    assert len({crashed.record.pid, accept.record.pid, dispatch.record.pid}) == 3


def test_changed_payload_is_refused_and_changes_nothing(
    fork_outcomes: dict[str, Outcome],
) -> None:
    outcome = fork_outcomes["changed_payload_rejected"]
    conflict = outcome.execution.observations[-1]
    assert conflict.step.action == "service"
    assert conflict.step.payload == {**FIXTURE_PAYLOAD, "priority": "urgent"}
    assert conflict.record.exit_code == 3
    assert conflict.record.response == {"error": "payload_conflict", "operation_id": OPERATION_ID}
    assert conflict.snapshot == conflict.before
    assert len(conflict.snapshot.tickets) == 1
    assert conflict.snapshot.operation(OPERATION_ID).state == "complete"  # type: ignore[union-attr]


def test_evidence_records_have_the_seed_keys(fork_outcomes: dict[str, Outcome]) -> None:
    for name, outcome in fork_outcomes.items():
        for record in ("crash", "acceptance", "recovery"):
            assert set(outcome.evidence[record]) == {"pid", "exit_code", "response", "stderr"}
        for snapshot in ("before_recovery", "after_recovery"):
            assert set(outcome.evidence[snapshot]) == {
                "operations", "outbox", "tickets", "receipts"
            }, name
        assert outcome.evidence["crash"]["exit_code"] == -9


def _contents(outcome: Outcome) -> list[dict[str, Any]]:
    """Every store snapshot of a scenario, plus the exit code and response without PIDs."""
    contents = []
    for observation in outcome.execution.observations:
        response = dict(observation.record.response or {})
        service = response.pop("service", None)
        contents.append({
            "step": observation.step.to_json(),
            "exit": observation.record.exit_code,
            "service_exit": None if service is None else service["exit_code"],
            "response": response,
            "snapshot": observation.snapshot.to_json(),
        })
    return contents


@pytest.mark.parametrize("name", list(SPEC_SUMMARIES))
def test_exec_and_fork_modes_give_the_same_stores(
    fork_outcomes: dict[str, Outcome], exec_outcomes: dict[str, Outcome], name: str,
) -> None:
    assert exec_outcomes[name].passed
    assert exec_outcomes[name].summary == SPEC_SUMMARIES[name]
    assert _contents(exec_outcomes[name]) == _contents(fork_outcomes[name])


def test_exec_mode_really_runs_fresh_interpreters(exec_outcomes: dict[str, Outcome]) -> None:
    # an exec-mode worker is slower than a fork: it imports Python and faultlab first
    observations = exec_outcomes["crash_before_dispatch"].execution.observations
    assert min(o.record.elapsed for o in observations) > 0.02


def test_a_receiver_without_deduplication_fails_the_scenarios(fork_spawner: Spawner) -> None:
    system = load_system("systems_for_tests:ForgetfulOutbox")
    outcomes = _run_all(system, fork_spawner)
    failed = outcomes["crash_after_downstream_commit"]
    assert not failed.passed
    assert failed.summary["tickets_after"] == 2
    assert any("2 tickets after recovery, expected 1" in f for f in failed.failures)
    assert not outcomes["changed_payload_rejected"].passed
    assert outcomes["crash_before_dispatch"].failures  # RCPT: tickets without receipts
