"""PostgreSQL stores: a template per schema, a marked clone per trace, nothing left behind.

One :class:`PostgresRun` lives in the process that drives a run (the CLI, a
test). It builds a *template* database once per schema, then gives each trace
fresh databases cloned with ``CREATE DATABASE ... TEMPLATE`` (about 30 ms each
on a local server: ``bench/postgres.py``). A background thread keeps a small
pool of clones ready and drops released ones, so a trace rarely waits for the
server's file copies. :func:`close_run` drops everything the run created; the
CLI calls it on every exit path (success, failure, Ctrl-C, SIGTERM).

Every database faultlab creates is marked twice: a ``faultlab_marker`` table
holding the run id (copied into every clone; workers and snapshots check it
before anything else) and ``COMMENT ON DATABASE`` starting with
:data:`COMMENT_PREFIX`. faultlab drops a database only if its name has this
run's prefix *and* it carries the comment. Names are ``faultlab_<pid>_<random>``
plus a suffix, so parallel runs on one server never collide.

A trace's run directory holds ``postgres.json``: the connection string and the
database of each store. That is how workers (other processes) find their stores.

psycopg is imported only when a PostgreSQL store is used: the SQLite path never
needs it.
"""

from __future__ import annotations

import atexit
import functools
import json
import math
import os
import queue
import secrets
import select
import signal
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType, ModuleType
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.stores.sqlite import StoreError

if TYPE_CHECKING:
    import psycopg

    from faultlab.stores.pgserver import PrivateServer

STORES_FILE = "postgres.json"
NAME_PREFIX = "faultlab_"
COMMENT_PREFIX = "faultlab store"
MARKER_TABLE = "faultlab_marker"
#: how long a killed worker's backend may take to go away before faultlab reports it
BACKEND_EXIT_BOUND = 5.0
#: clones kept ready per template by the background thread
POOL_SIZE = 2

T = TypeVar("T")

_dsn: str | None = None
_run: PostgresRun | None = None
_run_lock = threading.Lock()
#: The private server ``--postgres private`` started for this run (see :func:`configure`).
_server: PrivateServer | None = None


def psycopg_module() -> ModuleType:
    """Import psycopg, or explain (one line, exit 2) how to install it."""
    try:
        import psycopg
    except ImportError:
        raise UsageError(
            "PostgreSQL stores need psycopg 3: pip install 'faultlab[postgres]'"
        ) from None
    return psycopg


def configure(dsn: str | None, *, server: PrivateServer | None = None) -> None:
    """Use ``dsn`` (a libpq connection string or URI) instead of libpq's environment.

    ``server`` is the :class:`~faultlab.stores.pgserver.PrivateServer` behind ``dsn``
    when faultlab started its own (``--postgres private``): the executors reach it here
    (:func:`private_server`) to crash it, move its clock or drop a session, instead of
    through a global of the command line, which run/ must not import.
    """
    global _dsn, _server
    if _run is not None and (dsn != _dsn or server is not _server):
        raise UsageError("--postgres cannot change once a PostgreSQL run has started")
    _dsn = dsn
    _server = server


def private_server() -> PrivateServer | None:
    """The private server this run's stores live on, or None on a shared server."""
    return _server


#: How long a private server that ended a session of the run's may take to be seen gone,
#: when it is shutting down by itself (``restart_after_crash = off``).
SERVER_DEATH_BOUND = 5.0


def check_server_alive(*, wait: bool = False) -> None:
    """Raise :class:`ExecutionError` (the run failed, exit 3: never a finding) when the
    private server died although faultlab did not crash it; with ``wait``, give one that
    is shutting down by itself :data:`SERVER_DEATH_BOUND` seconds to be gone. Nothing on
    a shared server (not ours to watch) or in another process than the server's owner."""
    server = _server
    if server is None:
        return
    reason = server.wait_died(SERVER_DEATH_BOUND) if wait else server.died()
    if reason is not None:
        raise ExecutionError(reason)


def server_clock_follows() -> bool:
    """Whether the server's wall clock is faultlab's to move: a private server running under
    libfaketime (:meth:`~faultlab.stores.pgserver.PrivateServer.set_clock`). A shared
    server keeps the machine's time, whatever a trace's ``tick`` steps say."""
    return _server is not None and _server.virtual_clock


def set_server_clock(ticks: int) -> bool:
    """Move the private server's clock to ``ticks`` seconds after its epoch (one tick of
    a trace's virtual clock is one second of the server's ``now()``); False, and nothing
    moved, when the server's clock is not faultlab's (:func:`server_clock_follows`)."""
    server = _server
    if server is None or not server.virtual_clock:
        return False
    server.set_clock(ticks)
    return True


