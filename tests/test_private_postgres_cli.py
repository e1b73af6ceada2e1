"""``--postgres private``: a run on faultlab's own PostgreSQL server leaves nothing behind and
never touches the shared server."""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import ROOT, require_private_postgres

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)


@pytest.fixture(autouse=True)
def _private_server_possible() -> None:
    require_private_postgres()


def _shared_start_time() -> str | None:
    """When the shared server on 5432 started (None when there is none to compare)."""
    import psycopg

    try:
        with psycopg.connect("host=127.0.0.1 port=5432 dbname=postgres connect_timeout=3") as c:
            row = c.execute("SELECT pg_postmaster_start_time()::text").fetchone()
    except psycopg.OperationalError:
        return None
    return None if row is None else str(row[0])


def _left_behind(pid: int) -> list[str]:
    """Directories and server processes of the private server that run ``pid`` started."""
    directories = glob.glob(f"/dev/shm/faultlab-pg-{pid}-*")
    found = list(directories)
    for directory in directories:
        found += subprocess.run(["pgrep", "-f", directory], capture_output=True,
                                text=True, check=False).stdout.split()
    return found


def _explore(*extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--system", "reference-pg", "--postgres",
         "private", "--seed", "0", "--quiet", *extra],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def test_a_private_server_run_is_clean_leaves_nothing_and_spares_the_shared_server() -> None:
    shared = _shared_start_time()
    run = _explore("--examples", "5", "--steps", "6")
    out, err = run.communicate(timeout=300)
    assert run.returncode == 0, out + err
    assert "clean: no invariant failed" in out
    assert _left_behind(run.pid) == []
    assert _shared_start_time() == shared


def test_an_interrupted_private_server_run_leaves_nothing() -> None:
    run = _explore("--examples", "100000", "--steps", "6")
    deadline = time.monotonic() + 60
    while not glob.glob(f"/dev/shm/faultlab-pg-{run.pid}-*"):  # the server is being made
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()
        time.sleep(0.05)
    time.sleep(3)  # exploring by now
    assert _left_behind(run.pid) != []  # control: the server was there while it ran
    os.kill(run.pid, signal.SIGINT)
    sent = time.monotonic()
    out, err = run.communicate(timeout=120)
    took = time.monotonic() - sent
    assert run.returncode == 130, out + err
    # under 2 s on a quiet machine (0.4-0.8 s measured; the slow shared-server test holds
    # 2 s); a margin here, where the default run's other tests share the two cores
    assert took < 3.0, f"{took:.1f} s from the signal to the exit, the server stopped"
    assert _left_behind(run.pid) == []
