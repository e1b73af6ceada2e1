"""Power loss in sequential traces: the ``power`` step, DURABLE/OPEN, the two durability
mutants, replay and ``explore --power-loss``.

The reference must stay clean under power cuts (its stores commit with
``synchronous=EXTRA``: with a rollback journal FULL loses the last commit, see
tests/test_power_vfs.py); each mutant's one defect is a store setting a power cut exposes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from faultlab.base.errors import UsageError
from faultlab.process.records import POWER_LOG_VARIABLE, WorkerSpec
from faultlab.process.spawn import Spawner, spawner
from faultlab.run.executor import execute
from faultlab.system import is_builtin, load_system
from faultlab.system.builtin import registry
from faultlab.trace import Step, Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

POWER_MUTANTS = registry.names(fault_drawn="power")
SEQUENTIAL = registry.names(lanes=1, fault_drawn="")

P = {"title": "backlog"}
DROP_ALL = {"kind": "drop_all"}


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=600)


def test_an_executor_that_would_cut_stores_on_a_server_is_refused_before_anything() -> None:
    """Recording for power cuts means SQLite files; an executor asked to record a system
    whose stores are on PostgreSQL refuses at once (no run directory, no connection)."""
    from faultlab.run.executor import Executor

    with pytest.raises(UsageError) as raised:
        Executor(load_system("reference-pg"), power=True)
    assert "\n" not in str(raised.value) and "PostgreSQL" in str(raised.value)


def test_a_power_step_writes_its_choice_and_nothing_else() -> None:
    step = Step.power({"kind": "prefix", "keep": 1})
    assert step.to_json() == {"action": "power", "choice": {"kind": "prefix", "keep": 1}}
    assert Step.from_json(step.to_json()) == step
    assert step.describe() == 'power({"keep":1,"kind":"prefix"})'
    # every other step is written as before: no "choice" key
    assert "choice" not in Step("accept", "op-1", P).to_json()
    assert "choice" not in Step("dispatch", crash="after_claim").to_json()


def test_existing_trace_files_read_and_write_byte_identically() -> None:
    for path in sorted((ROOT / "corpus").glob("*.json")) + sorted(
            (ROOT / "tests" / "traces").glob("*.json")):
        trace = Trace.load(path)
        if isinstance(trace, Trace):
            assert trace.to_json() == json.loads(path.read_text()), path


@pytest.mark.parametrize("choice", [None, {}, {"kind": "drop"}, {"kind": "prefix"},
                                    {"kind": "prefix", "keep": -1}, {"kind": "drop_all", "x": 1},
                                    "drop_all"])
def test_a_malformed_power_step_is_refused_in_one_line(choice: object) -> None:
    data = {"action": "power"} if choice is None else {"action": "power", "choice": choice}
    with pytest.raises(UsageError) as raised:
        Step.from_json(data)
    assert "\n" not in str(raised.value) and "power" in str(raised.value)


def test_the_reference_keeps_everything_acknowledged_through_power_cuts(
        fork_spawner: Spawner) -> None:
    steps = [
        Step("accept", "op-1", P), Step.power(DROP_ALL), Step("dispatch"), Step.power(DROP_ALL),
        Step("accept", "op-2", P), Step("dispatch", crash="after_downstream_commit"),
        Step.power(DROP_ALL), Step("dispatch"), Step.power({"kind": "prefix", "keep": 1}),
    ]
    execution = execute(load_system("reference"), steps, fork_spawner, settle=True)
    assert execution.verdict.clean, [str(v) for v in execution.violations]
    assert execution.observations[-1].snapshot.counts()["tickets"] == 2


def test_a_recording_worker_is_forked_from_the_fork_server() -> None:
    """The recording's log directory is set by the forked worker itself, as the clock files
    are: a power trace keeps fork mode's cost (a fork server starts for its accept)."""
    with spawner("fork") as runner:
        execution = execute(load_system("reference"),
                            [Step("accept", "op-1", P), Step.power(DROP_ALL)], runner)
        assert runner.server_pids, "the recording accept was exec'd, not forked"
    assert execution.verdict.clean
    assert execution.observations[-1].snapshot.counts()["operations_pending"] == 1


