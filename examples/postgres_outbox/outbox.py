#!/usr/bin/env python3
"""A standalone two-store outbox on PostgreSQL with its own worker CLI. It does not import faultlab.

The PostgreSQL twin of ``examples/standalone_outbox/outbox.py``: its own table and
column names, status values and crash flag; the caller store and the downstream
store are two databases, given as libpq connection strings.

    outbox.py init     --caller DSN --downstream DSN
    outbox.py accept   --caller DSN --downstream DSN --id ID --payload JSON [--crash POINT]
    outbox.py dispatch --caller DSN --downstream DSN [--crash POINT] [--no-dedup]
    outbox.py service  --caller DSN --downstream DSN --id ID --payload JSON [--crash POINT]
                       [--no-dedup]

The dispatcher claims the oldest ``NEW`` event with ``FOR UPDATE SKIP LOCKED`` and
keeps that transaction open across the service call. Exit status: 0 ok, 2 bad
input, 3 payload_conflict, 4 downstream_failure; a crash is the process
SIGKILLing itself. Every worker prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from typing import Any

import psycopg

EXIT_USAGE, EXIT_CONFLICT, EXIT_DOWNSTREAM = 2, 3, 4
SERVICE_DEADLINE = 10.0

CALLER_SCHEMA = """
CREATE TABLE requests (
    request_key TEXT PRIMARY KEY, body TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('NEW', 'SENT')), ticket_no BIGINT);
CREATE TABLE outbox_events (
    seq BIGSERIAL PRIMARY KEY, request_key TEXT NOT NULL UNIQUE REFERENCES requests(request_key),
    status TEXT NOT NULL CHECK (status IN ('NEW', 'SENT')))
