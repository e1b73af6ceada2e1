"""An output option replaces only faultlab's own earlier output of that kind.

``suite --output``, ``mutants --output``, ``replay --html`` and ``explore --html`` once
replaced any file at their path (exit 0): a README became JSON, a Python file a table of
mutants, the very trace being replayed an HTML page. Now an existing file is replaced
only when it is recognisably what that option writes (the suite's evidence file, the
mutants' results, a faultlab HTML page); anything else (another project's file, a trace,
faultlab's output of another kind, an empty file) is one line, exit 2, before any work
starts, with nothing created, changed or deleted. The checks are no ``assert``: ``python
-O`` refuses the same way.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from faultlab.base.errors import ExecutionError
from faultlab.base.output import write_json
from faultlab.process.spawn import child_environment

#: Every test but the last runs faultlab's commands as processes: end to end (run once, in
#: tox's e2e environment, not under every interpreter).
e2e = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT / "corpus" / "no-dedup-RCPT-baa0069205.json"
SUITE_RESULTS = ROOT / "results" / "results.json"
MUTANTS_RESULTS = ROOT / "results" / "mutants.json"

Argv = Callable[[str, Path], list[str]]

#: option -> (the command line writing ``out`` with scratch space ``work``, the option, the
#: kind the refusal names, the exit status of a run that writes)
COMMANDS: dict[str, tuple[Argv, str, str, int]] = {
    "suite --output": (
        lambda out, work: ["suite", "--examples", "0", "--output", out],
        "--output", "a faultlab suite evidence file", 0),
    "mutants --output": (
        lambda out, work: ["mutants", "--only", "no-dedup", "--examples", "5", "--steps", "3",
                           "--operations", "1", "--crashes", "0", "--jobs", "1",
                           "--corpus", str(work / "corpus"), "--output", out],
        "--output", "a faultlab mutants results file", 0),
    "replay --html": (
        lambda out, work: ["replay", str(TRACE), "--html", out],
        "--html", "a faultlab HTML page", 0),
    "explore --html": (
        lambda out, work: ["explore", "--system", "no-dedup", "--examples", "20", "--steps", "3",
                           "--quiet", "--corpus", str(work / "corpus"), "--html", out],
        "--html", "a faultlab HTML page", 1),  # no-dedup is found: exit 1, the page written
}


def faultlab(*args: str, cwd: Path, optimise: bool = False) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *(["-O"] if optimise else []), "-m", "faultlab", *args],
        capture_output=True, text=True, env=child_environment(), timeout=300, check=False,
        cwd=cwd,
    )


def snapshot(directory: Path) -> dict[str, bytes | str]:
    """Every path below ``directory`` with its bytes (a link: where it points)."""
    found: dict[str, bytes | str] = {}
    for path in sorted(directory.rglob("*")):
        name = str(path.relative_to(directory))
        if path.is_symlink():
            found[name] = "-> " + os.readlink(path)
        elif path.is_file():
            found[name] = path.read_bytes()
        else:
            found[name] = "<dir>"
    return found


def victims(command: str) -> dict[str, bytes]:
    """Files that exist at the output path and are not this option's own output."""
    other_kind = MUTANTS_RESULTS if command == "suite --output" else SUITE_RESULTS
    return {
        "readme": (ROOT / "README.md").read_bytes(),
        "python": b"print(1)\n",
        "trace": TRACE.read_bytes(),  # a faultlab file, but no output of these options
        "other-kind": other_kind.read_bytes(),  # faultlab's output of another option
        "empty": b"",
    }


def assert_refused(result: subprocess.CompletedProcess[str], option: str, out: Path,
                   kind: str) -> None:
    assert result.returncode == 2, result
    assert result.stdout == "", result
    assert result.stderr == (f"faultlab: error: {option} {out}: exists and is not {kind}; "
                             "refusing to replace it\n"), result.stderr


