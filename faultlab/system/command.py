"""Command-line systems: an outbox in any language, described by a JSON file.

``--system path/to/system.json`` names a system whose workers are programs
faultlab knows nothing about. The file says how to run each role, how a crash
point is armed, which crash points exist, and how to read the two SQLite stores
into faultlab's four-table model (see examples/README.md for every key)::

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
* ``"mode": "announce"``: every worker gets two inherited file descriptors, named
  by ``FAULTLAB_ANNOUNCE_FD`` and ``FAULTLAB_RESUME_FD``. At each crash point it
  writes ``reached POINT PID`` and a newline to the first and blocks reading one
  line from the second. faultlab answers ``continue`` unless POINT is the armed
  point, in which case it SIGKILLs PID (only if PID is in the process group
  faultlab created for this worker) and never answers.

The file is checked completely when it is loaded, and the system is probed
once (``init`` in a fresh temporary directory, then every snapshot query), so
a bad description is a one-line error (exit 2) before anything is created.
Snapshots open the stores read-only (``mode=ro`` and ``PRAGMA query_only``).
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import sqlite3
import sys
import tempfile
import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from faultlab import crash
from faultlab.errors import ExecutionError, UsageError
from faultlab.process import DEFAULT_DEADLINE, ProcessRecord, Spawner, WorkerSpec, run_command
from faultlab.stores import TABLES, Snapshot, uri
from faultlab.system.contract import ROLES, CrashPoint, Refusal, System, WorkerContext

COMMANDS = ("init", "accept", "dispatch", "service")
CRASH_MODES = ("argument", "announce")
ANNOUNCE_FD_VARIABLE = "FAULTLAB_ANNOUNCE_FD"
RESUME_FD_VARIABLE = "FAULTLAB_RESUME_FD"
CONTINUE = b"continue\n"
EXIT_USAGE = 2
BUSY_TIMEOUT_SECONDS = 5.0

COLUMNS: dict[str, tuple[str, ...]] = {
    "operations": ("id", "payload", "state", "result"),
    "outbox": ("operation_id", "state"),
    "tickets": ("id", "operation_id", "payload"),
    "receipts": ("operation_id", "payload", "result"),
}
_NULLABLE = {("operations", "result")}

_ALWAYS = frozenset({"directory", "system_dir", "python"})
PLACEHOLDERS: dict[str, frozenset[str]] = {
    "init": _ALWAYS,
    "accept": _ALWAYS | {"operation_id", "payload"},
    "dispatch": _ALWAYS,
    "service": _ALWAYS | {"operation_id", "payload"},
    "crash": _ALWAYS | {"crash"},
    "no_deduplication": _ALWAYS,
    "environment": _ALWAYS,
}
_PROGRAM_PLACEHOLDERS = frozenset({"system_dir", "python"})
_PLACEHOLDER = re.compile(r"\{\{|\}\}|\{([^{}]*)\}")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_TOP_KEYS = (
    "name", "description", "comment", "commands", "crash", "crash_points", "stores", "snapshot",
    "no_deduplication", "environment",
)


# --- templates ---------------------------------------------------------------------------------


def placeholders_in(text: str) -> list[str]:
    """The placeholder names used in one template string (``{{`` and ``}}`` are literal)."""
    return [m.group(1) for m in _PLACEHOLDER.finditer(text) if m.group(1) is not None]


def substitute(text: str, values: Mapping[str, str]) -> str:
    """Replace ``{name}`` by ``values[name]``; ``{{``/``}}`` become literal braces."""

    def one(match: re.Match[str]) -> str:
        token = match.group(0)
        if token == "{{":
            return "{"
        if token == "}}":
            return "}"
        return values[match.group(1)]

    return _PLACEHOLDER.sub(one, text)


@dataclass(frozen=True)
class Query:
    store: str
    sql: str


@dataclass(frozen=True)
class CrashArming:
    mode: str
    arguments: tuple[str, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Switch:
    """Extra arguments and environment for dispatch and service (deduplication off)."""

    arguments: tuple[str, ...] = ()
    environment: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Description:
    """A validated system file."""

    path: Path
    name: str
    description: str
    commands: dict[str, tuple[str, ...]]
    crash: CrashArming | None
    crash_points: tuple[CrashPoint, ...]
    stores: dict[str, str]
    queries: dict[str, Query]
    no_deduplication: Switch | None
    environment: tuple[tuple[str, str], ...] = field(default=())

    @property
    def system_dir(self) -> Path:
        return self.path.parent


# --- parsing and validation --------------------------------------------------------------------


class _Reader:
    """Validates the JSON document, raising UsageError that names the file and the key."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def fail(self, message: str) -> NoReturn:
        raise UsageError(f"system file {self.path}: {message}")

    def object(self, value: Any, where: str, allowed: tuple[str, ...] | None) -> dict[str, Any]:
        if not isinstance(value, dict):
            self.fail(f"{where} must be a JSON object")
        if allowed is not None:
            unknown = [key for key in value if key not in allowed]
            if unknown:
                self.fail(
                    f"unknown key {where + '.' if where != 'the file' else ''}{unknown[0]} "
                    f"(allowed: {', '.join(allowed)})"
                )
        return value

    def string(self, value: Any, where: str, *, empty: bool = False) -> str:
        if not isinstance(value, str) or (not empty and not value.strip()):
            self.fail(f"{where} must be a non-empty string")
        return value

    def template(self, text: str, where: str, allowed: frozenset[str]) -> str:
        for name in placeholders_in(text):
            if name in allowed:
                continue
            if name == "crash":
                self.fail(
                    f"{where}: placeholder {{crash}} may only appear in crash.arguments or "
                    "crash.environment (they are added only to a step that arms a point)"
                )
            known = ", ".join(f"{{{n}}}" for n in sorted(allowed))
            self.fail(f"{where}: unknown placeholder {{{name}}} (allowed here: {known})")
        return text

    def arguments(self, value: Any, where: str, allowed: frozenset[str], *,
                  empty: bool = False) -> tuple[str, ...]:
        if not isinstance(value, list) or (not value and not empty):
            self.fail(f"{where} must be a non-empty list of strings (an argument vector)")
        result = []
        for index, item in enumerate(value):
            if not isinstance(item, str):
                self.fail(f"{where}[{index}] must be a string")
            result.append(self.template(item, f"{where}[{index}]", allowed))
        return tuple(result)

    def environment(self, value: Any, where: str,
                    allowed: frozenset[str]) -> tuple[tuple[str, str], ...]:
        mapping = self.object(value, where, None)
        result = []
        for key, item in mapping.items():
            if not _ENV_NAME.match(key):
                self.fail(f"{where}: {key!r} is not an environment variable name")
            if key in (ANNOUNCE_FD_VARIABLE, RESUME_FD_VARIABLE):
                self.fail(f"{where}: {key} is set by faultlab itself")
            if not isinstance(item, str):
                self.fail(f"{where}.{key} must be a string")
            result.append((key, self.template(item, f"{where}.{key}", allowed)))
        return tuple(result)


