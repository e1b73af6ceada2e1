"""A trace file is data: replaying one runs only systems the user named.

A system file's ``init`` runs when the file is loaded (the probe), and
``package.module:attribute`` imports a module: so ``replay``, the pytest plugin
and :func:`faultlab.replay` run a trace's system only when it is built in, named
(``--system``, ``--faultlab-system``, ``system=``) or mapped in the trace's project
(``[tool.faultlab.systems]``). A saved finding is a regression test unless it
says ``"expect": "finding"``. Every system here is real: a copy of the
standalone example's program, its workers real processes on real SQLite files.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import hypothesis
import pytest

from faultlab.process.spawn import child_environment

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "standalone_outbox"
CORPUS = ROOT / "corpus"

#: Runs the example's init, and first leaves a mark: the proof that init ran.
MARKED_INIT = """\
import os, runpy, sys
here = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(here, "init-ran"), "a") as mark:
    mark.write(sys.argv[1] + "\\n")
sys.argv = [os.path.join(here, "outbox.py"), "init", "--dir", sys.argv[1]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

#: A module that leaves a mark when imported.
MARKED_MODULE = """\
import pathlib
pathlib.Path(__file__).with_name("imported").write_text("yes")
from faultlab.system.builtin.reference import ReferenceOutbox
SYSTEM = ReferenceOutbox()
"""

#: The plugin, by entry point under tox, by name from a checkout (see test_pytest_plugin.py).
try:
    from importlib import metadata

    PLUGIN = [] if any(ep.value == "faultlab.pytest_plugin"
                       for ep in metadata.entry_points(group="pytest11")) \
        else ["-p", "faultlab.pytest_plugin"]
except Exception:  # pragma: no cover
    PLUGIN = ["-p", "faultlab.pytest_plugin"]


def faultlab(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], capture_output=True,
                          text=True, env=child_environment(), cwd=cwd, timeout=240,
                          check=False)


def pytest_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pytest", *PLUGIN, "-p", "no:cacheprovider",
                           *args], capture_output=True, text=True, env=child_environment(),
                          cwd=cwd, timeout=240, check=False)


def command_system(directory: Path, *, receipts: bool = True) -> Path:
    """The standalone example, copied, its init marked; ``receipts=False`` is a real bug
    in the description (it reads no receipt, so every ticket lacks one: RCPT)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLE / "outbox.py", directory / "outbox.py")
    (directory / "marked_init.py").write_text(MARKED_INIT)
    data = json.loads((EXAMPLE / "system.json").read_text())
    data["commands"]["init"] = ["{python}", "{system_dir}/marked_init.py", "{directory}"]
    if not receipts:
        query = data["snapshot"]["receipts"]["query"]
        data["snapshot"]["receipts"]["query"] = f"{query} WHERE 0"
    path = directory / "system.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def trace_naming(system: str, *, expect: bool = False) -> dict[str, object]:
    """The negative control's trace (a finding), recorded as on ``system``."""
    source = json.loads(next(CORPUS.glob("reference-nodedup-ONE-*.json")).read_text())
    source["system"] = system
    if not expect:
        source.pop("expect", None)
    return source


# --- 1. nothing runs that the user did not name -----------------------------------------------


def test_a_trace_naming_a_system_file_runs_nothing(tmp_path: Path) -> None:
    command_system(tmp_path)
    (tmp_path / "corpus").mkdir()
    trace = tmp_path / "corpus" / "x.json"
    trace.write_text(json.dumps(trace_naming("system.json")))
    before = sorted(p.name for p in tmp_path.rglob("*"))
    done = faultlab("replay", "corpus/x.json", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == ""
    (line,) = done.stderr.splitlines()
    assert "corpus/x.json: the trace names system 'system.json', which is not built in; " \
           "name it: faultlab replay corpus/x.json --system path/to/system.json" in line
    assert not (tmp_path / "init-ran").exists()  # the probe never ran init
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_a_trace_naming_a_module_imports_nothing(tmp_path: Path) -> None:
    (tmp_path / "marked_module.py").write_text(MARKED_MODULE)
    trace = tmp_path / "x.json"
    trace.write_text(json.dumps(trace_naming("marked_module:SYSTEM")))
    done = faultlab("replay", "x.json", cwd=tmp_path)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "--system package.module:attribute" in done.stderr
    assert not (tmp_path / "imported").exists()
    # named on the command line, it runs (and the finding shows as recorded)
    named = faultlab("replay", "x.json", "--system", "marked_module:SYSTEM", cwd=tmp_path)
    assert (tmp_path / "imported").exists()
    assert "verdict: ONE+DONE at step 3" in named.stdout, named.stdout + named.stderr


def test_the_python_api_and_the_cli_share_the_rule(tmp_path: Path) -> None:
    import faultlab as api
    from faultlab.base.errors import UsageError

    command_system(tmp_path)
    trace = tmp_path / "x.json"
    trace.write_text(json.dumps(trace_naming("system.json")))
    with pytest.raises(UsageError, match="name it: faultlab.replay"):
        api.replay(trace)
    assert not (tmp_path / "init-ran").exists()


def test_the_plugin_runs_nothing_unnamed_and_the_named_system(tmp_path: Path) -> None:
    system = command_system(tmp_path / "sut")
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "x.json").write_text(json.dumps(trace_naming("system.json", expect=True)))
    refused = pytest_run("--faultlab-corpus", str(corpus), cwd=tmp_path)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    assert "which is not built in; name it: pytest --faultlab-corpus" in refused.stdout
    assert "--faultlab-system path/to/system.json" in refused.stdout
    assert not (tmp_path / "sut" / "init-ran").exists()
    named = pytest_run("--faultlab-corpus", str(corpus), "--faultlab-system", str(system),
                       cwd=tmp_path)
    assert named.returncode == 0, named.stdout + named.stderr
    assert "1 passed" in named.stdout


