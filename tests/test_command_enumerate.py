"""A command-line system (its own program, no faultlab import) under enumerate and replay."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

SYSTEM = "examples/standalone_outbox/system.json"


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_enumerate_finds_the_negative_control_and_the_finding_replays(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    done = run_cli("enumerate", "--system", SYSTEM, "--operations", "1", "--max-steps", "2",
                   "--no-deduplication", "--corpus", str(corpus), "--quiet")
    assert done.returncode == 1, done.stdout + done.stderr
    files = sorted(corpus.glob("*.json"))
    assert files and all(f.name.startswith("standalone-outbox-nodedup-") for f in files)
    shortest = json.loads(files[0].read_text())
    assert shortest["system"] == SYSTEM and shortest["deduplication"] is False
    assert "ONE" in shortest["expected"]["invariants"]
    replayed = run_cli("replay", *map(str, files), "--system", SYSTEM)  # named: not built in
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "every outcome matches" in replayed.stdout
