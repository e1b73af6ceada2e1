"""Systems under test: the registry of built-in systems and the loader.

A system is named on the command line as a registry name (``reference``), as
``package.module:attribute`` for a user's Python system, or as a path to a
``.json`` file describing a command-line system. Nothing outside this package
imports the reference directly.
"""

from __future__ import annotations

import importlib
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
    """Every built-in system by name: the reference, then the mutants of the zoo.

    Only a name other than the reference imports the zoo (and the trace machinery
    its mutants declare their minimal traces with): a fork server that runs the
    reference stays that much smaller, so each worker forks and exits faster.
    """
    from faultlab.system.builtin.mutants import MUTANTS

    return {REFERENCE: _reference, **MUTANTS}


def _concurrency_builtins() -> dict[str, Callable[[], System]]:
    from faultlab.system.builtin.race_mutants import CONCURRENCY_MUTANTS

    return dict(CONCURRENCY_MUTANTS)


def power_mutant_names() -> list[str]:
    """The mutants only a power cut can catch (``explore --power-loss``), loadable by name."""
    from faultlab.system.builtin.mutants import POWER_MUTANTS

    return list(POWER_MUTANTS)


def _private_concurrency_names() -> list[str]:
    """PostgreSQL mutants only a concurrent trace on faultlab's own server shows."""
    from faultlab.system.builtin.reference_pg import PRIVATE_CONCURRENCY_MUTANTS

    return list(PRIVATE_CONCURRENCY_MUTANTS)


def concurrency_mutant_names() -> list[str]:
    """The mutants only a concurrent trace can catch (``explore --concurrency 2``) that
    ``mutants`` judges, the PostgreSQL ones that need a private server last;
    :func:`concurrency_mutant_all_names` adds the ones it cannot judge yet."""
    return [*(name for name, make in _concurrency_builtins().items()
              if getattr(make, "judged", True)), *_private_concurrency_names()]


def concurrency_mutant_all_names() -> list[str]:
    """Every concurrency mutant, judged by ``mutants`` or not (each loadable by name)."""
    return [*_concurrency_builtins(), *_private_concurrency_names()]


def builtin_names() -> list[str]:
    return list(_builtins())


def postgres_names() -> list[str]:
    """Built-in systems on PostgreSQL (``reference-pg`` and its zoo); they need psycopg."""
    from faultlab.system.builtin.reference_pg import POSTGRES_SYSTEMS

    return list(POSTGRES_SYSTEMS)


def is_builtin(ref: str) -> bool:
    """True for a system faultlab ships (the references and every mutant): the only systems
    a trace file may choose by itself, since loading one runs none of the user's code."""
    return ref in {*builtin_names(), *concurrency_mutant_all_names(), *postgres_names(),
                   *power_mutant_names()}


def is_reference(ref: str) -> bool:
    """True for a built-in reference (``reference``, ``reference-pg``): a built-in system with
    no defect on purpose, so a finding on it is a bug to fix, not the zoo's."""
    return ref in (REFERENCE, f"{REFERENCE}-pg")


def _postgres(name: str) -> System:
    from faultlab.system.builtin.reference_pg import POSTGRES_SYSTEMS

    return POSTGRES_SYSTEMS[name]()


def load_system(ref: str) -> System:
    """Resolve a system reference, or raise UsageError naming what is wrong."""
    if ref in _cache:
        return _cache[ref]
    builtins = {REFERENCE: _reference} if ref == REFERENCE else _builtins()
    if ref not in builtins and ref in _concurrency_builtins():
        builtins = _concurrency_builtins()  # named apart: sequential traces cannot catch them
    if ref not in builtins and ref in power_mutant_names():
        from faultlab.system.builtin.mutants import POWER_MUTANTS

        builtins = dict(POWER_MUTANTS)  # named apart: only power steps catch them
    if ref in builtins:
        system = builtins[ref]()
    elif ref.endswith("-pg") and ref in postgres_names():
        system = _postgres(ref)
    elif ref.endswith(".json"):
        from faultlab.system.command import load_command_system

        system = load_command_system(ref)
    elif ":" in ref:
        system = _load_python_system(ref)
    else:
        known = ", ".join([*builtins, *postgres_names()])
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
