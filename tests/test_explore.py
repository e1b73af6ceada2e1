"""The state machine: clean on the reference, the negative control found and shrunk."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest
from conftest import ROOT

from faultlab.process.spawn import Spawner, child_environment
from faultlab.search.explore import Exploration, explore, share_at_least
from faultlab.search.machine import SUITE_WEIGHTS, InvariantFailure, outbox_machine, run_example
from faultlab.system import System
from faultlab.trials.scenarios import SCENARIOS

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        cwd=cwd or ROOT, timeout=300,
    )


def test_reference_is_clean_under_exploration(reference: System, fork_spawner: Spawner) -> None:
    result = explore(reference, fork_spawner, examples=20, steps=8, seed_value=1)
    assert result.trace is None, result.trace and result.trace.to_json()
    assert result.recorder.examples >= 20
    assert result.recorder.steps >= 100
    assert result.recorder.sigkills > 0
    assert sum(result.recorder.crash_hits.values()) > 0
    # every invariant had something to check at least once (coverage is not vacuous)
    unchecked = [name for name, count in result.recorder.coverage.invariant_rows() if not count]
    assert unchecked == []
    # the power-loss invariants apply only to runs that draw power steps: left out here
    shown = [name for name, _ in result.recorder.coverage.invariant_rows()]
    assert "DURABLE" not in shown and "OPEN" not in shown and "ACK" in shown
    # a sequential trace keeps a history: TERM and ORDER are checked (and had something to
    # check, above); the invariants over announced claims only lanes collect are left out
    assert {"TERM", "ORDER"} <= set(shown) and not {"EXCL", "FENCE", "SKIP"} & set(shown)
    assert "DURABLE" in [name for name, _ in result.recorder.coverage.invariant_rows(["power"])]


def test_explore_delivers_directly_more_often_than_the_suite_weights(
    reference: System, fork_spawner: Spawner,
) -> None:
    """Examples are counted by operations and direct deliveries. (Operations per example:
    56% against 45% with three or more in 200 examples at seed 7, too close to compare
    in 30.)"""
    deep = explore(reference, fork_spawner, examples=30, seed_value=7)
    shallow = explore(reference, fork_spawner, examples=30, seed_value=7, weights=SUITE_WEIGHTS)
    for result in (deep, shallow):
        stats = result.stats()
        counted = stats["operations_per_example"], stats["direct_deliveries_per_example"]
        assert all(sum(c.values()) == result.recorder.examples for c in counted)
    delivered = [share_at_least(r.recorder.deliveries_per_example, 1) for r in (deep, shallow)]
    assert delivered[0] > delivered[1] + 10, delivered


@pytest.fixture(scope="module")
def negative_control(reference: System, fork_spawner: Spawner) -> Exploration:
    return explore(reference, fork_spawner, deduplication=False, examples=30, steps=6,
                   seed_value=0)


def test_negative_control_is_caught_by_one_in_exactly_three_steps(
    negative_control: Exploration,
) -> None:
    result = negative_control
    trace = result.trace
    assert trace is not None and trace.expected is not None
    assert "ONE" in trace.expected.invariants
    assert len(trace.steps) == 3
    first = trace.steps[0]
    assert first.action == "accept" and first.crash is None
    assert {s.action for s in trace.steps[1:]} <= {"dispatch", "service"}
    assert result.replay is not None and result.replay.verdict == trace.expected
    final = result.replay.observations[-1].snapshot
    assert [t.operation_id for t in final.tickets] == [first.operation_id] * 2
    # the two ticket creations happened at steps 2 and 3
    counts = [len(o.snapshot.tickets) for o in result.replay.observations]
    assert counts == [0, 1, 2]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.name)
def test_scenarios_are_explicit_examples_of_the_machine(
    scenario: object, fork_spawner: Spawner
) -> None:
    from faultlab.trials.scenarios import Scenario

    assert isinstance(scenario, Scenario)
    machine = outbox_machine(deduplication=scenario.deduplication, spawner=fork_spawner)
    if scenario.deduplication:
        instance = run_example(machine, scenario.steps)
        assert instance.failure is None
        assert len(instance.executor.observations) == len(scenario.steps)
    else:
        with pytest.raises(InvariantFailure) as caught:
            run_example(machine, scenario.steps)
        assert caught.value.step == 3
        assert "ONE" in {v.invariant for v in caught.value.violations}


def test_machine_runs_as_a_unittest_testcase(fork_spawner: Spawner) -> None:
    machine = outbox_machine(spawner=fork_spawner, examples=3, steps=4)
    machine.TestCase("runTest").runTest()
    assert machine.recorder.examples >= 3


def test_explore_command_clean_creates_no_corpus(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    done = run_cli("explore", "--examples", "5", "--steps", "5", "--seed", "2", "--corpus",
                   str(corpus), "--quiet")
    assert done.returncode == 0, done.stderr
    assert "clean: no invariant failed" in done.stdout
    assert "SIGKILLs" in done.stdout and "steps/s" in done.stdout
    assert hypothesis.__version__ in done.stdout  # what the seed reproduces a run with
    assert not corpus.exists()
    rows = dict(line.rsplit(None, 1) for line in done.stdout.splitlines()
                if line.startswith("step"))
    by_action = {name: int(count) for name, count in rows.items() if name.startswith("step ")}
    assert {"step accept", "step dispatch"} <= set(by_action), done.stdout
    assert sum(by_action.values()) == int(rows["steps"]), done.stdout  # each step counted once


def test_an_exploration_and_its_finding_record_the_hypothesis_version(
    negative_control: Exploration,
) -> None:
    """A seed reproduces a run only with the same Hypothesis, so both say which."""
    assert negative_control.to_json()["hypothesis"] == hypothesis.__version__
    assert negative_control.trace is not None
    assert negative_control.trace.meta["hypothesis"] == hypothesis.__version__


def test_explore_command_saves_a_replayable_finding(
    tmp_path: Path, negative_control: Exploration
) -> None:
    """Same system, seed and budget as the API run: the same shrunk trace (--seed reproduces)."""
    corpus = tmp_path / "corpus"
    done = run_cli("explore", "--no-deduplication", "--examples", "30", "--steps", "6",
                   "--seed", "0", "--corpus", str(corpus))
    assert done.returncode == 1, done.stderr
    assert "explore:" in done.stderr  # progress
    files = sorted(corpus.glob("*.json"))
    assert len(files) == 1
    assert files[0].name.startswith("reference-nodedup-ONE-")
    data = json.loads(files[0].read_text())
    assert data["format"] == "faultlab-trace" and data["version"] == 1
    assert data["deduplication"] is False and len(data["steps"]) == 3
    assert f"saved {files[0]}" in done.stdout
    assert negative_control.trace is not None
    assert data["steps"] == [s.to_json() for s in negative_control.trace.steps]
    replayed = run_cli("replay", str(files[0]))
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr
    assert "matches" in replayed.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--examples", "0"], "--examples"),
        (["--steps", "x"], "--steps"),
        (["--system", "nonesuch"], "unknown system"),
        (["--format", "nonesuch"], "--format"),
        (["--spawn", "thread"], "--spawn"),
    ],
)
def test_explore_bad_input(tmp_path: Path, args: list[str], message: str) -> None:
    corpus = tmp_path / "corpus"
    done = run_cli("explore", "--corpus", str(corpus), *args)
    assert done.returncode == 2
    assert message in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1
    assert not corpus.exists()


def test_explore_refuses_a_corpus_path_that_is_a_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    corpus.write_text("not a directory")
    done = run_cli("explore", "--corpus", str(corpus), "--examples", "1")
    assert done.returncode == 2
    assert "not a directory" in done.stderr
    assert corpus.read_text() == "not a directory"


@pytest.mark.slow
def test_hypothesis_shrinking_reaches_the_same_three_steps(
    reference: System, fork_spawner: Spawner
) -> None:
    result = explore(reference, fork_spawner, deduplication=False, examples=30, steps=6,
                     seed_value=0, hypothesis_shrink=True)
    assert result.trace is not None and result.trace.expected is not None
    assert "ONE" in result.trace.expected.invariants
    assert result.shrunk_steps == 3


_SEEDED_RUN = """
import json, sys
if len(sys.argv) > 1:  # load a module Hypothesis counts as local, full of literals
    sys.path.insert(0, sys.argv[1])
    import faultlab_test_literals  # noqa: F401
