"""Shared fixtures: one fork-mode and one exec-mode spawner per session, the reference system.

Works both when tox installed the package and with ``PYTHONPATH=. pytest`` (or
plain ``pytest`` from the repository root): if :mod:`faultlab` is not importable
the source tree is put on ``sys.path``. The tests directory is always on
``sys.path`` so ``systems_for_tests:...`` system references resolve, in this
process, in the fork server (which copies ``sys.path``) and in exec-mode
workers (which get it as ``PYTHONPATH``).
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent

if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))
if importlib.util.find_spec("faultlab") is None:  # pragma: no cover - uninstalled checkout
    sys.path.insert(0, str(ROOT))

from faultlab.process.spawn import Spawner, spawner  # noqa: E402
from faultlab.system import System, load_system  # noqa: E402

if TYPE_CHECKING:
    from faultlab.search.explore import Exploration


def explore_lanes(system: System, **settings: Any) -> Exploration:
    """One exploration with lanes (``concurrency`` 2 unless given) on a fork server of its own:
    :func:`faultlab.search.explore.explore` as a test that has no spawner calls it."""
    from faultlab.search.explore import explore

    with spawner("fork") as runner:
        return explore(system, runner, **{"concurrency": 2, **settings})


@pytest.fixture(scope="session")
def fork_spawner() -> Iterator[Spawner]:
    with spawner("fork") as runner:
        yield runner


@pytest.fixture(scope="session")
def exec_spawner() -> Iterator[Spawner]:
    with spawner("exec") as runner:
        yield runner


@pytest.fixture(scope="session")
def reference() -> System:
    return load_system("reference")


def required_services() -> set[str]:
    """FAULTLAB_REQUIRE_SERVICES (comma list, set by .ci/run): services that must be present."""

    names = os.environ.get("FAULTLAB_REQUIRE_SERVICES", "")
    return {name.strip() for name in names.split(",") if name.strip()}


def lock_redis_database(db: int) -> socket.socket | None:
    """A bound socket holding this machine's test lock on Redis database ``db``, or None
    when another test process holds it: tests running in parallel (pytest-xdist) each look
    for an empty database, and two of them once took the same one between looking and
    writing. The lock is a name in Linux's abstract socket namespace, which one socket at a
    time can bind: closing the socket (or the process ending) releases it, and nothing is
    left on disk."""
    lock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        lock.bind(f"\0faultlab-test-redis-{db}")
    except OSError as error:
        lock.close()
        if error.errno == errno.EADDRINUSE:
            return None
        raise
    return lock


def require_service(name: str, reason: str) -> None:
    """Skip with ``reason`` when a service is missing, or fail when the environment demands it."""
    if name in required_services():
        pytest.fail(f"{reason}, and FAULTLAB_REQUIRE_SERVICES names {name}")
    pytest.skip(reason)


def trace_on_postgres(path: Path) -> bool:
    """Whether the trace file ``path`` runs a system whose stores are on PostgreSQL: it
    replays on faultlab's own server (its server_crash and drop_connection steps, and a
    server clock, run nowhere else)."""
    from faultlab.system import load_system

    system = load_system(json.loads(path.read_text())["system"])
    return getattr(system, "store_kind", None) == "postgres"


def require_private_postgres() -> None:
    """Skip (or fail, where the environment demands postgres) unless faultlab can start its
    own PostgreSQL server here and psycopg is installed."""
    from faultlab.stores import pgserver

    reason = pgserver.unavailable()
    if reason is not None:
        require_service("postgres", reason)
    try:
        import psycopg  # noqa: F401
    except ImportError:
        require_service("postgres", "psycopg (the postgres extra) is not installed")
