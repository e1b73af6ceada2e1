"""The reference two-store outbox on PostgreSQL: ``reference-pg``, and its bug zoo.

The behaviour of :mod:`faultlab.system.builtin.reference`, with the caller
(``operations``, ``outbox``) and the downstream (``tickets``, ``receipts``) in two
separate PostgreSQL databases cloned per trace (:mod:`faultlab.stores.postgres`). What
changes is what production outboxes on PostgreSQL do:

* the dispatcher *claims* the oldest claimable pending entry (lease lapsed, no earlier
  pending entry of its key) with ``SELECT ... FOR UPDATE SKIP LOCKED`` in a short claim
  transaction that takes a new fencing token (``attempt + 1``) and a lease on the
  server's clock (``lease_until = now()`` plus
  :data:`~faultlab.system.builtin.reference.LEASE_TICKS` seconds in a concurrent trace, plus
  0 in a sequential one; :meth:`ReferencePg.lease_clock`) and commits; it calls
  downstream holding no lock, then completes only if the row still carries its token
  (``SELECT ... FOR UPDATE`` first), answering ``superseded`` otherwise, as
  :mod:`faultlab.system.builtin.reference` does. A crash inside the claim transaction
  (``during_claim``) or the completion (``during_completion``) kills a client that holds
  row locks, which the server releases only when it has ended the client's backend;
* the receiver serialises calls for one operation id with a transaction-scoped
  advisory lock, so concurrent services cannot both miss the receipt;
* three *ambiguous commits*: COMMIT sent, the worker killed before reading the reply
  (``accept_commit_sent``, ``completion_commit_sent``, ``service_commit_sent``);
* ticket ids come from a sequence, which a rolled-back insert still advances: after a
  crash inside the downstream transaction the recovered ticket may be 2, not 1.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from faultlab.base import clock
from faultlab.base.canonical import canonical_json
from faultlab.base.wall_clock import EPOCH
from faultlab.stores.sqlite import Snapshot
from faultlab.system.builtin.reference import LEASE_TICKS, ORDERING_KEY, ClaimLost
from faultlab.system.contract import CrashPoint, Refusal, System, WorkerContext
from faultlab.trace import DROP_CONNECTION, SERVER_CRASH, Step

CALLER = "caller"
DOWNSTREAM = "downstream"

CALLER_SCHEMA = """
CREATE TABLE operations (
    id TEXT PRIMARY KEY, payload TEXT NOT NULL, state TEXT NOT NULL, result TEXT);
CREATE TABLE outbox (
    seq BIGSERIAL UNIQUE, operation_id TEXT PRIMARY KEY REFERENCES operations(id),
    state TEXT NOT NULL, attempt INTEGER NOT NULL DEFAULT 0,
    lease_until TIMESTAMPTZ NOT NULL DEFAULT '-infinity')