from faultlab.search.explore import explore
from faultlab.process.spawn import spawner
from faultlab.system import load_system
with spawner("fork") as runner:
    result = explore(load_system("reference"), runner, examples=15, steps=6, seed_value=3)
stats = result.stats()
print(json.dumps({k: stats[k] for k in ("examples", "steps", "sigkills", "crash_points_hit")}))
"""


def test_a_seed_explores_the_same_whatever_other_code_is_loaded(tmp_path: Path) -> None:
    """Hypothesis draws literals from modules it counts as local (a checkout, a user's
    system, test files); faultlab switches that off, so --seed means one run."""
    (tmp_path / "faultlab_test_literals.py").write_text(
        "INTEGERS = [" + ", ".join(str(n) for n in range(-3, 400, 7)) + "]\n"
        "STRINGS = ['op-1', 'op-2', 'urgent', 'low', 'backlog', 'sql:1', 'commit:1']\n"
    )
    runs = []
    for extra in ([], [str(tmp_path)]):
        done = subprocess.run([sys.executable, "-c", _SEEDED_RUN, *extra], capture_output=True,
                              text=True, timeout=300, check=False, cwd=tmp_path,
                              env=child_environment())
        assert done.returncode == 0, done.stderr
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert runs[0]["steps"] > 0
    assert runs[0] == runs[1]


def test_a_saved_finding_stays_a_finding_when_the_html_target_vanishes(tmp_path: Path) -> None:
    """Saving the finding is the run's commit point: a page that can no longer be written
    (its directory removed while exploring) is a line on stderr, and the status stays 1."""
    pages = tmp_path / "pages"
    pages.mkdir()
    corpus = tmp_path / "corpus"
    explore_run = subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--no-deduplication", "--examples", "30",
         "--steps", "6", "--seed", "0", "--corpus", str(corpus), "--html",
         str(pages / "finding.html")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        env=child_environment())
    assert explore_run.stderr is not None
    seen = []
    for line in explore_run.stderr:  # the check of --html is long past: the run is exploring
        seen.append(line)
        if "an invariant failed; shrinking" in line:
            pages.rmdir()
            break
    out, err = explore_run.communicate(timeout=300)
    stderr = "".join(seen) + err
    assert explore_run.returncode == 1, out + stderr
    (saved,) = corpus.glob("*.json")
    assert f"saved {saved}" in out and "FOUND: ONE+DONE" in out
    assert "wrote " not in out
    assert "the finding is saved, but the --html page was not written" in stderr
    assert "Traceback" not in stderr


def test_an_example_that_errors_is_neither_recovered_nor_counted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dispatcher refuses its input (exit 2: a run error, never a finding). The
    sequential example stops there, as one in lanes does: no recovery starts another
    dispatcher after the error, and the example is not counted (before, the sequential
    frame recovered it, its dispatcher completed the work, and it counted as a clean
    example of three steps)."""
    from faultlab.base.errors import ExecutionError
    from faultlab.process.spawn import spawner
    from faultlab.trace import Step

    flag = tmp_path / "refuse-once"
    flag.write_text("")
    monkeypatch.setenv("FAULTLAB_TEST_ONCE_FLAG", str(flag))
    with spawner("fork") as runner:  # its fork server starts with the flag's variable
        machine = outbox_machine("systems_for_tests:OnceRefusingOutbox", spawner=runner)
        instance = machine()
        with pytest.raises(ExecutionError, match="refused"):
            try:
                instance.execute(Step("accept", "op-1", {"title": "a"}))
                instance.execute(Step("dispatch"))
            finally:
                instance.teardown()
    assert not flag.exists()  # the dispatcher did refuse
    assert isinstance(machine.recorder.run_error, ExecutionError)
    assert [o.step.action for o in instance.executor.observations] == ["accept"]
    assert machine.recorder.examples == 0 and machine.recorder.steps == 1
    assert instance.executor.snapshot.pending_outbox()  # nothing dispatched it afterwards