def crash_server() -> float:
    """Crash the private server (every process SIGKILLed) and restart it on its data;
    the seconds it took, crash recovery included.

    Every connection of this process dies with the server, so the run's pool thread is
    stopped first (a clone half made when the server died is dropped by :meth:`close`
    like any other) and its connections are reopened afterwards: the driver's snapshot
    readers, the admin session and the pool's own. A worker's connection simply fails.
    """
    server = _server
    if server is None:
        raise UsageError("a server crash needs faultlab's own server: --postgres private")
    run = _run
    began = time.monotonic()
    if run is not None:
        run.suspend()
    server.crash()
    server.restart()
    if run is not None:
        run.resume()
    return time.monotonic() - began


def printable_error(error: BaseException) -> str:
    """An error's first line (a psycopg message spans several)."""
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def quote_ident(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def conninfo_for(base: str, **extra: str) -> str:
    """``base`` with keywords overridden (libpq keyword/value form)."""
    from psycopg.conninfo import make_conninfo

    return str(make_conninfo(base, **extra))


def _describe_server(base: str) -> str:
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(base)
    except Exception:  # noqa: BLE001 - only used in a message
        params = {}
    host = params.get("host") or os.environ.get("PGHOST") or "the default socket"
    port = params.get("port") or os.environ.get("PGPORT") or "5432"
    user = params.get("user") or os.environ.get("PGUSER") or "the current user"
    return f"PostgreSQL at {host}:{port} as {user}"


def _check_timeout(params: dict[str, Any]) -> None:
    """psycopg reads ``connect_timeout`` itself, at each connect: this first connection
    passes its own, so a bad value in the string (``connect_timeout=abc``) showed only at
    the next one, a traceback after a database was made. Checked here, before any."""
    try:
        from psycopg.conninfo import timeout_from_conninfo
    except ImportError:  # pragma: no cover - a psycopg without the helper
        return
    timeout_from_conninfo(params)


def _admin_connect(base: str) -> psycopg.Connection[Any]:
    """A maintenance connection (autocommit) to the server's ``postgres`` database.

    Connection failures (no server, wrong credentials) are bad input: one line, exit 2.
    """
    pg = psycopg_module()
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(base)
        _check_timeout(params)
    except pg.ProgrammingError as error:
        raise UsageError(f"--postgres: not a connection string: {printable_error(error)}") \
            from None
    dbname = str(params.get("dbname") or "postgres")
    try:
        connection: psycopg.Connection[Any] = pg.connect(
            conninfo_for(base, dbname=dbname, application_name="faultlab-admin"),
            autocommit=True, connect_timeout=5,
        )
    except pg.OperationalError as error:
        first = (str(error).strip().splitlines() or ["no message"])[-1].strip()
        raise UsageError(f"cannot connect to {_describe_server(base)}: {first}") from None
    return connection


@dataclass
class _Template:
    name: str
    ready: queue.Queue[str] = field(default_factory=queue.Queue)


class PostgresRun:
    """Everything one run created on the server; drops all of it on :meth:`close`."""

    def __init__(self, dsn: str | None, *, pool: int | None = None) -> None:
        self.base = dsn or ""
        self.run_id = f"{os.getpid()}_{secrets.token_hex(3)}"
        self.prefix = f"{NAME_PREFIX}{self.run_id}_"
        self.application = f"faultlab-{self.run_id}"
        self.pool = POOL_SIZE if pool is None else pool
        self._admin = _admin_connect(self.base)
        self._lock = threading.RLock()  # guards the admin connection and the sets below
        self._names = 0
        self.created: set[str] = set()
        self._templates: dict[str, _Template] = {}
        self._work: queue.Queue[tuple[str, str] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._background: psycopg.Connection[Any] | None = None
        #: the driver's read-only connections, one per live trace database (closed on release)
        self.readers: dict[str, psycopg.Connection[Any]] = {}
        self._closing = False

    # -- the admin session -------------------------------------------------------------------

    def _reopen_admin(self) -> None:
        """A new admin session for one the server ended. A server that refuses it is
        checked first: one that died by itself is the run's error, named (exit 3)."""
        try:
            self._admin.close()
        except Exception:  # noqa: BLE001 - a dead session; nothing to do
            pass
        self._admin = self._admin_mid_run("the server ended the run's admin session")

    def _admin_mid_run(self, why: str) -> psycopg.Connection[Any]:
        """A new admin session once the run is under way. The server answered at the start,
        so a refusal now is never bad input (exit 2): a server that died by itself is the
        run's error, named; any other refusal fails the run (exit 3) saying ``why``."""
        try:
            return _admin_connect(self.base)
        except UsageError as error:
            check_server_alive(wait=True)
            raise ExecutionError(f"{why} and a new one cannot be opened: {error}") from None

    def with_admin(self, work: Callable[[psycopg.Connection[Any]], T],
                   again: Callable[[psycopg.Connection[Any]], T] | None = None) -> T:
        """``work(admin)`` on the run's admin session, under the run's lock. A session the
        server ended (``pg_terminate_backend``, a restart) is never used dead: it is
        reopened and the work done once more (``again`` instead, when redoing it needs
        care); a private server that died by itself fails the run (:func:`check_server_alive`)."""
        pg = psycopg_module()
        with self._lock:
            check_server_alive()
            if self._admin.closed:
                self._reopen_admin()
            connection = self._admin
            try:
                return work(connection)
            except pg.OperationalError:
                if not connection.closed:
                    raise  # an error of the statement, on a live session
            self._reopen_admin()
            try:
                return (again or work)(self._admin)
            except pg.OperationalError:
                if not self._admin.closed:
                    raise
                # lost again at once: a private server going down by itself (a server
                # process killed while it restarted) fails the run in one line, never a
                # traceback
                check_server_alive(wait=True)
                raise

    def _create_with_admin(self, name: str, template: str | None) -> None:
        self.with_admin(lambda c: self._create(c, name, template),
                        lambda c: self._create(c, name, template, again=True))

    # -- naming and marking -----------------------------------------------------------------

    def _new_name(self, kind: str) -> str:
        with self._lock:
            self._names += 1
            return f"{self.prefix}{kind}{self._names}"

    def _create(self, connection: psycopg.Connection[Any], name: str,
                template: str | None, *, again: bool = False) -> None:
        """CREATE DATABASE (from ``template``) and mark it; recorded before it exists.

        CREATE DATABASE cannot share a transaction with its COMMENT, so Ctrl-C and SIGTERM
        are held back between the two: an interrupted run never leaves an unmarked
        database (which it would then refuse to drop). ``again``: a retry after the
        session was lost mid-way, so the database may exist already (its name is this
        run's own: then only the mark is made).
        """
        with self._lock:
            self.created.add(name)
        clause = f" TEMPLATE {quote_ident(template)}" if template else ""
        held = {signal.SIGINT, signal.SIGTERM}
        previous = signal.pthread_sigmask(signal.SIG_BLOCK, held)
        try:
            exists = again and connection.execute(
                "SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone() is not None
            if not exists:
                connection.execute(f"CREATE DATABASE {quote_ident(name)}{clause}")
            connection.execute(
                f"COMMENT ON DATABASE {quote_ident(name)} IS "
                f"'{COMMENT_PREFIX} {self.run_id}: dropped when the run ends'"
            )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)

    def _drop(self, connection: psycopg.Connection[Any], name: str) -> None:
        """Drop a database this run created and marked; anything else is refused."""
        if not name.startswith(self.prefix) or name not in self.created:
            raise StoreError(f"database {name}: not created by this faultlab run; not dropping")
        row = connection.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = %s",
            (name,),
        ).fetchone()
        if row is None:  # never created (interrupted CREATE) or already gone
            with self._lock:
                self.created.discard(name)
            return
        if not str(row[0] or "").startswith(f"{COMMENT_PREFIX} {self.run_id}"):
            raise StoreError(f"database {name}: no faultlab marker; not dropping")
        connection.execute(f"DROP DATABASE IF EXISTS {quote_ident(name)} WITH (FORCE)")
        with self._lock:
            self.created.discard(name)

    # -- templates and clones ---------------------------------------------------------------

    def _marked_empty(self) -> str:
        """A new database holding only the marker table: the start of every template."""
        name = self._new_name("t")
        pg = psycopg_module()
        try:
            self._create_with_admin(name, None)
        except pg.Error as error:  # e.g. a role without CREATEDB: bad input, nothing made
            first = (str(error).strip().splitlines() or ["no message"])[0]
            raise UsageError(f"cannot create a database on {_describe_server(self.base)}: "
                             f"{first}") from None
        with pg.connect(conninfo_for(self.base, dbname=name,
                                     application_name=f"{self.application}-template"),
                        autocommit=True) as connection, connection.transaction():
            connection.execute(f"CREATE TABLE {MARKER_TABLE} (run TEXT NOT NULL)")
            connection.execute(f"INSERT INTO {MARKER_TABLE} VALUES (%s)", (self.run_id,))
        return name

    def templates(self, key: str, stores: Sequence[str],
                  build: Callable[[dict[str, str]], None]) -> dict[str, str]:
        """Template keys for ``stores``, built once per run by ``build({store: conninfo})``.

        ``build`` fills the marked, empty templates (runs DDL, or a system's ``init``
        command); afterwards no connection may remain on them (CREATE DATABASE ...
        TEMPLATE needs the template idle), which is waited for with a bound.
        """
        keys = {store: f"{key}\x00{store}" for store in stores}
        with self._lock:
            if all(k in self._templates for k in keys.values()):
                return keys
        names = {store: self._marked_empty() for store in stores}
        build({store: conninfo_for(self.base, dbname=name,
                                   application_name=f"{self.application}-template")
               for store, name in names.items()})
        self._wait_unused(list(names.values()))
        with self._lock:
            for store, name in names.items():
                self._templates[keys[store]] = _Template(name)
        self._start_background()
        return keys

    def _wait_unused(self, names: list[str]) -> None:
        end = time.monotonic() + BACKEND_EXIT_BOUND
        while True:
            row = self.with_admin(lambda c: c.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = ANY(%s)", (names,)
            ).fetchone())
            if row is None or row[0] == 0:
                return
            if time.monotonic() >= end:
                raise ExecutionError(
                    f"template databases {', '.join(names)} still have {row[0]} connections "
                    f"{BACKEND_EXIT_BOUND:g}s after they were built"
                )
            time.sleep(0.01)

    def template(self, schema: str) -> str:
        """The template key for ``schema`` (DDL statements separated by ``;``)."""

        def run_ddl(conninfos: dict[str, str]) -> None:
            pg = psycopg_module()
            try:
                with pg.connect(conninfos["schema"], autocommit=True) as connection, \
                        connection.transaction():
                    for statement in (s.strip() for s in schema.split(";")):
                        if statement:
                            connection.execute(statement)
            except pg.Error as error:
                raise UsageError(f"schema of a template: {error}".splitlines()[0]) from None

        return self.templates(schema, ["schema"], run_ddl)["schema"]

    def clone(self, key: str) -> str:
        """A fresh marked database from template ``key``: from the pool, or cloned now."""
        with self._lock:
            template = self._templates[key]
        try:
            name = template.ready.get_nowait()
        except queue.Empty:
            name = self._new_name("c")
            self._create_with_admin(name, template.name)
        if self._thread is not None:  # pool 0: nothing would ever take the work
            self._work.put(("fill", key))
        return name

    def release(self, name: str) -> None:
        """Drop ``name`` in the background (at once when there is no background thread)."""
        reader = self.readers.pop(name, None)
        if reader is not None:
            reader.close()
        if self._thread is None:
            self.with_admin(lambda c: self._drop(c, name))
        else:
            self._work.put(("drop", name))

    def _start_background(self) -> None:
        if self._thread is not None or self.pool <= 0:
            return
        pg = psycopg_module()
        self._background = pg.connect(
            conninfo_for(self.base, dbname=self._admin.info.dbname,
                         application_name="faultlab-admin"),
            autocommit=True,
        )
        self._thread = threading.Thread(target=self._serve, name="faultlab-pg-pool", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        """Background: keep ``pool`` clones ready per template; drop released databases.

        Ctrl-C and SIGTERM are blocked in this thread for good: the kernel then delivers
        them to the main thread, whose mask holds them back while it creates a database.
        """
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
        connection = self._background
        if connection is None:
            return
        while True:
            item = self._work.get()
            if item is None:
                return
            kind, value = item
            if kind == "fill" and self._closing:
                continue  # the run is ending: no more clones
            if connection.closed:  # the server ended it: a new one, never a dead one used
                try:
                    connection = self._background = psycopg_module().connect(
                        conninfo_for(self.base, dbname=self._admin.info.dbname,
                                     application_name="faultlab-admin"),
                        autocommit=True, connect_timeout=5)
                except Exception:  # noqa: BLE001 - the foreground clones; close() drops
                    continue
            try:
                if kind == "drop":
                    self._drop(connection, value)
                    continue
                with self._lock:
                    template = self._templates[value]
                while template.ready.qsize() < self.pool and not self._closing:
                    name = self._new_name("c")
                    self._create(connection, name, template.name)
                    template.ready.put(name)
            except Exception:  # noqa: BLE001 - close() drops whatever is left
                continue

    # -- a server crash ---------------------------------------------------------------------

    def suspend(self) -> None:
        """Before the server is crashed: stop the pool thread and close every connection
        (they would die anyway; closed here, none is reused broken)."""
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        for connection in (self._background, self._admin, *self.readers.values()):
            if connection is not None:
                try:
                    connection.close()
                except Exception:  # noqa: BLE001 - a dead server's connection; nothing to do
                    pass
        self._background = None
        self.readers.clear()

    def resume(self) -> None:
        """After the server restarted: reopen the admin session, restart the pool thread.
        Clones queued as ready survived (CREATE DATABASE is durable); a drop queued but not
        done is redone by :meth:`close`, which drops whatever this run created."""
        self._admin = self._admin_mid_run("the server restarted")
        self._work = queue.Queue()
        self._start_background()
        if self._thread is not None:
            for key in self._templates:
                self._work.put(("fill", key))

    # -- the end ----------------------------------------------------------------------------

    def close(self) -> list[str]:
        """Stop the pool and drop every database this run created; return what could not be."""
        self._closing = True
        if self._thread is not None:
            self._work.put(None)
            self._thread.join(timeout=60)
            self._thread = None
        if self._background is not None:
            self._background.close()
            self._background = None
        for reader in self.readers.values():
            reader.close()
        self.readers.clear()
        left: list[str] = []
        with self._lock:
            names = sorted(self.created, key=lambda n: (n.startswith(f"{self.prefix}t"), n))
        server = _server
        if server is not None and server.died() is not None:
            # a private server that died by itself (the run's error said so): its databases
            # go with its directory, which the command removes next
            names = []
        pg = psycopg_module()
        # a server that restarts (or a session it ended) refuses connections for a moment:
        # the drops are tried again for DROP_RETRY_SECONDS, not given up at the first
        give_up = time.monotonic() + DROP_RETRY_SECONDS
        while names:
            lost: list[tuple[str, Exception]] = []
            for name in names:  # clones first, then the templates they came from
                try:
                    self.with_admin(functools.partial(self._drop, name=name))
                except (pg.OperationalError, ExecutionError) as error:  # no session now
                    lost.append((name, error))
                except Exception as error:  # noqa: BLE001 - reported by the caller
                    left.append(f"{name}: {printable_error(error)}")
            if not lost or time.monotonic() >= give_up:
                left += [f"{name}: {printable_error(error)}" for name, error in lost]
                break
            time.sleep(0.2)
            names = [name for name, _ in lost]
        try:
            self._admin.close()
        except Exception:  # noqa: BLE001 - a dead session; nothing to do
            pass
        return left


def current_run() -> PostgresRun:
    """This process's run, started (connected, signal handlers installed) on first use."""
    global _run
    with _run_lock:
        if _run is None:
            # on a private server clones are made in the foreground (pool 0): no background
            # commit flushes the WAL while a step runs, so what a server crash loses (an
            # asynchronous commit still in the WAL buffers) depends on the trace alone
            _run = PostgresRun(_dsn if _dsn is not None else os.environ.get("FAULTLAB_POSTGRES"),
                               pool=0 if _server is not None else None)
            atexit.register(close_run)
            _install_sigterm()
        return _run


def active_run() -> PostgresRun | None:
    return _run


def close_run() -> list[str]:
    """Drop everything the run created (idempotent); the CLI calls it on every exit path."""
    global _run
    with _run_lock:
        run, _run = _run, None
    return run.close() if run is not None else []


def _install_sigterm() -> None:
    """SIGTERM ends the run like Ctrl-C (so its databases are dropped), if nobody handles it."""
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)


