"""A failure that does not fail again when re-run is "flaky": exit 5, never a finding, never
clean.

The system's receiver forgets its receipts once, while a file outside the run's stores
exists (``systems_for_tests:OnceForgetfulOutbox``): the example that saw it fails an
invariant, and neither Hypothesis's re-run nor faultlab's replay of its trace fails again.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import TESTS

from faultlab.base.errors import EXIT_FLAKY

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

pytest_plugins = ["pytester"]

SYSTEM = "systems_for_tests:OnceForgetfulOutbox"


def run(cwd: Path, flag: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(TESTS), *filter(None, [os.environ.get("PYTHONPATH")])]),
        "FAULTLAB_TEST_ONCE_FLAG": str(flag)}
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("concurrency", ["1", "2"])
def test_a_failure_that_does_not_fail_again_is_flaky_not_clean(
    tmp_path: Path, concurrency: str,
) -> None:
    flag = tmp_path / "forget-once"
    flag.touch()
    corpus = tmp_path / "corpus"
    done = run(tmp_path, flag, "explore", "--system", SYSTEM, "--concurrency", concurrency,
               "--examples", "100", "--seed", "0", "--quiet", "--corpus", str(corpus))
    output = done.stdout + done.stderr
    assert not flag.exists(), output  # the receiver did forget once
    assert done.returncode == EXIT_FLAKY, output
    assert "clean:" not in done.stdout and "FOUND" not in done.stdout, output
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("flaky: ")]
    assert "but did not fail again when re-run" in line, line
    assert not list(corpus.rglob("*.json")) if corpus.exists() else True  # nothing saved
    kept = Path(line.rsplit("trace kept at ", 1)[1])
    kept = kept if kept.is_absolute() else tmp_path / kept
    assert kept.is_file() and kept.parent == tmp_path / "flaky", (line, kept)
    assert corpus not in kept.parents
    data = json.loads(kept.read_text())
    assert data["expect"] == "flaky" and not data["expected"]["clean"]
    rows = {row.rsplit(None, 1)[0].strip(): row.rsplit(None, 1)[1]
            for row in done.stdout.splitlines() if len(row.rsplit(None, 1)) == 2}
    assert rows.get("flaky") == "1", done.stdout

    # replayed, the kept trace is no regression test: clean is not "fixed", it is flaky
    replayed = run(tmp_path, flag, "replay", str(kept), "--system", SYSTEM)
    assert replayed.returncode == EXIT_FLAKY, replayed.stdout + replayed.stderr
    assert "flaky" in replayed.stdout and "every outcome matches" not in replayed.stdout



def test_a_flaky_job_under_jobs_is_flaky_not_clean(tmp_path: Path) -> None:
    """With --jobs 2 exactly one job takes the flag (one file, deleted once): its failure
    stops the other job as a finding would, and the run is flaky (exit 5), its trace kept,
    counted once in the summary, never clean and never a finding."""
    flag = tmp_path / "forget-once"
    flag.touch()
    corpus = tmp_path / "corpus"
    done = run(tmp_path, flag, "explore", "--system", SYSTEM, "--jobs", "2",
               "--examples", "200", "--seed", "0", "--quiet", "--corpus", str(corpus))
    output = done.stdout + done.stderr
    assert not flag.exists(), output
    assert done.returncode == EXIT_FLAKY, output
    assert "clean:" not in done.stdout and "FOUND" not in done.stdout, output
    flaky_lines = [line for line in done.stdout.splitlines() if line.startswith("flaky: ")]
    assert len(flaky_lines) == 1 and "another job" not in done.stdout, output
    kept = Path(flaky_lines[0].rsplit("trace kept at ", 1)[1])
    kept = kept if kept.is_absolute() else tmp_path / kept
    assert kept.is_file() and json.loads(kept.read_text())["expect"] == "flaky"
    assert not corpus.exists() or not list(corpus.rglob("*.json"))
    rows = {row.rsplit(None, 1)[0].strip(): row.rsplit(None, 1)[1]
            for row in done.stdout.splitlines() if len(row.rsplit(None, 1)) == 2}
    assert rows.get("flaky") == "1" and rows.get("jobs") == "2", done.stdout

def test_the_api_outcome_says_flaky(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import faultlab

    flag = tmp_path / "forget-once"
    flag.touch()
    monkeypatch.setenv("FAULTLAB_TEST_ONCE_FLAG", str(flag))  # read by the fork server's workers
    corpus = tmp_path / "corpus"
    outcome = faultlab.explore(SYSTEM, examples=100, seed=0, corpus=corpus)
    assert not flag.exists()
    assert outcome.flaky and not outcome.clean and not outcome
    assert outcome.path is None and not list(tmp_path.rglob("*.json"))
    assert outcome.trace is not None and outcome.trace.expect == "flaky"
    assert any("did not fail again" in note for note in outcome.notes), outcome.notes


def test_the_kept_trace_is_never_in_the_corpus(tmp_path: Path) -> None:
    from faultlab.corpus.files import flaky_directory

    assert flaky_directory("corpus") == Path("flaky")
    assert flaky_directory(str(tmp_path / "results" / "corpus")) == tmp_path / "results" / "flaky"
    assert flaky_directory("redis://localhost:6379/0") == Path("flaky")
    for corpus in (tmp_path / "flaky", tmp_path):  # a corpus named flaky/, or the directory
        kept = flaky_directory(str(corpus))
        assert kept.resolve() != corpus.resolve() and corpus.resolve() not in kept.parents


def test_the_pytest_plugin_skips_a_flaky_trace(pytester: pytest.Pytester,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Even in a corpus directory, a kept flaky trace is no regression test."""
    from faultlab.process.spawn import child_environment

    monkeypatch.setenv("PYTHONPATH", child_environment()["PYTHONPATH"])
    source = next((TESTS.parent / "corpus").glob("reference-nodedup-ONE-*.json"))
    corpus = pytester.mkdir("mine")
    (corpus / "kept.json").write_text(json.dumps({**json.loads(source.read_text()),
                                                  "expect": "flaky"}))
    from importlib import metadata

    installed = any(ep.name == "faultlab" and ep.value == "faultlab.pytest_plugin"
                    for ep in metadata.entry_points(group="pytest11"))
    plugin = [] if installed else ["-p", "faultlab.pytest_plugin"]
    result = pytester.runpytest_subprocess(*plugin, "--faultlab-corpus", str(corpus), "-rs")
    result.assert_outcomes(skipped=1)
    assert "a flaky trace" in result.stdout.str()


