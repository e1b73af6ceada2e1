"""The contract a system under test implements.

faultlab drives a system only through this class: it initialises the stores,
runs each worker role (accept, dispatch, service) in a real process, and reads
both stores back as the four-table model of :mod:`faultlab.stores.sqlite`. The system
marks its crash points by calling ``context.crash_point(name)`` in worker code;
when that point is armed, the call SIGKILLs the worker's own process.
"""

from __future__ import annotations

import re
import sqlite3
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, Literal, Protocol

from faultlab.base.errors import UsageError
from faultlab.nemesis.crash import is_statement_point
from faultlab.process.records import ProcessRecord, WorkerSpec
from faultlab.stores.sqlite import Snapshot

if TYPE_CHECKING:
    import psycopg

Role = Literal["accept", "dispatch", "service"]
ROLES: tuple[Role, ...] = ("accept", "dispatch", "service")
_POINT_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")


@dataclass(frozen=True)
class CrashPoint:
    """A named place in one worker role where an armed worker SIGKILLs itself.

    ``expected`` documents what a correct system shows after the crash and after
    recovery; ``faultlab systems --system NAME`` prints it for every declared point.
    """

    name: str
    role: Role
    expected: str


def crash_point_problem(points: Iterable[object]) -> str | None:
    """What is wrong with a system's declared crash points (the first problem), or None.

    One rule for every kind of system: Python systems check their ``crash_points`` with
    it when loaded, command-line systems their file's ``crash_points``.
    """
    seen: set[str] = set()
    for point in points:
        if not isinstance(point, CrashPoint):
            return f"crash point {point!r} is not a CrashPoint"
        if not isinstance(point.name, str) or not _POINT_NAME.match(point.name) \
                or is_statement_point(point.name):
            return (f"crash point name {point.name!r} is not a valid point name (letters, "
                    "digits, _ . -; sql:K and commit:K are reserved)")
        if point.role not in ROLES:
            return (f"crash point {point.name!r} has unknown role {point.role!r} "
                    f"(one of: {', '.join(ROLES)})")
        if point.name in seen:
            return f"crash point {point.name!r} is declared twice"
        seen.add(point.name)
    return None


def article(word: str) -> str:
    """``an`` before a vowel (``an accept step``), else ``a`` (``a dispatch step``)."""
    return "an" if word[:1].lower() in "aeiou" and word else "a"


def check_crash_point(system: System, action: str, point: str | None) -> None:
    """Refuse a crash point a step of ``action`` cannot arm on ``system`` (UsageError)."""
    if point is None or is_statement_point(point):
        return
    allowed = [declared.name for declared in system.points_for(action)]
    if point not in allowed:
        raise UsageError(
            f"unknown crash point {point!r} for {article(action)} {action} step of system "
            f"{system.name!r} "
            f"(declared: {', '.join(allowed) or 'none'}; or sql:K, commit:K)"
        )


#: The crash points the five scenarios arm, by the role they play (``suite``). A system whose
#: points carry other names says which of its points plays each role (``scenario_points``).
SCENARIO_ROLES = ("during_accept", "before_dispatch", "after_downstream_commit")


def scenario_point(system: System, role: str) -> str:
    """The system's crash point that plays a scenario role, or a one-line UsageError.

    The scenarios are written with the reference's names; a system maps each role to
    one of its own points (``scenario_points``), and a system without a mapping for a
    role must have a point of that very name.
    """
    mapped = system.scenario_points.get(role, role)
    if system.crash_point(mapped) is None:
        declared = ", ".join(point.name for point in system.crash_points) or "none"
        where = ("its system file's" if system.ref.endswith(".json")
                 else "the system's scenario_points attribute,")
        raise UsageError(
            f"system {system.name!r} has no crash point for the scenario role {role!r}: "
            f"map it in {where} \"scenario_points\": {{\"{role}\": \"<one of: {declared}>\"}}"
        )
    return mapped


class Refusal(Exception):
    """A worker's deliberate refusal: printed as ``{"error": ...}``, exits ``exit_code``."""

    def __init__(self, error: str, exit_code: int, **detail: Any) -> None:
        super().__init__(error)
        self.error = error
        self.exit_code = exit_code
        self.detail = detail

    def response(self) -> dict[str, Any]:
        return {"error": self.error, **self.detail}


