"""Shrinking a failing trace: delta debugging over its steps, with real re-execution.

One engine, :class:`Shrinker`, shrinks every trace: a sequential trace's steps and a
concurrent trace's scheduling choices. Every candidate costs real processes, so it never
runs the same candidate twice (a cache keyed by the steps' canonical JSON), and it is
written over a ``run`` function: given steps, execute them on fresh stores and return the
execution (``None`` when the candidate is not a trace at all). The search code passes the
executor; the unit tests pass a pure function, so the algorithm is tested in milliseconds.

The moves are small functions over a :class:`Shrunk` state, chosen by the kind of trace
(:func:`minimise`):

* :func:`delete`: remove halves, quarters, ... single steps while the trace still fails;
  :func:`delete_pairs`: any two steps of a short trace (both kinds of trace);
* :func:`simplify_one` / :func:`simplify_each`: a step in its simpler form (an armed
  crash disarmed, a power cut that keeps no unsynced write), as long a trace being simpler;
* for scheduling choices, :func:`merge_ticks` (two clock advances as one), :func:`promote`
  (a held start as a run), :func:`hold` (a run as a held start, kept only when it opens
  a deletion) and a renaming of the lanes;
* last, the data the steps carry (:func:`faultlab.search.simplify.simplify_data`).

Any invariant may fail in the smaller trace, as Hypothesis's own shrinker allows.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from faultlab.base.canonical import canonical_json
from faultlab.run.observation import Execution
from faultlab.search.simplify import simplify_data
from faultlab.trace import MAX_TICKS, POWER, Step, Trace

#: The choice a power step shrinks to: no unsynced write survived.
DROP_ALL = {"kind": "drop_all"}


#: Executes a candidate on fresh stores; a laned candidate leniently (a step the
#: candidate left without its worker is dropped), ``None`` when it cannot run at all.
Run = Callable[[list[Step]], Execution | None]


def machine_could_draw(execution: Execution) -> bool:
    """Whether the sequential state machine's rules could have produced this trace.

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


def lanes_could_draw(execution: Execution) -> bool:
    """A concurrent machine draws a direct service call only for an operation the caller
    holds."""
    for observation in execution.observations:
        step = observation.step
        if step.action == "service" and step.operation_id is not None \
                and observation.before.operation(step.operation_id) is None:
            return False
    return True


def length(execution: Execution) -> int:
    """A finding's length, as it is shrunk and reported: a sequential trace's steps executed
    up to the failing check, recovery dispatches included; a laned trace's own
    scheduling choices (its recovery is implicit, the same for every trace)."""
    return len(execution.executed_prefix())


def _key(steps: list[Step]) -> tuple[str, ...]:
    return tuple(canonical_json(step.to_json()) for step in steps)


@dataclass(frozen=True)
class Shrunk:
    """Where shrinking stands: the steps kept, their execution, and its size."""

    steps: list[Step]
    execution: Execution
    size: int


@dataclass
class Shrinker:
    """The engine: a cached ``run`` and how a kind of trace is measured and judged.

    ``size_of`` measures an execution (what a shorter finding means), ``kept`` gives the
    steps to keep of a failing candidate, ``could_draw`` refuses a candidate the state
    machine could never have drawn (it would fail on a correct system too)."""

    run: Callable[[list[Step]], Execution | None]
    size_of: Callable[[Execution], int]
    kept: Callable[[Execution, list[Step]], list[Step]]
    could_draw: Callable[[Execution], bool]
    cache: dict[tuple[str, ...], Execution | None] = field(default_factory=dict)

    def execute(self, candidate: list[Step]) -> Execution | None:
        key = _key(candidate)
        if key not in self.cache:
            self.cache[key] = self.run(candidate)
        return self.cache[key]

    def attempt(self, candidate: list[Step], bound: int) -> Shrunk | None:
        """The candidate as the new state, if it still fails in fewer than ``bound``."""
        result = self.execute(candidate)
        if result is None or result.verdict.clean or not self.could_draw(result):
            return None
        size = self.size_of(result)
        if size >= bound:
            return None
        return Shrunk(self.kept(result, candidate), result, size)

    def start(self, steps: list[Step], execution: Execution, kept: list[Step]) -> Shrunk:
        """Shrinking begins: ``steps`` ran as ``execution``, of which ``kept`` are kept."""
        self.cache.setdefault(_key(steps), execution)
        return Shrunk(kept, execution, self.size_of(execution))


