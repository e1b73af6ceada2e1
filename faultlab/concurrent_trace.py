"""Concurrent traces (trace format version 2): lanes, schedule choices, pauses, ticks.

A sequential trace (version 1, :mod:`faultlab.trace`) runs one worker per step,
start to finish. A concurrent trace names *lanes*: up to ``concurrency`` workers
alive at once, each held by faultlab at every named point it reaches. Each step
is one scheduling choice, so the interleaving is data and replays exactly:

* ``run``: start a worker in a free lane and let it run to its end;
* ``start``: start a worker in a free lane; it runs to its first point and holds;
* ``release``: let a held lane run to its next point (or its end);
* ``finish``: let a lane run through its remaining points to its end;
* ``kill``: SIGKILL a lane where it is (held, blocked on a lock, or paused);
* ``pause`` / ``resume``: SIGSTOP / SIGCONT a live lane (a GC pause, a frozen VM);
* ``tick``: advance the trace's virtual clock (:mod:`faultlab.clock`).

A trace recorded with ``"statement_points": true`` also holds a Python worker
before each SQL statement (``sql:K``) and after each COMMIT (``commit:K``), so a
``release`` moves it one statement; the field is written only when true, so
every file recorded without it reads and replays as before.

Version 1 files are read by :class:`faultlab.trace.Trace` as before; :func:`load`
reads either version.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlab.canonical import canonical_json
from faultlab.errors import UsageError
from faultlab.inputs import check_operation_id, read_json_file
from faultlab.invariants import Violation
from faultlab.trace import (
    TRACE_FORMAT,
    Trace,
    Verdict,
    document,
    reading,
    recorded_fields,
    steps_of,
)

TRACE_VERSION_CONCURRENT = 2
LANE_ACTIONS = ("run", "start", "release", "finish", "kill", "pause", "resume", "tick")
STARTS = ("run", "start")
WORKER_ROLES = ("accept", "dispatch", "service")
MAX_TICKS = 1_000_000


@dataclass(frozen=True)
class LaneStep:
    """One scheduling choice; ``run``/``start`` name the worker's role (and operation)."""

    action: str
    lane: int | None = None
    role: str | None = None
    operation_id: str | None = None
    payload: Any = None
    ticks: int | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"action": self.action}
        if self.lane is not None:
            data["lane"] = self.lane
        if self.role is not None:
            data["role"] = self.role
        if self.operation_id is not None:
            data["operation_id"] = self.operation_id
        if self.action in STARTS and self.role in ("accept", "service"):
            data["payload"] = self.payload
        if self.ticks is not None:
            data["ticks"] = self.ticks
        return data

    @classmethod
    def from_json(cls, data: Any) -> LaneStep:
        if not isinstance(data, dict) or data.get("action") not in LANE_ACTIONS:
            raise UsageError(f"not a concurrent trace step: {json.dumps(data)[:80]}")
        lane, role, ticks = data.get("lane"), data.get("role"), data.get("ticks")
        operation_id = data.get("operation_id")
        if lane is not None and (not isinstance(lane, int) or isinstance(lane, bool)):
            raise UsageError(f"step lane must be an integer: {lane!r}")
        if ticks is not None and (not isinstance(ticks, int) or isinstance(ticks, bool)):
            raise UsageError(f"step ticks must be an integer: {ticks!r}")
        if role is not None and not isinstance(role, str):
            raise UsageError(f"step role must be a string: {role!r}")
        if operation_id is not None:
            check_operation_id(operation_id, "step operation_id")
        return cls(data["action"], lane, role, operation_id, data.get("payload"), ticks)

    def validate(self, concurrency: int) -> None:
        """Refuse a step that is malformed whatever the lanes' states (before running)."""
        if self.action == "tick":
            if self.ticks is None or not 0 < self.ticks <= MAX_TICKS:
                raise UsageError(f"tick needs 1 to {MAX_TICKS} ticks, not {self.ticks!r}")
            return
        if self.lane is None or not 1 <= self.lane <= concurrency:
            raise UsageError(
                f"{self.action} needs a lane from 1 to {concurrency}, not {self.lane!r}"
            )
        if self.action not in STARTS:
            return
        if self.role not in WORKER_ROLES:
            raise UsageError(f"{self.action} needs a role ({', '.join(WORKER_ROLES)})")
        if self.role != "dispatch":
            if not self.operation_id:
                raise UsageError(f"{self.action} {self.role} needs an operation_id")
            try:
                canonical_json(self.payload)
            except (TypeError, ValueError) as error:
                raise UsageError(f"{self.role} payload is not JSON: {error}") from None
            if self.payload is None:
                raise UsageError(f"{self.action} {self.role} needs a payload")

    def describe(self) -> str:
        if self.action == "tick":
            return f"tick({self.ticks})"
        if self.action not in STARTS:
            return f"L{self.lane} {self.action}"
        parts = [self.operation_id] if self.operation_id else []
        if self.role != "dispatch":
            parts.append(canonical_json(self.payload))
        return f"L{self.lane} {self.action} {self.role}({', '.join(parts)})"


@dataclass
class ConcurrentTrace:
    """A replayable concurrent trace (format version 2)."""

    system: str
    deduplication: bool
    concurrency: int
    steps: list[LaneStep]
    settle: bool = True
    expected: Verdict | None = None
    violations: list[Violation] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    #: Workers also hold at sql:K and commit:K (:class:`faultlab.lanes.LaneExecutor`).
    statement_points: bool = False

    def to_json(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"concurrency": self.concurrency}
        if self.statement_points:  # absent when false: older files stay byte for byte
            extra["statement_points"] = True
        return document(TRACE_VERSION_CONCURRENT, self, [step.to_json() for step in self.steps],
                        extra)

    @classmethod
    def from_json(cls, data: Any, *, source: str = "trace") -> ConcurrentTrace:
        with reading(source):
            concurrency = data["concurrency"]
            if not isinstance(concurrency, int) or isinstance(concurrency, bool) \
                    or not 1 <= concurrency <= 8:
                raise UsageError(f"concurrency must be an integer from 1 to 8: {concurrency!r}")
            statement_points = data.get("statement_points", False)
            if not isinstance(statement_points, bool):
                raise UsageError(f"statement_points must be a boolean: {statement_points!r}")
            steps = [LaneStep.from_json(step) for step in steps_of(data)]
            for step in steps:
                step.validate(concurrency)
            return cls(concurrency=concurrency, steps=steps, statement_points=statement_points,
                       **recorded_fields(data))


def from_document(data: Any, *, source: str = "trace") -> Trace | ConcurrentTrace:
    """A trace document of either version, already parsed (a file, a Redis corpus entry)."""
    if isinstance(data, dict) and data.get("format") == TRACE_FORMAT \
            and data.get("version") == TRACE_VERSION_CONCURRENT:
        return ConcurrentTrace.from_json(data, source=source)
    return Trace.from_json(data, source=source)


def load(path: Path) -> Trace | ConcurrentTrace:
    """Read a trace file of either version (version 1 exactly as :meth:`Trace.load`)."""
    data = read_json_file(path, "faultlab trace")  # untrusted: bounded, strict, Unicode
    return from_document(data, source=str(path))
