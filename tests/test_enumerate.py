"""``enumerate``: bounded exhaustive exploration finds the zoo and nothing in the reference."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from faultlab.cli import main
from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.search.enumeration import enumerate_system
from faultlab.stores.sqlite import scratch_directory
from faultlab.system import System, load_system
from faultlab.system.builtin import registry
from faultlab.system.builtin.mutants import Mutant
from faultlab.trace import Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)


@pytest.fixture(scope="module")
def spawners() -> Iterator[list[Spawner]]:
    runners = [Spawner("fork") for _ in range(3)]
    try:
        yield runners
    finally:
        for runner in runners:
            runner.close()


def _scratch_entries() -> set[str]:
    directory = Path(scratch_directory() or "/tmp")
    # this process's own (other runs on the machine may be enumerating too)
    return {p.name for p in directory.glob(f"faultlab-enumerate-{os.getpid()}-*")}


def test_reference_is_clean_with_one_operation_and_one_crash(
    reference: System, spawners: list[Spawner],
) -> None:
    before = _scratch_entries()
    started = time.monotonic()
    result = enumerate_system(reference, spawners, operations=1, crashes=1)
    assert time.monotonic() - started < 20
    assert not result.found and result.violations == 0
    assert result.traces > 50 and result.skipped > 0 and result.crash_states > 0
    assert result.probes > 0  # statement points were probed until they stopped firing
    assert _scratch_entries() <= before  # every branch directory was removed


def test_states_that_differ_only_in_when_a_dispatch_ran_are_one_state(
    reference: System, spawners: list[Spawner],
) -> None:
    result = enumerate_system(reference, spawners, operations=2, crashes=0)
    assert not result.found and result.violations == 0
    # the reference's 14 states (two operations, each accepted and dispatched or not,
    # delivered directly or not): a lease time per dispatch made 28 of them
    assert result.states == 14
    assert result.traces == 89 and result.skipped == 76
    assert result.symmetric == 1  # the first accept could have taken op-2: one trace


@pytest.mark.parametrize("name", ["no-dedup", "split-accept", "split-receipt", "idle-resend",
                                  "fresh-key-on-recovery"])
def test_mutant_is_found_at_its_known_minimal_length(
    name: str, spawners: list[Spawner],
) -> None:
    system = load_system(name)
    assert isinstance(system, Mutant)
    result = enumerate_system(system, spawners, operations=1, crashes=1, first=True)
    assert result.found
    shortest = min(f.executed for f in result.best.values())
    assert shortest == system.minimal_steps
    assert any(set(f.invariants) <= set(system.caught_by)
               for f in result.best.values() if f.executed == shortest)


def test_negative_control_deduplication_off_is_found(
    reference: System, spawners: list[Spawner],
) -> None:
    result = enumerate_system(reference, spawners, deduplication=False, operations=1, crashes=1,
                              first=True)
    one = result.best["ONE"]
    # accept, a delivery the caller did not record (a second deliverer, or a dispatcher
    # killed after the downstream commit: the same state), then the recovery's duplicate
    assert one.executed == 3
    assert [s.action for s in one.steps][0] == "accept" and len(one.steps) == 2


def test_the_walk_is_the_same_whatever_the_number_of_threads(spawners: list[Spawner]) -> None:
    system = load_system("error-completes")
    one = enumerate_system(system, spawners[:1], operations=1, crashes=1)
    three = enumerate_system(system, spawners, operations=1, crashes=1)
    keep = ("traces", "skipped", "probes", "states", "crash_states", "violations",
            "steps_executed")
    assert {k: one.stats()[k] for k in keep} == {k: three.stats()[k] for k in keep}
    assert {k: (f.steps, f.executed) for k, f in one.best.items()} == {
        k: (f.steps, f.executed) for k, f in three.best.items()
    }


# --- the command -------------------------------------------------------------------------------


def test_command_on_the_reference_is_clean_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    corpus = tmp_path / "corpus"
    code = main(["enumerate", "--operations", "1", "--crashes", "0", "--corpus", str(corpus),
                 "--format", "plain"])
    out, err = capsys.readouterr()
    assert code == 0
    assert "clean: no invariant failed" in out and "traces run" in out
    assert "enumerate reference" in err  # progress on stderr
    assert not corpus.exists()


def test_command_saves_a_replayable_finding(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fork_spawner: Spawner,
) -> None:
    corpus = tmp_path / "corpus"
    code = main(["enumerate", "--system", "split-accept", "--operations", "1", "--corpus",
                 str(corpus), "--quiet", "--jobs", "3"])
    out, err = capsys.readouterr()
    assert code == 1 and err == ""
    files = sorted(corpus.glob("*.json"))
    assert files and all(f.name.startswith("split-accept-") for f in files)
    atom = [f for f in files if f.name.startswith("split-accept-ATOM-")]
    assert len(atom) == 1 and str(atom[0]) in out
    trace = Trace.load(atom[0])
    assert trace.system == "split-accept" and trace.deduplication and trace.settle
    assert trace.meta["found_by"] == "enumerate"
    assert len(trace.steps) == 1 and trace.steps[0].action == "accept"
    assert trace.expected is not None and trace.expected.invariants == ("ATOM",)
    replayed = execute(load_system(trace.system), trace.steps, fork_spawner,
                       deduplication=trace.deduplication, settle=trace.settle)
    assert replayed.verdict == trace.expected
    assert main(["replay", str(atom[0])]) == 0


@pytest.mark.parametrize("argv", [
    ["--operations", "0"],
    ["--crashes", "-1"],
    ["--max-steps", "zero"],
    ["--system", "no-such-system"],
    ["--format", "no-such-format"],
    ["--jobs", "0"],
    ["--concurrency", "2", "--jobs", "3"],  # its walk is one job: --jobs was ignored
])
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    corpus = tmp_path / "corpus"
    assert main(["enumerate", "--corpus", str(corpus), *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_corpus_that_is_a_file_is_refused_and_left_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    target = tmp_path / "corpus"
    target.write_text("not a directory\n")
    before = _scratch_entries()
    assert main(["enumerate", "--system", "split-accept", "--corpus", str(target)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and "--corpus" in err
    assert target.read_text() == "not a directory\n"
    assert [p.name for p in tmp_path.iterdir()] == ["corpus"]
    assert _scratch_entries() <= before


# --- the whole zoo (slow) ----------------------------------------------------------------------


@pytest.mark.slow
def test_reference_is_clean_with_the_default_budget(
    reference: System, spawners: list[Spawner],
) -> None:
    result = enumerate_system(reference, spawners)
    assert not result.found, json.dumps(result.stats())


#: The data and depth mutants need explore's generated data: enumerate is n/a for them.
ENUMERABLE = [name for name in registry.names(lanes=1, fault_drawn="", postgres=False)
              if getattr(registry.BY_NAME[name], "enumerable", True)]


@pytest.mark.slow
@pytest.mark.parametrize("name", ENUMERABLE)
def test_every_mutant_is_found_with_the_default_budget(
    name: str, spawners: list[Spawner],
) -> None:
    system = load_system(name)
    assert isinstance(system, Mutant)
    result = enumerate_system(system, spawners)
    assert result.found
    shortest = min(f.executed for f in result.best.values())
    assert shortest == system.minimal_steps
    for finding in result.best.values():
        assert set(finding.invariants) & set(system.caught_by), finding


@pytest.mark.parametrize("lanes", ["1", "2"])
def test_a_redis_corpus_is_refused_by_name(lanes: str, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str],
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """--corpus was read as a path, which folds redis:// into redis:/ (the message said a
    parent directory redis:/host did not exist)."""
    monkeypatch.chdir(tmp_path)
    assert main(["enumerate", "--concurrency", lanes, "--corpus", "redis://h:6379/0"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err == ("faultlab: error: --corpus redis://h:6379/0: enumerate saves "
                                 "findings to a directory, not a Redis corpus\n")
    assert list(tmp_path.iterdir()) == []


def test_first_reports_the_longest_trace_it_ran(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    """--first stops after the depth of its first finding: the traces of that depth are one
    step longer than the states it expanded ("longest trace 1" beside a 2-step finding)."""
    assert main(["enumerate", "--system", "split-complete", "--first", "--quiet",
                 "--corpus", str(tmp_path / "corpus"), "--format", "github"]) == 1
    out = capsys.readouterr().out
    assert "FOUND: PAIR at executed step 2 of a 2-step trace" in out
    assert [line for line in out.splitlines() if "longest trace" in line][0].split("|")[2] \
        .strip() == "2"