@e2e
@pytest.mark.parametrize("victim", ["readme", "python", "trace", "other-kind", "empty"])
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_file_that_is_not_the_options_own_output_is_never_replaced(
    command: str, victim: str, tmp_path: Path,
) -> None:
    argv, option, kind, _ = COMMANDS[command]
    content = victims(command)[victim]
    out = tmp_path / ("x.py" if victim == "python" else "x.md")
    out.write_bytes(content)
    before = snapshot(tmp_path)
    result = faultlab(*argv(str(out), tmp_path), cwd=tmp_path)
    assert_refused(result, option, out, kind)
    assert out.read_bytes() == content  # byte for byte
    assert snapshot(tmp_path) == before  # no corpus, no temporary file, nothing else


@e2e
def test_replay_never_replaces_the_trace_it_replays(tmp_path: Path) -> None:
    trace = tmp_path / "t.json"
    shutil.copyfile(TRACE, trace)
    before = snapshot(tmp_path)
    result = faultlab("replay", str(trace), "--html", str(trace), cwd=tmp_path)
    assert_refused(result, "--html", trace, "a faultlab HTML page")
    assert snapshot(tmp_path) == before


@e2e
def test_a_link_to_a_foreign_file_is_refused_and_both_stay(tmp_path: Path) -> None:
    """The file a write would replace is the link's target: that is what is checked."""
    target = tmp_path / "notes.md"
    target.write_bytes((ROOT / "README.md").read_bytes())
    link = tmp_path / "results.json"
    link.symlink_to(target)
    before = snapshot(tmp_path)
    result = faultlab("suite", "--examples", "0", "--output", str(link), cwd=tmp_path)
    assert_refused(result, "--output", link, "a faultlab suite evidence file")
    assert snapshot(tmp_path) == before


@e2e
def test_python_O_refuses_the_same_way(tmp_path: Path) -> None:
    """No check is an ``assert``, which ``-O`` would strip."""
    out = tmp_path / "x.md"
    out.write_bytes(b"# notes\n")
    result = faultlab("suite", "--examples", "0", "--output", str(out), cwd=tmp_path,
                      optimise=True)
    assert_refused(result, "--output", out, "a faultlab suite evidence file")
    assert out.read_bytes() == b"# notes\n"


STALE = "\n<!-- stale: this line is gone once the file is replaced -->\n"


@e2e
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_rerun_replaces_the_options_own_previous_output(command: str, tmp_path: Path) -> None:
    argv, _, _, status = COMMANDS[command]
    out = tmp_path / ("page.html" if "--html" in command else "results.json")
    first = faultlab(*argv(str(out), tmp_path), cwd=tmp_path)
    assert first.returncode == status, first
    # a mark after the content (the start of the file, which identifies it, stays)
    out.write_text(out.read_text(encoding="utf-8") + STALE, encoding="utf-8")
    again = faultlab(*argv(str(out), tmp_path), cwd=tmp_path)
    assert again.returncode == status, again
    text = out.read_text(encoding="utf-8")
    assert "stale" not in text
    if "--html" in command:
        assert '<meta name="generator" content="faultlab">' in text
    else:
        json.loads(text)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


@e2e
@pytest.mark.parametrize(("committed", "command"), [
    (SUITE_RESULTS, "suite --output"),
    (ROOT / "results" / "results-pg.json", "suite --output"),
    (MUTANTS_RESULTS, "mutants --output"),
])
def test_the_committed_results_files_are_recognised(committed: Path, command: str,
                                                    tmp_path: Path) -> None:
    """results/ was written before this check: regenerating it into place still works."""
    argv, _, _, status = COMMANDS[command]
    out = tmp_path / committed.name
    shutil.copyfile(committed, out)
    result = faultlab(*argv(str(out), tmp_path), cwd=tmp_path)
    assert result.returncode == status, result
    assert out.read_bytes() != committed.read_bytes()