def delete(shrinker: Shrinker, state: Shrunk) -> Shrunk:
    """Delta debugging: remove chunks of half the steps, then quarters, down to single
    steps, while the trace still fails shorter."""
    chunk = max(1, len(state.steps) // 2)
    while True:
        improved = False
        start = 0
        while start < len(state.steps) and len(state.steps) > 1:
            steps = state.steps
            found = shrinker.attempt(steps[:start] + steps[start + chunk:], state.size)
            if found is not None:
                state, improved = found, True
            else:
                start += chunk
        if chunk == 1 and not improved:
            return state
        if not improved:
            chunk = max(1, chunk // 2)


def simpler(step: Step) -> Iterator[Step]:
    """The simpler forms of one step: a power cut that keeps no unsynced write (the
    simplest choice), an armed step without its crash."""
    if step.action == POWER and step.choice != DROP_ALL:
        yield Step.power(DROP_ALL)
    if step.crash is not None:
        yield replace(step, crash=None)


def simplify_one(shrinker: Shrinker, state: Shrunk) -> Shrunk | None:
    """The first step that fails in a simpler form (as long a trace is simpler too), or
    ``None`` when no step can be simpler."""
    steps = state.steps
    for index, step in enumerate(steps):
        for simple in simpler(step):
            found = shrinker.attempt(steps[:index] + [simple] + steps[index + 1:],
                                     state.size + 1)
            if found is not None:
                return found
    return None


def simplify_each(shrinker: Shrinker, state: Shrunk) -> Shrunk:
    """Each step in its simpler form, deleting again after each that still fails."""
    index = 0
    while index < len(state.steps):
        steps = state.steps
        step = steps[index]
        index += 1
        for simple in simpler(step):
            found = shrinker.attempt(steps[:index - 1] + [simple] + steps[index:],
                                     state.size + 1)
            if found is not None:
                state, index = delete(shrinker, found), 0
                break
    return state


def promote(shrinker: Shrinker,
            state: Shrunk
            ) -> Shrunk:
    """A worker started (held) and later released to its end is a worker run: try each
    ``start`` as a ``run`` (deletion then drops the steps left moving its ended lane)."""
    index = 0
    while index < len(state.steps):
        steps = state.steps
        step = steps[index]
        index += 1
        if not step.hold:
            continue
        found = shrinker.attempt(steps[:index - 1] + [replace(step, hold=False)]
                                 + steps[index:], state.size + 1)
        if found is None:
            continue
        smaller = delete(shrinker, found)
        if smaller.size < state.size:
            state, index = smaller, 0
    return state


#: Traces of at most this many steps also try deleting each pair of steps apart
#: (:func:`delete_pairs`): a handful of candidates more per round, where it matters most.
PAIR_STEPS = 8


def delete_pairs(shrinker: Shrinker, state: Shrunk) -> Shrunk:
    """Two steps that only go together (the first work accepted and the dispatch that took
    it, with others between): delete each pair, in a trace short enough
    (:data:`PAIR_STEPS`), where deleting either alone fails to (:func:`delete` tries runs
    of two only as halves of the trace or of its halves)."""
    improved = True
    while improved and len(state.steps) <= PAIR_STEPS:
        improved = False
        steps = state.steps
        for first, second in itertools.combinations(range(len(steps)), 2):
            found = shrinker.attempt(steps[:first] + steps[first + 1:second]
                                     + steps[second + 1:], state.size)
            if found is not None:
                state, improved = delete(shrinker, found), True
                break
    return state


def hold(shrinker: Shrinker, state: Shrunk) -> Shrunk:
    """A worker run that waited on another lane's lock did in effect what a worker started
    and held does, and the steps that held the lock were needed only to make it wait: try
    each ``run`` as a ``start``, then promote and delete again, and keep it only if that
    ends shorter (the two forms are as long, so neither is preferred for its own sake)."""
    index = 0
    while index < len(state.steps):
        steps = state.steps
        step = steps[index]
        index += 1
        if not step.starts or step.hold or step.lane is None:
            continue
        found = shrinker.attempt(steps[:index - 1] + [replace(step, hold=True)]
                                 + steps[index:], state.size + 1)
        if found is None:
            continue
        smaller = delete(shrinker, promote(shrinker, delete(shrinker, found)))
        if smaller.size < state.size:
            state, index = smaller, 0
    return state


def merge_ticks(shrinker: Shrinker,
                state: Shrunk
                ) -> Shrunk:
    """Two clock advances in a row are one: ``tick(a), tick(b)`` as ``tick(a + b)``
    (deletion cannot merge them: either alone falls short of the lease)."""
    index = 0
    while index + 1 < len(state.steps):
        steps = state.steps
        first, second = steps[index], steps[index + 1]
        total = (first.ticks or 0) + (second.ticks or 0)
        if first.action == second.action == "tick" and total <= MAX_TICKS:
            found = shrinker.attempt(steps[:index] + [replace(first, ticks=total)]
                                     + steps[index + 2:], state.size)
            if found is not None:
                state = found
                continue
        index += 1
    return state


def rename(step: Step, renaming: tuple[int, ...]) -> Step:
    """The same step on the lane ``renaming`` maps it to (lane n becomes renaming[n-1])."""
    if step.lane is None:
        return step
    return replace(step, lane=renaming[step.lane - 1])


def _sequential(shrinker: Shrinker,
                state: Shrunk) -> Shrunk:
    """Delete (runs of steps, then pairs apart), then make one step simpler, again until
    none shortens nor simplifies."""
    while True:
        state = delete_pairs(shrinker, delete(shrinker, state))
        simplified = simplify_one(shrinker, state)
        if simplified is None:
            return state
        state = simplified


def _schedule(shrinker: Shrinker,
              state: Shrunk
              ) -> Shrunk:
    """The moves in turn, again while a round shortened the trace: a simplified step or a
    promoted start can open a deletion an earlier move could not make."""
    while True:
        smaller = simplify_each(shrinker, delete_pairs(shrinker, hold(shrinker, promote(
            shrinker, merge_ticks(shrinker, delete(shrinker, state))))))
        if smaller.size >= state.size:
            return smaller
        state = smaller


def _renamed(shrinker: Shrinker,
             state: Shrunk, lanes: int
             ) -> Shrunk:
    """Lanes are interchangeable, but the final recovery finishes them in lane order: the
    same interleaving with the lanes renamed may need fewer choices. Try each renaming,
    shrink it, keep it only if it ends shorter."""
    for renaming in itertools.permutations(range(1, lanes + 1)):
        if list(renaming) == sorted(renaming):
            continue
        found = shrinker.attempt([rename(step, renaming) for step in state.steps],
                                 state.size + 1)  # as long as now, so it may shrink further
        if found is None:
            continue
        smaller = _schedule(shrinker, found)
        if smaller.size < state.size:
            state = smaller
    return state


def _data(shrinker: Shrinker, state: Shrunk) -> Shrunk:
    """Simpler data at the same length is a simpler finding too: ids renamed op-1, op-2, ...
    (a look-alike pair kept together), payloads made as plain as they can be."""
    current = [state]

    def attempt_as_long(candidate: list[Step]) -> list[Step] | None:
        found = shrinker.attempt(candidate, current[0].size + 1)
        if found is None:
            return None
        current[0] = found
        return found.steps

    steps = simplify_data(state.steps, attempt_as_long)
    return replace(current[0], steps=steps)


def _sequential_shrinker(run: Run) -> Shrinker:
    def kept(result: Execution, candidate: list[Step]) -> list[Step]:
        """A step failure keeps the steps up to it; a final one keeps the trace's own steps
        (replay recomputes the recovery)."""
        return result.executed_prefix() if result.verdict.step is not None \
            else list(candidate)

    return Shrinker(run, length, kept, machine_could_draw)


def _schedule_shrinker(run: Run) -> Shrinker:
    return Shrinker(run, length, lambda result, _candidate: result.executed_prefix(),
                    lanes_could_draw)


def minimise(trace: Trace, execution: Execution, run: Run) -> tuple[Trace, Execution]:
    """Shrink a failing trace while it still fails (any invariant) and stays a trace the
    state machine could draw; return the shrunk trace and the execution that showed it.

    A sequential trace is measured in executed steps, recovery included; a concurrent one
    in its own scheduling choices (the recovery is implicit). Each candidate is executed
    once (results are cached) with its recovery recomputed, so the result is what replay
    shows. A sequential trace that cannot shrink comes back as it was; a concurrent one's
    execution is a lenient one (the caller replays the shrunk trace as it is saved).
    """
    if trace.laned != bool(execution.lanes):
        raise TypeError("a trace is shrunk from an execution of its own kind")
    if trace.laned:
        lanes = _schedule_shrinker(run)
        state = _schedule(lanes, lanes.start(
            list(trace.steps), execution,
            execution.executed_prefix() if execution.verdict.step is not None
            else list(trace.steps)))
        state = _data(lanes, _renamed(lanes, state, trace.concurrency))
        return replace(
            trace, steps=state.steps, expected=state.execution.verdict,
            violations=list(state.execution.violations),
            meta={**trace.meta, "hypothesis_steps": len(trace.steps)},
        ), state.execution
    steps = _sequential_shrinker(run)
    original = list(trace.steps)
    shrunk = _data(steps, _sequential(steps, steps.start(
        original, execution, steps.kept(execution, original))))
    if shrunk.steps == original:
        return trace, execution
    final = steps.execute(shrunk.steps)
    if final is None:  # pragma: no cover - a sequential run always returns an execution
        raise TypeError("the shrunk trace did not run")
    return Trace(
        system=trace.system, deduplication=trace.deduplication, steps=shrunk.steps,
        settle=trace.settle, expected=final.verdict, violations=list(final.violations),
        meta={**trace.meta, "hypothesis_steps": len(trace.steps)},
    ), final
