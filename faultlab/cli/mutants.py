"""``mutants``: prove that faultlab catches every mutant of the bug zoo."""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from faultlab.base.errors import EXIT_FOUND, EXIT_OK, UsageError
from faultlab.base.messages import plural
from faultlab.base.output import Kind
from faultlab.cli.common import (
    MUTANTS_EPILOG,
    Commands,
    add_format,
    add_spawn,
    check_format,
    check_output_path,
    count,
    jobs,
    positive_int,
    seed_int,
)
from faultlab.corpus.files import DEFAULT_CORPUS, check_corpus_directory
from faultlab.search import defaults

#: What ``mutants --output`` writes, and so the only file it replaces: the results begin
#: with ``passed`` and the budget's integer settings in the order :class:`Budget` lists them.
RESULTS = Kind("a faultlab mutants results file", (
    re.compile(rb'\s*\{\s*"passed"\s*:\s*(?:true|false)\s*,\s*"budget"\s*:\s*\{\s*'
               + rb'\s*,\s*'.join(rb'"%s"\s*:\s*-?\d+' % name for name in
                                  (b"examples", b"steps", b"seed", b"operations", b"crashes"))
               + rb'\s*,\s*"spawn"\s*:'),
))


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "mutants", help="run explore and enumerate against the reference and every mutant",
        description="Judge the reference and every mutant of the bug zoo with both search "
                    "strategies (explore with a fixed seed, enumerate with its defaults), in "
                    "parallel across cores, and print one table; below it, the seconds "
                    "until explore and enumerate caught a mutant (median, worst) and the "
                    "median examples until explore found the concurrency mutants (none when "
                    "one was missed). Exit 0 only when the "
                    "reference is clean and every mutant is caught by both; 1 otherwise; 2 on "
                    "bad input. Each shrunk finding is saved to the corpus once every system "
                    "is judged (an interrupted run saves nothing). The mutants that need "
                    "faultlab's own PostgreSQL server (async-commit-pg, shown by a server "
                    "crash; server-clock-lease-pg, whose lease runs on the server's clock) "
                    "are judged by explore alone on a private server of their own (as "
                    "--postgres private); on a machine that cannot start one the row says "
                    "why instead. The reference "
                    "and the mutants only a power cut shows (reference-power, "
                    "wal-normal-receiver, sync-off-caller, full-sync-caller) are judged by "
                    "explore --power-loss and enumerate --power-loss.",
        epilog=MUTANTS_EPILOG,
    )
    parser.add_argument("--only", action="append", metavar="NAME",
                        help="judge only this system (repeatable; reference or a mutant name)")
    parser.add_argument("--output", type=Path, metavar="FILE",
                        help="write the table and timings as JSON (an existing FILE is "
                             "replaced only if it is a faultlab mutants results file; "
                             "written atomically)")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, metavar="DIR",
                        help="where shrunk findings are saved (default corpus/)")
    parser.add_argument("--examples", type=positive_int, default=defaults.EXAMPLES, metavar="N",
                        help=f"explore: examples per system (default {defaults.EXAMPLES})")
    parser.add_argument("--steps", type=positive_int, default=defaults.STEPS, metavar="N",
                        help=f"explore: steps per example (default {defaults.STEPS})")
    parser.add_argument("--seed", type=seed_int, default=defaults.SEED, metavar="S",
                        help=f"explore: seed (default {defaults.SEED})")
    parser.add_argument("--operations", type=positive_int, default=defaults.OPERATIONS, metavar="N",
                        help=f"enumerate: operations per trace (default {defaults.OPERATIONS})")
    parser.add_argument("--crashes", type=count, default=defaults.CRASHES, metavar="C",
                        help=f"enumerate: crashes per trace (default {defaults.CRASHES})")
    parser.add_argument("--jobs", type=jobs, default=(os.cpu_count() or 1) + 1,
                        metavar="J",
                        help="systems judged at once (default: the number of cores plus one: "
                             "a concurrent judgement spends much of its time waiting for "
                             "lanes held or blocked on a lock, so one more job fills the "
                             "cores)")
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_mutants)


