#!/usr/bin/env python3
"""An outbox lab with its own worker CLI and its own JSON. It does not import faultlab.

It stands for a program written before anyone thought of faultlab: its
dispatcher reports the service it started under ``downstream``
(``{"operation_id": ..., "result": ..., "downstream": {"pid": ..., "exit_code": ...}}``)
and an accept answers ``{"accepted": "<id>"}``. ``system.json`` beside it maps
those keys with ``response_fields``; ``system-no-fields.json`` does not, and
shows what faultlab reports then (the service PID is unknown, not wrong).

    outbox_lab.py init     --dir D
    outbox_lab.py accept   --dir D --id ID --payload JSON [--crash POINT]
    outbox_lab.py dispatch --dir D [--crash POINT] [--no-dedup]
    outbox_lab.py service  --dir D --id ID --payload JSON [--crash POINT] [--no-dedup]

Stores: ``orders.db`` (``requests``, ``outbox_events``) and ``tickets.db``
(``ticket``, ``idempotency_keys``). Each worker writes one store at a time in
``BEGIN IMMEDIATE`` ... ``COMMIT``. Exit status: 0 ok, 2 bad input,
3 payload_conflict, 4 downstream_failure; a crash is the process SIGKILLing
itself. Every worker prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

ORDERS = "orders.db"
TICKETS = "tickets.db"
EXIT_USAGE, EXIT_CONFLICT, EXIT_DOWNSTREAM = 2, 3, 4
SERVICE_DEADLINE = 10.0

ORDERS_SCHEMA = """
CREATE TABLE requests (
    request_key TEXT PRIMARY KEY,
    body TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('NEW', 'SENT')),
    ticket_no INTEGER);
CREATE TABLE outbox_events (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    request_key TEXT NOT NULL UNIQUE REFERENCES requests(request_key),
    status TEXT NOT NULL CHECK (status IN ('NEW', 'SENT')))
