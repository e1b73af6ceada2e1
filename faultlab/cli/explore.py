"""``explore``: search for a violating trace with Hypothesis; shrink and save a finding."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from faultlab import defaults
from faultlab.cli.common import (
    Commands,
    add_format,
    add_html,
    add_spawn,
    add_system,
    check_format,
    check_output_path,
    load_system,
    positive_int,
)
from faultlab.corpus import DEFAULT_CORPUS, check_corpus_directory
from faultlab.errors import EXIT_FOUND, EXIT_OK
from faultlab.machine import Recorder


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "explore", help="search for a crash that breaks an invariant (Hypothesis state machine)",
        description="Generate sequences of real steps (accept, dispatch, crash at a point, "
                    "recover, resubmit, call the service) with Hypothesis, each step a real "
                    "process on fresh SQLite stores, checking every invariant after every step. "
                    "A failure is shrunk to its shortest trace, saved to the corpus and printed "
                    "as a table. Exit 0 when nothing was found, 1 when something was, 2 on bad "
                    "input.",
    )
    add_system(parser)
    parser.add_argument("--examples", type=positive_int, default=defaults.EXAMPLES, metavar="N",
                         help="examples (traces) Hypothesis must complete (default "
                              f"{defaults.EXAMPLES}); ones it "
                              "abandons partway, when it cannot draw a rule, run on top, so the "
                              "summary can count a few more")
    parser.add_argument("--steps", type=positive_int, default=defaults.STEPS, metavar="N",
                         help="steps per example, before the final recovery "
                              f"(default {defaults.STEPS})")
    parser.add_argument("--seed", type=int, default=defaults.SEED, metavar="S",
                         help="random seed; the same seed gives the same run "
                              f"(default {defaults.SEED})")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, metavar="DIR",
                         help="where a finding is saved (default corpus/; created when needed)")
    parser.add_argument("--no-statement-crashes", dest="statement_crashes",
                         action="store_false",
                         help="draw only the system's named crash points, not sql:K/commit:K")
    parser.add_argument("--hypothesis-shrink", action="store_true",
                         help="also run Hypothesis's shrinker before faultlab's trace "
                              "minimiser (slower: every candidate is real processes; it also "
                              "simplifies payloads)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_html(parser, "for a finding, write its replay as one self-contained HTML page (a "
                     "timeline with a lane per process, both stores after each step); nothing "
                     "is written when the run is clean")
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_explore)


def _progress(recorder: Recorder) -> None:
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
    if args.html is not None:
        check_output_path(args.html, "--html")
    system = load_system(args.system, args.deduplication)
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
    if args.html is not None and result.replay is not None:
        from faultlab import html_report

        html_report.write(args.html, [html_report.TraceReport(
            title=f"explore finding: {path.name}", execution=result.replay,
            system=system.ref, deduplication=args.deduplication,
            verdict=result.replay.verdict.describe(), expected=verdict,
        )])
        print(f"wrote {args.html}")
    print(f"replay with: python -m faultlab replay {path}")
    return EXIT_FOUND
