"""``explore --concurrency N --scheduler``: PCT draws the lanes through Hypothesis.

A seed draws the same priorities and change points; a PCT finding shrinks to the same
minimal trace as a uniform one; the trace records the concrete lane steps, so its replay
does not depend on the scheduler that found it.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from conftest import explore_lanes

from faultlab.cli import main
from faultlab.corpus import files as corpus
from faultlab.run.executor import execute
from faultlab.search.explore import Exploration
from faultlab.search.schedules import check_scheduler, pct_span
from faultlab.system import load_system
from faultlab.system.builtin.race_mutants import ConcurrencyMutant
from faultlab.trace import Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

MUTANT = "eager-rescue"  # found by PCT within a few examples of seed 0


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def found() -> dict[str, Exploration]:
    system = load_system(MUTANT)
    return {scheduler: explore_lanes(system, examples=10, seed_value=0,
                                          scheduler=scheduler)
            for scheduler in ("pct", "uniform")}


def test_pct_draws_are_the_same_for_a_seed() -> None:
    system = load_system("reference")
    runs = [explore_lanes(system, examples=3, seed_value=5,
                               scheduler="pct") for _ in range(2)]
    draws = [run.recorder.pct_draws for run in runs]
    assert draws[0] and draws[0] == draws[1]
    for order, points in draws[0]:
        assert sorted(order) == [1, 2]
        assert len(points) == 2 and all(1 <= p <= pct_span(10) for p in points)
    assert runs[0].recorder.last_steps == runs[1].recorder.last_steps
    other = explore_lanes(system, examples=3, seed_value=5,
                               scheduler="uniform")
    assert other.recorder.pct_draws == []  # uniform draws no priorities at all


def test_swarm_draws_pct_for_some_examples_only() -> None:
    result = explore_lanes(load_system("reference"), examples=4,
                                seed_value=5, scheduler="swarm")
    assert 0 < len(result.recorder.pct_draws) < result.recorder.examples


def test_pct_finds_a_mutant_and_shrinks_it_as_uniform_does(
        found: dict[str, Exploration]) -> None:
    system = load_system(MUTANT)
    assert isinstance(system, ConcurrencyMutant)
    pct, uniform = found["pct"], found["uniform"]
    assert pct.trace is not None and uniform.trace is not None
    assert pct.recorder.first_failure_examples is not None
    assert pct.recorder.first_failure_examples <= 10
    assert pct.shrunk_steps == uniform.shrunk_steps == system.minimal_steps
    assert pct.trace.meta["scheduler"] == "pct" and "scheduler" not in uniform.trace.meta


def test_a_pct_finding_replays_whatever_the_scheduler(
        found: dict[str, Exploration], tmp_path: Path) -> None:
    trace = found["pct"].trace
    assert trace is not None
    path = corpus.save(trace, tmp_path, MUTANT)
    code, out, _ = cli("replay", str(path))
    assert code == 0 and "every outcome matches" in out, out
    document = json.loads(path.read_text())
    del document["meta"]["scheduler"]  # the steps are the trace: replay never asks
    path.write_text(json.dumps(document))
    saved = Trace.load(path)
    assert isinstance(saved, Trace)
    replayed = execute(load_system(MUTANT), saved.steps, concurrency=2, settle=True)
    assert replayed.verdict == saved.expected


@pytest.mark.parametrize("args, message", [
    (["--concurrency", "2", "--scheduler", "bogus"], "invalid choice: 'bogus'"),
    (["--scheduler", "pct"], "--scheduler applies with --concurrency above 1"),
])
def test_a_bad_scheduler_is_one_line_exit_2(tmp_path: Path, args: list[str],
                                           message: str) -> None:
    code, out, err = cli("explore", *args, "--corpus", str(tmp_path / "c"), "--quiet")
    assert code == 2 and out == "" and message in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (tmp_path / "c").exists()


def test_an_unknown_scheduler_is_refused_by_the_engine_too() -> None:
    with pytest.raises(Exception, match="unknown scheduler 'bogus'"):
        check_scheduler("bogus")


def test_the_overtake_rule_starts_a_second_relay_on_the_held_claims_key() -> None:
    """Per-key order bugs need a relay holding its claim while work of the same key is
    accepted and a second relay starts: the overtake rule makes that one move. Called on
    the reference's machine after one accept, whatever Hypothesis draws: a relay starts
    and holds op-1's claim, a new operation with op-1's title runs in the other lane, and
    a second relay starts there while the first still holds and, ``through``, runs to its
    end before the first moves."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from faultlab.search.recorder import Recorder
    from faultlab.search.schedules import concurrent_machine
    from faultlab.trace import Step

    machine = concurrent_machine("reference", concurrency=2, examples=1, steps=8,
                                 recorder=Recorder())
    seen: list[list[Step]] = []

    @settings(max_examples=5, database=None, deadline=None, derandomize=True)
    @given(st.data())
    def overtake_once(data: st.DataObject) -> None:
        state = machine()
        try:
            state.payloads["op-1"] = {"title": "backlog"}
            state.execute(Step("accept", "op-1", {"title": "backlog"}, lane=1))
            through = data.draw(st.booleans())
            state.overtake(data, through)
            steps = [o.step for o in state.executor.observations]
            holder = steps[1].lane
            assert (steps[1].action, steps[1].hold) == ("dispatch", True), steps
            assert (steps[2].action, steps[2].hold) == ("accept", False), steps
            assert steps[2].lane != holder and steps[2].payload["title"] == "backlog", steps
            assert (steps[3].action, steps[3].hold, steps[3].lane) == (
                "dispatch", True, steps[2].lane), steps
            # through: the second relay runs to its end, if it still holds (the reference's
            # finds op-1's key claimed, has nothing to take and has ended already)
            second = state.executor.lanes[steps[3].lane]
            assert steps[4:] == ([Step("finish", lane=steps[3].lane)]
                                 if through and len(steps) > 4 else []), steps
            assert not second.alive or not through, steps
            assert state.executor.lanes[holder].alive, steps  # the first relay still holds
            seen.append(steps)
        finally:
            state.teardown()

    overtake_once()
    assert len(seen) == 5


