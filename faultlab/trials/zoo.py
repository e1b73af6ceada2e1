"""The bug zoo on trial: is every mutant caught, by both search strategies, and how fast?

Each system (the reference and every mutant) is judged in its own process, so the
zoo spreads across cores; within it, exploration (Hypothesis, fixed seed) and
enumeration (bounded exhaustive) run one after the other with their defaults.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import statistics
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any

from faultlab.base import interrupt
from faultlab.base.errors import ExecutionError, UsageError
from faultlab.process.records import DEFAULT_DEADLINE, SpawnMode


@dataclass
class Judgement:
    """One system's row in the zoo table."""

    system: str
    defect: str
    reference: bool
    caught_by: list[str]
    minimal_steps: int | None
    enumerate_found: bool
    enumerate_invariants: list[str]
    enumerate_seconds: float
    enumerate_traces: int
    explore_found: bool
    explore_invariants: list[str]
    examples_until_found: int | None
    seconds_until_found: float | None
    shrunk_steps: int | None
    explore_seconds: float
    explore_steps: int
    #: Where the shrunk finding was saved: set by :func:`save_findings` once the whole run
    #: has ended (a judge saves nothing itself: an interrupted run saves nothing).
    corpus_file: str | None
    #: False for data and depth mutants, which enumerate's defaults cannot express.
    enumerable: bool = True
    #: Why the system was not judged at all (a server-crash mutant on a machine that cannot
    #: start faultlab's own PostgreSQL server); None when it was.
    unjudged: str | None = None
    #: The lanes the system was explored with (2 for a concurrency mutant).
    lanes: int = 1
    #: The shrunk finding's trace document, until :func:`save_findings` saves it.
    finding: dict[str, Any] | None = field(default=None, repr=False)

    @property
    def ok(self) -> bool:
        if self.unjudged is not None:
            return True  # nothing was tried, so nothing failed: the table says why
        if self.reference:
            return not self.enumerate_found and not self.explore_found
        return (self.enumerate_found or not self.enumerable) and self.explore_found

    @property
    def at_minimum(self) -> bool:
        return self.reference or self.unjudged is not None \
            or self.shrunk_steps == self.minimal_steps

    def to_json(self) -> dict[str, Any]:
        row = {**asdict(self), "ok": self.ok, "at_minimum": self.at_minimum}
        del row["finding"]  # saved to the corpus, named by corpus_file
        return row


@dataclass(frozen=True)
class Budget:
    examples: int
    steps: int
    seed: int
    operations: int
    crashes: int
    spawn: SpawnMode
    deadline: float = DEFAULT_DEADLINE
    corpus: str | None = None


#: The row in ``mutants`` for the reference explored with power cuts (it must stay clean).
REFERENCE_POWER = "reference-power"
#: The row in ``mutants`` for the reference judged with two lanes (it must stay clean).
REFERENCE_CONCURRENT = "reference-concurrent"
#: The references' rows: what each is judged under besides the plain sequential row.
_REFERENCES = {"reference": "", REFERENCE_CONCURRENT: "two dispatchers at once",
               REFERENCE_POWER: "with power cuts"}


#: Whether this pool process is judging a system now (see :func:`_pool_process`).
_judging = False


def _pool_process() -> None:
    """A pool process's signals: while it judges, SIGINT and SIGTERM raise
    :class:`~faultlab.base.interrupt.Interrupted` (its workers and stores are cleaned up);
    while it waits for work, they end it quietly (an exit status, not a traceback of the
    pool's queue when the command stops its judges after one failed)."""
    interrupt.install()

    def handler(signum: int, frame: FrameType | None) -> None:
        if _judging:
            interrupt.handler(signum, frame)
        else:
            raise SystemExit(128 + signum)

    for signum in interrupt.SIGNALS:
        signal.signal(signum, handler)
    interrupt.release_held()  # one that arrived while this interpreter started: now


def judge(name: str, budget: Budget) -> Judgement:
    """Explore and enumerate one system (runs in a worker process of the pool) the way
    the registry says its defect shows: with the lanes it needs, with power cuts, or on a
    private PostgreSQL server (whose whole-server crashes or moved clock the trace draws)."""
    global _judging
    _judging = True
    try:
        interrupt.check()  # a signal that came while it waited ended it already
        return _judged(name, budget)
    finally:
        _judging = False


