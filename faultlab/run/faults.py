"""Faults with no worker: a power cut of the machine and the private server's crash.

A power cut rebuilds the stores from what was recorded; the checks here refuse a fault
that cannot be run for real (a shared server, unrecorded writes) before it runs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.run.directory import store_digests
from faultlab.stores import vfs
from faultlab.system.contract import System


def check_server_crash(system: System, what: str = "a server_crash step") -> None:
    """Refuse a server fault (``server_crash``, ``drop_connection``) that cannot be run:
    only faultlab's own server may be crashed or have its sessions ended (a shared server
    is other people's), and only a PostgreSQL system's stores live on it."""
    from faultlab.stores import postgres as pgstores

    if pgstores.private_server() is None:
        raise UsageError(f"{what} needs faultlab's own PostgreSQL server "
                         "(--postgres private): a shared server is never touched")
    if getattr(system, "store_kind", None) != "postgres":
        raise UsageError(f"{what} needs a system whose stores are on PostgreSQL; "
                         f"{system.name} keeps them elsewhere")


def check_power_cut(system: System, what: str = "a power step") -> None:
    """Refuse a power cut that would cut nothing: it rebuilds the SQLite files faultlab
    recorded, and a system whose stores live on a server has none, so every store would
    come through untouched and ``DURABLE`` would pass without having been tested. A
    PostgreSQL server's own crash is ``server_crash`` (``--postgres private``)."""
    if system.store_kind != "sqlite":
        where = "PostgreSQL" if system.store_kind == "postgres" else system.store_kind
        raise UsageError(f"{what}: a power cut rebuilds only the SQLite files faultlab "
                         f"records, and {system.name} keeps its stores on {where}, which a "
                         "cut would leave untouched (a private PostgreSQL server's crash is "
                         "the server_crash step of --postgres private)")


def check_server_alive(system: System) -> None:
    """A private PostgreSQL server that died by itself fails the run (ExecutionError, exit
    3), whatever the step's worker showed: never a finding."""
    if getattr(system, "store_kind", None) != "postgres":
        return
    from faultlab.stores import postgres as pgstores

    pgstores.check_server_alive(wait=True)


def cut_power(system: System, directory: Path, log: Path, choice: Mapping[str, Any],
              baseline: Mapping[str, str], what: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The machine loses power now: every process that recorded into ``log`` is dead and
    this process's readers are closed. Rebuild the stores as ``choice`` says; return why
    each store that no longer opens does not (``OPEN``), and the new baseline. Recording
    into ``log`` goes on afterwards (the recovery the opening ran is durable).

    Refuses (ExecutionError, exit 3) a cut of a store whose writes were not recorded: a
    system's own program (a command-line system) runs its own SQLite, and unless it
    installs faultlab's VFS (:func:`faultlab.record_power_loss`) every write would count as
    durable and the cut would check nothing: a run that cannot test what it claims, not
    a clean one. A store is suspect when it changed since ``baseline`` (its digests when
    recording began or at the last cut) and ``log`` records no write of it.
    """
    vfs.uninstall()
    recorded = {os.path.realpath(name) for name in vfs.summary(log)["files"]}
    for name, digest in store_digests(system, directory).items():
        names = {os.path.realpath(directory / (name + suffix))
                 for suffix in ("", "-journal", "-wal")}
        if digest != baseline.get(name) and not names & recorded:
            raise ExecutionError(
                f"{what}: {name} was written without a recorded write, so a power cut "
                f"cannot be modelled: the system's program does not record its SQLite "
                f"writes (a Python program calls faultlab.record_power_loss() before it "
                f"opens a store; see the power loss guide)")
    try:
        vfs.power_image(log, choice)
    except vfs.VfsError as error:
        raise ExecutionError(f"{what}: {error}") from None
    unopenable = tuple(
        f"{path.name} does not open after the power cut: {problem}"
        for path in system.store_files(directory)
        if (problem := vfs.opens_cleanly(path)) is not None
    )
    after = store_digests(system, directory)
    vfs.install(log)
    return unopenable, after
