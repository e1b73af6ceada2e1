"""``python -m faultlab suite``: console, evidence JSON, --directory, and refused input."""

from __future__ import annotations

import json
import platform
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from faultlab.cli import main
from faultlab.process.spawn import child_environment

PASS_LINE = "PASS: 5 scenarios; real SIGKILL, separate caller and downstream stores"
SUMMARY_LINES = [
    'crash_before_dispatch {"crash_exit": -9, "tickets_before": 0, "tickets_after": 1, '
    '"caller_state": "complete", "ticket_id": 1}',
    'crash_after_downstream_commit {"crash_exit": -9, "tickets_before": 1, "tickets_after": 1, '
    '"caller_state": "complete", "ticket_id": 1}',
    'deduplication_disabled {"crash_exit": -9, "tickets_before": 1, "tickets_after": 2, '
    '"caller_state": "complete", "ticket_id": 2}',
    'crash_during_acceptance {"crash_exit": -9, "partial_operations": 0, "partial_outbox": 0, '
    '"tickets_after": 1}',
    'changed_payload_rejected {"exit_code": 3, "tickets_after": 1}',
]
SCENARIOS = [line.split()[0] for line in SUMMARY_LINES]
TABLES = {"operations", "outbox", "tickets", "receipts"}
RECORD_KEYS = {"pid", "exit_code", "response", "stderr"}


def faultlab(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        env=child_environment(), timeout=120, check=False, cwd=cwd,
    )


def tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else b"<dir>"
        for path in sorted(directory.rglob("*"))
    }


def assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr


class SuiteRun:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.output = root / "results.json"
        self.directory = root / "kept"
        # --output replaces its own earlier output: a longer one is there first
        self.output.write_text('{"experiment": "two-store outbox crash recovery (faultlab '
                               'suite)", "stale": true, "padding": "' + "x" * 100_000 + '"}\n')
        self.result = faultlab(
            "suite", "--examples", "0", "--output", str(self.output),
            "--directory", str(self.directory), "--format", "github",
        )
        self.evidence: dict[str, Any] = json.loads(self.output.read_text())


@pytest.fixture(scope="module")
def suite_run(tmp_path_factory: pytest.TempPathFactory) -> SuiteRun:
    return SuiteRun(tmp_path_factory.mktemp("suite"))


def test_console(suite_run: SuiteRun) -> None:
    result = suite_run.result
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[-1] == PASS_LINE
    assert lines[-6:-1] == SUMMARY_LINES
    header = lines[0]
    for column in ("scenario", "crash point", "exit", "tickets before", "tickets after",
                   "result", "verdict"):
        assert column in header
    assert header.startswith("|")  # --format github reached tabulate
    rows = [line for line in lines if line.startswith("| ") and "PASS" in line]
    assert [row.split("|")[1].strip() for row in rows] == SCENARIOS
    conflict = next(row for row in rows if "changed_payload_rejected" in row)
    assert "payload_conflict" in conflict


def test_evidence_json(suite_run: SuiteRun) -> None:
    data = suite_run.evidence
    for key in ("experiment", "python", "sqlite", "platform", "signal", "passed", "scenarios",
                "faultlab", "spawn", "timings"):
        assert key in data
    assert "stale" not in data
    assert data["passed"] is True
    assert data["spawn"] == "fork"
    assert data["python"] == sys.version.split()[0]
    # what the seed lab wrote, so its readers read ours; faultlab's detail beside them
    assert data["signal"] == "SIGKILL"
    assert data["platform"] == platform.system()
    assert data["signal_number"] == 9
    assert data["platform_detail"] == platform.platform()
    assert list(data["scenarios"]) == SCENARIOS
    for line in SUMMARY_LINES:
        name, summary = line.split(" ", 1)
        scenario = data["scenarios"][name]
        assert scenario["passed"] is True
        assert scenario["summary"] == json.loads(summary)
        for record in ("crash", "acceptance", "recovery"):
            assert RECORD_KEYS <= set(scenario[record]), (name, record)
            assert isinstance(scenario[record]["pid"], int)
        assert scenario["crash"]["exit_code"] == -9
        for snapshot in ("before_recovery", "after_recovery"):
            assert set(scenario[snapshot]) == TABLES
    timings = data["timings"]
    assert timings["total_seconds"] > 0
    assert set(SCENARIOS) <= set(timings)
    after = data["scenarios"]["crash_after_downstream_commit"]["after_recovery"]
    assert after["operations"][0]["state"] == "complete"
    assert after["operations"][0]["result"] == '{"ticket_id":1}'


def test_evidence_is_written_atomically(suite_run: SuiteRun) -> None:
    leftovers = [p.name for p in suite_run.root.iterdir() if p.name.startswith(".results")]
    assert leftovers == []


def test_directory_keeps_each_scenarios_stores(suite_run: SuiteRun) -> None:
    kept = suite_run.directory
    assert sorted(p.name for p in kept.iterdir()) == sorted(SCENARIOS)
    for name in SCENARIOS:
        assert {"caller.sqlite", "downstream.sqlite"} <= {p.name for p in (kept / name).iterdir()}
        with sqlite3.connect(kept / name / "downstream.sqlite") as connection:
            tickets = connection.execute("SELECT COUNT(*) FROM tickets").fetchone()[0]
        connection.close()
        assert tickets == suite_run.evidence["scenarios"][name]["summary"]["tickets_after"]


def test_existing_directory_is_refused_and_unchanged(tmp_path: Path) -> None:
    existing = tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine\n")
    output = tmp_path / "out.json"
    before = tree(tmp_path)
    result = faultlab("suite", "--examples", "0", "--directory", str(existing),
                      "--output", str(output))
    assert_refused(result, "--directory", "already exists")
    assert tree(tmp_path) == before
    assert not output.exists()


def test_output_in_a_missing_directory_is_refused(tmp_path: Path) -> None:
    output = tmp_path / "no" / "such" / "results.json"
    result = faultlab("suite", "--examples", "0", "--output", str(output),
                      "--directory", str(tmp_path / "kept"))
    assert_refused(result, "--output")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("args", "words"), [
    (["--format", "no-such-format"], ["--format", "no-such-format"]),
    (["--system", "no-such-system"], ["unknown system", "no-such-system"]),
    (["--spawn", "thread"], ["--spawn"]),
    (["--deadline", "-1"], ["--deadline"]),
])
def test_bad_options_are_refused_before_anything_runs(
    tmp_path: Path, args: list[str], words: list[str],
) -> None:
    result = faultlab("suite", "--examples", "0", "--output", "results.json",
                      "--directory", "kept", *args, cwd=tmp_path)
    assert_refused(result, *words)
    assert list(tmp_path.iterdir()) == []


def test_a_failing_scenario_exits_1_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    output = tmp_path / "results.json"
    code = main(["suite", "--examples", "0", "--system", "systems_for_tests:ForgetfulOutbox",
                 "--output", str(output)])
    out = capsys.readouterr().out
    assert code == 1
    assert PASS_LINE not in out
    assert "FAIL: crash_after_downstream_commit: 2 tickets after recovery, expected 1" in out
    data = json.loads(output.read_text())
    assert data["passed"] is False
    assert data["scenarios"]["crash_after_downstream_commit"]["passed"] is False
    assert data["scenarios"]["deduplication_disabled"]["passed"] is True


def test_in_process_suite_prints_the_same_lines(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["suite", "--examples", "0", "--format", "plain"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-6:] == [*SUMMARY_LINES, PASS_LINE]
