"""faultlab's private PostgreSQL server: start, crash and recovery, dropped sessions,
the virtual clock, and nothing left behind on any exit path.

Skipped with a reason when this machine cannot run one (no PostgreSQL 15 binaries,
root without a ``postgres`` user, no psycopg; the clock tests without libfaketime),
failed instead when FAULTLAB_REQUIRE_SERVICES names ``postgres`` (``libfaketime`` for
the clock). The shared server on 5432 is only ever read, to show it was not touched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, require_private_postgres, require_service

from faultlab.base import wall_clock
from faultlab.stores import pgserver
from faultlab.stores.pgserver import PrivateServer, PrivateServerUnavailable

EPOCH = datetime.fromtimestamp(pgserver.EPOCH, timezone.utc)


def _require() -> None:
    require_private_postgres()


@pytest.fixture
def faketime() -> None:
    """Asked for before ``server``, so a missing libfaketime skips before any initdb."""
    if wall_clock.library() is None:
        require_service("libfaketime", "libfaketime is not installed (pip install "
                        "'faultlab[faketime]' or apt-get install libfaketime)")


def _report(capsys: pytest.CaptureFixture[str], line: str) -> None:
    """The measured costs, shown even under -q (they are what this server costs a run)."""
    with capsys.disabled():
        print(f"\n[pgserver] {line}")


def _shm_key(server: PrivateServer) -> int:
    lines = (server.data / "postmaster.pid").read_text().splitlines()
    return int(lines[6].split()[0])


def _zombies() -> set[int]:
    """Server processes this process must reap and has not: postgres zombies whose parent is
    this process (the server it started, or a server process handed to it as a child
    subreaper). A zombie of another test process's server (xdist runs several) is not ours."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                text = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            name, rest = text.split("(", 1)[1].rsplit(")", 1)
            fields = rest.split()
            if fields[0] == "Z" and int(fields[1]) == os.getpid() and name.startswith("postgres"):
                found.add(int(entry))
    return found


def _pgrep(directory: Path) -> list[str]:
    user = [] if os.geteuid() != 0 else ["-u", pgserver.SERVER_USER]
    done = subprocess.run(["pgrep", *user, "-f", str(directory)], capture_output=True,
                          text=True, check=False)
    return done.stdout.split()


def assert_nothing_left(directory: Path, key: int | None, zombies_before: set[int]) -> None:
    assert not directory.exists(), f"{directory} is still there"
    assert pgserver.processes_using(directory) == []
    assert _pgrep(directory) == []
    assert _zombies() <= zombies_before, "a server process was never reaped"
    if key is not None:
        assert pgserver.shared_memory_segments(key) == [], "System V segment left behind"


@pytest.fixture
def server() -> Iterator[PrivateServer]:
    _require()
    before = _zombies()
    with PrivateServer() as running:
        key = _shm_key(running)
        directory = running.directory
        yield running
    assert directory is not None
    assert_nothing_left(directory, key, before)


def _count(server: PrivateServer) -> int:
    with server.connect(autocommit=True) as connection:
        row = connection.execute("SELECT count(*) FROM t").fetchone()
    assert row is not None
    return int(row[0])


# -- start-up, settings, cleanup -----------------------------------------------------------

def test_root_without_a_server_user_is_a_one_line_reason(
        monkeypatch: pytest.MonkeyPatch) -> None:
    if os.geteuid() != 0:
        pytest.skip("only root needs a user to run the server as")
    monkeypatch.setattr(pgserver, "SERVER_USER", "faultlab-no-such-user")
    reason = pgserver.unavailable()
    assert reason is not None and "no 'faultlab-no-such-user' user" in reason
    assert "\n" not in reason
    with pytest.raises(PrivateServerUnavailable, match="refuse root"):
        PrivateServer().start()


