"""A transactional outbox built on pgqueuer (a PostgreSQL job queue), as a faultlab system.

The caller store is one PostgreSQL database holding the application's ``orders``
table *and* pgqueuer's own tables (pgqueuer's install DDL). The downstream store
is a second database: a receiver that deduplicates by order id.

- ``accept`` inserts the order and enqueues its pgqueuer job (``SyncQueries.enqueue``)
  in one transaction on one connection: pgqueuer's transactional enqueue.
- ``dispatch`` runs pgqueuer's own worker loop (``QueueManager.run`` in drain mode,
  ``batch_size=1``, pgqueuer's ``AsyncpgDriver``) with one entrypoint. The entrypoint
  calls the receiver as a child process, records the ticket on the order and
  returns; pgqueuer then acknowledges the job itself (its job-status buffer moves
  the row from ``pgqueuer`` to ``pgqueuer_log`` as ``successful``).
- ``service`` is the receiver: ticket and receipt in one transaction; a repeat
  replays the receipt.

Three wirings, one attribute apart:

- ``SYSTEM`` (``pgqueuer-outbox``): the entrypoint marks the order complete itself;
  a failed downstream call raises ``RetryRequested`` (the job is queued again).
- ``ACK_STATE`` (``pgqueuer-ack-state``): the entrypoint records only the ticket; an
  order is complete once pgqueuer logged its job ``successful``.
- ``DEFAULT_FAILURE`` (``pgqueuer-default-failure``): as ``ACK_STATE``, but a failed
  downstream call is an ordinary exception, so pgqueuer applies the entrypoint's
  default ``on_failure="delete"``.

Run from the repository root (``pip install pgqueuer asyncpg``):

    python -m faultlab explore --system examples.pgqueuer.pgq_outbox:ACK_STATE \
        --postgres private --concurrency 2 --examples 10 --seed 0
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from datetime import timedelta
from pathlib import Path
from typing import Any

from faultlab.system import CrashPoint, Refusal
from faultlab.system.builtin.reference_pg import PostgresSystem

CALLER, DOWNSTREAM = "caller", "downstream"
ENTRYPOINT = "deliver"

#: pgqueuer's real-time knobs, at pgqueuer's own defaults except the drain poll: a
#: worker whose job is still running re-checks the queue this often (real seconds).
HEARTBEAT_TIMEOUT = timedelta(seconds=30)   # pgqueuer's default
DEQUEUE_TIMEOUT = timedelta(seconds=0.2)    # drain-mode poll while a job runs
RETRY_DELAY = timedelta(seconds=0)        # RetryRequested's default
#: On a server whose clock faultlab holds still between ticks (a private server under
#: libfaketime), ``now()`` is the same in every transaction, and pgqueuer claims only
#: jobs with ``execute_after < now()``: a job stamped ``now() + 0`` would never become
#: claimable. There, and only there, jobs (and retries) are stamped one second early.
FROZEN_CLOCK_OFFSET = timedelta(seconds=-1)

ORDERS_DDL = """
CREATE TABLE orders (
    id TEXT PRIMARY KEY,
    payload TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('pending', 'complete')),
    ticket_id BIGINT,
    job_id BIGINT
)
"""

DOWNSTREAM_DDL = """
CREATE TABLE tickets (
    id BIGSERIAL PRIMARY KEY, operation_id TEXT NOT NULL, payload TEXT NOT NULL);
CREATE TABLE receipts (
    operation_id TEXT PRIMARY KEY, payload TEXT NOT NULL, ticket_id BIGINT NOT NULL)
