"""What an exploration did, counted the same way whether its traces have one lane or several.

Both state machines (:mod:`faultlab.search.machine` and :mod:`faultlab.search.schedules`)
hand every executed step to one :class:`Recorder` and every finished example to its
:meth:`Recorder.finish`; the summaries, the progress line, ``--jobs`` totals, vacuity and
the coverage tables all read it. A step's counts come from the step itself (its SIGKILLs,
its checks, whether a lane was held or blocked after it), so a new kind of step changes
what it reports, not this class.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from hypothesis import event
from hypothesis.errors import InvalidArgument

from faultlab.checks.invariants import Violation
from faultlab.search.coverage import Coverage, Observed
from faultlab.trace import Step, Verdict


class Counted(Observed, Protocol):
    """What the recorder reads of one executed step (:class:`faultlab.run.observation.Observation`,
    a worker's run or a scheduling choice)."""

    @property
    def step(self) -> Step: ...
    @property
    def sigkills(self) -> int: ...
    @property
    def checks(self) -> int: ...
    @property
    def held(self) -> int: ...
    @property
    def blocked(self) -> int: ...


def _event(text: str) -> None:
    """Hypothesis's ``event()`` exists only inside a Hypothesis test; explicit examples
    (the plugin's, a replay through the machine) run outside one."""
    try:
        event(text)
    except InvalidArgument:
        pass


@dataclass
class Recorder:
    """Counts what exploration did, and keeps the last example's executed steps."""

    progress: Callable[[Recorder], None] | None = None
    #: Asked before every step; True stops the exploration (see
    #: :class:`faultlab.search.machine.StopExploration`).
    stop: Callable[[], bool] | None = None
    #: The faults the machine draws (``power`` under ``--power-loss``): the invariants of a
    #: fault are reported only for runs that draw it.
    faults: tuple[str, ...] = ()
    examples: int = 0
    steps: int = 0
    processes: int = 0
    sigkills: int = 0
    #: Invariant checks run: each per-step invariant per worker that ended at the step (at
    #: least once a step), and each history invariant once a step of a trace with lanes.
    checks: int = 0
    #: Steps after which some lane was held at a point: 0 for a whole run with lanes means
    #: its workers never overlapped (:func:`faultlab.search.coverage.vacuity`).
    held: int = 0
    #: Lane-steps that ended blocked on another lane's lock.
    blocked: int = 0
    coverage: Coverage = field(default_factory=Coverage)
    #: Examples by the operation ids they accepted, and by their direct deliveries (service
    #: workers): how deep the generated traces go.
    operations_per_example: Counter[int] = field(default_factory=Counter)
    deliveries_per_example: Counter[int] = field(default_factory=Counter)
    #: Steps by action (accept, dispatch, server_crash; with lanes run, start, release,
    #: ...): the summary shows that a run's faults were really drawn.
    actions: Counter[str] = field(default_factory=Counter)
    #: Per example PCT scheduled: its lane priorities (highest first) and change points.
    pct_draws: list[tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=list)
    #: Examples with lanes by the scenario they opened with (``none``: plain draws only).
    openings: Counter[str] = field(default_factory=Counter)
    last_steps: list[Step] = field(default_factory=list)
    last_verdict: Verdict = field(default_factory=Verdict)
    last_violations: list[Violation] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    first_failure_examples: int | None = None
    first_failure_seconds: float | None = None
    #: The first example that failed: its steps, verdict and violations. Hypothesis may not
    #: fail it again when it re-runs it (then this is the trace kept as flaky), or may
    #: abandon it and never report it; the search reports it all the same once its replay
    #: reproduces it.
    first_failure: tuple[list[Step], Verdict, list[Violation]] | None = None
    #: The first error that stopped a step without a verdict (a deadline, a broken
    #: protocol, a refused input, a store that could not be read): a run failure, never a
    #: finding, whatever Hypothesis makes of it.
    run_error: Exception | None = None
    #: What closes the example under way (its executor's ``close``): set as the machine
    #: opens its stores, cleared once its teardown has closed them. Hypothesis makes the
    #: machine a few statements before the block that runs its teardown, and a signal can
    #: land as the teardown's close begins, before it defers signals: either would leave
    #: the stores behind, so the search closes them then.
    open_example: Callable[[], None] | None = None
    _last_progress: float = 0.0

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.started

    @property
    def crash_hits(self) -> Counter[str]:
        return self.coverage.fired

    def observe(self, observation: Counted) -> None:
        """One executed step (a trace's own or its recovery's)."""
        self.steps += 1
        self.actions[observation.step.action] += 1
        self.sigkills += observation.sigkills
        self.checks += observation.checks
        self.held += observation.held
        self.blocked += observation.blocked
        self.coverage.observe(observation)
        for point in observation.fired:
            _event(f"crash point fired: {point}")
        now = time.monotonic()
        if self.progress is not None and now - self._last_progress >= 1.0:
            self._last_progress = now
            self.progress(self)

    def finish(self, steps: Sequence[Step], verdict: Verdict, violations: Sequence[Violation],
               *, processes: int, live: bool = False) -> None:
        """One example done: its steps, its verdict, the processes it started (workers and
        the services they started); ``live``: its recovery judged LIVE."""
        self.examples += 1
        self.processes += processes
        if live:
            self.coverage.live_checked()
        accepted = {step.operation_id for step in steps if step.role == "accept"}
        self.operations_per_example[len(accepted)] += 1
        self.deliveries_per_example[sum(step.role == "service" for step in steps)] += 1
        self.last_steps, self.last_verdict = list(steps), verdict
        self.last_violations = list(violations)
        if not verdict.clean and self.first_failure_examples is None:
            self.first_failure_examples = self.examples
            self.first_failure_seconds = self.seconds
            self.first_failure = (list(steps), verdict, list(violations))
            if self.progress is not None:
                self.progress(self)  # at once: shrinking starts now, and may take a while
