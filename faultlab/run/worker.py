"""The inside of a worker process: run one role of one system, print its response.

This is the same code in both spawn modes (a forked child of the fork server,
or ``python -m faultlab worker``). The response is one JSON line on stdout,
written unbuffered, so whatever a worker acknowledged before a SIGKILL is seen.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from faultlab.base import clock
from faultlab.base.errors import EXIT_USAGE
from faultlab.nemesis import crash, schedule
from faultlab.process.records import POWER_LOG_VARIABLE, ProcessRecord, WorkerSpec
from faultlab.process.spawn import (
    exec_worker,
    has_service_spare,
    keep_service_spare,
    release_service_spare,
    run_service,
    server_runs_services,
    zygote_main,
)
from faultlab.stores.sqlite import StoreError, connect
from faultlab.system import REFERENCE, load_system
from faultlab.system.contract import Refusal, System


class Context:
    """The :class:`faultlab.system.contract.WorkerContext` handed to system code."""

    def __init__(self, spec: WorkerSpec, system: System) -> None:
        self.spec = spec
        self.system = system
        self.directory = Path(spec.directory)
        self.deduplication = spec.deduplication

    def crash_point(self, name: str) -> None:
        if self.spec.crash == name:
            crash.kill_self()
        schedule.hold(name)  # a scheduled (concurrent) worker also waits here for its turn

    def now(self) -> float:
        return clock.now()

    def claimed(self, operation_id: str, token: int, lease_until: float | None = None) -> None:
        schedule.claimed(operation_id, token, lease_until)

    def connect(self, filename: str) -> sqlite3.Connection:
        if schedule.active():
            return connect(self.directory / filename, timeout=schedule.SCHEDULED_BUSY_TIMEOUT)
        return connect(self.directory / filename)

    def connect_postgres(self, store: str) -> Any:
        from faultlab.nemesis import pgcrash
        from faultlab.stores import postgres as pgstores

        traced = pgcrash.traced_connection_class() if crash.armed_counter() else None
        return pgstores.connect(self.directory, store, connection_class=traced)

    def call_service(self, operation_id: str, payload: str) -> ProcessRecord:
        point = self.system.crash_point(self.spec.crash or "")
        service_crash = self.spec.crash if point is not None and point.role == "service" else None
        spec = replace(
            self.spec, role="service", operation_id=operation_id, payload=payload,
            crash=service_crash,
        )
        # A recording worker forks no service of its own: a service forked from a
        # recording dispatcher left a WAL database malformed (seen with
        # wal-normal-receiver). The fork server's service spare, or the one a lane's
        # dispatcher forked before it recorded, shares nothing with this process (it
        # installs the recording VFS itself); without either, the service is exec'd.
        if self.spec.spawn == "exec" or (os.environ.get(POWER_LOG_VARIABLE)
                                         and not server_runs_services()
                                         and not has_service_spare()):
            return exec_worker(spec, new_group=False)
        return run_service(spec, run_worker)

    def acknowledge(self, response: dict[str, Any]) -> None:
        """Print a response line now (it counts even if the process dies afterwards)."""
        emit(response)


def emit(response: dict[str, Any]) -> None:
    os.write(1, (json.dumps(response, sort_keys=True) + "\n").encode())


def record_for_power_loss() -> None:
    """Install the recording VFS when the executor asked for it, before any store opens.

    Only then: recording costs a log record per write, and a trace without power steps
    needs none. A forked service inherits the installed VFS; an exec'd one reads the
    variable again (same directory, same log).
    """
    directory = os.environ.get(POWER_LOG_VARIABLE)
    if directory:
        from faultlab.stores import vfs

        vfs.install(directory)


def run_worker(spec: WorkerSpec) -> int:
    """Run the role; return the exit status (0, a refusal's status, or 2 for bad input)."""
    system = load_system(spec.system)
    crash.disarm()  # a forked service must not inherit its dispatcher's statement point
    schedule.disarm()  # nor its dispatcher's scheduling channel
    schedule.arm_from_environment()
    if spec.role == "dispatch" and spec.spawn != "exec" and os.environ.get(
            POWER_LOG_VARIABLE) and not server_runs_services():
        keep_service_spare(run_worker)  # before this process records anything
    try:
        return _run_role(spec, system)
    finally:
        release_service_spare()


def _run_role(spec: WorkerSpec, system: System) -> int:
    record_for_power_loss()
    if spec.crash is not None and crash.is_statement_point(spec.crash):
        crash.arm_statement_point(spec.crash)
    elif schedule.statement_holds_requested():
        crash.observe_statements(schedule.StatementHolds())
    context = Context(spec, system)
    try:
        if spec.role == "accept":
            response = system.accept(context, _required(spec.operation_id), _required(spec.payload))
        elif spec.role == "dispatch":
            response = system.dispatch(context)
        elif spec.role == "service":
            response = system.service(
                context, _required(spec.operation_id), _required(spec.payload)
            )
        else:
            print(f"faultlab worker: unknown role {spec.role!r}", file=sys.stderr)
            return EXIT_USAGE
    except Refusal as refusal:
        emit(refusal.response())
        return refusal.exit_code
    except StoreError as error:
        print(f"faultlab worker: {error}", file=sys.stderr)
        return EXIT_USAGE
    emit(response)
    return 0


def _required(value: str | None) -> str:
    if value is None:
        raise Refusal("missing_argument", EXIT_USAGE)
    return value


def preload() -> None:
    """Import, once in the fork server, every module a reference worker uses.

    A forked worker inherits what the fork server imported; a module it imports
    itself costs that import in every worker process (milliseconds each). Other
    systems are loaded by the fork server when first asked for, before it forks
    their workers. A test runs each role of every built-in system after this and
    ``load_system``, and checks that ``sys.modules`` did not grow.
    """
    load_system(REFERENCE)


def _prepare(spec: WorkerSpec) -> None:
    """Load what the spec's worker needs, once in the fork server, so its children inherit
    it warm: the system and, for a worker that records for power cuts, the recording VFS
    (imported in each worker it cost tens of milliseconds: ctypes, hashlib and the VFS).
    Neither is loaded before a spec needs it: the VFS brings :mod:`threading`, whose
    after-fork hook every later fork runs."""
    load_system(spec.system)
    if any(name == POWER_LOG_VARIABLE for name, _ in spec.environment):
        _load_recording()


def prepare_lanes(system: str, *recording: str) -> None:
    """The lanes' helper's preparation: the fork server's image (:func:`preload`), the
    trace's system and, when ``recording`` is given (``"power"``: the first trace's lanes
    record for power cuts), the recording VFS, loaded before it forks a lane's worker."""
    preload()
    load_system(system)
    if recording:
        _load_recording()


def _load_recording() -> None:
    """Load the recording VFS here, before the children that record are forked: its
    module, SQLite through ctypes and the VFS's structure (:func:`faultlab.stores.vfs.preload`)."""
    from faultlab.stores import vfs

    vfs.preload()


def run_lane_worker(spec: WorkerSpec, environment: dict[str, str],
                    channel: tuple[int, int]) -> int:
    """The body of a lane's worker, forked by the lanes' helper
    (:class:`faultlab.process.starter.Starter`, whose image holds this module) after
    :func:`faultlab.process.spawn.child_main` gave it its own group and pipes: the
    schedule's channel (its two descriptors as numbered in this process) and the clock's
    variables, then the worker."""
    os.environ.update(environment)
    os.environ[schedule.SCHEDULE_ENV] = f"{channel[0]},{channel[1]}"
    return run_worker(spec)


def serve_forks() -> None:
    """The fork server's entry point (:data:`faultlab.process.spawn.FORK_SERVER_ENTRY`)."""
    preload()
    zygote_main(run_worker, _prepare)
