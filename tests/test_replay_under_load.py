"""Concurrent replays do not depend on timing: every committed concurrent trace replays to
the same table again and again while other processes keep both cores busy (slow)."""

from __future__ import annotations

import difflib
import json
import multiprocessing
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import require_private_postgres, trace_on_postgres

ROOT = Path(__file__).resolve().parent.parent
CONCURRENT = sorted(path for path in (ROOT / "corpus").glob("*.json")
                    if json.loads(path.read_text()).get("version") == 2)
REPLAYS = 10


def same_but_for_pids(table: str) -> str:
    """The table with every PID (300 and up) and the padding around it made the same: a
    PID of another width pads its column differently, and nothing else may differ."""
    return "\n".join(re.sub(r" +", " ", re.sub(r"\b\d{3,}\b", "PID", line))
                     for line in table.splitlines())


def _burn() -> None:  # pragma: no cover - runs in the burner processes
    while True:
        pass


@pytest.fixture
def busy_cores() -> Iterator[None]:
    """One CPU burner per core (and one more), started and ended here."""
    context = multiprocessing.get_context("spawn")
    burners = [context.Process(target=_burn, daemon=True) for _ in range((os.cpu_count() or 1) + 1)]
    for burner in burners:
        burner.start()
    try:
        yield
    finally:
        for burner in burners:
            burner.kill()
            burner.join(timeout=10)
        assert not any(burner.is_alive() for burner in burners)


def test_there_are_concurrent_traces_to_replay() -> None:
    assert len(CONCURRENT) >= 8


@pytest.mark.slow
@pytest.mark.parametrize("path", CONCURRENT, ids=lambda p: p.name)
def test_a_concurrent_trace_replays_identically_under_cpu_load(path: Path,
                                                               busy_cores: None) -> None:
    options = []
    if trace_on_postgres(path):
        require_private_postgres()
        options = ["--postgres", "private"]
    tables = set()
    for _ in range(REPLAYS):
        done = subprocess.run([sys.executable, "-m", "faultlab", "replay", str(path), *options],
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "every outcome matches" in done.stdout, done.stdout
        tables.add(same_but_for_pids(done.stdout))
    first, *others = sorted(tables)
    assert not others, "".join(difflib.unified_diff(
        first.splitlines(True), others[0].splitlines(True), "one replay", "another"))