def drop_worker_connections(directory: Path, pid: int, tag: str | None = None) -> list[int]:
    """Terminate every session the worker process ``pid`` of the trace in ``directory``
    opened (``pg_terminate_backend``, waited for: its locks are free on return) while the
    worker lives on; the backends ended. A worker's sessions are the ones whose
    ``application_name`` :func:`connect` gave it (``<run>-worker-<pid>``): the server
    tells each worker's own apart, a service child's (another pid) is left alone.

    ``tag``: a command-line worker's (:func:`command_worker_started`): its connection
    strings were written before its process existed, so they name the tag, not the pid
    (``<run>-worker-<tag>``), and a dispatcher's service shares them: both lose theirs."""
    server = _server
    if server is None:
        raise UsageError("dropping a connection needs faultlab's own server: --postgres private")
    info = stores_info(directory)
    return server.terminate_backends_of(f"{info.application}-worker-{tag or pid}")


# --- the stores of one trace ----------------------------------------------------------------


def create_stores(directory: Path, schemas: dict[str, str]) -> None:
    """Give the trace in ``directory`` one fresh database per store (``{store: schema}``)."""
    run = current_run()
    clone_stores(directory, {store: run.template(schema) for store, schema in schemas.items()})


def clone_stores(directory: Path, templates: dict[str, str]) -> None:
    """Give the trace in ``directory`` one clone per store (``{store: template key}``)."""
    path = directory / STORES_FILE
    if path.exists():
        raise StoreError(f"{path}: already exists; faultlab only initialises new stores")
    run = current_run()
    databases: dict[str, str] = {}
    try:
        for store, key in templates.items():
            databases[store] = run.clone(key)
        data = {"conninfo": run.base, "run": run.run_id, "application": run.application,
                "databases": databases, "server_clock": server_clock_follows()}
        path.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
    except BaseException:
        for name in databases.values():
            run.release(name)
        raise


