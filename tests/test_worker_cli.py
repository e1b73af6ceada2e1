"""``python -m faultlab worker``: the seed's contract, and bad input that changes nothing."""

from __future__ import annotations

import json
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from faultlab.process.spawn import child_environment
from faultlab.system import System

PAYLOAD = '{"project":"demo-agent","title":"worker cli","priority":"normal"}'


def faultlab(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        env=child_environment(), timeout=timeout, check=False,
    )


def tree(directory: Path) -> dict[str, bytes]:
    """Every file under directory (and its bytes), for before/after comparisons."""
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else b"<dir>"
        for path in sorted(directory.rglob("*"))
    }


def assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.endswith("\n")
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr


@pytest.fixture
def stores(tmp_path: Path, reference: System) -> Path:
    directory = tmp_path / "stores"
    directory.mkdir()
    reference.initialise(directory)
    return directory


def test_accept_dispatch_and_crash_through_the_cli(stores: Path) -> None:
    accepted = faultlab("worker", "accept", "--directory", str(stores),
                        "--operation-id", "op-1", "--payload", PAYLOAD)
    assert accepted.returncode == 0, accepted.stderr
    assert json.loads(accepted.stdout) == {
        "accepted": True, "operation_id": "op-1", "state": "pending",
    }
    crashed = faultlab("worker", "dispatch", "--directory", str(stores),
                       "--crash", "after_downstream_commit")
    assert crashed.returncode == -9
    assert crashed.stdout == ""
    recovered = faultlab("worker", "dispatch", "--directory", str(stores), "--spawn", "exec")
    assert recovered.returncode == 0, recovered.stderr
    response = json.loads(recovered.stdout)
    assert response["result"] == {"ticket_id": 1} and response["replayed"] is True
    conflict = faultlab("worker", "service", "--directory", str(stores), "--operation-id",
                        "op-1", "--payload", PAYLOAD.replace("normal", "urgent"))
    assert conflict.returncode == 3
    assert json.loads(conflict.stdout) == {"error": "payload_conflict", "operation_id": "op-1"}


_WORKER_IMPORTS_PROBE = """
import json, sys
from faultlab.cli import main
code = main(sys.argv[1:])
heavy = ("hypothesis", "tabulate", "faultlab.search", "faultlab.report", "faultlab.cli.explore")
loaded = sorted(name for name in sys.modules if name.startswith(heavy))
print(json.dumps({"code": code, "loaded": loaded}), file=sys.stderr)
"""


