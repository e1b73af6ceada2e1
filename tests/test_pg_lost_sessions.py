"""A run on faultlab's private PostgreSQL server whose own sessions the server ends, or whose
server dies by itself.

* The server ends the run's admin session and its snapshot readers between two steps
  (``pg_terminate_backend`` from a separate connection, as a restart or an operator
  would): they are reopened, the trace runs on as if nothing happened, and every
  database the run made is dropped at its end.
* A server process is SIGKILLed mid-run (as the OOM killer would on a loaded machine):
  PostgreSQL would reinitialise the whole server, ending every session and running crash
  recovery faultlab did not ask for. The private server runs with
  ``restart_after_crash = off``, so it stops instead, and the run fails with one line
  naming it and quoting the server log's last lines (exit 3): no finding, no traceback,
  nothing left behind.
"""

from __future__ import annotations

import glob
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ROOT, require_private_postgres

from faultlab.process.spawn import Spawner
from faultlab.run.executor import Executor, execute
from faultlab.stores import postgres as pgstores
from faultlab.stores.pgserver import PrivateServer
from faultlab.system import load_system
from faultlab.trace import SERVER_CRASH, Step

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

PAYLOAD = {"title": "invoice", "count": 3}


def _require() -> None:
    require_private_postgres()


@pytest.fixture(scope="module")
def private() -> Iterator[PrivateServer]:
    _require()
    server = PrivateServer()
    try:
        server.start()
        pgstores.configure(server.conninfo, server=server)
        yield server
    finally:
        pgstores.close_run()
        pgstores.configure(None)
        server.stop()


def _end_run_sessions(server: PrivateServer) -> list[str]:
    """Terminate this process's run's admin session and snapshot readers from a connection
    of the test's own; the application names of the sessions ended."""
    run = pgstores.active_run()
    if run is None:
        raise AssertionError("no PostgreSQL run is active")
    with server.connect(autocommit=True, application_name="test-terminator") as connection:
        rows = connection.execute(
            "SELECT application_name, pg_terminate_backend(pid, 5000) FROM pg_stat_activity "
            "WHERE (application_name = 'faultlab-admin' OR application_name LIKE %s) "
            "AND pid <> pg_backend_pid()", (f"{run.application}-snapshot-%",)).fetchall()
    return sorted(str(name) for name, ended in rows if ended)


def _outcome(observations: list[Any], final: list[Any]) -> list[Any]:
    return [(o.step, o.snapshot, o.violations, o.record.exit_code)
            for o in observations] + [final]


def test_sessions_the_server_ends_between_steps_are_reopened_and_the_run_cleans_up(
        private: PrivateServer, fork_spawner: Spawner) -> None:
    system = load_system("reference-pg")
    steps = [Step("accept", "op-1", PAYLOAD), Step("dispatch"), Step(SERVER_CRASH),
             Step("accept", "op-2", PAYLOAD)]
    undisturbed = execute(system, steps, fork_spawner, settle=True)
    assert undisturbed.verdict.clean, undisturbed.violations
    ended: list[list[str]] = []
    with Executor(system, fork_spawner) as executor:
        for step in steps:
            executor.run(step)
            ended.append(_end_run_sessions(private))
        _, final = executor.settle()
        observations = list(executor.observations)
        ended.append(_end_run_sessions(private))  # the trace's release meets a dead admin
    assert all("faultlab-admin" in names for names in ended), ended
    assert any(any("-snapshot-" in name for name in names) for names in ended), ended
    assert _outcome(observations, final) == _outcome(undisturbed.observations,
                                                     undisturbed.final_violations)
    run = pgstores.active_run()
    if run is None:
        raise AssertionError("no PostgreSQL run is active")
    prefix = run.prefix
    _end_run_sessions(private)  # and so does the run's end
    assert pgstores.close_run() == []
    with private.connect(autocommit=True) as connection:
        assert pgstores.list_databases(connection, prefix) == []


def _left_behind(pid: int) -> list[str]:
    directories = glob.glob(f"/dev/shm/faultlab-pg-{pid}-*")
    found = list(directories)
    for directory in directories:
        found += subprocess.run(["pgrep", "-f", directory], capture_output=True,
                                text=True, check=False).stdout.split()
    return found


def _postmaster(directory: str) -> int | None:
    """The pid of the private server's postmaster running now in ``directory``, or None."""
    try:
        return int(open(f"{directory}/data/postmaster.pid").read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _a_client_backend(directory: str) -> tuple[int, int] | None:
    """The postmaster and the pid of the server process of a long-lived session of the
    private server in ``directory`` (the run's admin, on database ``postgres``), or None."""
    postmaster = _postmaster(directory)
    if postmaster is None:
        return None
    listed = subprocess.run(["pgrep", "-a", "-P", str(postmaster)], capture_output=True,
                            text=True, check=False).stdout.splitlines()
    return next(((postmaster, int(line.split()[0])) for line in listed
                 if "postgres: faultlab postgres " in line), None)


#: Seconds a run may go on after its server lost a process before the test calls it a hang.
STOPS_WITHIN = 30


def _kill_a_backend_until_the_run_ends(run: subprocess.Popen[str], directory: str,
                                       deadline: float) -> tuple[str, str]:
    """SIGKILL a backend of the server the run uses now, and wait for the run to end.

    The run's own ``server_crash`` steps kill and restart the whole server every few
    steps: a kill that lands while one does (the victim was already dying with its
    server) is absorbed by a crash faultlab made, and the run rightly goes on, on a new
    postmaster. Then the new server's backend is killed. A run that goes on under the
    postmaster whose process was killed is the defect this test guards against.
    """
    while True:
        found = _a_client_backend(directory)
        if found is None:  # between a crash and its restart: the new server comes soon
            if run.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(run.communicate())
            time.sleep(0.02)
            continue
        postmaster, victim = found
        try:
            os.kill(victim, signal.SIGKILL)  # as the OOM killer would
        except ProcessLookupError:
            continue
        try:
            return run.communicate(timeout=STOPS_WITHIN)
        except subprocess.TimeoutExpired:
            if _postmaster(directory) == postmaster or time.monotonic() > deadline:
                raise AssertionError(f"the run went on for {STOPS_WITHIN} s after "
                                     f"postmaster {postmaster} lost process {victim}") from None


def test_a_server_process_killed_mid_run_fails_the_run_in_one_line_and_leaves_nothing() -> None:
    _require()
    run = subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--system", "reference-pg", "--postgres",
         "private", "--seed", "0", "--quiet", "--examples", "100000", "--steps", "6"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        directories: list[str] = []
        while not directories or _a_client_backend(directories[0]) is None:
            if run.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(run.communicate())
            directories = glob.glob(f"/dev/shm/faultlab-pg-{run.pid}-*")
            time.sleep(0.05)
        time.sleep(1)  # exploring by now
        out, err = _kill_a_backend_until_the_run_ends(run, directories[0], deadline)
    finally:
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            run.communicate(timeout=60)
    assert run.returncode == 3, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("faultlab: run failed: the private PostgreSQL server stopped "
                               "by itself"), err
    assert "terminated by signal 9" in lines[0], err
    assert "Traceback" not in err and "FOUND" not in out
    assert _left_behind(run.pid) == []
    assert glob.glob(f"/dev/shm/faultlab-{run.pid}-*") == []  # nor a trace's run directory
