"""A Redis corpus that goes away in the middle of a run: through a TCP proxy this test
stalls or kills, never the server itself.

The run must end with one line naming the corpus (exit 3), within seconds of the loss
(a socket timeout, never the budget's end or later), without reporting the lost server as
an invariant failure, without tracebacks under ``--jobs 2``; and the shard's entry must
not claim ``running`` for days: a run that ended in an error says so, and a ``running``
entry nobody refreshes expires in minutes.

Needs a Redis server on 127.0.0.1:6379 and the redis client; skips when absent, fails
instead when FAULTLAB_REQUIRE_SERVICES names redis. Each test takes a database that is
empty when it starts and deletes only the keys it made.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ROOT, TESTS, lock_redis_database, require_service

from faultlab.corpus.redis_store import (
    COUNTER_TTL_SECONDS,
    MARKER,
    MARKER_KEY,
    RUNNING_TTL_SECONDS,
    SOCKET_TIMEOUT_SECONDS,
    RedisCorpus,
)

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

HOST, PORT = "127.0.0.1", 6379
SHARD = "faultlab:shard:0/1"


class Proxy:
    """127.0.0.1:<free port> forwarding to the Redis server, until :meth:`stall` (the
    bytes stop moving, the connections stay open) or :meth:`kill` (the listener and every
    connection closed: new ones are refused)."""

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.stalled = threading.Event()
        self.killed = threading.Event()
        self.sockets: list[socket.socket] = []
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.killed.is_set():
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection((HOST, PORT), timeout=5)
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets += [client, upstream]
            for source, target in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while True:
                data = source.recv(65536)
                if not data:
                    break
                while self.stalled.is_set() and not self.killed.is_set():
                    time.sleep(0.05)  # held, never delivered while stalled
                if self.killed.is_set():
                    break
                target.sendall(data)
        except OSError:
            pass
        for end in (source, target):
            end.close()

    def stall(self) -> None:
        self.stalled.set()

    def kill(self) -> None:
        self.killed.set()
        self.listener.close()
        with self.lock:
            for end in self.sockets:
                try:
                    end.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                end.close()


def _client(db: int) -> Any:
    try:
        import redis
    except ImportError:
        require_service("redis", "the redis client is not installed")
    client = redis.Redis(host=HOST, port=PORT, db=db, socket_timeout=5,
                         socket_connect_timeout=2, decode_responses=True)
    try:
        client.ping()
    except (redis.RedisError, OSError) as error:
        require_service("redis", f"no server at {HOST}:{PORT}: {error}")
    return client


@pytest.fixture
def corpus_db() -> Iterator[tuple[int, Any]]:
    """An empty database, marked as a faultlab corpus at once (so no other test takes it
    as empty), and a direct client on it."""
    for db in range(1, 16):
        lock = lock_redis_database(db)
        if lock is None:
            continue  # another test process is using it
        client = _client(db)
        if client.dbsize() == 0 and client.set(MARKER_KEY, MARKER, nx=True):
            break
        client.close()
        lock.close()
    else:
        pytest.fail("no empty Redis database among 1-15 to test in")
    try:
        yield db, client
    finally:
        keys = list(client.scan_iter("faultlab:*"))
        if keys:
            client.delete(*keys)
        client.close()
        lock.close()


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    through = Proxy()
    try:
        yield through
    finally:
        through.kill()


def _explore(url: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--quiet", "--corpus", url, *args],
        cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _wait_running(client: Any, process: subprocess.Popen[str]) -> None:
    """Until the run has published counters with a step or more (it reaches the server)."""
    ends = time.monotonic() + 60
    while time.monotonic() < ends:
        fields = client.hgetall(SHARD)
        if fields.get("state") == "running" and int(fields.get("steps", "0")) > 0:
            return
        if process.poll() is not None:
            pytest.fail("the run ended before it published: " + "".join(process.communicate()))
        time.sleep(0.2)
    process.kill()
    pytest.fail("no running counters within 60 s: " + "".join(process.communicate()))


#: After the loss: a command times out (twice: one retry), the step in flight ends, the
#: run winds down. Far below the budgets the tests give (without the fix: 2 minutes).
WIND_DOWN = 4 * SOCKET_TIMEOUT_SECONDS + 8


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_stalled_server_ends_the_run_in_seconds_with_one_line(
    corpus_db: tuple[int, Any], proxy: Proxy, jobs: str,
) -> None:
    db, client = corpus_db
    url = f"redis://127.0.0.1:{proxy.port}/{db}"
    process = _explore(url, "--duration", "60", "--jobs", jobs)
    _wait_running(client, process)
    proxy.stall()
    stalled = time.monotonic()
    try:
        out, err = process.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        pytest.fail("a stalled Redis server hung the run past its 60 s budget")
    took = time.monotonic() - stalled
    assert took < WIND_DOWN, (took, err)
    assert "invariant failed" not in out + err and "shrinking" not in out + err
    assert process.returncode == 3, out + err
    assert "FOUND" not in out and "clean" not in out
    assert err.splitlines() == [err.strip()] and err.startswith(
        f"faultlab: run failed: the Redis corpus at {url} went away: "), err
    # the run could not say it ended; its entry expires soon instead of in a week
    fields = client.hgetall(SHARD)
    assert fields["state"] == "running"
    assert 0 < client.ttl(SHARD) <= RUNNING_TTL_SECONDS


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_a_killed_server_ends_the_run_with_one_line_and_no_traceback(
    corpus_db: tuple[int, Any], proxy: Proxy, jobs: str,
) -> None:
    db, client = corpus_db
    url = f"redis://127.0.0.1:{proxy.port}/{db}"
    process = _explore(url, "--duration", "60", "--jobs", jobs)
    _wait_running(client, process)
    proxy.kill()
    killed = time.monotonic()
    out, err = process.communicate(timeout=90)
    assert process.returncode == 3, out + err
    assert "Traceback" not in err and "leaked" not in err, err
    assert err.splitlines() == [err.strip()] and err.startswith(
        f"faultlab: run failed: the Redis corpus at {url} went away: "), err
    assert "invariant failed" not in out + err and "FOUND" not in out
    assert time.monotonic() - killed < WIND_DOWN
    assert 0 < client.ttl(SHARD) <= RUNNING_TTL_SECONDS


def test_a_run_that_fails_marks_its_shard_failed(corpus_db: tuple[int, Any]) -> None:
    """The run ends in an error of its own (a worker past its deadline) while the server
    answers: the shard says ``failed``, not ``running``."""
    db, client = corpus_db
    process = _explore(f"redis://{HOST}:{PORT}/{db}", "--system",
                       "systems_for_tests:HangingOutbox", "--deadline", "1", "--examples", "3")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 3, out + err
    assert len(err.splitlines()) == 1 and "Redis" not in err, err
    fields = client.hgetall(SHARD)
    assert fields["state"] == "failed", fields
    assert client.ttl(SHARD) > RUNNING_TTL_SECONDS


def test_an_interrupted_run_marks_its_shard_interrupted(corpus_db: tuple[int, Any]) -> None:
    db, client = corpus_db
    process = _explore(f"redis://{HOST}:{PORT}/{db}", "--duration", "60")
    _wait_running(client, process)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=60)
    assert process.returncode == 143, out + err
    assert client.hgetall(SHARD)["state"] == "interrupted"
    assert client.ttl(SHARD) > RUNNING_TTL_SECONDS


def test_a_running_entry_expires_in_minutes_an_ended_one_in_days(
    corpus_db: tuple[int, Any],
) -> None:
    db, client = corpus_db
    corpus = RedisCorpus(f"redis://{HOST}:{PORT}/{db}", create=False)
    try:
        corpus.update_counters("0/1", {"state": "running", "steps": 1})
        assert 0 < client.ttl(SHARD) <= RUNNING_TTL_SECONDS
        corpus.update_counters("0/1", {"state": "done", "steps": 2})
        assert RUNNING_TTL_SECONDS < client.ttl(SHARD) <= COUNTER_TTL_SECONDS
    finally:
        corpus.close()
