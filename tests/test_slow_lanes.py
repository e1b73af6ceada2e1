"""A worker that is slow is not blocked, and one that never ends is a run failure.

Real workers wait: network calls, back-offs, heartbeat intervals. A lane is judged
*blocked* only while another worker is alive that could hold the lock it waits for; a
lane alone waits as long as the deadline allows, and one that misses it fails the run
(exit 3), as a sequential step does, never a LIVE finding. (A dispatcher that slept 2 s
before its correct work was once reported ``FOUND: LIVE`` with ``--concurrency 2``.)
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from conftest import ROOT, TESTS

from faultlab.base.errors import ExecutionError
from faultlab.run.executor import Executor
from faultlab.run.interleaving import BLOCK_BOUND
from faultlab.system import load_system
from faultlab.trace import Step

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

P = {"title": "slow"}
SLEEP = BLOCK_BOUND + 0.5


def test_a_lone_lane_that_sleeps_past_the_bound_runs_to_its_end(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAULTLAB_TEST_DISPATCH_SLEEP", str(SLEEP))
    system = load_system("systems_for_tests:SlowDispatchOutbox")
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", P, lane=1))
        began = time.monotonic()
        dispatched = ex.run(Step("dispatch", lane=1))
        took = time.monotonic() - began
        assert took >= SLEEP, took  # it did sleep past the bound
        assert dispatched.lanes == ("exit 0", "-"), dispatched.lanes
        assert not dispatched.violations, dispatched.violations
        assert [t.operation_id for t in ex.snapshot.tickets] == ["op-1"]
        assert [op.state for op in ex.snapshot.operations] == ["complete"], ex.snapshot
        _, final = ex.settle()
        assert final == []


def test_a_lone_lane_that_never_ends_misses_its_deadline() -> None:
    system = load_system("systems_for_tests:HangingDispatchOutbox")
    with Executor(system, concurrency=2, deadline=2.0) as ex:
        ex.run(Step("accept", "op-1", P, lane=1))
        began = time.monotonic()
        with pytest.raises(ExecutionError, match="missed its deadline") as failure:
            ex.run(Step("dispatch", lane=1))
        assert 2.0 <= time.monotonic() - began < 10.0
        pid = ex.lanes[1].pid
    assert "lane 1" in str(failure.value) and "dispatch" in str(failure.value)
    with pytest.raises(ProcessLookupError):  # ended and reaped with the executor
        os.kill(pid, 0)


def _explore(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "FAULTLAB_TEST_DISPATCH_SLEEP": str(SLEEP)}
    return subprocess.run([sys.executable, "-m", "faultlab", "explore", "--quiet", *args],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def test_explore_with_lanes_finds_nothing_in_a_slow_but_correct_dispatcher(
        tmp_path: os.PathLike[str]) -> None:
    done = _explore("--system", "systems_for_tests:SlowDispatchOutbox", "--concurrency", "2",
                    "--examples", "3", "--steps", "3", "--seed", "1",
                    "--corpus", f"{tmp_path}/corpus")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "FOUND" not in done.stdout and "clean: no invariant failed" in done.stdout


def test_explore_with_lanes_fails_the_run_on_a_dispatcher_that_never_ends(
        tmp_path: os.PathLike[str]) -> None:
    done = _explore("--system", "systems_for_tests:HangingDispatchOutbox", "--concurrency",
                    "2", "--examples", "3", "--steps", "3", "--seed", "1", "--deadline", "2",
                    "--corpus", f"{tmp_path}/corpus")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "FOUND" not in done.stdout
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "missed its deadline" in lines[0], done.stderr
    assert not os.path.exists(f"{tmp_path}/corpus")
