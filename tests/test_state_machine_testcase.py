"""``faultlab.state_machine(system).TestCase`` fails the way ``faultlab explore`` reports.

Measured on 2 shared cores (load 4-8, tox's Python 3.11, Hypothesis 6.170.17) for the
``split-receipt`` mutant, seed 0: ``python -m faultlab explore --system split-receipt``
took 6.1 s and 7.2 s (4 examples, RCPT shrunk to 2 steps); ``pytest`` on a file holding
``faultlab.state_machine("split-receipt").TestCase`` took 7.5 s and 8.6 s (1.2x, the same
4 examples and the same finding). For ``no-dedup`` (2 examples): explore 0.65-0.78 s,
the pytest run 1.4-2.0 s, of which the test 1.1-1.5 s (pytest's start-up is the rest).
Before, the TestCase ran Hypothesis's own loop: 62.6 s for split-receipt (114 s on another
machine) spent shrinking real processes, a report of raw draws, and no saved finding.
:func:`test_costs_about_what_explore_costs` holds it to 3x (plus 5 s for start-up).

Run as a user runs it: pytester in a subprocess, in a fresh directory, importing this
faultlab; and ``python -m unittest`` in a subprocess.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from faultlab.process.spawn import child_environment

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent

MACHINES = """
import faultlab

TestSplitReceipt = faultlab.state_machine("split-receipt").TestCase
TestReference = faultlab.state_machine("reference", examples=3, steps=3).TestCase
"""


def _plugin() -> list[str]:
    """As tests/test_pytest_plugin.py: name the plugin when it is not installed."""
    from importlib import metadata

    installed = any(ep.name == "faultlab" and ep.value == "faultlab.pytest_plugin"
                    for ep in metadata.entry_points(group="pytest11"))
    return [] if installed else ["-p", "faultlab.pytest_plugin"]


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester whose runs are subprocesses that import this faultlab (and the test systems)."""
    monkeypatch.setenv("PYTHONPATH", child_environment()["PYTHONPATH"])
    return pytester


def _saved(directory: Path) -> list[Path]:
    return sorted(directory.glob("*.json")) if directory.is_dir() else []


