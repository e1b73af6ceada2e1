"""faultlab's own PostgreSQL server for one run: private, RAM-backed, crashable, clocked.

The PostgreSQL stores (:mod:`faultlab.stores.postgres`) normally live on a shared
server someone else runs. That server cannot be crashed (other runs and other people
use it), its clock is the machine's, and its settings are not ours to change. A
:class:`PrivateServer` is a throw-away cluster that faultlab owns completely:

* ``initdb`` into a fresh directory ``faultlab-pg-<pid>-XXXX`` under ``/dev/shm`` (the
  run's RAM directory, as for the SQLite stores), mode 0700, owned by the server's user;
* ``postgres`` on a Unix socket in that directory only (``listen_addresses = ''``: no
  network), on a port number no other socket on the machine uses, so ``.s.PGSQL.<port>``
  names nothing but this server; a shared server on 5432 is never touched;
* :meth:`PrivateServer.crash` kills every server process at once (SIGKILL: no shutdown
  checkpoint, no WAL flush) and :meth:`PrivateServer.restart` starts it again on the same
  data, so PostgreSQL's crash recovery replays the WAL, exactly what a real crash leaves;
* :meth:`PrivateServer.terminate_backend` drops one session while its client lives;
* under libfaketime, ``now()``, ``clock_timestamp()`` and ``statement_timestamp()``
  follow a virtual clock that :meth:`PrivateServer.set_clock` moves;
* :meth:`PrivateServer.stop` leaves nothing: no process, no socket, no System V shared
  memory segment, no directory, on every exit path (``with``, ``atexit``, and the
  keeper below when the owning process dies without running either).

**Users.** ``initdb`` and ``postgres`` refuse to run as root. As root (this machine's CI)
the server runs as the unprivileged ``postgres`` user; without such a user,
:class:`PrivateServerUnavailable` says so in one line. As any other user the server runs
as that user. Clients connect as the superuser :data:`SUPERUSER` with ``trust``
authentication, which is safe only because the socket directory is private.

**Time.** With libfaketime installed (found as :mod:`faultlab.base.wall_clock` finds
it) ``initdb`` and the server run under it, frozen at :data:`EPOCH` + the whole
virtual seconds last given to :meth:`PrivateServer.set_clock`. The clock is a file's
modification time, read with one ``stat`` (async-signal-safe): PostgreSQL reads the clock
in its SIGALRM handler whenever a timeout fires, which libfaketime's timestamp-file mode
(an ``fopen`` on every read) turns into a deadlocked or heap-corrupted backend. One
hazard remains: libfaketime reads the real clock while it is inside that ``stat``, so an
alarm that lands in it sees real time, which is later than every virtual deadline, and
fires the timeouts then armed early. Every wall-clock read in the
server follows it: ``now()`` / ``transaction_timestamp()`` (the transaction's start, as
always), ``statement_timestamp()``, ``clock_timestamp()``, ``timeofday()``,
``pg_postmaster_start_time()``, ``backend_start`` / ``xact_start`` in
``pg_stat_activity``, and log timestamps. Between two ``set_clock`` calls they do not
move at all. Monotonic clocks stay real (``FAKETIME_DONT_FAKE_MONOTONIC``): latch waits,
``wal_writer_delay``, the postmaster's sleeps. PostgreSQL measures its *timeouts* on the
wall clock, so they run on virtual time: ``pg_sleep``, ``statement_timeout``,
``lock_timeout``, ``idle_in_transaction_session_timeout``, ``authentication_timeout``
and ``deadlock_timeout`` fire only once the virtual clock has passed their deadline
(noticed when their real-time alarm next expires). A frozen clock therefore means
``pg_sleep(1)`` never returns and a deadlock is never detected until ``set_clock``
moves at least ``deadlock_timeout`` (1 s). With ``virtual_clock=False``, or without
libfaketime, the server keeps real time and :attr:`PrivateServer.virtual_clock` is False.

**The keeper.** PostgreSQL makes every child of the postmaster a process-group leader
(``setsid`` in ``InitPostmasterChild``), so no signal to a group reaches them all, and a
child whose postmaster was killed is re-parented to init, which on some machines (this
one's) never reaps it. So the postmaster is started by a small keeper process (Python,
:data:`_KEEPER`): a child subreaper that forks and execs ``postgres``, reaps the
postmaster and every orphan, kills them all on request (SIGSTOP the postmaster so it
cannot fork, SIGKILL its children and itself), removes what a killed server leaves
(``postmaster.pid``, the socket lock, the System V segment) and, if the process that
owns the server dies (its parent changes), kills the server and removes the directory
itself. The driver signals only the keeper, its own child, so no signal can reach a
recycled pid. Linux only (``/proc``, ``prctl``).

psycopg is imported only by the methods that connect; starting and stopping need none.
"""