def test_flaky_has_an_exit_status_of_its_own() -> None:
    from faultlab.base import errors

    statuses = {errors.EXIT_OK, errors.EXIT_FOUND, errors.EXIT_USAGE, errors.EXIT_RUN_FAILED,
                errors.EXIT_VACUOUS, errors.EXIT_FLAKY}
    assert len(statuses) == 6 and EXIT_FLAKY == 5


def test_an_enumerated_failure_fresh_stores_do_not_show_is_flaky(tmp_path: Path) -> None:
    """enumerate confirms each violating trace on fresh stores: one that passes there was
    once reported as exit 1 with nothing saved (a finding no file could reproduce)."""
    flag = tmp_path / "once"
    flag.touch()
    done = run(tmp_path, flag, "enumerate", "--system", SYSTEM, "--operations", "1",
               "--crashes", "1", "--jobs", "1", "--quiet", "--corpus", str(tmp_path / "corpus"))
    assert done.returncode == EXIT_FLAKY, done.stdout + done.stderr
    assert not flag.exists()  # the control: the receiver did forget once
    assert "FOUND" not in done.stdout and "clean:" not in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("flaky: ")]
    kept = Path(line.rsplit("trace kept at ", 1)[1])
    assert kept.parent == tmp_path / "flaky" and not (tmp_path / "corpus").exists(), line
    data = json.loads(kept.read_text())
    assert data["expect"] == "flaky" and data["meta"]["found_by"] == "enumerate"
    assert data["meta"]["replayed"] == {"clean": True}
    replayed = run(tmp_path, flag, "replay", str(kept), "--system", SYSTEM)
    assert replayed.returncode == EXIT_FLAKY, replayed.stdout + replayed.stderr


def test_a_concurrent_enumerated_failure_fresh_stores_do_not_show_is_flaky(
        tmp_path: Path) -> None:
    """enumerate --concurrency 2 once printed a note and exited 0 (clean) for this."""
    flag = tmp_path / "once"
    flag.touch()
    done = run(tmp_path, flag, "enumerate", "--system", SYSTEM, "--concurrency", "2",
               "--quiet", "--corpus", str(tmp_path / "corpus"))
    assert done.returncode == EXIT_FLAKY, done.stdout + done.stderr
    assert not flag.exists()
    assert "FOUND" not in done.stdout and "clean:" not in done.stdout
    (line,) = [line for line in done.stdout.splitlines() if line.startswith("flaky: ")]
    kept = Path(line.rsplit("trace kept at ", 1)[1])
    assert kept.parent == tmp_path / "flaky" and not (tmp_path / "corpus").exists(), line
    data = json.loads(kept.read_text())
    assert data["expect"] == "flaky" and data["concurrency"] == 2, data
