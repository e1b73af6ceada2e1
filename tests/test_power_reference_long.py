"""The reference keeps what it acknowledged through 10,000 power cuts (slow).

Random traces (a fixed seed) of accepts, retries, resubmissions, dispatches crashed at
every named point, direct deliveries, each followed by a power cut with a choice drawn
from every kind explore draws; every step is checked, every trace recovered to
quiescence and checked for LIVE. The reference commits with ``synchronous=EXTRA``: a
single violation is a defect in it or a false alarm in faultlab, and this test fails.
"""

from __future__ import annotations

import random

import pytest

from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.search.machine import POWER_CHOICES
from faultlab.system import load_system
from faultlab.trace import POWER, Step, changed_payload

POWER_CUTS = 10_000
STEPS_PER_TRACE = 10  # worker steps; a power cut follows each


def _trace(chance: random.Random, points: list[str]) -> list[Step]:
    steps: list[Step] = []
    accepted: list[str] = []
    for _ in range(STEPS_PER_TRACE):
        kind = chance.choice(["accept", "accept", "retry", "resubmit", "dispatch",
                              "dispatch", "crash", "crash", "service"])
        if kind == "accept" or not accepted:
            operation = f"op-{len(accepted) + 1}"
            accepted.append(operation)
            step = Step("accept", operation, {"title": f"task {operation}"})
        elif kind == "retry":
            operation = chance.choice(accepted)
            step = Step("accept", operation, {"title": f"task {operation}"})
        elif kind == "resubmit":
            operation = chance.choice(accepted)
            step = Step("accept", operation, changed_payload({"title": f"task {operation}"}))
        elif kind == "dispatch":
            step = Step("dispatch")
        elif kind == "crash":
            step = Step("dispatch", crash=chance.choice(points))
        else:
            operation = chance.choice(accepted)
            step = Step("service", operation, {"title": f"task {operation}"})
        steps += [step, Step.power(chance.choice(POWER_CHOICES))]
    return steps


@pytest.mark.slow
def test_the_reference_stays_clean_through_ten_thousand_power_cuts(
        fork_spawner: Spawner) -> None:
    system = load_system("reference")
    points = [point.name for point in system.points_for("dispatch")]
    chance = random.Random(0)
    cuts = 0
    acknowledged = 0
    while cuts < POWER_CUTS:
        steps = _trace(chance, points)
        execution = execute(system, steps, fork_spawner, settle=True)
        assert execution.verdict.clean, (steps, [str(v) for v in execution.violations])
        cuts += sum(1 for observation in execution.observations
                    if observation.step.action == POWER)
        last = execution.observations[-1].check
        assert last is not None
        acknowledged += len(last.model.acknowledged)
    assert cuts >= POWER_CUTS
    assert acknowledged > POWER_CUTS // 10  # the cuts had something acknowledged to lose
