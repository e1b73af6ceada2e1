"""Shrinking a failing trace: delta debugging over its steps, with real re-execution.

Every candidate costs real processes, so :func:`minimise` never runs the same
candidate twice (a cache keyed by the steps' canonical JSON) and is written over
a ``run`` function: given steps, execute them on fresh stores and return the
:class:`~faultlab.run.executor.Execution`. The search code passes the executor; the
unit tests pass a pure function, so the algorithm is tested in milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable

from faultlab.base.canonical import canonical_json
from faultlab.run.executor import Execution
from faultlab.search.simplify import simplify_data
from faultlab.trace import POWER, Step, Trace

#: The choice a power step shrinks to: no unsynced write survived.
DROP_ALL = {"kind": "drop_all"}

Run = Callable[[list[Step]], Execution]


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


def _key(steps: list[Step]) -> tuple[str, ...]:
    return tuple(canonical_json(step.to_json()) for step in steps)


def minimise(trace: Trace, execution: Execution, run: Run) -> tuple[Trace, Execution]:
    """Shrink the trace itself: delete steps, disarm crashes, while it still fails.

    Delta debugging over the executed steps: remove chunks of half the trace, then
    quarters, down to single steps; then try each armed step without its crash; repeat
    until nothing changes (no single step can go, no crash can be dropped); then simplify
    the data the steps carry (:func:`faultlab.search.simplify.simplify_data`). Each
    candidate is executed (once: results are cached) with its recovery recomputed, so
    the result is exactly what replay shows. Any invariant may fail in the smaller
    trace, as Hypothesis's own shrinker allows (every failure raises the same exception).
    """
    cache: dict[tuple[str, ...], Execution] = {_key(list(trace.steps)): execution}

    def execute(candidate: list[Step]) -> Execution:
        key = _key(candidate)
        if key not in cache:
            cache[key] = run(candidate)
        return cache[key]

    def kept(result: Execution, candidate: list[Step]) -> list[Step]:
        """A step failure keeps the steps up to it; a final one keeps the trace's own steps
        (replay recomputes the recovery)."""
        return result.executed_prefix() if result.verdict.step is not None else list(candidate)

    def attempt(candidate: list[Step], limit: int) -> tuple[Execution, list[Step]] | None:
        result = execute(candidate)
        if result.verdict.clean or not machine_could_draw(result):
            return None
        if len(result.executed_prefix()) >= limit:  # measured in executed steps, recovery too
            return None
        return result, kept(result, candidate)

    steps = kept(execution, list(trace.steps))
    size = len(execution.executed_prefix())

    progress = True
    while progress:
        progress = False
        chunk = max(1, len(steps) // 2)
        while len(steps) > 1:
            improved = False
            start = 0
            while start < len(steps) and len(steps) > 1:
                found = attempt(steps[:start] + steps[start + chunk:], size)
                if found is not None:
                    (execution, steps), improved = found, True
                    size = len(execution.executed_prefix())
                else:
                    start += chunk
            if chunk == 1 and not improved:
                break
            if not improved:
                chunk = max(1, chunk // 2)
        for index, step in enumerate(steps):
            if step.action == POWER and step.choice != DROP_ALL:
                # the simplest power cut loses every unsynced write: try it in its place
                simplest = Step.power(DROP_ALL)
                found = attempt(steps[:index] + [simplest] + steps[index + 1:], size + 1)
                if found is not None:
                    (execution, steps), progress = found, True
                    size = len(execution.executed_prefix())
                    break
            if step.crash is None:
                continue
            disarmed = Step(step.action, step.operation_id, step.payload, None)
            # an equally long trace without the crash is simpler too
            found = attempt(steps[:index] + [disarmed] + steps[index + 1:], size + 1)
            if found is not None:
                (execution, steps), progress = found, True
                size = len(execution.executed_prefix())
                break
    def attempt_as_long(candidate: list[Step]) -> list[Step] | None:
        """Simpler data at the same length is a simpler finding too."""
        nonlocal execution
        found = attempt(candidate, size + 1)
        if found is None:
            return None
        execution = found[0]
        return found[1]

    steps = simplify_data(steps, attempt_as_long)
    if steps == list(trace.steps):
        return trace, execution
    shrunk = Trace(
        system=trace.system, deduplication=trace.deduplication, steps=steps,
        settle=trace.settle, expected=execution.verdict,
        violations=list(execution.violations),
        meta={**trace.meta, "hypothesis_steps": len(trace.steps)},
    )
    return shrunk, execute(steps)
