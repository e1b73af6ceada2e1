"""``enumerate --concurrency N`` (N >= 2). (``explore --concurrency N`` is ``explore`` itself:
its rounds are concurrent explorations, :mod:`faultlab.search.rounds`.)"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from faultlab.base.errors import EXIT_FLAKY, EXIT_FOUND, EXIT_OK, EXIT_VACUOUS, UsageError
from faultlab.cli.common import check_format, load_system
from faultlab.trace import ConcurrentTrace


def cmd_enumerate_concurrent(args: argparse.Namespace) -> int:

    from faultlab.base.version import __version__
    from faultlab.corpus import files as corpus
    from faultlab.corpus.files import flaky_directory
    from faultlab.report import tables as report
    from faultlab.run.interleaving import execute_concurrent
    from faultlab.search.coverage import Coverage, vacuity
    from faultlab.search.explore import flaky_trace
    from faultlab.search.schedule_enumeration import ACCEPTORS, enumerate_concurrent

    check_format(args.format)
    directory = _corpus_directory(args)
    system = load_system(args.system, args.deduplication)
    max_steps: int = args.max_steps or 3
    result = enumerate_concurrent(
        system, concurrency=args.concurrency, operations=args.operations, max_steps=max_steps,
        crashes=args.crashes, deduplication=args.deduplication, spawn=args.spawn,
        deadline=args.deadline, progress=None if args.quiet else _enumerate_progress,
    )
    rows: list[list[Any]] = [
        ["system", f"{system.ref}{'' if args.deduplication else ' (deduplication off)'}"],
        ["budget", f"{args.concurrency} lanes, {args.operations} operations, "
                   f"{args.crashes} kills, 1 tick, {ACCEPTORS} held acceptors, "
                   f"{max_steps} choices"],
        ["sequences run", result.sequences],
        ["not extended (state already explored)", result.pruned],
        ["distinct states", result.states],
        ["steps executed", result.steps],
        ["wall time (s)", round(result.seconds, 2)],
    ]
    print(report.table(rows, ["enumerate", "value"], args.format))
    if result.finding is None or result.execution is None:
        vacuous = vacuity(Coverage(checked=result.checked), system, result.sequences,
                          concurrency=args.concurrency, can_hold=system.holds_in_lanes())
        if vacuous is not None:
            print(f"\nvacuous: nothing failed in {result.sequences} sequences, but nothing "
                  f"was tested: {vacuous}")
            return EXIT_VACUOUS
        print(f"\nclean: no invariant failed in {result.sequences} sequences")
        return EXIT_OK
    confirmed = execute_concurrent(
        system, result.finding, concurrency=args.concurrency,
        deduplication=args.deduplication, spawn=args.spawn, deadline=args.deadline,
    )
    meta = {"found_by": "enumerate", "operations": args.operations, "crashes": args.crashes,
            "max_steps": max_steps, "faultlab": __version__}
    if confirmed.verdict != result.execution.verdict:
        # not a finding, and not clean either: kept beside the corpus as flaky
        kept = corpus.save(flaky_trace(ConcurrentTrace(
            system=system.ref, deduplication=args.deduplication, concurrency=args.concurrency,
            steps=list(result.finding), expected=result.execution.verdict, meta=meta),
            confirmed.verdict), flaky_directory(str(directory)), system.name)
        print(f"\nflaky: {result.execution.verdict.describe()} failed in a sequence of "
              f"enumerate's but not the same way on fresh stores (they showed "
              f"{confirmed.verdict.describe()}); trace kept at {kept}")
        return EXIT_FLAKY
    trace = ConcurrentTrace(
        system=system.ref, deduplication=args.deduplication, concurrency=args.concurrency,
        steps=list(result.finding), expected=confirmed.verdict,
        violations=list(confirmed.violations), meta=meta,
        # no timestamp: a finding of the same run is the same bytes
    )
    path = corpus.save(trace, directory, system.name)
    print(f"\nFOUND: {confirmed.verdict.describe()} with {len(result.finding) - args.operations} "
          f"scheduling choices after {args.operations} accepts; saved {path}")
    print(report.replay_table(confirmed, args.format))
    for line in [*report.violation_lines(confirmed), *report.worker_error_lines(confirmed)]:
        print(line)
    print(f"replay with: {corpus.replay_command(path, system.ref)}")
    return EXIT_FOUND


def _enumerate_progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _corpus_directory(args: argparse.Namespace) -> Path:
    """Concurrent findings go to a corpus directory (not yet to a Redis corpus)."""
    from faultlab.corpus.files import check_corpus_directory

    target = str(args.corpus)
    if "://" in target:
        raise UsageError(f"--corpus {target}: concurrent findings go to a directory, not yet "
                         "to a Redis corpus")
    check_corpus_directory(Path(target))
    return Path(target)
