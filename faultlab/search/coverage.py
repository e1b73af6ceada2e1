"""What a search exercised: crash points armed and fired, invariants checked non-vacuously.

A clean result means little if the crash points never fired or an invariant never
had anything to check; explore and enumerate both print this table (one unit, the
step, with lanes or without), and :func:`vacuity` turns it into explore's "vacuous"
outcome (exit status 4): a run in which no operation was ever accepted, no ticket
made, no operation completed, a fault it was asked to draw was never taken (``power``:
OPEN and DURABLE never checked), or the system's declared crash points were armed and
never fired tested nothing, and must not be reported as clean.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from faultlab.checks.invariants import INVARIANTS
from faultlab.nemesis.crash import statement_point
from faultlab.system.contract import System


class Observed(Protocol):
    """What coverage reads of one executed step (:class:`faultlab.run.observation.Observation`,
    of a sequential or a laned trace): data only, so coverage is tested without processes."""

    @property
    def covered(self) -> frozenset[str]: ...
    @property
    def armed(self) -> str | None: ...
    @property
    def fired(self) -> tuple[str, ...]: ...


def _point_order(name: str) -> tuple[str, int]:
    parsed = statement_point(name)
    return (name, 0) if parsed is None else (parsed[0], parsed[1])


@dataclass
class Coverage:
    """Per crash point the steps that armed it and that it fired at; per invariant the
    steps at which it had something to check (``LIVE``: the recoveries that judged it).
    One unit, the step, for sequential and concurrent traces alike."""

    armed: Counter[str] = field(default_factory=Counter)
    fired: Counter[str] = field(default_factory=Counter)
    checked: Counter[str] = field(default_factory=Counter)

    def observe(self, observation: Observed) -> None:
        """Count one executed step."""
        self.checked.update(observation.covered)
        if observation.armed is not None:
            self.armed[observation.armed] += 1
        self.fired.update(observation.fired)

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

    def invariant_rows(self, faults: Collection[str] = (), *,
                       lanes: bool = False) -> list[list[Any]]:
        """Rows: invariant, times it had something to check; an invariant that applies only
        under a fault the run did not draw (``Invariant.fault``) is left out, and so are the
        history invariants that read announced claims unless the run had lanes (``lanes``:
        a sequential worker announces none)."""
        return [[invariant.name, self.checked[invariant.name]] for invariant in INVARIANTS
                if (invariant.fault is None or invariant.fault in faults)
                and (lanes or not invariant.claims)]


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


#: What a run that draws a fault (``Invariant.fault``: ``power`` under ``--power-loss``)
#: never did when none of the invariants that apply only under that fault ever checked
#: anything: it was asked to test the fault and never did.
FAULT_CAUSES: dict[str, str] = {"power": "no power cut was ever taken"}


def drawn_faults(power_loss: bool) -> tuple[str, ...]:
    """The faults a run draws besides crashes (``Invariant.fault`` names): ``power`` under
    ``--power-loss``. Coverage tables and :func:`vacuity` both take them."""
    return ("power",) if power_loss else ()


def fault_family(fault: str) -> tuple[str, ...]:
    """The invariants that apply only under ``fault`` (``power``: OPEN, DURABLE)."""
    return tuple(invariant.name for invariant in INVARIANTS if invariant.fault == fault)


def vacuous_families(checked: Mapping[str, int], faults: Collection[str] = ()) -> list[str]:
    """Why the invariants had nothing to check, one cause per vacuous family (the first
    cause only once a family's cause already explains the ones after it), then one per
    fault in ``faults`` (those the run drew) whose invariants never checked anything."""
    causes = [cause for names, cause in FAMILIES if not any(checked.get(n, 0) for n in names)]
    causes = causes[:1] if causes and causes[0] == FAMILIES[0][1] else causes
    for fault in sorted(faults):
        names = fault_family(fault)
        if names and not any(checked.get(n, 0) for n in names):
            cause = FAULT_CAUSES.get(fault, f"no {fault} fault was ever taken")
            causes.append(f"{cause} ({' and '.join(names)} never had anything to check)")
    return causes


def vacuity(coverage: Coverage, system: System, examples: int, *, concurrency: int = 1,
            held: int = 0, can_hold: bool = True,
            faults: Collection[str] = ()) -> str | None:
    """Why a clean run tested nothing, as one line, or None when it tested something: no
    example ran; an invariant family was vacuous for the whole run; a fault the run drew
    (``faults``: ``power`` under ``--power-loss``) was never taken, so the invariants that
    apply only under it never checked anything; the system declares
    crash points, some were armed, and none ever fired (its arming does not work); or,
    with lanes (``concurrency`` above 1), workers that can never overlap (``can_hold``
    False: the system announces no point a lane could hold it at, so every worker ran
    to its end before the next one could start; ``held`` counts the steps after which a
    lane was held). A run too short to arm any point, or that held no lane by chance, is
    not blamed for it."""
    if examples == 0:
        return "no example completed"
    causes = vacuous_families(coverage.checked, faults)
    declared = [point.name for point in system.crash_points]
    armed = sum(coverage.armed[name] for name in declared)
    if declared and armed and not any(coverage.fired[name] for name in declared):
        causes.append(f"no declared crash point ever fired (armed {armed} times)")
    if concurrency > 1 and not held and not can_hold:
        causes.append(f"workers never overlapped: no lane was ever held at a point (the "
                      f"system announces none), so --concurrency {concurrency} ran one "
                      "worker at a time")
    return "; ".join(causes) or None
