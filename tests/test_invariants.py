"""Each invariant, fed a snapshot that violates it and one that does not."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

from faultlab.checks.invariants import (
    BY_NAME,
    INVARIANTS,
    STEP_INVARIANTS,
    Check,
    Model,
    check_live,
    check_step,
)
from faultlab.process.records import ProcessRecord
from faultlab.stores.sqlite import Operation, OutboxRow, Receipt, Snapshot, Ticket

P = '{"title":"a"}'
Q = '{"title":"b"}'
RESULT1 = '{"ticket_id":1}'


def record(response: dict[str, Any] | None = None, exit_code: int = 0) -> ProcessRecord:
    return ProcessRecord(pid=1, exit_code=exit_code, response=response, stdout="", stderr="",
                         elapsed=0.0)


def complete_snapshot(**overrides: Any) -> Snapshot:
    """One operation, complete, with its ticket and receipt: every invariant holds."""
    values: dict[str, Any] = {
        "operations": (Operation("op-1", P, "complete", RESULT1),),
        "outbox": (OutboxRow("op-1", "complete"),),
        "tickets": (Ticket(1, "op-1", P),),
        "receipts": (Receipt("op-1", P, RESULT1),),
    }
    values.update(overrides)
    return Snapshot(**values)


def check(after: Snapshot, *, before: Snapshot | None = None, action: str = "accept",
          operation_id: str | None = None, payload: str | None = None,
          response: dict[str, Any] | None = None, exit_code: int = 0,
          deduplication: bool = True, acknowledged: dict[str, str] | None = None) -> Check:
    model = Model(acknowledged=dict(acknowledged or {"op-1": P}))
    return Check(model=model, before=before if before is not None else after, after=after,
                 action=action, operation_id=operation_id, payload=payload,
                 record=record(response, exit_code), deduplication=deduplication)


VIOLATING: dict[str, Callable[[], Check]] = {
    "ATOM": lambda: check(complete_snapshot(outbox=())),
    "ONE": lambda: check(complete_snapshot(
        operations=(Operation("op-1", P, "pending", None),),
        outbox=(OutboxRow("op-1", "pending"),),
        tickets=(Ticket(1, "op-1", P), Ticket(2, "op-1", P)), receipts=(),
    ), deduplication=False),
    "RCPT": lambda: check(complete_snapshot(receipts=())),
    "PAIR": lambda: check(complete_snapshot(outbox=(OutboxRow("op-1", "pending"),))),
    "DONE": lambda: check(complete_snapshot(
        operations=(Operation("op-1", P, "complete", '{"ticket_id":7}'),))),
    "PAY": lambda: check(complete_snapshot(
        tickets=(Ticket(1, "op-1", Q),), receipts=(Receipt("op-1", Q, RESULT1),))),
    "KEY": lambda: check(complete_snapshot(
        tickets=(Ticket(1, "op-1", P), Ticket(2, "stranger", P)),
        receipts=(Receipt("op-1", P, RESULT1), Receipt("stranger", P, '{"ticket_id":2}')))),
    "QUIET": lambda: check(complete_snapshot(), action="dispatch",
                           response={"operation_id": "op-1", "result": {"ticket_id": 1}}),
    "ACK": lambda: check(complete_snapshot(), acknowledged={"op-1": P, "op-2": P}),
    "OPEN": lambda: replace(check(complete_snapshot(), action="power"),
                            unopenable=("caller.sqlite: missing",)),
    "DURABLE": lambda: check(complete_snapshot(
        operations=(Operation("op-1", P, "pending", None),),
        outbox=(OutboxRow("op-1", "pending"),)), before=complete_snapshot(), action="power"),
}


def step_check(name: str) -> Callable[[Check], list[str]]:
    found = BY_NAME[name].check
    assert found is not None, f"{name} is not a step invariant"
    return found


def test_every_step_invariant_has_a_violating_case() -> None:
    assert set(VIOLATING) == {invariant.name for invariant in STEP_INVARIANTS}
    assert [invariant.name for invariant in INVARIANTS if invariant.final] == ["LIVE"]
    assert len(BY_NAME) == len(INVARIANTS)  # names are unique


def test_vacuity_rules_see_the_difference_between_empty_and_busy_stores() -> None:
    empty = Check(model=Model(), before=Snapshot(), after=Snapshot(), action="accept",
                  operation_id=None, payload=None, record=record(), deduplication=True)
    busy = check(complete_snapshot(), acknowledged={"op-1": P})
    for invariant in STEP_INVARIANTS:
        if invariant.name in ("QUIET", "OPEN", "DURABLE"):  # judged by the step's action
            continue
        assert invariant.vacuous(empty), f"{invariant.name} is not vacuous on empty stores"
        assert not invariant.vacuous(busy), f"{invariant.name} is vacuous on busy stores"


def test_a_complete_consistent_snapshot_violates_nothing() -> None:
    assert check_step(check(complete_snapshot())) == []
    assert check_live(complete_snapshot()) == []


@pytest.mark.parametrize("name", sorted(VIOLATING))
def test_invariant_catches_its_violation(name: str) -> None:
    found = step_check(name)(VIOLATING[name]())
    assert found, f"{name} did not catch its violating snapshot"
    # and the same check on the consistent snapshot finds nothing
    assert step_check(name)(check(complete_snapshot())) == []


def test_one_is_demanded_even_without_deduplication_but_rcpt_is_not() -> None:
    two = complete_snapshot(
        operations=(Operation("op-1", P, "complete", '{"ticket_id":2}'),),
        tickets=(Ticket(1, "op-1", P), Ticket(2, "op-1", P)), receipts=(),
    )
    names = {v.invariant for v in check_step(check(two, deduplication=False))}
    assert names == {"ONE", "DONE"}


def test_pay_catches_a_changed_payload_answered_instead_of_refused() -> None:
    answered = check(complete_snapshot(), action="service", operation_id="op-1", payload=Q,
                     response={"operation_id": "op-1", "result": {"ticket_id": 1}})
    refused = check(complete_snapshot(), action="service", operation_id="op-1", payload=Q,
                    response={"error": "payload_conflict"}, exit_code=3)
    assert [v.invariant for v in check_step(answered)] == ["PAY"]
    assert check_step(refused) == []


def test_quiet_holds_for_an_idle_dispatch_and_for_a_dispatch_with_work() -> None:
    idle = check(complete_snapshot(), action="dispatch", response={"idle": True})
    assert step_check("QUIET")(idle) == []
    pending = complete_snapshot(operations=(Operation("op-1", P, "pending", None),),
                                outbox=(OutboxRow("op-1", "pending"),), tickets=(), receipts=())
    busy = check(complete_snapshot(), before=pending, action="dispatch",
                 response={"operation_id": "op-1", "result": {"ticket_id": 1}})
    assert step_check("QUIET")(busy) == []


def test_done_catches_a_dispatcher_answer_that_differs_from_what_was_stored() -> None:
    lying = check(complete_snapshot(), action="dispatch",
                  before=Snapshot(operations=(Operation("op-1", P, "pending", None),),
                                  outbox=(OutboxRow("op-1", "pending"),)),
                  response={"operation_id": "op-1", "result": {"ticket_id": 9}})
    assert [v.invariant for v in check_step(lying)] == ["DONE"]


def test_live_catches_pending_and_duplicated_work_after_recovery() -> None:
    pending = Snapshot(operations=(Operation("op-1", P, "pending", None),),
                       outbox=(OutboxRow("op-1", "pending"),))
    assert [v.invariant for v in check_live(pending, still_pending_after=1)] == ["LIVE", "LIVE"]
    doubled = complete_snapshot(tickets=(Ticket(1, "op-1", P), Ticket(2, "op-1", P)))
    assert [v.invariant for v in check_live(doubled)] == ["LIVE"]