def read_description(path: Path) -> Description:
    """Parse and check a system file; UsageError (one line) on any problem."""
    reader = _Reader(path)
    if not path.is_file():
        reader.fail("no such file" if not path.exists() else "not a regular file")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        reader.fail(f"cannot read: {error}")
    try:
        data = json.loads(text)
    except ValueError as error:
        reader.fail(f"not valid JSON: {error}")
    top = reader.object(data, "the file", _TOP_KEYS)

    name = reader.string(top.get("name", path.stem), "name")
    description = reader.string(top.get("description", f"command-line system {path.name}"),
                                "description", empty=True)
    if "comment" in top:
        reader.string(top["comment"], "comment", empty=True)

    if "commands" not in top:
        reader.fail("commands is missing (an object with init, accept, dispatch, service)")
    commands_data = reader.object(top["commands"], "commands", COMMANDS)
    commands: dict[str, tuple[str, ...]] = {}
    for role in COMMANDS:
        if role not in commands_data:
            reader.fail(f"commands.{role} is missing (an argument list)")
        argv = reader.arguments(commands_data[role], f"commands.{role}", PLACEHOLDERS[role])
        program_names = placeholders_in(argv[0])
        if any(n not in _PROGRAM_PLACEHOLDERS for n in program_names):
            reader.fail(f"commands.{role}[0]: the program may use only {{python}} and "
                        "{system_dir}")
        commands[role] = argv

    points = _crash_points(reader, top.get("crash_points", []))
    arming = None
    if "crash" in top:
        arming = _crash_arming(reader, top["crash"])
    elif points:
        reader.fail("crash is missing: say how a crash point is armed "
                    '({"mode": "argument", ...} or {"mode": "announce"})')

    if "stores" not in top:
        reader.fail("stores is missing (an object naming each SQLite file, e.g. "
                    '{"caller": "caller.db", "downstream": "downstream.db"})')
    stores_data = reader.object(top["stores"], "stores", None)
    if not stores_data:
        reader.fail("stores must name at least one SQLite file")
    stores: dict[str, str] = {}
    for store, filename in stores_data.items():
        filename = reader.string(filename, f"stores.{store}")
        relative = Path(filename)
        if relative.is_absolute() or ".." in relative.parts:
            reader.fail(f"stores.{store}: {filename!r} must be a path inside the run directory")
        stores[store] = filename

    if "snapshot" not in top:
        reader.fail("snapshot is missing (one query per table: " + ", ".join(TABLES) + ")")
    snapshot_data = reader.object(top["snapshot"], "snapshot", TABLES)
    queries: dict[str, Query] = {}
    for table in TABLES:
        if table not in snapshot_data:
            reader.fail(f"snapshot.{table} is missing (a query returning "
                        f"{', '.join(COLUMNS[table])})")
        entry = reader.object(snapshot_data[table], f"snapshot.{table}", ("store", "query"))
        store = reader.string(entry.get("store"), f"snapshot.{table}.store")
        if store not in stores:
            reader.fail(f"snapshot.{table}.store: unknown store {store!r} "
                        f"(stores: {', '.join(stores)})")
        queries[table] = Query(store, reader.string(entry.get("query"), f"snapshot.{table}.query"))

    switch = None
    if "no_deduplication" in top:
        switch_data = reader.object(top["no_deduplication"], "no_deduplication",
                                    ("arguments", "environment"))
        switch = Switch(
            reader.arguments(switch_data.get("arguments", []), "no_deduplication.arguments",
                             PLACEHOLDERS["no_deduplication"], empty=True),
            reader.environment(switch_data.get("environment", {}),
                               "no_deduplication.environment", PLACEHOLDERS["no_deduplication"]),
        )
        if not switch.arguments and not switch.environment:
            reader.fail("no_deduplication needs arguments or environment")

    environment = reader.environment(top.get("environment", {}), "environment",
                                     PLACEHOLDERS["environment"])
    return Description(path, name, description, commands, arming, points, stores, queries,
                       switch, environment)


