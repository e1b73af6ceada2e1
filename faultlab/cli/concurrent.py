"""``explore --concurrency N`` (N >= 2) and ``replay`` of version 2 traces."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from faultlab.cli.common import check_format, load_system
from faultlab.concurrent_explore import ConcurrentRecorder
from faultlab.concurrent_trace import ConcurrentTrace
from faultlab.errors import EXIT_FOUND, EXIT_OK, UsageError
from faultlab.trace import Trace, Verdict


def _progress(recorder: ConcurrentRecorder) -> None:
    seconds = max(recorder.seconds, 1e-9)
    print(
        f"explore: {recorder.examples} examples, {recorder.steps} concurrent steps, "
        f"{recorder.sigkills} SIGKILLs, {recorder.steps / seconds:.0f} steps/s",
        file=sys.stderr, flush=True,
    )


def cmd_explore_concurrent(args: argparse.Namespace) -> int:
    from faultlab import corpus, report
    from faultlab.concurrent_explore import explore_concurrent
    from faultlab.corpus import check_corpus_directory
    from faultlab.explore import HYPOTHESIS_VERSION
    from faultlab.lane_report import concurrent_table, concurrent_violation_lines

    check_format(args.format)
    check_corpus_directory(args.corpus)
    if args.hypothesis_shrink:
        raise UsageError("--hypothesis-shrink does not apply with --concurrency above 1")
    if getattr(args, "html", None) is not None:
        raise UsageError("--html does not apply with --concurrency above 1 yet")
    system = load_system(args.system, args.deduplication)
    result = explore_concurrent(
        system, concurrency=args.concurrency, deduplication=args.deduplication,
        examples=args.examples, steps=args.steps, seed_value=args.seed, spawn=args.spawn,
        deadline=args.deadline, progress=None if args.quiet else _progress,
    )
    stats = result.stats()
    rows = [
        ["system", f"{system.ref}{'' if args.deduplication else ' (deduplication off)'}"],
        ["concurrency", args.concurrency],
        ["seed", args.seed],
        ["Hypothesis", HYPOTHESIS_VERSION],
        ["examples", stats["examples"]],
        ["concurrent steps", stats["steps"]],
        ["processes", stats["processes"]],
        ["SIGKILLs", stats["sigkills"]],
        ["lane-steps blocked on a lock", stats["blocked_lane_steps"]],
        *[[f"step {name}", count] for name, count in stats["actions"].items()],
        ["wall time (s)", stats["seconds"]],
        ["steps/s", stats["steps_per_second"]],
    ]
    print(report.table(rows, ["explore", "value"], args.format))
    for note in result.notes:
        print(f"note: {note}")
    if result.trace is None:
        print(f"\nclean: no invariant failed in {stats['examples']} examples")
        return EXIT_OK
    path = corpus.save(result.trace, args.corpus, system.name)
    verdict = result.trace.expected.describe() if result.trace.expected else "?"
    print(f"\nFOUND: {verdict}, shrunk to {result.shrunk_steps} scheduling steps; saved {path}")
    if result.replay is not None:
        print(concurrent_table(result.replay, result.trace.concurrency, args.format))
        for line in concurrent_violation_lines(result.replay):
            print(line)
    print(f"replay with: python -m faultlab replay {path}")
    return EXIT_FOUND


def cmd_replay_concurrent(args: argparse.Namespace, traces: list[Trace | ConcurrentTrace]) -> int:
    """Replay a mix of version 1 and version 2 traces, each with its own executor."""
    from faultlab import report
    from faultlab.executor import execute, validate_step
    from faultlab.lane_report import concurrent_table, concurrent_violation_lines
    from faultlab.lanes import execute_concurrent
    from faultlab.process import spawner

    against = load_system(args.against) if args.against else None
    plans = []
    for path, trace in zip(args.traces, traces, strict=True):
        system = against if against is not None else load_system(trace.system)
        try:
            system.require_deduplication_switch(trace.deduplication)
        except UsageError as error:
            raise UsageError(f"{path}: {error}") from None
        if isinstance(trace, Trace):
            for step in trace.steps:
                try:
                    validate_step(system, step)
                except UsageError as error:
                    raise UsageError(f"{path}: {error}") from None
        plans.append((Path(path), trace, system))
    mismatches = 0
    with spawner(args.spawn) as runner:
        for path, trace, system in plans:
            print(f"{path}: {system.ref}{'' if trace.deduplication else ' (deduplication off)'}")
            verdict: Verdict
            if isinstance(trace, ConcurrentTrace):
                concurrent = execute_concurrent(
                    system, trace.steps, concurrency=trace.concurrency,
                    deduplication=trace.deduplication, settle=trace.settle, spawn=args.spawn,
                    deadline=args.deadline,
                )
                verdict = concurrent.verdict
                print(concurrent_table(concurrent, trace.concurrency, args.format))
                lines = concurrent_violation_lines(concurrent)
            else:
                sequential = execute(system, trace.steps, runner,
                                     deduplication=trace.deduplication, settle=trace.settle,
                                     deadline=args.deadline)
                verdict = sequential.verdict
                print(report.execution_table(sequential, args.format))
                lines = report.violation_lines(sequential)
            for line in lines:
                print(line)
            if against is not None:
                expected_text = "clean (replayed --against " + system.ref + ")"
                matches = verdict.clean
            else:
                expected = trace.expected
                expected_text = expected.describe() if expected else "clean (nothing recorded)"
                matches = verdict == (expected if expected is not None else Verdict())
            status = "matches" if matches else "DIFFERS"
            print(f"verdict: {verdict.describe()}; expected {expected_text}: {status}\n")
            mismatches += not matches
    if mismatches:
        print(f"{mismatches} of {len(plans)} traces differ from what was expected")
        return EXIT_FOUND
    print(f"{len(plans)} traces replayed; every outcome matches")
    return EXIT_OK
