"""A run that tested nothing is not clean: explore's "vacuous" outcome, exit status 4.

A command-line system whose accept prints ``accepted!`` (not JSON) and stores nothing
once explored as ``clean: no invariant failed in 123 examples``, exit 0. These tests run
such systems for real (real processes on fresh SQLite stores) and check that explore,
``--concurrency`` and the Python API say what was not tested, and that the reference is
not blamed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from conftest import ROOT

from faultlab.base.errors import EXIT_FOUND, EXIT_OK, EXIT_RUN_FAILED, EXIT_USAGE, EXIT_VACUOUS
from faultlab.search.coverage import Coverage, vacuity
from faultlab.system import load_system

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

STANDALONE = ROOT / "examples" / "standalone_outbox" / "system.json"


def faultlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def garbage_accept(tmp_path: Path, output: str = "accepted!") -> Path:
    """The standalone outbox, but its accept prints ``output`` and stores nothing."""
    data = json.loads(STANDALONE.read_text())
    data["commands"]["accept"] = ["{python}", "-c", f"print({output!r})", "{operation_id}",
                                  "{payload}"]
    system = tmp_path / "system" / "system.json"
    system.parent.mkdir()
    system.write_text(json.dumps(data))
    (system.parent / "outbox.py").symlink_to(STANDALONE.parent / "outbox.py")
    return system


def test_the_exit_statuses_are_distinct() -> None:
    assert len({EXIT_OK, EXIT_FOUND, EXIT_USAGE, EXIT_RUN_FAILED, EXIT_VACUOUS}) == 5
    assert EXIT_VACUOUS == 4


@pytest.mark.parametrize("output", ["accepted!", "\x01garbage{"])
def test_an_accept_that_stores_nothing_is_vacuous_not_clean(tmp_path: Path,
                                                            output: str) -> None:
    system = garbage_accept(tmp_path, output)
    corpus = tmp_path / "corpus"
    done = faultlab("explore", "--system", str(system), "--examples", "6", "--steps", "4",
                    "--corpus", str(corpus), "--quiet")
    assert done.returncode == EXIT_VACUOUS, done.stdout + done.stderr
    assert "clean:" not in done.stdout
    verdicts = [line for line in done.stdout.splitlines() if line.startswith("vacuous:")]
    assert len(verdicts) == 1, done.stdout
    assert "no operation was ever accepted" in verdicts[0]
    assert "no declared crash point ever fired" in verdicts[0]
    assert not corpus.exists()  # nothing found, nothing saved


def test_the_api_does_not_call_a_vacuous_run_clean(tmp_path: Path) -> None:
    import faultlab as api

    outcome = api.explore(garbage_accept(tmp_path), examples=4, steps=3)
    assert outcome.clean is False and outcome.trace is None
    assert any("no operation was ever accepted" in note for note in outcome.notes)


def test_concurrency_on_workers_that_never_overlap_says_so(tmp_path: Path) -> None:
    """The standalone outbox arms crash points by argument: it announces none, so a
    started lane runs to its end and --concurrency 2 runs one worker at a time."""
    done = faultlab("explore", "--system", str(STANDALONE), "--concurrency", "2",
                    "--examples", "3", "--steps", "4", "--corpus", str(tmp_path / "c"),
                    "--quiet")
    assert done.returncode == EXIT_VACUOUS, done.stdout + done.stderr
    verdict = [line for line in done.stdout.splitlines() if line.startswith("vacuous:")]
    assert len(verdict) == 1 and "workers never overlapped" in verdict[0], done.stdout
    assert "no operation was ever accepted" not in verdict[0]


def test_the_reference_is_not_vacuous(tmp_path: Path) -> None:
    done = faultlab("explore", "--examples", "8", "--seed", "0", "--corpus",
                    str(tmp_path / "c"), "--quiet")
    assert done.returncode == EXIT_OK, done.stdout + done.stderr
    assert "clean: no invariant failed" in done.stdout and "\nvacuous:" not in done.stdout
    done = faultlab("explore", "--concurrency", "2", "--examples", "5", "--seed", "0",
                    "--corpus", str(tmp_path / "c"), "--quiet")
    assert done.returncode == EXIT_OK, done.stdout + done.stderr


def test_the_rules() -> None:
    """Each family of invariants and the crash points, on counters (no processes)."""
    reference = load_system("reference")
    everything = Counter({name: 1 for name in ("ATOM", "PAIR", "ACK", "ONE", "RCPT", "KEY",
                                               "PAY", "DONE", "QUIET", "LIVE")})
    fired = Counter({"during_accept": 1})
    assert vacuity(Coverage(Counter(fired), Counter(fired), everything), reference, 3) is None
    # too short to arm any point: not blamed
    assert vacuity(Coverage(checked=everything), reference, 1) is None
    armed_only = vacuity(Coverage(armed=Counter(fired), checked=everything), reference, 3)
    assert armed_only == "no declared crash point ever fired (armed 1 times)"
    no_tickets = everything - Counter({"ONE": 1, "RCPT": 1, "KEY": 1, "PAY": 1, "DONE": 1})
    found = vacuity(Coverage(Counter(fired), Counter(fired), no_tickets), reference, 3)
    assert found == "no ticket was ever made downstream; no operation was ever complete"
    assert vacuity(Coverage(), reference, 0) == "no example completed"
    covered = Coverage(Counter(fired), Counter(fired), everything)
    assert vacuity(covered, reference, 3, concurrency=2, held=2) is None
    assert "never overlapped" in (vacuity(covered, reference, 3, concurrency=2,
                                          can_hold=False) or "")
    # sequentially, workers never overlap by design: not blamed for it
    assert vacuity(covered, reference, 3, can_hold=False) is None
    # a system that can hold lanes and, in a short run, happened to hold none: not blamed
    assert vacuity(covered, reference, 3, concurrency=2, can_hold=True) is None
    # with lanes too, declared points armed and never fired are blamed
    lanes_armed_only = vacuity(Coverage(armed=Counter(fired), checked=everything), reference,
                               3, concurrency=2, held=2)
    assert lanes_armed_only == "no declared crash point ever fired (armed 1 times)"
    assert load_system("reference").holds_in_lanes()


def test_power_rule() -> None:
    """Asked to cut the power (``faults``), a run that never did (OPEN and DURABLE never
    checked) is vacuous; one that did, or a run not asked to, is not blamed."""
    reference = load_system("reference")
    everything = Counter({name: 1 for name in ("ATOM", "PAIR", "ACK", "ONE", "RCPT", "KEY",
                                               "PAY", "DONE", "QUIET", "LIVE")})
    fired = Counter({"during_accept": 1})
    uncut = Coverage(Counter(fired), Counter(fired), everything)
    assert vacuity(uncut, reference, 3) is None
    assert vacuity(uncut, reference, 3, faults=("power",)) == (
        "no power cut was ever taken (OPEN and DURABLE never had anything to check)")
    cut = Coverage(Counter(fired), Counter(fired), everything + Counter({"OPEN": 1}))
    assert vacuity(cut, reference, 3, faults=("power",)) is None
    nothing = vacuity(Coverage(), reference, 3, faults=("power",)) or ""
    assert nothing.startswith("no operation was ever accepted") and "no power cut" in nothing


def _one_verdict(done: subprocess.CompletedProcess[str]) -> str:
    """The run's one verdict line (stdout), nothing on stderr (--quiet), never clean."""
    assert done.stderr == "", done.stderr
    assert "clean:" not in done.stdout, done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("vacuous:")]
    return line