def cmd_mutants(args: argparse.Namespace) -> int:
    from faultlab.base.output import write_json
    from faultlab.report import tables as report
    from faultlab.system import (
        builtin_names,
        concurrency_mutant_names,
        power_mutant_names,
        server_crash_mutant_names,
    )
    from faultlab.trials.zoo import (
        REFERENCE_CONCURRENT,
        REFERENCE_POWER,
        Budget,
        Judgement,
        concurrency_examples,
        judge_all,
        save_findings,
        timing_summary,
    )

    check_format(args.format)
    check_corpus_directory(args.corpus)
    if args.output is not None:
        check_output_path(args.output, "--output", RESULTS)
    names = [*builtin_names(), REFERENCE_CONCURRENT, *concurrency_mutant_names(),
             *server_crash_mutant_names(), REFERENCE_POWER, *power_mutant_names()]
    if args.only:
        unknown = [name for name in args.only if name not in names]
        if unknown:
            raise UsageError(f"--only: unknown system {unknown[0]!r} (one of: {', '.join(names)})")
        names = [name for name in names if name in args.only]
    budget = Budget(examples=args.examples, steps=args.steps, seed=args.seed,
                    operations=args.operations, crashes=args.crashes, spawn=args.spawn,
                    deadline=args.deadline, corpus=str(args.corpus))
    started = time.monotonic()

    def progress(judgement: Judgement) -> None:
        state = "ok" if judgement.ok else "FAILED"
        print(f"mutants: {judgement.system} judged ({state}), "
              f"{time.monotonic() - started:.1f}s", file=sys.stderr, flush=True)

    judgements = judge_all(names, budget, jobs=min(args.jobs, len(names)), progress=progress)
    save_findings(judgements, args.corpus)  # every judge done: the run's commit point
    seconds = time.monotonic() - started
    rows = []
    for j in judgements:
        rows.append([
            j.system,
            j.defect if len(j.defect) <= 48 else j.defect[:45] + "...",
            _found(j.enumerate_found, j.enumerate_invariants) if j.enumerable else "n/a",
            "-" if j.unjudged is not None else _found(j.explore_found, j.explore_invariants),
            "+".join(j.caught_by) or "-",
            "-" if j.examples_until_found is None else j.examples_until_found,
            "-" if j.seconds_until_found is None else j.seconds_until_found,
            "-" if j.shrunk_steps is None else j.shrunk_steps,
            "-" if j.reference else j.minimal_steps,
            f"not judged: {j.unjudged}" if j.unjudged is not None
            else "ok" if j.ok and j.at_minimum else ("ok (longer)" if j.ok else "FAIL"),
        ])
    headers = ["system", "defect", "enumerate", "explore", "expected", "examples",
               "seconds", "shrunk", "minimum", "verdict"]
    print(report.table(rows, headers, args.format))
    timings = timing_summary(judgements)

    def spread(search: str) -> str:
        median, worst = timings[f"{search}_median_seconds"], timings[f"{search}_worst_seconds"]
        if median is None:
            return f"{search}: caught none"
        return f"{search}: median {median} s, worst {worst} s"

    print(f"\n{spread('explore')} to catch a mutant; {spread('enumerate')}; wall "
          f"{seconds:.1f} s with {plural(min(args.jobs, len(names)), 'job')}")
    lanes = concurrency_examples(judgements)
    if lanes["examples"]:
        def shown(value: float | None) -> str:
            return "- (one was missed)" if value is None else f"{value:g}"

        print(f"concurrency mutants: median {shown(lanes['median'])} examples until found "
              f"over {len(lanes['examples'])}"
              + (f" ({shown(lanes['sqlite_median'])} over the {lanes['sqlite']} on SQLite)"
                 if lanes["sqlite"] and lanes["sqlite"] != len(lanes["examples"]) else ""))
    passed = all(j.ok for j in judgements)
    unjudged = [j.system for j in judgements if j.unjudged is not None]
    mutants = [j for j in judgements if not j.reference and j.unjudged is None]
    caught = sum(j.ok for j in mutants)
    reference_clean = all(j.ok for j in judgements if j.reference)
    explore_only = sum(not j.enumerable for j in mutants)
    print(f"{'PASS' if passed else 'FAIL'}: {caught} of {len(mutants)} mutants caught by "
          f"both explore and enumerate"
          + (f" ({explore_only} by explore alone: data, depth and PostgreSQL mutants, which "
             f"enumerate cannot express)" if explore_only else "")
          + (f"; not judged here: {', '.join(unjudged)} (no private PostgreSQL server)"
             if unjudged else "")
          + ("" if not any(j.reference for j in judgements)
             else f"; reference {'clean' if reference_clean else 'NOT clean'}"))
    if args.output is not None:
        write_json(args.output, {  # "passed" and "budget" first: what RESULTS recognises
            "passed": passed,
            "budget": vars(budget),
            "seconds": round(seconds, 3),
            "timings": timings,
            "concurrency": lanes,
            "systems": [j.to_json() for j in judgements],
        }, kind=RESULTS)
    return EXIT_OK if passed else EXIT_FOUND


def _found(found: bool, invariants: list[str]) -> str:
    return ("yes " + "+".join(invariants)) if found else "no"