def test_the_nemesis_kills_a_blocked_lane_but_never_pauses_it() -> None:
    """A blocked lane is inside SQLite's busy loop, taking and dropping a shared lock on
    every retry: a SIGSTOP landing while it holds one leaves the lock held (a committer
    then waits on it and the stores cannot be read: a run failed with "database is
    locked" under load), and whether it does is a matter of microseconds, so the trace
    would not replay alike. The nemesis may kill it; it may pause a held lane."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from faultlab.search.recorder import Recorder
    from faultlab.search.schedules import concurrent_machine
    from faultlab.trace import Step

    machine = concurrent_machine("reference", concurrency=2, examples=1, steps=8,
                                 recorder=Recorder())
    done: dict[str, set[str]] = {"blocked": set(), "held": set()}

    @settings(max_examples=30, database=None, deadline=None, derandomize=True)
    @given(st.data())
    def nemesis_once(data: st.DataObject) -> None:
        state = machine()
        try:
            state.payloads["op-1"] = {"title": "backlog"}
            state.execute(Step("accept", "op-1", {"title": "backlog"}, lane=1, hold=True))
            state.execute(Step("accept", "op-2", {"title": "backlog"}, lane=2, hold=True))
            lanes = state.executor.lanes
            assert (lanes[1].status, lanes[2].status) == ("held", "blocked")
            state.nemesis(data)
            step = state.executor.observations[-1].step
            done["blocked" if step.lane == 2 else "held"].add(step.action)
        finally:
            state.teardown()

    nemesis_once()
    assert done == {"blocked": {"kill"}, "held": {"kill", "pause"}}, done


def test_every_example_opens_with_a_drawn_scenario_the_same_for_a_seed() -> None:
    """The opening is Hypothesis's draw: a seed opens its examples alike, Hypothesis's first
    examples vary it (they no longer all repeat one simplest example), and the opening ran
    its steps (a rescue ticks the clock to a lease's end)."""
    system = load_system("reference")
    runs = [explore_lanes(system, examples=8, seed_value=3) for _ in range(2)]
    first, second = (run.recorder.openings for run in runs)
    assert first == second
    assert sum(first.values()) >= runs[0].recorder.examples
    assert len(first) >= 3, first
    assert set(first) <= {"rescue", "overtake", "redeliver", "overlap", "none"}
    assert runs[0].recorder.actions["tick"] >= first["rescue"] > 0


def test_a_confirmed_concurrent_finding_carries_no_flaky_note(
        found: dict[str, Exploration]) -> None:
    """The concurrent machine stops Hypothesis's own re-run of the failing example (the
    first failure is the finding), which Hypothesis reports as flaky every time; a finding
    its replay confirmed says nothing of the kind."""
    for exploration in found.values():
        assert exploration.trace is not None
        assert not [note for note in exploration.notes if "flaky" in note.lower()]
