"""``replay``: execute saved traces on fresh stores and print them as tables."""

from __future__ import annotations

import argparse
from pathlib import Path

from faultlab.base.errors import EXIT_FOUND, EXIT_OK
from faultlab.base.messages import plural
from faultlab.cli.common import (
    REPLAY_EPILOG,
    Commands,
    add_format,
    add_html,
    add_postgres,
    add_spawn,
    check_format,
    check_output_path,
    load_system,
)


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "replay", help="execute saved traces on fresh stores and print them as tables",
        description="Execute each trace on fresh stores and print a table per trace: step, "
                    "action, operation, crash point, pid, exit, operations and outbox "
                    "pending/complete, tickets, receipts, violations. Exit 0 when every outcome "
                    "matches its recording, 1 when one differs, 2 on bad input. With --against, "
                    "each trace runs on another system and is expected to be clean (a finding "
                    "from a broken variant replayed against a fixed one must pass).",
        epilog=REPLAY_EPILOG,
    )
    parser.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    parser.add_argument("--against", metavar="SYSTEM",
                        help="replay on this system instead of the recorded one; expect clean")
    add_html(parser, "also write every replayed trace as one self-contained HTML page (a "
                     "timeline with a lane per process, SIGKILLs, both stores after each step "
                     "with changed rows highlighted, violated invariants marked)")
    add_postgres(parser)
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_replay)


def cmd_replay(args: argparse.Namespace) -> int:
    from faultlab.corpus.replay import plan, replay
    from faultlab.process.spawn import spawner
    from faultlab.trace import load

    check_format(args.format)
    if args.html is not None:
        check_output_path(args.html, "--html")
    loaded = [load(path) for path in args.traces]
    against = load_system(args.against) if args.against else None
    plans = [
        plan(path, trace, against if against is not None else load_system(trace.system),
             against=against is not None)
        for path, trace in zip(args.traces, loaded, strict=True)
    ]
    mismatches = 0
    replayed = []
    with spawner(args.spawn) as runner:
        for planned in plans:
            outcome = replay(planned, runner, deadline=args.deadline, fmt=args.format)
            print("\n".join(outcome.lines()) + "\n")
            mismatches += not outcome.matches
            replayed.append(outcome)
    if args.html is not None:
        from faultlab.report import html as html_report

        html_report.write(args.html, [
            html_report.TraceReport(
                title=str(outcome.plan.path), execution=outcome.execution,
                system=outcome.plan.system.ref, deduplication=outcome.plan.trace.deduplication,
                verdict=outcome.verdict.describe(),
                expected=f"{outcome.expected_text}: {outcome.status}",
            )
            for outcome in replayed if outcome.execution is not None
        ], title="faultlab replay")
        print(f"wrote {args.html}")
    if mismatches:
        print(f"{mismatches} of {plural(len(plans), 'trace')} "
              f"{'differs' if mismatches == 1 else 'differ'} from what was expected")
        return EXIT_FOUND
    print(f"{plural(len(plans), 'trace')} replayed; every outcome matches")
    return EXIT_OK