"""
DOWNSTREAM_SCHEMA = """
CREATE TABLE ticket (
    ticket_no BIGSERIAL PRIMARY KEY, request_key TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE idempotency_keys (
    request_key TEXT PRIMARY KEY, body TEXT NOT NULL, ticket_no BIGINT NOT NULL)
"""

POINTS = {
    "during_accept": "accept",
    "before_dispatch": "dispatch",
    "after_downstream_commit": "dispatch",
    "during_completion": "dispatch",
    "service_before_commit": "service",
    "service_after_commit": "service",
}


class Failure(Exception):
    def __init__(self, error: str, code: int, **detail: Any) -> None:
        super().__init__(error)
        self.response = {"error": error, **detail}
        self.code = code


def reached(point: str, armed: str | None) -> None:
    if point == armed:
        os.kill(os.getpid(), signal.SIGKILL)


def canonical(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise Failure("bad_payload", EXIT_USAGE, detail=str(error)) from None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def init(args: argparse.Namespace) -> dict[str, Any]:
    for dsn, schema in ((args.caller, CALLER_SCHEMA), (args.downstream, DOWNSTREAM_SCHEMA)):
        with psycopg.connect(dsn) as db:
            for statement in filter(str.strip, schema.split(";")):
                db.execute(statement)
    return {"initialised": True}


def accept(args: argparse.Namespace, key: str, body: str) -> dict[str, Any]:
    with psycopg.connect(args.caller) as db:
        row = db.execute("SELECT body, status FROM requests WHERE request_key = %s FOR UPDATE",
                         (key,)).fetchone()
        if row is not None:
            db.rollback()
            if row[0] != body:
                raise Failure("payload_conflict", EXIT_CONFLICT, operation_id=key)
            state = "complete" if row[1] == "SENT" else "pending"
            return {"accepted": True, "already_accepted": True, "operation_id": key,
                    "state": state}
        db.execute("INSERT INTO requests (request_key, body, status) VALUES (%s, %s, 'NEW')",
                   (key, body))
        reached("during_accept", args.crash)
        db.execute("INSERT INTO outbox_events (request_key, status) VALUES (%s, 'NEW')", (key,))
        db.commit()
    return {"accepted": True, "operation_id": key, "state": "pending"}


def dispatch(args: argparse.Namespace) -> dict[str, Any]:
    with psycopg.connect(args.caller) as db:
        row = db.execute(
            "SELECT e.request_key, r.body FROM outbox_events e "
            "JOIN requests r ON r.request_key = e.request_key "
            "WHERE e.status = 'NEW' ORDER BY e.seq LIMIT 1 FOR UPDATE OF e SKIP LOCKED"
        ).fetchone()
        if row is None:
            return {"idle": True}
        key, body = row
        reached("before_dispatch", args.crash)
        service, reply = call_service(args, key, body)
        if service["exit_code"] != 0 or "result" not in reply:
            raise Failure("downstream_failure", EXIT_DOWNSTREAM, operation_id=key,
                          service=service, downstream=reply or None)
        reached("after_downstream_commit", args.crash)
        ticket_no = int(reply["result"]["ticket_id"])
        db.execute("UPDATE requests SET status = 'SENT', ticket_no = %s WHERE request_key = %s",
                   (ticket_no, key))
        reached("during_completion", args.crash)
        db.execute("UPDATE outbox_events SET status = 'SENT' WHERE request_key = %s", (key,))
        db.commit()
    return {"operation_id": key, "result": {"ticket_id": ticket_no},
            "replayed": bool(reply.get("replayed")), "service": service}


def call_service(args: argparse.Namespace, key: str,
                 body: str) -> tuple[dict[str, int], dict[str, Any]]:
    argv = [sys.executable, os.path.abspath(__file__), "service", "--caller", args.caller,
            "--downstream", args.downstream, "--id", key, "--payload", body]
    if POINTS.get(args.crash or "") == "service":
        argv += ["--crash", args.crash]
    if args.no_dedup:
        argv.append("--no-dedup")
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    try:
        out, err = child.communicate(timeout=SERVICE_DEADLINE)
    except subprocess.TimeoutExpired:
        child.kill()
        out, err = child.communicate()
    sys.stderr.write(err.decode("utf-8", "replace"))
    reply: dict[str, Any] = {}
    for line in reversed(out.decode("utf-8", "replace").splitlines()):
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            reply = value
            break
    return {"pid": child.pid, "exit_code": child.returncode}, reply


def service(args: argparse.Namespace, key: str, body: str) -> dict[str, Any]:
    with psycopg.connect(args.downstream) as db:
        db.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (key,))
        if not args.no_dedup:
            row = db.execute("SELECT body, ticket_no FROM idempotency_keys WHERE request_key = %s",
                             (key,)).fetchone()
            if row is not None:
                db.rollback()
                if row[0] != body:
                    raise Failure("payload_conflict", EXIT_CONFLICT, operation_id=key)
                return {"operation_id": key, "result": {"ticket_id": row[1]}, "replayed": True}
        ticket = db.execute("INSERT INTO ticket (request_key, body) VALUES (%s, %s) "
                            "RETURNING ticket_no", (key, body)).fetchone()
        ticket_no = int(ticket[0]) if ticket else 0
        if not args.no_dedup:
            db.execute("INSERT INTO idempotency_keys (request_key, body, ticket_no) "
                       "VALUES (%s, %s, %s)", (key, body, ticket_no))
        reached("service_before_commit", args.crash)
        db.commit()
    reached("service_after_commit", args.crash)
    return {"operation_id": key, "result": {"ticket_id": ticket_no}, "replayed": False}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="outbox.py", description=__doc__.splitlines()[0])
    roles = top.add_subparsers(dest="role", required=True)
    for role in ("init", "accept", "dispatch", "service"):
        sub = roles.add_parser(role)
        sub.add_argument("--caller", required=True, metavar="DSN")
        sub.add_argument("--downstream", required=True, metavar="DSN")
        if role in ("accept", "service"):
            sub.add_argument("--id", required=True)
            sub.add_argument("--payload", required=True)
        sub.add_argument("--crash", choices=sorted(POINTS))
        sub.add_argument("--no-dedup", action="store_true")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        if args.role == "init":
            response = init(args)
        elif args.role == "accept":
            response = accept(args, args.id, canonical(args.payload))
        elif args.role == "dispatch":
            response = dispatch(args)
        else:
            response = service(args, args.id, canonical(args.payload))
    except Failure as failure:
        print(json.dumps(failure.response, sort_keys=True), flush=True)
        return failure.code
    except psycopg.OperationalError as error:
        print(f"outbox.py: {error}".splitlines()[0], file=sys.stderr)
        return EXIT_USAGE
    print(json.dumps(response, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
