"""Systems under test: the registry of built-in systems and the loader.

A system is named on the command line as a registry name (``reference``), as
``package.module:attribute`` for a user's Python system, or as a path to a
``.json`` file describing a command-line system. Nothing outside this package
imports the reference directly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable

from faultlab.errors import UsageError
from faultlab.system.contract import CrashPoint, Refusal, System, WorkerContext

__all__ = ["CrashPoint", "Refusal", "System", "WorkerContext", "builtin_names", "load_system"]

_cache: dict[str, System] = {}


def _builtins() -> dict[str, Callable[[], System]]:
    from faultlab.system.reference import ReferenceOutbox

    registry: dict[str, Callable[[], System]] = {"reference": ReferenceOutbox}
    try:
        from faultlab.system.mutants import MUTANTS
    except ImportError:  # pragma: no cover - the zoo is optional during bootstrap
        MUTANTS = {}
    registry.update(MUTANTS)
    return registry


def builtin_names() -> list[str]:
    return list(_builtins())


def load_system(ref: str) -> System:
    """Resolve a system reference, or raise UsageError naming what is wrong."""
    if ref in _cache:
        return _cache[ref]
    builtins = _builtins()
    if ref in builtins:
        system = builtins[ref]()
    elif ref.endswith(".json"):
        from faultlab.system.command import load_command_system

        system = load_command_system(ref)
    elif ":" in ref:
        system = _load_python_system(ref)
    else:
        known = ", ".join(builtins)
        raise UsageError(
            f"unknown system {ref!r} (built-in: {known}; or package.module:attribute, "
            "or path/to/system.json)"
        )
    system.ref = ref
    _cache[ref] = system
    return system


def _load_python_system(ref: str) -> System:
    module_name, _, attribute = ref.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"system {ref!r}: expected package.module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(f"system {ref!r}: cannot import {module_name}: {error}") from None
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise UsageError(f"system {ref!r}: {module_name} has no attribute {attribute!r}") from None
    if isinstance(target, type) and issubclass(target, System):
        try:
            target = target()
        except TypeError as error:
            raise UsageError(f"system {ref!r}: cannot instantiate: {error}") from None
    if not isinstance(target, System):
        raise UsageError(
            f"system {ref!r}: {type(target).__name__} is not a faultlab.system.System "
            "(subclass it and implement initialise, accept, dispatch, service, snapshot)"
        )
    roles = ("accept", "dispatch", "service")
    missing = [p.name for p in target.crash_points if p.role not in roles]
    if missing:
        raise UsageError(f"system {ref!r}: crash points with an unknown role: {', '.join(missing)}")
    if not target.name:
        target.name = attribute
    return target