@pytest.mark.parametrize("role", ["accept", "dispatch"])
def test_an_exec_mode_worker_loads_no_search_machinery(stores: Path, role: str) -> None:
    """``python -m faultlab worker`` starts once per step in exec mode: it builds only its
    own command and never imports Hypothesis, tabulate or the search (which once made an
    exec'd worker take 0.33 s instead of 0.15 s)."""
    arguments = ["--operation-id", "op-1", "--payload", PAYLOAD] if role == "accept" else []
    completed = subprocess.run(
        [sys.executable, "-c", _WORKER_IMPORTS_PROBE, "worker", role, "--directory",
         str(stores), *arguments], capture_output=True, text=True, env=child_environment(),
        timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    outcome = json.loads(completed.stderr.splitlines()[-1])
    assert outcome == {"code": 0, "loaded": []}
    assert isinstance(json.loads(completed.stdout), dict)  # the role ran and answered


def test_missing_directory_is_refused_and_not_created(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    result = faultlab("worker", "dispatch", "--directory", str(missing))
    assert_refused(result, str(missing))
    assert not missing.exists()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("role", ["accept", "service"])
def test_payload_is_required(stores: Path, role: str) -> None:
    before = tree(stores)
    result = faultlab("worker", role, "--directory", str(stores), "--operation-id", "op-1")
    assert_refused(result, "--payload")
    assert tree(stores) == before


def test_payload_is_required_even_in_an_empty_directory(tmp_path: Path) -> None:
    result = faultlab("worker", "accept", "--directory", str(tmp_path), "--operation-id", "x")
    assert_refused(result, "--payload")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("payload", ['{"title": ', '{"x": NaN}'])
def test_invalid_json_payload_is_refused(stores: Path, payload: str) -> None:
    before = tree(stores)
    result = faultlab("worker", "accept", "--directory", str(stores), "--operation-id", "op-1",
                      "--payload", payload)
    assert_refused(result, "--payload", "not valid JSON")
    assert tree(stores) == before


@pytest.mark.parametrize(("role", "point"), [
    ("accept", "before_dispatch"), ("dispatch", "sql:0"), ("service", "commit:x"),
])
def test_unknown_crash_point_is_refused(stores: Path, role: str, point: str) -> None:
    before = tree(stores)
    result = faultlab("worker", role, "--directory", str(stores), "--operation-id", "op-1",
                      "--payload", PAYLOAD, "--crash", point)
    assert_refused(result, "unknown crash point", repr(point))
    assert tree(stores) == before


def test_unknown_system_is_refused(stores: Path) -> None:
    before = tree(stores)
    for system in ("no-such-system", "no_such_module:Thing", "faultlab.stores.sqlite:Snapshot"):
        result = faultlab("worker", "dispatch", "--directory", str(stores), "--system", system)
        assert_refused(result, system)
    assert tree(stores) == before


def _foreign_database(path: Path, *, wal: bool = False) -> None:
    connection = sqlite3.connect(path)
    if wal:
        connection.execute("PRAGMA journal_mode=WAL")
    connection.execute("CREATE TABLE operations (id TEXT PRIMARY KEY, note TEXT)")
    connection.execute("INSERT INTO operations VALUES ('mine', 'do not touch')")
    connection.commit()
    connection.close()


@pytest.mark.parametrize("wal", [False, True], ids=["rollback-journal", "wal"])
@pytest.mark.parametrize("role", ["accept", "dispatch"])
def test_a_database_faultlab_did_not_initialise_is_refused_untouched(
    tmp_path: Path, role: str, wal: bool,
) -> None:
    _foreign_database(tmp_path / "caller.sqlite", wal=wal)
    before = tree(tmp_path)
    assert list(before) == ["caller.sqlite"]
    result = faultlab("worker", role, "--directory", str(tmp_path), "--operation-id", "op-1",
                      "--payload", PAYLOAD)
    assert_refused(result, "caller.sqlite", "not initialised by faultlab")
    assert tree(tmp_path) == before


def test_a_foreign_downstream_store_is_refused_untouched(tmp_path: Path) -> None:
    _foreign_database(tmp_path / "downstream.sqlite")
    before = tree(tmp_path)
    result = faultlab("worker", "service", "--directory", str(tmp_path), "--operation-id",
                      "op-1", "--payload", PAYLOAD)
    assert_refused(result, "downstream.sqlite", "not initialised by faultlab")
    assert tree(tmp_path) == before


def test_a_file_that_is_not_sqlite_is_refused_untouched(tmp_path: Path) -> None:
    (tmp_path / "caller.sqlite").write_bytes(b"these are my notes, not a database\n" * 200)
    before = tree(tmp_path)
    result = faultlab("worker", "dispatch", "--directory", str(tmp_path))
    assert_refused(result, "caller.sqlite")
    assert tree(tmp_path) == before


def test_an_empty_directory_has_no_stores(tmp_path: Path) -> None:
    result = faultlab("worker", "dispatch", "--directory", str(tmp_path))
    assert_refused(result, "no such store")
    assert list(tmp_path.iterdir()) == []


def test_a_payload_file_is_read_and_a_bad_one_refused(stores: Path, tmp_path: Path) -> None:
    """--payload-file (how faultlab passes a payload too long for one argument): read and
    stored as --payload would be; a missing or invalid file, or both options, refused with
    one line and nothing changed."""
    given = tmp_path / "payload.json"
    given.write_text(PAYLOAD)
    before = tree(stores)
    for args, words in (
        (["--payload-file", str(tmp_path / "missing.json")], ["missing.json", "cannot read"]),
        (["--payload-file", str(stores)], ["not a regular file"]),
        (["--payload", PAYLOAD, "--payload-file", str(given)], ["not both"]),
    ):
        result = faultlab("worker", "accept", "--directory", str(stores), "--operation-id",
                          "op-1", *args)
        assert_refused(result, *words)
        assert tree(stores) == before
    given.write_text('{"title": ')
    result = faultlab("worker", "accept", "--directory", str(stores), "--operation-id", "op-1",
                      "--payload-file", str(given))
    assert_refused(result, "--payload-file", "not valid JSON")
    assert tree(stores) == before
    given.write_text(PAYLOAD)
    accepted = faultlab("worker", "accept", "--directory", str(stores), "--operation-id", "op-1",
                        "--payload-file", str(given))
    assert accepted.returncode == 0, accepted.stderr
    row = sqlite3.connect(stores / "caller.sqlite").execute(
        "SELECT payload FROM operations WHERE id = 'op-1'").fetchone()
    assert json.loads(row[0]) == json.loads(PAYLOAD)