def test_timeouts_run_on_the_virtual_clock(faketime: None, server: PrivateServer) -> None:
    """pg_sleep (and statement_timeout, deadlock_timeout...) measure wall time: on a
    frozen clock they wait until set_clock passes their deadline."""
    mover = threading.Timer(0.5, server.set_clock, (5,))
    with server.connect(autocommit=True) as connection:
        began = time.monotonic()
        mover.start()
        connection.execute("SELECT pg_sleep(0.1)")
        waited = time.monotonic() - began
    mover.join()
    assert 0.45 < waited < 3


# The test forks from this process on purpose (pytest-xdist's worker runs threads): the
# children run a few lines of ours and end with os._exit.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_a_forked_child_leaving_the_block_stops_nothing(server: PrivateServer) -> None:
    pid = os.fork()
    if pid == 0:  # the child leaves a with block it inherited, then exits normally
        code = 0
        try:
            server.__exit__(None, None, None)
            pgserver._stop_all()
        except BaseException:  # noqa: BLE001 - report through the exit status
            code = 1
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert server.running
    with pytest.raises(pgserver.PrivateServerError, match="belongs to process"):
        _in_child(server.crash)
    server.connect().close()


def _in_child(action: Any) -> None:
    """Run ``action`` in a forked child and re-raise its exception here (by type name)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            action()
            message = b""
        except BaseException as error:  # noqa: BLE001 - sent to the parent
            message = f"{error}".encode()
        os.write(write, message)
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    if message:
        raise pgserver.PrivateServerError(message)

def test_a_private_server_answers_on_its_own_socket_only(
        server: PrivateServer, capsys: pytest.CaptureFixture[str]) -> None:
    _report(capsys, f"start-up: initdb {server.timings['initdb']:.3f} s + start "
                    f"{server.timings['start']:.3f} s")
    assert server.port != 5432
    assert server.directory is not None and server.directory.name.startswith(
        f"{pgserver.DIRECTORY_PREFIX}{os.getpid()}-")
    assert (server.directory.stat().st_mode & 0o777) == 0o700
    assert (server.socket_directory / f".s.PGSQL.{server.port}").exists()
    with server.connect(autocommit=True) as connection:
        settings = dict(connection.execute(
            "SELECT name, setting FROM pg_settings WHERE name = ANY(%s)",
            (["fsync", "autovacuum", "listen_addresses", "port", "checkpoint_timeout",
              "dynamic_shared_memory_type", "server_version_num"],)).fetchall())
        user = connection.execute("SELECT current_user, usesuper FROM pg_user "
                                  "WHERE usename = current_user").fetchone()
    assert settings["fsync"] == "on" and settings["autovacuum"] == "off"
    assert settings["listen_addresses"] == "" and settings["port"] == str(server.port)
    assert settings["dynamic_shared_memory_type"] == "mmap"
    assert int(settings["checkpoint_timeout"]) >= 86400
    assert settings["server_version_num"].startswith("15")
    assert user == (pgserver.SUPERUSER, True)
    assert len(server.processes()) >= 3


def test_an_exception_inside_the_block_leaves_nothing() -> None:
    _require()
    before = _zombies()
    with pytest.raises(RuntimeError, match="inside"):
        with PrivateServer() as running:
            key = _shm_key(running)
            directory = running.directory
            running.connect().close()
            raise RuntimeError("inside")
    assert directory is not None
    assert_nothing_left(directory, key, before)


def test_stop_after_a_crash_removes_what_the_killed_server_left() -> None:
    """A killed postmaster leaves postmaster.pid, its socket and a System V segment."""
    _require()
    before = _zombies()
    with PrivateServer() as running:
        key = _shm_key(running)
        directory = running.directory
        backends = running.processes()
        running.crash()
        assert running.processes() == []
        assert all(not Path(f"/proc/{pid}").exists() for pid in backends)
        assert pgserver.shared_memory_segments(key) == []
        assert not (running.data / "postmaster.pid").exists()
        # under libfaketime, the killed processes used the server's area, not their own
        shared = [f"/dev/shm/{name}_{pid}" for pid in backends
                  for name in ("faketime_shm", "sem.faketime_sem")]
        assert [path for path in shared if Path(path).exists()] == []
    assert directory is not None
    assert_nothing_left(directory, key, before)
    assert list(Path("/dev/shm").glob(f"*faultlab-faketime-{os.getpid()}-*")) == []


_OWNER = textwrap.dedent("""
    import signal, sys, time
    from faultlab.stores.pgserver import PrivateServer

    def terminated(signum, frame):
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, terminated)
    with PrivateServer() as server:
        key = (server.data / "postmaster.pid").read_text().splitlines()[6].split()[0]
        print(server.directory, key, flush=True)
        while True:
            time.sleep(1)