def test_explore_power_loss_without_a_power_cut_is_vacuous(tmp_path: Path) -> None:
    """One example of two steps draws no power cut: it was once ``clean``, exit 0, with
    OPEN and DURABLE checked 0 times."""
    corpus = tmp_path / "c"
    done = faultlab("explore", "--power-loss", "--examples", "1", "--steps", "2",
                    "--corpus", str(corpus), "--quiet")
    assert done.returncode == EXIT_VACUOUS, done.stdout + done.stderr
    line = _one_verdict(done)
    assert line == ("vacuous: nothing failed in 1 examples, but nothing was tested: no power "
                    "cut was ever taken (OPEN and DURABLE never had anything to check)"), line
    assert not corpus.exists()


def test_enumerate_power_loss_without_a_power_cut_is_vacuous(tmp_path: Path) -> None:
    """``--crashes 0`` leaves no budget for a power cut: 15 traces, none cut (with a crash's
    budget the same run cuts the power and stays clean: tests/test_enumerate_power.py)."""
    corpus = tmp_path / "c"
    done = faultlab("enumerate", "--power-loss", "--crashes", "0", "--operations", "1",
                    "--corpus", str(corpus), "--quiet")
    assert done.returncode == EXIT_VACUOUS, done.stdout + done.stderr
    line = _one_verdict(done)
    assert line.startswith("vacuous: nothing failed in "), line
    assert line.endswith("traces, but nothing was tested: no power cut was ever taken (OPEN "
                         "and DURABLE never had anything to check)"), line
    assert not corpus.exists()


def test_explore_help_lists_exit_status_4() -> None:
    done = faultlab("explore", "--help")
    statuses = done.stdout.split("exit status:")[1]
    assert "  4        vacuous" in statuses


def test_enumerate_over_an_accept_that_stores_nothing_is_vacuous(tmp_path: Path) -> None:
    system = garbage_accept(tmp_path)
    done = faultlab("enumerate", "--system", str(system), "--operations", "1", "--crashes",
                    "0", "--corpus", str(tmp_path / "corpus"), "--quiet")
    assert done.returncode == EXIT_VACUOUS, done.stdout + done.stderr
    assert "clean:" not in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("vacuous:")]
    assert "no operation was ever accepted" in line, line
    control = faultlab("enumerate", "--system", str(STANDALONE), "--operations", "1",
                       "--crashes", "0", "--corpus", str(tmp_path / "corpus"), "--quiet")
    assert control.returncode == EXIT_OK, control.stdout + control.stderr
    assert "clean: no invariant failed" in control.stdout


def test_concurrent_enumerate_over_an_accept_that_stores_nothing_is_vacuous(
        tmp_path: Path) -> None:
    """Nothing accepted, so faultlab delivers nothing directly either (it once delivered
    op-1 anyway, and KEY blamed the system for faultlab's own delivery)."""
    system = garbage_accept(tmp_path)
    corpus = tmp_path / "corpus"
    done = faultlab("enumerate", "--system", str(system), "--concurrency", "2", "--corpus",
                    str(corpus), "--quiet")
    assert done.returncode == EXIT_VACUOUS, done.stdout + done.stderr
    assert "FOUND" not in done.stdout and not corpus.exists()
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("vacuous:")]
    assert "no operation was ever accepted" in line and "never overlapped" in line, line