"""
DOWNSTREAM_SCHEMA = """
CREATE TABLE tickets (
    id BIGSERIAL PRIMARY KEY, operation_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE receipts (
    operation_id TEXT PRIMARY KEY, payload TEXT NOT NULL, result TEXT NOT NULL)
"""
SCHEMAS = {CALLER: CALLER_SCHEMA, DOWNSTREAM: DOWNSTREAM_SCHEMA}

#: Lock the oldest pending entry whose lease lapsed by ``{now}`` (the server's ``now()``,
#: see :meth:`ReferencePg.lease_clock`) and that no earlier pending entry of the same key
#: precedes, skipping rows another claim transaction holds (only the outbox row is
#: locked: ``FOR UPDATE OF o``). In a sequential trace this is the oldest pending entry.
#: The key comparison is :data:`~faultlab.system.builtin.reference.CLAIM_SQL`'s.
#: No earlier pending entry of the same key precedes outbox row ``o`` (operation ``op``).
EARLIEST_OF_ITS_KEY = (
    "NOT EXISTS ("
    "SELECT 1 FROM outbox e JOIN operations eo ON eo.id = e.operation_id "
    "WHERE e.state = 'pending' AND e.seq < o.seq "
    f"AND (eo.payload::jsonb ->> '{ORDERING_KEY}') "
    f"IS NOT DISTINCT FROM (op.payload::jsonb ->> '{ORDERING_KEY}')) "
)
CLAIM_SQL = (
    "SELECT o.operation_id, o.attempt, op.payload FROM outbox o "
    "JOIN operations op ON op.id = o.operation_id "
    "WHERE o.state = 'pending' AND o.lease_until <= {now} AND " + EARLIEST_OF_ITS_KEY
    + "ORDER BY o.seq LIMIT 1 FOR UPDATE OF o SKIP LOCKED"
)

#: Write the claim's token and its lease, ``{now}`` plus the lease's seconds, and return
#: the lease's end in seconds since the Unix epoch.
LEASE_SQL = (
    "UPDATE outbox SET attempt = %s, lease_until = {now} + make_interval(secs => %s) "
    "WHERE operation_id = %s RETURNING extract(epoch FROM lease_until)::float8"
)

EXIT_CONFLICT = 3
EXIT_DOWNSTREAM_FAILURE = 4

POINTS: tuple[CrashPoint, ...] = (
    CrashPoint(
        "during_accept", "accept",
        "between the operation insert and the outbox insert, inside one transaction: the "
        "server rolls back when the backend ends; neither row exists; accepting again succeeds",
    ),
    CrashPoint(
        "accept_commit_sent", "accept",
        "COMMIT sent, the acceptor killed before its reply (ambiguous): the server committed "
        "both rows or neither; nothing was acknowledged; accepting again is idempotent",
    ),
    CrashPoint(
        "during_claim", "dispatch",
        "inside the claim transaction, holding the row lock (FOR UPDATE SKIP LOCKED) with "
        "the new token and lease written, not committed: the lock and the claim go with the "
        "backend; no ticket; a fresh dispatcher claims it, ticket 1",
    ),
    CrashPoint(
        "before_dispatch", "dispatch",
        "claim committed (token and lease), no lock held, before any downstream call: no "
        "ticket; once the lease lapses a fresh dispatcher claims it again, ticket 1",
    ),
    CrashPoint(
        "after_downstream_commit", "dispatch",
        "the service committed ticket and receipt, the dispatcher still holds its claim: one "
        "ticket, operation pending; recovery replays the receipt, still one ticket",
    ),
    CrashPoint(
        "during_completion", "dispatch",
        "between the operation and outbox completion updates, holding both rows' locks (the "
        "fencing check locked the outbox row): both stay pending; recovery replays the "
        "receipt and completes both",
    ),
    CrashPoint(
        "completion_commit_sent", "dispatch",
        "COMMIT of the completion sent, the dispatcher killed before its reply (ambiguous): "
        "both rows complete or both pending; either way one ticket after recovery",
    ),
    CrashPoint(
        "service_before_commit", "service",
        "inside the downstream transaction, after the ticket and receipt inserts (their "
        "locks held): rolled back, no ticket; the dispatcher reports downstream_failure; "
        "recovery makes one ticket (its id may skip a sequence value)",
    ),
    CrashPoint(
        "service_commit_sent", "service",
        "COMMIT of ticket and receipt sent, the service killed before its reply (ambiguous): "
        "the dispatcher reports downstream_failure; recovery replays the receipt if the "
        "server committed, or makes the ticket; one ticket either way",
    ),
    CrashPoint(
        "service_after_commit", "service",
        "downstream committed, the service dies before replying: one ticket and its receipt, "
        "the dispatcher reports downstream_failure; recovery replays the receipt",
    ),
)


class PostgresSystem(System):
    """A Python system whose stores are PostgreSQL databases (one per entry of ``schemas``)."""

    store_kind = "postgres"
    schemas: dict[str, str] = {}
    snapshot_queries: dict[str, dict[str, str]] = {}

    def __init__(self) -> None:
        # psycopg imported here: a fork server that loads the system gives it to every worker
        from faultlab.nemesis import pgcrash
        from faultlab.stores import postgres as pgstores

        pgstores.psycopg_module()
        pgcrash.traced_connection_class()

    def initialise(self, directory: Path) -> None:
        from faultlab.stores import postgres as pgstores

        pgstores.create_stores(directory, self.schemas)

    def release(self, directory: Path) -> None:
        from faultlab.stores import postgres as pgstores

        pgstores.release_stores(directory)

    def snapshot(self, directory: Path) -> Snapshot:
        """Wait for the step's backends to end (bounded), then read each store read-only."""
        from faultlab.stores import postgres as pgstores

        pgstores.wait_for_backends(directory)
        tables: dict[str, Iterable[Iterable[Any]]] = {}
        for store, queries in self.snapshot_queries.items():
            tables.update(pgstores.query(directory, store, queries))
        return Snapshot.from_rows(tables)


class ReferencePg(PostgresSystem):
    """Transactional outbox + stable operation id + deduplicating receiver, on PostgreSQL."""

    name = "reference-pg"
    description = ("the reference outbox on PostgreSQL: two databases, leased and fenced "
                   "claims with FOR UPDATE SKIP LOCKED, ambiguous-commit crash points")
    crash_points = POINTS
    schemas = SCHEMAS
    ordering_key = ORDERING_KEY
    snapshot_queries = {
        CALLER: {
            "operations": "SELECT id, payload, state, result FROM operations",
            "outbox": "SELECT operation_id, state FROM outbox",
        },
        DOWNSTREAM: {
            "tickets": "SELECT id, operation_id, payload FROM tickets",
            "receipts": "SELECT operation_id, payload, result FROM receipts",
        },
    }

    # -- caller ------------------------------------------------------------------------------

    def connect_caller(self, context: WorkerContext) -> Any:
        """The caller store's connection (acceptor and dispatcher): one place a mutant
        changes how the caller commits."""
        return context.connect_postgres(CALLER)

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        from faultlab.nemesis.pgcrash import commit_or_crash

        connection = self.connect_caller(context)
        try:
            existing = connection.execute(
                "SELECT payload, state FROM operations WHERE id = %s FOR UPDATE", (operation_id,)
            ).fetchone()
            if existing is not None:
                connection.rollback()
                return self.accept_existing(operation_id, payload, existing[0], existing[1])
            self.insert_operation(context, connection, operation_id, payload)
            commit_or_crash(context, connection, "accept_commit_sent")
        finally:
            connection.close()
        return {"accepted": True, "operation_id": operation_id, "state": "pending"}

    def accept_existing(
        self, operation_id: str, payload: str, stored_payload: str, state: str
    ) -> dict[str, Any]:
        if stored_payload != payload:
            raise Refusal("payload_conflict", EXIT_CONFLICT, operation_id=operation_id)
        return {
            "accepted": True, "already_accepted": True, "operation_id": operation_id,
            "state": state,
        }

    def insert_operation(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> None:
        connection.execute(
            "INSERT INTO operations (id, payload, state, result) VALUES (%s, %s, 'pending', NULL)",
            (operation_id, payload),
        )
        context.crash_point("during_accept")
        connection.execute(
            "INSERT INTO outbox (operation_id, state) VALUES (%s, 'pending')", (operation_id,)
        )

    #: This dispatcher's claim (operation id, fencing token), set by :meth:`claim`; None
    #: when a subclass reads the next entry without claiming it.
    held: tuple[str, int] | None = None

    def lease_clock(self, context: WorkerContext) -> tuple[str, tuple[float, ...]]:
        """The clock leases are stamped and checked on, as SQL and its parameters.

        The server's ``now()`` (the claim transaction's start), as PostgreSQL job queues
        do: every dispatcher reads one clock, whatever its own says. That needs a server
        whose clock follows the trace's ``tick`` steps (faultlab's own, ``--postgres
        private``, under libfaketime) or no virtual clock at all (a sequential trace, whose
        leases are 0 s long). A shared server's clock cannot be moved, so there a
        concurrent trace's leases are on the workers' virtual clock instead, passed in
        (one tick, one second after :data:`~faultlab.base.wall_clock.EPOCH`)."""
        from faultlab.stores import postgres as pgstores

        if clock.is_virtual() and not pgstores.stores_info(context.directory).server_clock:
            return "to_timestamp(%s)", (EPOCH + context.now(),)
        return "now()", ()

    def claim(self, context: WorkerContext, connection: Any) -> tuple[str, str] | None:
        """Claim the next entry in a short transaction: lock it (SKIP LOCKED), write a new
        token and a lease on the server's clock, commit. Returns (operation id, payload),
        or None when idle."""
        now, at = self.lease_clock(context)
        lease = float(LEASE_TICKS if clock.is_virtual() else 0)
        row = connection.execute(CLAIM_SQL.format(now=now), at).fetchone()
        if row is None:
            connection.rollback()
            return None
        operation_id, attempt = str(row[0]), int(row[1]) + 1
        stamped = connection.execute(LEASE_SQL.format(now=now),
                                     (attempt, *at, lease, operation_id)).fetchone()
        context.crash_point("during_claim")
        connection.commit()
        self.held = (operation_id, attempt)
        # announced on the trace's clock: the server's lease end, back in ticks
        until = float(stamped[0]) - EPOCH if clock.is_virtual() else context.now() + lease
        context.claimed(operation_id, attempt, lease_until=until)
        return operation_id, str(row[2])

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        self.held = None
        connection = self.connect_caller(context)
        try:
            pending = self.claim(context, connection)
            if pending is None:
                return {"idle": True}
            operation_id, payload = pending
            context.crash_point("before_dispatch")
            self.work_begins(context)
            service = context.call_service(operation_id, payload)
            service_summary = {"pid": service.pid, "exit_code": service.exit_code}
            response = service.response or {}
            if service.exit_code != 0 or "result" not in response:
                # the entry stays pending; the next dispatcher claims it once the lease lapses
                raise Refusal(
                    "downstream_failure", EXIT_DOWNSTREAM_FAILURE, operation_id=operation_id,
                    service=service_summary, downstream=response or None,
                )
            context.crash_point("after_downstream_commit")
            try:
                self.complete(context, connection, operation_id,
                              canonical_json(response["result"]))
            except ClaimLost:
                return {"operation_id": operation_id, "superseded": True,
                        "attempt": self.held[1] if self.held else None,
                        "service": service_summary}
        finally:
            connection.close()
        return {
            "operation_id": operation_id, "result": response["result"],
            "replayed": bool(response.get("replayed")), "service": service_summary,
        }

    def work_begins(self, context: WorkerContext) -> None:
        """The claimed entry's work starts (the downstream call comes next): nothing to do
        here; one place a mutant keeps a clock of its own."""

    def check_claim(self, connection: Any, operation_id: str) -> None:
        """Fencing: lock the outbox row and require this dispatcher's token on it, still
        pending; otherwise roll back and raise :class:`ClaimLost` (another claimed it)."""
        if self.held is None:
            return  # a subclass that reads without claiming completes unfenced
        row = connection.execute(
            "SELECT attempt, state FROM outbox WHERE operation_id = %s FOR UPDATE",
            (operation_id,),
        ).fetchone()
        if row is None or int(row[0]) != self.held[1] or row[1] != "pending":
            connection.rollback()
            raise ClaimLost(operation_id)

    def complete(
        self, context: WorkerContext, connection: Any, operation_id: str, result: str
    ) -> None:
        """Mark operation and outbox row complete in one transaction, only while this
        dispatcher still holds its claim (fencing), and commit it."""
        self.check_claim(connection, operation_id)
        self.mark_complete(context, connection, operation_id, result)

    def mark_complete(
        self, context: WorkerContext, connection: Any, operation_id: str, result: str
    ) -> None:
        """Mark the operation and its outbox row complete, and commit (no claim check)."""
        from faultlab.nemesis.pgcrash import commit_or_crash

        connection.execute(
            "UPDATE operations SET state = 'complete', result = %s WHERE id = %s",
            (result, operation_id),
        )
        context.crash_point("during_completion")
        connection.execute(
            "UPDATE outbox SET state = 'complete' WHERE operation_id = %s", (operation_id,)
        )
        commit_or_crash(context, connection, "completion_commit_sent")

    # -- downstream --------------------------------------------------------------------------

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect_postgres(DOWNSTREAM)
        try:
            connection.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (operation_id,)
            )
            if context.deduplication:
                receipt = connection.execute(
                    "SELECT payload, result FROM receipts WHERE operation_id = %s",
                    (operation_id,),
                ).fetchone()
                if receipt is not None:
                    connection.rollback()
                    return self.replay_receipt(operation_id, payload, receipt[0], receipt[1])
            result = self.record_ticket(context, connection, operation_id, payload)
        finally:
            connection.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": result, "replayed": False}

    def record_ticket(
        self, context: WorkerContext, connection: Any, operation_id: str, payload: str
    ) -> dict[str, Any]:
        from faultlab.nemesis.pgcrash import commit_or_crash

        row = connection.execute(
            "INSERT INTO tickets (operation_id, payload) VALUES (%s, %s) RETURNING id",
            (operation_id, payload),
        ).fetchone()
        result = {"ticket_id": int(row[0])}
        if context.deduplication:
            connection.execute(
                "INSERT INTO receipts (operation_id, payload, result) VALUES (%s, %s, %s)",
                (operation_id, payload, canonical_json(result)),
            )
        context.crash_point("service_before_commit")
        commit_or_crash(context, connection, "service_commit_sent")
        return result

    def replay_receipt(
        self, operation_id: str, payload: str, stored_payload: str, stored_result: str
    ) -> dict[str, Any]:
        if stored_payload != payload:
            raise Refusal("payload_conflict", EXIT_CONFLICT, operation_id=operation_id)
        return {"operation_id": operation_id, "result": json.loads(stored_result), "replayed": True}


# --- the bug zoo, PostgreSQL form ------------------------------------------------------------


class NoDedupPg(ReferencePg):
    """The receiver never reads or writes receipts: a retry makes a second ticket."""

    name = "no-dedup-pg"
    #: The same defect as the SQLite mutant ``no-dedup``, which ``mutants`` judges; this
    #: one is judged by the PostgreSQL tests.
    twin = "no-dedup"
    description = "reference-pg whose downstream never reads or writes receipts"

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        from faultlab.nemesis.pgcrash import commit_or_crash

        connection = context.connect_postgres(DOWNSTREAM)
        try:
            row = connection.execute(
                "INSERT INTO tickets (operation_id, payload) VALUES (%s, %s) RETURNING id",
                (operation_id, payload),
            ).fetchone()
            if row is None:
                raise RuntimeError("INSERT ... RETURNING returned no row")
            context.crash_point("service_before_commit")
            commit_or_crash(context, connection, "service_commit_sent")
        finally:
            connection.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": {"ticket_id": int(row[0])},
                "replayed": False}


