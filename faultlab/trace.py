"""The trace: steps, verdicts and the corpus file format (JSON, versioned).

A trace is a list of steps (``accept``, ``dispatch``, ``service``), each optionally armed
with a crash point, with the verdict it showed when recorded. A laned trace (version 2)
names lanes: several workers alive at once, each step one scheduling choice (see the
section below); a sequential trace (version 1) is its one-lane case, one :class:`Trace` of
:class:`Step` either way. This module is data and its JSON form only;
:mod:`faultlab.run.executor` runs a trace (:func:`~faultlab.run.executor.execute_trace`).
The format is faultlab's own, independent of Hypothesis, so a corpus file replays whatever
generated it.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from faultlab.base import inputs
from faultlab.base.canonical import canonical_json
from faultlab.base.errors import UsageError
from faultlab.base.inputs import MAX_CONCURRENCY, check_operation_id
from faultlab.checks.invariants import Violation
from faultlab.stores.power_choice import parse_choice

if TYPE_CHECKING:
    from faultlab.base.output import Kind

#: How a trace file as faultlab writes it begins (see :func:`trace_file`).
TRACE_SIGNATURE = re.compile(rb'\{\s*"format":\s*"faultlab-trace"')


def trace_file() -> Kind:
    """A trace file as an output kind: the only file a finding of the same name replaces
    (the same finding, byte for byte or but for its recorded versions), and what an export
    leaves alone; never another program's file. (Made on use: the fork server imports
    this module, and :mod:`faultlab.base.output` would bring ``tempfile`` into every
    worker.)"""
    from faultlab.base.output import Kind

    return Kind("a faultlab trace", (TRACE_SIGNATURE,))


def is_trace_file(path: Path) -> bool:
    """Whether ``path`` (through a link) is a regular file that begins as a trace file:
    what a finding of that name may replace, and an export leave alone."""
    try:
        return path.is_file() and trace_file().made(path)
    except OSError:
        return False


TRACE_FORMAT = "faultlab-trace"
TRACE_VERSION = 1
ACTIONS = ("accept", "dispatch", "service")
#: A power cut of the machine between two workers (:mod:`faultlab.stores.vfs`): not a
#: worker, so not in :data:`ACTIONS`; its ``choice`` says which unsynced changes survive.
POWER = "power"
#: The private PostgreSQL server crashes between two workers (every server process
#: SIGKILLed) and restarts through crash recovery: not a worker either, and only with
#: ``--postgres private`` (:func:`faultlab.stores.postgres.crash_server`).
SERVER_CRASH = "server_crash"
STEP_ACTIONS = (*ACTIONS, POWER, SERVER_CRASH)
MAX_STEPS = 10_000

# Trace format version 2: lanes, schedule choices, pauses, ticks.
#
# A sequential trace (version 1) runs one worker per step, start to finish: it is the
# one-lane case. A laned trace names *lanes*: up to ``concurrency`` workers alive at
# once, each held by faultlab at every named point it reaches. Each step is one
# scheduling choice, so the interleaving is data and replays exactly. Its file spells a
# worker's start with its role:
#
# * ``run``: start a worker in a free lane and let it run to its end;
# * ``start``: start a worker in a free lane; it runs to its first point and holds;
# * ``release``: let a held lane run to its next point (or its end);
# * ``finish``: let a lane run through its remaining points to its end;
# * ``kill``: SIGKILL a lane where it is (held, blocked on a lock, or paused);
# * ``pause`` / ``resume``: SIGSTOP / SIGCONT a live lane (a GC pause, a frozen VM);
# * ``tick``: advance the trace's virtual clock (:mod:`faultlab.base.clock`).
# * ``server_crash``: the private PostgreSQL server crashes and restarts (no lane);
# * ``drop_connection``: the server ends a live lane's sessions; its worker runs on.
#
# A ``run`` or ``start`` may arm a crash point (``crash``) as a sequential step does:
# the worker dies there by SIGKILL (its own, or the announcement nemesis's), which is
# how a command-line system armed by argument, whose workers never hold, crashes in a
# laned trace at all. The field is written only when set.
#
# A trace recorded with ``"statement_points": true`` also holds a Python worker
# before each SQL statement (``sql:K``) and after each COMMIT (``commit:K``), so a
# ``release`` moves it one statement; the field is written only when true.
#
# In memory both versions are one :class:`Trace` of :class:`Step` (a ``run`` or
# ``start`` is a step whose action is the worker's role, in its lane, ``hold`` for a
# start), and each is written back byte for byte in the version it was read in.

TRACE_VERSION_CONCURRENT = 2
#: Lane L's PostgreSQL session is terminated by the server while its worker lives on (a
#: dropped connection: a network blip, a proxy restart, an idle timeout); only on
#: faultlab's own server (:func:`faultlab.stores.postgres.drop_worker_connections`).
DROP_CONNECTION = "drop_connection"
LANE_ACTIONS = ("run", "start", "release", "finish", "kill", "pause", "resume", "tick",
                SERVER_CRASH, DROP_CONNECTION, POWER)
#: How a laned file spells a worker's start.
STARTS = ("run", "start")
MAX_TICKS = 1_000_000


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


#: What a laned step may do besides starting a worker (see the version 2 section below).
SCHEDULING = ("release", "finish", "kill", "pause", "resume", "tick", DROP_CONNECTION)


@dataclass(frozen=True)
class Step:
    """One step of a trace: a worker's run, a scheduling choice, or a fault with no worker.

    ``accept``/``dispatch``/``service`` start a worker in ``lane`` (lane 1 when the trace
    is sequential: ``lane`` None) and name its operation and payload; with ``hold`` it
    runs to its first scheduling point and holds there, otherwise it runs to its end. Any
    of them may arm a crash point (``crash``). ``release``, ``finish``, ``kill``,
    ``pause``, ``resume`` and ``drop_connection`` act on a lane; ``tick`` advances the
    trace's virtual clock by ``ticks``. A ``power`` step is no worker: the machine loses
    power after the previous step, and ``choice`` (the VFS choice JSON, e.g.
    ``{"kind": "drop_all"}``) says which unsynced writes reached the disk; a
    ``server_crash`` crashes faultlab's own PostgreSQL server.

    A sequential trace is the one-lane case: its steps name no lane and never hold, and
    its file (version 1) spells a worker's run by its role alone, as it always has.
    """

    action: str
    operation_id: str | None = None
    payload: Any = None
    crash: str | None = None
    choice: dict[str, Any] | None = None
    #: The lane that moves: None in a sequential trace (its one lane).
    lane: int | None = None
    #: A started worker runs to its first scheduling point and holds there.
    hold: bool = False
    ticks: int | None = None

    @property
    def starts(self) -> bool:
        """Whether the step starts a worker (in its lane, or the one lane)."""
        return self.action in ACTIONS

    @property
    def role(self) -> str | None:
        """The role of the worker the step starts (None: it starts none)."""
        return self.action if self.action in ACTIONS else None

    @property
    def laned(self) -> bool:
        """Whether the step needs a laned (version 2) trace to be written."""
        return self.lane is not None or self.hold or self.action in SCHEDULING

    @property
    def lane_number(self) -> int:
        """The lane that moves (1 for a sequential step); 0 for a step that moves none."""
        if self.lane is not None:
            return self.lane
        return 1 if self.starts else 0

    def to_json(self) -> dict[str, Any]:
        """The step as its file writes it: a laned step (it names a lane, holds or
        schedules) as version 2 does (:meth:`to_lane_json`), any other as version 1 does.
        Either way its JSON says everything the step is (shrinking and corpus names key on
        it)."""
        if self.laned:
            return self.to_lane_json()
        if self.action == POWER:
            return {"action": POWER, "choice": dict(self.choice or {})}
        if self.action == SERVER_CRASH:
            return {"action": SERVER_CRASH}
        data: dict[str, Any] = {"action": self.action}
        if self.operation_id is not None:
            data["operation_id"] = self.operation_id
        if self.action != "dispatch":
            data["payload"] = self.payload
        if self.crash is not None:
            data["crash"] = self.crash
        return data

    def to_lane_json(self) -> dict[str, Any]:
        """The step as a laned (version 2) file writes it: a worker's run is ``run`` or
        ``start`` with its ``role``."""
        if self.action == POWER:
            return {"action": POWER, "choice": dict(self.choice or {})}
        data: dict[str, Any] = {"action": ("start" if self.hold else "run")
                                if self.starts else self.action}
        if self.starts:  # a sequential step, in a laned trace, runs in lane 1
            data["lane"] = self.lane_number
            data["role"] = self.action
        elif self.lane is not None:
            data["lane"] = self.lane
        if self.operation_id is not None:
            data["operation_id"] = self.operation_id
        if self.action in ("accept", "service"):
            data["payload"] = self.payload
        if self.crash is not None:  # absent when unarmed: older files stay byte for byte
            data["crash"] = self.crash
        if self.ticks is not None:
            data["ticks"] = self.ticks
        return data

    @classmethod
    def from_json(cls, data: Any) -> Step:
        """A step of a sequential (version 1) file."""
        if not isinstance(data, dict) or data.get("action") not in STEP_ACTIONS:
            raise UsageError(f"not a trace step: {json.dumps(data)[:80]}")
        if data["action"] == POWER:
            return cls.power(data.get("choice"))
        if data["action"] == SERVER_CRASH:
            return cls(SERVER_CRASH, **_no_worker_fields(data))
        # what to_json writes for the action, nothing more: a hand edit ("lane" on a
        # sequential step, a dispatch's payload) would otherwise be dropped unseen
        _no_worker_fields(data, ("operation_id", "crash") if data["action"] == "dispatch"
                          else ("operation_id", "payload", "crash"))
        operation_id = data.get("operation_id")
        if operation_id is not None:
            inputs.check_operation_id(operation_id, "step operation_id")
        return cls(data["action"], operation_id, data.get("payload"), _crash_point(data))

    @classmethod
    def from_lane_json(cls, data: Any) -> Step:
        """A step of a laned (version 2) file: ``run``/``start`` with a role, or a
        scheduling choice."""
        if not isinstance(data, dict) or data.get("action") not in LANE_ACTIONS:
            raise UsageError(f"not a concurrent trace step: {json.dumps(data)[:80]}")
        action = data["action"]
        if action == SERVER_CRASH:
            return cls(SERVER_CRASH, **_no_worker_fields(data))
        if action == POWER:
            _no_worker_fields(data, ("choice",))
            return cls.power(data.get("choice"))
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
        crash_point = _crash_point(data)
        if action in STARTS:
            if role not in ACTIONS:
                raise UsageError(f"{action} needs a role ({', '.join(ACTIONS)})")
            worker = ("lane", "role", "operation_id", "crash", "ticks")
            _no_worker_fields(data, worker if role == "dispatch" else (*worker, "payload"))
            return cls(role, operation_id, data.get("payload"), crash_point, lane=lane,
                       hold=action == "start", ticks=ticks)
        if crash_point is not None:
            raise UsageError(f"only run and start arm a crash point, not {action}")
        # a hand edit that the next save would silently drop
        _no_worker_fields(data, ("lane", "ticks"))
        return cls(action, lane=lane, ticks=ticks)

    @classmethod
    def power(cls, choice: Any) -> Step:
        """A power step, its choice checked as :func:`faultlab.stores.vfs.power_image` will."""
        try:
            parse_choice(choice)
        except ValueError as error:
            raise UsageError(f"power step: {error}") from None
        return cls(POWER, choice=dict(choice))

    def validate(self, concurrency: int) -> None:
        """Refuse a laned step that is malformed whatever the lanes' states (before running)."""
        if self.crash is not None and not self.starts:
            raise UsageError(f"only run and start arm a crash point, not {self.action}")
        if self.action in (SERVER_CRASH, POWER):
            return  # names no lane: every live lane dies, or loses its connections
        if self.action == "tick":
            if self.ticks is None or not 0 < self.ticks <= MAX_TICKS:
                raise UsageError(f"tick needs 1 to {MAX_TICKS} ticks, not {self.ticks!r}")
            return
        if self.lane is None or not 1 <= self.lane <= concurrency:
            shown = ("start" if self.hold else "run") if self.starts else self.action
            raise UsageError(
                f"{shown} needs a lane from 1 to {concurrency}, not {self.lane!r}"
            )
        if not self.starts or self.action == "dispatch":
            return
        shown = "start" if self.hold else "run"
        if not self.operation_id:
            raise UsageError(f"{shown} {self.action} needs an operation_id")
        try:
            canonical_json(self.payload)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{self.action} payload is not JSON: {error}") from None
        if self.payload is None:
            raise UsageError(f"{shown} {self.action} needs a payload")

    def describe(self) -> str:
        """The step as tables show it: ``accept(op-1, {...})`` in a sequential trace,
        ``L2 start accept(op-1, {...})`` in a laned one."""
        if self.action == POWER:
            return f"power({canonical_json(self.choice)})"
        if self.action == SERVER_CRASH:
            return SERVER_CRASH
        if self.action == "tick":
            return f"tick({self.ticks})"
        if not self.starts:
            return f"L{self.lane} {self.action}"
        parts = [self.operation_id] if self.operation_id else []
        if self.action != "dispatch":
            parts.append(canonical_json(self.payload))
        if self.crash:
            parts.append(f"crash={self.crash}")
        run = f"{self.action}({', '.join(parts)})"
        if self.lane is None and not self.hold:
            return run
        return f"L{self.lane} {'start' if self.hold else 'run'} {run}"


