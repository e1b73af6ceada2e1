"""Command-line systems: an outbox in any language, described by a JSON file.

``--system path/to/system.json`` names a system whose workers are programs
faultlab knows nothing about. The file says how to run each role, how a crash
point is armed, which crash points exist, and how to read the stores (SQLite files
or PostgreSQL databases) into faultlab's four-table model (see examples/README.md
for every key)::

    {
      "name": "standalone-outbox",
      "commands": {
        "init":     ["{python}", "{system_dir}/outbox.py", "init", "--dir", "{directory}"],
        "accept":   ["{python}", "{system_dir}/outbox.py", "accept", "--dir", "{directory}",
                     "--id", "{operation_id}", "--payload", "{payload}"],
        "dispatch": ["{python}", "{system_dir}/outbox.py", "dispatch", "--dir", "{directory}"],
        "service":  ["{python}", "{system_dir}/outbox.py", "service", "--dir", "{directory}",
                     "--id", "{operation_id}", "--payload", "{payload}"]
      },
      "crash": {"mode": "argument", "arguments": ["--crash", "{crash}"]},
      "crash_points": [{"name": "before_dispatch", "role": "dispatch", "expected": "..."}],
      "stores": {"caller": "orders.db", "downstream": "tickets.db"},
      "snapshot": {
        "operations": {"store": "caller", "query": "SELECT id, payload, state, result FROM ..."},
        "outbox":     {"store": "caller", "query": "..."},
        "tickets":    {"store": "downstream", "query": "..."},
        "receipts":   {"store": "downstream", "query": "..."}
      },
      "no_deduplication": {"arguments": ["--no-dedup"]}
    }

Crash points are armed in one of two ways:

* ``"mode": "argument"``: the step's command gets ``crash.arguments`` (and
  ``crash.environment``) with ``{crash}`` replaced by the point's name; the
  worker SIGKILLs itself when it reaches that point.
* ``"mode": "announce"``: the worker announces each crash point it reaches and
  waits; faultlab's nemesis (:mod:`faultlab.nemesis.announce`) answers or kills it.

The file (:mod:`faultlab.system.description`) is checked completely when it is
loaded, and the system is probed once (``init`` in a fresh temporary directory,
then every snapshot query), so a bad description is a one-line error (exit 2)
before anything is created.
Snapshots open the stores read-only (``mode=ro`` and ``PRAGMA query_only``).
"""

from __future__ import annotations

import os
import shutil
import sqlite3
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from faultlab.base import interrupt
from faultlab.base.errors import ExecutionError, UsageError
from faultlab.base.messages import printable
from faultlab.nemesis import crash
from faultlab.nemesis.announce import ANNOUNCE_FD_VARIABLE, RESUME_FD_VARIABLE, Announcements
from faultlab.process.records import DEFAULT_DEADLINE, ProcessRecord, WorkerSpec
from faultlab.process.spawn import Spawner, run_command
from faultlab.stores.sqlite import BUSY_TIMEOUT, TABLES, Snapshot, uri
from faultlab.system.contract import (
    ROLES,
    Program,
    Refusal,
    StepRunner,
    System,
    WorkerContext,
)
from faultlab.system.description import (
    COLUMNS,
    COMMANDS,
    NULLABLE,
    Description,
    Reader,
    read_description,
    resolve_program,
    static_values,
    substitute,
)

#: how long ``init`` may run (the load-time probe and each trace's fresh stores): the
#: command's --deadline, set by the CLI before it loads a system
_init_deadline = DEFAULT_DEADLINE


def set_init_deadline(seconds: float) -> None:
    """The deadline for every ``init`` run from now on (``--deadline`` of the command)."""
    global _init_deadline
    _init_deadline = seconds


#: SQLite virtual-machine instructions between two calls of a snapshot's progress handler
#: (a few microseconds of work: a deadline or a signal is seen at once).
_PROGRESS_INSTRUCTIONS = 1000

_READ_ACTIONS = frozenset({
    sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION,
    getattr(sqlite3, "SQLITE_RECURSIVE", 33),
})


def _read_only(action: int, first: str | None, second: str | None, database: str | None,
               trigger: str | None) -> int:
    """SQLite authorizer for snapshot queries: reading tables and calling functions only."""
    if action in _READ_ACTIONS and not (action == sqlite3.SQLITE_FUNCTION
                                        and second == "load_extension"):
        return sqlite3.SQLITE_OK
    return sqlite3.SQLITE_DENY


# --- the system --------------------------------------------------------------------------------


