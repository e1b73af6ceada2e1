"""A two-store outbox written against faultlab's public Python contract.

Use it as ``--system examples.python_system.my_outbox:SYSTEM`` from the
repository root, or put this directory on PYTHONPATH and use
``--system my_outbox:SYSTEM``. faultlab imports the module in its fork server
and in exec-mode workers alike, so it must be importable from there too.

Its stores use their own names (``jobs.sqlite``: ``jobs``, ``job_outbox``;
``remote.sqlite``: ``issued``, ``seen``); :meth:`LedgerOutbox.snapshot` maps
them to faultlab's four tables. Crash points are marked with
``context.crash_point(name)``: when a step arms that name, the call SIGKILLs
the worker's own process.
"""

from __future__ import annotations

import json
import sqlite3
from pathlib import Path
from typing import Any

from faultlab.stores import sqlite as stores
from faultlab.stores.sqlite import Snapshot
from faultlab.system import CrashPoint, Refusal, System, WorkerContext

JOBS = "jobs.sqlite"
REMOTE = "remote.sqlite"
EXIT_CONFLICT, EXIT_DOWNSTREAM_FAILURE = 3, 4

JOBS_SCHEMA = """
CREATE TABLE jobs (job_id TEXT PRIMARY KEY, request TEXT NOT NULL, done INTEGER NOT NULL,
                   answer TEXT);
CREATE TABLE job_outbox (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL UNIQUE,
                         done INTEGER NOT NULL)
"""
REMOTE_SCHEMA = """
CREATE TABLE issued (number INTEGER PRIMARY KEY, job_id TEXT NOT NULL, request TEXT NOT NULL);
CREATE TABLE seen (job_id TEXT PRIMARY KEY, request TEXT NOT NULL, number INTEGER NOT NULL)
"""


def _read(path: Path, sql: str) -> list[tuple[Any, ...]]:
    """One query on a store opened read-only: a snapshot must never write."""
    connection = sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)
    try:
        return [tuple(row) for row in connection.execute(sql)]
    finally:
        connection.close()


def _result(number: int) -> dict[str, int]:
    return {"ticket_id": number}


class LedgerOutbox(System):
    name = "ledger"
    description = "example: a Python outbox with its own table names (examples/python_system)"
    crash_points = (
        CrashPoint("during_accept", "accept",
                   "between the job insert and its outbox insert: rolled back, nothing left"),
        CrashPoint("before_dispatch", "dispatch",
                   "after reading the pending job, before the service call: no ticket; "
                   "recovery makes ticket 1"),
        CrashPoint("after_downstream_commit", "dispatch",
                   "ticket issued, job not marked done: recovery replays it, one ticket"),
        CrashPoint("service_after_commit", "service",
                   "ticket committed, the service dies before replying: the dispatcher "
                   "reports downstream_failure; recovery replays it"),
    )

    def initialise(self, directory: Path) -> None:
        # faultlab's initialise adds the marker that context.connect() checks.
        stores.initialise(directory / JOBS, JOBS_SCHEMA)
        stores.initialise(directory / REMOTE, REMOTE_SCHEMA)

    def snapshot(self, directory: Path) -> Snapshot:
        state = "CASE done WHEN 1 THEN 'complete' ELSE 'pending' END"
        return Snapshot.from_rows({
            "operations": _read(directory / JOBS,
                                f"SELECT job_id, request, {state}, answer FROM jobs"),
            "outbox": _read(directory / JOBS, f"SELECT job_id, {state} FROM job_outbox"),
            "tickets": _read(directory / REMOTE, "SELECT number, job_id, request FROM issued"),
            "receipts": _read(directory / REMOTE,
                              "SELECT job_id, request, '{\"ticket_id\":' || number || '}' "
                              "FROM seen"),
        })

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        db = context.connect(JOBS)
        try:
            db.execute("BEGIN IMMEDIATE")
            row = db.execute("SELECT request, done FROM jobs WHERE job_id = ?",
                             (operation_id,)).fetchone()
            if row is not None:
                db.execute("ROLLBACK")
                if row[0] != payload:
                    raise Refusal("payload_conflict", EXIT_CONFLICT, operation_id=operation_id)
                return {"accepted": True, "already_accepted": True, "operation_id": operation_id}
            db.execute("INSERT INTO jobs (job_id, request, done) VALUES (?, ?, 0)",
                       (operation_id, payload))
            context.crash_point("during_accept")
            db.execute("INSERT INTO job_outbox (job_id, done) VALUES (?, 0)", (operation_id,))
            db.execute("COMMIT")
        finally:
            db.close()
        return {"accepted": True, "operation_id": operation_id}

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        db = context.connect(JOBS)
        try:
            row = db.execute(
                "SELECT o.job_id, j.request FROM job_outbox o JOIN jobs j USING (job_id) "
                "WHERE o.done = 0 ORDER BY o.seq LIMIT 1").fetchone()
        finally:
            db.close()
        if row is None:
            return {"idle": True}
        operation_id, payload = row
        context.crash_point("before_dispatch")
        service = context.call_service(operation_id, payload)  # a real child process
        summary = {"pid": service.pid, "exit_code": service.exit_code}
        reply = service.response or {}
        if service.exit_code != 0 or "result" not in reply:
            raise Refusal("downstream_failure", EXIT_DOWNSTREAM_FAILURE,
                          operation_id=operation_id, service=summary)
        context.crash_point("after_downstream_commit")
        db = context.connect(JOBS)
        try:
            db.execute("BEGIN IMMEDIATE")
            db.execute("UPDATE jobs SET done = 1, answer = ? WHERE job_id = ?",
                       (json.dumps(reply["result"], sort_keys=True, separators=(",", ":")),
                        operation_id))
            db.execute("UPDATE job_outbox SET done = 1 WHERE job_id = ?", (operation_id,))
            db.execute("COMMIT")
        finally:
            db.close()
        return {"operation_id": operation_id, "result": reply["result"], "service": summary}

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        db = context.connect(REMOTE)
        try:
            db.execute("BEGIN IMMEDIATE")
            if context.deduplication:
                row = db.execute("SELECT request, number FROM seen WHERE job_id = ?",
                                 (operation_id,)).fetchone()
                if row is not None:
                    db.execute("ROLLBACK")
                    if row[0] != payload:
                        raise Refusal("payload_conflict", EXIT_CONFLICT,
                                      operation_id=operation_id)
                    return {"operation_id": operation_id, "result": _result(row[1]),
                            "replayed": True}
            number = db.execute("INSERT INTO issued (job_id, request) VALUES (?, ?)",
                                (operation_id, payload)).lastrowid
            if context.deduplication:
                db.execute("INSERT INTO seen (job_id, request, number) VALUES (?, ?, ?)",
                           (operation_id, payload, number))
            db.execute("COMMIT")
        finally:
            db.close()
        context.crash_point("service_after_commit")
        return {"operation_id": operation_id, "result": _result(int(number or 0)),
                "replayed": False}


SYSTEM = LedgerOutbox()
