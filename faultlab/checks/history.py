"""Invariants over the history of a trace, not only its latest snapshot.

Most concurrency bugs still leave "one ticket per operation" true when the
receiver deduplicates; what they break is how the stores change over time and
who changed them. These checks keep a little state across steps:

* ``TERM``: a terminal state never changes. Once an operation is complete its
  row stays complete with the same result, and so does its outbox row.
* ``EXCL``: a claim is exclusive while its lease runs: no worker claims an
  operation while another live worker holds an unexpired lease on it.
* ``ORDER``: where the system declares an ordering key (a payload field), the
  operations of one key get their tickets in acceptance order: an operation whose
  acceptance was acknowledged before another's accept began is relayed first
  (two overlapping acceptances have no order a caller saw). An operation
  delivered straight to the receiver (a ``service`` step) is exempt: that
  delivery is the caller's own, not the relay's.
* ``FENCE``: a dispatcher whose claim was superseded (its lease lapsed and
  another dispatcher claimed the same operation with a higher token) never
  changes the caller store afterwards, and never reports completing that
  operation. Claims are what workers announce with ``context.claimed``.
* ``SKIP``: no committed outbox row is skipped for good. A relay (dispatcher)
  that reports it found nothing to do, and was the only worker alive from its start
  to its exit, leaves no outbox row pending that it could have claimed: one
  committed before it started, with no lease unexpired when it started, whose
  ordering key no such lease holds. (Its read of the outbox and of the clock may
  fall anywhere in its run: a row committed later, or a lease that lapsed only
  while it ran, it may rightly not have seen.) Unlike
  ``LIVE`` (judged once, over acknowledged operations, after recovery) it names
  the relay that passed the row over, counts rows whose acceptor never replied,
  and is judged at every idle relay, recovery's included.

Every executor keeps a :class:`History`, sequential and in lanes alike. ``TERM`` and
``ORDER`` need only the snapshots and the model, so a sequential trace checks them too;
``EXCL``, ``FENCE`` and ``SKIP`` read the claims workers announce, which only lanes
collect, so they check nothing in a sequential trace.

Each has a vacuity rule, judged per step (:attr:`HistoryStep.active`) and per
trace (:meth:`History.vacuous`): ``TERM`` has nothing to check until some
operation is complete; ``EXCL`` at a step in which a claim is taken while another
live worker holds a claim on the same operation; ``ORDER`` at a step after which
one key has two relayed operations and a ticket among them; ``FENCE`` once some
claim was superseded; ``SKIP`` at a step in which a relay alone reports idle with
a committed outbox row pending.

This module keeps the state and finds the messages; the invariants themselves (names,
meanings, vacuity) are entries of the one table, :data:`faultlab.checks.invariants.INVARIANTS`,
which read a step's :class:`HistoryStep`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from faultlab.process.records import ProcessRecord
from faultlab.stores.sqlite import Snapshot

#: The history invariants, in the order a step reports their violations.
HISTORY_NAMES: tuple[str, ...] = ("TERM", "EXCL", "ORDER", "FENCE", "SKIP")


@dataclass(frozen=True)
class HistoryStep:
    """What the history found at one step: each invariant's messages (one per violation),
    and the invariants that had something to check at that step."""

    found: Mapping[str, tuple[str, ...]]
    active: frozenset[str]


@dataclass(frozen=True)
class Claim:
    worker: int  # faultlab's serial number for the worker process
    lane: int
    pid: int
    operation_id: str
    token: int
    lease_until: float | None = None
    at: int = 0  # the virtual clock when the claim was announced


@dataclass(frozen=True)
class LoneRun:
    """A worker that was the only one alive from its start to its exit: the stores as it
    found them and the virtual clock when it started (what ``SKIP`` judges it by)."""

    worker: int
    started: Snapshot
    at: float


@dataclass
class History:
    """What earlier steps established: terminal results, claims and who superseded whom."""

    terminal: dict[str, str | None] = field(default_factory=dict)
    terminal_outbox: set[str] = field(default_factory=set)
    claims: list[Claim] = field(default_factory=list)
    ordering_key: str | None = None
    direct: set[str] = field(default_factory=set)  # operations delivered by a service step
    ordered: bool = False  # ORDER had something to check at some step
    contested: int = 0  # claims taken while another live worker held one on the operation
    idle_with_pending: int = 0  # SKIP had something to check: a lone idle relay, rows pending
    #: Steps checked so far; the step an operation's first accept began, and the step its
    #: acceptance was first acknowledged (ORDER orders only acceptances that did not overlap)
    steps: int = 0
    began: dict[str, int] = field(default_factory=dict)
    acknowledged_at: dict[str, int] = field(default_factory=dict)
    _exclusion: list[str] = field(default_factory=list)
    _contested_seen: int = 0  # contested, as of the last step checked
    _keys: dict[str, str | None] = field(default_factory=dict)  # acknowledged operations' keys

    def accept_begins(self, operation_id: str) -> None:
        """An accept of ``operation_id`` starts in the step being run now."""
        self.began.setdefault(operation_id, self.steps + 1)

    def state(self, acknowledged: Mapping[str, str]) -> tuple[tuple[str, ...],
                                                             tuple[tuple[str, str], ...]]:
        """What later checks of ``ORDER`` depend on beyond the stores and the model: the
        operations delivered directly, and each pair (earlier, later) whose acceptances a
        caller saw in order (``earlier`` acknowledged before ``later``'s accept began),
        among operations that share an ordering key or may yet (an acceptance not yet
        acknowledged has no key so far); an operation whose payload has no key is never
        ordered, and is left out. ``TERM``'s terminal results are the stores'
        complete rows in any trace still clean, and a sequential trace announces no claims.
        Two prefixes that agree on this, the stores and the model are one state to an
        enumerator (it keys states with it). ``acknowledged``: the model's."""
        if self.ordering_key is None:
            return (), ()
        unknown = object()  # the key of an acceptance not acknowledged yet
        keys: dict[str, Any] = {}
        for operation_id in {*self.began, *self.acknowledged_at}:
            if operation_id not in acknowledged:
                keys[operation_id] = unknown
            elif (key := self._key(acknowledged[operation_id])) is not None:
                keys[operation_id] = canonical_key(key)  # unkeyed: never ordered

        def related(one: str, other: str) -> bool:
            return (one != other and one in keys and other in keys
                    and (keys[one] is unknown or keys[other] is unknown
                         or keys[one] == keys[other]))

        pairs = tuple(sorted((earlier, later) for earlier in self.acknowledged_at
                             for later in self.began
                             if related(earlier, later) and self._precedes(earlier, later)))
        # a direct delivery exempts the operation from ORDER against any operation of its
        # key, those accepted later included: kept for every operation that may have one
        direct = tuple(sorted(operation_id for operation_id in self.direct
                              if operation_id in keys))
        return direct, pairs

    def claim(self, claim: Claim, *, alive: set[int]) -> None:
        """Record a claim; ``alive`` are the workers still running when it was taken."""
        held = [c for c in self.claims if c.operation_id == claim.operation_id
                and c.worker != claim.worker and c.worker in alive]
        if held:
            self.contested += 1
        for other in held:
            if other.lease_until is not None and other.lease_until > claim.at:
                self._exclusion.append(
                    f"lane {claim.lane} (worker {claim.worker}) claimed {claim.operation_id} at "
                    f"tick {claim.at} while lane {other.lane} (worker {other.worker}) held it "
                    f"leased until "
                    f"{other.lease_until:g}"
                )
        self.claims.append(claim)

    def superseded(self, worker: int) -> list[tuple[Claim, Claim]]:
        """This worker's claims that a later, higher token on the same operation replaced."""
        found = []
        for mine in (c for c in self.claims if c.worker == worker):
            later = [c for c in self.claims if c.operation_id == mine.operation_id
                     and c.token > mine.token and c.worker != worker]
            if later:
                found.append((mine, max(later, key=lambda c: c.token)))
        return found

    def vacuous(self, name: str) -> bool:
        if name == "TERM":
            return not self.terminal
        if name == "ORDER":
            return not self.ordered
        if name == "EXCL":
            return not self.contested
        if name == "FENCE":
            return not any(self.superseded(c.worker) for c in self.claims)
        if name == "SKIP":
            return not self.idle_with_pending
        return False

    def check(
        self, before: Snapshot, after: Snapshot, *, alone: int | None,
        exited: list[tuple[int, ProcessRecord]], acknowledged: dict[str, str] | None = None,
        lone: tuple[LoneRun, ...] = (),
    ) -> HistoryStep:
        """Check one step. ``alone`` is the worker that was the only one running during the
        step (so a change of the stores is its doing), ``exited`` the workers that ended;
        ``lone`` those of them that no other worker was alive beside at any moment of
        their run (not even held or paused), so every claim on the stores was announced."""
        self.steps += 1
        for operation_id in acknowledged or {}:
            self.acknowledged_at.setdefault(operation_id, self.steps)
        active: set[str] = set()
        if self.terminal:
            active.add("TERM")
        found: dict[str, tuple[str, ...]] = {"TERM": tuple(self._terminal(after))}
        if self.contested > self._contested_seen:
            active.add("EXCL")
        self._contested_seen = self.contested
        found["EXCL"] = tuple(self._exclusion)
        self._exclusion = []
        order, ordered = self._order(after, acknowledged or {})
        found["ORDER"] = tuple(order)
        if ordered:
            self.ordered = True
            active.add("ORDER")
        fence: list[str] = []
        caller_changed = (before.operations, before.outbox) != (after.operations, after.outbox)
        if alone is not None and caller_changed:
            for mine, theirs in self.superseded(alone):
                fence.append(
                    f"lane {mine.lane} (worker {mine.worker}) changed the caller store after its "
                    f"claim on {mine.operation_id} (token {mine.token}) was superseded by "
                    f"lane {theirs.lane}'s token {theirs.token}"
                )
        for worker, record in exited:
            response = record.response or {}
            if record.exit_code != 0 or "result" not in response:
                continue
            for mine, theirs in self.superseded(worker):
                if response.get("operation_id") == mine.operation_id:
                    fence.append(
                        f"lane {mine.lane} (worker {mine.worker}) reported completing "
                        f"{mine.operation_id} after its claim (token {mine.token}) was "
                        f"superseded by token {theirs.token}"
                    )
        found["FENCE"] = tuple(dict.fromkeys(fence))
        if not self.vacuous("FENCE"):
            active.add("FENCE")
        idle_before = self.idle_with_pending
        found["SKIP"] = tuple(message for run in lone
                              for message in self._skipped(run, after, exited))
        if self.idle_with_pending > idle_before:
            active.add("SKIP")
        self._remember(after)
        return HistoryStep(found, frozenset(active))

    def _skipped(self, run: LoneRun, after: Snapshot,
                 exited: list[tuple[int, ProcessRecord]]) -> list[str]:
        """Rows a relay alone for its whole run passed over: pending when it started and
        after it ended, no lease on them or on their ordering key unexpired when it
        started."""
        idle = any(worker == run.worker and record.exit_code == 0
                   and (record.response or {}).get("idle") is True
                   for worker, record in exited)
        still = {row.operation_id for row in after.pending_outbox()}
        pending = [row.operation_id for row in run.started.pending_outbox()
                   if row.operation_id in still]
        if not idle or not pending or not self.claims:
            return []  # a system that announces no claims tells faultlab of no lease
        self.idle_with_pending += 1
        payloads = {row.id: row.payload for row in after.operations}
        leased = {c.operation_id for c in self.claims
                  if c.lease_until is None or c.lease_until > run.at}
        held_keys = {canonical_key(self._key(payloads[op])) for op in leased
                     if op in payloads and op in pending and self.ordering_key is not None}
        found = []
        for operation_id in pending:
            key = (canonical_key(self._key(payloads[operation_id]))
                   if operation_id in payloads and self.ordering_key is not None else None)
            if operation_id in leased or (key is not None and key in held_keys):
                continue
            found.append(f"a relay (worker {run.worker}) started at tick {run.at:g} and "
                         f"reported idle while committed outbox row {operation_id} was "
                         f"pending and unleased")
        return found

    def _acknowledged_key(self, operation_id: str, payload: str) -> str | None:
        """The canonical ordering key of an acknowledged operation, parsed once: what a
        caller acknowledged never changes (the model keeps the first acknowledgement)."""
        if operation_id not in self._keys:
            key = self._key(payload)
            self._keys[operation_id] = None if key is None else canonical_key(key)
        return self._keys[operation_id]

    def _key(self, payload: str) -> Any:
        try:
            value = json.loads(payload)
        except ValueError:
            return None
        return value.get(self.ordering_key) if isinstance(value, dict) else None

    def _precedes(self, earlier: str, later: str) -> bool:
        """Whether ``earlier``'s acceptance was acknowledged before ``later``'s accept began.

        Two acceptances that overlap (one's COMMIT in flight while the other is accepted and
        acknowledged) have no order a caller could rely on: the store may hold either
        first. An operation whose start is unknown keeps the acknowledgement order.
        """
        began = self.began.get(later)
        acknowledged = self.acknowledged_at.get(earlier)
        return began is None or acknowledged is None or acknowledged < began

    def _order(self, after: Snapshot,
               acknowledged: dict[str, str]) -> tuple[list[str], bool]:
        """Within each key, in acceptance (acknowledgement) order, no relayed operation has a
        ticket while an earlier one has none or a later-numbered one. Only acceptances in
        real-time order count: ``earlier`` acknowledged before ``later`` began. Also
        whether there was anything to order (a key with two relayed operations, one of
        them ticketed)."""
        if self.ordering_key is None:
            return [], False
        first: dict[str, int] = {}
        for ticket in after.tickets:
            first[ticket.operation_id] = min(first.get(ticket.operation_id, ticket.id), ticket.id)
        keyed: dict[str, list[str]] = {}
        for operation_id, payload in acknowledged.items():
            key = self._acknowledged_key(operation_id, payload)
            if key is not None and operation_id not in self.direct:
                keyed.setdefault(key, []).append(operation_id)
        found = []
        ordered = False
        for key, operations in keyed.items():
            if len(operations) > 1 and any(op in first for op in operations):
                ordered = True
            for index, later in enumerate(operations):
                if later not in first:
                    continue
                for earlier in operations[:index]:
                    if not self._precedes(earlier, later):
                        continue
                    if earlier not in first or first[earlier] > first[later]:
                        shown = f"ticket {first[earlier]}" if earlier in first else "no ticket"
                        found.append(
                            f"{later} (key {key}) got ticket {first[later]} while {earlier}, "
                            f"accepted before it with the same key, has {shown}"
                        )
        return found, ordered

    def _terminal(self, after: Snapshot) -> list[str]:
        found = []
        for operation_id, result in sorted(self.terminal.items()):
            row = after.operation(operation_id)
            if row is None or row.state != "complete" or row.result != result:
                state = "missing" if row is None else f"{row.state} with result {row.result}"
                found.append(f"complete operation {operation_id} (result {result}) is now {state}")
        for operation_id in sorted(self.terminal_outbox):
            outbox = after.outbox_row(operation_id)
            if outbox is None or outbox.state != "complete":
                state = "missing" if outbox is None else outbox.state
                found.append(f"complete outbox row {operation_id} is now {state}")
        return found

    def _remember(self, after: Snapshot) -> None:
        for row in after.operations:
            if row.state == "complete":
                self.terminal.setdefault(row.id, row.result)
        self.terminal_outbox |= {r.operation_id for r in after.outbox if r.state == "complete"}


def canonical_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))