@pytest.mark.e2e  # an exploration, its shrinking and a replay
def test_a_failing_testcase_reports_the_shrunk_finding_as_explore_does(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_outbox=MACHINES)
    result = pytester.runpytest_subprocess(*_plugin(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)  # the reference stays clean
    text = result.stdout.str()
    saved = _saved(pytester.path / "faultlab-corpus")
    assert [p.name for p in saved] == ["split-receipt-RCPT-e69c5b6711.json"], text
    # the AssertionError's message is explore's finding: FOUND line, replay table, violation
    assert "AssertionError: FOUND: RCPT at step 2, shrunk to 2 executed steps" in text
    assert "#  action" in text and "step 2: RCPT: ticket 1 (op-1) has no receipt" in text
    assert ("replay with: python -m faultlab replay "
            "faultlab-corpus/split-receipt-RCPT-e69c5b6711.json") in text
    # printed too (captured stdout), and no Hypothesis report of raw draws
    assert "Captured stdout call" in text
    assert "state = " not in text and "Falsifying example" not in text
    assert "InvariantFailure" not in text
    trace = json.loads(saved[0].read_text())
    assert trace["system"] == "split-receipt" and len(trace["steps"]) == 2
    assert trace["meta"]["found_by"] == "explore" and trace["meta"]["seed"] == 0
    # the saved finding replays as the command says (a mutant's: expected to show)
    replayed = subprocess.run(
        [sys.executable, "-m", "faultlab", "replay", str(saved[0])], capture_output=True,
        text=True, env=child_environment(), cwd=pytester.path, timeout=120, check=False)
    assert replayed.returncode == 0, replayed.stdout + replayed.stderr


@pytest.mark.e2e  # an exploration and its shrinking
def test_the_plugin_corpus_receives_the_finding_and_its_options_apply(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_outbox=MACHINES)
    mine = pytester.mkdir("mine")
    result = pytester.runpytest_subprocess(
        *_plugin(), "-p", "no:cacheprovider", "--faultlab-corpus", str(mine),
        "--faultlab-seed", "3", "test_outbox.py")
    result.assert_outcomes(passed=1, failed=1)
    saved = _saved(mine)
    assert len(saved) == 1 and saved[0].name.startswith("split-receipt-"), result.stdout.str()
    assert json.loads(saved[0].read_text())["meta"]["seed"] == 3  # --faultlab-seed applied
    assert not (pytester.path / "faultlab-corpus").exists()
    assert f"python -m faultlab replay {saved[0]}" in result.stdout.str()


def test_under_unittest_the_testcase_fails_with_the_table(tmp_path: Path) -> None:
    (tmp_path / "test_outbox.py").write_text(MACHINES)
    done = subprocess.run(
        [sys.executable, "-m", "unittest", "test_outbox"], capture_output=True, text=True,
        env=child_environment(), cwd=tmp_path, timeout=300, check=False)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED (failures=1)" in done.stderr
    assert "AssertionError: FOUND: RCPT at step 2" in done.stderr
    assert "step 2: RCPT: ticket 1 (op-1) has no receipt" in done.stderr
    assert _saved(tmp_path / "faultlab-corpus")


@pytest.mark.e2e  # the same exploration twice, explore's and the test's: tox runs it once
def test_costs_about_what_explore_costs(pytester: pytest.Pytester) -> None:
    """The same bug, the same seed: at most 3x explore's wall time (measured 1.2x), and
    exactly explore's examples (no Hypothesis shrinking on top)."""
    pytester.makepyfile(test_outbox=MACHINES.split("TestReference")[0])
    started = time.monotonic()
    explored = subprocess.run(
        [sys.executable, "-m", "faultlab", "explore", "--system", "split-receipt", "--quiet",
         "--corpus", str(pytester.path / "explored")], capture_output=True, text=True,
        env=child_environment(), cwd=pytester.path, timeout=300, check=False)
    explore_seconds = time.monotonic() - started
    assert explored.returncode == 1, explored.stdout + explored.stderr
    started = time.monotonic()
    result = pytester.runpytest_subprocess(*_plugin(), "-p", "no:cacheprovider")
    test_seconds = time.monotonic() - started
    result.assert_outcomes(failed=1)
    examples = next(line for line in explored.stdout.splitlines()
                    if line.startswith("examples ")).split()[-1]
    assert f"(seed 0, {examples} examples)" in result.stdout.str()
    assert test_seconds < 3 * explore_seconds + 5, (test_seconds, explore_seconds)


def test_a_vacuous_run_passes_with_a_warning(pytester: pytest.Pytester) -> None:
    """explore's exit 4 (nothing tested) is a warning here, not a silent pass: the
    standalone outbox whose accept prints ``accepted!`` and stores nothing (as in
    tests/test_vacuous.py)."""
    standalone = ROOT / "examples" / "standalone_outbox" / "system.json"
    data = json.loads(standalone.read_text())
    data["commands"]["accept"] = ["{python}", "-c", "print('accepted!')", "{operation_id}",
                                  "{payload}"]
    system = pytester.mkdir("system") / "system.json"
    system.write_text(json.dumps(data))
    (system.parent / "outbox.py").symlink_to(standalone.parent / "outbox.py")
    pytester.makepyfile(test_outbox=f"""
import faultlab

TestGarbage = faultlab.state_machine({str(system)!r}, examples=2, steps=2).TestCase
""")
    result = pytester.runpytest_subprocess(*_plugin(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, warnings=1)
    assert "faultlab: vacuous: nothing failed in" in result.stdout.str()


def test_a_state_machine_test_under_unittest_leaves_no_hypothesis_directory(
        tmp_path: Path) -> None:
    """Its exploration keeps Hypothesis's files private, as explore does (a .hypothesis/
    with unicode and constants caches was left where the tests ran)."""
    (tmp_path / "test_outbox.py").write_text(
        "import faultlab\n\n"
        "TestReference = faultlab.state_machine('reference', examples=2, steps=2).TestCase\n")
    done = subprocess.run([sys.executable, "-m", "unittest", "-q", "test_outbox"],
                          capture_output=True, text=True, env=child_environment(),
                          cwd=tmp_path, timeout=300, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(path.name for path in tmp_path.iterdir()
                  if path.name != "__pycache__") == ["test_outbox.py"]


LANE_MACHINES = """
import faultlab

TestEagerRescue = faultlab.state_machine("eager-rescue", concurrency=2).TestCase
TestReferenceLanes = faultlab.state_machine("reference", concurrency=2, examples=3,
                                            steps=4).TestCase
"""


@pytest.mark.e2e  # a whole exploration in lanes and its shrinking: tox runs it once
def test_a_testcase_with_lanes_reports_the_shrunk_concurrent_finding(
    pytester: pytest.Pytester,
) -> None:
    """``concurrency=2`` gives the machine of ``explore --concurrency 2``: the race mutant
    fails with its minimal interleaving (the committed corpus file's steps), saved as a
    version 2 trace; the reference with lanes passes."""
    pytester.makepyfile(test_lanes=LANE_MACHINES)
    result = pytester.runpytest_subprocess(*_plugin(), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    text = result.stdout.str()
    saved = _saved(pytester.path / "faultlab-corpus")
    assert [p.name[:len("eager-rescue-EXCL-")] for p in saved] == ["eager-rescue-EXCL-"], text
    assert "AssertionError: FOUND: EXCL" in text
    trace = json.loads(saved[0].read_text())
    # the same finding as mutants saved, under the same name (named by its steps)
    committed = json.loads((ROOT / "corpus" / saved[0].name).read_text())
    assert trace["version"] == 2 and trace["concurrency"] == 2
    assert trace["steps"] == committed["steps"] and len(trace["steps"]) == 3
    assert "TestReferenceLanes" not in text.split("short test summary")[-1]
