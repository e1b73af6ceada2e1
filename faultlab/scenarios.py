"""The five regression scenarios of the seed lab, as fixed traces with expected figures.

Each scenario is a list of steps run by the one executor, plus a check that
turns the observations into the seed's summary and a list of failed checks.
A scenario passes when every check holds; ``deduplication_disabled`` passes
when the checker *does* report the duplicate ticket (it is a negative control).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlab.executor import Execution, Observation, execute
from faultlab.process import Spawner
from faultlab.records import KILLED, ProcessRecord
from faultlab.system.contract import System
from faultlab.trace import Step

OPERATION_ID = "operation-001"
FIXTURE_PAYLOAD: dict[str, str] = {
    "project": "demo-agent",
    "title": "Investigate the synthetic queue backlog",
    "priority": "normal",
}
CHANGED_PAYLOAD = {**FIXTURE_PAYLOAD, "priority": "urgent"}


@dataclass
class Outcome:
    """What one scenario showed: its summary figures and every check that failed."""

    name: str
    crash_point: str
    summary: dict[str, Any]
    failures: list[str]
    evidence: dict[str, Any]
    execution: Execution
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return not self.failures


@dataclass(frozen=True)
class Scenario:
    name: str
    crash_point: str
    description: str
    steps: tuple[Step, ...]
    judge: Callable[[Scenario, Execution], Outcome]
    deduplication: bool = True
    expected: dict[str, Any] = field(default_factory=dict)

    def run(self, system: System, spawner: Spawner, directory: Path | None = None) -> Outcome:
        execution = execute(
            system, self.steps, spawner, deduplication=self.deduplication, directory=directory
        )
        return self.judge(self, execution)


def process_json(record: ProcessRecord) -> dict[str, Any]:
    """The seed's process record: pid, exit code, response, stderr."""
    return {
        "pid": record.pid,
        "exit_code": record.exit_code,
        "response": record.response,
        "stderr": record.stderr,
    }


class _Checks:
    """Collects failed checks with the scenario's name in each message."""

    def __init__(self) -> None:
        self.failures: list[str] = []

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.failures.append(message)


def _ticket_count(observation: Observation) -> int:
    return len(observation.snapshot.tickets_for(OPERATION_ID))


def _judge_idle(checks: _Checks, idle: Observation) -> None:
    checks.expect(idle.record.response == {"idle": True},
                  f"a further dispatch answered {idle.record.response}, not idle")
    checks.expect(idle.snapshot == idle.before, "a further idle dispatch changed the stores")


