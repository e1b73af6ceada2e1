"""Explore catches the bug zoo at each mutant's known minimal length; `mutants` judges it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.search.explore import explore
from faultlab.system import load_system
from faultlab.system.builtin import registry

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

MUTANTS = registry.names(lanes=1, fault_drawn="", postgres=False)

QUICK = [
    "split-accept", "caller-overwrite", "no-payload-check", "idle-resend", "non-canonical-retry",
]


def check_caught_at_minimum(name: str, spawner: Spawner) -> None:
    system = load_system(name)
    result = explore(system, spawner)  # default budget and seed, as `mutants` runs it
    trace = result.trace
    assert trace is not None and trace.expected is not None, f"{name} was not caught"
    assert set(trace.expected.invariants) & set(getattr(system, "caught_by", ()))
    assert result.shrunk_steps == getattr(system, "minimal_steps", None)
    assert result.replay is not None and result.replay.verdict == trace.expected
    # the same trace is clean on the reference, unless it needs a point only the mutant has
    reference = load_system("reference")
    declared = {p.name for p in reference.crash_points}
    if all(s.crash is None or s.crash in declared or ":" in s.crash for s in trace.steps):
        fixed = execute(reference, trace.steps, spawner, settle=True)
        assert fixed.verdict.clean, fixed.verdict


@pytest.mark.parametrize("name", QUICK)
def test_explore_catches_a_mutant_at_its_minimal_length(name: str, fork_spawner: Spawner) -> None:
    check_caught_at_minimum(name, fork_spawner)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(MUTANTS) - set(QUICK)))
def test_explore_catches_every_mutant_at_its_minimal_length(
    name: str, fork_spawner: Spawner
) -> None:
    check_caught_at_minimum(name, fork_spawner)


@pytest.mark.slow
def test_reference_is_clean_under_ten_thousand_explored_steps(fork_spawner: Spawner) -> None:
    result = explore(load_system("reference"), fork_spawner, examples=1000, steps=10,
                     seed_value=0)
    assert result.trace is None
    assert result.recorder.steps >= 10_000


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_mutants_command_judges_reference_and_a_mutant(tmp_path: Path) -> None:
    output, corpus = tmp_path / "mutants.json", tmp_path / "corpus"
    done = run_cli("mutants", "--only", "reference", "--only", "split-accept", "--examples",
                   "20", "--operations", "1", "--output", str(output), "--corpus", str(corpus))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS: 1 of 1 mutants caught by both explore and enumerate; reference clean" in (
        done.stdout)
    data = json.loads(output.read_text())
    rows = {row["system"]: row for row in data["systems"]}
    assert rows["reference"]["ok"] and not rows["reference"]["explore_found"]
    assert not rows["reference"]["enumerate_found"]
    mutant = rows["split-accept"]
    assert mutant["explore_found"] and mutant["enumerate_found"]
    assert mutant["shrunk_steps"] == mutant["minimal_steps"] == 1
    saved = [Path(p).name for p in corpus.glob("*.json")]
    assert len(saved) == 1 and saved[0].startswith("split-accept-ATOM-")
    # saved once the run ended, and named in the row (the trace itself is not in the JSON)
    assert Path(mutant["corpus_file"]).name == saved[0] and "finding" not in mutant
    assert rows["reference"]["corpus_file"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["--only", "nonesuch"], "unknown system 'nonesuch'"),
        (["--jobs", "0"], "--jobs"),
        (["--crashes", "-1"], "--crashes"),
        (["--format", "nonesuch"], "--format"),
    ],
)
def test_mutants_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    corpus, output = tmp_path / "corpus", tmp_path / "out.json"
    done = run_cli("mutants", "--corpus", str(corpus), "--output", str(output), *args)
    assert done.returncode == 2
    assert message in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not corpus.exists() and not output.exists()


def test_mutants_reports_the_concurrency_mutants_median(tmp_path: Path) -> None:
    """The line the concurrency target is read from: examples until found by the mutants
    judged with two lanes, and their median; in the JSON too."""
    output = tmp_path / "mutants.json"
    done = run_cli("mutants", "--only", "eager-rescue", "--only", "split-accept", "--output",
                   str(output), "--corpus", str(tmp_path / "corpus"))
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(output.read_text())
    found = {row["system"]: row["examples_until_found"] for row in data["systems"]}
    lanes = data["concurrency"]
    assert lanes["examples"] == {"eager-rescue": found["eager-rescue"]}  # not split-accept
    assert lanes["median"] == lanes["sqlite_median"] == found["eager-rescue"] > 0
    assert (f"concurrency mutants: median {found['eager-rescue']} examples until found "
            "over 1\n") in done.stdout


def test_a_judge_whose_run_failed_is_named_and_nothing_is_saved(tmp_path: Path) -> None:
    """A run error in one judge (every worker misses a 1 ms deadline) fails the command
    with exit 3 and one line that names the system judged; the other judges stop quietly
    (no traceback from a pool process stopped while it waited), and nothing is saved."""
    corpus, output = tmp_path / "corpus", tmp_path / "out.json"
    done = run_cli("mutants", "--only", "no-dedup", "--only", "split-accept", "--jobs", "2",
                   "--deadline", "0.001", "--corpus", str(corpus), "--output", str(output))
    assert done.returncode == 3, done.stdout + done.stderr
    lines = [line for line in done.stderr.splitlines() if not line.startswith("mutants: ")]
    assert len(lines) == 1 and lines[0].startswith("faultlab: run failed: judging "), lines
    assert "missed its 0.001s deadline" in lines[0]
    assert not corpus.exists() and not output.exists()
