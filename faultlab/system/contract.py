"""The contract a system under test implements.

faultlab drives a system only through this class: it initialises the stores,
runs each worker role (accept, dispatch, service) in a real process, and reads
both stores back as the four-table model of :mod:`faultlab.stores`. The system
marks its crash points by calling ``context.crash_point(name)`` in worker code;
when that point is armed, the call SIGKILLs the worker's own process.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol

from faultlab.stores import Snapshot

if TYPE_CHECKING:
    import sqlite3

    from faultlab.process import ProcessRecord, Spawner, WorkerSpec

Role = Literal["accept", "dispatch", "service"]
ROLES: tuple[Role, ...] = ("accept", "dispatch", "service")


@dataclass(frozen=True)
class CrashPoint:
    """A named place in one worker role where an armed worker SIGKILLs itself.

    ``expected`` documents what a correct system shows after the crash and after
    recovery; it is printed by ``faultlab points`` and in the README.
    """

    name: str
    role: Role
    expected: str


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

    def connect(self, filename: str) -> sqlite3.Connection:
        """Open a store in the run directory that faultlab initialised (marker checked)."""

    def call_service(self, operation_id: str, payload: str) -> ProcessRecord:
        """Run the service role as a child process of this worker and wait for it."""


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

    def crash_point(self, name: str) -> CrashPoint | None:
        return next((point for point in self.crash_points if point.name == name), None)

    def points_for(self, action: str) -> tuple[CrashPoint, ...]:
        """Crash points a step of this action may arm (a dispatch also arms its service)."""
        roles = {
            "accept": ("accept",), "dispatch": ("dispatch", "service"), "service": ("service",)
        }
        return tuple(p for p in self.crash_points if p.role in roles.get(action, ()))

    def run_step(self, spec: WorkerSpec, spawner: Spawner) -> ProcessRecord:
        """Run one worker as a real process. Python systems use faultlab's spawner."""
        return spawner.run(spec)