def _judged(name: str, budget: Budget) -> Judgement:
    from faultlab.system.builtin import registry

    if name in _REFERENCES:
        cls = registry.BY_NAME["reference"]
        lanes = 2 if name == REFERENCE_CONCURRENT else 1
        power_loss = name == REFERENCE_POWER
    else:
        cls = registry.BY_NAME[name]
        lanes = registry.concurrency(cls)
        power_loss = registry.fault(cls) == "power"
    clock = bool(getattr(cls, "private_server", False))
    if registry.fault(cls) == "server_crash" or clock:
        return _on_private_server(name, budget, lanes=lanes, virtual_clock=clock)
    return _judge(name, budget, lanes=lanes, power_loss=power_loss)


def _on_private_server(name: str, budget: Budget, *, lanes: int,
                       virtual_clock: bool) -> Judgement:
    """Judge ``name`` with its stores on a private server started for it (a judge runs in
    its own process: one server per judge, stopped and removed whatever happens); on a
    machine that cannot start one, a row that says why instead of a verdict."""
    from faultlab.stores import pgserver
    from faultlab.stores import postgres as pgstores

    reason = pgserver.unavailable()
    if reason is None:
        try:
            pgserver.psycopg_module()
        except pgserver.PrivateServerUnavailable as error:
            reason = str(error)
    if reason is None:
        try:
            with pgserver.PrivateServer(virtual_clock=virtual_clock) as server:
                pgstores.configure(server.conninfo, server=server)
                try:
                    return _judge(name, budget, lanes=lanes, power_loss=False)
                finally:
                    pgstores.close_run()
                    pgstores.configure(None)
        except pgserver.PrivateServerUnavailable as error:
            reason = str(error)
    from faultlab.system import load_system

    system = load_system(name)
    return Judgement(
        system=name, defect=system.description, reference=False,
        caught_by=list(getattr(system, "caught_by", ())),
        minimal_steps=getattr(system, "minimal_steps", None), enumerate_found=False,
        enumerate_invariants=[], enumerate_seconds=0.0, enumerate_traces=0,
        explore_found=False, explore_invariants=[], examples_until_found=None,
        seconds_until_found=None, shrunk_steps=None, explore_seconds=0.0, explore_steps=0,
        corpus_file=None, enumerable=False,
        unjudged=f"needs --postgres private, which cannot start here: {reason}",
        lanes=lanes,
    )


@dataclass(frozen=True)
class _Enumerated:
    """What either enumerator found, in the terms of a Judgement."""

    found: bool
    invariants: list[str]
    seconds: float
    traces: int


def _judge(name: str, budget: Budget, *, lanes: int, power_loss: bool) -> Judgement:
    """Explore, then enumerate (where the system can be enumerated) with ``lanes`` lanes;
    ``power_loss``: both with power cuts (enumerate with its one job: its recording is per
    process). Two lanes use the schedule enumerator with its defaults; one lane the
    sequential enumerator with the budget's operations and crashes."""
    from faultlab.system import load_system

    system = load_system("reference" if name in _REFERENCES else name)
    enumerable = bool(getattr(system, "enumerable", True))
    from faultlab.process.spawn import spawner
    from faultlab.search.enumeration import enumerate_system
    from faultlab.search.explore import explore
    from faultlab.search.schedule_enumeration import enumerate_concurrent

    enumerated: _Enumerated | None = None
    with spawner(budget.spawn) as runner:
        explored = explore(system, runner, concurrency=lanes, examples=budget.examples,
                           steps=budget.steps, seed_value=budget.seed,
                           deadline=budget.deadline, power_loss=power_loss)
        began = time.monotonic()
        if enumerable and lanes > 1:
            schedules = enumerate_concurrent(system, concurrency=lanes, spawner=runner,
                                             deadline=budget.deadline)
            execution = schedules.execution
            enumerated = _Enumerated(
                found=execution is not None,
                invariants=sorted(execution.verdict.invariants) if execution is not None
                else [],
                seconds=schedules.seconds if execution is not None
                else time.monotonic() - began,
                traces=schedules.sequences)
        elif enumerable:
            sequences = enumerate_system(
                system, [runner], operations=budget.operations, crashes=budget.crashes,
                deadline=budget.deadline, first=True, power=power_loss,
            )
            enumerated = _Enumerated(
                found=sequences.found, invariants=sorted(sequences.best),
                seconds=sequences.first_found_seconds or time.monotonic() - began,
                traces=sequences.traces)
    trace = explored.trace
    recorder = explored.recorder
    return Judgement(
        system=name,
        defect=f"the reference, {_REFERENCES[name]}" if _REFERENCES.get(name)
        else system.description,
        reference=name in _REFERENCES,
        caught_by=list(getattr(system, "caught_by", ())),
        minimal_steps=getattr(system, "minimal_steps", None),
        enumerate_found=enumerated is not None and enumerated.found,
        enumerate_invariants=enumerated.invariants if enumerated is not None else [],
        enumerate_seconds=round(enumerated.seconds if enumerated is not None else 0.0, 3),
        enumerate_traces=enumerated.traces if enumerated is not None else 0,
        explore_found=trace is not None,
        explore_invariants=list(trace.expected.invariants) if trace and trace.expected else [],
        examples_until_found=recorder.first_failure_examples,
        seconds_until_found=None if recorder.first_failure_seconds is None
        else round(recorder.first_failure_seconds, 3),
        shrunk_steps=explored.shrunk_steps,
        explore_seconds=round(explored.seconds, 3),
        explore_steps=recorder.steps,
        corpus_file=None,
        enumerable=enumerable,
        lanes=lanes,
        finding=trace.to_json() if trace is not None else None,
    )