from __future__ import annotations

import atexit
import json
import os
import pwd
import random
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from faultlab.base import interrupt, wall_clock
from faultlab.base.errors import ExecutionError, UsageError

if TYPE_CHECKING:
    import psycopg

#: Where Debian's postgresql-15 puts the server binaries; FAULTLAB_PG_BIN overrides it.
BIN_DIR = Path("/usr/lib/postgresql/15/bin")
BIN_ENV = "FAULTLAB_PG_BIN"
#: The unprivileged user the server runs as when faultlab runs as root.
SERVER_USER = "postgres"
#: The superuser initdb creates; every faultlab connection uses this known role.
SUPERUSER = "faultlab"
DIRECTORY_PREFIX = "faultlab-pg-"
#: The virtual clock's tick 0 on the wall clock (shared with faultlab.base.wall_clock).
EPOCH = wall_clock.EPOCH
CLOCK_FILE = "faketime"
#: How long initdb, a start and a fast shutdown may take before faultlab gives up.
START_DEADLINE = 60.0
STOP_DEADLINE = 10.0
#: Ports tried for the socket name: never 5432, never one another socket uses.
PORT_RANGE = (20000, 60000)

#: Every server setting and why. ``settings=`` overrides or adds to these.
DEFAULT_SETTINGS: dict[str, str] = {
    # no network at all: the Unix socket in the private directory is the only way in
    "listen_addresses": "",
    # fsync stays on, so commits wait for the WAL flush as in production: what a crash
    # can lose is exactly what PostgreSQL itself does not promise (SIGKILL keeps the page
    # cache, so fsync cannot change an outcome here; on tmpfs it costs almost nothing)
    "fsync": "on",
    "synchronous_commit": "on",
    "full_page_writes": "on",
    # autovacuum off: its launcher schedules by the wall clock, which a frozen virtual
    # clock stops or makes jump, and its work would be noise between a trace's steps
    "autovacuum": "off",
    # no timed or size-triggered checkpoint during a run: recovery after crash() replays
    # everything since the start, deterministically, instead of depending on timing
    "checkpoint_timeout": "1d",
    "max_wal_size": "4GB",
    # the WAL writer's round as long as PostgreSQL allows: an asynchronous commit
    # (synchronous_commit = off) stays in the WAL buffers for up to 10 s, so a crash()
    # right after its acknowledgement loses it, as production loses up to 3 rounds; a
    # synchronous commit flushes its own WAL and is not affected
    "wal_writer_delay": "10s",
    # dynamic shared memory as files in the data directory (pg_dynshmem), not
    # /dev/shm/PostgreSQL.*, which a killed server would leave behind
    "dynamic_shared_memory_type": "mmap",
    "huge_pages": "off",
    "jit": "off",
    # English messages and UTC everywhere, so faultlab's checks and logs are stable
    "lc_messages": "C",
    "timezone": "UTC",
    "log_timezone": "UTC",
    "log_line_prefix": "%m [%p] ",
    "logging_collector": "off",
    # a server process that dies abnormally (SIGKILLed by the OOM killer or anyone else, a
    # crash) takes the server down instead of PostgreSQL's silent crash-restart, which ends
    # every session (the run's own included) and runs a crash recovery faultlab did not
    # ask for: a trace could then show a "finding" its steps did not cause. Stopped, the
    # server is seen gone (:meth:`PrivateServer.died`) and the run fails naming it (exit 3)
    "restart_after_crash": "off",
}

_live: set[PrivateServer] = set()
_live_lock = threading.Lock()
_atexit_registered = False


class PrivateServerUnavailable(UsageError):
    """This machine cannot run a private server (no binaries, root without a
    ``postgres`` user, no psycopg, no libfaketime when required): one line, so a test
    can skip with it and the command line can report it (exit 2)."""


class PrivateServerError(ExecutionError):
    """The private server failed (initdb, start-up, shutdown): the run failed, exit 3.
    The message ends with the tail of the server's log."""


def psycopg_module() -> ModuleType:
    """psycopg 3, imported only when a connection is needed."""
    try:
        import psycopg
    except ImportError:
        raise PrivateServerUnavailable(
            "the private PostgreSQL server needs psycopg 3: pip install 'faultlab[postgres]'"
        ) from None
    return psycopg


def bin_dir() -> Path:
    return Path(os.environ.get(BIN_ENV) or BIN_DIR)