"""

POINTS = (
    CrashPoint("during_accept", "accept",
               "after the order insert, before the enqueue, in one transaction: rolled "
               "back, neither order nor job; accepting again succeeds"),
    CrashPoint("before_dispatch", "dispatch",
               "the job is picked (status picked, heartbeat stamped), the receiver not "
               "called: no ticket; once the heartbeat is stale another worker re-picks it"),
    CrashPoint("after_downstream_commit", "dispatch",
               "the receiver committed ticket and receipt, the order is still pending and "
               "the job picked: recovery re-picks the job, the receipt is replayed"),
    CrashPoint("after_handler", "dispatch",
               "the entrypoint recorded the ticket on the order and is returning; pgqueuer "
               "has not acknowledged the job yet (its status buffer flushes later): order "
               "complete, job still picked until it is re-picked and acknowledged"),
    CrashPoint("service_before_commit", "service",
               "inside the ticket transaction, after both inserts: rolled back; the "
               "entrypoint sees a downstream failure"),
    CrashPoint("service_after_commit", "service",
               "ticket and receipt committed, the receiver dies before answering: the "
               "entrypoint sees a downstream failure; a retry replays the receipt"),
)


def _caller_ddl() -> str:
    from pgqueuer.adapters.persistence.qb import QueryBuilderEnvironment

    return ORDERS_DDL + ";\n" + QueryBuilderEnvironment().build_install_query()


def _result(ticket_id: Any) -> dict[str, int]:
    return {"ticket_id": int(ticket_id)}


class PgqueuerOutbox(PostgresSystem):
    name = "pgqueuer-outbox"
    description = ("orders + pgqueuer jobs enqueued in one transaction, pgqueuer's "
                   "QueueManager delivering to a deduplicating receiver")
    crash_points = POINTS
    # pgqueuer runs its statements through its own drivers and cursors: faultlab cannot
    # count them, so only the named points above can be armed.
    supports_statement_points = False
    #: "retry": a failed downstream call raises RetryRequested; "raise": the exception
    #: goes to pgqueuer, which applies the entrypoint's on_failure (default "delete").
    on_downstream_failure = "retry"
    #: True: the entrypoint marks the order complete itself (its own transaction, before
    #: pgqueuer acknowledges the job). False: it records only the ticket, and an order
    #: is complete once pgqueuer has logged its job successful.
    handler_marks_complete = True

    schemas: dict[str, str] = {}   # initialise builds the templates itself
    snapshot_queries = {
        CALLER: {
            "operations": (
                "SELECT id, payload, state, CASE WHEN ticket_id IS NULL THEN NULL "
                "ELSE '{\"ticket_id\":' || ticket_id::text || '}' END FROM orders"
            ),
            # the outbox entry is pgqueuer's job: pending while its row is queued or
            # picked, complete once pgqueuer logged it successful; any other end (a job
            # deleted as 'exception', never enqueued) shows as that status
            "outbox": (
                "SELECT o.id, CASE "
                "WHEN EXISTS (SELECT 1 FROM pgqueuer q WHERE q.id = o.job_id "
                "             AND q.status IN ('queued', 'picked')) THEN 'pending' "
                "WHEN EXISTS (SELECT 1 FROM pgqueuer_log l WHERE l.job_id = o.job_id "
                "             AND l.status = 'successful') THEN 'complete' "
                "ELSE COALESCE((SELECT q.status::text FROM pgqueuer q WHERE q.id = o.job_id), "
                "              (SELECT l.status::text FROM pgqueuer_log l "
                "               WHERE l.job_id = o.job_id ORDER BY l.id DESC LIMIT 1), "
                "              'no job') END "
                "FROM orders o"
            ),
        },
        DOWNSTREAM: {
            "tickets": "SELECT id, operation_id, payload FROM tickets",
            "receipts": ("SELECT operation_id, payload, '{\"ticket_id\":' || ticket_id::text "
                         "|| '}' FROM receipts"),
        },
    }

    # -- stores --------------------------------------------------------------------------

    def initialise(self, directory: Path) -> None:
        """One template per store; the caller's holds pgqueuer's install DDL, which has a
        PL/pgSQL function body, so it is run as one script rather than split on ``;``."""
        from faultlab.stores import postgres as pgstores

        scripts = {CALLER: _caller_ddl(), DOWNSTREAM: DOWNSTREAM_DDL}
        run = pgstores.current_run()
        keys: dict[str, str] = {}
        for store, script in scripts.items():
            digest = hashlib.sha256(script.encode()).hexdigest()[:16]

            def build(conninfos: dict[str, str], script: str = script) -> None:
                pg = pgstores.psycopg_module()
                with pg.connect(conninfos["schema"], autocommit=True) as connection, \
                        connection.transaction():
                    connection.execute(script)

            keys[store] = run.templates(f"pgqueuer-example-{store}-{digest}",
                                        ["schema"], build)["schema"]
        pgstores.clone_stores(directory, keys)

    def _stamp_offset(self, context: Any, delay: timedelta) -> timedelta:
        from faultlab.stores import postgres as pgstores

        if pgstores.stores_info(context.directory).server_clock:
            return delay + FROZEN_CLOCK_OFFSET
        return delay

    async def _asyncpg_connect(self, context: Any, store: str) -> Any:
        """An asyncpg connection to the store for pgqueuer's worker (pgqueuer's own
        ``AsyncpgDriver``), on the database and with the ``application_name`` faultlab's
        ``connect_postgres`` uses, so faultlab sees when a killed worker's backend is gone."""
        import os

        import asyncpg
        from psycopg.conninfo import conninfo_to_dict

        from faultlab.stores import postgres as pgstores

        context.connect_postgres(store).close()   # checks the store's marker first
        info = pgstores.stores_info(context.directory)
        params = conninfo_to_dict(info.conninfo)
        settings = {"application_name": f"{info.application}-worker-{os.getpid()}",
                    "client_connection_check_interval": str(pgstores.CLIENT_CHECK_MS)}
        return await asyncpg.connect(
            host=params.get("host") or None, port=int(params["port"]) if params.get("port")
            else None, user=params.get("user") or None, password=params.get("password") or None,
            database=info.databases[store], server_settings=settings)

    # -- caller --------------------------------------------------------------------------

    def accept(self, context: Any, operation_id: str, payload: str) -> dict[str, Any]:
        import psycopg

        from pgqueuer.db import SyncPsycopgDriver
        from pgqueuer.queries import SyncQueries

        for attempt in (1, 2):
            connection = context.connect_postgres(CALLER)
            connection.autocommit = True   # pgqueuer's drivers require it
            try:
                with connection.transaction():
                    existing = connection.execute(
                        "SELECT payload, state FROM orders WHERE id = %s FOR UPDATE",
                        (operation_id,)).fetchone()
                    if existing is not None:
                        if existing[0] != payload:
                            raise Refusal("payload_conflict", 3, operation_id=operation_id)
                        return {"accepted": True, "already_accepted": True,
                                "operation_id": operation_id, "state": existing[1]}
                    connection.execute(
                        "INSERT INTO orders (id, payload, state) VALUES (%s, %s, 'pending')",
                        (operation_id, payload))
                    context.crash_point("during_accept")
                    queries = SyncQueries(SyncPsycopgDriver(connection))
                    (job_id,) = queries.enqueue(
                        ENTRYPOINT, json.dumps({"operation_id": operation_id}).encode(),
                        execute_after=self._stamp_offset(context, timedelta(0)) or None)
                    connection.execute("UPDATE orders SET job_id = %s WHERE id = %s",
                                       (job_id, operation_id))
            except psycopg.errors.UniqueViolation:
                if attempt == 2:
                    raise
                continue   # a concurrent accept of the same id committed first: look again
            finally:
                connection.close()
            return {"accepted": True, "operation_id": operation_id, "state": "pending"}
        raise AssertionError("unreachable")

    def dispatch(self, context: Any) -> dict[str, Any]:
        return asyncio.run(self._dispatch(context))

    async def _dispatch(self, context: Any) -> dict[str, Any]:
        from pgqueuer import QueueManager, RetryRequested
        from pgqueuer.domain.types import QueueExecutionMode
        from pgqueuer.models import Job
        from pgqueuer.queries import Queries

        handled: list[dict[str, Any]] = []
        connection = await self._asyncpg_connect(context, CALLER)
        try:
            qm = QueueManager(Queries.from_asyncpg_connection(connection))

            @qm.entrypoint(ENTRYPOINT)
            async def deliver(job: Job) -> None:
                operation_id = json.loads(job.payload or b"{}")["operation_id"]
                orders = context.connect_postgres(CALLER)
                try:
                    row = orders.execute("SELECT payload FROM orders WHERE id = %s",
                                         (operation_id,)).fetchone()
                    orders.rollback()
                    payload = row[0]
                    context.crash_point("before_dispatch")
                    record = context.call_service(operation_id, payload)
                    response = record.response or {}
                    service = {"pid": record.pid, "exit_code": record.exit_code}
                    if record.exit_code != 0 or "result" not in response:
                        handled.append({"error": "downstream_failure",
                                        "operation_id": operation_id, "service": service})
                        # one attempt per dispatcher: the retried job is left for the next
                        # one (drain mode would otherwise retry it at once, again and again)
                        qm.shutdown.set()
                        if self.on_downstream_failure == "retry":
                            raise RetryRequested(delay=self._stamp_offset(context, RETRY_DELAY),
                                                 reason="downstream")
                        raise RuntimeError(f"downstream failed for {operation_id}")
                    context.crash_point("after_downstream_commit")
                    ticket_id = int(response["result"]["ticket_id"])
                    orders.execute(
                        "UPDATE orders SET state = %s, ticket_id = %s WHERE id = %s",
                        ("complete" if self.handler_marks_complete else "pending",
                         ticket_id, operation_id))
                    orders.commit()
                    handled.append({"operation_id": operation_id,
                                    "result": _result(ticket_id),
                                    "replayed": bool(response.get("replayed")),
                                    "service": service, "job_id": int(job.id)})
                    context.crash_point("after_handler")
                finally:
                    orders.close()

            await qm.run(mode=QueueExecutionMode.drain, batch_size=1,
                         dequeue_timeout=DEQUEUE_TIMEOUT, heartbeat_timeout=HEARTBEAT_TIMEOUT)
        finally:
            await connection.close()
        if not handled:
            return {"idle": True}
        first = handled[0]
        if "error" in first:
            raise Refusal("downstream_failure", 4, operation_id=first["operation_id"],
                          service=first["service"], jobs=len(handled))
        return {**first, "jobs": len(handled)}

    # -- downstream ----------------------------------------------------------------------

    def service(self, context: Any, operation_id: str, payload: str) -> dict[str, Any]:
        connection = context.connect_postgres(DOWNSTREAM)
        try:
            connection.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))",
                               (operation_id,))
            if context.deduplication:
                row = connection.execute(
                    "SELECT payload, ticket_id FROM receipts WHERE operation_id = %s",
                    (operation_id,)).fetchone()
                if row is not None:
                    connection.rollback()
                    if row[0] != payload:
                        raise Refusal("payload_conflict", 3, operation_id=operation_id)
                    return {"operation_id": operation_id, "result": _result(row[1]),
                            "replayed": True}
            (ticket_id,) = connection.execute(
                "INSERT INTO tickets (operation_id, payload) VALUES (%s, %s) RETURNING id",
                (operation_id, payload)).fetchone()
            if context.deduplication:
                connection.execute(
                    "INSERT INTO receipts (operation_id, payload, ticket_id) VALUES (%s, %s, %s)",
                    (operation_id, payload, ticket_id))
            context.crash_point("service_before_commit")
            connection.commit()
        finally:
            connection.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": _result(ticket_id), "replayed": False}


