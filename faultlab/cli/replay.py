"""``replay``: execute saved traces on fresh stores and print them as tables."""

from __future__ import annotations

import argparse
from pathlib import Path

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
from faultlab.errors import EXIT_FOUND, EXIT_OK, UsageError
from faultlab.messages import plural


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
    from faultlab import report
    from faultlab.executor import execute, validate_step
    from faultlab.process import spawner
    from faultlab.trace import Trace

    check_format(args.format)
    if args.html is not None:
        check_output_path(args.html, "--html")
    from faultlab.concurrent_trace import ConcurrentTrace, load

    loaded = [load(path) for path in args.traces]
    if any(isinstance(trace, ConcurrentTrace) for trace in loaded):
        if args.html is not None:
            raise UsageError("--html does not apply to concurrent (version 2) traces yet")
        from faultlab.cli.concurrent import cmd_replay_concurrent

        return cmd_replay_concurrent(args, loaded)
    traces = [trace for trace in loaded if isinstance(trace, Trace)]
    against = load_system(args.against) if args.against else None
    plans = []
    for path, trace in zip(args.traces, traces, strict=True):
        system = against if against is not None else load_system(trace.system)
        try:
            system.require_deduplication_switch(trace.deduplication)
        except UsageError as error:
            raise UsageError(f"{path}: {error}") from None
        for step in trace.steps:
            try:
                validate_step(system, step)
            except UsageError as error:
                raise UsageError(f"{path}: {error}") from None
        plans.append((path, trace, system))
    mismatches = 0
    pages = []
    with spawner(args.spawn) as runner:
        for path, trace, system in plans:
            execution = execute(
                system, trace.steps, runner, deduplication=trace.deduplication,
                settle=trace.settle, deadline=args.deadline,
            )
            verdict = execution.verdict
            print(f"{path}: {system.ref}{'' if trace.deduplication else ' (deduplication off)'}")
            print(report.execution_table(execution, args.format))
            for line in report.violation_lines(execution):
                print(line)
            if against is not None:
                expected_text = "clean (replayed --against " + system.ref + ")"
                matches = verdict.clean
            else:
                expected = trace.expected
                expected_text = expected.describe() if expected else "clean (nothing recorded)"
                matches = verdict == (expected if expected is not None else verdict.__class__())
            status = "matches" if matches else "DIFFERS"
            print(f"verdict: {verdict.describe()}; expected {expected_text}: {status}\n")
            mismatches += not matches
            pages.append((path, trace, system, execution, expected_text, status))
    if args.html is not None:
        from faultlab import html_report

        html_report.write(args.html, [
            html_report.TraceReport(
                title=str(path), execution=execution, system=system.ref,
                deduplication=trace.deduplication, verdict=execution.verdict.describe(),
                expected=f"{expected_text}: {status}",
            )
            for path, trace, system, execution, expected_text, status in pages
        ], title="faultlab replay")
        print(f"wrote {args.html}")
    if mismatches:
        print(f"{mismatches} of {plural(len(plans), 'trace')} "
              f"{'differs' if mismatches == 1 else 'differ'} from what was expected")
        return EXIT_FOUND
    print(f"{plural(len(plans), 'trace')} replayed; every outcome matches")
    return EXIT_OK
