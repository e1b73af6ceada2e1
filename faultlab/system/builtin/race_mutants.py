"""Concurrency mutants: the reference with one defect that only several workers at once show.

Each is a bug class users reported against real outboxes and job queues, written
as real code against the reference (different SQL, a read separated from its
write), with its known minimal concurrent trace (format version 2, see
:mod:`faultlab.trace`) and the invariants that catch it. A sequential
trace cannot show any of them; ``explore --concurrency 2`` can.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from faultlab.base.canonical import canonical_json
from faultlab.stores import sqlite as stores
from faultlab.system.builtin.reference import (
    CALLER,
    CALLER_SCHEMA,
    CLAIM_SKIP_LOCKED_SQL,
    DOWNSTREAM,
    DOWNSTREAM_SCHEMA,
    LEASE_TICKS,
    ORDERING_KEY,
    REFERENCE_POINTS,
    ClaimLost,
    ReferenceOutbox,
)
from faultlab.system.contract import CrashPoint, WorkerContext
from faultlab.trace import Step

OP = "op-1"
PAYLOAD: dict[str, Any] = {"title": "backlog", "priority": "normal"}


class ConcurrencyMutant(ReferenceOutbox):
    """A reference outbox with one concurrency defect, caught with ``concurrency`` lanes.

    ``minimal_steps`` counts the minimal trace's own scheduling choices up to the failing
    check; when the failure shows in the final recovery that is every step of the trace.
    """

    caught_by: tuple[str, ...] = ()
    concurrency: int = 2
    minimal_steps: int = 0
    minimal_trace: tuple[Step, ...] = ()
    reported: str = ""
    #: False while ``mutants`` cannot yet judge it (explore with the zoo's seed and budget
    #: and enumerate with its fixed workload do not reach its trigger); it stays loadable by
    #: name, and its minimal trace is tested like every other's.
    judged: bool = True


class NoFencing(ConcurrencyMutant):
    name = "no-fencing"
    description = (
        "completion is not conditional on still holding the claim: a dispatcher whose "
        "lease lapsed (rescued by time alone) completes anyway"
    )
    reported = "Oban Lifeline / hexpm #1825; pikkujs/pikku #1742 (no fencing token)"
    caught_by = ("FENCE",)
    # Lane 1 claims (token 1) and holds; its lease lapses; lane 2 claims (token 2) and
    # holds; the final recovery finishes lane 1 first: superseded, it completes anyway.
    minimal_steps = 4
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("dispatch", lane=1, hold=True),
        Step("tick", ticks=LEASE_TICKS),
        Step("dispatch", lane=2, hold=True),
    )

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "UPDATE operations SET state = 'complete', result = ? WHERE id = ?",
                (result, operation_id),
            )
            context.crash_point("during_completion")
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (operation_id,)
            )
            connection.execute("COMMIT")
        finally:
            connection.close()


class EagerRescue(ConcurrencyMutant):
    name = "eager-rescue"
    description = (
        "the claim ignores the lease: a pending entry another dispatcher is still working "
        "on is claimed again at once"
    )
    reported = "sidekiq #4611 (orphan recovered 3 s after fetch); celery/kombu #337"
    caught_by = ("EXCL",)
    minimal_steps = 3
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("dispatch", lane=1, hold=True),
        Step("dispatch", lane=2, hold=True),
    )

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        now, until = self.window
        rows = connection.execute(
            "UPDATE outbox SET attempt = attempt + 1, lease_until = ? WHERE rowid = ("
            "SELECT rowid FROM outbox WHERE state = 'pending' ORDER BY rowid LIMIT 1) "
            "RETURNING operation_id, attempt, "
            "(SELECT payload FROM operations WHERE id = operation_id)", (until,),
        ).fetchall()
        if not rows:
            return None
        operation_id, attempt, payload = rows[0]
        self.claim = (operation_id, int(attempt))
        return operation_id, payload


class FinishAndFail(ConcurrencyMutant):
    name = "finish-and-fail"
    description = (
        "a dispatcher that finds its claim superseded records the operation as failed, "
        "over the completion the new claimant recorded"
    )
    reported = "rails/solid_queue #589 (a job both finished and failed), PR #761"
    caught_by = ("FENCE", "TERM", "DONE")
    # Lane 1 claims (token 1); its lease lapses; lane 2 claims (token 2). The recovery
    # finishes lane 1 first: superseded, it writes its failure into the caller store (FENCE);
    # had lane 2 finished first, the failure would overwrite a completion (TERM).
    minimal_steps = 4
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("dispatch", lane=1, hold=True),
        Step("tick", ticks=LEASE_TICKS),
        Step("dispatch", lane=2, hold=True),
    )

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        try:
            super().complete(context, operation_id, result)
        except ClaimLost:
            connection = context.connect(CALLER)
            try:
                connection.execute(
                    "UPDATE operations SET result = ? WHERE id = ?",
                    ('{"error":"lease_lost"}', operation_id),
                )
            finally:
                connection.close()
            raise


class StaleRescue(ConcurrencyMutant):
    name = "stale-rescue"
    description = (
        "the claim is written from a stale read, unconditionally: an entry completed "
        "meanwhile is moved back to pending"
    )
    reported = "riverqueue/river #1302 (fixed in #1373 by a conditional update)"
    crash_points = (
        *REFERENCE_POINTS,
        CrashPoint(
            "claim_after_read", "dispatch",
            "after reading the next claimable entry, before writing the claim: nothing "
            "written yet; a fresh dispatcher claims it",
        ),
    )
    caught_by = ("TERM", "PAIR")
    # Both lanes read the entry and hold before claiming it; recovery finishes lane 1
    # (claims, completes), then lane 2 writes its stale claim over the completed row.
    minimal_steps = 3
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("dispatch", lane=1, hold=True),
        Step("dispatch", lane=2, hold=True),
    )
    context: WorkerContext | None = None

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        self.context = context
        return super().dispatch(context)

    def next_pending(self, connection: Any) -> tuple[str, str] | None:
        now, until = self.window
        row = connection.execute(
            "SELECT o.operation_id, o.attempt, op.payload FROM outbox o "
            "JOIN operations op ON op.id = o.operation_id "
            "WHERE o.state = 'pending' AND o.lease_until <= ? ORDER BY o.rowid LIMIT 1",
            (now,),
        ).fetchone()
        if row is None:
            return None
        if self.context is not None:
            self.context.crash_point("claim_after_read")
        attempt = int(row[1]) + 1
        connection.execute(
            "UPDATE outbox SET state = 'pending', attempt = ?, lease_until = ? "
            "WHERE operation_id = ?", (attempt, until, row[0]),
        )
        self.claim = (row[0], attempt)
        return row[0], row[2]


class SkipLocked(ConcurrencyMutant):
    name = "skip-locked"
    description = (
        "competing relays skip a leased entry and take the next, even one of the same key: "
        "a key's later operation is delivered before its earlier one"
    )
    reported = "per-key order lost with FOR UPDATE SKIP LOCKED relays (outbox relays)"
    caught_by = ("ORDER",)
    # Lane 2 claims op-1; lane 1 skips it and claims op-2 (same title); the recovery
    # finishes lane 1 first: op-2 gets ticket 1.
    minimal_steps = 4
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("accept", "op-2", PAYLOAD, lane=1),
        Step("dispatch", lane=2, hold=True),
        Step("dispatch", lane=1, hold=True),
    )

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        now, until = self.window
        rows = connection.execute(CLAIM_SKIP_LOCKED_SQL, (until, now)).fetchall()
        if not rows:
            return None
        operation_id, attempt, payload = rows[0]
        self.claim = (operation_id, int(attempt))
        return operation_id, payload


class RacyDedup(ConcurrencyMutant):
    name = "racy-dedup"
    description = (
        "the receiver checks for a receipt before its transaction (check, then insert): "
        "two concurrent deliveries both find none and both create a ticket"
    )
    reported = "NServiceBus #6583 (check-then-insert deduplication race)"
    crash_points = (
        *REFERENCE_POINTS,
        CrashPoint(
            "service_after_receipt_check", "service",
            "after finding no receipt, before the downstream transaction: no ticket; "
            "recovery makes ticket 1",
        ),
    )
    caught_by = ("ONE", "RCPT")
    # Both deliveries find no receipt and hold; recovery finishes both: two tickets.
    minimal_steps = 3
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("service", OP, PAYLOAD, lane=1, hold=True),
        Step("service", OP, PAYLOAD, lane=2, hold=True),
    )

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(DOWNSTREAM)
        try:
            if context.deduplication:
                receipt = connection.execute(
                    "SELECT payload, result FROM receipts WHERE operation_id = ?", (operation_id,)
                ).fetchone()
                if receipt is not None:
                    return self.replay_receipt(operation_id, payload, receipt[0], receipt[1])
            context.crash_point("service_after_receipt_check")
            connection.execute("BEGIN IMMEDIATE")
            ticket_id = connection.execute(
                "INSERT INTO tickets (operation_id, payload) VALUES (?, ?)",
                (operation_id, payload),
            ).lastrowid
            result = {"ticket_id": ticket_id}
            if context.deduplication:
                connection.execute(
                    "INSERT OR REPLACE INTO receipts (operation_id, payload, result) "
                    "VALUES (?, ?, ?)", (operation_id, payload, canonical_json(result)),
                )
            connection.execute("COMMIT")
        finally:
            connection.close()
        return {"operation_id": operation_id, "result": result, "replayed": False}


class LeaseTimeFence(ConcurrencyMutant):
    name = "lease-time-fence"
    description = (
        "completion is fenced by the entry's lease still running, not by this dispatcher's "
        "token: a dispatcher whose lease lapsed completes under its rescuer's fresh lease"
    )
    reported = "graphile-worker #169 (fixed lock expiry shorter than the work); pikkujs/pikku #1742"
    caught_by = ("FENCE",)
    # Lane 1 claims (lease until 10) and holds; the clock passes its lease; lane 2 claims
    # (lease until 20). The recovery finishes lane 1 first: the row's lease (lane 2's) still
    # runs, so lane 1's check passes and it completes although superseded.
    minimal_steps = 4
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=1),
        Step("dispatch", lane=1, hold=True),
        Step("tick", ticks=LEASE_TICKS),
        Step("dispatch", lane=2, hold=True),
    )

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            updated = connection.execute(
                "UPDATE operations SET state = 'complete', result = ? WHERE id = ? "
                "AND state = 'pending' AND EXISTS (SELECT 1 FROM outbox "
                "WHERE operation_id = id AND lease_until > ?)",
                (result, operation_id, context.now()),
            ).rowcount
            if not updated:
                connection.execute("ROLLBACK")
                raise ClaimLost(operation_id)
            context.crash_point("during_completion")
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (operation_id,)
            )
            connection.execute("COMMIT")
        finally:
            connection.close()


CURSOR_SCHEMA = """
CREATE TABLE outbox_sequence (value INTEGER NOT NULL);
INSERT INTO outbox_sequence VALUES (0);
CREATE TABLE outbox_position (
    operation_id TEXT PRIMARY KEY REFERENCES outbox(operation_id), position INTEGER NOT NULL);
