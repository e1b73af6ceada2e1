"""``explore``: search for a violating trace with Hypothesis; shrink and save a finding.

One stream of rounds in this process, or ``--jobs`` streams in processes
(:mod:`faultlab.search`); a directory corpus or a Redis one
(:mod:`faultlab.redis_corpus`); the summary, coverage and finding tables.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from faultlab import defaults
from faultlab.cli.common import (
    Commands,
    add_format,
    add_html,
    add_spawn,
    add_system,
    check_format,
    check_output_path,
    concurrency,
    load_system,
    positive_float,
    positive_int,
)
from faultlab.corpus import DEFAULT_CORPUS, check_corpus_directory
from faultlab.coverage import Coverage
from faultlab.errors import EXIT_FOUND, EXIT_OK, UsageError
from faultlab.redis_corpus import RedisCorpus, is_redis_url
from faultlab.search import Plan, StreamResult, Totals, run_jobs, run_stream
from faultlab.streams import Shard, parse_shard
from faultlab.system.contract import System
from faultlab.trace import Trace


def _shard(text: str) -> Shard:
    try:
        return parse_shard(text)
    except UsageError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), metavar="DIR|URL",
                        help="where a finding is saved: a directory (default corpus/; created "
                             "when needed) or redis://HOST:PORT/DB, a corpus shared by shards "
                             "(findings deduplicated by content, live counters per shard)")
    parser.add_argument("--duration", type=positive_float, metavar="SECONDS",
                        help="explore until this time budget is spent, in rounds of --examples "
                             "examples with seeds derived from --seed (the step in flight "
                             "finishes; the unfinished example is not counted)")
    parser.add_argument("--jobs", type=positive_int, default=1, metavar="N",
                        help="N explorations in parallel, each a process with its own fork "
                             "server and its own seed stream; without --duration they share "
                             "--examples; the first finding stops the others (default 1)")
    parser.add_argument("--shard", type=_shard, default=Shard(), metavar="K/N",
                        help="this run is shard K of N (K from 0, e.g. a Kubernetes completion "
                             "index): its seed streams are disjoint from the other shards' and "
                             "the same on every rerun (default 0/1)")
    parser.add_argument("--no-statement-crashes", dest="statement_crashes",
                         action="store_false",
                         help="draw only the system's named crash points, not sql:K/commit:K")
    parser.add_argument("--hypothesis-shrink", action="store_true",
                         help="also run Hypothesis's shrinker before faultlab's trace "
                              "minimiser (slower: every candidate is real processes; it also "
                              "simplifies payloads)")
    parser.add_argument("--concurrency", type=concurrency, default=1, metavar="N",
                        help="workers that may be alive at once (default 1: sequential "
                             "traces, exactly as before). With N >= 2 each step is a "
                             "scheduling choice over N lanes (start a worker held at its "
                             "first point, release, finish, kill, pause, resume, tick the "
                             "virtual clock); findings are version 2 traces")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_html(parser, "for a finding, write its replay as one self-contained HTML page (a "
                     "timeline with a lane per process, both stores after each step); nothing "
                     "is written when the run is clean")
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_explore)


class Sink:
    """Where findings go and where live counters are published (a Redis corpus only)."""

    def __init__(self, target: str, shard: str, system: System, seed: int) -> None:
        self.target = target
        self.shard = shard
        self.redis: RedisCorpus | None = None
        self.fields: dict[str, Any] = {"system": system.ref, "seed": seed, "state": "running",
                                       "findings": 0}
        self._last = 0.0
        if is_redis_url(target):
            self.redis = RedisCorpus(target, create=True)
        else:
            check_corpus_directory(Path(target))

    def publish(self, totals: Totals, seconds: float, *, force: bool = False,
                **fields: Any) -> None:
        self.fields.update(fields)
        now = time.monotonic()
        if self.redis is None or (not force and now - self._last < 1.0):
            return
        self._last = now
        self.redis.update_counters(self.shard, {
            **self.fields, "examples": totals.examples, "steps": totals.steps,
            "sigkills": totals.sigkills, "seconds": round(seconds, 1),
        })

    def save(self, trace: Trace, system: System) -> str:
        from faultlab import corpus

        if self.redis is None:
            return str(corpus.save(trace, Path(self.target), system.name))
        name = corpus.finding_name(trace, system.name)
        where, new = self.redis.save(trace.to_json(), name)
        return where + ("" if new else " (already there: another shard found the same trace)")

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()


def _progress_line(totals: Totals, seconds: float, jobs: int) -> None:
    seconds = max(seconds, 1e-9)
    prefix = f"explore ({jobs} jobs)" if jobs > 1 else "explore"
    print(f"{prefix}: {totals.examples} examples, {totals.steps} steps, "
          f"{totals.sigkills} SIGKILLs, {totals.steps / seconds:.0f} steps/s",
          file=sys.stderr, flush=True)


def _announce_failure() -> None:
    """Shrinking takes a while (every candidate is real processes): say it has begun."""
    sys.stderr.write("explore: an invariant failed; shrinking the trace\n")  # one write: a
    sys.stderr.flush()  # signal right after it must not leave the line unfinished


def cmd_explore(args: argparse.Namespace) -> int:
    if args.concurrency > 1:
        from faultlab.cli.concurrent import cmd_explore_concurrent

        return cmd_explore_concurrent(args)
    from faultlab import report
    from faultlab.executor import execute
    from faultlab.explore import HYPOTHESIS_VERSION
    from faultlab.process import spawner

    check_format(args.format)
    if args.html is not None:
        check_output_path(args.html, "--html")
    system = load_system(args.system, args.deduplication)
    plan = Plan(
        system=system.ref, deduplication=args.deduplication, seed=args.seed,
        examples=args.examples, steps=args.steps, statement_crashes=args.statement_crashes,
        hypothesis_shrink=args.hypothesis_shrink, spawn=args.spawn, deadline=args.deadline,
        duration=args.duration, jobs=args.jobs, shard=args.shard,
    )
    sink = Sink(args.corpus, str(args.shard), system, args.seed)
    started = time.monotonic()
    last_line = [0.0]

    def progress(totals: Totals, seconds: float) -> None:
        sink.publish(totals, seconds)
        now = time.monotonic()
        if not args.quiet and now - last_line[0] >= 1.0:
            last_line[0] = now
            _progress_line(totals, seconds, plan.jobs)

    try:
        with spawner(args.spawn) as runner:
            replay = None
            if plan.jobs == 1:
                result, found = run_stream(
                    system, runner, plan, 0,
                    progress=lambda t: progress(t, time.monotonic() - started),
                    on_failure=None if args.quiet else _announce_failure)
                results = [result]
                replay = found.replay if found is not None else None
            else:
                results = run_jobs(plan, progress=progress)
            seconds = time.monotonic() - started
            finders = sorted((r for r in results if r.trace is not None),
                             key=lambda r: r.seconds_until_found or 0.0)
            trace = Trace.from_json(finders[0].trace) if finders else None
            if trace is not None and replay is None:
                replay = execute(system, trace.steps, runner, deduplication=trace.deduplication,
                                 settle=trace.settle, deadline=args.deadline)
        totals = Totals()
        for r in results:
            for key, value in vars(r.totals).items():
                setattr(totals, key, getattr(totals, key) + value)
        sink.publish(totals, seconds, force=True, state="found" if finders else "done",
                     findings=len(finders))
        coverage = _coverage(results)
        print(report.table(_summary_rows(system, args, plan, totals, seconds,
                                         HYPOTHESIS_VERSION), ["explore", "value"], args.format))
        print()
        report.print_coverage(coverage, system, args.format)
        for r in results:
            for note in r.notes:
                print(f"note: {note}")
        if trace is None:
            print(f"\nclean: no invariant failed in {totals.examples} examples")
            return EXIT_OK
        saved = [sink.save(Trace.from_json(r.trace), system) for r in finders]
        verdict = trace.expected.describe() if trace.expected else "?"
        shrunk = None if replay is None else _executed(replay)
        print(f"\nFOUND: {verdict}, shrunk to {shrunk} executed steps; saved {saved[0]}")
        for extra in saved[1:]:
            print(f"another job found one too; saved {extra}")
        if replay is not None:
            print(report.execution_table(replay, args.format))
            for line in report.violation_lines(replay):
                print(line)
        if args.html is not None and replay is not None:
            from faultlab import html_report
            from faultlab.corpus import finding_name

            html_report.write(args.html, [html_report.TraceReport(
                title=f"explore finding: {finding_name(trace, system.name)}", execution=replay,
                system=system.ref, deduplication=args.deduplication,
                verdict=replay.verdict.describe(), expected=verdict,
            )])
            print(f"wrote {args.html}")
        if sink.redis is None:
            print(f"replay with: python -m faultlab replay {saved[0]}")
        else:
            print(f"replay with: python -m faultlab corpus export {args.corpus} DIR, then "
                  "python -m faultlab replay DIR/...")
        return EXIT_FOUND
    finally:
        sink.close()


def _executed(replay: Any) -> int:
    return len(replay.executed_prefix())


def _coverage(results: list[StreamResult]) -> Coverage:
    coverage = Coverage()
    for r in results:
        coverage.merge(Coverage(Counter(r.armed), Counter(r.fired), Counter(r.checked)))
    return coverage


def _summary_rows(system: System, args: argparse.Namespace, plan: Plan, totals: Totals,
                  seconds: float, hypothesis: str) -> list[list[Any]]:
    rows: list[list[Any]] = [
        ["system", f"{system.ref}{'' if args.deduplication else ' (deduplication off)'}"],
        ["seed", args.seed],
        ["Hypothesis", hypothesis],
    ]
    if plan.jobs > 1 or plan.shard.count > 1 or plan.duration is not None:
        rows += [["jobs", plan.jobs], ["shard", str(plan.shard)], ["rounds", totals.rounds]]
    if plan.duration is not None:
        rows.append(["time budget (s)", plan.duration])
    rows += [
        ["examples", totals.examples],
        ["steps", totals.steps],
        ["processes", totals.processes],
        ["SIGKILLs", totals.sigkills],
        ["invariant checks", totals.checks],
        ["wall time (s)", round(seconds, 3)],
        ["steps/s", round(totals.steps / seconds, 1) if seconds else 0.0],
    ]
    return rows
