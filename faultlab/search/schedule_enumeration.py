"""``enumerate --concurrency N``: every interleaving of a small workload, up to a bound.

The workload: ``operations`` operations accepted first (one ordering key, so
order matters), then every sequence of at most ``max_steps`` scheduling choices
over the lanes: start a dispatcher in any free lane, start a direct delivery of
the first operation in any free lane, start the acceptor of a new operation
(``op-{operations + 1}``, ... , same key; at most ``acceptors`` times) in any
free lane, held at its first point (an acceptance that commits late, after
later ones), release a held lane to its next point, SIGKILL a held lane (at most
``crashes`` times), advance the virtual clock past a lease (at most ``ticks``
times). Each sequence runs on
fresh stores in :class:`faultlab.run.executor.Executor`, every invariant checked
after every step, then the final recovery and ``LIVE``.

Reduction: after its choices run, a sequence's state is the stores, every
lane's worker and point, the clock and the claims taken; a sequence that
reaches a state an earlier one reached is not extended, so interleavings that
commute (the same state by another order) are explored once. Sequences run
shortest first, so the first finding is a shortest one.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from faultlab.base.errors import UsageError
from faultlab.checks.invariants import Violation
from faultlab.process.records import DEFAULT_DEADLINE
from faultlab.process.spawn import Spawner
from faultlab.process.spawn import spawner as open_spawner
from faultlab.run.executor import Executor
from faultlab.run.observation import Execution
from faultlab.search.coverage import Coverage
from faultlab.system.contract import System
from faultlab.trace import Step

PAYLOAD: dict[str, Any] = {"title": "backlog"}
#: The clock advance a ``tick`` choice makes: past any lease of the reference's length.
TICK = 10
#: How many new operations' acceptors a sequence may start and hold (two: one acceptance
#: committing before another that took its position earlier).
ACCEPTORS = 2


@dataclass
class ConcurrentEnumeration:
    """What the enumeration ran and found."""

    sequences: int = 0
    pruned: int = 0
    states: int = 0
    steps: int = 0
    seconds: float = 0.0
    finding: list[Step] | None = None
    execution: Execution | None = None
    by_depth: dict[int, int] = field(default_factory=dict)
    #: crash points armed and fired and the invariants that had something to check, counted
    #: in steps as every search counts them (a run is vacuous when a family of invariants
    #: never did: :func:`faultlab.search.coverage.vacuity`)
    coverage: Coverage = field(default_factory=Coverage)


def workload(operations: int) -> list[Step]:
    return [Step("accept", f"op-{n}", PAYLOAD, lane=1) for n in range(1, operations + 1)]


def _choices(executor: Executor, steps: list[Step], crashes: int,
             ticks: int, operations: int, acceptors: int) -> list[Step]:
    kills = sum(step.action == "kill" for step in steps)
    advanced = sum(step.action == "tick" for step in steps)
    held = sum(step.hold and step.action == "accept" for step in steps)
    found: list[Step] = []
    acceptor: list[Step] = []  # tried last at each depth: the workload's own work first
    for number in range(1, executor.concurrency + 1):
        lane = executor.lanes.get(number)
        if lane is None or not lane.alive:
            found.append(Step("dispatch", lane=number, hold=True))
            if "op-1" in executor.model.acknowledged:
                # as the search machines do: a second delivery of an accepted operation
                # (of one never acknowledged, KEY would blame the system for faultlab's
                # own delivery)
                found.append(Step("service", "op-1", PAYLOAD, lane=number, hold=True))
            if held < acceptors:
                acceptor.append(Step("accept", f"op-{operations + held + 1}", PAYLOAD,
                                     lane=number, hold=True))
        elif lane.status == "held" and not lane.paused:
            found.append(Step("release", lane=number))
            if kills < crashes:
                found.append(Step("kill", lane=number))
    if advanced < ticks and any(lane.alive for lane in executor.lanes.values()):
        found.append(Step("tick", ticks=TICK))
    return found + acceptor


def _state(executor: Executor) -> tuple[Any, ...]:
    lanes = tuple(
        (n, lane.spec.role, lane.spec.operation_id, lane.status, lane.point, lane.paused)
        for n, lane in sorted(executor.lanes.items()) if lane.alive
    )
    claims = tuple(sorted((c.lane, c.operation_id, c.token, c.lease_until)
                          for c in executor.history.claims))
    clock = executor.clock.ticks if executor.clock is not None else 0
    return executor.snapshot, lanes, claims, clock, tuple(executor.model.acknowledged.items())


def _run(system: System, runner: Spawner, prefix: list[Step], choices: list[Step], *,
         concurrency: int, deduplication: bool, deadline: float, crashes: int, ticks: int,
         operations: int, acceptors: int, coverage: Coverage,
         ) -> tuple[Execution, tuple[Any, ...] | None, list[Step]]:
    """Run a sequence through ``runner`` on fresh stores; its state before the recovery
    (None if it failed earlier) and the choices that follow from that state. Counts its
    steps (its recovery's too) in ``coverage``."""
    with Executor(
            system, runner, concurrency=concurrency, laned=True, deduplication=deduplication,
            deadline=deadline) as executor:
        for step in prefix + choices:
            if executor.run(step).violations:
                return _counted(executor, [], coverage), None, []
        state = _state(executor)
        following = _choices(executor, choices, crashes, ticks, operations, acceptors)
        _, final = executor.settle()
        return _counted(executor, final, coverage), state, following


def _counted(executor: Executor, final: list[Violation], coverage: Coverage
             ) -> Execution:
    """The sequence's execution, its steps (recovery included) counted in ``coverage``."""
    for observation in executor.observations:
        coverage.observe(observation)
    if "LIVE" in executor.checked:
        coverage.live_checked()
    return Execution(list(executor.observations), final, executor.concurrency)


def enumerate_concurrent(
    system: System, *, concurrency: int = 2, operations: int = 2, max_steps: int = 3,
    crashes: int = 1, ticks: int = 1, acceptors: int = ACCEPTORS, deduplication: bool = True,
    spawner: Spawner | None = None, deadline: float = DEFAULT_DEADLINE,
    progress: Callable[[str], None] | None = None,
) -> ConcurrentEnumeration:
    """Breadth first over choice sequences; stop at the first (shortest) finding.

    Every sequence starts its workers through ``spawner`` (else a fork-mode spawner
    opened for the enumeration and closed at its end): one fork server and one lanes'
    helper for the whole walk, not one per sequence."""
    system.require_deduplication_switch(deduplication)
    if concurrency < 2:
        raise UsageError("enumerate --concurrency needs at least 2 lanes")
    if spawner is None:
        with open_spawner("fork") as opened:
            return _breadth_first(system, opened, concurrency, operations, max_steps,
                                  crashes, ticks, acceptors, deduplication, deadline, progress)
    return _breadth_first(system, spawner, concurrency, operations, max_steps, crashes, ticks,
                          acceptors, deduplication, deadline, progress)


def _breadth_first(
    system: System, runner: Spawner, concurrency: int, operations: int, max_steps: int,
    crashes: int, ticks: int, acceptors: int, deduplication: bool, deadline: float,
    progress: Callable[[str], None] | None,
) -> ConcurrentEnumeration:
    result = ConcurrentEnumeration()
    started = time.monotonic()
    prefix = workload(operations)
    seen: set[tuple[Any, ...]] = set()
    frontier: list[list[Step]] = [[]]
    for depth in range(max_steps + 1):
        following: list[list[Step]] = []
        for choices in frontier:
            steps = prefix + choices
            execution, state, nexts = _run(
                system, runner, prefix, choices, concurrency=concurrency,
                deduplication=deduplication, deadline=deadline, crashes=crashes, ticks=ticks,
                operations=operations, acceptors=acceptors, coverage=result.coverage,
            )
            result.sequences += 1
            result.steps += len(execution.observations)
            result.by_depth[depth] = result.by_depth.get(depth, 0) + 1
            if not execution.verdict.clean:
                result.finding, result.execution = steps, execution
                result.seconds = time.monotonic() - started
                return result
            if state is None or state in seen:
                result.pruned += 1
                continue
            seen.add(state)
            if depth < max_steps:
                following += [choices + [step] for step in nexts]
        result.states = len(seen)
        if progress is not None:
            progress(f"enumerate: depth {depth}: {result.sequences} sequences, "
                     f"{result.states} states, {result.pruned} pruned, "
                     f"{time.monotonic() - started:.1f}s")
        frontier = following
        if not frontier:
            break
    result.seconds = time.monotonic() - started
    return result

