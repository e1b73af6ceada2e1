"""``explore``: search for a violating trace with Hypothesis; shrink and save a finding.

One stream of rounds in this process, or ``--jobs`` streams in processes
(:mod:`faultlab.search.rounds`); a directory corpus or a Redis one
(:mod:`faultlab.corpus.redis_store`); the summary, coverage and finding tables. With
``--concurrency N`` (N >= 2) each round is a concurrent exploration and a finding
a version 2 trace; everything else (streams, jobs, shards, the time budget, the
corpus, the HTML page) is the same code.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from faultlab.base.errors import (
    EXIT_FLAKY,
    EXIT_FOUND,
    EXIT_OK,
    EXIT_VACUOUS,
    ExecutionError,
    UsageError,
)
from faultlab.cli.common import (
    MAX_JOBS,
    SEARCH_EPILOG,
    Commands,
    add_format,
    add_html,
    add_spawn,
    add_system,
    check_format,
    check_output_path,
    concurrency,
    jobs,
    load_system,
    positive_float,
    positive_int,
    refuse_unused_postgres,
    seed_int,
)
from faultlab.corpus.files import (
    DEFAULT_CORPUS,
    check_corpus_directory,
    flaky_directory,
    replay_command,
)
from faultlab.corpus.redis_store import RedisCorpus, is_redis_url
from faultlab.report.progress import Progress
from faultlab.search import defaults
from faultlab.search.coverage import Coverage, drawn_faults, vacuity
from faultlab.search.streams import Shard, parse_shard
from faultlab.system import is_builtin
from faultlab.system.contract import System
from faultlab.trace import Trace

if TYPE_CHECKING:
    from faultlab.run.observation import Execution
    from faultlab.search.rounds import Plan, StreamResult, Totals


class Deprecated(argparse.Action):
    """A hidden old spelling of an option: sets ``dest`` to ``const`` and says, in one line
    on stderr, which spelling replaces it."""

    def __init__(self, option_strings: list[str], dest: str, *, const: Any,
                 replacement: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, default=None,
                         help=argparse.SUPPRESS, **kwargs)
        self.replacement = replacement

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        setattr(namespace, self.dest, self.const)
        print(f"faultlab: note: {option_string} is deprecated; use {self.replacement}",
              file=sys.stderr)


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
                    "input, 3 when the run failed, 4 when the run tested nothing (a "
                    "vacuous run is not clean), 5 when a failure did not fail again when "
                    "re-run (a flaky run is not clean either).",
        epilog=SEARCH_EPILOG,
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
    parser.add_argument("--seed", type=seed_int, default=defaults.SEED, metavar="S",
                         help="random seed; the same seed gives the same run "
                              f"(default {defaults.SEED})")
    parser.add_argument("--corpus", default=str(DEFAULT_CORPUS), metavar="DIR|URL",
                        help="where a finding is saved: a directory (default corpus/; created "
                             "when needed) or redis://HOST:PORT/DB, a corpus shared by shards "
                             "(findings deduplicated by content, live counters per shard). "
                             "A saved finding is a regression test: replay fails while it "
                             "reproduces and passes once the bug is fixed; one on a built-in "
                             "mutant or with --no-deduplication is a finding on purpose and "
                             "says so (\"expect\": \"finding\"), so replay passes while it "
                             "reproduces. Once saved, a finding is exit 1 even if the --html "
                             "page cannot be written (a line on stderr says so)")
    parser.add_argument("--duration", type=positive_float, metavar="SECONDS",
                        help="explore until this time budget is spent, in rounds of --examples "
                             "examples with seeds derived from --seed (the step in flight "
                             "finishes; the unfinished example is not counted; a failure "
                             "found before the end is still replayed, shrunk and reported)")
    parser.add_argument("--jobs", type=jobs, default=1, metavar="N",
                        help="N explorations in parallel, each a process with its own fork "
                             "server and its own seed stream; without --duration they share "
                             "--examples; the first finding stops the others (default 1, "
                             f"at most {MAX_JOBS})")
    parser.add_argument("--no-pin", dest="pin", action="store_false",
                        help="with --jobs: let the OS move jobs between CPUs (default: when "
                             "there is a CPU for every job, job K and every process it "
                             "starts run on the K-th CPU, which measured 9-22%% more "
                             "steps/s with 2 jobs on 2 cores; concurrent explorations are "
                             "never pinned)")
    parser.add_argument("--shard", type=_shard, default=Shard(), metavar="K/N",
                        help="this run is shard K of N (K from 0, e.g. a Kubernetes completion "
                             "index): its seed streams are disjoint from the other shards' and "
                             "the same on every rerun (default 0/1)")
    parser.add_argument("--no-statement-crashes", action=Deprecated, dest="statement_points",
                        const=False, replacement="--no-statement-points")
    parser.add_argument("--hypothesis-shrink", action="store_true",
                         help="also run Hypothesis's shrinker before faultlab's trace "
                              "minimiser (slower: every candidate is real processes; it also "
                              "simplifies payloads)")
    parser.add_argument("--concurrency", type=concurrency, default=1, metavar="N",
                        help="workers that may be alive at once (default 1: sequential "
                             "traces). With N >= 2 each step is a "
                             "scheduling choice over N lanes (start a worker held at its "
                             "first point, release, finish, kill, pause, resume, tick the "
                             "virtual clock); each example opens with a drawn scenario "
                             "(a lease that lapses under its holder, a relay overtaken on its "
                             "key, a delivery retried in flight, an acceptance committed after a "
                             "later one, or none) before its --steps drawn steps; findings are "
                             "version 2 traces")
    parser.add_argument("--scheduler", choices=defaults.SCHEDULERS, default=None,
                        help="with --concurrency: which held lane a release or finish "
                             "moves: uniform (any), pct (probabilistic concurrency testing: "
                             "random lane priorities, the highest-priority held lane moves, and "
                             "at a few drawn change points it drops below the others) or swarm "
                             "(each example one of the two); traces record the steps, so replay "
                             "does not depend on it "
                             f"(default {defaults.SCHEDULER})")
    parser.add_argument("--statement-points", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="statement points: before each SQL statement (sql:K) and after "
                             "each COMMIT (commit:K) a worker runs, for systems whose workers "
                             "are faultlab's own (Python systems: asking for them on another is "
                             "refused). "
                             "Sequential traces crash workers there as at named points "
                             "(default on where the system supports them). With "
                             "--concurrency, workers also hold there, so a release, kill or "
                             "pause can land between any two statements, recorded in the trace "
                             "so replay holds them too (default off: every statement is one "
                             "more scheduling choice, so traces reach the same place in many "
                             "more steps and the search runs slower). The old spelling "
                             "--no-statement-crashes still works, with a note")
    parser.add_argument("--power-loss", action="store_true",
                        help="also cut the machine's power between steps: the stores are "
                             "recorded through faultlab's SQLite VFS and rebuilt as a power "
                             "cut could leave them (with --concurrency every live lane dies "
                             "at the cut; a command-line system's program records only if it "
                             "calls faultlab.record_power_loss(), and a run whose writes were "
                             "not recorded ends with exit 3). SQLite stores only: a system on "
                             "PostgreSQL is refused (its server's crash is the server_crash "
                             "step, with --postgres private)")
    parser.add_argument("--quiet", action="store_true", help="no progress on stderr")
    add_html(parser, "for a finding, write its replay as one self-contained HTML page (a "
                     "timeline with a lane per process, both stores after each step); nothing "
                     "is written when the run is clean")
    add_spawn(parser)
    add_format(parser)
    parser.set_defaults(handler=cmd_explore)


class Sink:
    """Where findings go and where live counters are published (a Redis corpus only).

    A Redis server that goes away in the middle of the run does not raise where the
    counters are published (inside an example, Hypothesis would take that for a failing
    one and shrink it): :attr:`lost` keeps what the error says, the run is asked to stop
    (:meth:`stop`), and :meth:`check` raises it once the run has ended, as one line. Only
    the words are kept: the error's traceback holds the frames of the run (with
    ``--jobs``, its queue and semaphores), which must be gone before faultlab exits."""

    def __init__(self, target: str, shard: str, system: System, seed: int) -> None:
        self.target = target
        self.shard = shard
        self.redis: RedisCorpus | None = None
        self.fields: dict[str, Any] = {"system": system.ref, "seed": seed, "state": "running",
                                       "findings": 0}
        self.counts: dict[str, Any] = {}
        self.lost: str | None = None
        #: Whether this run's counters reached the corpus (its shard's entry is its own).
        self.published = False
        self._last = 0.0
        if is_redis_url(target):
            self.redis = RedisCorpus(target, create=True)
        else:
            check_corpus_directory(Path(target))

    def publish(self, totals: Totals, seconds: float, *, force: bool = False,
                **fields: Any) -> None:
        self.fields.update(fields)
        self.counts = {"examples": totals.examples, "steps": totals.steps,
                       "sigkills": totals.sigkills, "seconds": round(seconds, 1)}
        now = time.monotonic()
        if self.redis is None or self.lost is not None or (not force and now - self._last < 1.0):
            return
        self._last = now
        try:
            self.redis.update_counters(self.shard, {**self.fields, **self.counts})
            self.published = True
        except ExecutionError as error:
            self.lost = str(error)
            if force:  # the run has ended: nothing left to stop
                raise

    def stop(self) -> bool:
        """Whether the run should stop: the Redis corpus went away."""
        return self.lost is not None

    def check(self) -> None:
        if self.lost is not None:
            raise ExecutionError(self.lost)

    def ended_by(self, error: BaseException) -> None:
        """The run ended in ``error``: its shard says so (``failed``, or ``interrupted``)
        instead of ``running``, when the server still answers; otherwise the ``running``
        entry's short expiry ends it. A run refused before it published is left out."""
        if self.redis is None or self.lost is not None:
            return
        if isinstance(error, UsageError) and not self.published:
            return  # refused before its first counters: bad input creates nothing, and
            # an earlier run's entry for the shard stays as it was
        state = "interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
        try:
            self.redis.update_counters(self.shard, {**self.fields, **self.counts,
                                                    "state": state})
        except ExecutionError:
            pass  # the error being raised is the one to report

    def save(self, trace: Trace, system: System) -> str:
        from faultlab.corpus import files as corpus

        if self.redis is None:
            return str(corpus.save(trace, Path(self.target), system.name))
        name = corpus.finding_name(trace, system.name)
        where, new = self.redis.save(corpus.marked(trace).to_json(), name)
        return where + ("" if new else " (already there: another shard found the same trace)")

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()


