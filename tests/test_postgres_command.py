"""Command-line systems whose stores are PostgreSQL databases (examples/postgres_outbox).

Skipped with a reason when no server answers (failed when FAULTLAB_REQUIRE_SERVICES
names ``postgres``); every test checks that no ``faultlab_`` database is left behind.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from test_postgres import server  # noqa: F401 - the fixture

from faultlab.base.errors import UsageError
from faultlab.process.spawn import Spawner, child_environment
from faultlab.run.executor import Executor
from faultlab.system.command import load_command_system
from faultlab.trace import Step

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("server")]

SYSTEM = ROOT / "examples" / "postgres_outbox" / "system.json"
PAYLOAD = {"title": "invoice", "count": 3}


def _variant(tmp_path: Path, change: Any) -> Path:
    data = json.loads(SYSTEM.read_text())
    change(data)
    for role, argv in data["commands"].items():
        data["commands"][role] = [a.replace("{system_dir}", str(SYSTEM.parent)) for a in argv]
    path = tmp_path / "system.json"
    path.write_text(json.dumps(data))
    return path


def _downstream(data: dict[str, Any], store: Any) -> None:
    """Make the downstream store something else; no command uses {dsn:downstream} then."""
    data["stores"]["downstream"] = store
    for argv in data["commands"].values():
        argv[argv.index("{dsn:downstream}")] = "unused"


def test_a_command_system_on_postgres_runs_and_is_judged_on_the_server(
        fork_spawner: Spawner) -> None:
    system = load_command_system(str(SYSTEM))
    assert system.store_kind == "postgres"
    with Executor(system, fork_spawner) as executor:
        values = system.values(executor.directory)
        assert set(values) >= {"dsn:caller", "dsn:downstream"}
        assert "application_name=faultlab-" in values["dsn:caller"]
        executor.run(Step("accept", "op-1", PAYLOAD))
        crashed = executor.run(Step("dispatch", crash="after_downstream_commit"))
        assert crashed.record.exit_code == -9 and not crashed.violations
        assert crashed.snapshot.counts()["tickets"] == 1
        assert crashed.snapshot.counts()["operations_pending"] == 1
        recovered = executor.run(Step("dispatch"))
        assert recovered.record.response is not None
        assert recovered.record.response["replayed"] is True
        assert recovered.snapshot.counts() == {
            "operations_pending": 0, "operations_complete": 1, "outbox_pending": 0,
            "outbox_complete": 1, "tickets": 1, "receipts": 1}


@pytest.mark.parametrize(("change", "message"), [
    (lambda d: d["snapshot"]["operations"].update(
        query="DELETE FROM requests RETURNING request_key, body, status, ''"),
     "read-only transaction"),
    (lambda d: d["commands"]["accept"].append("{dsn:nowhere}"),
     "unknown placeholder {dsn:nowhere}"),
    (lambda d: _downstream(d, "tickets.db"), "not a mix"),
    (lambda d: _downstream(d, {"kind": "mysql"}), '{"kind": "postgres"}'),
])
def test_a_bad_postgres_system_file_is_one_line_and_exit_2(
        tmp_path: Path, change: Any, message: str) -> None:
    path = _variant(tmp_path, change)
    completed = subprocess.run(
        [sys.executable, "-m", "faultlab", "suite", "--system", str(path), "--examples", "0"],
        capture_output=True, text=True, cwd=ROOT, env=child_environment(), timeout=120,
        check=False)
    assert completed.returncode == 2, completed.stderr
    assert len(completed.stderr.strip().splitlines()) == 1, completed.stderr
    assert message in completed.stderr
    assert completed.stdout == ""


def test_a_writing_snapshot_query_is_refused_in_process(tmp_path: Path) -> None:
    path = _variant(tmp_path, lambda d: d["snapshot"]["tickets"].update(
        query="INSERT INTO ticket (request_key, body) VALUES ('x', 'y') "
              "RETURNING ticket_no, request_key, body"))
    with pytest.raises(UsageError, match="read-only transaction"):
        load_command_system(str(path))