def _judge_dispatcher(scenario: Scenario, execution: Execution) -> Outcome:
    """accept; dispatcher killed at the point; a fresh dispatcher recovers; then idle."""
    accept, crashed, recovery, idle = execution.observations
    checks = _Checks()
    expected = scenario.expected
    checks.expect(accept.record.exit_code == 0, f"accept exited {accept.record.exit_code}")
    checks.expect(crashed.record.killed,
                  f"crashed dispatcher exited {crashed.record.exit_code}, not {KILLED}")
    before, after = crashed.snapshot, recovery.snapshot
    operation = before.operation(OPERATION_ID)
    outbox = before.outbox_row(OPERATION_ID)
    checks.expect(operation is not None and operation.state == "pending"
                  and operation.result is None,
                  f"before recovery the operation is {operation}, not pending without result")
    checks.expect(outbox is not None and outbox.state == "pending",
                  f"before recovery the outbox row is {outbox}, not pending")
    tickets_before, tickets_after = _ticket_count(crashed), _ticket_count(recovery)
    checks.expect(tickets_before == expected["tickets_before"],
                  f"{tickets_before} tickets before recovery, "
                  f"expected {expected['tickets_before']}")
    checks.expect(tickets_after == expected["tickets_after"],
                  f"{tickets_after} tickets after recovery, expected {expected['tickets_after']}")
    operation = after.operation(OPERATION_ID)
    outbox = after.outbox_row(OPERATION_ID)
    response = recovery.record.response or {}
    result = response.get("result")
    checks.expect(recovery.record.exit_code == 0, f"recovery exited {recovery.record.exit_code}")
    checks.expect(operation is not None and operation.state == "complete",
                  f"after recovery the operation is {operation}, not complete")
    checks.expect(outbox is not None and outbox.state == "complete",
                  f"after recovery the outbox row is {outbox}, not complete")
    stored = json.loads(operation.result) if operation and operation.result else None
    checks.expect(stored == result and result is not None,
                  f"stored result {stored} differs from the recovering dispatcher's {result}")
    if scenario.deduplication:
        receipt = after.receipt(OPERATION_ID)
        receipt_result = json.loads(receipt.result) if receipt else None
        checks.expect(receipt_result == result,
                      f"receipt result {receipt_result} differs from the recovered {result}")
    ticket_id = (result or {}).get("ticket_id")
    checks.expect(ticket_id == expected["ticket_id"],
                  f"recovered ticket {ticket_id}, expected {expected['ticket_id']}")
    service_pid = (response.get("service") or {}).get("pid")
    pids = {crashed.record.pid, recovery.record.pid, service_pid}
    checks.expect(len(pids) == 3 and None not in pids,
                  f"crashed, recovering and service PIDs are not three distinct PIDs: {pids}")
    _judge_idle(checks, idle)
    _judge_violations(checks, scenario, execution)
    summary = {
        "crash_exit": crashed.record.exit_code,
        "tickets_before": tickets_before,
        "tickets_after": tickets_after,
        "caller_state": operation.state if operation else None,
        "ticket_id": ticket_id,
    }
    evidence = {
        "acceptance": process_json(accept.record),
        "crash": process_json(crashed.record),
        "recovery": process_json(recovery.record),
        "before_recovery": before.to_json(),
        "after_recovery": after.to_json(),
    }
    return Outcome(scenario.name, scenario.crash_point, summary, checks.failures, evidence,
                   execution)


def _judge_violations(checks: _Checks, scenario: Scenario, execution: Execution) -> None:
    """With deduplication the invariants must all hold; without it, ONE must catch it."""
    found = sorted({v.invariant for v in execution.violations})
    if scenario.deduplication:
        checks.expect(not found, f"invariants violated: {', '.join(found)}")
    else:
        checks.expect("ONE" in found, "negative control: ONE did not catch the duplicate ticket")


def _judge_acceptance(scenario: Scenario, execution: Execution) -> Outcome:
    """acceptor killed during_accept; nothing left behind; accept again; dispatch; idle."""
    crashed, accept, dispatch, idle = execution.observations
    checks = _Checks()
    before = crashed.snapshot
    checks.expect(crashed.record.killed,
                  f"crashed acceptor exited {crashed.record.exit_code}, not {KILLED}")
    checks.expect(not before.operations, f"partial acceptance left {before.operations}")
    checks.expect(not before.outbox, f"partial acceptance left {before.outbox}")
    checks.expect(accept.record.exit_code == 0
                  and bool((accept.record.response or {}).get("accepted")),
                  f"accepting again answered {accept.record.response}")
    after = dispatch.snapshot
    operation = after.operation(OPERATION_ID)
    result = (dispatch.record.response or {}).get("result")
    checks.expect(operation is not None and operation.state == "complete",
                  f"after dispatch the operation is {operation}, not complete")
    checks.expect(result == {"ticket_id": 1}, f"dispatch answered {result}, not ticket 1")
    _judge_idle(checks, idle)
    _judge_violations(checks, scenario, execution)
    summary = {
        "crash_exit": crashed.record.exit_code,
        "partial_operations": len(before.operations),
        "partial_outbox": len(before.outbox),
        "tickets_after": _ticket_count(dispatch),
    }
    evidence = {
        "crash": process_json(crashed.record),
        "acceptance": process_json(accept.record),
        "recovery": process_json(dispatch.record),
        "before_recovery": before.to_json(),
        "after_recovery": after.to_json(),
    }
    return Outcome(scenario.name, scenario.crash_point, summary, checks.failures, evidence,
                   execution)