def _server_account() -> tuple[int, int, list[int]] | None:
    """(uid, gid, groups) to run initdb and postgres as, or None for "as ourselves".

    Raises :class:`PrivateServerUnavailable` when we are root and there is no
    unprivileged user to become (PostgreSQL refuses root)."""
    if os.geteuid() != 0:
        return None
    try:
        entry = pwd.getpwnam(SERVER_USER)
    except KeyError:
        raise PrivateServerUnavailable(
            f"running as root and there is no {SERVER_USER!r} user to run the private "
            "PostgreSQL server as (initdb and postgres refuse root)"
        ) from None
    if entry.pw_uid == 0:
        raise PrivateServerUnavailable(f"the {SERVER_USER!r} user is root; PostgreSQL refuses it")
    return entry.pw_uid, entry.pw_gid, os.getgrouplist(entry.pw_name, entry.pw_gid)


def unavailable() -> str | None:
    """Why no private server can start here (one line), or None when it can."""
    if not sys.platform.startswith("linux"):
        return "the private PostgreSQL server needs Linux (/proc, prctl)"
    for name in ("initdb", "postgres"):
        if not os.access(bin_dir() / name, os.X_OK):
            return (f"no PostgreSQL server binaries: {bin_dir() / name} is missing (apt-get "
                    f"install postgresql-15, or name the directory in {BIN_ENV})")
    try:
        _server_account()
    except PrivateServerUnavailable as error:
        return str(error)
    return None


def _run_base() -> Path:
    """The run's RAM directory: /dev/shm when it exists (a SIGKILL keeps the page cache,
    so RAM changes nothing a check can see, and saves the disk), else the temp dir."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _ports_in_use() -> set[int]:
    """Port numbers in any PostgreSQL socket name on the machine (/proc/net/unix)."""
    used: set[int] = set()
    try:
        lines = Path("/proc/net/unix").read_text(encoding="ascii", errors="replace").splitlines()
    except OSError:
        return used
    for line in lines[1:]:
        path = line.split()[-1] if len(line.split()) >= 8 else ""
        name = path.rsplit("/", 1)[-1]
        if name.startswith(".s.PGSQL."):
            digits = name[len(".s.PGSQL."):].split(".", 1)[0]
            if digits.isdigit():
                used.add(int(digits))
    return used


def _free_port() -> int:
    """A port no PostgreSQL socket and no TCP listener uses (not needed for safety, since
    the socket lives in a private directory, but a log or a ``ps`` line then names one
    server only)."""
    used = _ports_in_use() | {5432}
    chooser = random.SystemRandom()
    for _ in range(200):
        port = chooser.randrange(*PORT_RANGE)
        if port in used:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise PrivateServerError("no free port for the private PostgreSQL server's socket name")


def _quote(value: str) -> str:
    """A libpq keyword value, quoted when it must be."""
    if value and not any(c in value for c in " '\\\t\n"):
        return value
    return "'" + value.replace("\\", "\\\\").replace("'", "\\'") + "'"


def processes_using(directory: Path) -> list[int]:
    """Live processes (not zombies) whose working directory or command line is inside
    ``directory``: every PostgreSQL process chdirs into its data directory, so this finds
    backends whose command line was rewritten too. What tests count as "left behind"."""
    prefix = str(directory)
    found: list[int] = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        base = f"/proc/{entry}"
        try:
            with open(f"{base}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
            if state in (b"Z", b"X"):
                continue
            try:
                cwd = os.readlink(f"{base}/cwd")
            except OSError:
                cwd = ""
            with open(f"{base}/cmdline", "rb") as handle:
                cmdline = handle.read().decode(errors="replace")
        except (OSError, IndexError):
            continue
        if cwd == prefix or cwd.startswith(prefix + "/") or prefix in cmdline:
            if int(entry) != os.getpid():
                found.append(int(entry))
    return found


def shared_memory_segments(key: int) -> list[int]:
    """System V segment ids with ``key`` (/proc/sysvipc/shm): a killed postmaster's
    interlock segment stays until someone removes it."""
    ids: list[int] = []
    try:
        lines = Path("/proc/sysvipc/shm").read_text(encoding="ascii").splitlines()
    except OSError:
        return ids
    for line in lines[1:]:
        fields = line.split()
        if len(fields) > 1 and fields[0].lstrip("-").isdigit() and int(fields[0]) == key:
            ids.append(int(fields[1]))
    return ids


#: The keeper (see the module docstring). argv[1] is a JSON spec; its stdout tells the
#: driver the postmaster's pid. Signals: SIGTERM fast shutdown, SIGUSR2 immediate
#: shutdown, SIGUSR1 kill everything now (a crash). Exits once nothing is left to reap.
_KEEPER = r"""
import ctypes, json, os, shutil, signal, sys, time
spec = json.loads(sys.argv[1])
data = spec["data"]
libc = ctypes.CDLL(None, use_errno=True)
libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: the postmaster's orphans come here
HANDLED = {signal.SIGCHLD, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2}
signal.pthread_sigmask(signal.SIG_BLOCK, HANDLED)
if os.getppid() != spec["parent"]:
    sys.exit(1)