def test_a_recording_dispatchers_service_is_the_fork_servers_and_records(
        tmp_path: Path) -> None:
    """The service of a recording dispatcher is forked by the fork server from its own
    image (one forked from the dispatcher, which holds open connections and the recording
    VFS, left a WAL database malformed), and installs the recording VFS itself; it was
    exec'd, at an interpreter's start-up per service."""
    system = "systems_for_tests:ServiceWitnessOutbox"
    load_system(system).initialise(tmp_path)
    log = tmp_path / "power"
    log.mkdir()
    recording = ((POWER_LOG_VARIABLE, str(log)),)
    with spawner("fork") as runner:
        accepted = runner.run(WorkerSpec(
            system=system, role="accept", directory=str(tmp_path), operation_id="op-1",
            payload=json.dumps(P), crash=None, environment=recording))
        assert accepted.exit_code == 0, accepted.stderr
        dispatcher = runner.run(WorkerSpec(system=system, role="dispatch",
                                           directory=str(tmp_path), crash=None,
                                           environment=recording))
        assert dispatcher.exit_code == 0, dispatcher.stderr
        [server] = runner.server_pids
    assert dispatcher.response is not None
    [[stdout, _, pid]] = dispatcher.response["service_outputs"]
    assert pid != str(dispatcher.pid)
    assert f"service parent {server} recording {log}" in stdout.splitlines()


@pytest.mark.parametrize("name", sorted(POWER_MUTANTS))
def test_each_power_mutant_is_caught_by_its_minimal_trace(name: str,
                                                         fork_spawner: Spawner) -> None:
    mutant = load_system(name)
    execution = execute(mutant, mutant.minimal_trace, fork_spawner,  # type: ignore[attr-defined]
                        settle=True)
    assert execution.verdict.invariants == mutant.caught_by  # type: ignore[attr-defined]
    assert len(execution.executed_prefix()) == mutant.minimal_steps  # type: ignore[attr-defined]
    # without the power cut the same steps are clean: only power loss shows the defect
    without = [step for step in mutant.minimal_trace  # type: ignore[attr-defined]
               if step.action != "power"]
    assert execute(mutant, without, fork_spawner, settle=True).verdict.clean


def test_power_mutants_are_builtin_but_stay_out_of_the_zoo() -> None:
    for name in POWER_MUTANTS:
        assert is_builtin(name) and name not in SEQUENTIAL


def test_a_trace_with_power_steps_replays_identically(tmp_path: Path) -> None:
    mutant = load_system("wal-normal-receiver")
    steps = list(mutant.minimal_trace)  # type: ignore[attr-defined]
    trace = Trace(system=mutant.ref, deduplication=True, steps=steps,
                  expected=execute(mutant, steps, Spawner(), settle=True).verdict,
                  expect="finding")
    path = tmp_path / "power.json"
    path.write_text(json.dumps(trace.to_json()))
    assert Trace.load(path).to_json() == trace.to_json()
    done = run_cli("replay", str(path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "DONE+DURABLE at step 3" in done.stdout and "matches" in done.stdout


@pytest.mark.parametrize("name", sorted(POWER_MUTANTS))
def test_explore_power_loss_catches_and_shrinks_each_mutant(name: str, tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    # seed 0, 30 examples, named points only: found in about 4 minutes on a loaded machine
    done = run_cli("explore", "--system", name, "--power-loss", "--no-statement-points",
                   "--examples", "30", "--seed", "0", "--corpus", str(corpus), "--quiet")
    assert done.returncode == 1, done.stdout + done.stderr
    # no cut is drawn before the first accept (it could lose nothing): 2 examples at seed 0
    # where it took 12 while cuts were drawn on empty stores
    examples = next(int(line.split()[-1]) for line in done.stdout.splitlines()
                    if line.split()[:1] == ["examples"] and len(line.split()) == 2)
    assert examples <= 5, done.stdout
    (found,) = sorted(corpus.glob("*.json"))
    trace = Trace.load(found)
    mutant = load_system(name)
    assert isinstance(trace, Trace) and trace.expected is not None
    assert trace.expected.invariants == mutant.caught_by  # type: ignore[attr-defined]
    # shrunk to the known minimal trace, the power cut's choice to drop_all
    assert [step.action for step in trace.steps] == [
        step.action for step in mutant.minimal_trace]  # type: ignore[attr-defined]
    assert trace.steps[-1].choice == DROP_ALL
    replayed = run_cli("replay", str(found))
    assert replayed.returncode == 0 and "matches" in replayed.stdout, \
        replayed.stdout + replayed.stderr


def test_explore_without_power_loss_never_cuts_power(tmp_path: Path) -> None:
    done = run_cli("explore", "--system", "sync-off-caller", "--examples", "5", "--seed", "0",
                   "--corpus", str(tmp_path / "corpus"), "--quiet")
    assert done.returncode in (0, 4), done.stdout + done.stderr
    assert not list((tmp_path / "corpus").glob("*.json"))


