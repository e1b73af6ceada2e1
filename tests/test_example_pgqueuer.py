"""The pgqueuer example (examples/pgqueuer/): its saved findings replay as findings.

Each corpus trace is replayed on faultlab's own private PostgreSQL server
(``--postgres private``) and must fail exactly as recorded ("expect": "finding").
End-to-end (tox's e2e environment installs pgqueuer and asyncpg for them; neither is a
dependency of faultlab or of its test extra). Skipped with the reason when pgqueuer or
asyncpg is not installed, and when this machine cannot start a private server (failed
instead when FAULTLAB_REQUIRE_SERVICES names ``postgres``).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, require_service

from faultlab.stores import pgserver

pytestmark = pytest.mark.e2e

CORPUS = sorted((ROOT / "examples" / "pgqueuer" / "corpus").glob("*.json"))


def _require() -> None:
    for module in ("pgqueuer", "asyncpg"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install pgqueuer asyncpg)")
    reason = pgserver.unavailable()
    if reason is not None:
        require_service("postgres", reason)
    if importlib.util.find_spec("psycopg") is None:
        require_service("postgres", "psycopg (the postgres extra) is not installed")


def test_corpus_is_there() -> None:
    assert len(CORPUS) == 3
    for path in CORPUS:
        assert json.loads(path.read_text(encoding="utf-8"))["expect"] == "finding"


@pytest.mark.parametrize("trace", CORPUS, ids=lambda path: path.stem)
def test_finding_replays(trace: Path) -> None:
    _require()
    system = json.loads(trace.read_text(encoding="utf-8"))["system"]
    done = subprocess.run(
        [sys.executable, "-m", "faultlab", "replay", "--system", system, str(trace),
         "--postgres", "private"],
        cwd=ROOT, capture_output=True, text=True, timeout=120, check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every outcome matches" in done.stdout
