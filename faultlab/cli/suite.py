"""``suite``: the five regression scenarios, then a short exploration and the negative control."""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from faultlab.base.errors import EXIT_FOUND, EXIT_OK, UsageError
from faultlab.base.messages import plural
from faultlab.cli.common import (
    SUITE_EPILOG,
    Commands,
    add_format,
    add_spawn,
    add_system,
    check_format,
    check_new_directory,
    check_output_path,
    int_at_least,
    load_system,
    refuse_unused_postgres,
    seed_int,
)
from faultlab.system.contract import System


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "suite", help="run the five regression scenarios (and a short exploration)",
        description="Run the five regression scenarios on fresh stores, print "
                    "a table and the summary lines, then explore the system (fixed seed) "
                    "and run the negative control. Exit 0 when everything passes, 1 when a "
                    "check fails, 2 on bad input, 3 when the run itself failed.",
        epilog=SUITE_EPILOG,
    )
    add_system(parser, dedup=False)
    parser.add_argument("--output", type=Path, metavar="FILE",
                       help="write the evidence JSON here (an existing FILE is replaced only "
                            "if it is a faultlab suite evidence file; written atomically)")
    parser.add_argument("--directory", type=Path, metavar="DIR",
                       help="keep each scenario's stores under DIR/<scenario>/ (DIR must not "
                            "exist; a run that is interrupted or breaks, exit 3 or 130/143, "
                            "removes it)")
    parser.add_argument("--examples", type=int_at_least(0), default=50, metavar="N",
                       help="examples the exploration phase must complete (default 50; 0 skips "
                            "it); ones Hypothesis abandons partway come on top")
    parser.add_argument("--seed", type=seed_int, default=0, metavar="S",
                       help="seed for the exploration phase (default 0)")
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_suite)


def _progress(line: str) -> None:
    """What suite is doing, on stderr: the table and evidence on stdout stay as they are."""
    print(f"suite: {line}", file=sys.stderr, flush=True)


def cmd_suite(args: argparse.Namespace) -> int:
    from faultlab.report import tables as report
    from faultlab.trials.scenarios import SCENARIOS

    check_format(args.format)
    system = load_system(args.system)
    refuse_unused_postgres(system, args.postgres)
    for scenario in SCENARIOS:
        scenario.steps_for(system)  # a role without a point: one line before anything runs
    if args.output is not None:
        check_output_path(args.output, "--output", report.EVIDENCE)
    if args.directory is not None:
        check_new_directory(args.directory)
        if args.output is not None and \
                os.path.abspath(args.output) == os.path.abspath(args.directory):
            raise UsageError(f"--output {args.output} and --directory {args.directory} are "
                             "the same path: the evidence file and the scenarios' stores "
                             "need two")
    try:
        return _run(args, system)
    except BaseException:
        # an interrupted or broken run reports nothing, so it keeps nothing either
        if args.directory is not None and args.directory.is_dir():
            shutil.rmtree(args.directory, ignore_errors=True)
        raise


