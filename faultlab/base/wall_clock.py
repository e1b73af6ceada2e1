"""Virtual time for code that reads the wall clock, through libfaketime.

Users' systems and the libraries under them call ``time.time()``,
``datetime.now()`` and ``clock_gettime`` and will not be rewritten to read
faultlab's clock file. A system that sets ``virtual_wall_clock = True`` runs its
workers under libfaketime (``LD_PRELOAD``), and so does a private PostgreSQL
server with a virtual clock: tick ``t`` is the wall time :data:`EPOCH` + ``t``
seconds, frozen until the clock is set again. Monotonic clocks are left real
(``FAKETIME_DONT_FAKE_MONOTONIC``), so sleeps, timeouts and SQLite's busy wait
still work.

libfaketime is used in its "follow a file" mode (:data:`SETTINGS`): the fake time
is the modification time of a clock file (:data:`FOLLOW_VARIABLE`), at rate 0, so
it does not run on between settings, and ``FAKETIME_NO_CACHE`` makes every read
see the file as it is now. Setting the clock is one ``utime`` (:func:`set_file`),
atomic for every reader. Reading it is one ``stat``, which is async-signal-safe: a
program that reads the clock inside a signal handler, as PostgreSQL does when a
statement, lock or connection-check timeout fires, neither deadlocks nor corrupts its
heap (a handler that interrupts that very ``stat`` reads the real clock: libfaketime
does not fake time while it is inside its own calls). libfaketime's
timestamp-file mode is not: it opens the file with ``fopen`` on every read, so a signal
that lands while the program is inside ``malloc`` deadlocks it or corrupts its
heap.

The library is found, in this order: the file named by ``FAULTLAB_LIBFAKETIME``;
the one the PyPI package ``libfaketime`` ships (``pip install
'faultlab[faketime]'``); Debian's (``apt-get install libfaketime``). A preload
reaches only a process as it starts, so such workers are forked from a fork
server that was itself started under libfaketime (:data:`LOAD_VARIABLES`,
:func:`server_variables`), and each points libfaketime at the trace's clock file
itself (:data:`FOLLOW_VARIABLE`, read on every clock read), or are exec'd in exec
mode.
"""

from __future__ import annotations

import os
from pathlib import Path

from faultlab.base.errors import UsageError

#: Virtual tick 0 on the wall clock: 2026-01-01T00:00:00Z (one tick is one second).
EPOCH = 1_767_225_600
LIBRARY_ENV = "FAULTLAB_LIBFAKETIME"
CLOCK_FILE = "faultlab-faketime"
_DEBIAN = "/usr/lib/*/faketime/libfaketime.so.1"
#: libfaketime's settings: follow the clock file's modification time ("%") at rate 0
#: ("x0": frozen at it), read it again on every clock read, leave monotonic clocks real.
SETTINGS: dict[str, str] = {
    "FAKETIME": "%x0",
    "FAKETIME_NO_CACHE": "1",
    "FAKETIME_DONT_FAKE_MONOTONIC": "1",
}
#: What libfaketime reads once, as the process starts: a fork server started with these
#: passes them on to every child it forks (the library is mapped, its settings are read).
LOAD_VARIABLES = ("LD_PRELOAD", *SETTINGS)
#: What it reads again on every clock read (FAKETIME_NO_CACHE), so a forked worker can set
#: it itself: the file whose modification time is the clock.
FOLLOW_VARIABLE = "FAKETIME_FOLLOW_FILE"


def library() -> Path | None:
    """The libfaketime shared library to preload, or None when none is installed."""
    import glob  # here: a fork server imports this module, and only this needs them
    import importlib.util

    named = os.environ.get(LIBRARY_ENV)
    if named:
        return Path(named) if Path(named).is_file() else None
    spec = importlib.util.find_spec("libfaketime")
    if spec is not None and spec.origin is not None:
        shipped = (Path(spec.origin).parent / "vendor" / "libfaketime" / "src"
                   / "libfaketime.so.1")
        if shipped.is_file():
            return shipped
    found = sorted(glob.glob(_DEBIAN))
    return Path(found[0]) if found else None


def require_library() -> Path:
    """The library, or a one-line error saying how to install it."""
    found = library()
    if found is None:
        raise UsageError(
            "this system asks for a virtual wall clock (virtual_wall_clock) but libfaketime "
            f"is not installed: pip install 'faultlab[faketime]', apt-get install libfaketime, "
            f"or name the library in {LIBRARY_ENV}"
        )
    return found


def set_file(path: Path, seconds: float) -> None:
    """Set the clock that follows ``path`` to :data:`EPOCH` + ``seconds``, exactly.

    Whole seconds: libfaketime takes the whole seconds of the file's modification time.
    The file is created if it is missing; the change is one ``utime``, so a reader sees
    the old time or the new one, never a mixture."""
    if seconds != int(seconds):
        raise ValueError(f"the virtual wall clock moves in whole seconds, not {seconds}")
    if not path.exists():  # never touch an existing file: its time would be real for a moment
        path.touch(mode=0o644)
    moment = (EPOCH + int(seconds)) * 1_000_000_000
    os.utime(path, ns=(moment, moment))


def server_variables(load: dict[str, str]) -> dict[str, str]:
    """What a fork server started with the start-up variables ``load`` needs besides them.

    In follow mode libfaketime stats its file from the process's first clock read, and
    exits when there is none, so a fork server under it follows a file that lives as
    long as it does: the preloaded library itself. Each child it forks then names its
    trace's clock file (:data:`FOLLOW_VARIABLE`) before anything reads the clock."""
    if "FAKETIME" not in load or not load.get("LD_PRELOAD"):
        return {}
    return {FOLLOW_VARIABLE: load["LD_PRELOAD"].split()[0]}


class WallClock:
    """The clock file of one trace, kept equal to its virtual clock."""

    def __init__(self, directory: Path, ticks: int = 0) -> None:
        self.library = require_library()
        self.path = directory / CLOCK_FILE
        self.set(ticks)

    def set(self, ticks: int) -> None:
        set_file(self.path, ticks)

    def environment(self) -> dict[str, str]:
        preload = os.environ.get("LD_PRELOAD", "")
        return {
            "LD_PRELOAD": f"{self.library}{' ' + preload if preload else ''}",
            **SETTINGS,
            FOLLOW_VARIABLE: str(self.path),
        }
