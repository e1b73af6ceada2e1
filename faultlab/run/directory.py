"""A trace's run directory: its fresh stores made, recorded for power cuts, released, removed.

Every trace runs against stores of its own, made for it and gone after it. Both
executors (one worker at a time, and lanes alive at once) open one
:class:`RunDirectory` per trace, so what a trace leaves behind does not depend on
how its steps ran: the directory is named by this process's pid (so a leftover tells
whose it was), is created and known or neither (a signal is held back meanwhile), has
its PostgreSQL databases released before it goes, and goes even when releasing them
failed (a dead server).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from faultlab.base import interrupt
from faultlab.stores import vfs
from faultlab.stores.sqlite import scratch_directory
from faultlab.system.contract import System

#: The recording of every SQLite change in a run directory that power steps replay.
POWER_LOG = "power-log"


def store_digests(system: System, directory: Path) -> dict[str, str]:
    """Each store's bytes with its journal and WAL (a WAL-mode writer may leave the main
    file untouched), as one digest per store file name: what a power step compares to
    tell a store written without a recorded write (an executor's ``unrecorded_baseline``)."""
    digests: dict[str, str] = {}
    for path in system.store_files(directory):
        digest = hashlib.sha256()
        for part in (path, *(path.with_name(path.name + s) for s in ("-journal", "-wal"))):
            digest.update(part.name.encode() + b"\0")
            if part.is_file():
                digest.update(part.read_bytes())
        digests[path.name] = digest.hexdigest()
    return digests


@dataclass
class RunDirectory:
    """One trace's stores: made by :meth:`open`, released and removed by :meth:`close`.

    ``prefix`` starts the temporary directory's name (the pid follows); ``requested``
    is a directory to create instead (released at close, then kept: the caller asked
    for it); ``power`` records every SQLite change of this process into the directory's
    :data:`POWER_LOG` from before the first read, so power steps can replay them."""

    system: System
    prefix: str
    power: bool = False
    requested: Path | None = None
    #: The directory once open; ``Path()`` before.
    path: Path = field(default_factory=Path)
    #: The stores' digests when recording began (see :func:`store_digests`).
    baseline: dict[str, str] = field(default_factory=dict)

    @property
    def power_log(self) -> Path:
        return self.path / POWER_LOG

    def open(self) -> Path:
        """Create the directory and the system's stores in it; start recording (``power``).
        On failure the caller closes it (a signal held back while the directory is made
        is raised as that section ends, and the directory must still go)."""
        with interrupt.deferred():  # the directory is created and known, or neither
            if self.requested is None:
                self.path = Path(tempfile.mkdtemp(prefix=f"{self.prefix}{os.getpid()}-",
                                                  dir=scratch_directory()))
            else:
                self.path = self.requested
                self.path.mkdir(parents=True)
        self.system.initialise(self.path)  # durable: nothing records it yet
        if self.power:  # before the first snapshot: its recovery of a journal is recorded
            self.baseline = store_digests(self.system, self.path)
            vfs.install(self.power_log)
        return self.path

    def close(self) -> None:
        """Stop recording, release the stores (PostgreSQL databases never outlive a
        trace), remove the directory unless it was requested; idempotent."""
        with interrupt.deferred():  # a signal must not leave half a run directory
            if self.power and vfs.installed_directory() == str(self.power_log):
                vfs.uninstall()
            if self.path == Path():
                return
            try:
                self.system.release(self.path)
            finally:  # the directory goes even when releasing failed (a dead server)
                if self.requested is None:
                    shutil.rmtree(self.path, ignore_errors=True)
                self.path = Path()
