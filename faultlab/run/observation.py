"""What an executed step shows, and what a whole executed trace showed.

Data only (no process runs here): the replay table, the page, coverage, the recorder and
the shrinker read it, for sequential and laned traces alike."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from faultlab.checks.invariants import (
    STEP_INVARIANTS,
    UNCLAIMED_HISTORY,
    Check,
    Violation,
    covered,
)
from faultlab.process.records import ProcessRecord
from faultlab.stores.sqlite import Snapshot
from faultlab.trace import Step, Verdict

#: How a power step shows as a process record: no process ran.
NO_PROCESS = ProcessRecord(pid=0, exit_code=0, response=None, stdout="", stderr="", elapsed=0.0)


@dataclass(frozen=True)
class Observation:
    """One executed step: the workers that ended at it, both stores before and after, what
    failed and what was checked. One type for every trace: a sequential step's worker is
    its one ``exited`` record; a laned step also shows each lane's state after it."""

    index: int
    step: Step
    before: Snapshot
    snapshot: Snapshot
    violations: tuple[Violation, ...]
    phase: str = "step"
    #: The workers that ended at this step (their ordinal in the trace, their record); a
    #: sequential step's own worker, none for a power cut or a server crash.
    exited: tuple[tuple[int, ProcessRecord], ...] = ()
    #: Each lane's state after the step, as the replay table shows it (none: sequential).
    lanes: tuple[str, ...] = ()
    #: The processes SIGKILLed at this step (workers and the services they started).
    sigkills: int = 0
    #: The processes started at this step (workers and the services they started).
    processes: int = 0
    #: Invariant checks run after the step.
    checks: int = 0
    #: The invariants that had something to check at this step (coverage's unit).
    covered: frozenset[str] = frozenset()
    #: The crash point this step armed (a worker started with one), and the armed points
    #: that fired at it (a worker or its service SIGKILLed there, not by a kill step).
    armed: str | None = None
    fired: tuple[str, ...] = ()
    check: Check | None = field(default=None, compare=False, repr=False)  # what was checked

    @property
    def record(self) -> ProcessRecord:
        """The first worker that ended at this step (a sequential step's own), else
        :data:`NO_PROCESS`."""
        return self.exited[0][1] if self.exited else NO_PROCESS

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(record.pid for _, record in self.exited)

    @property
    def crashed(self) -> bool:
        """The armed point fired: the worker, or the service it started, was SIGKILLed."""
        return bool(self.fired)

    @property
    def held(self) -> int:
        """1 when some lane is held at a point after the step (workers overlap), else 0."""
        return int(any(" @" in state for state in self.lanes))  # as Lane.shown shows it

    @property
    def blocked(self) -> int:
        """The lanes blocked on another lane's lock after the step."""
        return sum(state.endswith("blocked") for state in self.lanes)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "step": self.step.to_json(),
            "record": self.record.to_json(),
            "snapshot": self.snapshot.to_json(),
            "violations": [v.to_json() for v in self.violations],
        }


def worker_observation(index: int, step: Step, record: ProcessRecord, before: Snapshot,
                       after: Snapshot, violations: tuple[Violation, ...], phase: str = "step",
                       check: Check | None = None) -> Observation:
    """A sequential step's observation: its one worker (none for a power cut or a server
    crash), what it SIGKILLed and started, every per-step invariant and each history
    invariant that needs no announced claims (``TERM``, ``ORDER``) checked once."""
    killed = record.killed or record.service_killed
    return Observation(
        index, step, before, after, violations, phase,
        exited=((index, record),) if record.pid != 0 else (),
        sigkills=int(record.killed) + int(record.service_killed),
        processes=int(record.pid != 0) + int(bool(record.service)),
        checks=len(STEP_INVARIANTS) + len(UNCLAIMED_HISTORY),
        covered=frozenset() if check is None else covered(check),
        armed=step.crash,
        fired=(step.crash,) if step.crash is not None and killed else (),
        check=check,
    )


@dataclass
class Execution:
    """A whole trace executed: every observation, the final LIVE check, the verdict.
    ``lanes``: the trace's lanes (0: a sequential trace, run one worker at a time)."""

    observations: list[Observation]
    final_violations: list[Violation]
    lanes: int = 0

    @property
    def verdict(self) -> Verdict:
        return Verdict.first(self.observations, self.final_violations)

    @property
    def violations(self) -> list[Violation]:
        found = [v for o in self.observations for v in o.violations]
        return found + self.final_violations

    def executed_prefix(self) -> list[Step]:
        """The steps a finding is measured and shrunk by, up to the failing check (all of
        them for a clean run or a final LIVE): a sequential trace's executed steps, its
        recovery's included; a laned trace's own scheduling choices (its recovery is
        implicit, the same for every trace)."""
        upto = self.verdict.step
        observations = self.observations if upto is None else self.observations[:upto]
        return [o.step for o in observations if not self.lanes or o.phase == "step"]