SPLIT_POINT = CrashPoint(
    "between_completion_commits", "dispatch",
    "the operation's completion committed, the outbox row's not yet: a broken system shows "
    "operation complete, outbox pending (PAIR)",
)


class SplitCompletePg(ReferencePg):
    """Operation and outbox row are marked complete in two transactions."""

    name = "split-complete-pg"
    #: The same defect as the SQLite mutant ``split-complete``, which ``mutants`` judges; this
    #: one is judged by the PostgreSQL tests.
    twin = "split-complete"
    description = "reference-pg marking the operation and its outbox row complete in two commits"
    crash_points = (*POINTS, SPLIT_POINT)

    def complete(
        self, context: WorkerContext, connection: Any, operation_id: str, result: str
    ) -> None:
        self.check_claim(connection, operation_id)
        connection.execute(
            "UPDATE operations SET state = 'complete', result = %s WHERE id = %s",
            (result, operation_id),
        )
        connection.commit()
        context.crash_point("between_completion_commits")
        connection.execute(
            "UPDATE outbox SET state = 'complete' WHERE operation_id = %s", (operation_id,)
        )
        connection.commit()


class NoSkipLockedClaimPg(ReferencePg):
    """Claims without a lock and marks the entry complete before sending it downstream."""

    name = "claim-complete-first-pg"
    #: The same defect as the SQLite mutant ``complete-before-send``, which ``mutants`` judges; this
    #: one is judged by the PostgreSQL tests.
    twin = "complete-before-send"
    description = ("reference-pg claiming by marking the entry complete (UPDATE ... RETURNING) "
                   "and committing before the downstream call")

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        connection = context.connect_postgres(CALLER)
        try:
            row = connection.execute(
                "UPDATE outbox SET state = 'complete' WHERE operation_id = ("
                "SELECT operation_id FROM outbox WHERE state = 'pending' ORDER BY seq LIMIT 1) "
                "RETURNING operation_id"
            ).fetchone()
            if row is None:
                connection.rollback()
                return {"idle": True}
            operation_id = str(row[0])
            payload_row = connection.execute(
                "UPDATE operations SET state = 'complete' WHERE id = %s RETURNING payload",
                (operation_id,),
            ).fetchone()
            if payload_row is None:
                raise RuntimeError("the outbox row has no operation")
            connection.commit()
            context.crash_point("before_dispatch")
            service = context.call_service(operation_id, str(payload_row[0]))
            service_summary = {"pid": service.pid, "exit_code": service.exit_code}
            response = service.response or {}
            if service.exit_code != 0 or "result" not in response:
                raise Refusal(
                    "downstream_failure", EXIT_DOWNSTREAM_FAILURE, operation_id=operation_id,
                    service=service_summary, downstream=response or None,
                )
            context.crash_point("after_downstream_commit")
            connection.execute(
                "UPDATE operations SET result = %s WHERE id = %s",
                (canonical_json(response["result"]), operation_id),
            )
            context.crash_point("during_completion")
            connection.commit()
        finally:
            connection.close()
        return {
            "operation_id": operation_id, "result": response["result"],
            "replayed": bool(response.get("replayed")), "service": service_summary,
        }