def release_stores(directory: Path) -> None:
    """Drop the trace's databases (the run drops them anyway when it ends)."""
    path = directory / STORES_FILE
    run = active_run()
    if run is None or not path.is_file():
        return
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if data.get("run") != run.run_id:
        return
    for name in data.get("databases", {}).values():
        run.release(str(name))
    path.unlink()


@dataclass(frozen=True)
class StoreInfo:
    conninfo: str
    run: str
    application: str
    databases: dict[str, str]
    #: the server's clock follows the trace's ``tick`` steps (:func:`server_clock_follows`)
    server_clock: bool = False


_info_cache: dict[str, StoreInfo] = {}


def stores_info(directory: Path) -> StoreInfo:
    key = os.fspath(directory)
    cached = _info_cache.get(key)
    if cached is not None:
        return cached
    path = directory / STORES_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        info = StoreInfo(str(data["conninfo"]), str(data["run"]), str(data["application"]),
                         {str(k): str(v) for k, v in data["databases"].items()},
                         data.get("server_clock") is True)
    except FileNotFoundError:
        raise StoreError(f"{path}: no PostgreSQL stores here (initialise with faultlab)") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise StoreError(f"{path}: unreadable: {error}") from None
    _info_cache[key] = info
    return info


def connect(directory: Path, store: str, *, role: str = "worker",
            connection_class: type[Any] | None = None) -> psycopg.Connection[Any]:
    """Open a store of the trace in ``directory`` (marker checked before anything else).

    The connection's ``application_name`` names the run and this process's pid, so the
    driver can see in ``pg_stat_activity`` whether a killed worker's backend is gone.
    """
    pg = psycopg_module()
    info = stores_info(directory)
    if store not in info.databases:
        known = ", ".join(sorted(info.databases))
        raise StoreError(f"no PostgreSQL store {store!r} (stores: {known})")
    database = info.databases[store]
    factory = connection_class or pg.Connection
    try:
        connection: psycopg.Connection[Any] = factory.connect(
            conninfo_for(info.conninfo, dbname=database,
                         application_name=f"{info.application}-{role}-{os.getpid()}",
                         options=_with_client_check(info.conninfo)),
        )
    except pg.OperationalError as error:
        check_server_alive(wait=True)
        first = (str(error).strip().splitlines() or ["no message"])[-1].strip()
        raise StoreError(f"database {database}: cannot connect: {first}") from None
    try:
        cursor = pg.Cursor(connection)  # untraced: the marker check is faultlab's
        cursor.execute(f"SELECT run FROM {MARKER_TABLE}")
        row = cursor.fetchone()
        connection.rollback()
    except pg.errors.UndefinedTable:
        connection.close()
        raise StoreError(
            f"database {database}: not created by faultlab (no marker); refusing to write"
        ) from None
    except pg.Error as error:  # the server went away under the check: not a foreign database
        connection.close()
        check_server_alive(wait=True)
        first = (str(error).strip().splitlines() or ["no message"])[-1].strip()
        raise StoreError(f"database {database}: lost the connection while checking its "
                         f"marker: {first}") from None
    if row is None or row[0] != info.run:
        connection.close()
        raise StoreError(f"database {database}: marked by another faultlab run; refusing")
    return connection