def _judge_conflict(scenario: Scenario, execution: Execution) -> Outcome:
    """On crash_after_downstream_commit's stores, a changed payload must be refused."""
    accept, crashed, recovery, conflict = execution.observations
    checks = _Checks()
    checks.expect(crashed.record.killed,
                  f"crashed dispatcher exited {crashed.record.exit_code}, not {KILLED}")
    checks.expect(recovery.record.exit_code == 0, f"recovery exited {recovery.record.exit_code}")
    checks.expect(conflict.record.exit_code == 3,
                  f"changed payload exited {conflict.record.exit_code}, not 3")
    checks.expect((conflict.record.response or {}).get("error") == "payload_conflict",
                  f"changed payload answered {conflict.record.response}, not payload_conflict")
    checks.expect(conflict.snapshot == conflict.before, "the refused call changed the stores")
    _judge_violations(checks, scenario, execution)
    summary = {"exit_code": conflict.record.exit_code, "tickets_after": _ticket_count(conflict)}
    evidence = {
        "acceptance": process_json(accept.record),
        "crash": process_json(crashed.record),
        "recovery": process_json(recovery.record),
        "conflict": process_json(conflict.record),
        "before_recovery": conflict.before.to_json(),
        "after_recovery": conflict.snapshot.to_json(),
    }
    return Outcome(scenario.name, scenario.crash_point, summary, checks.failures, evidence,
                   execution)


def _dispatcher_steps(point: str) -> tuple[Step, ...]:
    return (
        Step("accept", OPERATION_ID, FIXTURE_PAYLOAD),
        Step("dispatch", crash=point),
        Step("dispatch"),
        Step("dispatch"),
    )


SCENARIOS: tuple[Scenario, ...] = (
    Scenario(
        "crash_before_dispatch", "before_dispatch",
        "accept; dispatcher killed at before_dispatch; a new dispatcher recovers",
        _dispatcher_steps("before_dispatch"), _judge_dispatcher,
        expected={"tickets_before": 0, "tickets_after": 1, "ticket_id": 1},
    ),
    Scenario(
        "crash_after_downstream_commit", "after_downstream_commit",
        "accept; dispatcher killed at after_downstream_commit; recovery replays the receipt",
        _dispatcher_steps("after_downstream_commit"), _judge_dispatcher,
        expected={"tickets_before": 1, "tickets_after": 1, "ticket_id": 1},
    ),
    Scenario(
        "deduplication_disabled", "after_downstream_commit",
        "the same crash with deduplication off: the duplicate ticket is the expected finding",
        _dispatcher_steps("after_downstream_commit"), _judge_dispatcher, deduplication=False,
        expected={"tickets_before": 1, "tickets_after": 2, "ticket_id": 2},
    ),
    Scenario(
        "crash_during_acceptance", "during_accept",
        "acceptor killed at during_accept; nothing left behind; accept again and dispatch",
        (
            Step("accept", OPERATION_ID, FIXTURE_PAYLOAD, crash="during_accept"),
            Step("accept", OPERATION_ID, FIXTURE_PAYLOAD),
            Step("dispatch"),
            Step("dispatch"),
        ),
        _judge_acceptance,
    ),
    Scenario(
        "changed_payload_rejected", "after_downstream_commit",
        "on crash_after_downstream_commit's stores, the service refuses priority urgent",
        _dispatcher_steps("after_downstream_commit")[:3]
        + (Step("service", OPERATION_ID, CHANGED_PAYLOAD),),
        _judge_conflict,
    ),
)


def scenario_names() -> list[str]:
    return [scenario.name for scenario in SCENARIOS]