def _progress_line(totals: Totals, seconds: float, jobs: int, concurrency: int = 1) -> str:
    seconds = max(seconds, 1e-9)
    prefix = f"explore ({jobs} jobs)" if jobs > 1 else "explore"
    steps = "concurrent steps" if concurrency > 1 else "steps"
    return (f"{prefix}: {totals.examples} examples, {totals.steps} {steps}, "
            f"{totals.sigkills} SIGKILLs, {totals.steps / seconds:.0f} steps/s")


def cmd_explore(args: argparse.Namespace) -> int:
    from faultlab.process.spawn import spawner
    from faultlab.report import tables as report
    from faultlab.run.faults import check_power_cut
    from faultlab.search.explore import HYPOTHESIS_VERSION
    from faultlab.search.rounds import Plan, Totals, run_jobs, run_stream
    from faultlab.search.shrink import length

    check_format(args.format)
    concurrent = args.concurrency > 1
    if concurrent and args.hypothesis_shrink:
        raise UsageError("--hypothesis-shrink does not apply with --concurrency above 1")
    if args.scheduler is not None and not concurrent:
        raise UsageError("--scheduler applies with --concurrency above 1")
    if args.html is not None:
        from faultlab.report import html as html_report

        check_output_path(args.html, "--html", html_report.PAGE)
    system = load_system(args.system, args.deduplication)
    refuse_unused_postgres(system, args.postgres)
    if args.power_loss:
        check_power_cut(system, "--power-loss")
    if args.statement_points:
        system.require_statement_points(f"--statement-points: {system.name}")
    # one option, a default per mode: sequential crashes at statements where the system can;
    # lanes hold there only when asked (see --help)
    statement_points = (not concurrent) if args.statement_points is None \
        else args.statement_points
    plan = Plan(
        system=system.ref, deduplication=args.deduplication, seed=args.seed,
        examples=args.examples, steps=args.steps,
        statement_points=statement_points and system.supports_statement_points,
        hypothesis_shrink=args.hypothesis_shrink, spawn=args.spawn, deadline=args.deadline,
        duration=args.duration, jobs=args.jobs, shard=args.shard,
        concurrency=args.concurrency,
        scheduler=args.scheduler or defaults.SCHEDULER,
        pin=args.pin,
        power_loss=args.power_loss,
    )
    sink = Sink(args.corpus, str(args.shard), system, args.seed)
    started = time.monotonic()
    shown = Progress(examples=plan.examples * max(plan.jobs, 1), duration=plan.duration,
                     label="explore", quiet=args.quiet)

    def progress(totals: Totals, seconds: float) -> None:
        sink.publish(totals, seconds)
        shown.update(examples=totals.examples, seconds=seconds,
                     line=_progress_line(totals, seconds, plan.jobs, plan.concurrency),
                     postfix=f"{totals.steps} steps, {totals.sigkills} SIGKILLs, "
                             f"{totals.steps / max(seconds, 1e-9):.0f} steps/s")

    def announce_failure() -> None:
        """Shrinking takes a while (every candidate is real processes): say it has begun."""
        shown.write("explore: an invariant failed; shrinking the trace")

    try:
        with spawner(args.spawn) as runner:
            replay = None
            if plan.jobs == 1:
                result, found = run_stream(
                    system, runner, plan, 0, stop=sink.stop,
                    progress=lambda t: progress(t, time.monotonic() - started),
                    on_failure=None if args.quiet else announce_failure)
                results = [result]
                replay = found.replay if found is not None else None
            else:
                results = run_jobs(plan, progress=progress, stop=sink.stop)
            seconds = time.monotonic() - started
            finders = sorted((r for r in results if r.trace is not None),
                             key=lambda r: r.seconds_until_found or 0.0)
            trace = Trace.from_json(finders[0].trace) if finders else None
            flakies = [r for r in results if r.flaky is not None]
            if trace is not None and replay is None:  # found in a job process: run it here
                from faultlab.corpus import replay as replaying

                replay = replaying.replay(replaying.plan(Path("finding"), trace, system),
                                          runner, deadline=args.deadline).execution
        shown.close()
        sink.check()  # the Redis corpus went away: one line, exit 3, whatever was found
        totals = Totals()
        for r in results:
            for key, value in vars(r.totals).items():
                setattr(totals, key, getattr(totals, key) + value)
        # a run that tested nothing is not "done" on the shard's counters either
        vacuous = None if finders or flakies else _vacuity(results, system, plan, totals)
        sink.publish(totals, seconds, force=True,
                     state="found" if finders else "flaky" if flakies else
                     "vacuous" if vacuous is not None else "done",
                     findings=len(finders))
        print(report.table(_summary_rows(system, args, plan, totals, results, seconds,
                                         HYPOTHESIS_VERSION), ["explore", "value"], args.format))
        print()
        _print_coverage(results, system, plan, args.format)
        for r in results:
            for note in r.notes:
                print(f"note: {note}")
        kept = _keep_flaky(flakies, args.corpus, system)
        if trace is None and kept:
            # an invariant failed but did not fail again: not clean, and not a finding
            print(f"\nflaky: {kept[0]}")
            for line in kept[1:]:
                print(f"another job's failure was flaky too: {line}")
            return EXIT_FLAKY
        if trace is None:
            if vacuous is not None:
                print(f"\nvacuous: nothing failed in {totals.examples} examples, but nothing "
                      f"was tested: {vacuous}")
                return EXIT_VACUOUS
            print(f"\nclean: no invariant failed in {totals.examples} examples")
            return EXIT_OK
        saved = [sink.save(Trace.from_json(r.trace), system) for r in finders]
        verdict = trace.expected.describe() if trace.expected else "?"
        unit = "scheduling steps" if concurrent else "executed steps"
        shrunk = None if replay is None else length(replay)
        print(f"\nFOUND: {verdict}, shrunk to {shrunk} {unit}; saved {saved[0]}")
        for extra in saved[1:]:
            print(f"another job found one too; saved {extra}")
        for line in kept:
            print(f"another job's failure was flaky: {line}")
        if replay is not None:
            for line in _finding_table(replay, args.format):
                print(line)
        if args.html is not None and replay is not None:
            from faultlab.base.errors import ExecutionError
            from faultlab.base.messages import printable
            from faultlab.corpus.files import finding_name
            from faultlab.report import html as html_report

            try:
                html_report.write(args.html, [html_report.TraceReport(
                    title=f"explore finding: {finding_name(trace, system.name)}",
                    execution=replay, system=system.ref, deduplication=args.deduplication,
                    verdict=replay.verdict.describe(), expected=verdict,
                )])
            except ExecutionError as error:
                # the finding is saved (the run's commit point) and printed: it stays a
                # finding (exit 1); the page that could not be written is said on stderr
                print(f"faultlab: the finding is saved, but the --html page was not "
                      f"written: {printable(str(error))}", file=sys.stderr)
            else:
                print(f"wrote {args.html}")
        named = "" if is_builtin(system.ref) else f" --system {system.ref}"
        if sink.redis is None:
            print(f"replay with: {replay_command(saved[0], system.ref)}")
        else:
            print(f"replay with: python -m faultlab corpus export {args.corpus} DIR, then "
                  f"python -m faultlab replay DIR/...{named}")
        return EXIT_FOUND
    except BaseException as error:
        shown.close()
        sink.ended_by(error)  # not left "running": the shard's run ended in an error
        raise
    finally:
        shown.close()
        sink.close()