""")


def _owner() -> tuple[subprocess.Popen[str], Path, int]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE,
                             text=True, env=env, cwd=ROOT)
    assert child.stdout is not None
    directory, key = child.stdout.readline().split()
    return child, Path(directory), int(key)


def test_sigterm_to_the_process_that_owns_a_server_leaves_nothing() -> None:
    _require()
    before = _zombies()
    child, directory, key = _owner()
    assert pgserver.processes_using(directory)
    child.send_signal(signal.SIGTERM)
    assert child.wait(30) == 143
    assert_nothing_left(directory, key, before)


def test_the_keeper_cleans_up_when_the_owner_is_sigkilled() -> None:
    """No finally and no atexit runs after SIGKILL: the keeper sees its owner gone."""
    _require()
    before = _zombies()
    child, directory, key = _owner()
    child.kill()
    child.wait(10)
    deadline = time.monotonic() + 15
    while (directory.exists() or pgserver.processes_using(directory)) and \
            time.monotonic() < deadline:
        time.sleep(0.05)
    assert_nothing_left(directory, key, before)


_STARTER = textwrap.dedent("""
    import sys
    from faultlab.base import interrupt
    from faultlab.stores.pgserver import PrivateServer

    with interrupt.handling():
        try:
            with PrivateServer():
                pass
        except interrupt.Interrupted as error:
            sys.exit(error.exit_code)