_JOB_DONE = ("EXISTS (SELECT 1 FROM pgqueuer_log l WHERE l.job_id = o.job_id "
             "AND l.status = 'successful')")


class PgqueuerAckState(PgqueuerOutbox):
    name = "pgqueuer-ack-state"
    description = ("pgqueuer-outbox whose order is complete once pgqueuer acknowledged its "
                   "job (the entrypoint records only the ticket)")
    handler_marks_complete = False
    snapshot_queries = {
        CALLER: {
            **PgqueuerOutbox.snapshot_queries[CALLER],
            "operations": (
                f"SELECT o.id, o.payload, CASE WHEN {_JOB_DONE} THEN 'complete' "
                "ELSE 'pending' END, CASE WHEN o.ticket_id IS NULL THEN NULL "
                "ELSE '{\"ticket_id\":' || o.ticket_id::text || '}' END FROM orders o"
            ),
        },
        DOWNSTREAM: PgqueuerOutbox.snapshot_queries[DOWNSTREAM],
    }


class PgqueuerDefaultFailure(PgqueuerAckState):
    name = "pgqueuer-default-failure"
    description = ("pgqueuer-ack-state whose entrypoint lets a failed downstream call raise: "
                   "pgqueuer's default on_failure ('delete') applies")
    on_downstream_failure = "raise"


SYSTEM = PgqueuerOutbox()
ACK_STATE = PgqueuerAckState()
DEFAULT_FAILURE = PgqueuerDefaultFailure()
