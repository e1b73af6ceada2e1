"""Replay: every corpus file matches its recorded verdict; bad input is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, require_private_postgres

from faultlab.corpus.replay import plan, replay
from faultlab.process.spawn import Spawner
from faultlab.system import load_system
from faultlab.trace import Step, Trace, Verdict

CORPUS = sorted((ROOT / "corpus").glob("*.json"))


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300)


def test_the_corpus_is_not_empty() -> None:
    assert CORPUS, "corpus/ holds no findings"


@pytest.fixture(scope="module")
def private_postgres() -> Iterator[None]:
    """faultlab's own PostgreSQL server for the corpus traces of PostgreSQL systems (their
    server_crash steps and server clock run nowhere else), removed after the module."""
    from faultlab.stores import postgres as pgstores
    from faultlab.stores.pgserver import PrivateServer

    require_private_postgres()
    server = PrivateServer()
    try:
        server.start()
        pgstores.configure(server.conninfo, server=server)
        yield
    finally:
        pgstores.close_run()
        pgstores.configure(None)
        server.stop()


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.name)
def test_corpus_trace_matches_its_recorded_verdict(path: Path, fork_spawner: Spawner,
                                                   request: pytest.FixtureRequest) -> None:
    trace = Trace.load(path)  # version 1 or 2 (a concurrency mutant's finding)
    assert trace.expected is not None and not trace.expected.clean
    system = load_system(trace.system)
    if getattr(system, "store_kind", None) == "postgres":
        request.getfixturevalue("private_postgres")
    outcome = replay(plan(path, trace, system), fork_spawner, deadline=15)
    assert outcome.verdict == trace.expected, "\n".join(outcome.lines())


def negative_control_trace() -> Trace:
    """The negative control's finding: there on purpose, so it says so (expect)."""
    payload = {"title": "backlog"}
    return Trace(
        system="reference", deduplication=False,
        steps=[Step("accept", "op-1", payload), Step("dispatch", crash="after_downstream_commit"),
               Step("dispatch")],
        expected=Verdict(3, ("ONE", "DONE")), expect="finding",
    )


def test_replay_prints_a_table_and_matches(tmp_path: Path) -> None:
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(negative_control_trace().to_json()))
    done = run_cli("replay", str(path), "--format", "github")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "| after_downstream_commit |" in done.stdout
    assert "verdict: ONE+DONE at step 3; expected ONE+DONE at step 3: matches" in done.stdout


def test_replay_exits_1_and_says_how_when_the_outcome_differs(tmp_path: Path) -> None:
    trace = negative_control_trace()
    trace.expected = Verdict()
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace.to_json()))
    done = run_cli("replay", str(path))
    assert done.returncode == 1
    assert "verdict: ONE+DONE at step 3; expected clean: DIFFERS" in done.stdout


def test_replay_against_a_fixed_system_passes(tmp_path: Path) -> None:
    trace = negative_control_trace()
    trace.deduplication = True
    trace.system = "reference"
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace.to_json()))
    done = run_cli("replay", str(path), "--against", "reference")
    assert done.returncode == 0, done.stdout
    assert "verdict: clean" in done.stdout


@pytest.mark.parametrize(
    "content, message",
    [
        ("{not json", "invalid JSON"),
        ('{"format": "faultlab-trace", "version": 99, "steps": []}', "unsupported trace version"),
        ('{"hello": "world"}', "not a faultlab trace"),
        ('[1, 2, 3]', "not a faultlab trace"),
        ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
         '"deduplication": true, "steps": [{"action": "explode"}]}', "not a trace step"),
        ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
         '"deduplication": true, "steps": [{"action": "dispatch", "crash": "nowhere"}]}',
         "unknown crash point"),
        ('{"format": "faultlab-trace", "version": 1, "system": "nonesuch", '
         '"deduplication": true, "steps": [{"action": "dispatch"}]}',
         "which is not built in; name it"),
        ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
         '"deduplication": true}', 'trace has no "steps"'),
        ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
         '"deduplication": true, "steps": []}', "trace has no steps"),
    ],
)
def test_replay_bad_input(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    before = sorted(os.listdir(tmp_path))
    done = run_cli("replay", str(path))
    assert done.returncode == 2, done.stdout
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert done.stdout == ""
    assert sorted(os.listdir(tmp_path)) == before


def test_replay_refuses_a_missing_file_before_running_anything(tmp_path: Path) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(negative_control_trace().to_json()))
    done = run_cli("replay", str(good), str(tmp_path / "missing.json"))
    assert done.returncode == 2
    assert "missing.json" in done.stderr and done.stdout == ""


