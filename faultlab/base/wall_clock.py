"""Virtual time for code that reads the wall clock, through libfaketime.

Users' systems and the libraries under them call ``time.time()``,
``datetime.now()`` and ``clock_gettime`` and will not be rewritten to read
faultlab's clock file. A system that sets ``virtual_wall_clock = True`` runs its
workers under libfaketime (``LD_PRELOAD``), whose timestamp file faultlab writes
from its virtual clock: tick ``t`` is the wall time :data:`EPOCH` + ``t``
seconds, frozen until the next ``tick`` step. Monotonic clocks are left real
(``FAKETIME_DONT_FAKE_MONOTONIC``), so sleeps, timeouts and SQLite's busy wait
still work; ``FAKETIME_NO_CACHE`` makes every read see the file as it is now.

The library is found, in this order: the file named by ``FAULTLAB_LIBFAKETIME``;
the one the PyPI package ``libfaketime`` ships (``pip install
'faultlab[faketime]'``); Debian's (``apt-get install libfaketime``). A preload
reaches only a process as it starts, so such workers are forked from a fork
server that was itself started under libfaketime (:data:`LOAD_VARIABLES`), and
each sets the trace's timestamp file itself (:data:`TIMESTAMP_VARIABLE`, read on
every clock read), or are exec'd in exec mode.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from faultlab.base.errors import UsageError

#: Virtual tick 0 on the wall clock: 2026-01-01T00:00:00Z (one tick is one second).
EPOCH = 1_767_225_600
LIBRARY_ENV = "FAULTLAB_LIBFAKETIME"
TIMESTAMP_FILE = "faultlab-faketime"
_DEBIAN = "/usr/lib/*/faketime/libfaketime.so.1"
#: What libfaketime reads once, as the process starts: a fork server started with these
#: passes them on to every child it forks (the library is mapped, its settings are read).
LOAD_VARIABLES = ("LD_PRELOAD", "FAKETIME_NO_CACHE", "FAKETIME_DONT_FAKE_MONOTONIC")
#: What it reads again on every clock read (FAKETIME_NO_CACHE), so a forked worker can set
#: it itself: the trace's timestamp file.
TIMESTAMP_VARIABLE = "FAKETIME_TIMESTAMP_FILE"


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


def stamp(ticks: int) -> str:
    """libfaketime's absolute, frozen timestamp for a tick (it reads local time)."""
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(EPOCH + ticks))


class WallClock:
    """The timestamp file of one trace, kept equal to its virtual clock."""

    def __init__(self, directory: Path, ticks: int = 0) -> None:
        self.library = require_library()
        self.path = directory / TIMESTAMP_FILE
        self.set(ticks)

    def set(self, ticks: int) -> None:
        """Write beside the file and rename, so no reader sees half a timestamp."""
        temporary = self.path.with_name(f".{self.path.name}.tmp")
        temporary.write_text(stamp(ticks) + "\n", encoding="ascii")
        os.replace(temporary, self.path)

    def environment(self) -> dict[str, str]:
        preload = os.environ.get("LD_PRELOAD", "")
        return {
            "LD_PRELOAD": f"{self.library}{' ' + preload if preload else ''}",
            TIMESTAMP_VARIABLE: str(self.path),
            "FAKETIME_NO_CACHE": "1",
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }
