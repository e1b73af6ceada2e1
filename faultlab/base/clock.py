"""faultlab's virtual clock: time in a concurrent trace moves only when a ``tick`` step says so.

Leases, visibility timeouts and retry delays must expire deterministically, so a
concurrent trace owns its time: an integer number of ticks, stored as decimal
text in one file in the run directory. Faultlab writes it (atomically, by
rename); workers read it. The environment variable ``FAULTLAB_CLOCK`` names the
file, so a command-line system reads the virtual time with any language's file
API. When the variable is unset (a sequential trace, unless the system asks for
``virtual_wall_clock``), :func:`now` is the real clock, ``time.time()``.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

#: The environment variable naming the clock file (absent: the real clock).
CLOCK_ENV = "FAULTLAB_CLOCK"
CLOCK_FILE = "faultlab-clock"
#: How far the final recovery advances the virtual clock before judging liveness: every
#: lease, visibility timeout or retry delay shorter than this has lapsed by then.
SETTLE_HORIZON = 1000


def is_virtual() -> bool:
    """Whether this process runs on faultlab's virtual clock."""
    return bool(os.environ.get(CLOCK_ENV))


def now() -> float:
    """The current time: virtual ticks when ``FAULTLAB_CLOCK`` names a file, else seconds."""
    path = os.environ.get(CLOCK_ENV)
    if not path:
        return time.time()
    return float(read(Path(path)))


def read(path: Path) -> int:
    """The tick count in a clock file (faultlab's own file: a bad one is a faultlab bug)."""
    return int(path.read_text(encoding="ascii").strip())


def write(path: Path, ticks: int) -> None:
    """Set the clock: write beside the file and rename, so no reader sees half a number."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(f"{ticks}\n", encoding="ascii")
    os.replace(temporary, path)


class VirtualClock:
    """The clock of one trace: starts at 0 in the run directory, advanced by ``tick``."""

    def __init__(self, directory: Path, *, existing: bool = False) -> None:
        """A new clock at 0, or (``existing``) the clock a copied run directory holds."""
        self.path = directory / CLOCK_FILE
        if existing:
            self.ticks = read(self.path)
        else:
            self.ticks = 0
            write(self.path, 0)

    def advance(self, ticks: int) -> int:
        if ticks < 0:
            raise ValueError("the virtual clock never goes backwards")
        self.ticks += ticks
        write(self.path, self.ticks)
        return self.ticks

    def environment(self) -> dict[str, str]:
        return {CLOCK_ENV: str(self.path)}
