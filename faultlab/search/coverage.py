"""What a search exercised: crash points armed and fired, invariants checked non-vacuously.

A clean result means little if the crash points never fired or an invariant never
had anything to check; explore and enumerate both print this table.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from faultlab.checks.invariants import INVARIANTS, STEP_INVARIANTS
from faultlab.nemesis.crash import statement_point
from faultlab.run.executor import Observation
from faultlab.system.contract import System


def _point_order(name: str) -> tuple[str, int]:
    parsed = statement_point(name)
    return (name, 0) if parsed is None else (parsed[0], parsed[1])


@dataclass
class Coverage:
    armed: Counter[str] = field(default_factory=Counter)
    fired: Counter[str] = field(default_factory=Counter)
    checked: Counter[str] = field(default_factory=Counter)

    def observe(self, observation: Observation) -> None:
        """Count one executed step, reusing the check context the executor built for it."""
        step = observation.step
        if observation.check is not None:
            for invariant in STEP_INVARIANTS:
                if not invariant.vacuous(observation.check):
                    self.checked[invariant.name] += 1
        if step.crash is not None:
            self.armed[step.crash] += 1
            if observation.crashed:
                self.fired[step.crash] += 1

    def live_checked(self) -> None:
        self.checked["LIVE"] += 1

    def merge(self, other: Coverage) -> None:
        self.armed.update(other.armed)
        self.fired.update(other.fired)
        self.checked.update(other.checked)

    def crash_rows(self, system: System) -> list[list[Any]]:
        """Rows: crash point, times armed, times it fired (declared points first)."""
        names = [p.name for p in system.crash_points]
        names += sorted(set(self.armed) - set(names), key=_point_order)
        return [[name, self.armed[name], self.fired[name]] for name in names]

    def invariant_rows(self) -> list[list[Any]]:
        """Rows: invariant, times it had something to check."""
        return [[invariant.name, self.checked[invariant.name]] for invariant in INVARIANTS]
