"""``explore --concurrency N`` and ``replay`` of version 2 traces, end to end in-process."""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from conftest import explore_lanes

from faultlab.cli import main
from faultlab.system import load_system
from faultlab.system.builtin import registry
from faultlab.system.builtin.race_mutants import ConcurrencyMutant
from faultlab.trace import Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def test_explore_concurrency_finds_shrinks_saves_and_replays_20_times(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    code, out, _ = cli("explore", "--system", "racy-dedup", "--concurrency", "2",
                       "--seed", "0", "--corpus", str(corpus), "--quiet")
    assert code == 1, out
    (path,) = corpus.glob("*.json")
    trace = Trace.load(path)
    assert isinstance(trace, Trace) and trace.concurrency == 2
    system = load_system("racy-dedup")
    assert isinstance(system, ConcurrencyMutant)
    assert len(trace.steps) == system.minimal_steps  # shrunk to the known minimum
    assert trace.expected is not None and "ONE" in trace.expected.invariants
    assert json.loads(path.read_text())["version"] == 2
    assert "shrunk to 3 scheduling steps" in out and "L1" in out and "L2" in out
    tables = set()
    for _ in range(20):
        code, out, _ = cli("replay", str(path))
        assert code == 0 and "every outcome matches" in out
        # the same table but for PIDs (300 and up) and the padding a PID's width changes
        tables.add("\n".join(re.sub(r" +", " ", re.sub(r"\b\d{3,}\b", "PID", line))
                             for line in out.splitlines()))
    assert len(tables) == 1
    code, out, _ = cli("replay", str(path), "--against", "reference")
    assert code == 0 and "verdict: clean" in out


def test_explore_concurrency_reference_negative_control(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    code, out, _ = cli("explore", "--concurrency", "2", "--no-deduplication", "--seed", "0",
                       "--examples", "30", "--corpus", str(corpus), "--quiet")
    assert code == 1
    (path,) = corpus.glob("reference-nodedup-*.json")
    trace = Trace.load(path)
    assert isinstance(trace, Trace) and len(trace.steps) == 2
    assert trace.expected is not None and "ONE" in trace.expected.invariants


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "0"], "at least 1"),
    (["--concurrency", "9"], "at most 8"),
    (["--concurrency", "2", "--hypothesis-shrink"], "--hypothesis-shrink"),
    (["--concurrency", "2", "--jobs", "0"], "--jobs"),
    (["--concurrency", "2", "--shard", "2/2"], "--shard"),
    (["--concurrency", "2", "--duration", "-1"], "--duration"),
])
def test_bad_concurrency_is_refused_and_creates_nothing(tmp_path: Path, args: list[str],
                                                         message: str) -> None:
    corpus = tmp_path / "corpus"
    code, _, err = cli("explore", *args, "--corpus", str(corpus), "--quiet")
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1
    assert not corpus.exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names(lanes=2, postgres=False, only_judged=True))
def test_explore_concurrency_catches_each_mutant_at_its_minimum(tmp_path: Path, name: str) -> None:
    system = load_system(name)
    assert isinstance(system, ConcurrencyMutant)
    result = explore_lanes(system, examples=100, seed_value=0)
    assert result.trace is not None and result.trace.expected is not None
    assert set(result.trace.expected.invariants) & set(system.caught_by)
    assert result.shrunk_steps == system.minimal_steps


@pytest.mark.slow
def test_explore_concurrency_reference_clean_100_examples() -> None:
    result = explore_lanes(load_system("reference"), examples=100,
                                seed_value=0)
    assert result.trace is None and not result.notes
    assert result.recorder.examples >= 100 and result.recorder.steps > 500


@pytest.mark.slow
def test_ten_thousand_concurrent_steps_on_the_reference_stay_clean() -> None:
    result = explore_lanes(load_system("reference"), examples=1000,
                                seed_value=0)
    assert result.trace is None and not result.notes
    assert result.recorder.steps >= 10_000
    assert result.recorder.sigkills > 0 and result.recorder.actions.get("pause", 0) > 0