def _crash_point(data: dict[str, Any]) -> str | None:
    crash_point = data.get("crash")
    if crash_point is not None and (
        not isinstance(crash_point, str) or not crash_point or len(crash_point) > 200
    ):
        raise UsageError(f"step crash must be a point name: {json.dumps(crash_point)[:80]}")
    return crash_point


def _no_worker_fields(data: dict[str, Any], allowed: tuple[str, ...] = ()) -> dict[str, Any]:
    """Refuse a step's keys beyond ``action`` and ``allowed`` (a server fault names no
    worker, a dispatch has no payload): a hand edit that would otherwise be silently
    dropped on the next save."""
    extra = sorted(set(data) - {"action", *allowed})
    if extra:
        article = "an" if str(data["action"])[:1] in "aeiou" else "a"
        raise UsageError(f"{article} {data['action']} step takes no {', '.join(extra)}")
    return {}


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
        final = data.get("final", False)
        if not isinstance(final, bool):
            raise UsageError(f"trace 'expected.final' must be a boolean: {final!r}"[:120])
        if final:
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
    """A replayable sequence of steps against one system, with what it showed when recorded.

    ``concurrency`` lanes (1: a sequential trace, one worker at a time). A trace is
    *laned* when it schedules lanes (more than one, statement points, or any step that
    names a lane, holds or schedules): it is written as version 2 and run by the lane
    executor; any other trace is written as version 1, byte for byte as always.
    """

    system: str
    deduplication: bool
    steps: list[Step]
    settle: bool = True
    expected: Verdict | None = None
    violations: list[Violation] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)
    #: ``"finding"``: the recorded finding is expected (see :data:`EXPECT_FINDING`);
    #: ``"flaky"``: it did not happen again when re-run (see :data:`EXPECT_FLAKY`).
    expect: str | None = None
    concurrency: int = 1
    #: Workers also hold at sql:K and commit:K (:class:`faultlab.run.executor.Executor`).
    statement_points: bool = False

    @property
    def laned(self) -> bool:
        """Whether the trace schedules lanes (version 2), or runs one worker at a time."""
        return self.concurrency > 1 or self.statement_points \
            or any(step.laned for step in self.steps)

    @property
    def version(self) -> int:
        return TRACE_VERSION_CONCURRENT if self.laned else TRACE_VERSION

    def to_json(self) -> dict[str, Any]:
        if not self.laned:
            return document(TRACE_VERSION, self, [step.to_json() for step in self.steps])
        extra: dict[str, Any] = {"concurrency": self.concurrency}
        if self.statement_points:  # absent when false: older files stay byte for byte
            extra["statement_points"] = True
        return document(TRACE_VERSION_CONCURRENT, self,
                        [step.to_lane_json() for step in self.steps], extra)

    @classmethod
    def from_json(cls, data: Any, *, source: str = "trace") -> Trace:
        """A trace document of either version, already parsed (a file, a Redis entry)."""
        if not isinstance(data, dict) or data.get("format") != TRACE_FORMAT:
            raise UsageError(f"{source}: not a faultlab trace (no \"format\": \"{TRACE_FORMAT}\")")
        version = data.get("version")
        # True == 1 and 2.0 == 2 in Python: only the integers are versions
        if type(version) is not int or version not in (TRACE_VERSION, TRACE_VERSION_CONCURRENT):
            raise UsageError(
                f"{source}: unsupported trace version {json.dumps(version)[:40]} "
                f"(this faultlab reads versions {TRACE_VERSION} and {TRACE_VERSION_CONCURRENT})"
            )
        with reading(source):
            if version == TRACE_VERSION:
                return not_empty(cls(steps=[Step.from_json(step) for step in steps_of(data)],
                                     **recorded_fields(data)))
            concurrency = required(data, "concurrency")
            if not isinstance(concurrency, int) or isinstance(concurrency, bool) \
                    or not 1 <= concurrency <= MAX_CONCURRENCY:
                raise UsageError(f"concurrency must be an integer from 1 to {MAX_CONCURRENCY}: "
                                 f"{concurrency!r}")
            statement_points = data.get("statement_points", False)
            if not isinstance(statement_points, bool):
                raise UsageError(f"statement_points must be a boolean: {statement_points!r}")
            steps = [Step.from_lane_json(step) for step in steps_of(data)]
            for step in steps:
                step.validate(concurrency)
            return not_empty(cls(concurrency=concurrency, steps=steps,
                                 statement_points=statement_points, **recorded_fields(data)))

    @classmethod
    def load(cls, path: Path) -> Trace:
        """Read a trace file of either version, refusing anything hostile in one line (see
        :mod:`faultlab.base.inputs`)."""
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
    expect: str | None


