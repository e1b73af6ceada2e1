"""What a search exercised: crash points armed and fired, invariants checked non-vacuously.

A clean result means little if the crash points never fired or an invariant never
had anything to check; explore and enumerate both print this table, and
:func:`vacuity` turns it into explore's "vacuous" outcome (exit status 4): a run in
which no operation was ever accepted, no ticket made, no operation completed, or the
system's declared crash points were armed and never fired tested nothing, and must
not be reported as clean.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
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

    def invariant_rows(self, faults: Collection[str] = ()) -> list[list[Any]]:
        """Rows: invariant, times it had something to check; an invariant that applies only
        under a fault the run did not draw (``Invariant.fault``) is left out."""
        return [[invariant.name, self.checked[invariant.name]] for invariant in INVARIANTS
                if invariant.fault is None or invariant.fault in faults]


#: Invariants grouped by what the run must have done for any of them to check something
#: (each :class:`~faultlab.checks.invariants.Invariant`'s ``vacuous`` rule): a family of
#: which no member ever checked anything means the run never exercised that part of the
#: outbox, whatever its examples were. In order: each family's cause implies the next.
FAMILIES: tuple[tuple[tuple[str, ...], str], ...] = (
    (("ATOM", "PAIR", "ACK"),
     "no operation was ever accepted (the caller store stayed empty and no accept was "
     "acknowledged)"),
    (("ONE", "RCPT", "KEY", "PAY"), "no ticket was ever made downstream"),
    (("DONE",), "no operation was ever complete"),
)


def vacuous_families(checked: Mapping[str, int]) -> list[str]:
    """Why the invariants had nothing to check, one cause per vacuous family (the first
    cause only once a family's cause already explains the ones after it)."""
    causes = [cause for names, cause in FAMILIES if not any(checked.get(n, 0) for n in names)]
    return causes[:1] if causes and causes[0] == FAMILIES[0][1] else causes


def vacuity(coverage: Coverage, system: System, examples: int) -> str | None:
    """Why a clean sequential run tested nothing, as one line, or None when it tested
    something: no example ran, an invariant family was vacuous for the whole run, or the
    system declares crash points, some were armed, and none ever fired (its arming does
    not work). A run too short to arm any point is not blamed for it."""
    if examples == 0:
        return "no example completed"
    causes = vacuous_families(coverage.checked)
    declared = [point.name for point in system.crash_points]
    armed = sum(coverage.armed[name] for name in declared)
    if declared and armed and not any(coverage.fired[name] for name in declared):
        causes.append(f"no declared crash point ever fired (armed {armed} times)")
    return "; ".join(causes) or None


def concurrent_vacuity(checked: Mapping[str, int], examples: int, held: int,
                       concurrency: int, *, can_hold: bool = True) -> str | None:
    """Why a clean concurrent run tested nothing, as one line, or None: as
    :func:`vacuity` (``checked`` counts examples per invariant), and workers that can
    never overlap (``can_hold`` False: the system announces no point a lane could hold it
    at, so every worker runs to its end before the next one can start). A run that held
    no lane by chance (a short budget) is not blamed for it."""
    if examples == 0:
        return "no example completed"
    causes = vacuous_families(checked)
    if not held and not can_hold:
        causes.append(f"workers never overlapped: no lane was ever held at a point (the "
                      f"system announces none), so --concurrency {concurrency} ran one "
                      "worker at a time")
    return "; ".join(causes) or None