class CommandSystem(System):
    """A system whose workers are external programs, described by a JSON file."""

    supports_statement_points = False
    sleeps_only_on_locks = False  # a program may sleep for reasons of its own

    def holds_in_lanes(self) -> bool:
        """Only a program that announces its points can be held at them."""
        return self.config.crash is not None and self.config.crash.mode == "announce"

    def __init__(self, description: Description) -> None:
        self.config = description
        self.virtual_wall_clock = description.virtual_wall_clock
        self.name = description.name
        self.description = description.description
        self.crash_points = description.crash_points
        self.scenario_points = dict(description.scenario_points)
        self.supports_no_deduplication = description.no_deduplication is not None
        self.payload_schema = description.payload_schema
        self.operation_id_pattern = description.operation_id_pattern
        reader = Reader(description.path)
        self.programs = {role: resolve_program(reader, description, role) for role in COMMANDS}
        if description.postgres:
            from faultlab.stores import postgres as pgstores

            pgstores.psycopg_module()  # a one-line error now if psycopg is missing
            self.store_kind = "postgres"

    # -- commands --------------------------------------------------------------------------------

    def argv(self, role: str, values: Mapping[str, str], *, crash_point: str | None = None,
             deduplication: bool = True) -> list[str]:
        """The command line for one role (crash and no-deduplication arguments appended)."""
        argv = [self.programs[role]]
        argv += [substitute(arg, values) for arg in self.config.commands[role][1:]]
        arming = self.config.crash
        if crash_point is not None and arming is not None and arming.mode == "argument":
            armed = {**values, "crash": crash_point}
            argv += [substitute(arg, armed) for arg in arming.arguments]
        switch = self.config.no_deduplication
        if not deduplication and switch is not None and role in ("dispatch", "service"):
            argv += [substitute(arg, values) for arg in switch.arguments]
        return argv

    def environment(self, values: Mapping[str, str], *, crash_point: str | None = None,
                    deduplication: bool = True) -> dict[str, str]:
        env = dict(os.environ)
        env.pop(ANNOUNCE_FD_VARIABLE, None)
        env.pop(RESUME_FD_VARIABLE, None)
        env.update((key, substitute(text, values)) for key, text in self.config.environment)
        arming = self.config.crash
        if crash_point is not None and arming is not None and arming.mode == "argument":
            armed = {**values, "crash": crash_point}
            env.update((key, substitute(text, armed)) for key, text in arming.environment)
        switch = self.config.no_deduplication
        if not deduplication and switch is not None:
            env.update((key, substitute(text, values)) for key, text in switch.environment)
        return env

    def values(self, directory: Path, operation_id: str | None = None,
               payload: str | None = None, *, backend_tag: str = "cmd") -> dict[str, str]:
        values = {**static_values(self.config), "directory": str(directory.resolve())}
        if self.config.postgres:
            from faultlab.system.command_pg import dsn_values

            values.update(dsn_values(directory, backend_tag))
        if operation_id is not None:
            values["operation_id"] = operation_id
        if payload is not None:
            values["payload"] = payload
        return values

    def program(self, spec: WorkerSpec) -> Program:
        """The role's command for ``spec``: argv, environment (the file's, the spec's clock
        variables, the crash point armed by argument and environment in argument mode, the
        deduplication switch), and whether it announces its points. Sequential steps and
        lanes start exactly this."""
        if spec.crash is not None and crash.is_statement_point(spec.crash):
            raise UsageError(
                f"system {self.name!r} is a command-line system: statement crash points "
                f"({spec.crash}) need faultlab's own worker process; arm a declared point"
            )
        if spec.role not in ROLES:
            raise UsageError(f"unknown role {spec.role!r}")
        directory = Path(spec.directory)
        tag = None
        if self.config.postgres:  # its backends named for it (a lane registers the tag)
            from faultlab.stores import postgres as pgstores

            tag = pgstores.command_worker_tag()
        values = self.values(directory, spec.operation_id, spec.payload,
                             backend_tag=tag or "cmd")
        argv = self.argv(spec.role, values, crash_point=spec.crash,
                         deduplication=spec.deduplication)
        env = self.environment(values, crash_point=spec.crash, deduplication=spec.deduplication)
        env.update(spec.environment)
        announces = self.config.crash is not None and self.config.crash.mode == "announce"
        return Program(tuple(argv), env, str(directory), announces,
                       frozenset(point.name for point in self.crash_points), backend_tag=tag)

    def response(self, spec: WorkerSpec, record: ProcessRecord) -> ProcessRecord:
        """The program's own JSON read through the file's ``response_fields``."""
        return self.config.response_fields.apply(spec.role, record)

    def run_step(self, spec: WorkerSpec, runner: StepRunner) -> ProcessRecord:
        """Run the role's command as a real process, arming the step's crash point."""
        program = self.program(spec)
        if not program.announces:
            record = runner.run_program(program.argv, deadline=spec.deadline, env=program.env,
                                        cwd=program.cwd)
            return self.response(spec, record)
        with Announcements(spec.crash, program.points) as announcements:
            record = runner.run_program(
                program.argv, deadline=spec.deadline,
                env={**program.env, **announcements.environment()}, cwd=program.cwd,
                pass_fds=announcements.child_fds(), started=announcements.start,
            )
        if announcements.errors:
            raise ExecutionError(
                f"system {self.name!r}: {spec.role} worker (pid {record.pid}) broke the "
                f"announcement protocol: {announcements.errors[0]}"
            )
        return self.response(spec, record)

    # -- stores ----------------------------------------------------------------------------------

    def initialise(self, directory: Path) -> None:
        self._initialise(directory, ExecutionError)

    def _initialise(self, directory: Path, error: type[Exception]) -> None:
        if self.config.postgres:
            from faultlab.system.command_pg import initialise

            initialise(self, directory, error)
            return
        values = self.values(directory)
        record = run_command(
            self.argv("init", values), deadline=_init_deadline, env=self.environment(values),
            cwd=str(directory),
        )
        if record.timed_out:
            raise error(f"system {self.name!r}: init command missed its {_init_deadline:g}s "
                        "deadline (--deadline) and was killed")
        if record.exit_code != 0:
            last = printable((record.stderr.strip().splitlines() or ["no message on stderr"])[-1],
                             200)
            raise error(f"system {self.name!r}: init command exited {record.exit_code}: {last}")
        for store, filename in self.config.stores.items():
            if not (directory / filename).is_file():
                raise UsageError(
                    f"system {self.name!r}: store {store} ({filename}) does not exist after init"
                )

    def release(self, directory: Path) -> None:
        if self.config.postgres:
            from faultlab.stores import postgres as pgstores

            pgstores.release_stores(directory)

    def snapshot(self, directory: Path) -> Snapshot:
        """Run each table's query on its store, opened read-only."""
        if self.config.postgres:
            from faultlab.system.command_pg import snapshot

            return snapshot(self, directory)
        connections: dict[str, sqlite3.Connection] = {}
        tables: dict[str, Iterable[Iterable[Any]]] = {}
        deadline = self.snapshot_deadline
        ends = time.monotonic() + deadline
        stopped: list[str] = []

        def progress() -> int:
            """Asked by SQLite every thousand instructions: a query that never ends (a
            recursive CTE that loops once the outbox has rows passes the load-time probe on
            empty stores) is stopped at the deadline or on SIGINT/SIGTERM, which otherwise
            wait until the query returns to Python, that is for ever."""
            if interrupt.received() is not None:
                stopped.append("signal")
            elif time.monotonic() >= ends:
                stopped.append("deadline")
            return 1 if stopped else 0

        try:
            for table in TABLES:
                query = self.config.queries[table]
                connection = connections.get(query.store)
                if connection is None:
                    connection = self._open(directory, query.store)
                    connection.set_progress_handler(progress, _PROGRESS_INSTRUCTIONS)
                    connections[query.store] = connection
                try:
                    cursor = connection.execute(query.sql)
                    rows = cursor.fetchall()
                except sqlite3.Error as error:
                    interrupt.check()  # a signal stopped the query: the run is interrupted
                    if stopped:
                        raise ExecutionError(
                            f"system {self.name!r}: the {table} snapshot query on store "
                            f"{query.store} ran longer than its {deadline:g}s deadline "
                            "(--deadline) and was stopped"
                        ) from None
                    denied = "authoriz" in str(error)
                    raise UsageError(
                        f"system {self.name!r}: the {table} query failed on store "
                        f"{query.store}: {error}"
                        + (" (a snapshot query may only read: SELECT or WITH ... SELECT)"
                           if denied else "")
                    ) from None
                width = len(cursor.description or ())
                if width != len(COLUMNS[table]):
                    raise UsageError(
                        f"system {self.name!r}: the {table} query returns {width} columns, "
                        f"expected {len(COLUMNS[table])} ({', '.join(COLUMNS[table])})"
                    )
                tables[table] = [self.row(table, row) for row in rows]
        finally:
            for connection in connections.values():
                connection.close()
        return Snapshot.from_rows(tables)

    def store_files(self, directory: Path) -> list[Path]:
        """The SQLite stores the system file names (a PostgreSQL store is no file)."""
        return sorted(directory / name for name in self.config.stores.values() if name)

    @property
    def snapshot_deadline(self) -> float:
        """Seconds one snapshot's queries may take together: the command's --deadline."""
        return _init_deadline

    def _open(self, directory: Path, store: str) -> sqlite3.Connection:
        path = directory / self.config.stores[store]
        if not path.is_file():
            raise UsageError(
                f"system {self.name!r}: store {store} ({self.config.stores[store]}) does not exist "
                f"in {directory}"
            )
        try:
            connection = sqlite3.connect(
                uri(path, "ro"), uri=True, isolation_level=None,
                timeout=BUSY_TIMEOUT,
            )
            connection.execute("PRAGMA query_only=ON")
            # mode=ro and query_only protect the store, not the file system: ATTACH and
            # VACUUM INTO create files anywhere. A snapshot query may only read.
            connection.set_authorizer(_read_only)
        except sqlite3.Error as error:
            raise UsageError(f"system {self.name!r}: cannot open store {store} ({path}): "
                             f"{error}") from None
        return connection

    def row(self, table: str, row: tuple[Any, ...]) -> tuple[Any, ...]:
        converted: list[Any] = []
        for column, value in zip(COLUMNS[table], row, strict=True):
            if table == "tickets" and column == "id":
                if isinstance(value, bool) or not isinstance(value, int):
                    try:
                        value = int(value)
                    except (TypeError, ValueError):
                        raise UsageError(
                            f"system {self.name!r}: the tickets query returned id {value!r}, "
                            "not an integer"
                        ) from None
            elif value is None:
                if (table, column) not in NULLABLE:
                    raise UsageError(
                        f"system {self.name!r}: the {table} query returned NULL for {column}"
                    )
            elif isinstance(value, bytes):
                value = value.decode("utf-8", "replace")
            elif not isinstance(value, str):
                value = str(value)
            converted.append(value)
        return tuple(converted)

    def probe(self) -> None:
        """Initialise a throw-away directory and run every query once (load-time check)."""
        # named after the pid, as every run directory is (a leftover says whose it was)
        directory = Path(tempfile.mkdtemp(prefix=f"faultlab-probe-{os.getpid()}-"))
        try:
            try:
                self._initialise(directory, UsageError)
            except ExecutionError as error:
                raise UsageError(f"system {self.name!r}: init command failed: {error}") from None
            snapshot = self.snapshot(directory)
        finally:
            self.release(directory)
            shutil.rmtree(directory, ignore_errors=True)
        counts = {table: len(getattr(snapshot, table)) for table in TABLES}
        if any(counts.values()):
            filled = ", ".join(f"{t} has {n} rows" for t, n in counts.items() if n)
            raise UsageError(f"system {self.name!r}: init must create empty stores ({filled})")

    # -- the Python worker contract: ``faultlab worker`` proxies to the command ------------------

    def accept(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        return self._proxy(context, "accept", operation_id, payload)

    def dispatch(self, context: WorkerContext) -> dict[str, Any]:
        return self._proxy(context, "dispatch", None, None)

    def service(self, context: WorkerContext, operation_id: str, payload: str) -> dict[str, Any]:
        return self._proxy(context, "service", operation_id, payload)

    def _proxy(self, context: WorkerContext, role: str, operation_id: str | None,
               payload: str | None) -> dict[str, Any]:
        """Run the command from inside ``faultlab worker``: its outcome becomes ours."""
        worker_spec = getattr(context, "spec", None)
        base = worker_spec if isinstance(worker_spec, WorkerSpec) else WorkerSpec(
            system=self.ref, role=role, directory=str(context.directory),
            deduplication=context.deduplication,
        )
        spec = replace(base, role=role, operation_id=operation_id, payload=payload)
        record = self.run_step(spec, Spawner("exec"))
        if record.stderr:
            sys.stderr.write(record.stderr)
            sys.stderr.flush()
        if record.killed:
            crash.kill_self()
        response = dict(record.response or {})
        if record.exit_code != 0:
            error = str(response.pop("error", "worker_failed"))
            raise Refusal(error, record.exit_code if record.exit_code > 0 else 1, **response)
        return response


def load_command_system(ref: str) -> System:
    """Load, check and probe a system file; UsageError (exit 2) naming any problem."""
    description = read_description(Path(ref))
    system = CommandSystem(description)
    system.probe()
    return system
