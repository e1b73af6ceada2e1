"""Exploration: run the state machine under Hypothesis and turn a failure into a trace.

The shrunk failing example is the last one Hypothesis executes, so the
:class:`faultlab.machine.Recorder` holds its executed steps (including the
recovery dispatches of teardown). That list becomes a corpus trace, which is
replayed once more through the executor to confirm it and to print its table.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from hypothesis import Verbosity, seed
from hypothesis.errors import Flaky
from hypothesis.stateful import run_state_machine_as_test

from faultlab import __version__
from faultlab.canonical import canonical_json
from faultlab.machine import InvariantFailure, Recorder, machine_settings, outbox_machine
from faultlab.process import DEFAULT_DEADLINE, Spawner
from faultlab.system.contract import System
from faultlab.trace import Execution, Step, Trace, execute

DEFAULT_EXAMPLES = 100
DEFAULT_STEPS = 10


@dataclass
class Exploration:
    """What one exploration did and found."""

    system: str
    deduplication: bool
    seed: int
    recorder: Recorder
    seconds: float
    trace: Trace | None = None
    replay: Execution | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def found(self) -> bool:
        return self.trace is not None

    def stats(self) -> dict[str, Any]:
        r = self.recorder
        return {
            "examples": r.examples,
            "steps": r.steps,
            "processes": r.processes,
            "sigkills": r.sigkills,
            "invariant_checks": r.checks,
            "crash_points_hit": dict(sorted(r.crash_hits.items())),
            "examples_until_found": r.first_failure_examples,
            "seconds_until_found": None if r.first_failure_seconds is None
            else round(r.first_failure_seconds, 3),
            "seconds": round(self.seconds, 3),
            "steps_per_second": round(r.steps / self.seconds, 1) if self.seconds else 0.0,
        }

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "system": self.system,
            "deduplication": self.deduplication,
            "seed": self.seed,
            **self.stats(),
            "found": self.found,
        }
        if self.trace is not None:
            data["trace"] = self.trace.to_json()
        return data


def explore(
    system: System,
    spawner: Spawner,
    *,
    deduplication: bool = True,
    examples: int = DEFAULT_EXAMPLES,
    steps: int = DEFAULT_STEPS,
    seed_value: int = 0,
    deadline: float = DEFAULT_DEADLINE,
    progress: Callable[[Recorder], None] | None = None,
    statement_crashes: bool = True,
) -> Exploration:
    """Search for a violating trace; shrink it; confirm it by replay."""
    recorder = Recorder(progress=progress)
    machine = outbox_machine(
        system.ref, deduplication=deduplication, spawner=spawner, deadline=deadline,
        examples=examples, steps=steps, recorder=recorder, statement_crashes=statement_crashes,
    )
    settings = machine_settings(examples, steps)
    settings = type(settings)(settings, verbosity=Verbosity.quiet)
    started = time.monotonic()
    failure: BaseException | None = None
    try:
        run_state_machine_as_test(  # type: ignore[no-untyped-call]
            seed(seed_value)(machine), settings=settings
        )
    except (InvariantFailure, Flaky) as error:
        failure = error
    seconds = time.monotonic() - started
    result = Exploration(system.ref, deduplication, seed_value, recorder, seconds)
    if failure is None:
        return result
    trace = Trace(
        system=system.ref,
        deduplication=deduplication,
        steps=list(recorder.last_steps),
        settle=True,
        expected=recorder.last_verdict,
        violations=list(recorder.last_violations),
        meta={
            "found_by": "explore",
            "seed": seed_value,
            "examples": examples,
            "steps_per_example": steps,
            "faultlab": __version__,
            "recorded": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        },
    )
    if isinstance(failure, Flaky):
        result.notes.append(f"Hypothesis reported a flaky failure: {failure}")
    replay = execute(
        system, trace.steps, spawner, deduplication=deduplication, settle=trace.settle,
        deadline=deadline,
    )
    if replay.verdict != trace.expected:
        result.notes.append(
            f"replay showed {replay.verdict.describe()}, recorded "
            f"{trace.expected.describe() if trace.expected else 'nothing'}"
        )
    elif not replay.verdict.clean:
        trace, replay = minimise(system, trace, replay, spawner, deadline=deadline)
    result.trace, result.replay = trace, replay
    return result


def executed_prefix(execution: Execution) -> list[Step]:
    """The steps executed up to the failing check (all of them for a final LIVE)."""
    verdict = execution.verdict
    upto = len(execution.observations) if verdict.step is None else verdict.step
    return [o.step for o in execution.observations[:upto]]


def machine_could_draw(execution: Execution) -> bool:
    """Whether the state machine's rules could have produced this trace.

    A deleted step can leave a direct service call the machine never makes: for an
    operation the caller does not hold, or with a changed payload before the
    operation is complete (the receiver cannot know the accepted payload yet). Such a
    trace would fail on a correct system too, so it is not a smaller finding.
    """
    for observation in execution.observations:
        step = observation.step
        if step.action != "service" or step.operation_id is None:
            continue
        held = observation.before.operation(step.operation_id)
        if held is None:
            return False
        if canonical_json(step.payload) != held.payload and held.state != "complete":
            return False
    return True


def minimise(
    system: System, trace: Trace, execution: Execution, spawner: Spawner, *,
    deadline: float = DEFAULT_DEADLINE,
) -> tuple[Trace, Execution]:
    """Delete single steps while the trace still fails one of the same invariants.

    Hypothesis shrinks the choices that generated the trace; this pass shrinks the
    trace itself, so a finding is 1-minimal (no single step can go) whatever path
    Hypothesis's shrinker took. Each candidate is re-executed on fresh stores, and
    its recovery steps are recomputed, so the result is what replay will show.
    """
    wanted = set(execution.verdict.invariants)
    steps = executed_prefix(execution)
    improved = True
    while improved and len(steps) > 1:
        improved = False
        for index in range(len(steps)):
            candidate = steps[:index] + steps[index + 1:]
            attempt = execute(system, candidate, spawner, deduplication=trace.deduplication,
                              settle=trace.settle, deadline=deadline)
            kept = executed_prefix(attempt)
            if (wanted & set(attempt.verdict.invariants) and len(kept) < len(steps)
                    and machine_could_draw(attempt)):
                steps, execution, improved = kept, attempt, True
                break
    if steps == list(trace.steps):
        return trace, execution
    shrunk = Trace(
        system=trace.system, deduplication=trace.deduplication, steps=steps,
        settle=trace.settle, expected=execution.verdict,
        violations=list(execution.violations),
        meta={**trace.meta, "hypothesis_steps": len(trace.steps)},
    )
    return shrunk, execute(system, steps, spawner, deduplication=trace.deduplication,
                           settle=trace.settle, deadline=deadline)


def _describe(trace: Trace) -> str:
    return trace.expected.describe() if trace.expected else "a failure"


def suite_exploration(
    system: System, spawner: Spawner, *, examples: int, seed: int, deadline: float, fmt: str
) -> dict[str, Any]:
    """suite's exploration phase: the system must be clean; the negative control must be
    caught by ONE, shrunk to exactly 3 steps."""
    clean = explore(system, spawner, examples=examples, seed_value=seed, deadline=deadline)
    stats = clean.stats()
    clean_ok = clean.trace is None
    outcome = "clean" if clean.trace is None else f"FOUND {_describe(clean.trace)}: FAIL"
    lines = [
        f"explore {system.ref}: {stats['examples']} examples, {stats['steps']} steps, "
        f"{stats['sigkills']} SIGKILLs, {stats['seconds']}s: {outcome}"
    ]
    control_ok = True
    control: Exploration | None = None
    if system.supports_no_deduplication:
        control = explore(system, spawner, deduplication=False, examples=examples,
                          seed_value=seed, deadline=deadline)
        trace = control.trace
        steps = len(trace.steps) if trace else 0
        control_ok = bool(trace and trace.expected and "ONE" in trace.expected.invariants
                          and steps == 3)
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
