"""The trace: steps, verdicts and the corpus file format (JSON, versioned).

A trace is a list of steps (``accept``, ``dispatch``, ``service``), each
optionally armed with a crash point, with the verdict it showed when recorded.
This module is data and its JSON form only; :mod:`faultlab.executor` runs a
trace. The format is faultlab's own, independent of Hypothesis, so a corpus file
replays whatever generated it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from faultlab import inputs
from faultlab.canonical import canonical_json
from faultlab.errors import UsageError
from faultlab.invariants import Violation

TRACE_FORMAT = "faultlab-trace"
TRACE_VERSION = 1
ACTIONS = ("accept", "dispatch", "service")
MAX_STEPS = 10_000


def changed_payload(payload: Any) -> Any:
    """A payload that differs from ``payload``: a retry that changed the request.

    The one resubmission every generator uses (the state machine, the enumerator),
    so a changed payload reads the same in every trace. Generated payloads may carry
    any ``revision`` (or be no object at all, when a system declares its own data).
    """
    if not isinstance(payload, dict):
        return {"value": payload, "revision": 1}
    revision = payload.get("revision", 0)
    number = revision if isinstance(revision, int) and not isinstance(revision, bool) else 0
    return {**payload, "revision": number + 1}


@dataclass(frozen=True)
class Step:
    """One worker run: ``accept``/``service`` name an operation and payload."""

    action: str
    operation_id: str | None = None
    payload: Any = None
    crash: str | None = None

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"action": self.action}
        if self.operation_id is not None:
            data["operation_id"] = self.operation_id
        if self.action != "dispatch":
            data["payload"] = self.payload
        if self.crash is not None:
            data["crash"] = self.crash
        return data

    @classmethod
    def from_json(cls, data: Any) -> Step:
        if not isinstance(data, dict) or data.get("action") not in ACTIONS:
            raise UsageError(f"not a trace step: {json.dumps(data)[:80]}")
        crash_point = data.get("crash")
        operation_id = data.get("operation_id")
        if crash_point is not None and (
            not isinstance(crash_point, str) or not crash_point or len(crash_point) > 200
        ):
            raise UsageError(f"step crash must be a point name: {json.dumps(crash_point)[:80]}")
        if operation_id is not None:
            inputs.check_operation_id(operation_id, "step operation_id")
        return cls(data["action"], operation_id, data.get("payload"), crash_point)

    def describe(self) -> str:
        parts = [self.operation_id] if self.operation_id else []
        if self.action != "dispatch":
            parts.append(canonical_json(self.payload))
        if self.crash:
            parts.append(f"crash={self.crash}")
        return f"{self.action}({', '.join(parts)})"


class Checked(Protocol):
    """An executed step as a verdict sees it (sequential or concurrent)."""

    @property
    def index(self) -> int: ...

    @property
    def violations(self) -> tuple[Violation, ...]: ...


@dataclass(frozen=True)
class Verdict:
    """Which invariants failed first, and where: at a step, or in the final recovery check.

    A final (``LIVE``) verdict carries no step number: recovery may take a different
    number of dispatches on replay, and what matters is that it did not converge.
    """

    step: int | None = None
    invariants: tuple[str, ...] = ()

    @classmethod
    def of(cls, step: int | None, violations: Iterable[Violation]) -> Verdict:
        return cls(step, tuple(dict.fromkeys(v.invariant for v in violations)))

    @classmethod
    def first(cls, observations: Iterable[Checked], final: Iterable[Violation]) -> Verdict:
        """The first step that failed, else the final check: how every execution is judged."""
        for observation in observations:
            if observation.violations:
                return cls.of(observation.index, observation.violations)
        return cls.of(None, final)

    @property
    def clean(self) -> bool:
        return not self.invariants

    @property
    def final(self) -> bool:
        return not self.clean and self.step is None

    def to_json(self) -> dict[str, Any]:
        if self.clean:
            return {"clean": True}
        where: dict[str, Any] = {"final": True} if self.final else {"step": self.step}
        return {"clean": False, **where, "invariants": list(self.invariants)}

    @classmethod
    def from_json(cls, data: Any) -> Verdict:
        if not isinstance(data, dict) or not isinstance(data.get("clean"), bool):
            raise UsageError("trace 'expected' must be an object with a boolean 'clean'")
        if data["clean"]:
            return cls()
        names = data.get("invariants", ())
        if not isinstance(names, list) or not all(isinstance(i, str) for i in names):
            raise UsageError("trace 'expected.invariants' must be a list of names")
        invariants = tuple(names)
        if not invariants:
            raise UsageError("trace 'expected' is not clean but names no invariant")
        if data.get("final") is True:
            return cls(None, invariants)
        step = data.get("step")
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise UsageError(f"trace 'expected.step' must be a step number: {step!r}")
        return cls(step, invariants)

    def describe(self) -> str:
        if self.clean:
            return "clean"
        where = "after recovery" if self.final else f"at step {self.step}"
        return f"{'+'.join(self.invariants)} {where}"


@dataclass
class Trace:
    """A replayable sequence of steps against one system, with what it showed when recorded."""

    system: str
    deduplication: bool
    steps: list[Step]
    settle: bool = True
    expected: Verdict | None = None
    violations: list[Violation] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return document(TRACE_VERSION, self, [step.to_json() for step in self.steps])

    @classmethod
    def from_json(cls, data: Any, *, source: str = "trace") -> Trace:
        if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
            raise UsageError(f"{source}: not a faultlab trace (no \"format\": \"{TRACE_FORMAT}\")")
        version = data.get("version")
        if type(version) is not int or version != TRACE_VERSION:  # True == 1 in Python
            raise UsageError(
                f"{source}: unsupported trace version {json.dumps(version)[:40]} "
                f"(this faultlab reads versions {TRACE_VERSION} and 2)"
            )
        with reading(source):
            return cls(steps=[Step.from_json(step) for step in steps_of(data)],
                       **recorded_fields(data))

    @classmethod
    def load(cls, path: Path) -> Trace:
        """Read a trace file, refusing anything hostile in one line (:mod:`faultlab.inputs`)."""
        data = inputs.read_json_file(path, "faultlab trace")
        return cls.from_json(data, source=str(path))


class Recorded(Protocol):
    """What every trace version records beside its steps."""

    system: str
    deduplication: bool
    settle: bool
    expected: Verdict | None
    violations: list[Violation]
    meta: dict[str, Any]


def document(version: int, trace: Recorded, steps: list[dict[str, Any]],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A trace file's JSON, the same for every version; ``extra`` follows deduplication."""
    data: dict[str, Any] = {
        "format": TRACE_FORMAT,
        "version": version,
        "system": trace.system,
        "deduplication": trace.deduplication,
        **(extra or {}),
        "settle": trace.settle,
        "steps": steps,
    }
    if trace.expected is not None:
        data["expected"] = trace.expected.to_json()
    if trace.violations:
        data["violations"] = [v.to_json() for v in trace.violations]
    if trace.meta:
        data["meta"] = trace.meta
    return data