def test_the_printed_replay_command_survives_a_shell(tmp_path: Path) -> None:
    """The line explore prints is pasted into a shell: a corpus "my corp" and a system file
    whose path has a space must come back as one argument each."""
    import shlex

    from faultlab.corpus.files import replay_command
    from faultlab.stores import postgres as pgstores

    # a private server a fixture of this process started adds its option at the end
    private = ["--postgres", "private"] if pgstores.private_server() is not None else []
    line = replay_command(tmp_path / "my corp" / "x-ONE-1.json", str(tmp_path / "a b.json"))
    assert shlex.split(line) == ["python", "-m", "faultlab", "replay",
                                 str(tmp_path / "my corp" / "x-ONE-1.json"),
                                 "--system", str(tmp_path / "a b.json"), *private]
    assert shlex.split(replay_command("corpus/x-ONE-1.json", "reference")) == [
        "python", "-m", "faultlab", "replay", "corpus/x-ONE-1.json", *private]


def _laned(tmp_path: Path, name: str, steps: list[dict[str, object]],
           **fields: object) -> Path:
    path = tmp_path / name
    path.write_text(json.dumps({"format": "faultlab-trace", "version": 2, "system": "reference",
                                "deduplication": True, "concurrency": 2, "steps": steps,
                                **fields}))
    return path


def test_a_lane_no_step_started_is_refused_before_any_trace_runs(tmp_path: Path) -> None:
    """The trace format's promise: checked completely before anything runs. A step on a lane
    that no step started is refused, naming its file, before the valid trace beside it
    prints a table (it once ran first, and the refusal named no file)."""
    valid = ROOT / "corpus" / "no-dedup-RCPT-baa0069205.json"
    accept = {"action": "run", "lane": 1, "role": "accept", "operation_id": "op-1",
              "payload": {}}
    for action in ("kill", "pause", "release", "finish", "resume"):
        bad = _laned(tmp_path, f"{action}.json", [accept, {"action": action, "lane": 2}])
        done = run_cli("replay", str(valid), str(bad))
        assert done.returncode == 2, done
        assert done.stdout == "", done.stdout  # nothing ran
        assert done.stderr == (f"faultlab: error: {bad}: L2 {action}: lane 2 never started "
                               "a worker\n"), done.stderr


def test_a_busy_lane_shows_only_as_the_trace_runs_and_names_its_file(tmp_path: Path) -> None:
    """Whether a lane is busy depends on whether its worker ended by itself: judged as the
    trace runs, and the refusal still names the file."""
    held = {"action": "start", "lane": 1, "role": "accept", "operation_id": "op-1",
            "payload": {}}
    bad = _laned(tmp_path, "busy.json", [held, held])
    done = run_cli("replay", str(bad))
    assert done.returncode == 2, done
    assert done.stderr.startswith(f"faultlab: error: {bad}: ") and \
        done.stderr.endswith("lane 1 is busy\n"), done.stderr


def test_statement_points_on_a_command_line_system_are_refused_before_anything_runs(
        tmp_path: Path) -> None:
    accept = {"action": "run", "lane": 1, "role": "accept", "operation_id": "op-1",
              "payload": {}}
    bad = _laned(tmp_path, "statements.json", [accept], statement_points=True,
                 system="standalone-outbox")
    done = run_cli("replay", str(bad), "--system",
                   str(ROOT / "examples" / "standalone_outbox" / "system.json"))
    assert done.returncode == 2, done
    assert done.stdout == ""
    assert done.stderr == (f"faultlab: error: {bad}: standalone-outbox: statement scheduling "
                           "points (sql:K, commit:K) need faultlab's own worker processes (a "
                           "Python system)\n"), done.stderr
