"""A command-line system on PostgreSQL under ``--concurrency``: a live lane's backends are
its own, not an ended worker's.

A command's connection strings are written before its process exists, so they cannot
name its pid: each worker gets a tag of its own in ``application_name``, and a lane
registers it with its process until it is reaped. Before, every command-line backend
counted as an ended worker's, and a snapshot while a lane was held (``run accept``,
``start dispatch``) waited 5 s for it and stopped the run with exit 3.

Skipped with a reason when no server answers (failed when FAULTLAB_REQUIRE_SERVICES
names ``postgres``); every test checks that no ``faultlab_`` database is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, TESTS
from test_postgres import DSN, server  # noqa: F401 - the fixture

from faultlab.process.spawn import child_environment
from faultlab.run.executor import Executor
from faultlab.stores import postgres as pgstores
from faultlab.system import load_system
from faultlab.trace import Step

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("server")]

EXAMPLE = ROOT / "examples" / "postgres_outbox"
PAYLOAD = {"title": "invoice", "count": 3}


def _announcing(tmp_path: Path) -> Path:
    """examples/postgres_outbox/system.json with its program announcing its points."""
    data = json.loads((EXAMPLE / "system.json").read_text())
    data["name"] = "postgres-outbox-announcing"
    data["crash"] = {"mode": "announce"}
    for argv in data["commands"].values():
        argv[1:2] = [str(TESTS / "pg_announcing_outbox.py"), str(EXAMPLE)]
    path = tmp_path / "system.json"
    path.write_text(json.dumps(data))
    return path


def test_a_held_command_lane_keeps_its_backends(tmp_path: Path) -> None:
    system = load_system(str(_announcing(tmp_path)))
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1))
        held = ex.run(Step("dispatch", lane=2, hold=True))  # its claim's transaction open
        assert held.lanes == ("exit 0", "dispatch @before_dispatch")
        done = ex.run(Step("finish", lane=2))
        assert done.lanes == ("exit 0", "exit 0")
        assert len(done.snapshot.tickets) == 1
    assert pgstores._command_workers == {}  # every lane reaped, every tag gone


def test_a_killed_command_lane_is_waited_for(tmp_path: Path) -> None:
    """A lane that ended (killed at its point) is an ended worker again: the snapshot
    waits for its backend, and shows its claim's transaction rolled back."""
    system = load_system(str(_announcing(tmp_path)))
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", PAYLOAD, lane=1))
        ex.run(Step("dispatch", lane=2, hold=True))
        killed = ex.run(Step("kill", lane=2))
        assert killed.lanes == ("exit 0", "exit -9"), killed.lanes
        assert killed.snapshot.counts()["outbox_pending"] == 1
        recovered = ex.run(Step("dispatch", lane=1))
        assert len(recovered.snapshot.tickets) == 1


@pytest.mark.slow  # 30-60 s: every trace clones two databases and starts real programs
def test_explore_concurrency_on_a_command_postgres_system(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "faultlab", "explore", "--system", str(_announcing(tmp_path)),
         "--concurrency", "2", "--postgres", DSN or "dbname=postgres", "--examples", "5",
         "--steps", "6", "--seed", "1", "--quiet", "--corpus", str(tmp_path / "corpus")],
        cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=600)
    assert "after its worker ended" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stderr == "" and "clean: no invariant failed" in done.stdout