def _run(args: argparse.Namespace, system: System) -> int:
    """The scenarios, then the exploration phase; the table, the lines and the evidence."""
    from faultlab.base.output import write_json
    from faultlab.process.spawn import spawner
    from faultlab.report import tables as report
    from faultlab.report.progress import Progress
    from faultlab.search.explore import suite_exploration
    from faultlab.trials.scenarios import SCENARIOS

    exploration = None
    outcomes = []
    started = time.perf_counter()
    with spawner(args.spawn) as runner:
        if args.directory is not None:
            args.directory.mkdir()
        for scenario in SCENARIOS:
            directory = args.directory / scenario.name if args.directory is not None else None
            began = time.perf_counter()
            outcome = scenario.run(system, runner, directory, deadline=args.deadline)
            outcome.seconds = time.perf_counter() - began
            outcomes.append(outcome)
            _progress(f"scenario {len(outcomes)}/{len(SCENARIOS)} {scenario.name}: "
                      f"{outcome.verdict} ({outcome.seconds:.1f} s)")
        scenario_seconds = time.perf_counter() - started
        try:
            if args.examples > 0:
                _progress(f"exploring {system.name} ({args.examples} examples, seed "
                          f"{args.seed}), then the negative control")
                shown = Progress(examples=args.examples, duration=None, label="suite")

                def progress(phase: str, recorder: Any) -> None:
                    line = (f"suite: {phase}: {recorder.examples} examples, "
                            f"{recorder.steps} steps, {recorder.sigkills} SIGKILLs")
                    shown.update(examples=recorder.examples, seconds=0.0, line=line,
                                 postfix=f"{recorder.steps} steps, {recorder.sigkills} SIGKILLs")

                try:
                    exploration = suite_exploration(
                        system, runner, examples=args.examples, seed=args.seed,
                        deadline=args.deadline, progress=progress,
                    )
                finally:
                    shown.close()
        except Exception:
            # the scenarios ran: show them even when the exploration phase errors (an
            # interrupted run, a KeyboardInterrupt, reports nothing)
            print_scenarios(outcomes, args.format)
            raise
        print_scenarios(outcomes, args.format)
    seconds = time.perf_counter() - started
    failed = [o for o in outcomes if not o.passed]
    if exploration is not None:
        for line in exploration["lines"]:
            print(line)
    passed = not failed and (exploration is None or exploration["passed"])
    if passed:
        print(report.PASS_LINE)
    if args.output is not None:
        data = report.evidence(outcomes, spawn=args.spawn, seconds=seconds)
        data["timings"]["scenarios_seconds"] = round(scenario_seconds, 4)
        if exploration is not None:
            data["exploration"] = exploration["evidence"]
            data["passed"] = data["passed"] and exploration["passed"]
        write_json(args.output, data, final=True, kind=report.EVIDENCE)
    return EXIT_OK if passed else EXIT_FOUND


def print_scenarios(outcomes: Sequence[Any], fmt: str) -> None:
    """The scenario table, the summary lines, and every failed or unknown check."""
    from faultlab.report import tables as report

    print(report.scenario_table(outcomes, fmt))
    print()
    for line in report.summary_lines(outcomes):
        print(line)
    crashed = [o for o in outcomes if o.failures and report.worker_error(o.execution)]
    for outcome in outcomes:
        if outcome in crashed:
            continue  # its checks fail because a worker died: said once, below
        for failure in outcome.failures:
            print(f"FAIL: {outcome.name}: {failure}")
        for unknown in outcome.unknowns:
            print(f"UNKNOWN: {outcome.name}: {unknown}")
    for line in worker_error_lines(crashed):
        print(line)
    sys.stdout.flush()


def worker_error_lines(crashed: Sequence[Any]) -> list[str]:
    """A worker that died with an unexpected error (a traceback, exit 70) fails every check
    after it: 47 ``FAIL:`` lines once hid the one cause, whose stderr was never shown. The
    first such failure is shown with the worker's stderr; the other scenarios it broke and
    the count of checks that failed after it are one line (``--output`` lists every check)."""
    from faultlab.report import tables as report

    if not crashed:
        return []
    first = crashed[0]
    observation = report.worker_error(first.execution)
    if observation is None:  # pragma: no cover - crashed holds only outcomes with one
        return []
    record = observation.record
    lines = [f"FAIL: {first.name}: step {observation.index}: the {observation.step.action} "
             f"worker (pid {record.pid}) failed with exit {record.exit_code}, an error it "
             "did not declare; its stderr:", *report.worker_stderr(record)]
    hidden = sum(len(o.failures) for o in crashed)
    others = [o.name for o in crashed[1:]]
    also = (f" (a worker also failed with an undeclared error in {', '.join(others)})"
            if others else "")
    lines.append(f"FAIL: {plural(hidden, 'failed check')} not listed: they follow a worker's "
                 f"undeclared error{also}; --output records every one")
    return lines