def _keep_flaky(flakies: list[StreamResult], corpus: str, system: System) -> list[str]:
    """Keep each flaky stream's trace beside the corpus, never in it
    (:func:`faultlab.corpus.files.flaky_directory`); what each one's line says."""
    from faultlab.corpus import files

    lines = []
    for r in flakies:
        if r.flaky is None:  # pragma: no cover - only flaky streams are passed
            continue
        path = files.save(Trace.from_json(r.flaky), flaky_directory(corpus), system.name)
        lines.append(f"{r.flaky_reason}; trace kept at {path}")
    return lines


def _finding_table(replay: Execution, fmt: str) -> list[str]:
    """The finding's replay as ``replay`` prints it: a row per step (a column per lane)."""
    from faultlab.report import tables as report

    return [report.replay_table(replay, fmt), *report.violation_lines(replay),
            *report.worker_error_lines(replay)]


def _coverage(results: list[StreamResult]) -> Coverage:
    """Every job's coverage, summed."""
    coverage = Coverage()
    for r in results:
        coverage.merge(Coverage(Counter(r.armed), Counter(r.fired), Counter(r.checked)))
    return coverage


def _print_coverage(results: list[StreamResult], system: System, plan: Plan,
                    fmt: str) -> None:
    """Crash points armed and fired, invariants checked non-vacuously, in steps (the
    history invariants that read claims too when the run had lanes)."""
    from faultlab.report import tables as report

    report.print_coverage(_coverage(results), system, fmt,
                          faults=drawn_faults(plan.power_loss),
                          lanes=plan.concurrency > 1)