""")


def _orphaned_shared_memory(since: float) -> list[str]:
    """POSIX segments in /dev/shm named as PostgreSQL names them, and System V segments,
    made since ``since`` and attached by no process: left behind for good. (A segment of
    another test's live server is mapped by it.)"""
    mapped: set[str] = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                mapped.update(line.split()[-1] for line in
                              Path(f"/proc/{entry}/maps").read_text().splitlines()
                              if "/dev/shm/PostgreSQL." in line)
            except OSError:
                continue
    left = [str(path) for path in Path("/dev/shm").glob("PostgreSQL.*")
            if path.stat().st_ctime >= since and str(path) not in mapped]
    rows = Path("/proc/sysvipc/shm").read_text().splitlines()[1:]
    left += [f"System V segment {fields[1]}" for fields in map(str.split, rows)
             if int(fields[6]) == 0 and int(fields[13]) >= int(since)]
    return left


def test_a_signal_during_initdb_waits_for_it_and_leaves_no_shared_memory() -> None:
    """initdb's own postgres makes POSIX and System V shared memory (the server's setting
    that keeps it in the data directory is not initdb's): SIGTERM mid-initdb killed initdb
    alone and left both behind (two or more segments in most such runs). Now the signal
    waits until initdb has ended, and the run still ends with 143."""
    _require()
    began = time.time() - 1  # ctime has whole seconds in /proc/sysvipc
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    child = subprocess.Popen([sys.executable, "-c", _STARTER], env=env, cwd=ROOT,
                             stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not subprocess.run(["pgrep", "-P", str(child.pid), "-x", "initdb"],
                             capture_output=True).stdout:
        assert child.poll() is None and time.monotonic() < deadline, "initdb never started"
        time.sleep(0.005)
    time.sleep(0.1)  # initdb's postgres is making its segments now
    child.send_signal(signal.SIGTERM)
    _, err = child.communicate(timeout=60)
    assert child.returncode == 143, err
    assert _orphaned_shared_memory(began) == []


# -- crash and recovery --------------------------------------------------------------------

def _commit_rows(server: PrivateServer, synchronous: str, start: int, rows: int) -> None:
    """``rows`` quick single-row commits, then crash while the session is still open."""
    with server.connect(autocommit=True) as connection:
        connection.execute(f"SET synchronous_commit = {synchronous}")
        for number in range(start, start + rows):
            connection.execute("INSERT INTO t VALUES (%s, repeat('x', 100))", (number,))
        server.crash()


def test_commits_survive_a_crash_unless_asynchronous(capsys: pytest.CaptureFixture[str]) -> None:
    """The negative control for an async-commit mutant: the same 200 commits, with
    synchronous_commit on all survive a crash; off (WAL writer asleep for 10 s) some are
    lost although every COMMIT returned."""
    _require()
    with PrivateServer(settings={"wal_writer_delay": "10s"}) as running:
        with running.connect(autocommit=True) as connection:
            connection.execute("CREATE TABLE t (n integer PRIMARY KEY, pad text)")
        _commit_rows(running, "on", 0, 200)
        running.restart()
        assert _count(running) == 200
        recovery = running.timings["restart"]
        _commit_rows(running, "off", 200, 200)
        running.restart()
        survived = _count(running)
        _report(capsys, f"restart with crash recovery: {recovery:.3f} s; asynchronous "
                        f"commits lost in the crash: {400 - survived} of 200")
        assert 200 <= survived < 400


def test_a_restart_without_a_crash_crashes_first(server: PrivateServer) -> None:
    with server.connect(autocommit=True) as connection:
        connection.execute("CREATE TABLE t (n integer)")
        connection.execute("INSERT INTO t VALUES (1)")
    server.restart()
    assert _count(server) == 1
    with server.connect(autocommit=True) as connection:
        recovered = connection.execute("SELECT pg_is_in_recovery()").fetchone()
    assert recovered == (False,)


# -- dropped sessions ----------------------------------------------------------------------

_HOLDER = textwrap.dedent("""
    import sys, psycopg
    connection = psycopg.connect(sys.argv[1], autocommit=True,
                                 application_name="faultlab-test-holder")
    connection.execute("SELECT pg_advisory_lock(42)")
    print(connection.info.backend_pid, flush=True)
    sys.stdin.readline()
    try:
        connection.execute("SELECT 1")
        print("still connected", flush=True)
    except psycopg.OperationalError:
        print("dropped", flush=True)
""")


def test_terminating_a_backend_frees_its_advisory_lock_while_the_client_lives(
        server: PrivateServer) -> None:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, server.conninfo],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert holder.stdin is not None and holder.stdout is not None
    try:
        backend = int(holder.stdout.readline())
        with server.connect(autocommit=True) as other:
            assert other.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (False,)
            assert server.terminate_backends_of("faultlab-test-holder") == [backend]
            assert holder.poll() is None, "the client process must live on"
            assert other.execute("SELECT pg_try_advisory_lock(42)").fetchone() == (True,)
        assert server.terminate_backend(backend) is False  # already gone
        holder.stdin.write("\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "dropped"
    finally:
        holder.kill()
        holder.wait()


# -- the clock -----------------------------------------------------------------------------

def _now(connection: Any, what: str) -> datetime:
    row = connection.execute(f"SELECT {what}").fetchone()
    assert row is not None
    value: datetime = row[0]
    return value


def test_the_virtual_clock_moves_only_when_set(faketime: None, server: PrivateServer) -> None:
    assert server.virtual_clock
    with server.connect(autocommit=True) as connection:
        started = _now(connection, "pg_postmaster_start_time()")
        assert started == EPOCH
        first = _now(connection, "clock_timestamp()")
        time.sleep(0.3)
        assert _now(connection, "clock_timestamp()") == first  # frozen between ticks
        assert _now(connection, "now()") == first
        server.set_clock(60)
        moved = _now(connection, "clock_timestamp()") - first
        assert abs(moved - timedelta(seconds=60)) < timedelta(seconds=1)
        assert _now(connection, "statement_timestamp()") == EPOCH + timedelta(seconds=60)
    with server.connect() as connection:  # one transaction: now() is its start
        begun = _now(connection, "now()")
        server.set_clock(90.0)  # a float that is a whole number of seconds
        assert _now(connection, "now()") == begun
        assert _now(connection, "statement_timestamp()") == EPOCH + timedelta(seconds=90)
        assert _now(connection, "clock_timestamp()") == EPOCH + timedelta(seconds=90)
        connection.rollback()
        assert _now(connection, "now()") == EPOCH + timedelta(seconds=90)
    with pytest.raises(ValueError, match="whole seconds"):
        server.set_clock(90.25)
    assert server.clock == 90
    server.restart()  # the clock survives a crash and restart
    with server.connect(autocommit=True) as connection:
        assert _now(connection, "now()") == EPOCH + timedelta(seconds=90)


#: How long the clock is read under a storm of timeout signals: the old timestamp-file
#: clock hung a backend within a second or two here, every time.
SIGNAL_STORM_SECONDS = 4.0


def test_clock_reads_inside_timeout_signals_neither_hang_nor_corrupt_a_backend(
        faketime: None, server: PrivateServer) -> None:
    """PostgreSQL reads the wall clock in its SIGALRM handler (every timeout). With the
    connection check every millisecond the alarm fires about a thousand times a second
    while the statement reads the clock in a loop: a clock read that is not
    async-signal-safe (libfaketime's timestamp file, an fopen per read) deadlocks the
    backend inside malloc or aborts it with a corrupted heap."""
    rounds = 0
    failure: list[BaseException] = []

    def hammer() -> None:
        nonlocal rounds
        try:
            with server.connect(autocommit=True) as connection:
                connection.execute("SET client_connection_check_interval = 1")
                began = time.monotonic()
                while time.monotonic() - began < SIGNAL_STORM_SECONDS:
                    row = connection.execute(
                        "SELECT count(clock_timestamp()) FROM generate_series(1, 20000)"
                    ).fetchone()
                    assert row == (20000,)
                    rounds += 1
        except BaseException as error:  # reported by the test's thread below
            failure.append(error)

    worker = threading.Thread(target=hammer, daemon=True)
    worker.start()
    worker.join(SIGNAL_STORM_SECONDS + 20)
    hung = worker.is_alive()
    if hung:
        server.crash()  # drops the hung session, so the thread ends
        worker.join(10)
    log = server.log_path.read_text(errors="replace")
    assert not hung, f"a backend hung reading the clock in a signal handler ({rounds} rounds)"
    assert not failure, f"{failure[0]!r}\n{log[-2000:]}"
    assert "terminated by signal" not in log and "corrupted" not in log, log[-2000:]
    assert rounds >= 5


def test_without_the_virtual_clock_the_server_keeps_real_time() -> None:
    _require()
    with PrivateServer(virtual_clock=False) as running:
        assert not running.virtual_clock
        with pytest.raises(PrivateServerUnavailable, match="real clock"):
            running.set_clock(60)
        with running.connect(autocommit=True) as connection:
            now = _now(connection, "clock_timestamp()")
    assert abs(now.timestamp() - time.time()) < 5


# -- the shared server ---------------------------------------------------------------------

def test_the_shared_server_is_not_touched() -> None:
    _require()
    import psycopg

    shared = os.environ.get("FAULTLAB_TEST_POSTGRES", "")
    try:
        with psycopg.connect(shared, dbname="postgres", autocommit=True,
                             connect_timeout=3) as connection:
            before = connection.execute("SELECT pg_postmaster_start_time(), "
                                        "current_setting('port')").fetchone()
    except psycopg.OperationalError as error:
        require_service("postgres", "no shared server to compare with: "
                        + str(error).strip().splitlines()[-1])
    assert before is not None
    with PrivateServer() as running:
        assert str(running.port) != before[1]
        running.crash()
        running.restart()
    with psycopg.connect(shared, dbname="postgres", autocommit=True,
                         connect_timeout=3) as connection:
        after = connection.execute("SELECT pg_postmaster_start_time(), "
                                   "current_setting('port')").fetchone()
    assert after == before