#: Lane 1 claims (held inside the claim, then released past its commit) and holds before
#: the downstream call; its lease lapses; lane 2 claims and completes; the final recovery
#: finishes lane 1. A completion that is not fenced completes anyway, superseded: the
#: minimal trace of both mutants whose lease or fencing is wrong on PostgreSQL.
LAPSED_LEASE_TRACE: tuple[Step, ...] = (
    Step("accept", "op-1", {"title": "backlog", "priority": "normal"}, lane=1),
    Step("dispatch", lane=1, hold=True),
    Step("release", lane=1),
    Step("tick", ticks=LEASE_TICKS),
    Step("dispatch", lane=2),
)


class NoFencingPg(ReferencePg):
    """Completes without checking it still holds the claim: a dispatcher whose lease lapsed
    (and whose entry another dispatcher claimed with a higher token) completes anyway.

    The PostgreSQL form of :class:`faultlab.system.builtin.race_mutants.NoFencing`; only a
    concurrent trace shows it (``explore --concurrency 2``).
    """

    name = "no-fencing-pg"
    #: The same defect as the SQLite mutant ``no-fencing``, which ``mutants`` judges; this
    #: one is judged by the PostgreSQL tests.
    twin = "no-fencing"
    description = ("reference-pg whose completion is not conditional on still holding the "
                   "claim (no fencing token check)")
    caught_by = ("FENCE",)
    concurrency = 2
    minimal_trace = LAPSED_LEASE_TRACE
    minimal_steps = len(minimal_trace)

    def complete(
        self, context: WorkerContext, connection: Any, operation_id: str, result: str
    ) -> None:
        from faultlab.nemesis.pgcrash import commit_or_crash

        connection.execute(
            "UPDATE operations SET state = 'complete', result = %s WHERE id = %s",
            (result, operation_id),
        )
        context.crash_point("during_completion")
        connection.execute(
            "UPDATE outbox SET state = 'complete' WHERE operation_id = %s", (operation_id,)
        )
        commit_or_crash(context, connection, "completion_commit_sent")