def judge_all(
    names: Sequence[str], budget: Budget, *, jobs: int,
    progress: Callable[[Judgement], None] | None = None,
) -> list[Judgement]:
    """Judge every system, ``jobs`` at a time, each in a fresh interpreter (spawn).

    The references go first: nothing catches them early, so both searches run their
    whole budget (the longest judgements); the mutants then fill the other jobs, and the
    last to finish is a short one (longest first)."""
    context = multiprocessing.get_context("spawn")
    results: dict[str, Judgement] = {}
    pool = ProcessPoolExecutor(max_workers=jobs, mp_context=context,
                               initializer=_pool_process)
    try:
        first = sorted(names, key=lambda name: name not in _REFERENCES)
        with interrupt.held_for_children():  # submit starts the pool's processes
            futures = {pool.submit(judge, name, budget): name for name in first}
        for future in as_completed(futures):
            try:
                judgement = future.result()
            except (ExecutionError, UsageError) as error:  # the run failed: say where
                raise type(error)(f"judging {futures[future]}: {error}") from None
            results[judgement.system] = judgement
            if progress is not None:
                progress(judgement)
        pool.shutdown(wait=True)
    except BaseException:
        # interrupted (or failed): stop the judges too; each ends its own workers and fork
        # server and removes its run directories, as the command does on SIGTERM
        processes: dict[int, Any] = getattr(pool, "_processes", None) or {}
        for process in list(processes.values()):
            if process.is_alive():  # not reaped yet, so the pid is still our child's
                os.kill(process.pid, signal.SIGTERM)
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    return [results[name] for name in names]


def save_findings(judgements: Sequence[Judgement], directory: Path) -> None:
    """Save every judge's shrunk finding to the corpus, once the whole run has ended (the
    run's commit point, as for ``explore``): each file atomically, all of them before a
    signal that lands meanwhile is acted on."""
    from faultlab.corpus import files as corpus
    from faultlab.trace import Trace

    with interrupt.deferred():
        for judgement in judgements:
            if judgement.finding is not None:
                trace = Trace.from_json(judgement.finding, source=judgement.system)
                judgement.corpus_file = str(corpus.save(trace, directory))
                judgement.finding = None


def concurrency_examples(judgements: Sequence[Judgement]) -> dict[str, Any]:
    """Examples until found by the mutants judged with lanes (a miss counts as None and
    keeps the median from being reported: it has none); their median over all, and over
    those on SQLite (the ones ``bench/scheduler.py`` measures)."""
    concurrent = [j for j in judgements if not j.reference and j.lanes > 1
                  and j.unjudged is None]
    counts = {j.system: j.examples_until_found for j in concurrent}

    def median(names: list[str]) -> float | None:
        values = [counts[name] for name in names]
        if not values or any(value is None for value in values):
            return None
        return statistics.median(v for v in values if v is not None)

    from faultlab.system.builtin import registry

    sqlite = [name for name in registry.names(lanes=2, postgres=False) if name in counts]
    return {"examples": counts, "median": median(list(counts)),
            "sqlite_median": median(sqlite), "sqlite": len(sqlite)}


def timing_summary(judgements: Sequence[Judgement]) -> dict[str, float | None]:
    """Median and worst seconds until a mutant was first caught (explore and enumerate)."""
    explore = [j.seconds_until_found for j in judgements
               if not j.reference and j.seconds_until_found is not None]
    enumerate_ = [j.enumerate_seconds for j in judgements
                  if not j.reference and j.enumerate_found]
    return {
        "explore_median_seconds": round(statistics.median(explore), 3) if explore else None,
        "explore_worst_seconds": round(max(explore), 3) if explore else None,
        "enumerate_median_seconds": round(statistics.median(enumerate_), 3) if enumerate_
        else None,
        "enumerate_worst_seconds": round(max(enumerate_), 3) if enumerate_ else None,
    }