class WorkerContext(Protocol):
    """What a worker role gets from faultlab inside its process."""

    directory: Path
    deduplication: bool

    def crash_point(self, name: str) -> None:
        """SIGKILL this process if the step armed ``name``; otherwise return at once."""

    def now(self) -> float:
        """The current time: faultlab's virtual clock in a concurrent trace (and in every
        trace of a ``virtual_wall_clock`` system), else the real one."""

    def claimed(self, operation_id: str, token: int, lease_until: float | None = None) -> None:
        """Tell faultlab this worker holds the claim on an operation with a fencing token,
        leased until ``lease_until`` on :meth:`now`'s clock (None: no lease)."""

    def connect(self, filename: str) -> sqlite3.Connection:
        """Open a store in the run directory that faultlab initialised (marker checked)."""

    def connect_postgres(self, store: str) -> psycopg.Connection[Any]:
        """Open a PostgreSQL store of this trace (marker checked; see faultlab.stores.postgres).

        Only for systems whose ``initialise`` made PostgreSQL stores
        (``faultlab.stores.postgres.create_stores``); the connection is psycopg's default
        (a transaction starts with the first statement; ``commit()`` ends it).
        """

    def call_service(self, operation_id: str, payload: str) -> ProcessRecord:
        """Run the service role as a process of its own, in this worker's process group,
        and wait for it (:func:`faultlab.process.spawn.run_service`)."""


@dataclass(frozen=True)
class Program:
    """A system's own program running one worker, as the system decides it (command-line
    systems): its command line, environment and working directory, and whether it speaks
    the announcement protocol (:mod:`faultlab.nemesis.announce`), holding at each point it
    announces (``points``: the names it may announce).

    Sequential steps (:meth:`System.run_step`) and lanes
    (:class:`faultlab.run.interleaving.Lanes`) start the same program for the same
    spec; only how they answer its announcements differs (a sequential step answers at
    once unless the point is armed, a lane when the schedule releases it).
    """

    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str
    announces: bool = False
    points: frozenset[str] = frozenset()
    #: The tag its PostgreSQL connection strings name it by (``application_name`` ends
    #: ``-worker-<tag>``), or None: a lane registers it with its process
    #: (:func:`faultlab.stores.postgres.command_worker_started`), so a snapshot tells this
    #: live worker's backends from those of workers that have ended.
    backend_tag: str | None = None


class StepRunner(Protocol):
    """How a system runs one step as a real process (faultlab's spawner implements it)."""

    def run(self, spec: WorkerSpec) -> ProcessRecord:
        """Run faultlab's own worker process for ``spec``."""

    def run_program(
        self, argv: Sequence[str], *, deadline: float, env: Mapping[str, str] | None = None,
        cwd: str | None = None, pass_fds: Sequence[int] = (),
        started: Callable[[int], None] | None = None,
    ) -> ProcessRecord:
        """Run a program that is not faultlab as the worker (its own process group)."""