@e2e
def test_a_page_written_before_the_generator_tag_is_recognised(tmp_path: Path) -> None:
    """Pages written before ``<meta name="generator">`` are still faultlab's own."""
    page = tmp_path / "page.html"
    first = faultlab("replay", str(TRACE), "--html", str(page), cwd=tmp_path)
    assert first.returncode == 0, first
    old = page.read_text(encoding="utf-8").replace('<meta name="generator" content="faultlab">',
                                                   "", 1)
    assert "generator" not in old
    page.write_text(old, encoding="utf-8")
    again = faultlab("replay", str(TRACE), "--html", str(page), cwd=tmp_path)
    assert again.returncode == 0, again
    assert '<meta name="generator" content="faultlab">' in page.read_text(encoding="utf-8")


def test_a_file_that_appears_during_the_run_is_not_replaced(tmp_path: Path) -> None:
    """Checked again at the moment of writing: a foreign file that appeared meanwhile stays
    (exit 3 through ExecutionError), and no temporary file is left."""
    from faultlab.base.output import check_output_file
    from faultlab.report.tables import EVIDENCE

    out = tmp_path / "results.json"
    check_output_file(out, "--output", EVIDENCE)  # nothing there yet: fine
    out.write_text("# someone else's\n")
    with pytest.raises(ExecutionError, match="not a faultlab suite evidence file; not replaced"):
        write_json(out, {"experiment": "x"}, kind=EVIDENCE)
    assert out.read_text() == "# someone else's\n"
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


@pytest.mark.parametrize("occupant", ["link", "file", "own"])
def test_a_finding_replaces_only_a_trace_at_its_name(tmp_path: Path, occupant: str) -> None:
    """A finding's name is predictable (seed 0 always gives the same one): a link to
    another file or a foreign file at that name stays, byte for byte (exit 3 through
    ExecutionError); only a trace there, the same finding saved before, is replaced."""
    from faultlab.corpus.files import finding_name, save
    from faultlab.trace import Trace

    trace = Trace.from_json(json.loads(TRACE.read_text()))
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    path = corpus / finding_name(trace)
    notes = tmp_path / "notes.txt"
    notes.write_text("my notes\n")
    if occupant == "link":
        path.symlink_to(notes)
    elif occupant == "file":
        path.write_text("my notes\n")
    else:
        path.write_text(TRACE.read_text().replace('"seed"', '"seed" ', 1))
    before = snapshot(tmp_path)
    if occupant == "own":
        assert save(trace, corpus) == path
        assert path.read_bytes() == TRACE.read_bytes()
        return
    with pytest.raises(ExecutionError, match="exists and is not a faultlab trace; the "
                                             "finding was not saved over it"):
        save(trace, corpus)
    assert snapshot(tmp_path) == before


def _bench(name: str) -> object:
    """A bench script as a module (bench/ is not a package)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", ["spawn", "postgres"])
def test_a_bench_replaces_only_its_own_results_file(name: str, tmp_path: Path) -> None:
    """The bench scripts' --output follows the same rule: another file is refused (one line,
    exit 2, before anything is measured, the file unchanged); the committed results file
    is recognised as the bench's own."""
    victim = tmp_path / "notes.json"
    victim.write_text('{"mine": true}\n')
    result = subprocess.run([sys.executable, str(ROOT / "bench" / f"{name}.py"),
                             "--output", str(victim)], capture_output=True, text=True,
                            env=child_environment(), timeout=60)
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        f"{'spawn.py' if name == 'spawn' else 'bench/postgres.py'}: --output {victim}: exists "
        f"and is not a bench/{name}.py results file; refusing to replace it"]
    assert result.stdout == ""
    assert victim.read_text() == '{"mine": true}\n'
    results = _bench(name).RESULTS  # type: ignore[attr-defined]
    committed = ROOT / "results" / ("bench.json" if name == "spawn" else "bench-postgres.json")
    assert results.made(committed)
    assert not results.made(victim)
