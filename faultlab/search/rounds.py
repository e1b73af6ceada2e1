"""Exploration at scale: seed streams, rounds, a time budget, jobs and shards.

One Hypothesis run (a *round*) explores ``--examples`` examples from one seed. A
*stream* is a sequence of rounds with seeds derived from the run's ``--seed``:

* ``--duration SECONDS`` keeps a stream going round after round until the budget is
  spent (the step in flight finishes; the unfinished example is not counted);
* ``--jobs N`` runs N streams on this machine, one process each with its own fork
  server; without a duration the ``--examples`` are split between them; the first
  finding stops the others;
* ``--shard K/N`` makes this run the K-th of N (K from 0, as a Kubernetes completion
  index): with ``--jobs J`` its streams are numbers K*J ... K*J+J-1 of N*J.

Round ``r`` of stream ``s`` of ``S`` is global round ``g = r*S + s``; its seed is
``--seed`` itself for ``g = 0`` (so a plain ``explore --seed S`` is exactly round 0)
and otherwise a 63-bit hash of ``(--seed, g)``. Different ``g`` give different seeds,
so shards and jobs never repeat each other's examples, and the same command gives
the same streams. A finding records its round's seed: ``explore --seed <that>
--examples <the round's examples>`` replays the round on its own.

A round is one exploration (:func:`faultlab.search.explore.explore`), sequential or, with
``concurrency`` of 2 or more, concurrent; everything else here, the seeds, the time budget,
the jobs and the first finding stopping the others, is the same.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
import signal
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from faultlab.base import interrupt
from faultlab.base.errors import UsageError
from faultlab.process.affinity import allowed_cpus, pin_job
from faultlab.process.records import DEFAULT_DEADLINE, SpawnMode
from faultlab.process.spawn import Spawner
from faultlab.search.explore import Exploration, explore
from faultlab.search.machine import flaky_reason
from faultlab.search.recorder import Recorder
from faultlab.search.schedules import DEFAULT_SCHEDULER
from faultlab.search.streams import Shard, round_seed
from faultlab.system.contract import System
from faultlab.trace import Verdict


@dataclass(frozen=True)
class Plan:
    """Everything a stream needs; picklable, so a job process gets it whole."""

    system: str
    deduplication: bool
    seed: int
    examples: int
    steps: int
    #: Statement points (sql:K, commit:K): sequential traces also arm crashes there, lanes
    #: also hold there (``--statement-points``; the command line applies each mode's default).
    statement_points: bool
    hypothesis_shrink: bool
    spawn: SpawnMode
    deadline: float = DEFAULT_DEADLINE
    duration: float | None = None
    jobs: int = 1
    shard: Shard = Shard()
    #: Lanes: 1 explores sequential traces, 2 or more concurrent ones.
    concurrency: int = 1
    #: How concurrent traces draw the lane that moves (``--scheduler``, SCHEDULERS).
    scheduler: str = DEFAULT_SCHEDULER
    #: Traces also draw power cuts (``--power-loss``, :mod:`faultlab.stores.vfs`).
    power_loss: bool = False
    #: Jobs may be pinned, one CPU each (see :mod:`faultlab.process.affinity`); ``--no-pin``
    #: clears it.
    pin: bool = True

    @property
    def pinned(self) -> bool:
        """Whether each job is confined to one CPU: several sequential jobs (a concurrent
        job's lanes run at once, so they keep every CPU)."""
        return self.pin and self.jobs > 1 and self.concurrency == 1

    @property
    def streams(self) -> int:
        return self.shard.count * self.jobs

    def stream(self, job: int) -> int:
        return self.shard.index * self.jobs + job

    def examples_for(self, job: int) -> int:
        """With a time budget every round is ``examples``; without, jobs share them."""
        if self.duration is not None:
            return self.examples
        share, extra = divmod(self.examples, self.jobs)
        return share + (1 if job < extra else 0)


@dataclass
class Totals:
    """Counters summed over rounds and jobs (what the progress line and tables show)."""

    examples: int = 0
    steps: int = 0
    processes: int = 0
    sigkills: int = 0
    checks: int = 0
    rounds: int = 0
    #: Concurrent traces: lane-steps that ended blocked on another lane's lock.
    blocked: int = 0
    #: Concurrent traces: steps after which some lane was held at a point (none: the
    #: workers never overlapped).
    held: int = 0
    #: Examples by operations accepted, and by direct deliveries
    #: (Counters add up like the numbers above; a new one on every add, since a progress
    #: snapshot shares them)
    operations: Counter[int] = field(default_factory=Counter)
    deliveries: Counter[int] = field(default_factory=Counter)

    def add(self, recorder: Recorder) -> None:
        self.examples += recorder.examples
        self.steps += recorder.steps
        self.processes += recorder.processes
        self.sigkills += recorder.sigkills
        self.checks += recorder.checks
        self.blocked += recorder.blocked
        self.held += recorder.held
        self.operations = self.operations + recorder.operations_per_example
        self.deliveries = self.deliveries + recorder.deliveries_per_example


@dataclass
class StreamResult:
    """One stream's rounds: totals, coverage and the finding (as trace JSON), if any."""

    job: int
    totals: Totals = field(default_factory=Totals)
    armed: dict[str, int] = field(default_factory=dict)
    fired: dict[str, int] = field(default_factory=dict)
    checked: dict[str, int] = field(default_factory=dict)
    #: Steps by action (accept, dispatch, server_crash, ...; concurrent traces: run, start,
    #: release, ...).
    actions: dict[str, int] = field(default_factory=dict)
    trace: dict[str, Any] | None = None
    #: An example failed but did not fail again when re-run: its trace (JSON, marked
    #: ``"expect": "flaky"``; never a corpus file) and the flaky line's reason. It ends the
    #: stream as a finding would.
    flaky: dict[str, Any] | None = None
    flaky_reason: str | None = None
    notes: list[str] = field(default_factory=list)
    examples_until_found: int | None = None
    seconds_until_found: float | None = None
    #: ``time.monotonic()`` as the stream started and ended exploring (one clock for every
    #: process of a machine), so a throughput can leave out interpreter and fork-server
    #: start-up, which a long run pays once.
    began: float = 0.0
    ended: float = 0.0
    #: The CPUs the stream's processes could run on (its fork server's, as its workers
    #: inherit them), or None where the platform cannot say.
    cpus: list[int] | None = None


def run_stream(
    system: System, spawner: Spawner, plan: Plan, job: int, *,
    stop: Callable[[], bool] = lambda: False,
    on_failure: Callable[[], None] | None = None,
    progress: Callable[[Totals], None] | None = None,
) -> tuple[StreamResult, Exploration | None]:
    """Run one stream's rounds in this process; returns its result and the finding's
    exploration (with its replay), if one was found."""
    started = time.monotonic()
    ends = None if plan.duration is None else started + plan.duration
    result = StreamResult(job, began=started)
    totals = result.totals
    stream, streams = plan.stream(job), plan.streams

    def expired() -> bool:
        return stop() or (ends is not None and time.monotonic() >= ends)

    def live(recorder: Recorder) -> None:
        if progress is not None:
            snapshot = Totals(**vars(totals))
            snapshot.add(recorder)
            progress(snapshot)

    round_index = 0
    while True:
        examples = plan.examples_for(job)
        if examples == 0 or expired():
            break
        seed = round_seed(plan.seed, round_index * streams + stream)
        found = explore_round(system, spawner, plan, examples=examples, seed=seed,
                              progress=live, stop=expired, on_failure=on_failure)
        recorder = found.recorder
        examples_before = totals.examples
        if found.trace is not None and recorder.first_failure_examples is not None:
            result.examples_until_found = totals.examples + recorder.first_failure_examples
            result.seconds_until_found = round(time.monotonic() - started, 3)
        totals.add(recorder)
        totals.rounds += 1
        counters: tuple[tuple[str, Mapping[str, int]], ...] = (
            ("armed", recorder.coverage.armed), ("fired", recorder.coverage.fired),
            ("checked", recorder.coverage.checked), ("actions", recorder.actions))
        for name, counter in counters:
            merged: dict[str, int] = getattr(result, name)
            for key, count in counter.items():
                merged[key] = merged.get(key, 0) + count
        result.notes += found.notes
        where = {"stream_seed": plan.seed, "round": round_index, "job": job,
                 "shard": str(plan.shard), "jobs": plan.jobs, "round_examples": examples}
        if found.trace is not None:
            found.trace.meta.update(where)
            result.trace = found.trace.to_json()
            result.ended = time.monotonic()
            return result, found
        if found.flaky is not None:
            found.flaky.meta.update(where)
            result.flaky = found.flaky.to_json()
            first = recorder.first_failure_examples
            which = None if first is None else f"example {examples_before + first}" + (
                f" of job {job}" if plan.jobs > 1 else "")
            recorded = found.flaky.expected or Verdict()
            result.flaky_reason = flaky_reason(
                which, recorded, Verdict.from_json(found.flaky.meta["replayed"]))
            result.ended = time.monotonic()
            return result, None
        if plan.duration is None or found.stopped:
            break
        round_index += 1
    result.ended = time.monotonic()
    return result, None


def explore_round(
    system: System, spawner: Spawner, plan: Plan, *, examples: int, seed: int,
    progress: Callable[[Any], None] | None = None, stop: Callable[[], bool] | None = None,
    on_failure: Callable[[], None] | None = None,
) -> Exploration:
    """One round: one exploration with the plan's lanes (a concurrent one's workers run in
    the spawner's mode)."""
    return explore(
        system, spawner, concurrency=plan.concurrency, deduplication=plan.deduplication,
        examples=examples, steps=plan.steps, seed_value=seed, deadline=plan.deadline,
        progress=progress, stop=stop, on_failure=on_failure,
        statement_points=plan.statement_points,
        hypothesis_shrink=plan.hypothesis_shrink, scheduler=plan.scheduler,
        power_loss=plan.power_loss,
    )


# --- jobs -----------------------------------------------------------------------------------


def _job_main(plan: Plan, job: int, messages: Any, stop_event: Any) -> None:
    """One job process: its own fork server, its stream, messages to the parent."""
    from faultlab.process.spawn import become_subreaper, spawner
    from faultlab.system import load_system

    interrupt.install()  # SIGINT (the terminal's group) or SIGTERM (the parent) end it cleanly
    # as the faultlab program is: a killed lane's service, orphaned, is reparented to this
    # job and reaped here, not left a zombie of whoever started faultlab
    become_subreaper()
    last = [0.0]

    def progress(totals: Totals) -> None:
        now = time.monotonic()
        if now - last[0] >= 0.5:
            last[0] = now
            messages.put(("progress", job, vars(totals)))

    try:
        interrupt.release_held()  # one that arrived while this interpreter started: now
        cpus = pin_job(job, plan.jobs) if plan.pinned else allowed_cpus()
        system = load_system(plan.system)  # the parent checked it; a job reports its own
        with spawner(plan.spawn) as runner:
            result, _ = run_stream(system, runner, plan, job, stop=stop_event.is_set,
                                   on_failure=stop_event.set, progress=progress)
            server = runner.server_pid  # alive until the block ends: still ours to ask
            result.cpus = allowed_cpus(server) if server is not None else cpus
        messages.put(("done", job, result))
    except UsageError as error:  # bad input stays bad input (exit 2), not a run failure
        stop_event.set()
        messages.put(("usage", job, str(error)))
    except BaseException as error:  # reported to the parent, which stops with an error
        stop_event.set()
        messages.put(("error", job, f"{type(error).__name__}: {error}"))


def run_jobs(
    plan: Plan, *, progress: Callable[[Totals, float], None] | None = None,
    stop: Callable[[], bool] = lambda: False,
) -> list[StreamResult]:
    """Run ``plan.jobs`` streams in as many processes (spawned: a fresh interpreter each,
    so no fork server or Hypothesis state is inherited). Waits for all of them.

    ``progress`` is called with the summed totals as jobs report them, and at least every
    half second while none does (a heartbeat for the live counters); ``stop`` is asked as
    often, and True ends every job's stream as the first finding does (each job still
    reports, so the run ends as a stopped one, never by killing the jobs)."""
    context = multiprocessing.get_context("spawn")
    messages = context.Queue()
    stop_event = context.Event()
    processes = [context.Process(target=_job_main, args=(plan, job, messages, stop_event),
                                 name=f"faultlab-explore-job-{job}")
                 for job in range(plan.jobs)]
    started = time.monotonic()
    live: dict[int, Totals] = {}
    results: dict[int, StreamResult] = {}
    errors: list[str] = []
    usage: list[str] = []
    try:
        for process in processes:
            # deferred: a signal as a job starts is raised once it is known, so the handler
            # below ends it (a job started before the signal ran on to its end)
            with interrupt.deferred(), interrupt.held_for_children():
                process.start()
        while len(results) + len(errors) < len(processes):
            if stop():
                stop_event.set()
            try:
                kind, job, payload = messages.get(timeout=0.5)
            except queue.Empty:
                dead = [p for p in processes if p.exitcode not in (None, 0)]
                if dead and len(results) + len(errors) < len(processes):
                    time.sleep(0.5)  # let a last message arrive before judging
                    if messages.empty():
                        stop_event.set()
                        errors.append(f"job process {dead[0].name} died "
                                      f"(exit {dead[0].exitcode})")
                        break
                if progress is not None:
                    progress(_merged(live), time.monotonic() - started)
                continue
            if kind == "progress":
                live[job] = Totals(**payload)
            elif kind == "done":
                results[job] = payload
                live[job] = payload.totals
            elif kind == "usage":
                usage.append(payload)
                errors.append(f"job {job}: {payload}")
            else:
                errors.append(f"job {job}: {payload}")
            if progress is not None:
                progress(_merged(live), time.monotonic() - started)
    except BaseException:
        # interrupted: end the jobs at once (a job waiting on a worker would otherwise run
        # to its deadline); each ends its worker and fork server and removes its stores
        for process in processes:
            if process.is_alive() and process.pid is not None:  # unreaped: still ours
                os.kill(process.pid, signal.SIGTERM)
        raise
    finally:
        stop_event.set()
        while any(process.is_alive() for process in processes):
            try:  # drain: a job blocked writing its last message could never exit
                messages.get(timeout=0.2)
            except queue.Empty:
                pass
        for process in processes:
            if process.pid is not None:  # started
                process.join()
        messages.close()
        messages.join_thread()
    if usage:  # the same words a single job would have printed, exit 2
        raise UsageError(usage[0])
    if errors:
        from faultlab.base.errors import ExecutionError

        raise ExecutionError(errors[0])
    return [results[job] for job in sorted(results)]


def _merged(live: Mapping[int, Totals]) -> Totals:
    merged = Totals()
    for totals in live.values():
        for key, value in vars(totals).items():
            setattr(merged, key, getattr(merged, key) + value)
    return merged