CREATE TABLE relay_cursor (key ANY, position INTEGER NOT NULL)
"""


#: The reference's claim (lease lapsed, no earlier pending entry of the same key), limited to
#: rows above the high-water mark of their key and taken in position order.
CURSOR_CLAIM_SQL = (
    "UPDATE outbox SET attempt = attempt + 1, lease_until = ? WHERE rowid = ("
    "SELECT o.rowid FROM outbox o JOIN operations op ON op.id = o.operation_id "
    "JOIN outbox_position p ON p.operation_id = o.operation_id "
    "WHERE o.state = 'pending' AND o.lease_until <= ? "
    "AND p.position > coalesce((SELECT max(c.position) FROM relay_cursor c "
    f"WHERE c.key IS json_extract(op.payload, '$.{ORDERING_KEY}')), 0) AND NOT EXISTS ("
    "SELECT 1 FROM outbox e JOIN operations eo ON eo.id = e.operation_id "
    "WHERE e.state = 'pending' AND e.rowid < o.rowid "
    f"AND json_extract(eo.payload, '$.{ORDERING_KEY}') "
    f"IS json_extract(op.payload, '$.{ORDERING_KEY}')) "
    "ORDER BY p.position LIMIT 1) "
    "RETURNING operation_id, attempt, (SELECT payload FROM operations WHERE id = operation_id)"
)


class RelayCursor(ConcurrencyMutant):
    name = "relay-cursor"
    description = (
        "the relay keeps a high-water mark on the outbox position and claims only rows "
        "above it; positions are taken before the acceptance commits (a sequence), so a "
        "row whose position was taken before a later row's commit is skipped for good"
    )
    reported = "kamu-data/kamu-cli #1398; Debezium PR #7531 (events lost under a cursor)"
    crash_points = (
        *REFERENCE_POINTS,
        CrashPoint(
            "accept_after_position", "accept",
            "after taking the outbox position, before the acceptance transaction: the "
            "position is spent, nothing else written; accepting again succeeds",
        ),
    )
    caught_by = ("SKIP", "LIVE")
    # Lane 2 takes position 1 and holds; lane 1 takes position 2 and holds. The recovery
    # finishes lane 1 first: op-2 commits (position 2) before op-1 (position 1), so the key's
    # order relays op-2 first and its mark passes op-1's position: op-1 is skipped for good.
    minimal_steps = 2
    minimal_trace = (
        Step("accept", OP, PAYLOAD, lane=2, hold=True),
        Step("accept", "op-2", PAYLOAD, lane=1, hold=True),
    )
    position: int = 0

    def initialise(self, directory: Path) -> None:
        stores.initialise(directory / CALLER, f"{CALLER_SCHEMA};\n{CURSOR_SCHEMA}")
        stores.initialise(directory / DOWNSTREAM, DOWNSTREAM_SCHEMA)

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(CALLER)
        try:  # like nextval(): its own transaction, never rolled back with the acceptance
            connection.execute("BEGIN IMMEDIATE")
            (self.position,) = connection.execute(
                "UPDATE outbox_sequence SET value = value + 1 RETURNING value").fetchone()
            connection.execute("COMMIT")
        finally:
            connection.close()
        context.crash_point("accept_after_position")
        return super().accept(context, operation_id, payload)

    def insert_operation(
        self, context: WorkerContext, connection: sqlite3.Connection, operation_id: str,
        payload: str,
    ) -> None:
        super().insert_operation(context, connection, operation_id, payload)
        connection.execute("INSERT INTO outbox_position (operation_id, position) VALUES (?, ?)",
                           (operation_id, self.position))

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        now, until = self.window
        rows = connection.execute(CURSOR_CLAIM_SQL, (until, now)).fetchall()
        if not rows:
            return None
        operation_id, attempt, payload = rows[0]
        self.claim = (operation_id, int(attempt))
        return operation_id, payload

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        super().complete(context, operation_id, result)
        connection = context.connect(CALLER)
        try:  # the key's high-water mark (its largest row): everything up to here is relayed
            connection.execute(
                f"INSERT INTO relay_cursor (key, position) SELECT json_extract(op.payload, "
                f"'$.{ORDERING_KEY}'), p.position FROM operations op JOIN outbox_position p "
                "ON p.operation_id = op.id WHERE op.id = ?", (operation_id,))
        finally:
            connection.close()