"""
TICKETS_SCHEMA = """
CREATE TABLE ticket (
    ticket_no INTEGER PRIMARY KEY, request_key TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE idempotency_keys (
    request_key TEXT PRIMARY KEY, body TEXT NOT NULL, ticket_no INTEGER NOT NULL)
"""

# The crash points this program knows, and the worker role each sits in.
POINTS = {
    "during_accept": "accept",
    "before_dispatch": "dispatch",
    "after_downstream_commit": "dispatch",
    "during_completion": "dispatch",
    "service_before_commit": "service",
    "service_after_commit": "service",
}


class Failure(Exception):
    """A refusal: printed as {"error": ...}, exit status ``code``."""

    def __init__(self, error: str, code: int, **detail: Any) -> None:
        super().__init__(error)
        self.response = {"error": error, **detail}
        self.code = code


class CrashHook:
    """Where this program can be killed for a test.

    ``--crash POINT``: SIGKILL this process on reaching POINT. Announcement mode
    (FAULTLAB_ANNOUNCE_FD and FAULTLAB_RESUME_FD set by the test harness): write
    ``reached POINT PID`` and wait for a ``continue`` line; the harness kills the
    process instead of answering when POINT is the one it armed.
    """

    def __init__(self, armed: str | None) -> None:
        self.armed = armed
        announce = os.environ.get("FAULTLAB_ANNOUNCE_FD")
        resume = os.environ.get("FAULTLAB_RESUME_FD")
        self.fds = (int(announce), int(resume)) if announce and resume else None

    def reached(self, point: str) -> None:
        if self.fds is not None:
            announce, resume = self.fds
            os.write(announce, f"reached {point} {os.getpid()}\n".encode())
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = os.read(resume, 1)
                if not chunk:  # the harness went away: carry on
                    break
                reply += chunk
        if point == self.armed:
            os.kill(os.getpid(), signal.SIGKILL)

    def for_service(self) -> str | None:
        """The point a dispatcher passes on to the service it starts."""
        return self.armed if POINTS.get(self.armed or "") == "service" else None


def canonical(text: str) -> str:
    try:
        value = json.loads(text)
    except ValueError as error:
        raise Failure("bad_payload", EXIT_USAGE, detail=str(error)) from None
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def connect(directory: Path, name: str) -> sqlite3.Connection:
    path = directory / name
    if not path.is_file():
        raise Failure("no_store", EXIT_USAGE, store=str(path))
    connection = sqlite3.connect(str(path), isolation_level=None, timeout=5.0)
    connection.execute("PRAGMA synchronous=FULL")
    return connection


def init(directory: Path) -> dict[str, Any]:
    for name, schema in ((ORDERS, ORDERS_SCHEMA), (TICKETS, TICKETS_SCHEMA)):
        if (directory / name).exists():
            raise Failure("store_exists", EXIT_USAGE, store=name)
        connection = sqlite3.connect(str(directory / name), isolation_level=None)
        try:
            connection.execute("BEGIN IMMEDIATE")
            for statement in filter(str.strip, schema.split(";")):
                connection.execute(statement)
            connection.execute("COMMIT")
        finally:
            connection.close()
    return {"initialised": True}


def accept(directory: Path, key: str, body: str, hook: CrashHook) -> dict[str, Any]:
    db = connect(directory, ORDERS)
    try:
        db.execute("BEGIN IMMEDIATE")
        row = db.execute(
            "SELECT body, status FROM requests WHERE request_key = ?", (key,)
        ).fetchone()
        if row is not None:
            db.execute("ROLLBACK")
            if row[0] != body:
                raise Failure("payload_conflict", EXIT_CONFLICT, operation_id=key)
            state = "complete" if row[1] == "SENT" else "pending"
            return {"accepted": key, "state": state}
        db.execute("INSERT INTO requests (request_key, body, status) VALUES (?, ?, 'NEW')",
                   (key, body))
        hook.reached("during_accept")
        db.execute("INSERT INTO outbox_events (request_key, status) VALUES (?, 'NEW')", (key,))
        db.execute("COMMIT")
    finally:
        db.close()
    return {"accepted": key, "state": "pending"}


def dispatch(directory: Path, hook: CrashHook, dedup: bool) -> dict[str, Any]:
    db = connect(directory, ORDERS)
    try:
        row = db.execute(
            "SELECT e.request_key, r.body FROM outbox_events e "
            "JOIN requests r ON r.request_key = e.request_key "
            "WHERE e.status = 'NEW' ORDER BY e.seq LIMIT 1"
        ).fetchone()
    finally:
        db.close()
    if row is None:
        return {"idle": True}
    key, body = row
    hook.reached("before_dispatch")
    service, reply = call_service(directory, key, body, hook, dedup)
    if service["exit_code"] != 0 or "result" not in reply:
        raise Failure("downstream_failure", EXIT_DOWNSTREAM, operation_id=key,
                      downstream=service, reply=reply or None)
    hook.reached("after_downstream_commit")
    ticket_no = int(reply["result"]["ticket_id"])
    db = connect(directory, ORDERS)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE requests SET status = 'SENT', ticket_no = ? WHERE request_key = ?",
                   (ticket_no, key))
        hook.reached("during_completion")
        db.execute("UPDATE outbox_events SET status = 'SENT' WHERE request_key = ?", (key,))
        db.execute("COMMIT")
    finally:
        db.close()
    return {"operation_id": key, "result": {"ticket_id": ticket_no},
            "downstream": service}


def call_service(directory: Path, key: str, body: str, hook: CrashHook,
                 dedup: bool) -> tuple[dict[str, int], dict[str, Any]]:
    """Run the service as a child process; pass on a service crash point and --no-dedup."""
    argv = [sys.executable, os.path.abspath(__file__), "service", "--dir", str(directory),
            "--id", key, "--payload", body]
    point = hook.for_service()
    if point is not None:
        argv += ["--crash", point]
    if not dedup:
        argv.append("--no-dedup")
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, pass_fds=hook.fds or ())
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


def service(directory: Path, key: str, body: str, hook: CrashHook,
            dedup: bool) -> dict[str, Any]:
    db = connect(directory, TICKETS)
    try:
        db.execute("BEGIN IMMEDIATE")
        if dedup:
            row = db.execute(
                "SELECT body, ticket_no FROM idempotency_keys WHERE request_key = ?", (key,)
            ).fetchone()
            if row is not None:
                db.execute("ROLLBACK")
                if row[0] != body:
                    raise Failure("payload_conflict", EXIT_CONFLICT, operation_id=key)
                return {"operation_id": key, "result": {"ticket_id": row[1]}, "replayed": True}
        ticket_no = db.execute(
            "INSERT INTO ticket (request_key, body) VALUES (?, ?)", (key, body)
        ).lastrowid
        if dedup:
            db.execute(
                "INSERT INTO idempotency_keys (request_key, body, ticket_no) VALUES (?, ?, ?)",
                (key, body, ticket_no),
            )
        hook.reached("service_before_commit")
        db.execute("COMMIT")
    finally:
        db.close()
    hook.reached("service_after_commit")
    return {"operation_id": key, "result": {"ticket_id": ticket_no}, "replayed": False}


def parser() -> argparse.ArgumentParser:
    top = argparse.ArgumentParser(prog="outbox_lab.py", description=__doc__.splitlines()[0])
    roles = top.add_subparsers(dest="role", required=True)
    for role in ("init", "accept", "dispatch", "service"):
        sub = roles.add_parser(role)
        sub.add_argument("--dir", required=True, type=Path)
        if role in ("accept", "service"):
            sub.add_argument("--id", required=True)
            sub.add_argument("--payload", required=True)
        if role != "init":
            sub.add_argument("--crash", choices=sorted(POINTS))
        if role in ("dispatch", "service"):
            sub.add_argument("--no-dedup", action="store_true",
                             help="switch the receiver's deduplication off")
    return top


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not args.dir.is_dir():
        print(f"outbox_lab.py: --dir {args.dir}: no such directory", file=sys.stderr)
        return EXIT_USAGE
    hook = CrashHook(getattr(args, "crash", None))
    dedup = not getattr(args, "no_dedup", False)
    try:
        if args.role == "init":
            response = init(args.dir)
        elif args.role == "accept":
            response = accept(args.dir, args.id, canonical(args.payload), hook)
        elif args.role == "dispatch":
            response = dispatch(args.dir, hook, dedup)
        else:
            response = service(args.dir, args.id, canonical(args.payload), hook, dedup)
    except Failure as failure:
        print(json.dumps(failure.response, sort_keys=True), flush=True)
        if failure.code == EXIT_USAGE:
            print(f"outbox_lab.py: {failure.response}", file=sys.stderr)
        return failure.code
    print(json.dumps(response, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
