"""A worker that dies with an undeclared error is shown once, with its stderr.

``tests/systems_for_tests.py:DividingOutbox``'s dispatcher raises ZeroDivisionError
(a traceback, exit 70). ``suite`` once printed 40 ``FAIL:`` lines for it (47 with
another system) and never its stderr; explore's finding table showed LIVE and an exit
70 without saying why.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from faultlab.process.records import ProcessRecord
from faultlab.process.spawn import child_environment

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
DIVIDING = "systems_for_tests:DividingOutbox"


def run_cli(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, env=child_environment(), cwd=cwd, timeout=300,
                          check=False)


def test_suite_shows_the_worker_error_once_with_its_stderr() -> None:
    done = run_cli("suite", "--system", DIVIDING, "--examples", "0")
    assert done.returncode == 1, done.stdout + done.stderr
    fails = [line for line in done.stdout.splitlines() if line.startswith("FAIL:")]
    assert len(fails) == 2, done.stdout
    assert fails[0].startswith("FAIL: crash_before_dispatch: step 2: the dispatch worker (pid ")
    assert "failed with exit 70" in fails[0]
    assert done.stdout.count("ZeroDivisionError: integer division or modulo by zero") == 1
    assert "    Traceback (most recent call last):" in done.stdout
    assert "failed checks not listed" in fails[1] and "--output" in fails[1]
    assert "crash_after_downstream_commit" in fails[1]  # the other scenarios it broke


def test_explore_finding_shows_the_worker_error_and_names_the_system(tmp_path: Path) -> None:
    done = run_cli("explore", "--system", DIVIDING, "--examples", "5", "--quiet",
                   "--corpus", str(tmp_path / "corpus"))
    assert done.returncode == 1, done.stdout + done.stderr
    text = done.stdout
    assert text.count("ZeroDivisionError: integer division or modulo by zero") == 1
    assert "the dispatch worker (pid " in text and "failed with exit 70; its stderr:" in text
    # the summary names the system, then where it came from
    assert f"system                               dividing ({DIVIDING})" in text
    saved = sorted((tmp_path / "corpus").glob("*.json"))
    assert f"replay with: python -m faultlab replay {saved[0]} --system {DIVIDING}" in text
    # replay (and so pytest --faultlab-corpus) shows it too
    replayed = run_cli("replay", str(saved[0]), "--system", DIVIDING)
    assert replayed.returncode == 1, replayed.stdout + replayed.stderr
    assert replayed.stdout.count("ZeroDivisionError: integer division or modulo by zero") == 1


def test_a_state_machine_test_shows_it_too(pytester: pytest.Pytester,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", child_environment()["PYTHONPATH"])
    pytester.makepyfile(test_dividing=f"""
import faultlab

TestDividing = faultlab.state_machine({DIVIDING!r}, examples=5).TestCase
""")
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert "ZeroDivisionError: integer division or modulo by zero" in text
    assert "faultlab-corpus/dividing-LIVE-" in text and f"--system {DIVIDING}" in text


def test_the_stderr_shown_is_trimmed_and_escaped() -> None:
    from faultlab.report.tables import WORKER_STDERR_LINES, unexpected_exit, worker_stderr

    lines = [f"line {n}" for n in range(40)] + ["Boom: \x1b[2J" + "x" * 500]
    record = ProcessRecord(pid=7, exit_code=70, response=None, stdout="",
                           stderr="\n".join(lines) + "\n", elapsed=0.1)
    shown = worker_stderr(record)
    assert shown[0] == "    ... (21 earlier lines)"
    assert len(shown) == WORKER_STDERR_LINES + 1
    assert shown[-1].startswith("    Boom: \\x1b[2J") and shown[-1].endswith("...")
    assert "\x1b" not in "".join(shown) and max(map(len, shown)) <= 204
    assert unexpected_exit(record)
    # neither a SIGKILL, nor a success, nor a declared refusal is unexpected
    for code, response in ((-9, None), (0, {}), (3, {"error": "payload_conflict"})):
        assert not unexpected_exit(ProcessRecord(pid=7, exit_code=code, response=response,
                                                 stdout="", stderr="", elapsed=0.1))


def test_enumerate_concurrency_names_the_system_and_shows_the_lane_error(tmp_path: Path) -> None:
    done = run_cli("enumerate", "--system", DIVIDING, "--concurrency", "2", "--operations", "1",
                   "--crashes", "0", "--max-steps", "3", "--corpus", str(tmp_path), "--quiet")
    assert done.returncode == 1, done.stdout + done.stderr
    (saved,) = sorted(tmp_path.glob("*.json"))
    assert f"replay with: python -m faultlab replay {saved} --system {DIVIDING}" in done.stdout
    # a lane's worker error is shown as a sequential one is, here and under replay
    assert done.stdout.count("ZeroDivisionError: integer division or modulo by zero") == 1
    assert "failed with exit 70; its stderr:" in done.stdout
    replayed = run_cli("replay", str(saved), "--system", DIVIDING)
    assert replayed.stdout.count("ZeroDivisionError: integer division or modulo by zero") == 1
