"""The Python API refuses what the command line's parser refuses, before anything runs.

A string for ``examples`` was a bare TypeError deep in the search, a negative deadline a
worker that "missed" it, a redis:// corpus a local directory named ``redis:``, a file in
the corpus's place an error after the whole search. Each is now one UsageError naming
the argument, with nothing created.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

import faultlab
from faultlab.base.errors import UsageError

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "corpus" / "no-dedup-RCPT-baa0069205.json"


@pytest.mark.parametrize(("arguments", "words"), [
    ({"examples": "10"}, "examples must be an integer of at least 1, not '10'"),
    ({"examples": None}, "examples must be an integer"),
    ({"examples": 2.5}, "examples must be an integer"),
    ({"examples": True}, "examples must be an integer"),
    ({"steps": 0}, "steps must be an integer of at least 1, not 0"),
    ({"seed": "x"}, "seed must be an integer, not 'x'"),
    ({"seed": 10**200}, "seed must be an integer"),
    ({"deadline": -1}, "deadline must be a positive number of seconds, not -1"),
    ({"deadline": "x"}, "deadline must be a positive number"),
    ({"deadline": float("nan")}, "deadline must be a positive number"),
    ({"spawn": "thread"}, "spawn must be one of fork, exec, not 'thread'"),
    ({"statement_points": "yes"}, "statement_points must be True, False or None"),
    ({"corpus": "redis://127.0.0.1:6379/0"}, "saves findings to a directory"),
    ({"corpus": 5}, "corpus must be a directory path, not 5"),
])
def test_explore_refuses_a_bad_argument_before_anything_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, arguments: dict[str, Any],
        words: str) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as raised:
        faultlab.explore("no-dedup", **arguments)
    assert words in str(raised.value) and "\n" not in str(raised.value)
    assert os.listdir(tmp_path) == []


def test_a_corpus_that_is_a_file_is_refused_before_the_search(tmp_path: Path) -> None:
    occupied = tmp_path / "afile"
    occupied.write_text("mine\n")
    with pytest.raises(UsageError, match="afile"):
        faultlab.explore("no-dedup", corpus=occupied)
    with pytest.raises(UsageError, match="does not exist"):
        faultlab.explore("no-dedup", corpus=tmp_path / "missing" / "corpus")
    assert sorted(os.listdir(tmp_path)) == ["afile"]


def test_statement_points_on_a_command_line_system_are_refused() -> None:
    system = str(ROOT / "examples" / "standalone_outbox" / "system.json")
    with pytest.raises(UsageError,
                       match="statement_points: standalone-outbox: statement scheduling"):
        faultlab.explore(system, statement_points=True)


@pytest.mark.parametrize(("arguments", "words"), [
    ({"deadline": 0}, "deadline must be a positive number"),
    ({"spawn": "x"}, "spawn must be one of"),
])
def test_replay_refuses_a_bad_argument(arguments: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        faultlab.replay(TRACE, **arguments)


def test_replay_refuses_what_is_no_trace() -> None:
    with pytest.raises(UsageError, match="replay takes a Trace or a trace file's path, not 5"):
        faultlab.replay(5)  # type: ignore[arg-type]


@pytest.mark.parametrize(("arguments", "words"), [
    ({"examples": 0}, "examples must be an integer of at least 1, not 0"),
    ({"steps": 0}, "steps must be an integer of at least 1, not 0"),
    ({"deadline": -1}, "deadline must be a positive number"),
    ({"corpus": "redis://127.0.0.1:6379/0"}, "saves findings to a directory"),
])
def test_state_machine_refuses_a_bad_argument(arguments: dict[str, Any], words: str) -> None:
    with pytest.raises(UsageError, match=words):
        faultlab.state_machine("reference", **arguments)


@pytest.mark.e2e
def test_the_api_names_a_finding_as_the_command_line_does(tmp_path: Path) -> None:
    """One finding, one name: a shared corpus got the same trace twice, once named after
    the system's reference (system_json-...) and once after its name."""
    system = str(ROOT / "examples" / "standalone_outbox" / "system.json")
    outcome = faultlab.explore(system, deduplication=False, examples=20, seed=0,
                               corpus=tmp_path)
    assert outcome.path is not None
    assert outcome.path.name.startswith("standalone-outbox-nodedup-"), outcome.path.name