def test_the_project_maps_a_recorded_name_from_any_directory(tmp_path: Path) -> None:
    project = tmp_path / "project"
    command_system(project / "sut")
    (project / "pyproject.toml").write_text(
        '[project]\nname = "mine"\n\n[tool.faultlab.systems]\n"system.json" = "sut/system.json"\n')
    (project / "corpus").mkdir()
    trace = project / "corpus" / "x.json"
    trace.write_text(json.dumps(trace_naming("system.json", expect=True)))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = faultlab("replay", str(trace), cwd=elsewhere)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "expected ONE+DONE at step 3: matches" in done.stdout
    plugin = pytest_run("--faultlab-corpus", str(project / "corpus"), cwd=elsewhere)
    assert plugin.returncode == 0, plugin.stdout + plugin.stderr
    # a table that is not a table of names is one line, exit 2
    (project / "pyproject.toml").write_text('[tool.faultlab]\nsystems = ["sut/system.json"]\n')
    bad = faultlab("replay", str(trace), cwd=elsewhere)
    assert bad.returncode == 2 and "[tool.faultlab.systems] must map" in bad.stderr


def test_system_and_against_together_are_refused(tmp_path: Path) -> None:
    trace = tmp_path / "x.json"
    trace.write_text(json.dumps(trace_naming("reference", expect=True)))
    done = faultlab("replay", str(trace), "--system", "reference", "--against", "reference",
                    cwd=tmp_path)
    assert done.returncode == 2 and "give one of them" in done.stderr


# --- 2 and 3. explored in one directory, replayed from another; a regression test ------------


def test_a_finding_explored_here_is_a_regression_test_replayed_from_elsewhere(
    tmp_path: Path,
) -> None:
    """explore a (buggy) command-line system from its directory, then replay the saved
    trace, which records "system.json" as typed there, from another directory with
    --system: it still fails while the bug is there and passes once it is fixed."""
    here = tmp_path / "here"
    command_system(here, receipts=False)
    explored = faultlab("explore", "--system", "system.json", "--no-statement-points",
                        "--examples", "10", "--steps", "3", "--seed", "0", "--quiet",
                        "--corpus", "corpus", cwd=here)
    assert explored.returncode == 1, explored.stdout + explored.stderr
    (saved,) = (here / "corpus").glob("*.json")
    data = json.loads(saved.read_text())
    assert data["system"] == "system.json" and "expect" not in data  # a regression test
    assert "replay with: python -m faultlab replay corpus/" in explored.stdout
    assert explored.stdout.rstrip().endswith("--system system.json")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    broken = faultlab("replay", str(saved), "--system", str(here / "system.json"),
                      cwd=elsewhere)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"{saved}: still fails: fix the bug, then replay again; it passes once fixed" \
        in broken.stdout.splitlines()
    fixed_dir = tmp_path / "fixed"
    command_system(fixed_dir)
    fixed = faultlab("replay", str(saved), "--system", "../fixed/system.json", cwd=elsewhere)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    assert "1 trace replayed; every outcome matches" in fixed.stdout
    # the plugin judges it the same way
    corpus = str(here / "corpus")
    assert pytest_run("--faultlab-corpus", corpus, "--faultlab-system",
                      str(here / "system.json"), cwd=elsewhere).returncode == 1
    assert pytest_run("--faultlab-corpus", corpus, "--faultlab-system",
                      str(fixed_dir / "system.json"), cwd=elsewhere).returncode == 0


