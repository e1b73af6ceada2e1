"""A private server that dies by itself while faultlab restarts it after a ``server_crash``
step: a server process SIGKILLed just after the restart (as the OOM killer would) makes the
server stop (``restart_after_crash = off``), so the run's admin session cannot be reopened.
That is the run's failure (exit 3, the server's own account quoted), never bad input
(exit 2): the server answered when the run began.

The steps a ``server_crash`` takes are called one by one here, so the kill lands at the one
moment that matters every time, not only when a loaded machine makes it."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest
from conftest import require_private_postgres

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.stores import postgres as pgstores
from faultlab.stores.pgserver import PrivateServer


def test_a_server_that_dies_while_the_run_resumes_after_its_restart_fails_the_run() -> None:
    require_private_postgres()
    server = PrivateServer()
    try:
        server.start()
        pgstores.configure(server.conninfo, server=server)
        run = pgstores.current_run()
        run.suspend()
        server.crash()
        server.restart()
        with server.connect(autocommit=True, application_name="test-victim") as victim:
            backend = int(victim.execute("SELECT pg_backend_pid()").fetchone()[0])
            os.kill(backend, signal.SIGKILL)  # a process of the server faultlab started
            deadline = time.monotonic() + 30
            while server.died() is None and time.monotonic() < deadline:
                time.sleep(0.02)
        assert server.died() is not None, "the server went on after a process was killed"
        with pytest.raises(ExecutionError) as failure:
            run.resume()
        assert not isinstance(failure.value, UsageError)
        message = str(failure.value)
        assert message.startswith("the private PostgreSQL server stopped by itself"), message
        assert "terminated by signal 9" in message, message
    finally:
        pgstores.close_run()
        pgstores.configure(None)
        server.stop()
    assert server.directory is None or not server.directory.exists()


def test_databases_on_a_server_that_restarts_as_the_run_ends_are_still_dropped() -> None:
    """A user's server (a DSN, not faultlab's own) restarting while the run ends refused
    every drop at once: eight to seventeen databases stayed, one "could not drop" line
    each. The drops are tried again while it comes back."""
    require_private_postgres()
    server = PrivateServer()  # stands for the user's server: configured by DSN alone
    try:
        server.start()
        pgstores.configure(server.conninfo)
        run = pgstores.current_run()
        made = [run._new_name("c") for _ in range(3)]
        for name in made:
            run._create_with_admin(name, None)
        server.crash()
        restart = threading.Timer(1.0, server.restart)
        restart.start()
        try:
            left = pgstores.close_run()
        finally:
            restart.join()
        assert left == []
        with server.connect(autocommit=True) as connection:
            names = {row[0] for row in connection.execute("SELECT datname FROM pg_database")}
        assert names.isdisjoint(made), sorted(names)
    finally:
        pgstores.close_run()
        pgstores.configure(None)
        server.stop()
