"""Traces and the one executor behind scenarios, exploration and replay.

A trace is a list of steps (``accept``, ``dispatch``, ``service``), each
optionally armed with a crash point. :class:`Executor` runs steps one at a time
on fresh stores: each step is a real worker process, then both stores are read
back and every invariant is checked. Nothing else in faultlab spawns a worker or
reads a store.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from faultlab.canonical import canonical_json
from faultlab.errors import ExecutionError, UsageError
from faultlab.invariants import Check, Model, Violation, check_live, check_step
from faultlab.process import Spawner
from faultlab.records import DEFAULT_DEADLINE, ProcessRecord, WorkerSpec
from faultlab.stores import Snapshot, scratch_directory
from faultlab.system.contract import System, check_crash_point

TRACE_FORMAT = "faultlab-trace"
TRACE_VERSION = 1
ACTIONS = ("accept", "dispatch", "service")
EXIT_USAGE = 2


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
        if crash_point is not None and not isinstance(crash_point, str):
            raise UsageError(f"step crash must be a string: {crash_point!r}")
        if operation_id is not None and not isinstance(operation_id, str):
            raise UsageError(f"step operation_id must be a string: {operation_id!r}")
        return cls(data["action"], operation_id, data.get("payload"), crash_point)

    def describe(self) -> str:
        parts = [self.operation_id] if self.operation_id else []
        if self.action != "dispatch":
            parts.append(canonical_json(self.payload))
        if self.crash:
            parts.append(f"crash={self.crash}")
        return f"{self.action}({', '.join(parts)})"


@dataclass(frozen=True)
class Observation:
    """One executed step: what ran, how the process ended, both stores after it."""

    index: int
    step: Step
    record: ProcessRecord
    before: Snapshot
    snapshot: Snapshot
    violations: tuple[Violation, ...]
    phase: str = "step"
    check: Check | None = field(default=None, compare=False, repr=False)  # what was checked

    @property
    def crashed(self) -> bool:
        """The armed point fired: the worker, or the service it started, was SIGKILLed."""
        if self.step.crash is None:
            return False
        service = (self.record.response or {}).get("service") or {}
        return self.record.killed or service.get("exit_code") == -9

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "step": self.step.to_json(),
            "record": self.record.to_json(),
            "snapshot": self.snapshot.to_json(),
            "violations": [v.to_json() for v in self.violations],
        }


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
        invariants = tuple(str(i) for i in data.get("invariants", ()))
        if not invariants:
            raise UsageError("trace 'expected' is not clean but names no invariant")
        step = None if data.get("final") else int(data["step"])
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
        data: dict[str, Any] = {
            "format": TRACE_FORMAT,
            "version": TRACE_VERSION,
            "system": self.system,
            "deduplication": self.deduplication,
            "settle": self.settle,
            "steps": [step.to_json() for step in self.steps],
        }
        if self.expected is not None:
            data["expected"] = self.expected.to_json()
        if self.violations:
            data["violations"] = [v.to_json() for v in self.violations]
        if self.meta:
            data["meta"] = self.meta
        return data

    @classmethod
    def from_json(cls, data: Any, *, source: str = "trace") -> Trace:
        if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
            raise UsageError(f"{source}: not a faultlab trace (no \"format\": \"{TRACE_FORMAT}\")")
        if data.get("version") != TRACE_VERSION:
            raise UsageError(
                f"{source}: unsupported trace version {data.get('version')!r} "
                f"(this faultlab reads version {TRACE_VERSION})"
            )
        try:
            steps = [Step.from_json(step) for step in data["steps"]]
            system = data["system"]
            if not isinstance(system, str) or not isinstance(data["deduplication"], bool):
                raise TypeError("system must be a string and deduplication a boolean")
            expected = Verdict.from_json(data["expected"]) if "expected" in data else None
            return cls(
                system=system,
                deduplication=data["deduplication"],
                steps=steps,
                settle=bool(data.get("settle", True)),
                expected=expected,
                violations=[Violation.from_json(v) for v in data.get("violations", ())],
                meta=dict(data.get("meta", {})),
            )
        except UsageError as error:
            raise UsageError(f"{source}: {error}") from None
        except (KeyError, TypeError, ValueError) as error:
            raise UsageError(f"{source}: corrupt trace: {error}") from None

    @classmethod
    def load(cls, path: Path) -> Trace:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise UsageError(f"{path}: cannot read: {error.strerror}") from None
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not a faultlab trace (not UTF-8 text)") from None
        try:
            data = json.loads(text)
        except ValueError as error:
            raise UsageError(f"{path}: not a faultlab trace (invalid JSON: {error})") from None
        return cls.from_json(data, source=str(path))


def write_json_atomically(path: Path, data: Any) -> None:
    """Write to a temporary file beside the target and rename, so no reader sees half a file."""
    directory = path.parent if str(path.parent) else Path(".")
    handle, temporary = tempfile.mkstemp(prefix=f".{path.name}.", dir=directory)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(data, stream, indent=2, sort_keys=False)
            stream.write("\n")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def validate_step(system: System, step: Step) -> None:
    """Refuse a step the system cannot run (before anything is executed)."""
    if step.action not in ACTIONS:
        raise UsageError(f"unknown action {step.action!r}")
    if step.action in ("accept", "service"):
        if not step.operation_id:
            raise UsageError(f"{step.action} step needs an operation_id")
        if step.payload is None:
            raise UsageError(f"{step.action} step needs a payload")
        try:
            canonical_json(step.payload)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{step.action} payload is not JSON: {error}") from None
    check_crash_point(system, step.action, step.crash)


class Executor:
    """Runs steps on one set of fresh stores and checks every invariant after each."""

    def __init__(
        self,
        system: System,
        spawner: Spawner,
        *,
        deduplication: bool = True,
        directory: Path | None = None,
        deadline: float = DEFAULT_DEADLINE,
    ) -> None:
        system.require_deduplication_switch(deduplication)
        self.system = system
        self.spawner = spawner
        self.deduplication = deduplication
        self.deadline = deadline
        self._requested_directory = directory
        self._temporary = directory is None
        self.directory = Path()
        self.model = Model()
        self.snapshot = Snapshot()
        self.observations: list[Observation] = []

    @classmethod
    def resume(
        cls, system: System, spawner: Spawner, directory: Path, model: Model,
        snapshot: Snapshot, *, deduplication: bool = True, deadline: float = DEFAULT_DEADLINE,
    ) -> Executor:
        """Continue from stores already in ``directory`` (a branch the caller owns and removes),
        with a copy of the model that produced them."""
        executor = cls(system, spawner, deduplication=deduplication, deadline=deadline)
        executor._temporary = False
        executor.directory = directory
        executor.model = copy.deepcopy(model)
        executor.snapshot = snapshot
        return executor

    def __enter__(self) -> Executor:
        if self._requested_directory is None:
            self.directory = Path(tempfile.mkdtemp(prefix="faultlab-", dir=scratch_directory()))
        else:
            self.directory = self._requested_directory
            self.directory.mkdir(parents=True)
        try:
            self.system.initialise(self.directory)
            self.snapshot = self.system.snapshot(self.directory)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._temporary and self.directory != Path():
            shutil.rmtree(self.directory, ignore_errors=True)

    @property
    def steps(self) -> list[Step]:
        return [observation.step for observation in self.observations]

    def run(self, step: Step, *, phase: str = "step") -> Observation:
        validate_step(self.system, step)
        payload = None if step.action == "dispatch" else canonical_json(step.payload)
        spec = WorkerSpec(
            system=self.system.ref,
            role=step.action,
            directory=str(self.directory),
            operation_id=step.operation_id if step.action != "dispatch" else None,
            payload=payload,
            crash=step.crash,
            deduplication=self.deduplication,
            spawn=self.spawner.mode,
            deadline=self.deadline,
        )
        record = self.system.run_step(spec, self.spawner)
        where = f"step {len(self.observations) + 1} {step.describe()}: worker pid {record.pid}"
        if record.timed_out:
            raise ExecutionError(
                f"{where} missed its {self.deadline:g}s deadline and was killed"
            )
        if record.exit_code == EXIT_USAGE:
            last = (record.stderr.strip().splitlines() or ["no message"])[-1]
            raise ExecutionError(f"{where} refused its input (exit 2): {last}")
        before = self.snapshot
        after = self.system.snapshot(self.directory)
        self.model.observe(step.action, spec.operation_id, payload, record)
        check = Check(
            model=self.model, before=before, after=after, action=step.action,
            operation_id=spec.operation_id, payload=payload, record=record,
            deduplication=self.deduplication,
        )
        self.snapshot = after
        observation = Observation(
            len(self.observations) + 1, step, record, before, after,
            tuple(check_step(check)), phase, check,
        )
        self.observations.append(observation)
        return observation

    def settle(self) -> tuple[list[Observation], list[Violation]]:
        """Recover to quiescence, then check LIVE.

        Dispatch while outbox work is pending; stop early when a dispatch changes
        neither store (recovery is stuck: another attempt would do the same).
        """
        bound = 2 * len(self.snapshot.pending_outbox()) + 2
        observations: list[Observation] = []
        while self.snapshot.pending_outbox() and len(observations) < bound:
            observation = self.run(Step("dispatch"), phase="settle")
            observations.append(observation)
            if observation.violations:
                return observations, []
            if observation.snapshot == observation.before:
                break
        stuck = len(observations) if self.snapshot.pending_outbox() else None
        return observations, check_live(self.snapshot, still_pending_after=stuck)


@dataclass
class Execution:
    """A whole trace executed: every observation, the final LIVE check, the verdict."""

    observations: list[Observation]
    final_violations: list[Violation]

    @property
    def verdict(self) -> Verdict:
        for observation in self.observations:
            if observation.violations:
                return Verdict.of(observation.index, observation.violations)
        return Verdict.of(None, self.final_violations)

    @property
    def violations(self) -> list[Violation]:
        found = [v for o in self.observations for v in o.violations]
        return found + self.final_violations


def execute(
    system: System,
    steps: Iterable[Step],
    spawner: Spawner,
    *,
    deduplication: bool = True,
    settle: bool = False,
    directory: Path | None = None,
    deadline: float = DEFAULT_DEADLINE,
) -> Execution:
    """Run a fixed list of steps on fresh stores; settle afterwards when asked and still clean."""
    steps = list(steps)
    for step in steps:
        validate_step(system, step)
    with Executor(
        system, spawner, deduplication=deduplication, directory=directory, deadline=deadline
    ) as executor:
        for step in steps:
            executor.run(step)
        final: list[Violation] = []
        if settle and not any(o.violations for o in executor.observations):
            _, final = executor.settle()
        return Execution(list(executor.observations), final)