class AsyncCommitPg(ReferencePg):
    """The caller commits with ``synchronous_commit = off``: COMMIT returns before its WAL
    record is written, so an acknowledged acceptance (or completion) lives only in the
    server's WAL buffers until the WAL writer's next round. A server crash in between
    loses it after the client was told it was durable. Only a ``server_crash`` step shows
    it (``--postgres private``): a killed worker, even a killed backend, loses nothing of
    a commit the server acknowledged, since the WAL buffers are the server's shared memory.

    The private server's ``wal_writer_delay`` is the longest PostgreSQL allows (10 s, see
    :data:`faultlab.stores.pgserver.DEFAULT_SETTINGS`) and no background commit flushes the
    WAL while a step runs (a private run makes its clones in the foreground), so the crash
    right after the acknowledgement finds the commit still unwritten.
    """

    name = "async-commit-pg"
    fault = "server_crash"  # only a crash of the whole server shows it
    description = ("reference-pg whose caller commits with synchronous_commit = off: a "
                   "server crash loses an acknowledged acceptance")
    caught_by = ("ACK", "DURABLE")
    server_crashes = True
    minimal_trace: tuple[Step, ...] = (
        Step("accept", "op-1", {"title": "backlog", "priority": "normal"}),
        Step(SERVER_CRASH),
    )
    minimal_steps = len(minimal_trace)
    enumerable = False

    def connect_caller(self, context: WorkerContext) -> Any:
        connection = super().connect_caller(context)
        # outside any transaction and through an untraced cursor: the setting is the bug,
        # not a statement of the system's (sql:K and commit:K count as for reference-pg)
        from psycopg import Cursor

        connection.autocommit = True
        Cursor(connection).execute("SET synchronous_commit = off")
        connection.autocommit = False
        return connection