def test_a_regression_trace_of_a_built_in_fails_until_fixed(tmp_path: Path) -> None:
    """The same finding without "expect": fails on the broken variant, passes on the fix."""
    trace = json.loads(next(CORPUS.glob("no-dedup-RCPT-*.json")).read_text())
    assert trace["expect"] == "finding"
    regression = {key: value for key, value in trace.items() if key != "expect"}
    path = tmp_path / "regression.json"
    path.write_text(json.dumps(regression))
    still = faultlab("replay", str(path), cwd=tmp_path)
    assert still.returncode == 1, still.stdout + still.stderr
    assert "STILL FAILS" in still.stdout
    assert f"{path}: still fails: fix the bug, then replay again; it passes once fixed" \
        in still.stdout
    fixed_path = tmp_path / "fixed.json"
    fixed_path.write_text(json.dumps({**regression, "system": "reference"}))
    fixed = faultlab("replay", str(fixed_path), cwd=tmp_path)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    shutil.copy(path, corpus / "regression.json")
    plugin = pytest_run("--faultlab-corpus", str(corpus), cwd=tmp_path)
    assert plugin.returncode == 1 and "still fails: fix the bug" in plugin.stdout


def test_an_unknown_expect_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    path.write_text(json.dumps({**trace_naming("reference"), "expect": "clean"}))
    done = faultlab("replay", str(path), cwd=tmp_path)
    assert done.returncode == 2 and "trace 'expect' must be 'finding'" in done.stderr


def test_the_committed_corpus_is_marked_and_the_zoo_writes_the_same_bytes(
    tmp_path: Path,
) -> None:
    """Every committed trace is an expected finding; mutants writes it byte for byte."""
    for path in [*CORPUS.glob("*.json"), *(ROOT / "tests" / "traces").glob("*.json"),
                 *(EXAMPLE / "corpus").glob("*.json")]:
        assert json.loads(path.read_text()).get("expect") == "finding", path
    done = faultlab("mutants", "--only", "split-accept", "--corpus", str(tmp_path), "--jobs",
                    "1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (written,) = tmp_path.glob("*.json")
    committed = (CORPUS / written.name).read_bytes()
    recorded = json.loads(committed)["meta"]["hypothesis"]
    if recorded != hypothesis.__version__:
        # another Hypothesis (an older interpreter gets an older release) names itself
        # in the file: every other byte must still be the same
        committed = committed.replace(f'"hypothesis": "{recorded}"'.encode(),
                                      f'"hypothesis": "{hypothesis.__version__}"'.encode())
    assert written.read_bytes() == committed


# --- 5. run directories named after the pid; no .hypothesis/ in the user's directory ----------


def test_the_probe_directory_is_named_after_the_pid(tmp_path: Path) -> None:
    from faultlab.system.command import load_command_system

    path = command_system(tmp_path)
    load_command_system(str(path))
    (probed,) = (tmp_path / "init-ran").read_text().splitlines()
    assert Path(probed).name.startswith(f"faultlab-probe-{os.getpid()}-")
    assert not Path(probed).exists()


def test_explore_leaves_no_hypothesis_directory_behind(tmp_path: Path) -> None:
    """Nothing in the current directory (no .hypothesis/), and its private directory
    (named after its pid) removed at the end."""
    run = subprocess.Popen([sys.executable, "-m", "faultlab", "explore", "--examples", "3",
                            "--steps", "3", "--quiet", "--corpus", str(tmp_path / "corpus")],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           env=child_environment(), cwd=tmp_path)
    out, err = run.communicate(timeout=240)
    assert run.returncode == 0, out + err
    assert list(tmp_path.iterdir()) == []
    temporary = Path(os.environ.get("TMPDIR", "/tmp"))
    assert list(temporary.glob(f"faultlab-hypothesis-{run.pid}-*")) == []


def test_the_python_api_leaves_no_hypothesis_directory_behind(tmp_path: Path) -> None:
    """``faultlab.explore`` from a program keeps Hypothesis's files out of the caller's
    directory as the command line does (no .hypothesis/ with its Unicode map)."""
    program = ("import faultlab\n"
               "found = faultlab.explore('no-dedup', examples=20, seed=0)\n"
               "print(found.clean, len(found.trace.steps))\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env=child_environment(), cwd=tmp_path, timeout=240, check=False)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == ["False", "2"]
    assert list(tmp_path.iterdir()) == []