#: Milliseconds between the server's checks that a client is still connected while it runs
#: a statement. A worker SIGKILLed while its statement waits for a row lock another live
#: worker holds would otherwise keep its backend (and the locks its transaction took)
#: until that lock is released: the server notices a closed socket only when it next
#: talks to the client. With the check the backend ends within this interval.
CLIENT_CHECK_MS = 50


def _with_client_check(base: str) -> str:
    """libpq ``options`` for a store connection: the caller's own (from ``base`` or
    ``PGOPTIONS``, which the keyword would override) plus the client connection check."""
    from psycopg.conninfo import conninfo_to_dict

    own = str(conninfo_to_dict(base).get("options") or os.environ.get("PGOPTIONS") or "")
    return f"{own} -c client_connection_check_interval={CLIENT_CHECK_MS}".strip()


def query(directory: Path, store: str, queries: dict[str, str]) -> dict[str, list[tuple[Any, ...]]]:
    """Run queries in one READ ONLY transaction on a store; a query that writes is refused."""
    return {name: rows for name, (_, rows) in query_described(directory, store, queries).items()}


def query_described(
    directory: Path, store: str, queries: dict[str, str], *, timeout: float | None = None,
) -> dict[str, tuple[int, list[tuple[Any, ...]]]]:
    """Each query's column count and rows, in one ``READ ONLY`` transaction on one store.

    The run driving the trace keeps this read-only connection open until the trace's
    databases are released (a connection costs a server process; a snapshot follows
    every step). On an error the connection is closed, never reused. ``timeout`` (seconds)
    is each query's ``statement_timeout``: a query that does not end (a command-line
    system's recursive query that loops once the outbox has rows) is cancelled by the
    server and reported as a run failure (:class:`ExecutionError`, exit 3) naming it;
    SIGINT/SIGTERM cancel it too (psycopg cancels a query its wait is interrupted in).
    """
    pg = psycopg_module()
    info = stores_info(directory)
    run = active_run()
    database = info.databases.get(store, "")
    ours = run is not None and info.run == run.run_id
    connection = run.readers.pop(database, None) if run is not None and ours else None
    if connection is None or connection.closed:
        connection = connect(directory, store, role="snapshot")
    try:
        try:
            connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        except pg.OperationalError:
            if not connection.closed:
                raise
            # a kept reader the server ended while it idled: a new one, never a dead one
            connection.close()
            check_server_alive(wait=True)
            connection = connect(directory, store, role="snapshot")
            connection.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
        if timeout is not None:  # LOCAL: ends with the transaction, the kept reader unchanged
            milliseconds = max(1, math.ceil(timeout * 1000))
            try:
                connection.execute(f"SET LOCAL statement_timeout = {milliseconds}")
            except pg.Error as error:
                _snapshot_session_failed(connection, "setting its deadline", error)
        results: dict[str, tuple[int, list[tuple[Any, ...]]]] = {}
        for name, sql in queries.items():
            try:
                cursor = connection.execute(sql)
                rows = [tuple(row) for row in cursor.fetchall()] if cursor.description else []
                results[name] = (len(cursor.description or ()), rows)
            except pg.errors.QueryCanceled as error:
                if timeout is None:
                    raise StoreError(f"snapshot query {name!r}: {printable_error(error)}") \
                        from None
                raise ExecutionError(
                    f"snapshot query {name!r} ran longer than its {timeout:g}s deadline "
                    "(--deadline) and was cancelled") from None
            except pg.Error as error:
                _snapshot_session_failed(connection, f"query {name!r}", error)
        try:
            connection.rollback()
        except pg.Error as error:  # the session lost after the last query, before its end
            _snapshot_session_failed(connection, "ending its transaction", error)
    except BaseException:
        connection.close()
        raise
    if run is not None and ours:
        run.readers[database] = connection
    else:
        connection.close()
    return results


