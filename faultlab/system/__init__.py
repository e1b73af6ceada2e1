"""Systems under test: the registry of built-in systems and the loader.

A system is named on the command line as a registry name (``reference``), as
``package.module:attribute`` for a user's Python system, or as a path to a
``.json`` file describing a command-line system. Nothing outside this package
imports the reference directly.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable

from faultlab.base.errors import UsageError
from faultlab.system.contract import (
    CrashPoint,
    Refusal,
    System,
    WorkerContext,
    crash_point_problem,
)

__all__ = [
    "REFERENCE", "CrashPoint", "Refusal", "System", "WorkerContext", "builtin_names", "is_builtin",
    "is_reference", "load_system", "postgres_names",
]

_cache: dict[str, System] = {}


REFERENCE = "reference"


def _reference() -> System:
    from faultlab.system.builtin.reference import ReferenceOutbox

    return ReferenceOutbox()


def _builtins() -> dict[str, Callable[[], System]]:
    """Every built-in system by name (:mod:`faultlab.system.builtin.registry`).

    Only a name other than the reference imports the zoo (and the trace machinery
    its mutants declare their minimal traces with): a fork server that runs the
    reference stays that much smaller, so each worker forks and exits faster.
    """
    from faultlab.system.builtin.registry import BY_NAME

    return dict(BY_NAME)


def power_mutant_names() -> list[str]:
    """The mutants only a power cut can catch (``explore --power-loss``), loadable by name."""
    from faultlab.system.builtin import registry

    return registry.names(fault_drawn="power")


def server_crash_mutant_names() -> list[str]:
    """The mutants only a crash of faultlab's own PostgreSQL server shows."""
    from faultlab.system.builtin import registry

    return registry.names(fault_drawn="server_crash")


def concurrency_mutant_names() -> list[str]:
    """The mutants only a concurrent trace can catch (``explore --concurrency 2``) that
    ``mutants`` judges (every one but a PostgreSQL twin of a SQLite one), the PostgreSQL
    ones that need a private server last."""
    from faultlab.system.builtin import registry

    return registry.names(lanes=2, only_judged=True)


def builtin_names() -> list[str]:
    """The SQLite reference and its sequential mutants (what ``mutants`` explores and
    enumerates without lanes or faults)."""
    from faultlab.system.builtin import registry

    return [REFERENCE, *registry.names(lanes=1, fault_drawn="", postgres=False)]


def postgres_names() -> list[str]:
    """Built-in systems on PostgreSQL (``reference-pg`` and its zoo); they need psycopg."""
    from faultlab.system.builtin import registry

    return registry.names(postgres=True)


def is_builtin(ref: str) -> bool:
    """True for a system faultlab ships (the references and every mutant): the only systems
    a trace file may choose by itself, since loading one runs none of the user's code."""
    return ref == REFERENCE or ref in _builtins()


def is_reference(ref: str) -> bool:
    """True for a built-in reference (``reference``, ``reference-pg``): a built-in system with
    no defect on purpose, so a finding on it is a bug to fix, not the zoo's."""
    return ref in (REFERENCE, f"{REFERENCE}-pg")


def load_system(ref: str) -> System:
    """Resolve a system reference, or raise UsageError naming what is wrong."""
    if ref in _cache:
        return _cache[ref]
    builtins = {REFERENCE: _reference} if ref == REFERENCE else _builtins()
    if ref in builtins:
        system = builtins[ref]()
    elif ref.endswith(".json"):
        from faultlab.system.command import load_command_system

        system = load_command_system(ref)
    elif ":" in ref:
        system = _load_python_system(ref)
    elif os.path.exists(ref):  # a path, but not to a description
        raise UsageError(f"system {ref!r}: exists, but is not a .json system description "
                         "(a command-line system is described by path/to/system.json)")
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
    """Import ``package.module:attribute`` and check it satisfies the contract."""
    module_name, _, attribute = ref.partition(":")
    if not module_name or not attribute:
        raise UsageError(f"system {ref!r}: expected package.module:attribute")
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise UsageError(
            f"system {ref!r}: cannot import {module_name}: {error} (is the directory that "
            "holds it on PYTHONPATH, or the current directory?)"
        ) from None
    except SystemExit as error:  # sys.exit() at import must not end faultlab with its status
        raise UsageError(
            f"system {ref!r}: importing {module_name} called sys.exit({error.code!r})"
        ) from None
    except Exception as error:  # noqa: BLE001 - the user's module failed while importing
        raise UsageError(
            f"system {ref!r}: importing {module_name} failed: {type(error).__name__}: {error}"
        ) from None
    try:
        target = getattr(module, attribute)
    except AttributeError:
        raise UsageError(f"system {ref!r}: {module_name} has no attribute {attribute!r}") from None
    if isinstance(target, type):
        if not issubclass(target, System):
            raise UsageError(
                f"system {ref!r}: class {target.__name__} does not subclass "
                "faultlab.system.System"
            )
        abstract = sorted(getattr(target, "__abstractmethods__", ()))
        if abstract:
            raise UsageError(
                f"system {ref!r}: {target.__name__} does not implement {', '.join(abstract)}"
            )
        try:
            target = target()
        except (Exception, SystemExit) as error:  # noqa: BLE001 - reported as bad input
            raise UsageError(
                f"system {ref!r}: cannot instantiate {target.__name__}: "
                f"{type(error).__name__}: {error}"
            ) from None
    if not isinstance(target, System):
        methods = ("initialise", "accept", "dispatch", "service", "snapshot")
        missing = [m for m in methods if not callable(getattr(target, m, None))]
        lacking = f"; it lacks {', '.join(missing)}" if missing else ""
        raise UsageError(
            f"system {ref!r}: {type(target).__name__} is not a faultlab.system.System "
            f"(subclass it and implement {', '.join(methods)}){lacking}"
        )
    _check_crash_points(ref, target)
    if not target.name:
        target.name = attribute
    return target


def _check_crash_points(ref: str, system: System) -> None:
    if not isinstance(system.crash_points, (tuple, list)):
        raise UsageError(f"system {ref!r}: crash_points must be a tuple of CrashPoint")
    problem = crash_point_problem(system.crash_points)
    if problem is not None:
        raise UsageError(f"system {ref!r}: {problem}")