def _crash_points(reader: _Reader, value: Any) -> tuple[CrashPoint, ...]:
    if not isinstance(value, list):
        reader.fail("crash_points must be a list of objects")
    points: list[CrashPoint] = []
    for index, item in enumerate(value):
        where = f"crash_points[{index}]"
        entry = reader.object(item, where, ("name", "role", "expected", "comment"))
        name = reader.string(entry.get("name"), f"{where}.name")
        if not _NAME.match(name) or crash.is_statement_point(name):
            reader.fail(f"{where}.name: {name!r} is not a valid point name (letters, digits, "
                        "_ . -; sql:K and commit:K are reserved)")
        if "role" not in entry:
            reader.fail(f"crash point {name!r} has no role (one of: {', '.join(ROLES)})")
        role = entry["role"]
        if role not in ROLES:
            reader.fail(f"crash point {name!r}: unknown role {role!r} (one of: {', '.join(ROLES)})")
        expected = reader.string(entry.get("expected", ""), f"{where}.expected", empty=True)
        if any(point.name == name for point in points):
            reader.fail(f"crash point {name!r} is declared twice")
        points.append(CrashPoint(name, role, expected))
    return tuple(points)


def _crash_arming(reader: _Reader, value: Any) -> CrashArming:
    entry = reader.object(value, "crash", ("mode", "arguments", "environment"))
    mode = entry.get("mode")
    if mode not in CRASH_MODES:
        reader.fail(f"crash.mode must be one of: {', '.join(CRASH_MODES)} (got {mode!r})")
    if mode == "announce":
        if "arguments" in entry or "environment" in entry:
            reader.fail("crash: announce mode takes no arguments or environment")
        return CrashArming("announce")
    arguments = reader.arguments(entry.get("arguments", []), "crash.arguments",
                                 PLACEHOLDERS["crash"], empty=True)
    environment = reader.environment(entry.get("environment", {}), "crash.environment",
                                     PLACEHOLDERS["crash"])
    texts = list(arguments) + [text for _, text in environment]
    if not any("crash" in placeholders_in(text) for text in texts):
        reader.fail("crash: argument mode needs {crash} in crash.arguments or crash.environment")
    return CrashArming("argument", arguments, environment)