def _snapshot_session_failed(connection: Any, what: str, error: Exception) -> NoReturn:
    """Raise the run failure for a snapshot whose session failed at ``what``: the server's
    death when it died (check_server_alive raises it), else a StoreError naming the step
    of the snapshot and the server's first line (a lost session is a broken run, exit 3,
    never a traceback)."""
    if connection.closed:  # the session was lost mid-snapshot
        check_server_alive(wait=True)
    message = (str(error).strip().splitlines() or ["no message"])[0]
    raise StoreError(f"snapshot {what}: {message}") from None


def wait_for_backends(directory: Path, bound: float | None = None) -> None:
    """Wait until no worker of this trace has a backend left on its databases.

    A SIGKILLed worker's backend ends when the server sees the socket close; until then it
    may still hold the row locks of an open transaction. After ``bound`` seconds a lingering
    backend is reported (ExecutionError), not waited on forever.
    """
    bound = BACKEND_EXIT_BOUND if bound is None else bound
    info = stores_info(directory)
    run = active_run()
    if run is None:
        raise ExecutionError("no PostgreSQL run is active in this process")
    names = list(info.databases.values())
    pattern = f"{info.application}-worker-%"
    end = time.monotonic() + bound
    delay = 0.001
    while True:
        rows = run.with_admin(lambda c: c.execute(
            "SELECT pid, application_name, datname, state, "
            "(SELECT count(*) FROM pg_locks l WHERE l.pid = a.pid AND l.granted), "
            "wait_event_type "
            "FROM pg_stat_activity a WHERE datname = ANY(%s) AND application_name LIKE %s",
            (names, pattern),
        ).fetchall())
        rows = [row for row in rows if not _worker_alive(str(row[1]))]
        if not rows:
            return
        server = _server
        if server is not None and server.virtual_clock:
            # client_connection_check_interval is a timeout on the wall clock, which a
            # private server's frozen clock never lets fire: a dead client's backend that
            # waits for a lock is ended here instead, as that check would end it
            for pid, *_, waiting in rows:
                if waiting == "Lock":
                    server.terminate_backend(int(pid))
        if time.monotonic() >= end:
            pid, application, datname, state, locks, _ = rows[0]
            raise ExecutionError(
                f"backend {pid} ({application}) on {datname} is still {state} with {locks} "
                f"locks {bound:g}s after its worker ended; not waiting for it"
            )
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


