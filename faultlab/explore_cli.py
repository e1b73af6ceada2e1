"""``explore`` and ``replay``: search for a violating trace, and re-execute saved ones."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from faultlab.cli import (
    EXIT_FOUND,
    EXIT_OK,
    _add_format,
    _add_spawn,
    _add_system,
    _load_system,
    _positive_int,
    check_format,
)
from faultlab.corpus import DEFAULT_CORPUS, check_corpus_directory
from faultlab.errors import UsageError


def register(commands: Any) -> None:
    explore = commands.add_parser(
        "explore", help="search for a crash that breaks an invariant (Hypothesis state machine)",
        description="Generate sequences of real steps (accept, dispatch, crash at a point, "
                    "recover, resubmit, call the service) with Hypothesis, each step a real "
                    "process on fresh SQLite stores, checking every invariant after every step. "
                    "A failure is shrunk to its shortest trace, saved to the corpus and printed "
                    "as a table. Exit 0 when nothing was found, 1 when something was, 2 on bad "
                    "input.",
    )
    _add_system(explore)
    explore.add_argument("--examples", type=_positive_int, default=100, metavar="N",
                         help="examples (traces) Hypothesis must complete (default 100); ones it "
                              "abandons partway, when it cannot draw a rule, run on top, so the "
                              "summary can count a few more")
    explore.add_argument("--steps", type=_positive_int, default=10, metavar="N",
                         help="steps per example, before the final recovery (default 10)")
    explore.add_argument("--seed", type=int, default=0, metavar="S",
                         help="random seed; the same seed gives the same run (default 0)")
    explore.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, metavar="DIR",
                         help="where a finding is saved (default corpus/; created when needed)")
    explore.add_argument("--no-statement-crashes", dest="statement_crashes",
                         action="store_false",
                         help="draw only the system's named crash points, not sql:K/commit:K")
    explore.add_argument("--hypothesis-shrink", action="store_true",
                         help="also run Hypothesis's shrinker before faultlab's trace "
                              "minimiser (slower: every candidate is real processes; it also "
                              "simplifies payloads)")
    explore.add_argument("--quiet", action="store_true", help="no progress on stderr")
    _add_spawn(explore)
    _add_format(explore)
    explore.set_defaults(handler=cmd_explore)

    replay = commands.add_parser(
        "replay", help="execute saved traces on fresh stores and print them as tables",
        description="Execute each trace on fresh stores and print a table per trace: step, "
                    "action, operation, crash point, pid, exit, operations and outbox "
                    "pending/complete, tickets, receipts, violations. Exit 0 when every outcome "
                    "matches its recording, 1 when one differs, 2 on bad input. With --against, "
                    "each trace runs on another system and is expected to be clean (a finding "
                    "from a broken variant replayed against a fixed one must pass).",
    )
    replay.add_argument("traces", nargs="+", type=Path, metavar="TRACE")
    replay.add_argument("--against", metavar="SYSTEM",
                        help="replay on this system instead of the recorded one; expect clean")
    _add_spawn(replay)
    _add_format(replay)
    replay.set_defaults(handler=cmd_replay)


def _progress(recorder: Any) -> None:
    seconds = max(recorder.seconds, 1e-9)
    print(
        f"explore: {recorder.examples} examples, {recorder.steps} steps, "
        f"{recorder.sigkills} SIGKILLs, {recorder.steps / seconds:.0f} steps/s",
        file=sys.stderr, flush=True,
    )


def cmd_explore(args: argparse.Namespace) -> int:
    from faultlab import corpus, report
    from faultlab.explore import HYPOTHESIS_VERSION, explore
    from faultlab.process import spawner

    check_format(args.format)
    check_corpus_directory(args.corpus)
    system = _load_system(args.system, args.deduplication)
    with spawner(args.spawn) as runner:
        result = explore(
            system, runner, deduplication=args.deduplication, examples=args.examples,
            steps=args.steps, seed_value=args.seed, deadline=args.deadline,
            progress=None if args.quiet else _progress, statement_crashes=args.statement_crashes,
            hypothesis_shrink=args.hypothesis_shrink,
        )
    stats = result.stats()
    rows = [
        ["system", f"{system.ref}{'' if args.deduplication else ' (deduplication off)'}"],
        ["seed", args.seed],
        ["Hypothesis", HYPOTHESIS_VERSION],
        ["examples", stats["examples"]],
        ["steps", stats["steps"]],
        ["processes", stats["processes"]],
        ["SIGKILLs", stats["sigkills"]],
        ["invariant checks", stats["invariant_checks"]],
        *[[f"crash point {name}", count] for name, count in stats["crash_points_hit"].items()],
        ["wall time (s)", stats["seconds"]],
        ["steps/s", stats["steps_per_second"]],
    ]
    print(report.table(rows, ["explore", "value"], args.format))
    print()
    report.print_coverage(result.recorder.coverage, system, args.format)
    for note in result.notes:
        print(f"note: {note}")
    if result.trace is None:
        print(f"\nclean: no invariant failed in {stats['examples']} examples")
        return EXIT_OK
    path = corpus.save(result.trace, args.corpus, system.name)
    verdict = result.trace.expected.describe() if result.trace.expected else "?"
    print(f"\nFOUND: {verdict}, shrunk to {result.shrunk_steps} executed steps; saved {path}")
    if result.replay is not None:
        print(report.execution_table(result.replay, args.format))
        for line in report.violation_lines(result.replay):
            print(line)
    print(f"replay with: python -m faultlab replay {path}")
    return EXIT_FOUND


def cmd_replay(args: argparse.Namespace) -> int:
    from faultlab import report
    from faultlab.executor import execute, validate_step
    from faultlab.process import spawner
    from faultlab.trace import Trace

    check_format(args.format)
    traces = [Trace.load(path) for path in args.traces]
    against = _load_system(args.against) if args.against else None
    plans = []
    for path, trace in zip(args.traces, traces, strict=True):
        system = against if against is not None else _load_system(trace.system)
        if not trace.deduplication and not system.supports_no_deduplication:
            raise UsageError(f"{path}: system {system.ref!r} cannot switch deduplication off")
        for step in trace.steps:
            try:
                validate_step(system, step)
            except UsageError as error:
                raise UsageError(f"{path}: {error}") from None
        plans.append((path, trace, system))
    mismatches = 0
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
    if mismatches:
        print(f"{mismatches} of {len(plans)} traces differ from what was expected")
        return EXIT_FOUND
    print(f"{len(plans)} traces replayed; every outcome matches")
    return EXIT_OK
