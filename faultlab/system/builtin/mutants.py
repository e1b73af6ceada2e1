"""The bug zoo: the reference outbox with one deliberate, realistic defect each.

Every mutant subclasses :class:`~faultlab.system.builtin.reference.ReferenceOutbox` and
overrides one method, so each defect is a small diff against the reference:
different SQL or a different transaction structure, never a switch that only
pretends. Each mutant states the defect (``description``), the invariants
expected to catch it (``caught_by``, names from :data:`faultlab.checks.invariants.INVARIANTS`)
and its known minimal trace (``minimal_trace``, run with the final recovery)
together with ``minimal_steps``: the number of steps that trace executes up to
the failing check, recovery dispatches included; for a ``LIVE`` finding, every
executed step. Mutants that split a transaction declare the crash point between
the two transactions, after the reference's points.

Add a mutant: subclass, override the one method that carries the defect, fill in
the five class attributes, add one line to :data:`faultlab.system.builtin.registry.BUILTINS`,
and give ``tests/test_mutants.py`` nothing new: it is parametrised over the registry.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable
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
    REFERENCE_POINTS,
    ReferenceOutbox,
)
from faultlab.system.contract import CrashPoint, WorkerContext
from faultlab.trace import Step

#: The reference's claim without its per-key condition, newest first.
NEWEST_FIRST_SQL = CLAIM_SKIP_LOCKED_SQL.replace("ORDER BY rowid LIMIT 1",
                                                 "ORDER BY rowid DESC LIMIT 1")
if NEWEST_FIRST_SQL == CLAIM_SKIP_LOCKED_SQL:
    raise ImportError("faultlab.system.builtin.mutants: the newest-first claim is the reference's")

OP = "op-1"
PAYLOAD: dict[str, Any] = {"title": "backlog", "priority": "normal"}
CHANGED: dict[str, Any] = {"title": "backlog", "priority": "urgent"}


class Mutant(ReferenceOutbox):
    """A reference outbox with one defect; the attributes below describe how it is caught."""

    caught_by: tuple[str, ...] = ()
    minimal_steps: int = 0
    minimal_trace: tuple[Step, ...] = ()
    #: What a trace needs to show the defect (see :mod:`faultlab.system.builtin.registry`):
    #: one lane; ``fault = "power"`` for a mutant only a power cut shows.
    concurrency: int = 1
    fault: str | None = None
    #: False when ``enumerate`` cannot express the trigger with its defaults (its payloads
    #: are fixed and its ids are op-N; two operations): data and depth mutants are for
    #: ``explore`` to catch, and the zoo judges enumerate on them as "n/a".
    enumerable: bool = True


# --- caller: acceptance ----------------------------------------------------------------------


class NoDedup(Mutant):
    name = "no-dedup"
    description = "the downstream never reads or writes receipts: every delivery is a new ticket"
    # Under deduplication RCPT sees the receipt-less ticket at the first delivery; ONE
    # sees the duplicate a recovery makes (and is what catches it with --no-deduplication).
    caught_by = ("RCPT", "ONE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD),)

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(DOWNSTREAM)
        try:
            connection.execute("BEGIN IMMEDIATE")
            ticket_id = connection.execute(
                "INSERT INTO tickets (operation_id, payload) VALUES (?, ?)", (operation_id, payload)
            ).lastrowid
            context.crash_point("service_before_commit")
            connection.execute("COMMIT")
        finally:
            connection.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": {"ticket_id": ticket_id}, "replayed": False}


ACCEPT_SPLIT = CrashPoint(
    "accept_between_commits", "accept",
    "between the two acceptance transactions: the first row is committed without the other",
)


class SplitAccept(Mutant):
    name = "split-accept"
    description = "the operation row and its outbox row are committed in two transactions"
    crash_points = (*REFERENCE_POINTS, ACCEPT_SPLIT)
    caught_by = ("ATOM",)
    minimal_steps = 1
    minimal_trace = (Step("accept", OP, PAYLOAD, crash="commit:1"),)

    def insert_operation(
        self, context: WorkerContext, connection: sqlite3.Connection, operation_id: str,
        payload: str,
    ) -> None:
        connection.execute(
            "INSERT INTO operations (id, payload, state, result) VALUES (?, ?, 'pending', NULL)",
            (operation_id, payload),
        )
        context.crash_point("during_accept")
        connection.execute("COMMIT")
        context.crash_point("accept_between_commits")
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(
            "INSERT INTO outbox (operation_id, state) VALUES (?, 'pending')", (operation_id,)
        )


class SplitAcceptOutboxFirst(Mutant):
    name = "split-accept-outbox-first"
    description = "the outbox row is committed first, the operation row in a second transaction"
    crash_points = (*REFERENCE_POINTS, ACCEPT_SPLIT)
    caught_by = ("ATOM",)
    minimal_steps = 1
    minimal_trace = (Step("accept", OP, PAYLOAD, crash="commit:1"),)

    def insert_operation(
        self, context: WorkerContext, connection: sqlite3.Connection, operation_id: str,
        payload: str,
    ) -> None:
        connection.execute(
            "INSERT INTO outbox (operation_id, state) VALUES (?, 'pending')", (operation_id,)
        )
        context.crash_point("during_accept")
        connection.execute("COMMIT")
        context.crash_point("accept_between_commits")
        connection.execute("BEGIN IMMEDIATE")
        connection.execute(
            "INSERT INTO operations (id, payload, state, result) VALUES (?, ?, 'pending', NULL)",
            (operation_id, payload),
        )


class CallerOverwrite(Mutant):
    name = "caller-overwrite"
    description = "accepting an existing id with a new payload overwrites it (an upsert)"
    # ACK sees the acknowledged payload replaced at once; PAY would see the ticket later.
    caught_by = ("ACK", "PAY")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("accept", OP, CHANGED))

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "INSERT INTO operations (id, payload, state, result) "
                "VALUES (?, ?, 'pending', NULL) "
                "ON CONFLICT (id) DO UPDATE SET payload = excluded.payload",
                (operation_id, payload),
            )
            context.crash_point("during_accept")
            connection.execute(
                "INSERT INTO outbox (operation_id, state) VALUES (?, 'pending') "
                "ON CONFLICT (operation_id) DO NOTHING",
                (operation_id,),
            )
            connection.execute("COMMIT")
        finally:
            connection.close()
        return {"accepted": True, "operation_id": operation_id, "state": "pending"}


# --- caller: dispatch ------------------------------------------------------------------------


COMPLETION_SPLIT = CrashPoint(
    "completion_between_commits", "dispatch",
    "between the two completion transactions: one of the pair is complete, the other pending",
)


class SplitComplete(Mutant):
    name = "split-complete"
    description = "the operation and its outbox row are marked complete in two transactions"
    crash_points = (*REFERENCE_POINTS, COMPLETION_SPLIT)
    caught_by = ("PAIR",)
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("dispatch", crash="commit:1"))

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "UPDATE operations SET state = 'complete', result = ? WHERE id = ?",
                (result, operation_id),
            )
            context.crash_point("during_completion")
            connection.execute("COMMIT")
            context.crash_point("completion_between_commits")
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (operation_id,)
            )
            connection.execute("COMMIT")
        finally:
            connection.close()


class SplitCompleteOutboxFirst(Mutant):
    name = "split-complete-outbox-first"
    description = "the outbox row is marked complete first, the operation in a second transaction"
    crash_points = (*REFERENCE_POINTS, COMPLETION_SPLIT)
    # PAIR sees the half-completed pair at once (recovery would never finish it: LIVE).
    caught_by = ("PAIR", "LIVE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("dispatch", crash="commit:1"))

    def complete(self, context: WorkerContext, operation_id: str, result: str) -> None:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (operation_id,)
            )
            context.crash_point("during_completion")
            connection.execute("COMMIT")
            context.crash_point("completion_between_commits")
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "UPDATE operations SET state = 'complete', result = ? WHERE id = ?",
                (result, operation_id),
            )
            connection.execute("COMMIT")
        finally:
            connection.close()


class CompleteBeforeSend(Mutant):
    name = "complete-before-send"
    description = "the dispatcher marks the entry complete when it claims it, before the call"
    caught_by = ("DONE", "LIVE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("dispatch", crash="before_dispatch"))

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        connection.execute("BEGIN IMMEDIATE")
        row = connection.execute(
            "SELECT o.operation_id, op.payload FROM outbox o "
            "JOIN operations op ON op.id = o.operation_id "
            "WHERE o.state = 'pending' ORDER BY o.rowid LIMIT 1"
        ).fetchone()
        if row is not None:
            connection.execute("UPDATE operations SET state = 'complete' WHERE id = ?", (row[0],))
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (row[0],)
            )
        connection.execute("COMMIT")
        return None if row is None else (row[0], row[1])


class ErrorCompletes(Mutant):
    name = "error-completes"
    description = "a failed downstream call marks the operation complete with the error"
    caught_by = ("DONE",)
    minimal_steps = 2
    minimal_trace = (
        Step("accept", OP, PAYLOAD), Step("dispatch", crash="service_before_commit"),
    )

    def on_downstream_failure(self, context: WorkerContext, operation_id: str) -> None:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "UPDATE operations SET state = 'complete', result = ? WHERE id = ?",
                ('{"error":"downstream_failure"}', operation_id),
            )
            connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ?", (operation_id,)
            )
            connection.execute("COMMIT")
        finally:
            connection.close()


class IdleResend(Mutant):
    name = "idle-resend"
    description = "with nothing pending, the dispatcher re-sends the oldest completed entry"
    caught_by = ("QUIET",)
    minimal_steps = 3
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("dispatch"), Step("dispatch"))

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        row = connection.execute(
            "SELECT o.operation_id, op.payload FROM outbox o "
            "JOIN operations op ON op.id = o.operation_id "
            "WHERE o.state IN ('pending', 'complete') "
            "ORDER BY o.state = 'pending' DESC, o.rowid LIMIT 1"
        ).fetchone()
        return None if row is None else (row[0], row[1])


class RetryReopens(Mutant):
    name = "retry-reopens"
    description = (
        "a resubmission of an accepted operation re-opens it (an upsert that resets its "
        "state): a completed operation goes back to pending and is sent again"
    )
    # Only TERM sees it: both rows go back to pending together (PAIR holds), the payload is
    # unchanged (ACK), and recovery completes it again with the receipt's ticket (LIVE).
    caught_by = ("TERM",)
    minimal_steps = 3
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("dispatch"), Step("accept", OP, PAYLOAD))

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            existing = connection.execute(
                "SELECT payload, state FROM operations WHERE id = ?", (operation_id,)
            ).fetchone()
            if existing is None:
                self.insert_operation(context, connection, operation_id, payload)
            elif existing[0] != payload:
                connection.execute("ROLLBACK")
                return self.accept_existing(operation_id, payload, existing[0], existing[1])
            else:
                connection.execute(
                    "UPDATE operations SET state = 'pending', result = NULL WHERE id = ?",
                    (operation_id,))
                connection.execute(
                    "UPDATE outbox SET state = 'pending', lease_until = 0 "
                    "WHERE operation_id = ?", (operation_id,))
            connection.execute("COMMIT")
        finally:
            connection.close()
        return {"accepted": True, "operation_id": operation_id, "state": "pending"}


class SharedKey(Mutant):
    name = "shared-key"
    description = (
        "the idempotency key is derived from the payload's title, so operations with the "
        "same title share a ticket"
    )
    # At the first delivery KEY sees a downstream key the caller never accepted and DONE
    # an operation completed without a ticket of its own; two same-title operations would
    # then share one ticket, or the second would be refused forever (LIVE).
    caught_by = ("KEY", "DONE", "LIVE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD),)

    def downstream_request(
        self, context: WorkerContext, operation_id: str, payload: str
    ) -> tuple[str, str]:
        return f"title:{json.loads(payload).get('title')}", payload


ATTEMPTS_SCHEMA = (
    "CREATE TABLE dispatch_attempts (operation_id TEXT PRIMARY KEY, attempts INTEGER NOT NULL)"
)


class _CountsAttempts(Mutant):
    """Scaffolding, not a defect: the dispatcher counts its attempts per operation in the
    caller store (as outboxes with backoff do), in a table snapshots do not show."""

    def initialise(self, directory: Path) -> None:
        stores.initialise(directory / CALLER, f"{CALLER_SCHEMA};\n{ATTEMPTS_SCHEMA}")
        stores.initialise(directory / DOWNSTREAM, DOWNSTREAM_SCHEMA)

    def record_attempt(self, context: WorkerContext, operation_id: str) -> int:
        connection = context.connect(CALLER)
        try:
            connection.execute("BEGIN IMMEDIATE")
            connection.execute(
                "INSERT INTO dispatch_attempts (operation_id, attempts) VALUES (?, 1) "
                "ON CONFLICT (operation_id) DO UPDATE SET attempts = attempts + 1",
                (operation_id,),
            )
            (attempts,) = connection.execute(
                "SELECT attempts FROM dispatch_attempts WHERE operation_id = ?", (operation_id,)
            ).fetchone()
            connection.execute("COMMIT")
        finally:
            connection.close()
        return int(attempts)


class FreshKeyOnRecovery(_CountsAttempts):
    name = "fresh-key-on-recovery"
    description = "a dispatch that finds an earlier attempt sends a new idempotency key"
    # KEY: the retry's key was never accepted; DONE: the operation stores the retry's
    # ticket while its own key holds the first one (ONE would count per key).
    caught_by = ("KEY", "DONE", "ONE")
    minimal_steps = 3
    minimal_trace = (
        Step("accept", OP, PAYLOAD), Step("dispatch", crash="after_downstream_commit"),
    )

    def downstream_request(
        self, context: WorkerContext, operation_id: str, payload: str
    ) -> tuple[str, str]:
        attempt = self.record_attempt(context, operation_id)
        return (operation_id if attempt == 1 else f"{operation_id}/retry-{attempt}"), payload


class NonCanonicalRetry(_CountsAttempts):
    name = "non-canonical-retry"
    description = (
        "a retry re-encodes the payload without canonical JSON, so the receiver sees a "
        "conflict and the operation never completes"
    )
    # LIVE after a crash past the downstream commit (the receipt refuses the new bytes);
    # PAY first when no receipt exists yet (the ticket keeps non-canonical bytes).
    caught_by = ("PAY", "LIVE")
    minimal_steps = 3
    minimal_trace = (
        Step("accept", OP, PAYLOAD), Step("dispatch", crash="service_before_commit"),
    )

    def downstream_request(
        self, context: WorkerContext, operation_id: str, payload: str
    ) -> tuple[str, str]:
        attempt = self.record_attempt(context, operation_id)
        return operation_id, payload if attempt == 1 else json.dumps(json.loads(payload))


# --- downstream ------------------------------------------------------------------------------


class SplitReceipt(Mutant):
    name = "split-receipt"
    description = "the ticket and its receipt are committed in two downstream transactions"
    crash_points = (
        *REFERENCE_POINTS,
        CrashPoint(
            "service_between_commits", "service",
            "between the ticket commit and the receipt commit: a ticket without its receipt",
        ),
    )
    # RCPT sees the receipt-less ticket; recovery then makes a second ticket (ONE).
    caught_by = ("RCPT", "ONE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("service", OP, PAYLOAD, crash="commit:1"))

    def record_ticket(
        self, context: WorkerContext, connection: sqlite3.Connection, operation_id: str,
        payload: str,
    ) -> dict[str, Any]:
        ticket_id = connection.execute(
            "INSERT INTO tickets (operation_id, payload) VALUES (?, ?)", (operation_id, payload)
        ).lastrowid
        result = {"ticket_id": ticket_id}
        connection.execute("COMMIT")
        context.crash_point("service_between_commits")
        connection.execute("BEGIN IMMEDIATE")
        if context.deduplication:
            connection.execute(
                "INSERT INTO receipts (operation_id, payload, result) VALUES (?, ?, ?)",
                (operation_id, payload, canonical_json(result)),
            )
        context.crash_point("service_before_commit")
        connection.execute("COMMIT")
        return result


class NoPayloadCheck(Mutant):
    name = "no-payload-check"
    description = "the downstream deduplicates by id alone and replays a receipt for any payload"
    caught_by = ("PAY",)
    minimal_steps = 3
    minimal_trace = (
        Step("accept", OP, PAYLOAD), Step("dispatch"), Step("service", OP, CHANGED),
    )

    def replay_receipt(
        self, operation_id: str, payload: str, stored_payload: str, stored_result: str
    ) -> dict[str, Any]:
        return {"operation_id": operation_id, "result": json.loads(stored_result), "replayed": True}


# --- data and depth: bugs that hide in ids, payload values and long traces ----------


class NewestFirst(Mutant):
    name = "newest-first"
    description = (
        "the relay takes the newest pending entry first (ORDER BY rowid DESC): a key's "
        "later operation is delivered before its earlier one"
    )
    # Only ORDER sees it: every operation still gets exactly one ticket. Enumerate's
    # payloads give each operation a title of its own, so no two share an ordering key.
    caught_by = ("ORDER",)
    minimal_steps = 3
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("accept", "op-2", PAYLOAD),
                     Step("dispatch"))
    enumerable = False

    def next_pending(self, connection: sqlite3.Connection) -> tuple[str, str] | None:
        now, until = self.window
        rows = connection.execute(NEWEST_FIRST_SQL, (until, now)).fetchall()
        if not rows:
            return None
        operation_id, attempt, payload = rows[0]
        self.claim = (operation_id, int(attempt))
        return operation_id, payload



class CaseInsensitiveKey(Mutant):
    name = "case-insensitive-key"
    description = (
        "the receiver looks receipts up case-insensitively, so op-1 and OP-1 share a ticket"
    )
    # DONE: OP-1 completes with op-1's ticket (same payload); with another payload the
    # receiver refuses OP-1 for ever (LIVE).
    caught_by = ("DONE", "LIVE")
    minimal_steps = 4
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("accept", "OP-1", PAYLOAD))
    enumerable = False

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect(DOWNSTREAM)
        try:
            connection.execute("BEGIN IMMEDIATE")
            if context.deduplication:
                receipt = connection.execute(
                    "SELECT payload, result FROM receipts WHERE operation_id = ? COLLATE NOCASE",
                    (operation_id,),
                ).fetchone()
                if receipt is not None:
                    connection.execute("ROLLBACK")
                    return self.replay_receipt(operation_id, payload, receipt[0], receipt[1])
            result = self.record_ticket(context, connection, operation_id, payload)
        finally:
            connection.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": result, "replayed": False}


LONG_ID = "tenant-0042/region-eu-west-1/customer-7f3a9c2e/order-2026-11-30/op-1"


class TruncatedKey(Mutant):
    name = "truncated-key"
    description = "the idempotency key is cut to 64 characters, so long ids collide"
    # KEY: the receiver holds a key the caller never accepted; DONE: the operation has no
    # ticket under its own id (two ids with one 64-character prefix would share a ticket).
    caught_by = ("KEY", "DONE")
    minimal_steps = 2
    minimal_trace = (Step("accept", LONG_ID, PAYLOAD),)
    enumerable = False

    def downstream_request(
        self, context: WorkerContext, operation_id: str, payload: str
    ) -> tuple[str, str]:
        return operation_id[:64], payload


def _as_double(number: int) -> int | float:
    """What a JavaScript or Go float64 decoder makes of an integer."""
    value = float(number)
    return int(value) if abs(value) < 1e21 else value


class LossyNumbers(Mutant):
    name = "lossy-numbers"
    description = "the receiver decodes numbers as doubles: integers beyond 2^53 change"
    # PAY: the ticket (and receipt) carry 9007199254740992 for an accepted 9007199254740993.
    caught_by = ("PAY",)
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, {"count": 2**53 + 1}),)
    enumerable = False

    def record_ticket(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> dict[str, Any]:
        decoded = json.loads(payload, parse_int=lambda text: _as_double(int(text)))
        return super().record_ticket(context, connection, operation_id, canonical_json(decoded))


def _nfc(value: Any) -> Any:
    import unicodedata

    if isinstance(value, str):
        return unicodedata.normalize("NFC", value)
    if isinstance(value, list):
        return [_nfc(item) for item in value]
    if isinstance(value, dict):
        return {_nfc(key): _nfc(item) for key, item in value.items()}
    return value


class UnicodeNormalising(Mutant):
    name = "unicode-normalising"
    description = "the receiver NFC-normalises strings, so e + combining acute becomes \u00e9"
    caught_by = ("PAY",)
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, {"title": "cafe\u0301"}),)
    enumerable = False

    def record_ticket(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> dict[str, Any]:
        normalised = canonical_json(_nfc(json.loads(payload)))
        return super().record_ticket(context, connection, operation_id, normalised)


def _map_strings(value: Any, change: Callable[[str], str]) -> Any:
    if isinstance(value, str):
        return change(value)
    if isinstance(value, list):
        return [_map_strings(item, change) for item in value]
    if isinstance(value, dict):
        return {change(key): _map_strings(item, change) for key, item in value.items()}
    return value


def _utf8mb3(text: str) -> str:
    """MySQL's 3-byte ``utf8`` in non-strict mode: the value ends at the first character
    beyond the BMP (an emoji, a mathematical letter)."""
    for index, character in enumerate(text):
        if ord(character) > 0xFFFF:
            return text[:index]
    return text


class Utf8mb3Column(Mutant):
    name = "utf8mb3-column"
    description = "the receiver stores 3-byte UTF-8 (MySQL utf8): text ends at a non-BMP character"
    caught_by = ("PAY",)
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, {"title": "\U0001f4e6 parcel"}),)
    enumerable = False

    def record_ticket(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> dict[str, Any]:
        stored = canonical_json(_map_strings(json.loads(payload), _utf8mb3))
        return super().record_ticket(context, connection, operation_id, stored)


def _float32(value: Any) -> Any:
    import struct

    if isinstance(value, float):
        try:
            return struct.unpack("f", struct.pack("f", value))[0]
        except OverflowError:  # beyond float32: the column holds infinity; JSON cannot
            return None
    if isinstance(value, list):
        return [_float32(item) for item in value]
    if isinstance(value, dict):
        return {key: _float32(item) for key, item in value.items()}
    return value


class Float32Amounts(Mutant):
    name = "float32-amounts"
    description = "the receiver stores numbers with a fraction as 32-bit floats: 0.1 changes"
    caught_by = ("PAY",)
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, {"amount": 0.1}),)
    enumerable = False

    def record_ticket(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> dict[str, Any]:
        stored = canonical_json(_float32(json.loads(payload)))
        return super().record_ticket(context, connection, operation_id, stored)


class BoundedReceipts(Mutant):
    name = "bounded-receipts"
    description = "receipts live in a cache of the two most recent: a third delivery evicts one"
    # RCPT: the oldest ticket loses its receipt at the third delivery; a redelivery of that
    # operation would then make a second ticket (ONE).
    caught_by = ("RCPT", "ONE")
    minimal_steps = 6
    minimal_trace = (
        Step("accept", OP, PAYLOAD), Step("accept", "op-2", PAYLOAD),
        Step("accept", "op-3", PAYLOAD),
    )
    enumerable = False

    def record_ticket(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> dict[str, Any]:
        ticket_id = connection.execute(
            "INSERT INTO tickets (operation_id, payload) VALUES (?, ?)", (operation_id, payload)
        ).lastrowid
        result = {"ticket_id": ticket_id}
        if context.deduplication:
            connection.execute(
                "INSERT INTO receipts (operation_id, payload, result) VALUES (?, ?, ?)",
                (operation_id, payload, canonical_json(result)),
            )
            connection.execute(
                "DELETE FROM receipts WHERE rowid NOT IN "
                "(SELECT rowid FROM receipts ORDER BY rowid DESC LIMIT 2)"
            )
        context.crash_point("service_before_commit")
        connection.execute("COMMIT")
        return result


# --- durability: power loss (caught only by traces with power steps) ------------------------


class _StorePragmas:
    """A worker context whose connections to one store get extra PRAGMAs: the one defect of
    a durability mutant is how that store is configured, not what the code does."""

    def __init__(self, context: WorkerContext, filename: str, pragmas: tuple[str, ...],
                 *, pooled: bool = False) -> None:
        self._context = context
        self._filename = filename
        self._pragmas = pragmas
        self._pooled = pooled

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    def connect(self, filename: str) -> sqlite3.Connection:
        connection = self._context.connect(filename)
        if filename == self._filename:
            for pragma in self._pragmas:
                connection.execute(pragma).fetchall()
            if self._pooled:
                # as a connection pool that never closes the last connection: closing does
                # not checkpoint (a checkpoint on close would sync the WAL after all)
                from faultlab.stores import vfs

                vfs.keep_wal_on_close(connection)
        return connection


class WalNormalReceiver(Mutant):
    name = "wal-normal-receiver"
    fault = "power"
    description = ("the receiver's store runs in WAL mode with synchronous=NORMAL behind a pool "
                   "of open connections: a commit is not synced until a checkpoint, so a power "
                   "cut loses acknowledged tickets")
    # DURABLE: the ticket (and receipt) the dispatcher was answered with are gone after the
    # cut, while the caller, synced, still says complete (DONE: no ticket).
    caught_by = ("DONE", "DURABLE")
    minimal_steps = 3
    minimal_trace = (Step("accept", OP, PAYLOAD), Step("dispatch"),
                     Step.power({"kind": "drop_all"}))

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        wal = _StorePragmas(context, DOWNSTREAM,
                            ("PRAGMA journal_mode=WAL", "PRAGMA synchronous=NORMAL"), pooled=True)
        return super().service(wal, operation_id, payload)


class SyncOffCaller(Mutant):
    name = "sync-off-caller"
    fault = "power"
    description = ("the caller's store runs with synchronous=OFF: nothing is synced, so a "
                   "power cut loses an acknowledged acceptance")
    caught_by = ("ACK", "DURABLE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step.power({"kind": "drop_all"}))

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        off = _StorePragmas(context, CALLER, ("PRAGMA synchronous=OFF",))
        return super().accept(off, operation_id, payload)

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        off = _StorePragmas(context, CALLER, ("PRAGMA synchronous=OFF",))
        return super().dispatch(off)


class FullSyncCaller(Mutant):
    name = "full-sync-caller"
    fault = "power"
    description = ("the caller's store keeps SQLite's default synchronous=FULL with a rollback "
                   "journal: the unlink that commits an acceptance is not followed by a "
                   "directory sync, so a power cut brings the journal back and rolls the "
                   "acknowledged acceptance back")
    # FULL syncs the journal and the database but not the directory entry of the journal's
    # deletion, which is the commit point in DELETE mode (tests/test_power_vfs.py shows the
    # last commit lost); the reference's EXTRA syncs it.
    caught_by = ("ACK", "DURABLE")
    minimal_steps = 2
    minimal_trace = (Step("accept", OP, PAYLOAD), Step.power({"kind": "drop_all"}))

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        full = _StorePragmas(context, CALLER, ("PRAGMA synchronous=FULL",))
        return super().accept(full, operation_id, payload)

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        full = _StorePragmas(context, CALLER, ("PRAGMA synchronous=FULL",))
        return super().dispatch(full)
