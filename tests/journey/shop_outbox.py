#!/usr/bin/env python3
"""A shop's order outbox with a warehouse receiver: a new user's own program, not faultlab's.

Standard library only; it does not import faultlab (tests/test_journey.py drives it through
system.json, as a user would on the first day).

    shop_outbox.py init      DIR
    shop_outbox.py take      DIR --ref REF --basket=JSON [--die-at POINT]
    shop_outbox.py relay     DIR [--die-at POINT] [--no-dedup]
    shop_outbox.py warehouse DIR --ref REF --basket=JSON [--die-at POINT] [--no-dedup]

Stores: shop.db (purchase, relay_queue) and warehouse.db (parcel, receipt). Exit status:
0 done, 2 bad input, 3 payload_conflict, 4 downstream_failure; a crash point SIGKILLs the process.
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

# The receiver's bug: it looks the reference up only in the newest receipt, so a repeat
# delivery after another order's receipt ships a second parcel. The fix is False here.
RECENT_RECEIPTS_ONLY = True

SHOP, WAREHOUSE = "shop.db", "warehouse.db"
USAGE, MISMATCH, DOWN = 2, 3, 4
SHOP_SCHEMA = (
    "CREATE TABLE purchase (ref TEXT PRIMARY KEY, basket TEXT NOT NULL, "
    "phase TEXT NOT NULL CHECK (phase IN ('queued', 'shipped')), parcel INTEGER)",
    "CREATE TABLE relay_queue (n INTEGER PRIMARY KEY AUTOINCREMENT, ref TEXT NOT NULL UNIQUE, "
    "sent INTEGER NOT NULL DEFAULT 0)",
)
WAREHOUSE_SCHEMA = (
    "CREATE TABLE parcel (parcel_id INTEGER PRIMARY KEY, ref TEXT NOT NULL, "
    "basket TEXT NOT NULL)",
    "CREATE TABLE receipt (ref TEXT NOT NULL, basket TEXT NOT NULL, parcel_id INTEGER NOT NULL)",
    "CREATE INDEX receipt_ref ON receipt (ref)",
)
POINTS = {"mid_accept": "take", "pre_call": "relay", "post_call": "relay",
          "receiver_pre_commit": "warehouse"}


class Refused(Exception):
    def __init__(self, code: int, **reply: object) -> None:
        super().__init__(reply)
        self.code, self.reply = code, reply


def die_at(armed: str | None, point: str) -> None:
    if armed == point:
        os.kill(os.getpid(), signal.SIGKILL)


def open_store(directory: Path, name: str) -> sqlite3.Connection:
    if not (directory / name).is_file():
        raise Refused(USAGE, problem="no_store", store=name)
    db = sqlite3.connect(str(directory / name), isolation_level=None, timeout=5.0)
    db.execute("PRAGMA synchronous=FULL")
    return db


def basket_of(text: str) -> str:
    try:
        return json.dumps(json.loads(text), sort_keys=True, separators=(",", ":"))
    except ValueError:
        raise Refused(USAGE, problem="bad_basket") from None


def init(directory: Path) -> dict[str, object]:
    for name, schema in ((SHOP, SHOP_SCHEMA), (WAREHOUSE, WAREHOUSE_SCHEMA)):
        if (directory / name).exists():
            raise Refused(USAGE, problem="store_exists", store=name)
        db = sqlite3.connect(str(directory / name), isolation_level=None)
        with db:
            for statement in schema:
                db.execute(statement)
        db.close()
    return {"ready": True}


def take(directory: Path, ref: str, basket: str, armed: str | None) -> dict[str, object]:
    db = open_store(directory, SHOP)
    try:
        db.execute("BEGIN IMMEDIATE")
        row = db.execute("SELECT basket FROM purchase WHERE ref = ?", (ref,)).fetchone()
        if row is not None:
            db.execute("ROLLBACK")
            if row[0] != basket:
                raise Refused(MISMATCH, error="payload_conflict", ref=ref)
            return {"accepted": True, "operation_id": ref, "again": True}
        db.execute("INSERT INTO purchase (ref, basket, phase) VALUES (?, ?, 'queued')",
                   (ref, basket))
        die_at(armed, "mid_accept")
        db.execute("INSERT INTO relay_queue (ref) VALUES (?)", (ref,))
        db.execute("COMMIT")
    finally:
        db.close()
    return {"accepted": True, "operation_id": ref}


def relay(directory: Path, armed: str | None, dedup: bool) -> dict[str, object]:
    db = open_store(directory, SHOP)
    try:
        row = db.execute("SELECT q.ref, p.basket FROM relay_queue q JOIN purchase p "
                         "ON p.ref = q.ref WHERE q.sent = 0 ORDER BY q.n LIMIT 1").fetchone()
    finally:
        db.close()
    if row is None:
        return {"idle": True, "pending": 0}
    ref, basket = row
    die_at(armed, "pre_call")
    argv = [sys.executable, os.path.abspath(__file__), "warehouse", str(directory),
            "--ref", ref, f"--basket={basket}"]
    if POINTS.get(armed or "") == "warehouse":
        argv += ["--die-at", str(armed)]
    if not dedup:
        argv.append("--no-dedup")
    child = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    out, err = child.communicate(timeout=10)
    sys.stderr.write(err.decode("utf-8", "replace"))
    lines = out.decode("utf-8", "replace").splitlines()
    reply = json.loads(lines[-1]) if child.returncode == 0 and lines else {}
    courier = {"pid": child.pid, "exit_code": child.returncode}
    if "result" not in reply:
        raise Refused(DOWN, error="downstream_failure", order=ref, courier=courier)
    die_at(armed, "post_call")
    parcel = int(reply["result"]["ticket_id"])
    db = open_store(directory, SHOP)
    try:
        db.execute("BEGIN IMMEDIATE")
        db.execute("UPDATE purchase SET phase = 'shipped', parcel = ? WHERE ref = ?",
                   (parcel, ref))
        db.execute("UPDATE relay_queue SET sent = 1 WHERE ref = ?", (ref,))
        db.execute("COMMIT")
    finally:
        db.close()
    return {"order": ref, "result": {"ticket_id": parcel}, "courier": courier}


def warehouse(directory: Path, ref: str, basket: str, armed: str | None,
              dedup: bool) -> dict[str, object]:
    db = open_store(directory, WAREHOUSE)
    try:
        db.execute("BEGIN IMMEDIATE")
        if dedup:
            lookup = "SELECT basket, parcel_id FROM receipt WHERE ref = ?"
            if RECENT_RECEIPTS_ONLY:
                lookup += " AND rowid = (SELECT max(rowid) FROM receipt)"
            seen = db.execute(lookup, (ref,)).fetchone()
            if seen is not None:
                db.execute("ROLLBACK")
                if seen[0] != basket:
                    raise Refused(MISMATCH, error="payload_conflict", ref=ref)
                return {"operation_id": ref, "result": {"ticket_id": seen[1]}, "replayed": True}
        parcel = db.execute("INSERT INTO parcel (ref, basket) VALUES (?, ?)",
                            (ref, basket)).lastrowid
        if dedup:
            db.execute("INSERT INTO receipt (ref, basket, parcel_id) VALUES (?, ?, ?)",
                       (ref, basket, parcel))
        die_at(armed, "receiver_pre_commit")
        db.execute("COMMIT")
    finally:
        db.close()
    return {"operation_id": ref, "result": {"ticket_id": parcel}, "replayed": False}


def main() -> int:
    top = argparse.ArgumentParser(prog="shop_outbox.py")
    commands = top.add_subparsers(dest="command", required=True)
    for name in ("init", "take", "relay", "warehouse"):
        sub = commands.add_parser(name)
        sub.add_argument("dir", type=Path)
        if name in ("take", "warehouse"):
            sub.add_argument("--ref", required=True)
            sub.add_argument("--basket", required=True)
        if name != "init":
            sub.add_argument("--die-at", choices=sorted(POINTS))
        if name in ("relay", "warehouse"):
            sub.add_argument("--no-dedup", action="store_true")
    args = top.parse_args()
    armed, dedup = getattr(args, "die_at", None), not getattr(args, "no_dedup", False)
    try:
        if not args.dir.is_dir():
            raise Refused(USAGE, problem="no_directory", dir=str(args.dir))
        if args.command == "init":
            reply = init(args.dir)
        elif args.command == "take":
            reply = take(args.dir, args.ref, basket_of(args.basket), armed)
        elif args.command == "relay":
            reply = relay(args.dir, armed, dedup)
        else:
            reply = warehouse(args.dir, args.ref, basket_of(args.basket), armed, dedup)
    except Refused as refused:
        print(json.dumps(refused.reply, sort_keys=True), flush=True)
        if refused.code == USAGE:
            print(f"shop_outbox.py: {refused.reply}", file=sys.stderr)
        return refused.code
    print(json.dumps(reply, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