class System(ABC):
    """One implementation of the two-store outbox.

    Subclass it, set ``name``, ``description`` and ``crash_points``, and implement
    the five methods. Worker methods return a JSON object (the worker's response,
    exit status 0) or raise :class:`Refusal`. ``ref`` is how workers find the system
    again in their own process: a registry name or ``package.module:attribute``.
    """

    name: str = ""
    description: str = ""
    crash_points: tuple[CrashPoint, ...] = ()
    supports_no_deduplication: bool = True
    #: False when workers are not faultlab processes (command-line systems): statement
    #: crash points (``sql:K``, ``commit:K``) need faultlab's traced sqlite3 in the worker.
    supports_statement_points: bool = True
    #: A payload field that orders operations (None: no order): the relay must deliver the
    #: operations of one key in acceptance order. Every trace, sequential or concurrent,
    #: checks it (``ORDER``).
    ordering_key: str | None = None
    #: where the stores live: "sqlite" (files in the run directory) or "postgres"
    #: (databases cloned per trace; see faultlab.stores.postgres)
    store_kind: str = "sqlite"
    #: True: in every trace, sequential or concurrent, workers run under libfaketime, so
    #: ``time.time()``, ``datetime.now()`` and ``clock_gettime`` read faultlab's virtual
    #: clock (tick t is 2026-01-01T00:00:00Z + t s; see :mod:`faultlab.base.wall_clock`).
    virtual_wall_clock: bool = False
    #: Which of the system's crash points plays each scenario role (``SCENARIO_ROLES``) in
    #: ``suite``, when its points have names of their own, e.g.
    #: ``{"before_dispatch": "before_send"}``. A role left out keeps its own name.
    scenario_points: Mapping[str, str] = MappingProxyType({})
    #: True when a worker seen asleep can only be waiting for a lock (faultlab's own workers
    #: sleep only in SQLite's busy handler), so a lane sleeping while another is alive is
    #: blocked at once; a system's own programs may sleep for reasons of their own.
    sleeps_only_on_locks: bool = True
    ref: str = ""

    @abstractmethod
    def initialise(self, directory: Path) -> None:
        """Create both stores, empty, in an existing empty directory."""

    @abstractmethod
    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        """Durably accept an operation and its outbox entry (payload is canonical JSON)."""

    @abstractmethod
    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        """Send the oldest pending outbox entry downstream and record its completion."""

    @abstractmethod
    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        """The downstream receiver: create a ticket, deduplicating by operation id."""

    @abstractmethod
    def snapshot(self, directory: Path) -> Snapshot:
        """Read both stores (without writing) into the four-table model."""

    def store_files(self, directory: Path) -> list[Path]:
        """The SQLite files of the run that hold this system's durable state: what a power
        cut rebuilds and what must still open after it. faultlab's own systems name their
        stores ``*.sqlite``."""
        return sorted(directory.glob("*.sqlite"))

    def release(self, directory: Path) -> None:
        """Free what ``initialise`` made outside ``directory`` (PostgreSQL databases).

        Called when the trace ends, before the directory is removed. SQLite systems keep
        everything in the directory and need nothing here.
        """
        return None

    def crash_point(self, name: str) -> CrashPoint | None:
        return next((point for point in self.crash_points if point.name == name), None)

    def points_for(self, action: str) -> tuple[CrashPoint, ...]:
        """Crash points a step of this action may arm (a dispatch also arms its service)."""
        roles = {
            "accept": ("accept",), "dispatch": ("dispatch", "service"), "service": ("service",)
        }
        return tuple(p for p in self.crash_points if p.role in roles.get(action, ()))

    def require_deduplication_switch(self, deduplication: bool) -> None:
        """Refuse to run with deduplication off when the system has no way to switch it."""
        if not deduplication and not self.supports_no_deduplication:
            raise UsageError(f"system {self.ref or self.name!r} cannot switch deduplication off")

    def require_statement_points(self, what: str = "") -> None:
        """Refuse statement points (sql:K, commit:K) for a system whose workers are not
        faultlab's processes: they need faultlab's traced sqlite3 in the worker. One check,
        asked by the executor, the lanes, replay's plan, the command line and the API."""
        if not self.supports_statement_points:
            raise UsageError(f"{what or self.name}: statement scheduling points (sql:K, "
                             "commit:K) need faultlab's own worker processes (a Python "
                             "system)")

    def program(self, spec: WorkerSpec) -> Program | None:
        """The program that runs ``spec`` when this system's workers are programs of its own
        (a command-line system: its argv, environment and announcements, with the step's
        crash point armed as the system arms it), or None: faultlab's own worker process
        runs the role (a Python system). Asked by sequential steps and by lanes alike."""
        return None

    def response(self, spec: WorkerSpec, record: ProcessRecord) -> ProcessRecord:
        """The worker's record with its response read the way this system prints it (a
        command-line system maps its own JSON with ``response_fields``,
        :mod:`faultlab.system.fields`); faultlab's own workers print faultlab's form. Applied
        to every worker's record, sequential or in a lane."""
        return record

    def holds_in_lanes(self) -> bool:
        """Whether a lane can hold this system's worker at a point, so that several workers
        overlap under ``--concurrency``. faultlab's own workers hold at every named point."""
        return bool(self.crash_points)

    def run_step(self, spec: WorkerSpec, runner: StepRunner) -> ProcessRecord:
        """Run one worker as a real process. Python systems run faultlab's own worker."""
        return self.response(spec, runner.run(spec))
