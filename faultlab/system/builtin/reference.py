"""The reference two-store outbox: the behaviour the own-system guide describes, for many
operations.

Caller store ``caller.sqlite`` holds ``operations`` and ``outbox``; downstream
store ``downstream.sqlite`` holds ``tickets`` and ``receipts``. Each worker
writes one store at a time, inside ``BEGIN IMMEDIATE`` ... ``COMMIT``; no
transaction spans both files. Mutants in the bug zoo subclass this and change
one method, so every defect is a small, readable diff against this file.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from faultlab.base import clock
from faultlab.base.canonical import canonical_json
from faultlab.stores import sqlite as stores
from faultlab.stores.sqlite import Snapshot
from faultlab.system.contract import CrashPoint, Refusal, System, WorkerContext

CALLER = "caller.sqlite"
DOWNSTREAM = "downstream.sqlite"

CALLER_SCHEMA = """
CREATE TABLE operations (
    id TEXT PRIMARY KEY, payload TEXT NOT NULL, state TEXT NOT NULL, result TEXT);
CREATE TABLE outbox (
    operation_id TEXT PRIMARY KEY REFERENCES operations(id), state TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 0, lease_until REAL NOT NULL DEFAULT 0)
"""

#: How long a dispatcher's claim lasts, in ticks of faultlab's virtual clock. On the real
#: clock (sequential traces: one dispatcher at a time, a new one only after the last died)
#: there is nobody to exclude, and the lease is 0: every pending entry is claimable at once.
LEASE_TICKS = 10

#: The payload field whose value orders operations: one title's operations are delivered
#: in acceptance order.
ORDERING_KEY = "title"

#: Claim the oldest pending entry whose lease has lapsed and that no earlier pending entry
#: of the same key precedes, in one statement: take a new fencing token (the attempt
#: number) and a lease, and read the payload to send. In a sequential trace this is the
#: oldest pending entry, as the spec says.
CLAIM_SQL = (
    "UPDATE outbox SET attempt = attempt + 1, lease_until = ? WHERE rowid = ("
    "SELECT o.rowid FROM outbox o JOIN operations op ON op.id = o.operation_id "
    "WHERE o.state = 'pending' AND o.lease_until <= ? AND NOT EXISTS ("
    "SELECT 1 FROM outbox e JOIN operations eo ON eo.id = e.operation_id "
    "WHERE e.state = 'pending' AND e.rowid < o.rowid "
    f"AND json_extract(eo.payload, '$.{ORDERING_KEY}') "
    f"IS json_extract(op.payload, '$.{ORDERING_KEY}')) "
    "ORDER BY o.rowid LIMIT 1) "
    "RETURNING operation_id, attempt, (SELECT payload FROM operations WHERE id = operation_id)"
)
#: The same claim without the per-key condition: skip whatever is leased, take the next.
CLAIM_SKIP_LOCKED_SQL = (
    "UPDATE outbox SET attempt = attempt + 1, lease_until = ? WHERE rowid = ("
    "SELECT rowid FROM outbox WHERE state = 'pending' AND lease_until <= ? "
    "ORDER BY rowid LIMIT 1) "
    "RETURNING operation_id, attempt, (SELECT payload FROM operations WHERE id = operation_id)"
)
DOWNSTREAM_SCHEMA = """
CREATE TABLE tickets (
    id INTEGER PRIMARY KEY, operation_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE receipts (
    operation_id TEXT PRIMARY KEY, payload TEXT NOT NULL, result TEXT NOT NULL)
"""

EXIT_CONFLICT = 3
EXIT_DOWNSTREAM_FAILURE = 4

REFERENCE_POINTS: tuple[CrashPoint, ...] = (
    CrashPoint(
        "during_accept", "accept",
        "between the operation insert and the outbox insert, inside one transaction: "
        "the transaction rolls back, so neither row exists; accepting again succeeds",
    ),
    CrashPoint(
        "before_dispatch", "dispatch",
        "after reading the pending entry, before any downstream call: no ticket; "
        "the operation stays pending and a fresh dispatcher completes it with ticket 1",
    ),
    CrashPoint(
        "after_downstream_commit", "dispatch",
        "the service committed ticket and receipt, the caller has not recorded completion: "
        "one ticket, operation pending; recovery replays the receipt, still one ticket",
    ),
    CrashPoint(
        "during_completion", "dispatch",
        "between the operation and outbox completion updates, inside one caller transaction: "
        "both stay pending; recovery replays the receipt and completes both",
    ),
    CrashPoint(
        "service_before_commit", "service",
        "inside the downstream transaction, after the ticket and receipt inserts: "
        "rolled back, no ticket; the dispatcher reports downstream_failure; "
        "recovery makes ticket 1",
    ),
    CrashPoint(
        "service_after_commit", "service",
        "downstream committed, the service dies before replying: one ticket and its receipt, "
        "the dispatcher reports downstream_failure; recovery replays the receipt",
    ),
)


class ClaimLost(Exception):
    """This dispatcher's claim was superseded (its lease lapsed and another claimed the
    entry): it must not record completion."""


class ReferenceOutbox(System):
    """Transactional outbox + stable operation id + deduplicating receiver."""

    name = "reference"
    description = ("the correct two-store outbox (docs/guide/own-system.md), extended to many "
                   "operations")
    crash_points = REFERENCE_POINTS
    ordering_key = ORDERING_KEY

    # -- stores ------------------------------------------------------------------------------

    def initialise(self, directory: Path) -> None:
        stores.initialise(directory / CALLER, CALLER_SCHEMA)
        stores.initialise(directory / DOWNSTREAM, DOWNSTREAM_SCHEMA)

    def snapshot(self, directory: Path) -> Snapshot:
        return Snapshot.from_rows({
            **stores.query(directory / CALLER, {
                "operations": "SELECT id, payload, state, result FROM operations",
                "outbox": "SELECT operation_id, state FROM outbox",
            }),
            **stores.query(directory / DOWNSTREAM, {
                "tickets": "SELECT id, operation_id, payload FROM tickets",
                "receipts": "SELECT operation_id, payload, result FROM receipts",
            }),
        })

    # -- caller ------------------------------------------------------------------------------

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            existing = connection.execute(
                "SELECT payload, state FROM operations WHERE id = ?", (operation_id,)
            ).fetchone()
            if existing is not None:
                connection.execute("ROLLBACK")
                return self.accept_existing(operation_id, payload, existing[0], existing[1])
            self.insert_operation(context, connection, operation_id, payload)
            connection.execute("COMMIT")
        finally:
            connection.close()
        return {"accepted": True, "operation_id": operation_id, "state": "pending"}

    def accept_existing(
        self, operation_id: str, payload: str, stored_payload: str, state: str
    ) -> dict[str, Any]:
        """The same id again: idempotent with the same payload, refused with another."""
        if stored_payload != payload:
            raise Refusal("payload_conflict", EXIT_CONFLICT, operation_id=operation_id)
        return {
            "accepted": True, "already_accepted": True, "operation_id": operation_id,
            "state": state,
        }

    def insert_operation(
        self, context: WorkerContext, connection: sqlite3.Connection, operation_id: str,
        payload: str,
    ) -> None:
        connection.execute(
            "INSERT INTO operations (id, payload, state, result) VALUES (?, ?, 'pending', NULL)",
            (operation_id, payload),
        )
        context.crash_point("during_accept")
        connection.execute(
            "INSERT INTO outbox (operation_id, state) VALUES (?, 'pending')", (operation_id,)
        )

    #: This dispatcher's claim (operation id, fencing token), set by :meth:`next_pending`;
    #: None when a subclass reads the next entry without claiming it.
    claim: tuple[str, int] | None = None
    #: (now, lease end) for the claim this dispatcher is about to take.
    window: tuple[float, float] = (0.0, 0.0)

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        """Claim the oldest pending entry whose lease lapsed (one statement, so concurrent
        dispatchers never claim the same entry at the same attempt)."""
        now, until = self.window
        rows = connection.execute(CLAIM_SQL, (until, now)).fetchall()
        if not rows:
            return None
        operation_id, attempt, payload = rows[0]
        self.claim = (operation_id, int(attempt))
        return operation_id, payload

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        now = context.now()
        self.window = (now, now + (LEASE_TICKS if clock.is_virtual() else 0))
        self.claim = None
        connection = context.connect(CALLER)
        try:
            pending = self.next_pending(connection)
        finally:
            connection.close()
        if pending is None:
            return {"idle": True}
        operation_id, payload = pending
        if self.claim is not None:
            context.claimed(*self.claim, lease_until=self.window[1])
        context.crash_point("before_dispatch")
        key, sent = self.downstream_request(context, operation_id, payload)
        service = context.call_service(key, sent)
        service_summary = {"pid": service.pid, "exit_code": service.exit_code}
        response = service.response or {}
        if service.exit_code != 0 or "result" not in response:
            self.on_downstream_failure(context, operation_id)
            raise Refusal(
                "downstream_failure", EXIT_DOWNSTREAM_FAILURE, operation_id=operation_id,
                service=service_summary, downstream=response or None,
            )
        context.crash_point("after_downstream_commit")
        result = canonical_json(response["result"])
        try:
            self.complete(context, operation_id, result)
        except ClaimLost:
            return {"operation_id": operation_id, "superseded": True,
                    "attempt": self.claim[1] if self.claim else None,
                    "service": service_summary}
        return {
            "operation_id": operation_id, "result": response["result"],
            "replayed": bool(response.get("replayed")), "service": service_summary,
        }

    def downstream_request(
        self, context: WorkerContext, operation_id: str, payload: str
    ) -> tuple[str, str]:
        """What goes downstream: the operation id as idempotency key, the stored payload bytes."""
        return operation_id, payload

    def on_downstream_failure(self, context: WorkerContext, operation_id: str) -> None:
        """A failed downstream call leaves the operation pending for the next dispatcher."""

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        """Record completion, only while this dispatcher still holds its claim (fencing):
        a dispatcher whose lease lapsed and whose entry another claimed changes nothing."""
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            arguments: tuple[Any, ...] = (result, operation_id)
            fence = ""  # a subclass that reads without claiming completes unfenced
            if self.claim is not None:
                fence = (" AND state = 'pending' AND EXISTS (SELECT 1 FROM outbox "
                         "WHERE operation_id = id AND attempt = ?)")
                arguments = (result, operation_id, self.claim[1])
            updated = connection.execute(
                "UPDATE operations SET state = 'complete', result = ? WHERE id = ?" + fence,
                arguments,
            ).rowcount
            if not updated and self.claim is not None:
                connection.execute("ROLLBACK")
                raise ClaimLost(operation_id)
            context.crash_point("during_completion")
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (operation_id,)
            )
            connection.execute("COMMIT")
        finally:
            connection.close()

    # -- downstream --------------------------------------------------------------------------

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(DOWNSTREAM)
        try:
            connection.execute("BEGIN IMMEDIATE")
            if context.deduplication:
                receipt = connection.execute(
                    "SELECT payload, result FROM receipts WHERE operation_id = ?", (operation_id,)
                ).fetchone()
                if receipt is not None:
                    connection.execute("ROLLBACK")
                    return self.replay_receipt(operation_id, payload, receipt[0], receipt[1])
            result = self.record_ticket(context, connection, operation_id, payload)
        finally:
            connection.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": result, "replayed": False}

    def record_ticket(
        self, context: WorkerContext, connection: sqlite3.Connection, operation_id: str,
        payload: str,
    ) -> dict[str, Any]:
        """Insert the ticket and its receipt and commit them together (transaction open)."""
        ticket_id = connection.execute(
            "INSERT INTO tickets (operation_id, payload) VALUES (?, ?)", (operation_id, payload)
        ).lastrowid
        result = {"ticket_id": ticket_id}
        if context.deduplication:
            connection.execute(
                "INSERT INTO receipts (operation_id, payload, result) VALUES (?, ?, ?)",
                (operation_id, payload, canonical_json(result)),
            )
        context.crash_point("service_before_commit")
        connection.execute("COMMIT")
        return result

    def replay_receipt(
        self, operation_id: str, payload: str, stored_payload: str, stored_result: str
    ) -> dict[str, Any]:
        if stored_payload != payload:
            raise Refusal("payload_conflict", EXIT_CONFLICT, operation_id=operation_id)
        return {"operation_id": operation_id, "result": json.loads(stored_result), "replayed": True}