def _vacuity(results: list[StreamResult], system: System, plan: Plan,
             totals: Totals) -> str | None:
    """Why a run that found nothing tested nothing either (see
    :mod:`faultlab.search.coverage`), over every job's coverage; None when it tested."""
    return vacuity(_coverage(results), system, totals.examples, concurrency=plan.concurrency,
                   held=totals.held, can_hold=system.holds_in_lanes(),
                   faults=drawn_faults(plan.power_loss))


def _cpus(results: list[StreamResult]) -> str:
    """Where each job's processes could run, as its fork server reported it."""
    def one(cpus: list[int] | None) -> str:
        return "?" if cpus is None else ",".join(map(str, cpus))

    return "; ".join(f"job {r.job}: {one(r.cpus)}" for r in results)


def system_label(system: System) -> str:
    """The system as a summary names it: its name, then the reference it was loaded from when
    that is another string (``standalone-outbox (my_outbox/system.json)``), since a path or
    ``package.module:attribute`` says where the system is, not which one it is."""
    return system.name if system.ref == system.name else f"{system.name} ({system.ref})"


def _summary_rows(system: System, args: argparse.Namespace, plan: Plan, totals: Totals,
                  results: list[StreamResult], seconds: float,
                  hypothesis: str) -> list[list[Any]]:
    rows: list[list[Any]] = [
        ["system", f"{system_label(system)}{'' if args.deduplication else ' (deduplication off)'}"],
    ]
    if plan.concurrency > 1:
        rows.append(["concurrency", plan.concurrency])
        if plan.statement_points:
            rows.append(["statement points", "sql:K, commit:K held"])
    rows += [
        ["seed", args.seed],
        ["Hypothesis", hypothesis],
    ]
    if plan.jobs > 1 or plan.shard.count > 1 or plan.duration is not None:
        rows += [["jobs", plan.jobs], ["shard", str(plan.shard)], ["rounds", totals.rounds]]
    if plan.jobs > 1:
        rows.append(["CPUs", _cpus(results)])
    if plan.duration is not None:
        rows.append(["time budget (s)", plan.duration])
    rows += [
        ["examples", totals.examples],
        ["concurrent steps" if plan.concurrency > 1 else "steps", totals.steps],
        ["processes", totals.processes],
        ["SIGKILLs", totals.sigkills],
        ["invariant checks", totals.checks],
        # failures that did not fail again when re-run (each ends its stream)
        ["flaky", sum(r.flaky is not None for r in results)],
    ]
    if plan.concurrency == 1:
        from faultlab.search.explore import share_at_least

        rows += [
            ["examples with 3+ operations (%)", share_at_least(totals.operations, 3)],
            ["examples with a direct delivery (%)", share_at_least(totals.deliveries, 1)],
        ]
    if plan.concurrency > 1:
        rows.append(["lane-steps blocked on a lock", totals.blocked])
    actions: Counter[str] = Counter()
    for r in results:
        actions.update(r.actions)
    rows += [[f"step {name}", count] for name, count in sorted(actions.items())]
    rows += [
        ["wall time (s)", round(seconds, 3)],
        ["steps/s", round(totals.steps / seconds, 1) if seconds else 0.0],
    ]
    return rows