class AdvisoryLockPg(ReferencePg):
    """Claims are session advisory locks (``pg_try_advisory_lock``) held on a connection of
    their own while the work runs on others, as a pool hands them out: the claim lasts
    exactly as long as that session. When the server drops the session (a network blip,
    an idle timeout, a proxy restart) the lock goes with it while the worker runs on, never
    asking whether it still holds it, and a second dispatcher takes the same entry: two
    workers run one job at once (``EXCL``; without the receiver's receipts a second ticket,
    ``ONE``). Only a concurrent trace with a dropped connection shows it (``--postgres
    private --concurrency 2``): a killed worker's session ends with its process, claim and
    all.
    """

    name = "advisory-lock-pg"
    description = ("reference-pg whose claims are session advisory locks on a connection of "
                   "their own: a dropped connection frees the claim while its worker runs on")
    crash_points = tuple(point for point in POINTS if point.name != "during_claim")
    caught_by = ("EXCL",)
    concurrency = 2
    #: Judged by ``mutants`` with two lanes on a private server of its own (only there
    #: can faultlab drop a session).
    private_server = True
    enumerable = False
    # Lane 1 claims op-1 (the advisory lock) and holds before the downstream call; the
    # server drops its sessions; lane 2's dispatcher gets the lock and claims op-1 too.
    minimal_trace: tuple[Step, ...] = (
        Step("accept", "op-1", {"title": "backlog", "priority": "normal"}, lane=1),
        Step("dispatch", lane=1, hold=True),
        Step(DROP_CONNECTION, lane=1),
        Step("dispatch", lane=2),
    )
    minimal_steps = len(minimal_trace)

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        from faultlab.nemesis.pgcrash import commit_or_crash

        lock = self.connect_caller(context)
        lock.autocommit = True
        try:
            # the entries no earlier pending entry of the same key precedes, as
            # reference-pg's claim takes them: the one defect is the claim's lifetime
            pending = lock.execute(
                "SELECT o.operation_id, o.attempt, op.payload FROM outbox o "
                "JOIN operations op ON op.id = o.operation_id "
                "WHERE o.state = 'pending' AND " + EARLIEST_OF_ITS_KEY
                + "ORDER BY o.seq").fetchall()
            claim = None
            for operation_id, attempt, payload in pending:
                got = lock.execute("SELECT pg_try_advisory_lock(hashtextextended(%s, 0))",
                                   (operation_id,)).fetchone()
                if not (got and got[0]):
                    continue  # another dispatcher's session holds it
                # completed between the read and the lock: not work any more
                still = lock.execute("SELECT state FROM outbox WHERE operation_id = %s",
                                     (operation_id,)).fetchone()
                if still is not None and still[0] == "pending":
                    claim = (str(operation_id), int(attempt) + 1, str(payload))
                    break
            if claim is None:
                return {"idle": True}
            operation_id, token, payload = claim
            # held for as long as the session lives: no lease to lapse
            context.claimed(operation_id, token, lease_until=float("inf"))
            context.crash_point("before_dispatch")
            service = context.call_service(operation_id, payload)
            service_summary = {"pid": service.pid, "exit_code": service.exit_code}
            response = service.response or {}
            if service.exit_code != 0 or "result" not in response:
                raise Refusal(
                    "downstream_failure", EXIT_DOWNSTREAM_FAILURE, operation_id=operation_id,
                    service=service_summary, downstream=response or None,
                )
            context.crash_point("after_downstream_commit")
            work = self.connect_caller(context)  # never asks whether the lock is still held
            try:
                work.execute("UPDATE operations SET state = 'complete', result = %s "
                             "WHERE id = %s", (canonical_json(response["result"]), operation_id))
                context.crash_point("during_completion")
                work.execute("UPDATE outbox SET state = 'complete' WHERE operation_id = %s",
                             (operation_id,))
                commit_or_crash(context, work, "completion_commit_sent")
            finally:
                work.close()
        finally:
            lock.close()  # the session ends: its advisory lock with it
        return {
            "operation_id": operation_id, "result": response["result"],
            "replayed": bool(response.get("replayed")), "service": service_summary,
        }