postmaster = os.fork()
if postmaster == 0:
    try:
        os.dup2(2, 1)
        signal.pthread_sigmask(signal.SIG_SETMASK, set())
        if spec["uid"] is not None:
            os.setgroups(spec["groups"])
            os.setgid(spec["gid"])
            os.setuid(spec["uid"])
        os.chdir(data)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as error:
        os.write(2, f"faultlab keeper: cannot start postgres: {error}\n".encode())
    os._exit(127)
for number in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
    signal.signal(number, signal.SIG_IGN)
os.write(1, f"{postmaster}\n".encode())
null = os.open(os.devnull, os.O_WRONLY)
os.dup2(null, 1)
os.close(null)
status = None

def children(parent):
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", "rb") as handle:
                    fields = handle.read().rsplit(b")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == parent:
                found.append(int(entry))
    return found

def state(pid):
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            return handle.read().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return b"X"

def kill_all():
    # Stop the postmaster first so it can fork nothing new, then kill its children and
    # it. Pids stay valid: the postmaster's children are its zombies (it is stopped) or,
    # once it is gone, ours; the postmaster is ours until we reap it.
    victims = set(children(os.getpid()))
    if postmaster is not None:
        os.kill(postmaster, signal.SIGSTOP)
        deadline = time.monotonic() + 2.0
        while state(postmaster) not in (b"T", b"t", b"Z", b"X") and time.monotonic() < deadline:
            time.sleep(0.001)
        victims.update(children(postmaster))
        victims.add(postmaster)
    for pid in victims:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

def reap():
    global postmaster, status
    while True:
        try:
            pid, code = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return False
        if pid == 0:
            return True
        if pid == postmaster:
            postmaster, status = None, code

def clean():
    # What a killed postmaster leaves: its lock file, the socket's lock file (both name
    # a dead pid that the shared server's processes may reuse) and the System V segment.
    path = os.path.join(data, "postmaster.pid")
    try:
        with open(path) as handle:
            lines = handle.read().splitlines()
    except OSError:
        return
    try:
        key, shmid = (int(field) for field in lines[6].split()[:2])
        with open("/proc/sysvipc/shm") as handle:
            for row in handle.read().splitlines()[1:]:
                fields = row.split()
                if int(fields[0]) == key and int(fields[1]) == shmid and int(fields[6]) == 0:
                    libc.shmctl(shmid, 0, None)  # IPC_RMID
    except (OSError, IndexError, ValueError):
        pass
    if len(lines) > 4 and lines[3].strip().isdigit() and lines[4].strip():
        name = os.path.join(lines[4].strip(), f".s.PGSQL.{lines[3].strip()}")
        for stale in (name, name + ".lock"):
            try:
                os.unlink(stale)
            except OSError:
                pass
    try:
        os.unlink(path)
    except OSError:
        pass

orphaned = False
while reap():
    if not orphaned and os.getppid() != spec["parent"]:
        orphaned = True  # our owner died without stopping us: crash and clean up
        kill_all()
        continue
    info = signal.sigtimedwait(HANDLED, 0.5)
    if info is None or postmaster is None:
        continue
    if info.si_signo == signal.SIGUSR1:
        kill_all()
    elif info.si_signo == signal.SIGTERM:
        os.kill(postmaster, signal.SIGINT)
    elif info.si_signo == signal.SIGUSR2:
        os.kill(postmaster, signal.SIGQUIT)
clean()
if orphaned:
    shutil.rmtree(spec["directory"], ignore_errors=True)
    for path in spec["shared"]:  # libfaketime's area, made by the owner for the server
        try:
            os.unlink(path)
        except OSError:
            pass
code = os.waitstatus_to_exitcode(status) if status is not None else 0
sys.exit(code if code >= 0 else 128 - code)
"""


class PrivateServer:
    """One private PostgreSQL cluster, from ``initdb`` to the removal of its directory.

    Use it as a context manager (``with PrivateServer() as server:``) so :meth:`stop`
    runs on every exit; an ``atexit`` hook and the keeper back that up. Not meant to be
    shared between processes: the process that starts it owns it.
    """

    def __init__(self, *, settings: Mapping[str, str] | None = None,
                 max_connections: int = 64, shared_buffers: str = "16MB",
                 virtual_clock: bool | None = None, start_deadline: float = START_DEADLINE
                 ) -> None:
        """``virtual_clock``: True requires libfaketime, False runs on the real clock,
        None (the default) uses libfaketime when it is installed."""
        self.settings: dict[str, str] = dict(DEFAULT_SETTINGS)
        # room for every lane of a concurrent trace, the store pool and the admin session
        self.settings["max_connections"] = str(max_connections)
        # small: a trace's stores are kilobytes, and several runs may share one machine
        self.settings["shared_buffers"] = shared_buffers
        self.settings.update(settings or {})
        self.start_deadline = start_deadline
        self._want_clock = virtual_clock
        self._library: Path | None = None
        #: libfaketime's shared area for the server's processes (a crashed postmaster
        #: would otherwise leave its own in /dev/shm)
        self._faketime_area: wall_clock.SharedArea | None = None
        self.directory: Path | None = None
        self.port = 0
        self.postmaster_pid: int | None = None
        self._keeper: subprocess.Popen[bytes] | None = None
        self._admin: psycopg.Connection[Any] | None = None
        self._lock = threading.RLock()
        self._clock = 0
        self._owner = os.getpid()
        #: wall seconds of the last initdb, first start and restart (crash recovery)
        self.timings: dict[str, float] = {}

    # -- paths and strings ----------------------------------------------------------------

    def _path(self, *parts: str) -> Path:
        if self.directory is None:
            raise PrivateServerError("the private PostgreSQL server was never started")
        return self.directory.joinpath(*parts)

    @property
    def data(self) -> Path:
        return self._path("data")

    @property
    def socket_directory(self) -> Path:
        return self._path("socket")

    @property
    def log_path(self) -> Path:
        return self._path("server.log")

    @property
    def virtual_clock(self) -> bool:
        """True when the server runs under libfaketime and :meth:`set_clock` moves it."""
        return self._library is not None

    @property
    def running(self) -> bool:
        return self._keeper is not None and self._keeper.poll() is None

    @property
    def conninfo(self) -> str:
        """libpq connection string of the ``postgres`` database as :data:`SUPERUSER`."""
        return self.conninfo_for("postgres")

    def conninfo_for(self, dbname: str, **extra: str) -> str:
        words = {"host": str(self.socket_directory), "port": str(self.port),
                 "user": SUPERUSER, "dbname": dbname, **extra}
        return " ".join(f"{key}={_quote(value)}" for key, value in words.items())

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of the server's log, for error messages."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except (OSError, PrivateServerError):
            return "(no server log)"
        return "\n".join(text.splitlines()[-lines:]) or "(empty server log)"

    def died(self) -> str | None:
        """Why the server is gone although faultlab neither stopped nor crashed it (one
        line, ending with its log's last lines), or None while it runs (or was never
        started, or was stopped). A crash faultlab made is followed by :meth:`restart`
        before anything asks."""
        if os.getpid() != self._owner:  # a fork's poll() would take any server for gone
            return None
        with self._lock:
            keeper = self._keeper
            if keeper is None or keeper.poll() is None:
                return None
            code = keeper.returncode
        tail = [line.strip() for line in self.log_tail(60).splitlines() if line.strip()]
        # the server's own account: what a dying process printed itself (a PANIC, a C
        # library's or libfaketime's complaint on its stderr), which process died and how,
        # then how it ended
        said = [line for line in tail if "PANIC:" in line or "TRAP:" in line
                or line.startswith("***") or "faketime" in line.lower()
                or "corrupt" in line.lower()][-2:]
        cause = said + [line for line in tail if "terminated by signal" in line
                        or "exited with exit code" in line][-1:]
        shown = [line[:200] for line in cause + [line for line in tail[-3:]
                                                  if line not in cause]]
        return (f"the private PostgreSQL server stopped by itself (exit status {code}; "
                f"faultlab did not crash it: a server process was killed or crashed); "
                f"the last lines of its log: " + " | ".join(shown))

    def wait_died(self, bound: float) -> str | None:
        """:meth:`died`, for a server that may be shutting down by itself: while it refuses
        a session, up to ``bound`` seconds for it to be gone. None at once when it answers."""
        pg = psycopg_module()
        end = time.monotonic() + bound
        while True:
            reason = self.died()
            if reason is not None:
                return reason
            try:
                self._on_admin("SELECT 1", ())
                return None
            except pg.Error:
                self._forget_admin()
            if time.monotonic() >= end:
                return self.died()
            time.sleep(0.02)

    def _fail(self, what: str) -> PrivateServerError:
        return PrivateServerError(f"private PostgreSQL server: {what}; log tail:\n"
                                  f"{self.log_tail()}")

    # -- life cycle -----------------------------------------------------------------------

    def __enter__(self) -> PrivateServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if os.getpid() == self._owner:  # a forked child leaving the block owns nothing
            self.stop()

    def _check_owner(self) -> None:
        if os.getpid() != self._owner:
            raise PrivateServerError(
                f"the private PostgreSQL server belongs to process {self._owner}, not to "
                f"this one ({os.getpid()}, a fork of it)")

    def start(self) -> None:
        """initdb into a fresh private directory and start the server (once)."""
        with self._lock:
            if self.directory is not None:
                raise PrivateServerError("start() runs once; use restart() after crash()")
            reason = unavailable()
            if reason is not None:
                raise PrivateServerUnavailable(reason)
            library = wall_clock.library() if self._want_clock is not False else None
            if self._want_clock and library is None:
                raise PrivateServerUnavailable(
                    "a virtual clock for the private PostgreSQL server needs libfaketime: pip "
                    f"install 'faultlab[faketime]' or apt-get install libfaketime "
                    f"(or name it in {wall_clock.LIBRARY_ENV})")
            account = _server_account()
            self.directory = Path(tempfile.mkdtemp(prefix=f"{DIRECTORY_PREFIX}{os.getpid()}-",
                                                   dir=_run_base()))
            self._owner = os.getpid()
            _track(self)
            try:
                self._prepare(account, library)
                began = time.monotonic()
                self._initdb(account)
                self.timings["initdb"] = time.monotonic() - began
                self.port = _free_port()
                began = time.monotonic()
                self._launch(account)
                self.timings["start"] = time.monotonic() - began
            except BaseException:
                self.stop()
                raise

    def _prepare(self, account: tuple[int, int, list[int]] | None,
                 library: Path | None) -> None:
        """The directory's layout: data/ (initdb makes it), socket/, the log, the clock."""
        top = self._path()
        self.socket_directory.mkdir(mode=0o700)
        self.log_path.touch(mode=0o600)
        if library is not None:
            # the installed library may sit where the server's user cannot read it
            # (/root/.pyenv/...): preload a copy in the server's own directory
            copy = self._path("libfaketime.so.1")
            shutil.copyfile(library, copy)
            copy.chmod(0o755)
            self._library = copy
            self._faketime_area = wall_clock.SharedArea(
                owner=(account[0], account[1]) if account is not None else None)
            self.set_clock(0)
        if account is not None:
            uid, gid, _ = account
            for path in (top, self.socket_directory, self.log_path):
                os.chown(path, uid, gid)
        top.chmod(0o700)

    def _environment(self) -> dict[str, str]:
        """The server's whole environment: nothing of ours leaks in (no PG*, no FAKETIME)."""
        env = {"PATH": "/usr/bin:/bin", "LC_ALL": "C", "LANG": "C", "TZ": "UTC",
               "HOME": str(self._path())}
        if self._library is not None:
            env.update({
                "LD_PRELOAD": str(self._library),
                # frozen at the clock file's modification time, read again on every
                # read (set_clock() takes effect at once); monotonic clocks stay real:
                # latch waits, wal_writer_delay and the postmaster's own sleeps work
                **wall_clock.SETTINGS,
                wall_clock.FOLLOW_VARIABLE: str(self._path(CLOCK_FILE)),
                **({wall_clock.SHARED_VARIABLE: self._faketime_area.variable}
                   if self._faketime_area is not None else {}),
                # file times stay real (nothing in the server should see them move)
                "NO_FAKE_STAT": "1",
            })
        return env

    def _initdb(self, account: tuple[int, int, list[int]] | None) -> None:
        command = [str(bin_dir() / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
                   "--auth=trust", "--no-sync", "--encoding=UTF8", "--locale=C",
                   "--no-instructions"]
        # Not interrupted half-way: initdb's own postgres makes POSIX shared memory in
        # /dev/shm (the setting that keeps the server's in its directory is not initdb's),
        # and initdb killed mid-run, or its group sent the terminal's Ctrl-C, left those
        # segments behind for good. So it runs in a session of its own, and a signal to
        # faultlab waits until it has ended (about a second; at most start_deadline).
        with open(self.log_path, "ab") as log, interrupt.deferred():
            try:
                done = subprocess.run(
                    command, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                    env=self._environment(), cwd=self._path(), timeout=self.start_deadline,
                    start_new_session=True, **_as_account(account))
            except subprocess.TimeoutExpired:
                raise self._fail(f"initdb took more than {self.start_deadline:g} s") from None
        if done.returncode != 0:
            raise self._fail(f"initdb exited with status {done.returncode}")

    def _launch(self, account: tuple[int, int, list[int]] | None) -> None:
        """Start the keeper, which starts the postmaster; wait until it accepts connections."""
        argv = [str(bin_dir() / "postgres"), "-D", str(self.data),
                "-k", str(self.socket_directory), "-p", str(self.port)]
        for key, value in self.settings.items():
            argv += ["-c", f"{key}={value}"]
        uid, gid, groups = account if account is not None else (None, None, [])
        spec = {"data": str(self.data), "directory": str(self._path()), "argv": argv,
                "env": self._environment(), "uid": uid, "gid": gid, "groups": groups,
                "parent": os.getpid(),
                "shared": list(self._faketime_area.files) if self._faketime_area else []}
        with open(self.log_path, "ab") as log:
            self._keeper = subprocess.Popen(
                [sys.executable, "-I", "-S", "-c", _KEEPER, json.dumps(spec)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=log,
                cwd="/", start_new_session=True)
        deadline = time.monotonic() + self.start_deadline
        pipe = self._keeper.stdout
        if pipe is None:  # pragma: no cover - stdout=PIPE always gives one
            raise self._fail("the keeper has no pipe")
        ready, _, _ = select.select([pipe], [], [], self.start_deadline)
        line = pipe.readline() if ready else b""
        pipe.close()
        if not line.strip().isdigit():
            raise self._fail("the keeper did not start the postmaster")
        self.postmaster_pid = int(line)
        pidfile = self.data / "postmaster.pid"
        while True:
            try:
                lines = pidfile.read_text(encoding="ascii", errors="replace").splitlines()
            except OSError:
                lines = []
            if len(lines) > 7 and lines[7].strip() == "ready":
                return
            if self._keeper.poll() is not None:
                raise self._fail(f"postgres exited with status {self._keeper.returncode} "
                                 "while starting")
            if time.monotonic() > deadline:
                raise self._fail(f"not accepting connections after {self.start_deadline:g} s")
            time.sleep(0.005)

    def _forget_admin(self) -> None:
        admin, self._admin = self._admin, None
        if admin is not None:
            try:
                admin.close()
            except Exception:  # noqa: BLE001 - the server may be gone; nothing to do
                pass

    def _wait_keeper(self, timeout: float) -> bool:
        keeper = self._keeper
        if keeper is None:
            return True
        try:
            keeper.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True

    def _signal_keeper(self, number: int) -> None:
        if self._keeper is not None and self._keeper.poll() is None:
            self._keeper.send_signal(number)

    def crash(self) -> None:
        """Kill every server process at once (SIGKILL), as an OOM kill or a power cut of
        the processes would: no shutdown checkpoint, WAL still in shared buffers is lost.
        Files stay; :meth:`restart` recovers from them."""
        with self._lock:
            self._check_owner()
            self._forget_admin()
            if not self.running:
                raise PrivateServerError(self.died() or
                                         "crash(): the private server is not running")
            self._signal_keeper(signal.SIGUSR1)
            if not self._wait_keeper(STOP_DEADLINE):
                raise self._fail("the server's processes did not die after SIGKILL")
            self._keeper = None
            self.postmaster_pid = None

    def restart(self) -> None:
        """Start the server again on the same data: after :meth:`crash` PostgreSQL runs
        crash recovery (WAL replay) before it accepts connections. A running server is
        crashed first. The time it took is ``timings["restart"]``."""
        with self._lock:
            self._check_owner()
            if self.running:
                self.crash()
            if self.directory is None or not self.data.is_dir():
                raise PrivateServerError("restart(): the private server was never started")
            began = time.monotonic()
            self._launch(_server_account())
            self.timings["restart"] = time.monotonic() - began

    def stop(self) -> None:
        """Stop the server and remove its whole directory: fast shutdown, then immediate,
        then SIGKILL, each after a deadline. Safe to call twice and after a failed start."""
        with self._lock:
            self._check_owner()
            self._forget_admin()
            if self.running:
                for number, bound in ((signal.SIGTERM, STOP_DEADLINE),
                                      (signal.SIGUSR2, STOP_DEADLINE / 2),
                                      (signal.SIGUSR1, STOP_DEADLINE / 2)):
                    self._signal_keeper(number)
                    if self._wait_keeper(bound):
                        break
                else:
                    if self._keeper is not None:
                        self._keeper.kill()
                        self._keeper.wait()
            elif self._keeper is not None:
                self._keeper.wait()
            self._keeper = None
            self.postmaster_pid = None
            with _live_lock:
                _live.discard(self)
            if self._faketime_area is not None:
                self._faketime_area.remove()
                self._faketime_area = None
            if self.directory is not None:
                shutil.rmtree(self.directory, ignore_errors=True)
                if self.directory.exists():
                    raise PrivateServerError(f"could not remove {self.directory}")

    # -- virtual clock --------------------------------------------------------------------

    @property
    def clock(self) -> int:
        """The virtual time in seconds since :data:`EPOCH` (last :meth:`set_clock`)."""
        return self._clock

    def set_clock(self, seconds: float) -> None:
        """Set the server's wall clock to :data:`EPOCH` + ``seconds``, frozen there.

        Whole seconds (a float that is one is accepted). One ``utime`` of the clock file,
        so no backend reads a half-set clock; the next call that reads the clock (the
        next statement) sees it."""
        if self._library is None:
            raise PrivateServerUnavailable(
                "this private PostgreSQL server runs on the real clock (libfaketime is not "
                "installed, or virtual_clock=False)")
        wall_clock.set_file(self._path(CLOCK_FILE), seconds)
        self._clock = int(seconds)

    # -- sessions -------------------------------------------------------------------------

    def connect(self, dbname: str = "postgres", **kwargs: Any) -> psycopg.Connection[Any]:
        """A new psycopg connection to ``dbname`` on this server."""
        pg = psycopg_module()
        connection: psycopg.Connection[Any] = pg.connect(self.conninfo_for(dbname), **kwargs)
        return connection

    def admin(self) -> psycopg.Connection[Any]:
        """The server's own autocommit session (reopened after a crash or restart)."""
        with self._lock:
            if self._admin is None or self._admin.closed:
                self._admin = self.connect(autocommit=True,
                                           application_name="faultlab-pgserver-admin")
            return self._admin

    def _on_admin(self, sql: str, params: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        """Rows of ``sql`` on the server's own session; one the server ended (a restart,
        ``pg_terminate_backend``) is reopened once, never used dead."""
        pg = psycopg_module()
        with self._lock:
            admin = self.admin()
            try:
                return admin.execute(sql, params).fetchall()
            except pg.OperationalError:
                if not admin.closed:
                    raise
            self._forget_admin()
            return self.admin().execute(sql, params).fetchall()

    def terminate_backend(self, pid: int, timeout: float = 5.0) -> bool:
        """``pg_terminate_backend``: end one session while its client process lives on
        (a dropped connection). Waits until the backend has exited, so its locks are free
        when this returns True; False if there was no such backend."""
        with self._lock:
            if not self._on_admin("SELECT 1 FROM pg_stat_activity WHERE pid = %s", (pid,)):
                return False
            rows = self._on_admin("SELECT pg_terminate_backend(%s, %s)",
                                  (pid, int(timeout * 1000)))
            return bool(rows and rows[0][0])

    def terminate_backends_of(self, application_name: str, timeout: float = 5.0) -> list[int]:
        """Terminate every session with this ``application_name``; the pids it ended."""
        with self._lock:
            rows = self._on_admin(
                "SELECT pid FROM pg_stat_activity WHERE application_name = %s "
                "AND pid <> pg_backend_pid()", (application_name,))
            return [int(pid) for (pid,) in rows if self.terminate_backend(int(pid), timeout)]

    def processes(self) -> list[int]:
        """The server's live processes (the keeper, the postmaster and its children), for
        tests and reports."""
        if self.directory is None:
            return []
        return processes_using(self.directory)


def _as_account(account: tuple[int, int, list[int]] | None) -> dict[str, Any]:
    """subprocess keywords that run a program as the server's user."""
    if account is None:
        return {}
    uid, gid, groups = account
    return {"user": uid, "group": gid, "extra_groups": groups}


def _track(server: PrivateServer) -> None:
    """Remember a started server for :func:`_stop_all` (registered with atexit once)."""
    global _atexit_registered
    with _live_lock:
        if not _atexit_registered:
            atexit.register(_stop_all)
            _atexit_registered = True
        _live.add(server)


def _forget_all_in_child() -> None:
    """A forked child (faultlab's fork server forks workers) owns none of its parent's
    servers: its atexit must not stop them."""
    global _live_lock
    _live.clear()
    _live_lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_all_in_child)


def _stop_all() -> None:
    """atexit: stop every server this process still owns (a caller that forgot ``with``)."""
    with _live_lock:
        servers = [server for server in _live if server._owner == os.getpid()]
    for server in servers:
        try:
            server.stop()
        except Exception:  # noqa: BLE001 - exiting anyway; the keeper cleans up the rest
            pass
