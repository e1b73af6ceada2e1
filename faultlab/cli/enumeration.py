"""``enumerate``: bounded exhaustive crash exploration, of sequential traces
(:mod:`faultlab.search.enumeration`) or, with ``--concurrency N``, of interleavings
(:mod:`faultlab.search.schedule_enumeration`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from faultlab.base.errors import EXIT_FLAKY, EXIT_FOUND, EXIT_OK, EXIT_VACUOUS, UsageError
from faultlab.cli.common import (
    MAX_JOBS,
    SEARCH_EPILOG,
    Commands,
    add_format,
    add_spawn,
    add_system,
    check_format,
    concurrency,
    count,
    jobs,
    load_system,
    positive_int,
    refuse_unused_postgres,
)
from faultlab.corpus.files import DEFAULT_CORPUS, check_corpus_directory
from faultlab.search import defaults

if TYPE_CHECKING:
    from faultlab.process.spawn import Spawner
    from faultlab.search.coverage import Coverage
    from faultlab.system.contract import System

#: The most worker threads enumerate starts by default (``--jobs`` may ask for up to
#: :data:`~faultlab.cli.common.MAX_JOBS`).
DEFAULT_JOBS_AT_MOST = 8


def default_jobs() -> int:
    """Two worker threads per core: each mostly waits for its worker processes."""
    return max(1, min(DEFAULT_JOBS_AT_MOST, 2 * (os.cpu_count() or 1)))


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "enumerate", help="run every trace up to a small budget, crashing at every point",
        description="Bounded exhaustive exploration, beside explore's random search: run every "
                    "trace over at most N operation ids, built from accept, accept again (same "
                    "or changed payload), dispatch/recover and direct service calls, with up to "
                    "C crashes at every crash point the system declares and before every SQL "
                    "statement / after every COMMIT a worker runs (sql:K, commit:K); recover "
                    "each trace to quiescence and check every invariant. Operation ids are "
                    "first used in order (op-1, op-2, ...): a trace that would only rename an "
                    "unused id is counted, not run; a trace that reaches an already explored "
                    "state (stored wall-clock times compared by their order) is not extended. "
                    "The shortest violating trace for each "
                    "invariant is saved to the corpus and printed as a table. Exit 0 when "
                    "nothing was found, 1 when something was, 2 on bad input, 4 when nothing "
                    "was tested (vacuous: no operation accepted, a family of invariants never "
                    "checked, --power-loss that took no power cut, declared crash points that "
                    "never fired), 5 when a violation "
                    "found did not happen again on fresh stores (flaky: its trace kept in "
                    "flaky/ beside the corpus, never in it).",
        epilog=SEARCH_EPILOG,
    )
    add_system(parser)
    parser.add_argument("--operations", type=positive_int, default=defaults.OPERATIONS,
                        metavar="N",
                        help=f"operation ids a trace may use (default {defaults.OPERATIONS})")
    parser.add_argument("--crashes", type=count, default=defaults.CRASHES, metavar="C",
                        help=f"crashes per trace (default {defaults.CRASHES}; 0: none)")
    parser.add_argument("--max-steps", type=positive_int, metavar="S",
                        help="steps per trace before the final recovery "
                             "(default 2N + C + 1: every operation accepted and dispatched, "
                             "each crash, one more step)")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), metavar="DIR",
                        help="where findings are saved (default corpus/; created when needed)")
    parser.add_argument("--jobs", type=jobs, metavar="J",
                        help="worker threads, each with its own fork server "
                             f"(default {default_jobs()}: two per core, at most "
                             f"{DEFAULT_JOBS_AT_MOST}; 1 with --power-loss or --concurrency "
                             f"above 1, which refuse more; at most {MAX_JOBS} when given)")
    parser.add_argument("--first", action="store_true",
                        help="stop after the trace length at which something was first found")
    parser.add_argument("--concurrency", type=concurrency, default=1, metavar="N",
                        help="lanes (default 1: sequential traces, as above). With N >= 2: "
                             "after --operations accepts of one key, every sequence of at "
                             "most --max-steps scheduling choices (default 3: start a "
                             "dispatcher or a direct delivery in a free lane, release or kill "
                             "a held lane, one clock advance past a lease), each state "
                             "explored once; stops at the first (shortest) finding")
    parser.add_argument("--power-loss", action="store_true",
                        help="also cut the machine's power after each step, once for every "
                             "choice of the unsynced writes that gives a distinct outcome "
                             "(each cut counts against --crashes); the stores are recorded "
                             "through faultlab's SQLite VFS, and a cut checks that each "
                             "store still opens (OPEN) and that what was acknowledged "
                             "survived (DURABLE). Sequential traces only, one job")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_enumerate)


def _progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def cmd_enumerate(args: argparse.Namespace) -> int:
    if args.power_loss and args.concurrency > 1:
        raise UsageError("enumerate --power-loss applies to sequential traces only "
                         "(--concurrency 1)")
    if "://" in args.corpus:  # read as text: a Path would fold redis:// into redis:/
        raise UsageError(f"--corpus {args.corpus}: enumerate saves findings to a directory, "
                         "not a Redis corpus")
    args.corpus = Path(args.corpus)
    if args.concurrency > 1:
        if args.jobs not in (None, 1):
            raise UsageError("enumerate --concurrency walks its states in one job (each "
                             "explored once, in order): drop --jobs")
        return _enumerate_lanes(args)
    from faultlab.base.version import __version__
    from faultlab.corpus import files as corpus
    from faultlab.corpus.files import flaky_directory
    from faultlab.process.spawn import Spawner
    from faultlab.report import tables as report
    from faultlab.search.coverage import drawn_faults, vacuity
    from faultlab.search.enumeration import confirm, enumerate_system
    from faultlab.search.explore import flaky_trace
    from faultlab.trace import Trace, Verdict

    check_format(args.format)
    check_corpus_directory(args.corpus)
    if args.power_loss and args.jobs not in (None, 1):
        raise UsageError("enumerate --power-loss runs one job (the recording VFS is this "
                         "process's default, for one log at a time): drop --jobs")
    threads = args.jobs or (1 if args.power_loss else default_jobs())
    system = load_system(args.system, args.deduplication)
    refuse_unused_postgres(system, args.postgres)
    if system.store_kind != "sqlite":  # branches copy the run directory's store files
        raise UsageError(f"enumerate: system {system.name!r} keeps its stores in "
                         f"{system.store_kind}; enumerate needs SQLite stores (use explore)")
    max_steps = args.max_steps or defaults.max_steps(args.operations, args.crashes)
    spawners = [Spawner(args.spawn) for _ in range(threads)]
    try:
        result = enumerate_system(
            system, spawners, deduplication=args.deduplication, operations=args.operations,
            crashes=args.crashes, max_steps=max_steps, deadline=args.deadline,
            first=args.first, progress=None if args.quiet else _progress,
            power=args.power_loss,
        )
        confirmed = [
            (finding, confirm(system, finding, spawners[0], deduplication=args.deduplication,
                              deadline=args.deadline))
            for finding in result.findings()
        ]
    finally:
        for runner in spawners:
            runner.close()

    rows: list[list[Any]] = [
        ["budget", f"{args.operations} operations, {args.crashes} "
                   f"{'crashes or power cuts' if args.power_loss else 'crashes'}, "
                   f"{max_steps} steps"],
        ["traces run", result.traces],
        ["pruned by state (reached an explored state)", result.skipped],
        ["pruned by symmetry (an unused id renamed)", result.symmetric],
        ["crash probes that did not fire", result.probes],
        ["distinct states", result.states],
        ["distinct crash states", result.crash_states],
        ["violating traces", result.violations],
        ["steps executed", result.steps_executed],
        ["longest trace", result.depth],
        ["wall time (s)", round(result.seconds, 2)],
    ]
    faults = drawn_faults(args.power_loss)
    _print_summary(system, args, rows, result.coverage, faults=faults)
    if not confirmed:
        return _nothing_found(vacuity(result.coverage, system, result.traces, faults=faults),
                              result.traces, "traces")

    summary: list[list[Any]] = []
    flaky: list[str] = []
    for finding, execution in confirmed:
        verdict = execution.verdict
        reproduced = not verdict.clean and not set(verdict.invariants).isdisjoint(
            finding.invariants)
        # the heading says FOUND only for what fresh stores showed again
        heading = "FOUND" if reproduced else "not reproduced on fresh stores"
        print(f"\n{heading}: {'+'.join(finding.invariants)} at executed step "
              f"{finding.executed} of a {len(finding.steps)}-step trace (recovery dispatches "
              f"count as steps)")
        print(report.replay_table(execution, args.format))
        for line in report.violation_lines(execution):
            print(line)
        if not reproduced:
            # not a finding, and not clean either: kept beside the corpus as flaky
            at = finding.executed if finding.executed <= len(finding.steps) else None
            recorded = Verdict(at, finding.invariants)
            kept = corpus.save(flaky_trace(Trace(
                system=system.ref, deduplication=args.deduplication,
                steps=list(finding.steps), settle=True, expected=recorded,
                meta={"found_by": "enumerate", "operations": args.operations,
                      "crashes": args.crashes, "max_steps": max_steps,
                      "faultlab": __version__}), verdict),
                flaky_directory(str(args.corpus)), system.name)
            flaky.append(f"{'+'.join(finding.invariants)} failed in a trace of enumerate's "
                         f"but not on fresh stores (they showed {verdict.describe()}); trace "
                         f"kept at {kept}")
            summary.append(["+".join(finding.invariants), finding.executed, len(finding.steps),
                            f"not reproduced: {kept}"])
            continue
        trace = Trace(
            system=system.ref,
            deduplication=args.deduplication,
            steps=list(finding.steps),
            settle=True,
            expected=verdict,
            violations=list(execution.violations),
            meta={
                "found_by": "enumerate",
                "operations": args.operations,
                "crashes": args.crashes,
                "max_steps": max_steps,
                "executed_steps": len(execution.executed_prefix()),
                "seconds_to_find": round(finding.seconds, 3),
                "faultlab": __version__,
            },
        )
        path = corpus.save(trace, args.corpus, system.name)
        print(f"verdict: {verdict.describe()}; saved {path}")
        summary.append(["+".join(finding.invariants), finding.executed, len(finding.steps),
                        str(path)])
    print()
    print(report.table(summary, ["found", "executed steps", "trace steps", "corpus file"],
                       args.format))
    for line in flaky:
        print(f"flaky: {line}")
    return EXIT_FLAKY if len(flaky) == len(confirmed) else EXIT_FOUND


def _enumerate_lanes(args: argparse.Namespace) -> int:
    """``enumerate --concurrency N`` (N >= 2): every interleaving of a small workload
    (:mod:`faultlab.search.schedule_enumeration`), stopping at the first finding."""
    from faultlab.process.spawn import spawner

    check_format(args.format)
    directory = _lanes_corpus_directory(args)
    system = load_system(args.system, args.deduplication)
    refuse_unused_postgres(system, args.postgres)
    max_steps: int = args.max_steps or 3
    with spawner(args.spawn) as runner:  # one fork server and lanes' helper for the walk
        return _walk_lanes(args, system, directory, max_steps, runner)


def _walk_lanes(args: argparse.Namespace, system: System, directory: Path, max_steps: int,
                runner: Spawner) -> int:
    """:func:`_enumerate_lanes`'s walk, report and confirming replay, all through
    ``runner``."""
    from faultlab.base.version import __version__
    from faultlab.corpus import files as corpus
    from faultlab.corpus.files import flaky_directory
    from faultlab.report import tables as report
    from faultlab.run.executor import execute
    from faultlab.search.coverage import vacuity
    from faultlab.search.explore import flaky_trace
    from faultlab.search.schedule_enumeration import ACCEPTORS, enumerate_concurrent
    from faultlab.trace import Trace

    result = enumerate_concurrent(
        system, concurrency=args.concurrency, operations=args.operations, max_steps=max_steps,
        crashes=args.crashes, deduplication=args.deduplication, spawner=runner,
        deadline=args.deadline, progress=None if args.quiet else _progress,
    )
    rows: list[list[Any]] = [
        ["budget", f"{args.concurrency} lanes, {args.operations} operations, "
                   f"{args.crashes} kills, 1 tick, {ACCEPTORS} held acceptors, "
                   f"{max_steps} choices"],
        ["sequences run", result.sequences],
        ["not extended (state already explored)", result.pruned],
        ["distinct states", result.states],
        ["steps executed", result.steps],
        ["wall time (s)", round(result.seconds, 2)],
    ]
    _print_summary(system, args, rows, result.coverage, lanes=True)
    if result.finding is None or result.execution is None:
        return _nothing_found(
            vacuity(result.coverage, system, result.sequences, concurrency=args.concurrency,
                    can_hold=system.holds_in_lanes()),
            result.sequences, "sequences")
    confirmed = execute(system, result.finding, runner, laned=True,
                        concurrency=args.concurrency, deduplication=args.deduplication,
                        deadline=args.deadline, settle=True)
    meta = {"found_by": "enumerate", "operations": args.operations, "crashes": args.crashes,
            "max_steps": max_steps, "faultlab": __version__}
    if confirmed.verdict != result.execution.verdict:
        # not a finding, and not clean either: kept beside the corpus as flaky
        kept = corpus.save(flaky_trace(Trace(
            system=system.ref, deduplication=args.deduplication, steps=list(result.finding),
            expected=result.execution.verdict, meta=meta, concurrency=args.concurrency),
            confirmed.verdict), flaky_directory(str(directory)), system.name)
        print(f"\nflaky: {result.execution.verdict.describe()} failed in a sequence of "
              f"enumerate's but not the same way on fresh stores (they showed "
              f"{confirmed.verdict.describe()}); trace kept at {kept}")
        return EXIT_FLAKY
    trace = Trace(
        system=system.ref, deduplication=args.deduplication, steps=list(result.finding),
        expected=confirmed.verdict, violations=list(confirmed.violations), meta=meta,
        concurrency=args.concurrency)
    path = corpus.save(trace, directory, system.name)
    print(f"\nFOUND: {confirmed.verdict.describe()} with {len(result.finding) - args.operations} "
          f"scheduling choices after {args.operations} accepts; saved {path}")
    print(report.replay_table(confirmed, args.format))
    for line in [*report.violation_lines(confirmed), *report.worker_error_lines(confirmed)]:
        print(line)
    print(f"replay with: {corpus.replay_command(path, system.ref)}")
    return EXIT_FOUND


def _print_summary(system: System, args: argparse.Namespace, rows: list[list[Any]],
                   coverage: Coverage, *, faults: tuple[str, ...] = (),
                   lanes: bool = False) -> None:
    """Either enumerator's figures under one system row, then the coverage tables."""
    from faultlab.report import tables as report

    system_row = ["system", f"{system.ref}{'' if args.deduplication else ' (deduplication off)'}"]
    print(report.table([system_row, *rows], ["enumerate", "value"], args.format))
    print()
    report.print_coverage(coverage, system, args.format, faults, lanes=lanes)


def _nothing_found(vacuous: str | None, count: int, unit: str) -> int:
    """The verdict of an enumeration that found nothing: clean (exit 0) only when something
    was tested, else vacuous (exit 4), saying why."""
    if vacuous is not None:
        print(f"\nvacuous: nothing failed in {count} {unit}, but nothing was tested: "
              f"{vacuous}")
        return EXIT_VACUOUS
    print(f"\nclean: no invariant failed in {count} {unit}")
    return EXIT_OK


def _lanes_corpus_directory(args: argparse.Namespace) -> Path:
    """Concurrent findings go to a corpus directory (a redis:// one is refused above)."""
    check_corpus_directory(Path(args.corpus))
    return Path(args.corpus)
