"""What a newcomer stumbled over, each fixed and checked here.

Documentation that cites only the repository; documented commands that reproduce
committed corpus files byte for byte; ``init`` obeying ``--deadline``; ``{python}``
as the interpreter invoked (a real virtual environment whose workers import a
package only it has); ``faultlab init``; the scenario table when exploration
errors; and the wording of errors and counts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sqlite3
import subprocess
import sys
import time
from contextlib import closing
from pathlib import Path

import hypothesis
import pytest
import tabulate

from faultlab.process.spawn import child_environment
from faultlab.system import load_system

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
STANDALONE = ROOT / "examples" / "standalone_outbox"


def faultlab(*args: str, cwd: Path = ROOT, env: dict[str, str] | None = None,
             python: str = sys.executable) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [python, "-m", "faultlab", *args], capture_output=True, text=True,
        env=env if env is not None else child_environment(), timeout=300, check=False, cwd=cwd,
    )


def assert_refused(result: subprocess.CompletedProcess[str], *words: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    for word in words:
        assert word in result.stderr, result.stderr


# --- documentation ---------------------------------------------------------------------------


def test_the_repository_documents_the_system_itself() -> None:
    page = (ROOT / "docs" / "guide" / "own-system.md").read_text()
    for point in load_system("reference").crash_points:
        assert f"`{point.name}`" in page
    for scenario in ("crash_before_dispatch", "crash_after_downstream_commit",
                     "deduplication_disabled", "crash_during_acceptance",
                     "changed_payload_rejected"):
        assert f"`{scenario}`" in page
    readme = (ROOT / "README.md").read_text()
    assert "SPEC.md" not in readme and "docs/guide/own-system.md" in readme
    shown = faultlab("systems")
    assert shown.returncode == 0 and "SPEC.md" not in shown.stdout
    assert "docs/guide/own-system.md" in shown.stdout


# --- documented commands reproduce committed files -------------------------------------------


def _same_bytes_or_pending(produced: Path, committed: Path) -> None:
    """Byte-for-byte; a committed file from before reproducible corpora (it records a time)
    is reported as awaiting regeneration, not silently passed."""
    data = json.loads(committed.read_text())
    if "recorded" in data.get("meta", {}):
        pytest.xfail(f"{committed.relative_to(ROOT)} predates reproducible corpus files; the "
                     "integrator regenerates it with the README's command")
    _same_finding(produced, committed)


def _committed_for(produced: Path) -> Path:
    """The committed corpus file the documented command rewrites: the same name (the name
    hashes the trace's steps), or, when this Hypothesis found another trace, the one file
    of the same system and invariant, which then says which version recorded it."""
    committed = ROOT / "corpus" / produced.name
    if not committed.is_file():
        stem = produced.name.rsplit("-", 1)[0]
        matches = sorted((ROOT / "corpus").glob(f"{stem}-*.json"))
        assert len(matches) == 1, f"no committed {stem}-*.json beside {produced.name}"
        committed = matches[0]
        _same_hypothesis(committed)
        raise AssertionError(f"the committed file is {committed.name}, not {produced.name}")
    return committed


def _same_hypothesis(committed: Path) -> None:
    """A seed reproduces a run only with the Hypothesis version that recorded it (every corpus
    file names it); with another version (an older interpreter's newest release, or a newer
    release than the file's) the byte-for-byte claim does not apply, and the test says so
    rather than passing."""
    recorded = json.loads(committed.read_text()).get("meta", {}).get("hypothesis")
    if recorded != hypothesis.__version__:
        pytest.skip(f"{committed.name} was recorded with Hypothesis {recorded}; this run has "
                    f"{hypothesis.__version__}, which draws other examples from the seed: "
                    "rerun the documented command to rewrite the file")


def _same_finding(produced: Path, committed: Path) -> None:
    """The produced file is the committed one, byte for byte.

    Under another Hypothesis version than the one the committed file records, the two are
    compared with the produced file's version put back to the recorded one: most releases
    draw the same examples from a seed, and the documented command then still reproduces
    the finding, every other byte included. Only a release that found another trace skips.
    """
    ours, theirs = produced.read_bytes(), committed.read_bytes()
    recorded = json.loads(theirs)["meta"]["hypothesis"]
    if recorded != hypothesis.__version__:
        running = json.dumps(hypothesis.__version__).encode()
        assert ours.count(running) == 1, "the produced file names this run's Hypothesis once"
        ours = ours.replace(running, json.dumps(recorded).encode())
        if ours != theirs:
            _same_hypothesis(committed)
    assert ours == theirs


def test_negative_control_command_reproduces_the_committed_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    # the README's command, writing elsewhere so the comparison is honest
    result = faultlab("explore", "--no-deduplication", "--seed", "0", "--quiet",
                      "--corpus", str(corpus))
    assert result.returncode == 1, result.stdout + result.stderr
    (produced,) = corpus.iterdir()
    committed = _committed_for(produced)
    assert json.loads(produced.read_text())["meta"]["hypothesis"] == hypothesis.__version__
    _same_bytes_or_pending(produced, committed)


def test_mutants_command_reproduces_a_committed_file(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab("mutants", "--only", "no-dedup", "--jobs", "1", "--corpus", str(corpus))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "with 1 job\n" in result.stdout  # not "1 jobs"
    (produced,) = corpus.iterdir()
    _same_bytes_or_pending(produced, _committed_for(produced))


def test_examples_walkthrough_reproduces_its_committed_finding(tmp_path: Path) -> None:
    committed = list((STANDALONE / "corpus").iterdir())
    assert len(committed) == 1
    corpus = tmp_path / "corpus"
    result = faultlab("explore", "--system", "examples/standalone_outbox/system.json",
                      "--no-statement-points", "--no-deduplication", "--examples", "10",
                      "--steps", "6", "--seed", "1", "--quiet", "--corpus", str(corpus))
    assert result.returncode == 1, result.stdout + result.stderr
    (produced,) = corpus.iterdir()
    if produced.name != committed[0].name:  # another trace: only another Hypothesis may find it
        _same_hypothesis(committed[0])
    assert produced.name == committed[0].name  # the same file, not a second one beside it
    _same_finding(produced, committed[0])
    documented = (ROOT / "examples" / "README.md").read_text()
    assert "--no-deduplication --examples 10 --steps 6 --seed 1 \\\n" \
           "    --corpus examples/standalone_outbox/corpus" in documented


# --- init obeys --deadline; {python} is the interpreter as invoked ---------------------------


def _system_copy(tmp_path: Path, first_line: str = "") -> Path:
    """The standalone example in tmp_path, its program optionally importing something."""
    directory = tmp_path / "system"
    directory.mkdir()
    source = (STANDALONE / "outbox.py").read_text()
    if first_line:
        source = source.replace("from __future__ import annotations\n",
                                f"from __future__ import annotations\n\n{first_line}\n", 1)
    (directory / "outbox.py").write_text(source)
    shutil.copy(STANDALONE / "system.json", directory / "system.json")
    return directory / "system.json"


def _hanging_init(tmp_path: Path) -> Path:
    path = _system_copy(tmp_path)
    program = path.parent / "hang.sh"
    program.write_text("#!/bin/sh\nsleep 60\n")
    program.chmod(0o755)
    data = json.loads(path.read_text())
    data["commands"]["init"] = ["./hang.sh"]
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("command", [["systems"], ["suite", "--examples", "0"],
                                     ["init", "{dir}"]])
def test_a_hanging_init_obeys_deadline(command: list[str], tmp_path: Path) -> None:
    path = _hanging_init(tmp_path)
    args = [a.replace("{dir}", str(tmp_path / "stores")) for a in command]
    began = time.monotonic()
    result = faultlab(*args, "--system", str(path), "--deadline", "1")
    assert time.monotonic() - began < 10  # not the default 15 s
    assert_refused(result, "init command missed its 1s deadline")
    assert not (tmp_path / "stores").exists()


def test_python_placeholder_is_the_virtual_environments_interpreter(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    made = subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)],
                          capture_output=True, text=True, timeout=120, check=False)
    assert made.returncode == 0, made.stderr
    python = venv / "bin" / "python"
    (site,) = venv.glob("lib/python*/site-packages")
    (site / "venv_only_marker.py").write_text("MARK = 'only in this venv'\n")
    path = _system_copy(tmp_path, "import venv_only_marker  # noqa: F401  (a venv-only package)")
    # faultlab and its dependencies on PYTHONPATH; the marker only in the venv's site-packages
    paths = dict.fromkeys(str(Path(m.__file__).resolve().parent.parent)  # type: ignore[arg-type]
                          for m in (hypothesis, tabulate))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *paths])}
    base = os.path.realpath(python)
    assert base != str(python)
    # the base interpreter behind the venv's symlink cannot import the package ...
    plain = subprocess.run([base, "-c", "import venv_only_marker"], env=env,
                           capture_output=True, text=True, check=False)
    assert plain.returncode == 1 and "ModuleNotFoundError" in plain.stderr
    # ... so only {python} = the venv's own interpreter passes the five scenarios
    result = faultlab("suite", "--system", str(path), "--examples", "0", env=env,
                      python=str(python))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: 5 scenarios" in result.stdout


# --- faultlab init ---------------------------------------------------------------------------


def test_init_creates_stores_for_the_worker_command(tmp_path: Path) -> None:
    stores = tmp_path / "stores"
    result = faultlab("init", str(stores))
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in stores.iterdir()) == ["caller.sqlite", "downstream.sqlite"]
    accept = faultlab("worker", "accept", "--directory", str(stores), "--operation-id", "op-1",
                      "--payload", '{"title":"backlog"}')
    assert accept.returncode == 0, accept.stderr
    dispatch = faultlab("worker", "dispatch", "--directory", str(stores))
    assert dispatch.returncode == 0, dispatch.stderr
    assert json.loads(dispatch.stdout)["result"] == {"ticket_id": 1}
    with closing(sqlite3.connect(stores / "downstream.sqlite")) as connection:
        assert connection.execute("SELECT operation_id FROM tickets").fetchall() == [("op-1",)]
    # an existing, empty directory is fine; a non-empty one is refused and left alone
    empty = tmp_path / "empty"
    empty.mkdir()
    assert faultlab("init", str(empty), "--system", "split-accept").returncode == 0
    before = {p.name: p.read_bytes() for p in stores.iterdir()}
    assert_refused(faultlab("init", str(stores)), "not empty")
    assert {p.name: p.read_bytes() for p in stores.iterdir()} == before


def test_init_for_a_command_line_system(tmp_path: Path) -> None:
    stores = tmp_path / "stores"
    system = str(STANDALONE / "system.json")
    assert faultlab("init", str(stores), "--system", system).returncode == 0
    assert sorted(p.name for p in stores.iterdir()) == ["orders.db", "tickets.db"]
    accept = faultlab("worker", "accept", "--directory", str(stores), "--system", system,
                      "--operation-id", "op-1", "--payload", '{"title":"backlog"}')
    assert accept.returncode == 0, accept.stderr
    assert json.loads(accept.stdout)["accepted"] is True


def test_a_failing_init_leaves_nothing_and_echoes_no_control_characters(tmp_path: Path) -> None:
    path = _system_copy(tmp_path)
    program = path.parent / "garbage.sh"
    program.write_text("#!/bin/sh\nprintf '\\033[2J\\001\\377garbage' >&2\nexit 1\n")
    program.chmod(0o755)
    data = json.loads(path.read_text())
    data["commands"]["init"] = ["./garbage.sh"]
    path.write_text(json.dumps(data))
    for command in (["systems"], ["init", str(tmp_path / "stores")]):
        result = faultlab(*command, "--system", str(path))
        assert_refused(result, "init command exited 1", "\\x1b[2J\\x01\\ufffdgarbage")
        assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", result.stderr)
    assert not (tmp_path / "stores").exists()


# --- suite, explore, replay wording ----------------------------------------------------------


def test_suite_prints_the_scenarios_when_exploration_errors(tmp_path: Path) -> None:
    result = faultlab("suite", "--system", "systems_for_tests:HangsWhenExploredOutbox",
                      "--examples", "5", "--deadline", "1")
    assert result.returncode == 3, result.stdout + result.stderr
    rows = [line for line in result.stdout.splitlines() if line.endswith("PASS")]
    assert len(rows) == 5  # the scenario table, though exploration stopped
    assert "missed its 1s deadline" in result.stderr
    assert "PASS: 5 scenarios" not in result.stdout


def test_errors_name_the_program_once() -> None:
    result = faultlab("explore", "--bogus")
    assert_refused(result, "unrecognized arguments: --bogus")
    assert result.stderr.startswith("faultlab: error: ") and "faultlab: error: faultlab" \
        not in result.stderr
    result = faultlab("explore", "--examples", "zero")
    assert_refused(result, "faultlab: error: explore: argument --examples")


def test_counts_read_as_english(tmp_path: Path) -> None:
    trace = next((ROOT / "corpus").glob("split-accept-ATOM-*.json"))
    result = faultlab("replay", str(trace))
    assert result.returncode == 0
    assert result.stdout.splitlines()[-1] == "1 trace replayed; every outcome matches"
    explored = faultlab("explore", "--examples", "5", "--quiet", "--corpus", str(tmp_path))
    assert explored.returncode == 0
    # crash points fired are counted once, in the coverage table, not also in the summary
    summary = explored.stdout.split("\n\n")[0]
    assert "crash point" not in summary
    assert explored.stdout.count("before_dispatch") == 1


def test_a_missing_result_is_said_plainly() -> None:
    result = faultlab("suite", "--system", "complete-before-send", "--examples", "0")
    assert result.returncode == 1
    assert "the recovering dispatcher answered no result" in result.stdout
    assert "None differs" not in result.stdout and "differs from the recovered None" \
        not in result.stdout
