"""Which system a saved trace runs on: the one rule ``replay``, the pytest plugin and
:func:`faultlab.replay` share.

A trace file is data, and may come from anywhere (a colleague, a bug report, a
Redis corpus). Loading a system can run code: a system file's ``init`` command
runs when it is probed, ``package.module:attribute`` imports a module. So a trace
never chooses such a system by itself. It runs on:

1. the system the user named (``replay --system``, ``--faultlab-system``,
   ``faultlab.replay(..., system=...)``), for every trace of the run; else
2. the built-in system of the name it records (built-ins run none of the user's
   code); else
3. the system the trace's own project maps that name to: the nearest
   ``pyproject.toml`` at or above the trace file's directory, table
   ``[tool.faultlab.systems]`` (``"name as recorded" = "path/to/system.json"``,
   a path relative to that ``pyproject.toml``, or ``package.module:attribute``,
   or a built-in name). Only the nearest ``pyproject.toml`` is read, and only
   when a trace needs it; its owner named those systems, as they name the
   tests pytest runs there.

Otherwise the trace is refused in one line that says how to name its system,
before anything runs.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from faultlab.base.errors import UsageError
from faultlab.system import is_builtin, load_system
from faultlab.system.contract import System
from faultlab.trace import Recorded

#: Where a project maps the system names its traces record to systems.
TABLE = "[tool.faultlab.systems]"


def placeholder(recorded: str) -> str:
    """What to write in place of a system in a suggested command: a file or a module."""
    return "package.module:attribute" if ":" in recorded and not recorded.endswith(".json") \
        else "path/to/system.json"


def system_for(path: Path, trace: Recorded, named: System | None, *,
               how: Callable[[str], str]) -> System:
    """The system ``trace`` (read from ``path``) runs on, by the rule of this module.

    ``how(placeholder)`` is the caller's way to name a system (a command line, a call),
    shown when the trace's system is neither named, built in nor configured.
    """
    if named is not None:
        return named
    if is_builtin(trace.system):
        return load_system(trace.system)
    configured = configured_system(path, trace.system) if path.is_file() else None
    if configured is not None:
        return configured
    raise UsageError(
        f"{path}: the trace names system {trace.system!r}, which is not built in; name it: "
        f"{how(placeholder(trace.system))} (or map {trace.system!r} in {TABLE} of the "
        "project's pyproject.toml)"
    )


def project_file(trace_path: Path) -> Path | None:
    """The nearest ``pyproject.toml`` at or above the trace file's directory."""
    for directory in Path(os.path.abspath(trace_path)).parents:
        candidate = directory / "pyproject.toml"
        if candidate.is_file():
            return candidate
    return None


def configured_system(trace_path: Path, recorded: str) -> System | None:
    """The system the trace's project maps ``recorded`` to, or None when it maps nothing."""
    pyproject = project_file(trace_path)
    if pyproject is None:
        return None
    systems = _systems_table(pyproject)
    target = systems.get(recorded)
    if target is None:
        return None
    reference = target
    if target.endswith(".json") and not os.path.isabs(target):
        reference = os.path.normpath(pyproject.parent / target)  # not the current directory
    try:
        return load_system(reference)
    except UsageError as error:
        raise UsageError(f"{pyproject}: {TABLE} {recorded!r}: {error}") from None


def _systems_table(pyproject: Path) -> dict[str, str]:
    """``[tool.faultlab.systems]`` of one ``pyproject.toml``, checked (empty when absent)."""
    parse = _toml_parser()
    try:
        with pyproject.open("rb") as handle:
            document: dict[str, Any] = parse(handle)
    except OSError as error:
        raise UsageError(f"{pyproject}: cannot read: {error.strerror or error}") from None
    except ValueError as error:  # tomllib.TOMLDecodeError subclasses ValueError
        raise UsageError(f"{pyproject}: not valid TOML: {error}") from None
    tool = document.get("tool", {})
    faultlab = tool.get("faultlab", {}) if isinstance(tool, dict) else {}
    systems = faultlab.get("systems", {}) if isinstance(faultlab, dict) else {}
    if not isinstance(systems, dict) or not all(
        isinstance(key, str) and isinstance(value, str) and value
        for key, value in systems.items()
    ):
        raise UsageError(f"{pyproject}: {TABLE} must map recorded system names to systems "
                         '(strings), e.g. "system.json" = "path/to/system.json"')
    return systems


def _toml_parser() -> Callable[..., dict[str, Any]]:
    """``tomllib.load`` (Python 3.11+), or tomli's on 3.10."""
    if sys.version_info >= (3, 11):
        import tomllib

        return tomllib.load
    import importlib

    try:
        tomli = importlib.import_module("tomli")  # a dependency on 3.10 only
    except ImportError:
        raise UsageError(f"reading {TABLE} from pyproject.toml needs tomli on Python 3.10 "
                         "(pip install tomli), or name the system instead") from None
    load: Callable[..., dict[str, Any]] = tomli.load
    return load
