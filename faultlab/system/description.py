"""Reading a command-line system's description file, checked completely before anything runs.

The file (see examples/README.md for every key) says how to run each role, how a
crash point is armed, which crash points exist, and how to read the stores (SQLite
files or PostgreSQL databases) into faultlab's four-table model.
:func:`read_description` turns it into a :class:`Description` or raises a one-line
:class:`~faultlab.base.errors.UsageError` naming the file and the key; running the
system is :mod:`faultlab.system.command`'s.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from faultlab.base.errors import UsageError
from faultlab.base.inputs import read_json_file
from faultlab.nemesis.announce import ANNOUNCE_FD_VARIABLE, RESUME_FD_VARIABLE
from faultlab.stores.sqlite import TABLES
from faultlab.system.contract import ROLES, SCENARIO_ROLES, CrashPoint, crash_point_problem
from faultlab.system.fields import ResponseFields

COMMANDS = ("init", "accept", "dispatch", "service")
CRASH_MODES = ("argument", "announce")

COLUMNS: dict[str, tuple[str, ...]] = {
    "operations": ("id", "payload", "state", "result"),
    "outbox": ("operation_id", "state"),
    "tickets": ("id", "operation_id", "payload"),
    "receipts": ("operation_id", "payload", "result"),
}
NULLABLE = {("operations", "result")}

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
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

_TOP_KEYS = (
    "name", "description", "comment", "commands", "crash", "crash_points", "stores", "snapshot",
    "no_deduplication", "environment", "response_fields", "payload_schema", "operation_ids",
    "virtual_wall_clock", "scenario_points",
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
    response_fields: ResponseFields = field(default_factory=ResponseFields)
    #: A JSON Schema for payloads and a regular expression for ids (faultlab.search.data draws
    #: them).
    payload_schema: Any = None
    operation_id_pattern: str | None = None
    #: stores that are PostgreSQL databases (faultlab clones one per trace; commands get
    #: its libpq connection string as ``{dsn:STORE}``); the others are SQLite files
    postgres: tuple[str, ...] = field(default=())
    #: Run the programs under libfaketime, in every trace (:mod:`faultlab.base.wall_clock`).
    virtual_wall_clock: bool = False
    #: Which declared crash point plays each scenario role in ``suite`` (role -> point).
    scenario_points: dict[str, str] = field(default_factory=dict)

    @property
    def system_dir(self) -> Path:
        return self.path.parent


# --- parsing and validation --------------------------------------------------------------------


class Reader:
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
        if "\x00" in text:  # execve takes C strings: Python's fork_exec raises ValueError
            self.fail(f"{where} contains a NUL character, which no argument or environment "
                      "value can carry")
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
    reader = Reader(path)
    if not path.is_file():
        reader.fail("no such file" if not path.exists() else "not a regular file")
    try:
        data = read_json_file(path, "system file")  # untrusted: bounded, strict, Unicode
    except UsageError as error:
        reader.fail(str(error).replace(f"{path}: ", "", 1))
    top = reader.object(data, "the file", _TOP_KEYS)
    postgres = _postgres_stores(top.get("stores"))
    dsn = frozenset(f"dsn:{store}" for store in postgres)

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
        argv = reader.arguments(commands_data[role], f"commands.{role}",
                                PLACEHOLDERS[role] | dsn)
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
        reader.fail("stores is missing (an object naming each store's SQLite file or "
                    '{"kind": "postgres"}, e.g. {"caller": "caller.db", "downstream": '
                    '"downstream.db"})')
    stores_data = reader.object(top["stores"], "stores", None)
    if not stores_data:
        reader.fail("stores must name at least one store")
    stores: dict[str, str] = {}
    for store, filename in stores_data.items():
        if store in postgres:
            reader.object(filename, f"stores.{store}", ("kind",))
            stores[store] = ""
            continue
        if isinstance(filename, dict):
            reader.fail(f'stores.{store}: an object must be {{"kind": "postgres"}}')
        filename = reader.string(filename, f"stores.{store}")
        if "\x00" in filename:
            reader.fail(f"stores.{store} contains a NUL character, which no file name can")
        relative = Path(filename)
        if relative.is_absolute() or ".." in relative.parts:
            reader.fail(f"stores.{store}: {filename!r} must be a path inside the run directory")
        stores[store] = filename

    if postgres and len(postgres) != len(stores):
        reader.fail("stores: all SQLite files or all PostgreSQL databases, not a mix")

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
                             PLACEHOLDERS["no_deduplication"] | dsn, empty=True),
            reader.environment(switch_data.get("environment", {}),
                               "no_deduplication.environment",
                               PLACEHOLDERS["no_deduplication"] | dsn),
        )
        if not switch.arguments and not switch.environment:
            reader.fail("no_deduplication needs arguments or environment")

    environment = reader.environment(top.get("environment", {}), "environment",
                                     PLACEHOLDERS["environment"] | dsn)
    fields = ResponseFields()
    if "response_fields" in top:
        mapping = reader.object(top["response_fields"], "response_fields", None)
        try:
            fields = ResponseFields.from_mapping(mapping)
        except ValueError as error:
            reader.fail(f"response_fields: {error}")
    payload_schema = top.get("payload_schema")
    if payload_schema is not None and not isinstance(payload_schema, dict | bool):
        reader.fail("payload_schema must be a JSON Schema (an object)")
    pattern = top.get("operation_ids")
    if pattern is not None:
        pattern = reader.string(pattern, "operation_ids")
        try:
            re.compile(pattern)
        except re.error as error:
            reader.fail(f"operation_ids is not a regular expression: {error}")
    wall = top.get("virtual_wall_clock", False)
    if not isinstance(wall, bool):
        reader.fail("virtual_wall_clock must be true or false")
    scenario = _scenario_points(reader, top.get("scenario_points", {}), points)
    return Description(path, name, description, commands, arming, points, stores, queries,
                       switch, environment, fields, payload_schema, pattern, postgres, wall,
                       scenario)


def _scenario_points(reader: Reader, value: Any,
                     points: tuple[CrashPoint, ...]) -> dict[str, str]:
    """``scenario_points``: each scenario role (``suite``) mapped to one declared point."""
    entry = reader.object(value, "scenario_points", SCENARIO_ROLES)
    declared = [point.name for point in points]
    mapping: dict[str, str] = {}
    for role, point in entry.items():
        name = reader.string(point, f"scenario_points.{role}")
        if name not in declared:
            reader.fail(f"scenario_points.{role}: {name!r} is not a declared crash point "
                        f"(declared: {', '.join(declared) or 'none'})")
        mapping[role] = name
    return mapping


def _postgres_stores(value: Any) -> tuple[str, ...]:
    """Names of the stores declared ``{"kind": "postgres"}`` (checked fully later)."""
    if not isinstance(value, dict):
        return ()
    return tuple(store for store, entry in value.items()
                 if isinstance(entry, dict) and entry.get("kind") == "postgres")


def _crash_points(reader: Reader, value: Any) -> tuple[CrashPoint, ...]:
    if not isinstance(value, list):
        reader.fail("crash_points must be a list of objects")
    points: list[CrashPoint] = []
    for index, item in enumerate(value):
        where = f"crash_points[{index}]"
        entry = reader.object(item, where, ("name", "role", "expected", "comment"))
        name = reader.string(entry.get("name"), f"{where}.name")
        if "role" not in entry:
            reader.fail(f"crash point {name!r} has no role (one of: {', '.join(ROLES)})")
        expected = reader.string(entry.get("expected", ""), f"{where}.expected", empty=True)
        points.append(CrashPoint(name, entry["role"], expected))
        problem = crash_point_problem(points)
        if problem is not None:
            reader.fail(problem)
    return tuple(points)


def _crash_arming(reader: Reader, value: Any) -> CrashArming:
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


def resolve_program(reader: Reader, description: Description, role: str) -> str:
    argv = description.commands[role]
    program = substitute(argv[0], static_values(description))
    if "/" in program:
        path = Path(program)
        if not path.is_absolute():
            path = description.system_dir / path
        if not path.is_file():
            reader.fail(f"commands.{role}: program {program!r} not found ({path})")
        if not os.access(path, os.X_OK):
            reader.fail(f"commands.{role}: program {program!r} is not executable ({path})")
        # not resolve(): {python} of a virtual environment is a symlink to the base
        # interpreter, and only the link makes the venv's packages importable
        return os.path.abspath(path)
    found = shutil.which(program)
    if found is None:
        reader.fail(f"commands.{role}: program {program!r} not found on PATH")
    return found


def static_values(description: Description) -> dict[str, str]:
    return {"system_dir": str(description.system_dir.resolve()), "python": sys.executable}