class ServerClockLeasePg(ReferencePg):
    """The lease is stamped on the server's clock and trusted on the worker's: the claim
    writes ``lease_until = now() + 10 s`` as reference-pg does (``now()`` being the claim
    transaction's start), but the dispatcher times its lease itself, on its own clock,
    from the moment it starts the work, and while that timer runs it completes without
    asking the server again ("nobody else can hold it before then"). A dispatcher delayed
    between the claim and the work (a pause, a local queue, a slow claim transaction)
    works on after the server's lease has lapsed: the server lets a second dispatcher
    claim the entry, and the first completes although it was superseded (``FENCE``).

    Only a concurrent trace on a server whose clock follows the ticks shows it
    (``--postgres private --concurrency 2``): lane 1 claims and holds before its work; a
    tick passes the server's lease; lane 2 claims and completes; lane 1 wakes, starts its
    timer, and completes too.
    """

    name = "server-clock-lease-pg"
    description = ("reference-pg whose dispatcher times its lease on its own clock from "
                   "when its work starts, while the server stamped it with now() at the "
                   "claim, and completes unfenced while that timer runs")
    caught_by = ("FENCE",)
    concurrency = 2
    #: Judged by ``mutants`` with two lanes on a private server of its own.
    private_server = True
    enumerable = False
    minimal_trace = LAPSED_LEASE_TRACE
    minimal_steps = len(minimal_trace)
    #: Where this dispatcher believes its lease ends, on its own clock.
    deadline = float("inf")

    def initialise(self, directory: Path) -> None:
        from faultlab.base.errors import UsageError
        from faultlab.stores import postgres as pgstores

        if not pgstores.server_clock_follows():
            raise UsageError(
                f"{self.name} stamps its leases on the server's clock, which faultlab moves "
                "only on its own server: --postgres private (with libfaketime installed)")
        super().initialise(directory)

    def work_begins(self, context: WorkerContext) -> None:
        # the defect: the lease timed from here on the worker's clock, not from the
        # lease_until the server stamped when the claim transaction began
        self.deadline = context.now() + (LEASE_TICKS if clock.is_virtual() else 0)

    def complete(
        self, context: WorkerContext, connection: Any, operation_id: str, result: str
    ) -> None:
        if clock.is_virtual() and context.now() >= self.deadline:
            raise ClaimLost(operation_id)  # its own timer ran out: it gives the entry up
        self.mark_complete(context, connection, operation_id, result)
