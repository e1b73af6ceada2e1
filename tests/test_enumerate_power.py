"""enumerate --power-loss: power cuts as branches of the exhaustive walk.

A branch copies a run directory with its recording, so the copy's log must name the copy
(``vfs.relocate``); the walk must find each power mutant at its minimal trace, keep the
reference clean with cuts really made, and refuse what it cannot do (exit 2, nothing made).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from test_power_vfs import lost, rows_present, run_child

from faultlab.stores import vfs

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)


def faultlab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600, check=False)


def test_a_relocated_log_rebuilds_the_copy_and_leaves_the_original(tmp_path: Path) -> None:
    run = run_child(tmp_path / "a", journal_mode="wal", synchronous="normal", rows=20)
    assert len(run.acked) == 20
    copy = tmp_path / "b"
    shutil.copytree(run.directory, copy)
    before = vfs.unsynced_digest(run.log, run.directory)
    vfs.relocate(copy / "log", run.directory, copy)
    assert vfs.unsynced_digest(copy / "log", copy) == before  # named relative to the root
    assert vfs.summary(copy / "log")["files"]  # something unsynced to lose
    assert all(name.startswith(str(copy) + "/") for name in vfs.summary(copy / "log")["files"])
    original = {p.name: p.read_bytes() for p in run.directory.iterdir() if p.is_file()}
    vfs.power_image(copy / "log", {"kind": "drop_all"})
    assert {p.name: p.read_bytes() for p in run.directory.iterdir() if p.is_file()} == original
    assert rows_present(copy / "db.sqlite") == set()  # WAL + NORMAL: every commit lost
    assert len(lost(run)) == 0  # the original still holds all 20


def test_relocate_refuses_a_log_that_names_files_elsewhere(tmp_path: Path) -> None:
    run = run_child(tmp_path / "a", journal_mode="wal", synchronous="normal", rows=3)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    log = (run.log / vfs.LOG_NAME).read_bytes()
    with pytest.raises(vfs.PowerImageError, match="outside"):
        vfs.relocate(run.log, elsewhere, tmp_path / "c")
    assert (run.log / vfs.LOG_NAME).read_bytes() == log  # nothing rewritten


def _corpus_steps(corpus: Path) -> list[list[tuple[str, dict[str, object] | None]]]:
    found = []
    for path in sorted(corpus.glob("*.json")):
        trace = json.loads(path.read_text())
        found.append([(step["action"], step.get("choice")) for step in trace["steps"]])
    return found


@pytest.mark.parametrize(("mutant", "invariants", "minimal"), [
    ("wal-normal-receiver", "DONE+DURABLE", ["accept", "dispatch", "power"]),
    ("full-sync-caller", "ACK+DURABLE", ["accept", "power"]),
    ("sync-off-caller", "ACK+DURABLE", ["accept", "power"]),
])
def test_each_power_mutant_is_found_at_its_minimal_trace_and_replays(
        tmp_path: Path, mutant: str, invariants: str, minimal: list[str]) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab("enumerate", "--system", mutant, "--power-loss", "--operations", "1",
                      "--crashes", "1", "--first", "--quiet", "--corpus", str(corpus),
                      cwd=tmp_path)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"FOUND: {invariants} at executed step {len(minimal)} of a {len(minimal)}-step" \
        in result.stdout
    shortest = min(_corpus_steps(corpus), key=len)
    assert [action for action, _ in shortest] == minimal
    assert shortest[-1][1] == {"kind": "drop_all"}
    saved = next(p for p in sorted(corpus.glob("*.json"))
                 if len(json.loads(p.read_text())["steps"]) == len(minimal))
    replay = faultlab("replay", str(saved), cwd=tmp_path)  # fresh stores: the same verdict
    assert replay.returncode == 0, replay.stdout + replay.stderr
    assert f"verdict: {invariants} at step {len(minimal)}; expected {invariants} at step " \
        f"{len(minimal)}: matches" in replay.stdout



def test_the_reference_is_clean_with_power_cuts_really_made(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab("enumerate", "--system", "reference", "--power-loss", "--operations",
                      "1", "--crashes", "1", "--quiet", "--corpus", str(corpus), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean: no invariant failed" in result.stdout
    assert "1 crashes or power cuts" in result.stdout
    checked = {line.split()[0]: int(line.split()[1]) for line in result.stdout.splitlines()
               if line.split()[:1] in (["OPEN"], ["DURABLE"])}
    assert checked["OPEN"] >= 4 and checked["DURABLE"] >= 4, result.stdout
    assert not corpus.exists()


@pytest.mark.parametrize("extra", [["--jobs", "2"], ["--concurrency", "2"]])
def test_what_enumerate_power_loss_cannot_do_is_refused(tmp_path: Path,
                                                        extra: list[str]) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab("enumerate", "--system", "reference", "--power-loss", *extra,
                      "--corpus", str(corpus), cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "--power-loss" in result.stderr
    assert not corpus.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == []
