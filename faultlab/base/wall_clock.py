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

Every process faultlab starts under libfaketime uses an area of libfaketime's
(:class:`SharedArea`, named by ``FAKETIME_SHARED``) that faultlab makes and removes: a
trace's (:class:`WallClock`) for the workers it execs, a fork server's for the workers
it forks, a private PostgreSQL server's for its processes. Left to itself, each such
process makes its own semaphore and shared memory in ``/dev/shm``, named by its pid, and
removes them only when it exits normally: every worker killed at a crash point, and
every crashed PostgreSQL server, left two files behind.
"""

from __future__ import annotations

import os
import struct
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
#: libfaketime's variable naming the shared area a process uses instead of making its own
#: ("SEMAPHORE MEMORY", :class:`SharedArea`).
SHARED_VARIABLE = "FAKETIME_SHARED"
#: What libfaketime reads once, as the process starts: a fork server started with these
#: passes them on to every child it forks (the library is mapped, its settings are read;
#: the server's own shared area, not a trace's, see :func:`under_library`).
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
    named = os.environ.get(LIBRARY_ENV)
    found = library()
    if found is None and named:
        raise UsageError(
            f"this system asks for a virtual wall clock (virtual_wall_clock) and "
            f"{LIBRARY_ENV} names {named!r}, which is not a file"
        )
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


class SharedArea:
    """libfaketime's shared area, made by faultlab: a named semaphore and a shared memory
    object in ``/dev/shm`` (``sem.faultlab-faketime-PID-...`` and
    ``faultlab-faketime-PID-...``).

    A process that loads libfaketime with :data:`SHARED_VARIABLE` naming an existing area
    uses it and never removes it, so a SIGKILL leaves nothing; :meth:`remove` does, once.
    The memory is initialised as libfaketime initialises its own (no ticks, no file
    index, start times unset). ``owner`` (uid, gid) gives both to another account (a
    private PostgreSQL server's)."""

    #: struct ft_shared_s: ticks, file_idx, then CLOCK_REALTIME, MONOTONIC, MONOTONIC_RAW
    #: and BOOTTIME start times, each a timespec whose tv_nsec -1 means "not set yet".
    LAYOUT = struct.Struct("=QQ" + "qq" * 4)

    def __init__(self, owner: tuple[int, int] | None = None) -> None:
        import ctypes  # here: only a process that starts libfaketime'd ones needs it

        self.creator = os.getpid()
        # os.urandom, not the secrets module: this module is in the fork server's image,
        # and secrets would bring random, hashlib and OpenSSL into every worker's image
        name = f"/faultlab-faketime-{self.creator}-{os.urandom(4).hex()}"
        self.semaphore, self.memory = f"{name}-sem", f"{name}-shm"
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.sem_open.restype = ctypes.c_void_p
        self._libc.sem_open.argtypes = [ctypes.c_char_p, ctypes.c_int, ctypes.c_uint,
                                        ctypes.c_uint]
        self._libc.sem_close.argtypes = [ctypes.c_void_p]
        self._libc.sem_unlink.argtypes = [ctypes.c_char_p]
        handle = self._libc.sem_open(self.semaphore.encode(), os.O_CREAT | os.O_EXCL,
                                     0o600, 1)
        if not handle:
            number = ctypes.get_errno()
            raise OSError(number, f"sem_open {self.semaphore}: {os.strerror(number)}")
        self._libc.sem_close(handle)
        try:
            descriptor = os.open(f"/dev/shm{self.memory}",
                                 os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
            try:
                page = self.LAYOUT.pack(0, 0, *(0, -1) * 4)
                os.write(descriptor, page.ljust(os.sysconf("SC_PAGE_SIZE"), b"\0"))
                if owner is not None:
                    os.fchown(descriptor, *owner)
            finally:
                os.close(descriptor)
            if owner is not None:
                os.chown(self.files[0], *owner)
        except BaseException:
            self.remove()
            raise

    @property
    def variable(self) -> str:
        """The value of :data:`SHARED_VARIABLE` that names this area."""
        return f"{self.semaphore} {self.memory}"

    @property
    def files(self) -> tuple[str, str]:
        """Where both live (what a process other than the maker removes, if it must)."""
        return f"/dev/shm/sem.{self.semaphore[1:]}", f"/dev/shm{self.memory}"

    def remove(self) -> None:
        """Remove both objects (idempotent; only in the process that made them)."""
        if os.getpid() != self.creator:
            return
        self._libc.sem_unlink(self.semaphore.encode())
        try:
            os.unlink(f"/dev/shm{self.memory}")
        except FileNotFoundError:
            pass


def under_library(environment: dict[str, str]) -> bool:
    """Whether a process started with ``environment`` runs under libfaketime (and so needs
    a :class:`SharedArea` from whoever starts it)."""
    return "FAKETIME" in environment and bool(environment.get("LD_PRELOAD"))


class WallClock:
    """The clock file of one trace, kept equal to its virtual clock, and the libfaketime
    area its exec'd workers share (removed by :meth:`close`)."""

    def __init__(self, directory: Path, ticks: int = 0) -> None:
        self.library = require_library()
        self.path = directory / CLOCK_FILE
        self.set(ticks)
        self.area: SharedArea | None = SharedArea()

    def close(self) -> None:
        """Remove the shared area (idempotent); the clock file goes with its directory."""
        if self.area is not None:
            self.area.remove()
            self.area = None

    def set(self, ticks: int) -> None:
        set_file(self.path, ticks)

    def environment(self) -> dict[str, str]:
        preload = os.environ.get("LD_PRELOAD", "")
        return {
            "LD_PRELOAD": f"{self.library}{' ' + preload if preload else ''}",
            **SETTINGS,
            **({SHARED_VARIABLE: self.area.variable} if self.area is not None else {}),
            FOLLOW_VARIABLE: str(self.path),
        }