#: How long the drops at a run's end are tried again while the server refuses them.
DROP_RETRY_SECONDS = 10.0
#: Command-line workers that lanes started and have not reaped yet, by the tag their
#: backends' ``application_name`` ends with (``...-worker-cmd<N>``): a command's
#: connection string is written before its process exists, so it cannot carry its pid.
_command_workers: dict[str, int] = {}
_command_tags = iter(range(1, 1 << 62))


def command_worker_tag() -> str:
    """A new tag for one command-line worker's ``application_name`` (unique in this
    process; the run's name before it makes it unique on the server)."""
    return f"cmd{next(_command_tags)}"


def command_worker_started(tag: str, pid: int) -> None:
    """A lane started the worker whose connection strings carry ``tag``; it is alive
    until :func:`command_worker_ended` (its process reaped)."""
    _command_workers[tag] = pid


def command_worker_ended(tag: str) -> None:
    _command_workers.pop(tag, None)


def _worker_alive(application: str) -> bool:
    """Whether the worker named in ``application`` still runs: ``...-worker-<pid>`` (a
    Python worker's own pid), or ``...-worker-cmd<N>`` (a command-line worker a lane
    started, alive until the lane reaps it, its children with it: a dispatcher's service
    gets the same connection strings).

    Concurrent traces snapshot while other workers are alive, held at a scheduling point
    with their transactions open: only a worker that has ended must have lost its backend.
    A command-line worker no lane started (a sequential step's, which has ended by the
    snapshot) counts as ended, as does any name without a pid or a live tag.
    """
    suffix = application.rsplit("-", 1)[-1]
    if suffix in _command_workers:
        return True
    if not suffix.isdigit():
        return False
    try:
        os.kill(int(suffix), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def send_commit_then(connection: psycopg.Connection[Any], then: Callable[[], None]) -> None:
    """Send COMMIT, run ``then`` before reading the reply (a crash point), then finish.

    If ``then`` SIGKILLs the process, the COMMIT is on the wire and its reply is never
    read: the client cannot know whether it committed; only the server's state tells.
    """
    from psycopg import pq

    pgconn = connection.pgconn
    pgconn.send_query(b"COMMIT")
    while pgconn.flush() != 0:  # nonblocking connection: wait until every byte is sent
        select.select([], [pgconn.socket], [], 1.0)
    then()
    error: str | None = None
    while True:
        while pgconn.is_busy():
            select.select([pgconn.socket], [], [], 1.0)
            pgconn.consume_input()
        result = pgconn.get_result()
        if result is None:
            break
        if result.status != pq.ExecStatus.COMMAND_OK:
            error = (result.error_message or b"COMMIT failed").decode(errors="replace")
    if error is not None:
        raise psycopg_module().OperationalError(error.strip())


def list_databases(admin: psycopg.Connection[Any], prefix: str = NAME_PREFIX) -> list[str]:
    """Names of databases starting with ``prefix`` (tests check none is left behind)."""
    rows = admin.execute(
        "SELECT datname FROM pg_database WHERE starts_with(datname, %s) ORDER BY 1", (prefix,)
    ).fetchall()
    return [str(row[0]) for row in rows]