#: A trace's top-level ``"expect": "finding"``: its finding is there on purpose (a zoo
#: mutant's, the negative control's), so replay passes while it reproduces. A trace without
#: the field is a regression test: replay fails while the finding reproduces and passes once
#: the bug is fixed (the trace replays clean), as a saved Hypothesis example does.
EXPECT_FINDING = "finding"
#: A trace's top-level ``"expect": "flaky"``: an invariant failed when it was explored, but
#: not again when the example was re-run. ``explore`` keeps such a trace apart from the
#: corpus, for inspection; replay never judges it as a regression test (a clean replay is
#: not "fixed"), and the pytest plugin skips it.
EXPECT_FLAKY = "flaky"


def document(version: int, trace: Recorded, steps: list[dict[str, Any]],
             extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A trace file's JSON, the same for every version; ``extra`` follows deduplication."""
    data: dict[str, Any] = {
        "format": TRACE_FORMAT,
        "version": version,
        "system": trace.system,
        # written only when set: a file without it reads (and is written) as before
        **({"expect": trace.expect} if trace.expect is not None else {}),
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


def required(data: dict[str, Any], key: str) -> Any:
    """A key every trace document of its version has: refused by name when missing."""
    if key not in data:
        raise UsageError(f"trace has no {json.dumps(key)}")
    return data[key]


def not_empty(trace: Trace) -> Trace:
    """A trace read from a document, refused when it has no steps, or only ticks of the
    clock: replaying it would run nothing, check nothing and still be judged clean
    (nothing faultlab writes is either)."""
    if not trace.steps:
        raise UsageError("trace has no steps: it would test nothing")
    if all(step.action == "tick" for step in trace.steps):
        raise UsageError("trace only moves the clock: it would test nothing")
    return trace


def steps_of(data: dict[str, Any]) -> list[Any]:
    """A trace document's steps, bounded (each version parses its own kind of step)."""
    steps = required(data, "steps")
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise TypeError(f"steps must be a list of at most {MAX_STEPS} steps")
    return steps


def recorded_fields(data: dict[str, Any]) -> dict[str, Any]:
    """The fields every trace version records beside its steps, checked strictly."""
    system = required(data, "system")
    if not isinstance(system, str) or not system \
            or not isinstance(required(data, "deduplication"), bool):
        raise TypeError("system must be a string and deduplication a boolean")
    if not isinstance(data.get("settle", True), bool):
        raise TypeError("settle must be a boolean")
    if not isinstance(data.get("meta", {}), dict) or not isinstance(
        data.get("violations", []), list
    ):
        raise TypeError("meta must be an object and violations a list")
    expect = data.get("expect")
    if expect is not None and expect not in (EXPECT_FINDING, EXPECT_FLAKY):
        raise UsageError(f"trace 'expect' must be {EXPECT_FINDING!r} (an expected finding), "
                         f"{EXPECT_FLAKY!r} (a failure that did not happen again) or absent "
                         f"(a regression test), not {json.dumps(expect)[:40]}")
    expected = Verdict.from_json(data["expected"]) if "expected" in data else None
    if expected is not None and expected.final and data.get("settle") is False:
        raise UsageError("trace 'expected' is a finding after recovery ('final') but "
                         "'settle' is false: without the recovery it would never be judged")
    return {
        "system": system,
        "deduplication": data["deduplication"],
        "settle": data.get("settle", True),
        "expected": expected,
        "violations": [Violation.from_json(v) for v in data.get("violations", ())],
        "meta": dict(data.get("meta", {})),
        "expect": expect,
    }


@contextmanager
def reading(source: str) -> Iterator[None]:
    """Turn whatever a corrupt trace document raises into one line naming the file."""
    try:
        yield
    except UsageError as error:
        raise UsageError(f"{source}: {error}") from None
    except KeyError as error:  # a nested object without a key it needs, named as such
        raise UsageError(f"{source}: corrupt trace: missing key {error}") from None
    except (TypeError, ValueError, AttributeError, RecursionError) as error:
        raise UsageError(f"{source}: corrupt trace: {error}") from None


def write_json_atomically(path: Path, data: Any) -> None:
    """Write JSON to a temporary file beside the target and rename (see
    :mod:`faultlab.base.output`)."""
    from faultlab.base.output import write_json

    write_json(path, data)
