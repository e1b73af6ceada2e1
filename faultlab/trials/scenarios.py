"""The five regression scenarios, as fixed traces with expected figures.

Each scenario is a list of steps run by the one executor, plus a check that
turns the observations into the summary and a list of failed checks.
A scenario passes when every check holds; ``deduplication_disabled`` passes
when the checker *does* report the duplicate ticket (it is a negative control).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from faultlab.process.records import DEFAULT_DEADLINE, KILLED, ProcessRecord
from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.run.observation import Execution, Observation
from faultlab.system.contract import SCENARIO_ROLES, System, scenario_point
from faultlab.system.fields import describe_unknown
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
    #: checks that could not run: a field the worker's response lacks (response_fields)
    unknowns: list[str] = field(default_factory=list)

    @property
    def passed(self) -> bool:
        return not self.failures and not self.unknowns

    @property
    def verdict(self) -> str:
        return "FAIL" if self.failures else "UNKNOWN" if self.unknowns else "PASS"


@dataclass(frozen=True)
class Scenario:
    name: str
    crash_point: str
    description: str
    steps: tuple[Step, ...]
    judge: Callable[[Scenario, Execution], Outcome]
    deduplication: bool = True
    expected: dict[str, Any] = field(default_factory=dict)

    def steps_for(self, system: System) -> tuple[Step, ...]:
        """The steps with each scenario role's crash point renamed to the system's own point
        (``scenario_points``), or a one-line UsageError naming the missing role."""
        return tuple(
            replace(step, crash=scenario_point(system, step.crash))
            if step.crash in SCENARIO_ROLES else step
            for step in self.steps
        )

    def run(self, system: System, spawner: Spawner, directory: Path | None = None, *,
            deadline: float = DEFAULT_DEADLINE) -> Outcome:
        execution = execute(
            system, self.steps_for(system), spawner, deduplication=self.deduplication,
            directory=directory, deadline=deadline,
        )
        outcome = self.judge(self, execution)
        outcome.crash_point = scenario_point(system, self.crash_point)  # the point armed
        return outcome


def process_json(record: ProcessRecord) -> dict[str, Any]:
    """The seed's process record: pid, exit code, response, stderr (plus, for a command-line
    system, the fields its response lacked and what it printed before response_fields)."""
    data = {
        "pid": record.pid,
        "exit_code": record.exit_code,
        "response": record.response,
        "stderr": record.stderr,
    }
    if record.unknown_fields:
        data["unknown_fields"] = record.unknown_fields
    if record.raw_response is not None:
        data["printed_response"] = record.raw_response
    return data


class _Checks:
    """Collects failed checks with the scenario's name in each message."""

    def __init__(self) -> None:
        self.failures: list[str] = []
        self.unknowns: list[str] = []

    def expect(self, condition: bool, message: str) -> None:
        if not condition:
            self.failures.append(message)

    def known(self, record: ProcessRecord, name: str, who: str) -> bool:
        """False (and the check reported as unknown) when the response lacks ``name``."""
        message = describe_unknown(record, name, who)
        if message is not None and message not in self.unknowns:
            self.unknowns.append(message)
        return message is None


def _ticket_count(observation: Observation) -> int:
    return len(observation.snapshot.tickets_for(OPERATION_ID))


def _judge_idle(checks: _Checks, idle: Observation) -> None:
    """A further dispatch answers idle the way QUIET reads it: a true ``/idle`` (after the
    system's ``response_fields``), whatever else the answer carries."""
    checks.expect(idle.record.exit_code == 0 and bool((idle.record.response or {}).get("idle")),
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
    result_known = checks.known(recovery.record, "result", "the recovering dispatcher")
    if result_known:
        checks.expect(result is not None, "the recovering dispatcher answered no result")
        checks.expect(stored == result or result is None,
                      "no stored result" if stored is None else
                      f"stored result {stored} differs from the recovering dispatcher's {result}")
    if scenario.deduplication and result_known and result is not None:
        receipt = after.receipt(OPERATION_ID)
        receipt_result = json.loads(receipt.result) if receipt else None
        checks.expect(receipt_result == result,
                      "no receipt" if receipt is None else
                      f"receipt result {receipt_result} differs from the recovered {result}")
    ticket_id = (result if isinstance(result, dict) else {}).get("ticket_id")
    if result_known:
        checks.expect(ticket_id == expected["ticket_id"],
                      f"recovered ticket {ticket_id}, expected {expected['ticket_id']}")
    if checks.known(recovery.record, "service_pid", "the recovering dispatcher"):
        service_pid = (response.get("service") or {}).get("pid")
        if isinstance(service_pid, int) and not isinstance(service_pid, bool):
            pids = [crashed.record.pid, recovery.record.pid, service_pid]
            checks.expect(len(set(pids)) == 3,
                          "crashed, recovering and service PIDs are not three distinct PIDs: "
                          f"{pids}")
        else:
            checks.expect(False, missing_pid(recovery.record, service_pid))
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
                   execution, unknowns=checks.unknowns)


def missing_pid(record: ProcessRecord, value: Any) -> str:
    """The failed check of a dispatcher whose response names no service child PID: the field
    by name (a null once showed as a PID list ending in None, which said nothing of why)."""
    said = ("printed no response" if record.response is None
            else f"holds {json.dumps(value, default=str)} there, not a PID")
    return (f"the recovering dispatcher's response has no service_pid ({said}; "
            "response_fields: service_pid)")


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
    checks.expect(accept.record.exit_code == 0, f"accepting again exited {accept.record.exit_code}")
    if checks.known(accept.record, "accepted", "the second acceptor"):
        checks.expect(bool((accept.record.response or {}).get("accepted")),
                      f"accepting again answered {accept.record.response}")
    after = dispatch.snapshot
    operation = after.operation(OPERATION_ID)
    result = (dispatch.record.response or {}).get("result")
    checks.expect(operation is not None and operation.state == "complete",
                  f"after dispatch the operation is {operation}, not complete")
    if checks.known(dispatch.record, "result", "the dispatcher"):
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
                   execution, unknowns=checks.unknowns)


def _judge_conflict(scenario: Scenario, execution: Execution) -> Outcome:
    """On crash_after_downstream_commit's stores, a changed payload must be refused."""
    accept, crashed, recovery, conflict = execution.observations
    checks = _Checks()
    checks.expect(crashed.record.killed,
                  f"crashed dispatcher exited {crashed.record.exit_code}, not {KILLED}")
    checks.expect(recovery.record.exit_code == 0, f"recovery exited {recovery.record.exit_code}")
    checks.expect(conflict.record.exit_code == 3,
                  f"changed payload exited {conflict.record.exit_code}, not 3")
    if checks.known(conflict.record, "error", "the service"):
        checks.expect((conflict.record.response or {}).get("error") == "payload_conflict",
                      f"changed payload answered {conflict.record.response}, "
                      "not payload_conflict")
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
                   execution, unknowns=checks.unknowns)


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
