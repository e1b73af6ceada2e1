"""What a worker is asked to do and how it ended: plain data, shared by every layer.

These records cross process boundaries (the fork server's pipe, exec-mode
command lines, corpus evidence), so they hold only JSON-able fields. They live
apart from the spawning machinery in :mod:`faultlab.process.spawn` so that the
checker, the trace format and the systems can name them without depending on
how a process is started.
"""

from __future__ import annotations

import json
import signal
import sys
from dataclasses import dataclass
from typing import Any, Literal

SpawnMode = Literal["fork", "exec"]
SPAWN_MODES: tuple[SpawnMode, ...] = ("fork", "exec")
#: Seconds a worker may run before faultlab kills its process group.
DEFAULT_DEADLINE = 15.0
#: The exit code a parent observes for a child killed by SIGKILL (``-9`` on Linux).
KILLED = -int(signal.SIGKILL)
#: Set for a trace with power steps: the directory a worker's SQLite changes are recorded in
#: (:mod:`faultlab.stores.vfs`), so a power cut can be rebuilt. The worker reads it as it
#: starts its role, so a forked worker sets it itself like the clock files.
POWER_LOG_VARIABLE = "FAULTLAB_POWER_LOG"  # faultlab.stores.vfs.LOG_VARIABLE (not imported: workers
#                                           that do not record must not load the VFS)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs: which system, which role, where, armed how."""

    system: str
    role: str
    directory: str
    operation_id: str | None = None
    payload: str | None = None
    crash: str | None = None
    deduplication: bool = True
    spawn: SpawnMode = "fork"
    deadline: float = DEFAULT_DEADLINE
    #: Extra environment for the worker (the virtual clock's and libfaketime's variables).
    #: In fork mode a preload reaches a worker through a fork server started with it, and
    #: the rest is set in the child (:func:`faultlab.process.spawn.server_environment`);
    #: any other variable makes the worker start by exec.
    environment: tuple[tuple[str, str], ...] = ()

    def argv(self, payload_file: str | None = None) -> list[str]:
        """The ``python -m faultlab worker`` command line for this spec (exec mode), its
        payload read from ``payload_file`` when given (see
        :func:`faultlab.process.spawn.worker_command`)."""
        # OPTION=VALUE: a value that begins with "-" (an id "--crash", a payload -1e300)
        # is still the option's value, not taken for an option of its own
        args = [sys.executable, "-m", "faultlab", "worker", self.role]
        args += [f"--directory={self.directory}", f"--system={self.system}"]
        args += [f"--spawn={self.spawn}", f"--deadline={self.deadline!r}"]
        if self.operation_id is not None:
            args.append(f"--operation-id={self.operation_id}")
        if payload_file is not None:
            args.append(f"--payload-file={payload_file}")
        elif self.payload is not None:
            args.append(f"--payload={self.payload}")
        if self.crash is not None:
            args.append(f"--crash={self.crash}")
        if not self.deduplication:
            args.append("--no-deduplication")
        return args


@dataclass(frozen=True)
class ProcessRecord:
    """How one worker process ended: exit code is -N when killed by signal N."""

    pid: int
    exit_code: int
    response: dict[str, Any] | None
    stdout: str
    stderr: str
    elapsed: float
    timed_out: bool = False
    #: command-line systems (system/fields.py): fields the response lacked, and what the
    #: worker printed when response_fields rewrote it into faultlab's keys
    unknown_fields: dict[str, str] | None = None
    raw_response: dict[str, Any] | None = None

    @property
    def killed(self) -> bool:
        return self.exit_code == KILLED

    @property
    def service(self) -> dict[str, Any]:
        """The record of the service child a dispatcher reported (empty when none)."""
        service = (self.response or {}).get("service")
        return service if isinstance(service, dict) else {}

    @property
    def service_killed(self) -> bool:
        return self.service.get("exit_code") == KILLED

    def to_json(self) -> dict[str, Any]:
        return dict(vars(self))  # flat fields: asdict's deep copy is a cost on every worker

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ProcessRecord:
        return cls(**data)


def parse_response(stdout: str) -> dict[str, Any] | None:
    """The worker's response is the last complete JSON object line it wrote."""
    for line in reversed(stdout.splitlines()):
        line = line.strip()
        if not line.startswith("{"):
            continue
        try:
            value = json.loads(line)
        except ValueError:
            continue
        if isinstance(value, dict):
            return value
    return None
