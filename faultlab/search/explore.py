"""Exploration: run a state machine under Hypothesis and turn a failure into a trace.

One driver for every exploration, whatever its lanes: :func:`explore` runs the sequential
machine (:mod:`faultlab.search.machine`) or, with ``concurrency`` of 2 or more, the
machine whose rules are scheduling choices (:mod:`faultlab.search.schedules`), under the
same discipline: a run that failed (an error, not an invariant) raises and is never a
finding; a stopped or interrupted search reports nothing; the failing example is replayed
on fresh stores and is a finding only when the replay fails the same way (otherwise it is
flaky); a finding is shrunk by :func:`faultlab.search.shrink.minimise` and replayed once
more as it is saved. The :class:`faultlab.search.recorder.Recorder` holds each example's
executed steps (recovery included), so the failing example is known without Hypothesis's
report.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis import Phase, Verbosity, seed
from hypothesis import __version__ as _hypothesis_version
from hypothesis import settings as Settings
from hypothesis.errors import Flaky
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from faultlab.base import interrupt
from faultlab.base.errors import UsageError
from faultlab.base.version import __version__
from faultlab.process.records import DEFAULT_DEADLINE
from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute, execute_trace
from faultlab.run.observation import Execution
from faultlab.search import defaults
from faultlab.search.coverage import drawn_faults, vacuity
from faultlab.search.machine import (
    SUITE_WEIGHTS,
    WEIGHTS,
    InvariantFailure,
    StopExploration,
    Weights,
    ended_by_stop,
    flaky_reason,
    machine_settings,
    not_a_finding,
    outbox_machine,
)
from faultlab.search.recorder import Recorder
from faultlab.search.schedules import DEFAULT_SCHEDULER, concurrent_machine, scheduled_steps
from faultlab.search.shrink import length, minimise
from faultlab.system.contract import System
from faultlab.trace import EXPECT_FLAKY, Step, Trace, Verdict

#: Explorations record it: the same seed gives the same run with the same Hypothesis.
HYPOTHESIS_VERSION: str = _hypothesis_version


@dataclass
class Exploration:
    """What one exploration did and found (``concurrency`` lanes; 1 is sequential)."""

    system: str
    deduplication: bool
    seed: int
    recorder: Recorder
    seconds: float
    concurrency: int = 1
    trace: Trace | None = None
    replay: Execution | None = None
    notes: list[str] = field(default_factory=list)
    #: True when the run was told to stop before its examples were done (no finding).
    stopped: bool = False
    #: An example failed, but its re-run did not fail again: its trace (marked
    #: ``"expect": "flaky"``, never a corpus file) and what the flaky line says about it.
    flaky: Trace | None = None
    flaky_reason: str | None = None

    @property
    def found(self) -> bool:
        return self.trace is not None

    @property
    def shrunk_steps(self) -> int | None:
        """The finding's length: steps executed up to the failing check, recovery dispatches
        included; with lanes, its own scheduling choices (the recovery is implicit)."""
        return None if self.replay is None else length(self.replay)

    def stats(self) -> dict[str, Any]:
        r = self.recorder
        stats: dict[str, Any] = {
            "examples": r.examples,
            "steps": r.steps,
            "processes": r.processes,
            "sigkills": r.sigkills,
            "invariant_checks": r.checks,
            "crash_points_hit": dict(sorted(r.crash_hits.items())),
            "operations_per_example": histogram(r.operations_per_example),
            "direct_deliveries_per_example": histogram(r.deliveries_per_example),
            "examples_until_found": r.first_failure_examples,
            "seconds_until_found": None if r.first_failure_seconds is None
            else round(r.first_failure_seconds, 3),
            "seconds": round(self.seconds, 3),
            "steps_per_second": round(r.steps / self.seconds, 1) if self.seconds else 0.0,
        }
        if self.concurrency > 1:  # what only lanes show
            stats.update({
                "blocked_lane_steps": r.blocked,
                "held_steps": r.held,
                "actions": dict(sorted(r.actions.items())),
                "checked": {name: count for name, count in r.coverage.invariant_rows(
                    r.faults, lanes=True)},
                "crash_points_armed": dict(sorted(r.coverage.armed.items())),
                "crash_points_fired": dict(sorted(r.coverage.fired.items())),
            })
        return stats

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "system": self.system,
            "deduplication": self.deduplication,
            **({"concurrency": self.concurrency} if self.concurrency > 1 else {}),
            "seed": self.seed,
            "hypothesis": HYPOTHESIS_VERSION,  # a seed reproduces a run with this version
            **self.stats(),
            "found": self.found,
            "flaky": self.flaky is not None,
            "shrunk_steps": self.shrunk_steps,
        }
        if self.trace is not None:
            data["trace"] = self.trace.to_json()
        return data


def histogram(counts: Mapping[int, int]) -> dict[str, int]:
    """Examples by a count (operations, direct deliveries), as JSON: keys in numeric order."""
    return {str(key): counts[key] for key in sorted(counts)}


def share_at_least(counts: Mapping[int, int], least: int) -> float:
    """The percentage of examples whose count is ``least`` or more (0.0 with no examples)."""
    total = sum(counts.values())
    return round(100 * sum(n for k, n in counts.items() if k >= least) / total, 1) if total else 0.0


@contextmanager
def _no_local_constants() -> Iterator[None]:
    """Keep Hypothesis from mining constants out of the modules it thinks are "local".

    Since 6.131, Hypothesis sometimes draws literals found in loaded modules outside
    site-packages and the standard library. Which modules those are depends on how
    faultlab was installed (a checkout is "local", a wheel is not), on the system
    under test and on the test runner, so the same ``--seed`` explored differently
    from a checkout and from ``pip install .``. faultlab's strategies name every
    value they want; with no local constants a seed means one run per Hypothesis
    version. Versions without the mechanism are left as they are.
    """
    try:
        from hypothesis.internal.conjecture import providers
    except ImportError:  # pragma: no cover - a Hypothesis without the module
        yield
        return
    original = getattr(providers, "_get_local_constants", None)
    cache: Any = getattr(getattr(providers, "CONSTANTS_CACHE", None), "cache", None)
    if original is None or cache is None or not hasattr(providers, "Constants"):
        yield  # pragma: no cover - another Hypothesis: nothing to switch off
        return
    empty = providers.Constants()
    providers._get_local_constants = lambda: empty
    cache.clear()  # values computed with local constants before this run
    try:
        yield
    finally:
        providers._get_local_constants = original
        cache.clear()


def explore(
    system: System,
    spawner: Spawner,
    *,
    concurrency: int = 1,
    deduplication: bool = True,
    examples: int = defaults.EXAMPLES,
    steps: int = defaults.STEPS,
    seed_value: int = 0,
    deadline: float = DEFAULT_DEADLINE,
    progress: Callable[[Any], None] | None = None,
    statement_points: bool | None = None,
    hypothesis_shrink: bool = False,
    stop: Callable[[], bool] | None = None,
    on_failure: Callable[[], None] | None = None,
    weights: Weights = WEIGHTS,
    power_loss: bool = False,
    scheduler: str = DEFAULT_SCHEDULER,
) -> Exploration:
    """Search for a violating trace; shrink it; confirm it by replay.

    ``concurrency`` lanes (1: sequential steps, each a worker run to its end; 2 or more:
    scheduling choices among workers alive at once, drawn by ``scheduler``). Every worker
    runs through ``spawner`` (lanes in its spawn mode). ``statement_points``: sequentially,
    crashes are also armed at sql:K / commit:K (default on); with lanes, workers also hold
    there (default off). ``power_loss`` adds the ``power`` rule (a power cut between two
    steps); the workers then record through :mod:`faultlab.stores.vfs`.

    Shrinking is faultlab's own trace minimiser (:func:`minimise`), run on the first
    failing example: deterministic and fast, since every candidate costs real
    processes. ``hypothesis_shrink`` (sequential only) runs Hypothesis's shrinker first
    (many more executions; it also simplifies payloads). ``stop`` is asked before every
    step and ends the run early (no finding: :attr:`Exploration.stopped`); ``on_failure``
    is called as soon as an example fails, before shrinking (``--jobs`` stops the other
    jobs with it); ``weights`` weigh the sequential rules.
    """
    lanes = concurrency > 1
    recorder: Recorder
    machine: type[RuleBasedStateMachine]
    if lanes:
        recorder = Recorder(progress=progress, stop=stop,
                            faults=drawn_faults(power_loss))
        machine = concurrent_machine(
            system.ref, concurrency=concurrency, deduplication=deduplication,
            deadline=deadline, examples=examples, steps=steps,
            recorder=recorder, statement_points=bool(statement_points), scheduler=scheduler,
            power_loss=power_loss, spawner=spawner,
        )
        base = machine_settings(examples, scheduled_steps(steps))
    else:
        recorder = Recorder(progress=progress, stop=stop)
        machine = outbox_machine(
            system.ref, deduplication=deduplication, spawner=spawner, deadline=deadline,
            examples=examples, steps=steps, recorder=recorder,
            statement_points=statement_points is not False, weights=weights,
            power_loss=power_loss,
        )
        base = machine_settings(examples, steps)
    failure, stopped, seconds = _search(machine, base, seed_value, recorder,
                                        hypothesis_shrink=hypothesis_shrink and not lanes)
    result = Exploration(system.ref, deduplication, seed_value, recorder, seconds,
                         concurrency=concurrency, stopped=stopped)
    failed = recorder.first_failure
    if failure is None:
        if failed is None:
            return result
        failure = InvariantFailure(failed[1].step, failed[2])  # one Hypothesis did not report
    if on_failure is not None:
        on_failure()
    # The failing example Hypothesis reports is the last it ran (its shrinker's, with
    # hypothesis_shrink); when that last run did not fail (Hypothesis calls it Flaky), the
    # first failing example is the one to re-run. With lanes it always is: Hypothesis's
    # re-run of the same choices may have been scheduled differently.
    steps_of, verdict_of, violations_of = failed if failed is not None and (
        lanes or recorder.last_verdict.clean) else (
        recorder.last_steps, recorder.last_verdict, recorder.last_violations)
    meta: dict[str, Any] = {
        "found_by": "explore",
        "seed": seed_value,
        "hypothesis": HYPOTHESIS_VERSION,
        "examples": examples,
        "steps_per_example": steps,
        **({"concurrency": concurrency} if lanes else {}),
        "faultlab": __version__,
        # how the lanes were drawn; absent for uniform, so older files stay byte for byte
        **({"scheduler": scheduler} if lanes and scheduler != "uniform" else {}),
        # no timestamp: the documented commands must reproduce committed files byte for byte
    }
    # With lanes the machine itself stops Hypothesis's re-run of the failing example
    # (ConcurrentMachine.should_stop), which Hypothesis always calls flaky: no news. The
    # replay below judges the finding either way.
    if isinstance(failure, Flaky) and not lanes:
        result.notes.append(f"Hypothesis reported a flaky failure: {failure}")
    trace = Trace(system=system.ref, deduplication=deduplication, steps=list(steps_of),
                  expected=verdict_of, violations=list(violations_of), meta=meta,
                  concurrency=concurrency, statement_points=lanes and bool(statement_points))
    replay = execute_trace(system, trace, spawner, deadline=deadline)
    refused = not_a_finding(trace.expected, replay.verdict, failure)
    if refused is not None:
        if failed is not None:  # an example did fail, and did not fail again: flaky
            result.flaky = flaky_trace(trace, replay.verdict)
            result.flaky_reason = flaky_reason(
                recorder.first_failure_examples, verdict_of, replay.verdict)
        result.notes.append(refused)
        return result
    if trace.laned:
        shrunk, _ = minimise(trace, replay, _lenient_run(system, trace, spawner, deadline))
        # replayed as saved (not leniently): what replay of the corpus file will show
        result.trace, result.replay = shrunk, execute_trace(system, shrunk, spawner,
                                                           deadline=deadline)
    else:
        def run(candidate: list[Step]) -> Execution:
            return execute(system, candidate, spawner, deduplication=deduplication,
                           settle=True, deadline=deadline)

        result.trace, result.replay = minimise(trace, replay, run)
    return result


def close_open_example(recorder: Recorder) -> None:
    """Close the stores of an example whose teardown never ran: a signal that landed
    between Hypothesis making the machine and entering the block that tears it down."""
    leftover, recorder.open_example = recorder.open_example, None
    if leftover is not None:
        leftover()


def _search(machine: type[RuleBasedStateMachine], base: Settings, seed_value: int,
            recorder: Recorder, *, hypothesis_shrink: bool
            ) -> tuple[BaseException | None, bool, float]:
    """Run the machine under Hypothesis: the failure it ended with (None when none), whether
    it was told to stop, and its seconds. A run error or an interrupt is raised: a run that
    failed is not a finding, whatever it showed."""
    phases = tuple(base.phases) if hypothesis_shrink else tuple(
        phase for phase in base.phases if phase not in (Phase.shrink, Phase.explain))
    chosen = Settings(base, verbosity=Verbosity.quiet, phases=phases)
    started = time.monotonic()
    failure: BaseException | None = None
    stopped = False
    try:
        with _no_local_constants():
            run_state_machine_as_test(  # type: ignore[no-untyped-call,unused-ignore]
                seed(seed_value)(machine), settings=chosen
            )
    except (InvariantFailure, Flaky, StopExploration) as error:
        if ended_by_stop(error):
            stopped = True  # told to stop; Hypothesis may have called that flaky
        else:
            failure = error
    except Exception:
        interrupt.check()  # Hypothesis can trip over a KeyboardInterrupt in its own setup
        if recorder.run_error is not None:
            raise recorder.run_error from None  # the step's own error, not Hypothesis's report
        raise
    finally:
        close_open_example(recorder)
    interrupt.check()  # an interrupted search reports nothing
    if recorder.run_error is not None:
        raise recorder.run_error  # a run that failed is not a finding, whatever it showed
    return failure, stopped, time.monotonic() - started


def _lenient_run(system: System, trace: Trace, spawner: Spawner, deadline: float
                 ) -> Callable[[list[Step]], Execution | None]:
    """How the shrinker runs a candidate of a concurrent trace: leniently (a step left
    without its worker is dropped), ``None`` when the lanes cannot run it at all."""
    def run(candidate: list[Step]) -> Execution | None:
        try:
            return execute_trace(system, replace(trace, steps=candidate), spawner,
                                 deadline=deadline, lenient=True)
        except UsageError:
            return None  # not a trace these lanes can run

    return run


def flaky_trace(trace: Trace, replayed: Verdict) -> Trace:
    """A failing example's trace as a flaky outcome keeps it: ``"expect": "flaky"`` (so
    replay and the pytest plugin never take it for a regression test), with what its
    re-run showed in ``meta``."""
    trace.expect = EXPECT_FLAKY
    trace.meta = {**trace.meta, "replayed": replayed.to_json()}
    return trace


def _describe(trace: Trace) -> str:
    return trace.expected.describe() if trace.expected else "a failure"


def _phase(progress: Callable[[str, Any], None] | None,
           name: str) -> Callable[[Any], None] | None:
    """A recorder's progress callback that names the suite's phase it belongs to."""
    if progress is None:
        return None
    return lambda recorder: progress(name, recorder)


def suite_exploration(
    system: System, spawner: Spawner, *, examples: int, seed: int, deadline: float,
    progress: Callable[[str, Any], None] | None = None,
) -> dict[str, Any]:
    """suite's exploration phase: the system must be clean, and not vacuously (an
    exploration that accepted nothing or fired no declared crash point tested nothing:
    :func:`faultlab.search.coverage.vacuity`); the negative control must be caught by
    ONE, shrunk to exactly 3 steps."""
    clean = explore(system, spawner, examples=examples, seed_value=seed, deadline=deadline,
                    weights=SUITE_WEIGHTS, progress=_phase(progress, "exploration"))
    stats = clean.stats()
    vacuous = None if clean.trace is not None or examples == 0 else vacuity(
        clean.recorder.coverage, system, clean.recorder.examples)
    clean_ok = clean.trace is None and clean.flaky is None and vacuous is None
    outcome = "clean" if clean_ok else f"FOUND {_describe(clean.trace)}: FAIL" \
        if clean.trace is not None else f"FLAKY ({clean.flaky_reason}): FAIL" \
        if clean.flaky is not None else f"VACUOUS ({vacuous}): FAIL"
    lines = [
        f"explore {system.ref} (seed {seed}, Hypothesis {HYPOTHESIS_VERSION}): "
        f"{stats['examples']} examples, {stats['steps']} steps, {stats['sigkills']} SIGKILLs, "
        f"{stats['seconds']}s: {outcome}"
    ]
    control_ok = True
    control: Exploration | None = None
    if system.supports_no_deduplication:
        control = explore(system, spawner, deduplication=False, examples=examples,
                          seed_value=seed, deadline=deadline, weights=SUITE_WEIGHTS,
                          progress=_phase(progress, "negative control"))
        trace = control.trace
        steps = control.shrunk_steps or 0
        control_ok = bool(trace and trace.expected and "ONE" in trace.expected.invariants
                          and control.shrunk_steps == 3)
        shown = ", ".join(s.describe() for s in trace.steps) if trace else "nothing found"
        verdict = _describe(trace) if trace else "nothing"
        lines.append(
            f"negative control (deduplication off): {verdict}, shrunk to {steps} steps: {shown}"
            + ("" if control_ok else "  FAIL: expected ONE shrunk to 3 steps")
        )
    return {
        "passed": clean_ok and control_ok,
        "lines": lines,
        "evidence": {
            "clean": clean.to_json(),
            "negative_control": control.to_json() if control else None,
        },
    }