def _resolve_program(reader: _Reader, description: Description, role: str) -> str:
    argv = description.commands[role]
    program = substitute(argv[0], _static_values(description))
    if "/" in program:
        path = Path(program)
        if not path.is_absolute():
            path = description.system_dir / path
        if not path.is_file():
            reader.fail(f"commands.{role}: program {program!r} not found ({path})")
        if not os.access(path, os.X_OK):
            reader.fail(f"commands.{role}: program {program!r} is not executable ({path})")
        return str(path.resolve())
    found = shutil.which(program)
    if found is None:
        reader.fail(f"commands.{role}: program {program!r} not found on PATH")
    return found


def _static_values(description: Description) -> dict[str, str]:
    return {"system_dir": str(description.system_dir.resolve()), "python": sys.executable}


# --- the system --------------------------------------------------------------------------------


class CommandSystem(System):
    """A system whose workers are external programs, described by a JSON file."""

    supports_statement_points = False

    def __init__(self, description: Description) -> None:
        self.config = description
        self.name = description.name
        self.description = description.description
        self.crash_points = description.crash_points
        self.supports_no_deduplication = description.no_deduplication is not None
        reader = _Reader(description.path)
        self.programs = {role: _resolve_program(reader, description, role) for role in COMMANDS}

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
               payload: str | None = None) -> dict[str, str]:
        values = {**_static_values(self.config), "directory": str(directory.resolve())}
        if operation_id is not None:
            values["operation_id"] = operation_id
        if payload is not None:
            values["payload"] = payload
        return values

    def run_step(self, spec: WorkerSpec, spawner: Spawner) -> ProcessRecord:
        """Run the role's command as a real process, arming the step's crash point."""
        if spec.crash is not None and crash.is_statement_point(spec.crash):
            raise UsageError(
                f"system {self.name!r} is a command-line system: statement crash points "
                f"({spec.crash}) need faultlab's own worker process; arm a declared point"
            )
        if spec.role not in ROLES:
            raise UsageError(f"unknown role {spec.role!r}")
        spawner.processes += 1
        directory = Path(spec.directory)
        values = self.values(directory, spec.operation_id, spec.payload)
        argv = self.argv(spec.role, values, crash_point=spec.crash,
                         deduplication=spec.deduplication)
        env = self.environment(values, crash_point=spec.crash, deduplication=spec.deduplication)
        if self.config.crash is None or self.config.crash.mode != "announce":
            return run_command(argv, deadline=spec.deadline, env=env, cwd=str(directory))
        known = {point.name for point in self.crash_points}
        with _Announcements(spec.crash, known) as announcements:
            env.update(announcements.environment())
            record = run_command(
                argv, deadline=spec.deadline, env=env, cwd=str(directory),
                pass_fds=announcements.child_fds(), started=announcements.start,
            )
        if announcements.errors:
            raise ExecutionError(
                f"system {self.name!r}: {spec.role} worker (pid {record.pid}) broke the "
                f"announcement protocol: {announcements.errors[0]}"
            )
        return record

    # -- stores ----------------------------------------------------------------------------------

    def initialise(self, directory: Path) -> None:
        self._initialise(directory, ExecutionError)

    def _initialise(self, directory: Path, error: type[Exception]) -> None:
        values = self.values(directory)
        record = run_command(
            self.argv("init", values), deadline=DEFAULT_DEADLINE, env=self.environment(values),
            cwd=str(directory),
        )
        if record.exit_code != 0:
            last = (record.stderr.strip().splitlines() or ["no message on stderr"])[-1]
            raise error(f"system {self.name!r}: init command exited {record.exit_code}: {last}")
        for store, filename in self.config.stores.items():
            if not (directory / filename).is_file():
                raise UsageError(
                    f"system {self.name!r}: store {store} ({filename}) does not exist after init"
                )

    def snapshot(self, directory: Path) -> Snapshot:
        """Run each table's query on its store, opened read-only."""
        connections: dict[str, sqlite3.Connection] = {}
        tables: dict[str, Iterable[Iterable[Any]]] = {}
        try:
            for table in TABLES:
                query = self.config.queries[table]
                connection = connections.get(query.store)
                if connection is None:
                    connection = self._open(directory, query.store)
                    connections[query.store] = connection
                try:
                    cursor = connection.execute(query.sql)
                    rows = cursor.fetchall()
                except sqlite3.Error as error:
                    raise UsageError(
                        f"system {self.name!r}: the {table} query failed on store "
                        f"{query.store}: {error}"
                    ) from None
                width = len(cursor.description or ())
                if width != len(COLUMNS[table]):
                    raise UsageError(
                        f"system {self.name!r}: the {table} query returns {width} columns, "
                        f"expected {len(COLUMNS[table])} ({', '.join(COLUMNS[table])})"
                    )
                tables[table] = [self._row(table, row) for row in rows]
        finally:
            for connection in connections.values():
                connection.close()
        return Snapshot.from_rows(tables)

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
                timeout=BUSY_TIMEOUT_SECONDS,
            )
            connection.execute("PRAGMA query_only=ON")
        except sqlite3.Error as error:
            raise UsageError(f"system {self.name!r}: cannot open store {store} ({path}): "
                             f"{error}") from None
        return connection

    def _row(self, table: str, row: tuple[Any, ...]) -> tuple[Any, ...]:
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
                if (table, column) not in _NULLABLE:
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
        directory = Path(tempfile.mkdtemp(prefix="faultlab-probe-"))
        try:
            try:
                self._initialise(directory, UsageError)
            except ExecutionError as error:
                raise UsageError(f"system {self.name!r}: init command failed: {error}") from None
            snapshot = self.snapshot(directory)
        finally:
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


