"""Power cuts in concurrent traces: every live lane dies at the cut, the stores keep what
the choice keeps of their unsynced writes, and the findings shrink, save and replay."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT
from test_lanes import _gone
from test_starter import _parent_of

from faultlab.base.errors import UsageError
from faultlab.run.directory import POWER_LOG
from faultlab.run.executor import Executor, execute
from faultlab.system import load_system
from faultlab.trace import Step, Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

P = {"title": "backlog"}
DROP_ALL = {"kind": "drop_all"}


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=900, check=False)


def test_a_power_step_is_data_in_a_concurrent_trace() -> None:
    step = Step.power({"kind": "prefix", "keep": 1})
    assert step.to_json() == {"action": "power", "choice": {"kind": "prefix", "keep": 1}}
    assert Step.from_lane_json(step.to_json()) == step
    assert step.describe() == 'power({"keep":1,"kind":"prefix"})'
    with pytest.raises(UsageError, match="takes no lane"):
        Step.from_lane_json({"action": "power", "choice": DROP_ALL, "lane": 1})
    with pytest.raises(UsageError, match="power step"):
        Step.from_lane_json({"action": "power", "choice": {"kind": "sometimes"}})


def test_a_cut_kills_the_held_lane_and_loses_an_unsynced_acceptance() -> None:
    system = load_system("sync-off-caller")
    with Executor(system, concurrency=2, power=True) as ex:
        accepted = ex.run(Step("accept", "op-1", P, lane=1))
        assert accepted.violations == () and len(accepted.snapshot.operations) == 1
        held = ex.run(Step("dispatch", lane=2, hold=True))
        (pid,) = [lane.pid for lane in ex.lanes.values() if lane.alive]
        # forked by the lanes' helper, which holds no connection and no recording VFS (a
        # lane was exec'd: an interpreter's start each)
        assert _parent_of(pid) != os.getpid()
        cut = ex.run(Step.power(DROP_ALL))
        assert _gone(pid) and not any(lane.alive for lane in ex.lanes.values())
        assert cut.sigkills == 1 and held.violations == ()
        assert len(cut.snapshot.operations) == 0  # synchronous=OFF: nothing synced
        assert {v.invariant for v in cut.violations} >= {"ACK", "DURABLE"}


def test_a_recording_lane_dispatchers_service_is_forked_and_records(tmp_path: Path) -> None:
    """A lane's recording dispatcher forks its service's spare before it records anything
    (one forked from it afterwards shares its connections and the recording VFS's open
    files): the service is the dispatcher's child, forked, not exec'd (an interpreter's
    start each), and installs the recording VFS itself."""
    system = load_system("systems_for_tests:ServiceWitnessOutbox")
    with Executor(system, concurrency=2, power=True) as ex:
        ex.run(Step("accept", "op-1", P, lane=1))
        dispatched = ex.run(Step("dispatch", lane=2))
        [record] = [record for _, record in dispatched.exited
                    if record.response and "service_outputs" in record.response]
        dispatcher = record.pid
        log = ex.directory / POWER_LOG
        assert dispatched.violations == ()
    assert record.response is not None
    [[stdout, _, service]] = record.response["service_outputs"]
    lines = stdout.splitlines()
    assert f"service parent {dispatcher} recording {log}" in lines, lines
    assert "service interpreter -c" in lines, lines
    assert service != str(dispatcher)


def test_a_cut_in_a_laned_trace_loses_an_unsynced_wal_commit() -> None:
    """The explorer keeps its readers open through a laned power trace, as through a
    sequential one: closing the last connection to a WAL store checkpoints and syncs it,
    so the service's connection (or the snapshot's, opened and closed after each step)
    made the receiver's unsynced commit durable, and wal-normal-receiver's lost ticket
    went unseen with lanes (``explore --concurrency 2 --power-loss`` read it clean)."""
    steps = [Step("accept", "op-1", P, lane=1), Step("dispatch", lane=2),
             Step.power(DROP_ALL)]
    execution = execute(load_system("wal-normal-receiver"), steps, concurrency=2)
    before, after = (o.snapshot.counts() for o in execution.observations[-2:])
    assert before["tickets"] == 1 and before["operations_complete"] == 1
    assert after["tickets"] == 0 and after["operations_complete"] == 1
    assert {v.invariant for v in execution.violations} >= {"DONE", "DURABLE"}


def test_the_reference_keeps_what_it_acknowledged_through_a_cut_under_a_held_lane() -> None:
    steps = [Step("accept", "op-1", P, lane=1), Step("dispatch", lane=2, hold=True),
             Step.power(DROP_ALL), Step("dispatch", lane=1),
             Step("accept", "op-2", P, lane=2), Step.power({"kind": "prefix",
                                                                       "keep": 1})]
    execution = execute(load_system("reference"), steps, concurrency=2, settle=True)
    assert execution.verdict.clean, [str(v) for v in execution.violations]
    last = execution.observations[-1].snapshot
    assert len(last.operations) == 2 and len(last.tickets) == 2


def test_a_concurrent_power_finding_replays_from_its_file(tmp_path: Path) -> None:
    trace = Trace(system="full-sync-caller", deduplication=True, concurrency=2,
                  steps=[Step("accept", "op-1", P, lane=1), Step.power(DROP_ALL)])
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(trace.to_json(), indent=2) + "\n", encoding="utf-8")
    loaded = Trace.load(path)
    assert isinstance(loaded, Trace) and loaded.steps == trace.steps
    done = run_cli("replay", str(path))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ACK+DURABLE at step 2" in done.stdout


def test_explore_power_loss_runs_with_concurrency(tmp_path: Path) -> None:
    """Seed 1 cuts the power (seed 0's three examples never did: a vacuous run, exit 4)."""
    done = run_cli("explore", "--system", "reference", "--power-loss", "--concurrency", "2",
                   "--examples", "3", "--steps", "6", "--seed", "1", "--quiet",
                   "--corpus", str(tmp_path / "corpus"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = {line.split()[0]: line.split()[-1] for line in done.stdout.splitlines()
            if line.split()[:1] in (["OPEN"], ["DURABLE"], ["step"])}
    assert int(rows["OPEN"]) > 0 and int(rows["DURABLE"]) > 0, done.stdout
    assert not (tmp_path / "corpus").exists()


@pytest.mark.slow
def test_explore_power_loss_with_concurrency_finds_and_shrinks_a_power_mutant(
        tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    done = run_cli("explore", "--system", "sync-off-caller", "--power-loss", "--concurrency",
                   "2", "--examples", "30", "--seed", "0", "--quiet", "--corpus", str(corpus),
                   cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FOUND: ACK+DURABLE at step 2, shrunk to 2 scheduling steps" in done.stdout
    (found,) = sorted(corpus.glob("*.json"))
    trace = Trace.load(found)
    assert isinstance(trace, Trace)
    assert [(step.action, step.hold) for step in trace.steps] == [
        ("accept", False), ("power", False)]
    assert trace.steps[-1].choice == DROP_ALL
    replayed = run_cli("replay", str(found), cwd=tmp_path)
    assert replayed.returncode == 0 and "matches" in replayed.stdout, replayed.stdout
