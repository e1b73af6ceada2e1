"""ORDER orders only acceptances a caller saw in order: one acknowledged before the other began.

Found on reference-pg with two lanes: an accept whose COMMIT was in flight (held at
``accept_commit_sent``) while a second accept of the same key ran and was acknowledged;
the relay then delivered the first one first, as the store holds them, and ORDER called
that a violation. The checker sees only data, so these tests give it data.
"""

from __future__ import annotations

import json

from faultlab.checks.history import History
from faultlab.stores.sqlite import Operation, OutboxRow, Snapshot, Ticket

A, B = "op-a", "op-b"
PAYLOAD = {A: json.dumps({"title": "backlog", "n": 1}), B: json.dumps({"title": "backlog"})}


def _stores(ticketed: tuple[str, ...]) -> Snapshot:
    """Both operations accepted; the ``ticketed`` ones delivered, in that order."""
    return Snapshot(
        operations=tuple(Operation(op, PAYLOAD[op], "pending", None) for op in (A, B)),
        outbox=tuple(OutboxRow(op, "pending") for op in (A, B)),
        tickets=tuple(Ticket(n, op, PAYLOAD[op]) for n, op in enumerate(ticketed, 1)),
    )


Steps = list[tuple[str | None, dict[str, str], Snapshot]]


def _orders(history: History, steps: Steps) -> list[str]:
    """Run steps of (accept beginning, acknowledged so far, stores after); ORDER messages."""
    found = []
    before = Snapshot()
    for begins, acknowledged, after in steps:
        if begins is not None:
            history.accept_begins(begins)
        found += history.check(before, after, alone=None, exited=[],
                               acknowledged=acknowledged).found["ORDER"]
        before = after
    return found


def test_overlapping_acceptances_have_no_order_to_break() -> None:
    """A begins (its COMMIT in flight), B begins and is acknowledged, A is acknowledged;
    delivering A first is what the store holds: no ORDER."""
    empty = _stores(())
    steps = [
        (A, {}, empty),                                  # A's accept starts, holds
        (B, {B: PAYLOAD[B]}, empty),                     # B accepted and acknowledged
        (None, {B: PAYLOAD[B], A: PAYLOAD[A]}, empty),   # A acknowledged
        (None, {B: PAYLOAD[B], A: PAYLOAD[A]}, _stores((A,))),  # relay delivers A
    ]
    assert _orders(History(ordering_key="title"), steps) == []


def test_acceptances_in_real_time_order_must_be_relayed_in_order() -> None:
    """Negative control: B acknowledged before A began, then A delivered first: ORDER."""
    empty = _stores(())
    steps = [
        (B, {B: PAYLOAD[B]}, empty),
        (A, {B: PAYLOAD[B], A: PAYLOAD[A]}, empty),
        (None, {B: PAYLOAD[B], A: PAYLOAD[A]}, _stores((A,))),
    ]
    found = _orders(History(ordering_key="title"), steps)
    assert found == [f'{A} (key "backlog") got ticket 1 while {B}, accepted before it with '
                     "the same key, has no ticket"]
