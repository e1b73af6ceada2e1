"""``replay``: execute saved traces on fresh stores and print them as tables."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from faultlab.base.errors import EXIT_FLAKY, EXIT_FOUND, EXIT_OK, UsageError
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
                    "pending/complete, tickets, receipts, violations. A trace is data and "
                    "never chooses code to run: a built-in system is found by the name the "
                    "trace records; any other (a system file, package.module:attribute) runs "
                    "only when named with --system, or mapped in the trace's project: the "
                    "nearest pyproject.toml at or above the trace file, table "
                    "[tool.faultlab.systems], e.g. \"system.json\" = \"path/to/system.json\" "
                    "(a path relative to that pyproject.toml); otherwise the trace is refused "
                    "(exit 2) before anything runs. A trace with \"expect\": \"finding\" "
                    "(the zoo's, the negative control's) passes when it shows its recorded "
                    "finding; one without it (what explore saves for the reference or your "
                    "system) is a regression test: it fails (exit 1, \"still fails\") while "
                    "its finding reproduces and passes once the bug is fixed. A trace with "
                    "\"expect\": \"flaky\" (what explore keeps in flaky/ when a failure did "
                    "not fail again) is no test: clean, it is flaky again (exit 5); failing, "
                    "it differs (exit 1). With --against, "
                    "each trace runs on another system and is expected to be clean (a finding "
                    "from a broken variant replayed against a fixed one must pass).",
        epilog=REPLAY_EPILOG,
    )
    parser.add_argument("traces", nargs="+", type=Path, metavar="TRACE",
                        help="a saved trace file (.json), as explore or mutants saved it in "
                             "corpus/; several are replayed in turn")
    parser.add_argument("--system", metavar="SYSTEM",
                        help="run every trace on this system, judged by its recording: a "
                             "built-in name, package.module:attribute or path/to/system.json "
                             "(as typed here, from this directory); needed for a trace whose "
                             "recorded system is not built in nor mapped in its project's "
                             "[tool.faultlab.systems]")
    parser.add_argument("--against", metavar="SYSTEM",
                        help="replay on this system instead of the recorded one; expect clean")
    add_html(parser, "also write every replayed trace as one self-contained HTML page (a "
                     "timeline with a lane per process, SIGKILLs, both stores after each step "
                     "with changed rows highlighted, violated invariants marked)")
    add_postgres(parser)
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_replay)


def _how(path: Path) -> Callable[[str], str]:
    """How to name the system of the trace at ``path`` on this command line."""
    return lambda system: f"faultlab replay {path} --system {system}"


def cmd_replay(args: argparse.Namespace) -> int:
    from faultlab.corpus.replay import plan, replay
    from faultlab.corpus.trust import system_for
    from faultlab.process.spawn import spawner
    from faultlab.report import html as html_report
    from faultlab.trace import Trace

    check_format(args.format)
    if args.html is not None:
        check_output_path(args.html, "--html", html_report.PAGE)
    if args.system is not None and args.against is not None:
        raise UsageError("--system names the system a trace was recorded on and --against "
                         "another one expected clean: give one of them")
    loaded = [Trace.load(path) for path in args.traces]
    against = load_system(args.against) if args.against else None
    named = load_system(args.system) if args.system else against
    plans = [
        plan(path, trace, system_for(path, trace, named, how=_how(path)),
             against=against is not None)
        for path, trace in zip(args.traces, loaded, strict=True)
    ]
    mismatches = flaky = 0
    replayed = []
    with spawner(args.spawn) as runner:
        for planned in plans:
            outcome = replay(planned, runner, deadline=args.deadline, fmt=args.format)
            print("\n".join(outcome.lines()) + "\n")
            mismatches += not outcome.matches
            flaky += outcome.flaky and outcome.matches
            replayed.append(outcome)
    if args.html is not None:
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
    if flaky:  # a kept flaky trace that replays clean is not fixed: still flaky, not clean
        print(f"{flaky} of {plural(len(plans), 'trace')} flaky: recorded as failing, "
              "and did not fail again")
        return EXIT_FLAKY
    print(f"{plural(len(plans), 'trace')} replayed; every outcome matches")
    return EXIT_OK
