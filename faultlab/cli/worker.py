"""``worker``: one worker role in this process (what exec mode spawns)."""

from __future__ import annotations

import argparse
from pathlib import Path

from faultlab.base.errors import UsageError
from faultlab.cli.common import Commands, add_spawn, add_system, load_system


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "worker", help="run one worker role in this process (what exec mode spawns)",
        description="Run one worker role against an existing directory whose stores faultlab "
                    "initialised. Prints one JSON response line. Exit 0 on success, 3 "
                    "payload_conflict, 4 downstream_failure, 2 bad input, -9 when a crash "
                    "point fires.",
        epilog="exit status: 0 success, 2 bad input, 3 payload_conflict, "
               "4 downstream_failure, -9 (SIGKILL) when the armed crash point fires",
    )
    parser.add_argument("role", choices=("accept", "dispatch", "service"))
    parser.add_argument("--directory", required=True, metavar="DIR",
                        help="the run directory whose stores faultlab initialised (the "
                             "worker reads and writes them there)")
    parser.add_argument("--operation-id", metavar="ID",
                        help="the operation to accept or deliver (required for accept and "
                             "service; dispatch claims what its outbox holds)")
    # not an argparse mutually exclusive group: Python 3.13 wraps its usage line
    # differently, and the command reference is generated from --help
    parser.add_argument("--payload", metavar="JSON",
                        help="the operation's payload as one JSON value (accept and service "
                             "need it or --payload-file)")
    parser.add_argument("--payload-file", metavar="PATH", type=Path,
                        help="read the payload (one JSON value) from this file instead: "
                             "faultlab passes a payload too long for one argument this way")
    parser.add_argument("--crash", metavar="POINT",
                        help="arm a crash point: a declared name, sql:K or commit:K")
    add_system(parser)
    add_spawn(parser)
    parser.set_defaults(handler=cmd_worker)


def cmd_worker(args: argparse.Namespace) -> int:
    from faultlab.base.canonical import parse_payload
    from faultlab.base.inputs import check_operation_id, read_text_file
    from faultlab.process.records import WorkerSpec
    from faultlab.run.worker import run_worker
    from faultlab.system.contract import check_crash_point

    system = load_system(args.system, args.deduplication, drawn=False)
    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"--directory {directory}: no such directory")
    payload = None
    if args.operation_id is not None:
        check_operation_id(args.operation_id, "--operation-id")
    if args.payload is not None and args.payload_file is not None:
        raise UsageError("--payload and --payload-file: give one of them, not both")
    if args.role in ("accept", "service"):
        text = args.payload
        if args.payload_file is not None:
            text = read_text_file(args.payload_file, "payload file")
        if text is None:
            raise UsageError(f"worker {args.role}: --payload (or --payload-file) is required")
        if args.operation_id is None:
            raise UsageError(f"worker {args.role}: --operation-id is required")
        payload = parse_payload(text, what="--payload" if args.payload_file is None
                                else f"--payload-file {args.payload_file}")
    check_crash_point(system, args.role, args.crash)
    spec = WorkerSpec(
        system=args.system, role=args.role, directory=str(directory),
        operation_id=args.operation_id, payload=payload, crash=args.crash,
        deduplication=args.deduplication, spawn=args.spawn, deadline=args.deadline,
    )
    return run_worker(spec)