def test_enumerate_concurrency_finds_the_shortest_interleaving(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    code, out, _ = cli("enumerate", "--concurrency", "2", "--system", "skip-locked",
                       "--corpus", str(corpus), "--quiet")
    assert code == 1, out
    # the coverage tables every search prints, in steps, history invariants included
    rows = dict(line.split()[:2] for line in out.splitlines()
                if line.split()[:1] in (["ORDER"], ["TERM"], ["ATOM"]))
    assert "steps that checked it non-vacuously" in out
    assert int(rows["ORDER"]) >= 1 and int(rows["ATOM"]) >= 2, out
    (path,) = corpus.glob("skip-locked-ORDER-*.json")
    trace = Trace.load(path)
    assert isinstance(trace, Trace)
    assert [s.hold for s in trace.steps] == [False, False, True, True]  # run, run, start, start
    assert [s.lane for s in trace.steps[2:]] == [2, 1]  # lane 2 claims first: order broken
    code, out, _ = cli("replay", str(path))
    assert code == 0


@pytest.mark.slow
def test_enumerate_concurrency_holds_acceptors_for_relay_cursor() -> None:
    """relay-cursor needs two acceptances committing out of position order: enumerate
    finds it with two held acceptors, and without them (acceptors=0) not within the bound."""
    from faultlab.search.schedule_enumeration import enumerate_concurrent

    system = load_system("relay-cursor")
    found = enumerate_concurrent(system, concurrency=2, max_steps=2)
    assert found.execution is not None and "SKIP" in found.execution.verdict.invariants
    assert found.finding is not None
    assert [s.role for s in found.finding if s.hold] == ["accept", "accept"]
    assert enumerate_concurrent(system, concurrency=2, max_steps=2, acceptors=0).finding is None


@pytest.mark.slow
def test_enumerate_concurrency_reference_clean_within_two_choices(tmp_path: Path) -> None:
    code, out, _ = cli("enumerate", "--concurrency", "2", "--max-steps", "2",
                       "--corpus", str(tmp_path / "corpus"), "--quiet")
    assert code == 0 and "clean: no invariant failed" in out
    assert not (tmp_path / "corpus").exists()


@pytest.mark.slow
@pytest.mark.parametrize("name", registry.names(lanes=2, postgres=False, only_judged=True))
def test_enumerate_concurrency_catches_each_mutant(name: str) -> None:
    from faultlab.search.schedule_enumeration import enumerate_concurrent

    system = load_system(name)
    assert isinstance(system, ConcurrencyMutant)
    result = enumerate_concurrent(system, concurrency=2)
    assert result.execution is not None
    assert set(result.execution.verdict.invariants) & set(system.caught_by)


@pytest.mark.slow
def test_enumerate_concurrency_reference_clean_within_three_choices() -> None:
    from faultlab.search.schedule_enumeration import enumerate_concurrent

    result = enumerate_concurrent(load_system("reference"), concurrency=2, max_steps=3)
    assert result.finding is None and result.sequences > 50 and result.pruned > 0


@pytest.mark.slow
def test_mutants_command_judges_concurrency_mutants(tmp_path: Path) -> None:
    output, corpus = tmp_path / "mutants.json", tmp_path / "corpus"
    code, out, _ = cli("mutants", "--only", "reference-concurrent", "--only", "eager-rescue",
                       "--output", str(output), "--corpus", str(corpus), "--jobs", "2")
    assert code == 0, out
    assert "PASS: 1 of 1 mutants caught by both explore and enumerate; reference clean" in out
    rows = {row["system"]: row for row in json.loads(output.read_text())["systems"]}
    assert not rows["reference-concurrent"]["explore_found"]
    assert not rows["reference-concurrent"]["enumerate_found"]
    mutant = rows["eager-rescue"]
    assert mutant["explore_found"] and mutant["enumerate_found"]
    assert mutant["shrunk_steps"] == mutant["minimal_steps"] == 3
    (saved,) = corpus.glob("*.json")
    assert isinstance(Trace.load(saved), Trace)