def steps_of(data: dict[str, Any]) -> list[Any]:
    """A trace document's steps, bounded (each version parses its own kind of step)."""
    steps = data.get("steps")
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise TypeError(f"steps must be a list of at most {MAX_STEPS} steps")
    return steps


def recorded_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The fields every trace version records beside its steps, checked strictly."""
    system = data["system"]
    if not isinstance(system, str) or not system or not isinstance(data["deduplication"], bool):
        raise TypeError("system must be a string and deduplication a boolean")
    if not isinstance(data.get("settle", True), bool):
        raise TypeError("settle must be a boolean")
    if not isinstance(data.get("meta", {}), dict) or not isinstance(
        data.get("violations", []), list
    ):
        raise TypeError("meta must be an object and violations a list")
    return {
        "system": system,
        "deduplication": data["deduplication"],
        "settle": data.get("settle", True),
        "expected": Verdict.from_json(data["expected"]) if "expected" in data else None,
        "violations": [Violation.from_json(v) for v in data.get("violations", ())],
        "meta": dict(data.get("meta", {})),
    }


@contextmanager
def reading(source: str) -> Iterator[None]:
    """Turn whatever a corrupt trace document raises into one line naming the file."""
    try:
        yield
    except UsageError as error:
        raise UsageError(f"{source}: {error}") from None
    except (KeyError, TypeError, ValueError, AttributeError, RecursionError) as error:
        raise UsageError(f"{source}: corrupt trace: {error}") from None


def write_json_atomically(path: Path, data: Any) -> None:
    """Write JSON to a temporary file beside the target and rename (see :mod:`faultlab.output`)."""
    from faultlab.output import write_json

    write_json(path, data)
