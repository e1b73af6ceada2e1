"""Invariants: pure checks over (model, snapshot before, snapshot after, step, record).

Each invariant has a short stable name used in tables and corpus files. The
same functions run inside the state machine, after every replayed step, and in
the scenarios. Exactly-once guarantees (``ONE``, ``DONE``, ``LIVE``) are always
demanded; checks that only make sense for a deduplicating receiver (``RCPT``,
and the receipt half of ``DONE``) apply when the run has deduplication on. That
is what makes deduplication-off a negative control: the system loses its
receipts, the checker keeps demanding exactly-once delivery.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from faultlab.checks.history import HISTORY_NAMES, HistoryStep
from faultlab.process.records import ProcessRecord
from faultlab.stores.sqlite import Snapshot


@dataclass(frozen=True)
class Violation:
    invariant: str
    message: str

    def to_json(self) -> dict[str, str]:
        return {"invariant": self.invariant, "message": self.message}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Violation:
        return cls(str(data["invariant"]), str(data.get("message", "")))

    def __str__(self) -> str:
        return f"{self.invariant}: {self.message}"


@dataclass
class Model:
    """What the caller acknowledged: the durability promises the stores must keep."""

    acknowledged: dict[str, str] = field(default_factory=dict)
    submitted: set[str] = field(default_factory=set)
    #: Operation id -> the ticket id a dispatcher was answered with (exit 0): the downstream
    #: acknowledged that delivery, so a power cut must not lose its ticket (``DURABLE``).
    delivered: dict[str, Any] = field(default_factory=dict)

    def observe(self, action: str, operation_id: str | None, payload: str | None,
                record: ProcessRecord) -> None:
        """An accept that printed a non-error response acknowledged the operation,
        whether or not its process was killed afterwards. A dispatch that ended with a
        result was answered by the downstream: that delivery was acknowledged."""
        if action == "dispatch":
            answer = record.response or {}
            result = answer.get("result")
            if record.exit_code == 0 and isinstance(result, dict) and "ticket_id" in result:
                self.delivered.setdefault(str(answer.get("operation_id")), result["ticket_id"])
            return
        if action != "accept" or operation_id is None or payload is None:
            return
        self.submitted.add(operation_id)
        response = record.response
        if response is not None and "error" not in response and response.get("accepted"):
            self.acknowledged.setdefault(operation_id, payload)


@dataclass(frozen=True)
class Check:
    """Everything an invariant may look at for one executed step."""

    model: Model
    before: Snapshot
    after: Snapshot
    action: str
    operation_id: str | None
    payload: str | None
    record: ProcessRecord
    deduplication: bool
    #: After a power step: why each store that no longer opens does not (``OPEN``).
    unopenable: tuple[str, ...] = ()
    #: What the trace's history found at this step (the history invariants' input); None
    #: in the check of one lane worker that ended, whose step's history is judged once,
    #: apart from its workers' checks.
    history: HistoryStep | None = None


def _result(text: str | None) -> Any:
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError:
        return text


def check_atom(c: Check) -> list[str]:
    operations = {row.id for row in c.after.operations}
    outbox = {row.operation_id for row in c.after.outbox}
    found = [f"operation {i} has no outbox row" for i in sorted(operations - outbox)]
    found += [f"outbox row {i} has no operation" for i in sorted(outbox - operations)]
    return found


def check_one(c: Check) -> list[str]:
    counts = Counter(ticket.operation_id for ticket in c.after.tickets)
    return [f"operation {op} has {n} tickets" for op, n in sorted(counts.items()) if n > 1]


def check_receipts(c: Check) -> list[str]:
    if not c.deduplication:
        return []
    found = []
    for ticket in c.after.tickets:
        receipt = c.after.receipt(ticket.operation_id)
        if receipt is None:
            found.append(f"ticket {ticket.id} ({ticket.operation_id}) has no receipt")
        elif not _names_ticket(_result(receipt.result), ticket.id):
            found.append(
                f"receipt for {ticket.operation_id} says {receipt.result}, not ticket {ticket.id}"
            )
    return found


def _names_ticket(result: Any, ticket_id: int) -> bool:
    return isinstance(result, dict) and result.get("ticket_id") == ticket_id


def check_pair(c: Check) -> list[str]:
    found = []
    for operation in c.after.operations:
        outbox = c.after.outbox_row(operation.id)
        if outbox is not None and outbox.state != operation.state:
            found.append(
                f"operation {operation.id} is {operation.state} but its outbox row is "
                f"{outbox.state}"
            )
    return found


def check_done(c: Check) -> list[str]:
    found = []
    for operation in c.after.operations:
        if operation.state != "complete":
            continue
        tickets = c.after.tickets_for(operation.id)
        if len(tickets) != 1:
            found.append(f"complete operation {operation.id} has {len(tickets)} tickets")
            continue
        stored = _result(operation.result)
        if not _names_ticket(stored, tickets[0].id):
            found.append(
                f"operation {operation.id} stores result {operation.result}, "
                f"not ticket {tickets[0].id}"
            )
        receipt = c.after.receipt(operation.id)
        if c.deduplication and receipt is not None and _result(receipt.result) != stored:
            found.append(
                f"operation {operation.id} stores {operation.result} but its receipt says "
                f"{receipt.result}"
            )
    response = c.record.response or {}
    if c.action == "dispatch" and "result" in response and c.record.exit_code == 0:
        operation_id = response.get("operation_id")
        answered = c.after.operation(str(operation_id))
        if answered is not None and _result(answered.result) != response["result"]:
            found.append(
                f"dispatcher answered {json.dumps(response['result'])} for {operation_id} but "
                f"the caller stored {answered.result}"
            )
    return found


def _accepted_payload(c: Check, operation_id: str) -> str | None:
    if operation_id in c.model.acknowledged:
        return c.model.acknowledged[operation_id]
    operation = c.after.operation(operation_id)
    return None if operation is None else operation.payload


def check_payload(c: Check) -> list[str]:
    found = []
    for ticket in c.after.tickets:
        accepted = _accepted_payload(c, ticket.operation_id)
        if accepted is not None and ticket.payload != accepted:
            found.append(
                f"ticket {ticket.id} for {ticket.operation_id} carries {ticket.payload}, "
                f"accepted {accepted}"
            )
    if c.action == "service" and c.operation_id is not None:
        accepted = _accepted_payload(c, c.operation_id)
        response = c.record.response or {}
        if accepted is not None and c.payload != accepted and "result" in response:
            found.append(
                f"downstream answered a changed payload for {c.operation_id} with "
                f"{json.dumps(response['result'])} instead of refusing it"
            )
    return found


def check_key(c: Check) -> list[str]:
    accepted = {row.id for row in c.after.operations}
    return [
        f"ticket {t.id} names operation {t.operation_id}, which the caller never accepted"
        for t in c.after.tickets
        if t.operation_id not in accepted
    ]


def without_pids(value: Any) -> Any:
    """A response as a violation quotes it: without the ``pid`` of any process (the service
    a dispatcher started), which differs on every run, so a saved finding is the same bytes
    however often it is found."""
    if isinstance(value, dict):
        return {key: without_pids(item) for key, item in value.items() if key != "pid"}
    if isinstance(value, list):
        return [without_pids(item) for item in value]
    return value


def check_quiet(c: Check) -> list[str]:
    if c.action != "dispatch" or c.before.pending_outbox():
        return []
    found = []
    response = c.record.response or {}
    if c.record.exit_code == 0 and not response.get("idle"):
        shown = json.dumps(without_pids(response))
        found.append(f"dispatch with no pending work answered {shown}")
    if c.after != c.before:
        found.append("dispatch with no pending work changed the stores")
    return found


def check_ack(c: Check) -> list[str]:
    found = []
    for operation_id, payload in sorted(c.model.acknowledged.items()):
        operation = c.after.operation(operation_id)
        if operation is None:
            found.append(f"acknowledged operation {operation_id} is not in the caller store")
        elif operation.payload != payload:
            found.append(
                f"acknowledged operation {operation_id} now carries {operation.payload}, "
                f"acknowledged {payload}"
            )
    return found


def check_open(c: Check) -> list[str]:
    return list(c.unopenable)


#: The faults after which what was acknowledged must still be there, and how a message
#: names each: a power cut of the machine, a crash of the whole PostgreSQL server.
DURABILITY_FAULTS: dict[str, str] = {"power": "the power cut", "server_crash": "the server crash"}


def check_durable(c: Check) -> list[str]:
    """After a power cut or a server crash: nothing acknowledged before it is gone (the
    model is data: the acknowledgements recorded, and the snapshot taken just before). The
    same promise either way: an acknowledged commit survives the loss of everything that
    was only in memory, the machine's page cache or the server's WAL buffers."""
    fault = DURABILITY_FAULTS.get(c.action)
    if fault is None:
        return []
    found = [f"acknowledged operation {operation_id} was lost in {fault}"
             for operation_id in sorted(c.model.acknowledged)
             if c.after.operation(operation_id) is None]
    for operation in c.before.operations:
        if operation.state != "complete":
            continue
        now = c.after.operation(operation.id)
        if now is None or now.state != "complete" or now.result != operation.result:
            state = "gone" if now is None else now.state
            found.append(f"operation {operation.id} was complete before {fault} and is "
                         f"{state} after it")
    for operation_id, ticket_id in sorted(c.model.delivered.items()):
        if not any(t.id == ticket_id for t in c.after.tickets_for(operation_id)):
            found.append(f"ticket {ticket_id} for {operation_id}, whose receipt a dispatcher "
                         f"got, was lost in {fault}")
    return found


def _not_power(c: Check) -> bool:
    return c.action != "power"


def _not_durability_fault(c: Check) -> bool:
    return c.action not in DURABILITY_FAULTS


def _never(c: Check) -> bool:
    return False


def _history_check(name: str) -> Callable[[Check], list[str]]:
    def check(c: Check) -> list[str]:
        return [] if c.history is None else list(c.history.found.get(name, ()))
    return check


def _history_vacuous(name: str) -> Callable[[Check], bool]:
    def vacuous(c: Check) -> bool:
        return c.history is None or name not in c.history.active
    return vacuous


@dataclass(frozen=True)
class Invariant:
    """One invariant: its stable name, what it means, how it is checked, when it is vacuous.

    ``check`` returns one message per violation found after a step; ``None`` marks the
    final invariant (``LIVE``), judged by :func:`check_live` after recovery.
    ``vacuous`` says the step gave it nothing to check (for coverage reports).
    ``fault`` names the fault a run must draw for the invariant to apply at all (``power``:
    only traces with power steps can lose unsynced writes); coverage reports leave it out of
    runs without that fault rather than call it vacuous there. ``history``: judged over the
    trace's history (:mod:`faultlab.checks.history`, the step's :attr:`Check.history`),
    once a step, not once per worker that ended, in every trace. ``claims``: a history
    invariant that reads the claims workers announce, which only lanes collect (a
    sequential step's worker has no schedule pipe to announce on): it has nothing to
    check in a sequential trace, and coverage reports leave it out of one.
    Adding an invariant is adding one entry to :data:`INVARIANTS`.
    """

    name: str
    meaning: str
    check: Callable[[Check], list[str]] | None
    vacuous: Callable[[Check], bool] = _never
    fault: str | None = None
    history: bool = False
    claims: bool = False

    @property
    def final(self) -> bool:
        return self.check is None


INVARIANTS: tuple[Invariant, ...] = (
    Invariant(
        "ATOM", "an operation row exists iff its outbox row exists", check_atom,
        lambda c: not c.after.operations and not c.after.outbox,
    ),
    Invariant("ONE", "at most one ticket per operation id", check_one,
              lambda c: not c.after.tickets),
    Invariant(
        "RCPT", "every ticket has its receipt, and the receipt's result names that ticket "
        "(under deduplication)", check_receipts,
        lambda c: not c.deduplication or not c.after.tickets,
    ),
    Invariant("PAIR", "an operation's state equals its outbox row's state", check_pair,
              lambda c: not c.after.outbox),
    Invariant(
        "DONE", "a complete operation has exactly one ticket, its stored result names it and "
        "equals the receipt's result and what the dispatcher answered", check_done,
        lambda c: not any(op.state == "complete" for op in c.after.operations),
    ),
    Invariant(
        "PAY", "a ticket's payload equals the accepted payload; a downstream call with a "
        "changed payload is refused", check_payload,
        lambda c: not c.after.tickets and c.action != "service",
    ),
    Invariant("KEY", "every downstream operation id was accepted by the caller", check_key,
              lambda c: not c.after.tickets),
    Invariant(
        "QUIET", "a dispatch that finds no pending work answers idle and changes neither "
        "store", check_quiet,
        lambda c: c.action != "dispatch" or bool(c.before.pending_outbox()),
    ),
    Invariant(
        "ACK", "every acknowledged operation is in the caller store with its acknowledged "
        "payload", check_ack, lambda c: not c.model.acknowledged,
    ),
    Invariant("OPEN", "every store still opens after a power cut", check_open, _not_power,
              fault="power"),
    Invariant(
        "DURABLE", "after a power cut or a server crash every acknowledged operation, every "
        "completion and every ticket a dispatcher got a receipt for is still recorded",
        check_durable, _not_durability_fault, fault="power",
    ),
    *(Invariant(name, meaning, _history_check(name), _history_vacuous(name), history=True,
                claims=claims)
      for name, claims, meaning in (
        ("TERM", False, "a complete operation (and its outbox row) stays complete with the "
                        "same result"),
        ("EXCL", True, "no worker claims an operation while another live worker holds an "
                       "unexpired lease on it"),
        ("ORDER", False, "the operations of one ordering key get their tickets in acceptance "
                         "order"),
        ("FENCE", True, "a dispatcher whose claim was superseded never changes the caller "
                        "store afterwards, nor reports completing the operation"),
        ("SKIP", True, "no committed outbox row is skipped for good: a relay alone from "
                       "its start to its end never reports idle while a row committed "
                       "before it started is pending that no lease unexpired at its start "
                       "holds"),
    )),
    Invariant("LIVE", "after recovery every accepted operation is complete with exactly one "
              "ticket", None),
)
BY_NAME: dict[str, Invariant] = {invariant.name: invariant for invariant in INVARIANTS}
#: Judged per worker that ended at a step (and after each fault).
STEP_INVARIANTS: tuple[Invariant, ...] = tuple(i for i in INVARIANTS
                                               if not i.final and not i.history)
#: Judged once a step over the trace's history.
HISTORY_INVARIANTS: tuple[Invariant, ...] = tuple(i for i in INVARIANTS if i.history)
#: The history invariants a sequential trace can check: those that need no announced claims.
UNCLAIMED_HISTORY: tuple[Invariant, ...] = tuple(i for i in HISTORY_INVARIANTS if not i.claims)
if tuple(i.name for i in HISTORY_INVARIANTS) != HISTORY_NAMES:  # one list, in one order
    raise ImportError("faultlab.checks: the history invariants' table and names disagree")


def check_step(c: Check) -> list[Violation]:
    """Every per-step invariant, in a stable order."""
    return [
        Violation(invariant.name, message)
        for invariant in STEP_INVARIANTS if invariant.check is not None
        for message in invariant.check(c)
    ]


def check_history(c: Check) -> list[Violation]:
    """Every history invariant, in a stable order (nothing where no history is kept)."""
    return [
        Violation(invariant.name, message)
        for invariant in HISTORY_INVARIANTS if invariant.check is not None
        for message in invariant.check(c)
    ]


def covered(c: Check) -> frozenset[str]:
    """The invariants (per-step and history) that had something to check at ``c``'s step."""
    return frozenset(invariant.name for invariant in (*STEP_INVARIANTS, *HISTORY_INVARIANTS)
                     if not invariant.vacuous(c))


def check_live(snapshot: Snapshot, *, still_pending_after: int | None = None) -> list[Violation]:
    """The teardown check, after recovery to quiescence."""
    found = []
    if still_pending_after is not None:
        pending = ", ".join(row.operation_id for row in snapshot.pending_outbox())
        found.append(f"still pending after {still_pending_after} recovery dispatches: {pending}")
    for operation in snapshot.operations:
        tickets = len(snapshot.tickets_for(operation.id))
        if operation.state != "complete" or tickets != 1:
            found.append(
                f"operation {operation.id} is {operation.state} with {tickets} tickets after "
                "recovery"
            )
    return [Violation("LIVE", message) for message in found]