class _Announcements:
    """faultlab's side of the announcement protocol for one worker run."""

    def __init__(self, armed: str | None, known: set[str]) -> None:
        self.armed = armed
        self.known = known
        self.errors: list[str] = []
        self.reached: list[str] = []
        self.group = 0
        self._announce_r, self._announce_w = os.pipe()
        self._resume_r, self._resume_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._child_ends_open = True
        self._closed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _Announcements:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def environment(self) -> dict[str, str]:
        return {ANNOUNCE_FD_VARIABLE: str(self._announce_w),
                RESUME_FD_VARIABLE: str(self._resume_r)}

    def child_fds(self) -> tuple[int, int]:
        return self._announce_w, self._resume_r

    def _close_child_ends(self) -> None:
        if self._child_ends_open:
            self._child_ends_open = False
            os.close(self._announce_w)
            os.close(self._resume_r)

    def start(self, pid: int) -> None:
        """The worker (pid, leader of its own process group) is running: serve it."""
        self.group = pid
        self._close_child_ends()
        self._thread = threading.Thread(target=self._serve, name="faultlab-announce", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self._announce_r, selectors.EVENT_READ)
            selector.register(self._stop_r, selectors.EVENT_READ)
            while True:
                events = selector.select()
                if any(key.fd == self._stop_r for key, _ in events):
                    return
                data = os.read(self._announce_r, 4096)
                if not data:
                    return
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._handle(line.decode("utf-8", "replace").strip())

    def _handle(self, line: str) -> None:
        parts = line.split()
        if len(parts) != 3 or parts[0] != "reached" or not parts[2].isdigit():
            self._protocol_error(f"expected 'reached POINT PID', got {line[:80]!r}")
            return
        point, pid = parts[1], int(parts[2])
        if point not in self.known:
            self._protocol_error(f"announced {point!r}, which the system file does not declare")
            return
        try:
            in_group = pid > 0 and os.getpgid(pid) == self.group
        except OSError:
            in_group = False
        if not in_group:
            self._protocol_error(
                f"announced pid {pid}, which is not in the worker's process group {self.group}"
            )
            return
        self.reached.append(point)
        if point == self.armed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        try:
            os.write(self._resume_w, CONTINUE)
        except OSError:
            pass

    def _protocol_error(self, message: str) -> None:
        """Record the error and end the worker's process group (ours), so nothing hangs."""
        self.errors.append(message)
        try:
            os.killpg(self.group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_child_ends()
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join()
            self._thread = None
        for fd in (self._announce_r, self._resume_w, self._stop_r, self._stop_w):
            os.close(fd)


def load_command_system(ref: str) -> System:
    """Load, check and probe a system file; UsageError (exit 2) naming any problem."""
    description = read_description(Path(ref))
    system = CommandSystem(description)
    system.probe()
    return system
