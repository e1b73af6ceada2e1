"""The pytest plugin (entry point ``pytest11``): corpus files as test items, machine settings.

Run with pytester (a pytest in a subprocess, in a fresh directory: an in-process
run would leave its fork servers to this process) and once as a user would:
``pytest --faultlab-corpus corpus`` from a directory unrelated to faultlab.
"""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from conftest import trace_on_postgres

from faultlab.process.spawn import child_environment

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus"
TRACES = sorted(CORPUS.glob("*.json"))


def _entry_point_installed() -> bool:
    return any(ep.name == "faultlab" and ep.value == "faultlab.pytest_plugin"
               for ep in metadata.entry_points(group="pytest11"))


#: under tox faultlab is installed and pytest loads the plugin by its entry point; from a
#: checkout it is named explicitly (loading it twice would be an error)
PLUGIN = [] if _entry_point_installed() else ["-p", "faultlab.pytest_plugin"]


@pytest.fixture
def pytester(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> pytest.Pytester:
    """pytester whose runs are subprocesses that import this faultlab."""
    monkeypatch.setenv("PYTHONPATH", child_environment()["PYTHONPATH"])
    return pytester


def test_pyproject_registers_the_plugin() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert '[project.entry-points.pytest11]\nfaultlab = "faultlab.pytest_plugin"' in text


def _corpus_options(tmp_path: Path) -> tuple[list[str], list[Path]]:
    """The plugin's options for the whole corpus and the traces they replay: with faultlab's
    own PostgreSQL server where one can start (failing instead where the environment demands
    postgres); elsewhere a copy of the corpus without the PostgreSQL traces."""
    from conftest import required_services

    from faultlab.stores import pgserver

    reason = pgserver.unavailable()
    if reason is None:
        return ["--faultlab-corpus", str(CORPUS), "--faultlab-postgres", "private"], TRACES
    if "postgres" in required_services():
        pytest.fail(f"{reason}, and FAULTLAB_REQUIRE_SERVICES names postgres")
    kept = [path for path in TRACES if not trace_on_postgres(path)]
    copy = tmp_path / "corpus-without-postgres"
    copy.mkdir()
    for path in kept:
        (copy / path.name).write_bytes(path.read_bytes())
    return ["--faultlab-corpus", str(copy)], kept


def test_every_corpus_file_is_one_passing_item_named_after_it(pytester: pytest.Pytester,
                                                               tmp_path: Path) -> None:
    assert len(TRACES) >= 15
    options, traces = _corpus_options(tmp_path)
    result = pytester.runpytest_subprocess(*PLUGIN, *options, "-v")
    result.assert_outcomes(passed=len(traces))
    passed = [line for line in result.outlines if line.endswith("PASSED") or " PASSED " in line]
    names = sorted(line.split("::")[1].split()[0] for line in passed)
    assert names == [path.name for path in traces]


def test_a_postgres_trace_without_faultlabs_own_server_fails_saying_how(
        pytester: pytest.Pytester) -> None:
    """A server fault runs only on faultlab's own server: without --faultlab-postgres the
    item fails in one line naming the option, and nothing runs."""
    corpus = pytester.mkdir("mine")
    source = next(CORPUS.glob("async-commit-pg-ACK-*.json"))
    (corpus / source.name).write_bytes(source.read_bytes())
    result = pytester.runpytest_subprocess(*PLUGIN, "--faultlab-corpus", str(corpus))
    result.assert_outcomes(failed=1)
    assert ("a server_crash step needs faultlab's own PostgreSQL server (--postgres private)"
            in result.stdout.str())
    assert "(under pytest: --faultlab-postgres private)" in result.stdout.str()


def test_a_differing_replay_fails_and_prints_its_table(pytester: pytest.Pytester) -> None:
    corpus = pytester.mkdir("mine")
    source = next(CORPUS.glob("reference-nodedup-ONE-*.json"))
    trace = json.loads(source.read_text())
    (corpus / "claims-clean.json").write_text(json.dumps({**trace, "expected": {"clean": True}}))
    (corpus / "as-recorded.json").write_text(source.read_text())
    (corpus / "broken.json").write_bytes(b"\x00\xffnot json")
    result = pytester.runpytest_subprocess(*PLUGIN, "--faultlab-corpus", str(corpus))
    result.assert_outcomes(passed=1, failed=2)
    text = result.stdout.str()
    # the replay table of the differing trace, with the violation and the verdict line
    assert "#  action" in text and "ONE: operation op-1 has 2 tickets" in text
    assert "verdict: ONE+DONE at step 3; expected clean: DIFFERS" in text
    assert "broken.json: not valid JSON" in text or "broken.json:" in text
    assert "\\x00" not in text and "\x00" not in text


def test_a_missing_corpus_directory_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess(*PLUGIN, "--faultlab-corpus", "no-such-dir")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--faultlab-corpus no-such-dir: not a directory" in result.stderr.str()


def test_corpus_items_come_on_top_of_test_paths_given(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_other="def test_one():\n    assert 1 + 1 == 2\n")
    corpus = pytester.mkdir("mine")
    (corpus / "one.json").write_text(next(CORPUS.glob("split-accept-ATOM-*.json")).read_text())
    result = pytester.runpytest_subprocess(*PLUGIN, "--faultlab-corpus", str(corpus),
                                           "test_other.py")
    result.assert_outcomes(passed=2)


MACHINE_TESTS = """
import json
from pathlib import Path

import pytest
from conftest import trace_on_postgres

from faultlab.search.machine import outbox_machine
from faultlab.search.recorder import Recorder

PLAIN = Recorder()
MARKED = Recorder()
TestPlain = outbox_machine("reference", examples=40, steps=3, recorder=PLAIN).TestCase


@pytest.mark.faultlab(examples=2, seed=11)
class TestMarked(outbox_machine("reference", examples=40, steps=3, recorder=MARKED).TestCase):
    pass


def test_zz_write_what_ran():
    Path("ran.json").write_text(json.dumps({
        name: {"examples": r.examples, "steps": r.steps,
               "last": [s.describe() for s in r.last_steps]}
        for name, r in (("plain", PLAIN), ("marked", MARKED))
    }))
"""


def _machines(pytester: pytest.Pytester, *options: str) -> dict[str, dict[str, object]]:
    pytester.makepyfile(test_machine=MACHINE_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, *options)
    result.assert_outcomes(passed=3)
    ran: dict[str, dict[str, object]] = json.loads((pytester.path / "ran.json").read_text())
    return ran


def test_examples_and_seed_options_and_the_marker(pytester: pytest.Pytester) -> None:
    first = _machines(pytester, "--faultlab-examples", "4", "--faultlab-seed", "3")
    # the option limits the unmarked machine (40 otherwise; abandoned examples come on top)
    assert 4 <= int(first["plain"]["examples"]) < 10  # type: ignore[call-overload]
    # the marker wins over the option
    assert 2 <= int(first["marked"]["examples"]) < 4  # type: ignore[call-overload]
    again = _machines(pytester, "--faultlab-examples", "4", "--faultlab-seed", "3")
    assert again == first  # the same seed, the same examples, step for step
    other = _machines(pytester, "--faultlab-examples", "4", "--faultlab-seed", "4")
    assert other["plain"] != first["plain"]
    assert other["marked"] == first["marked"]  # its seed is the marker's


def test_installed_plugin_from_any_directory(tmp_path: Path) -> None:
    """As a user runs it: a subprocess in a directory unrelated to faultlab."""
    options, traces = _corpus_options(tmp_path)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", *PLUGIN, *options, "-q", "-p", "no:cacheprovider"],
        capture_output=True, text=True, env=child_environment(), cwd=elsewhere, timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(traces)} passed" in result.stdout
    assert list(elsewhere.iterdir()) == []


CONCURRENT_MACHINE_TESTS = """
import json
from pathlib import Path

import pytest
from conftest import trace_on_postgres

from faultlab.search.recorder import Recorder
from faultlab.search.schedules import concurrent_machine

from hypothesis.stateful import invariant

PLAIN = Recorder()
MARKED = Recorder()
RULES = []  # per example of the marked machine: its invariant checks (1 + its rules)
TestPlain = concurrent_machine("reference", concurrency=2, examples=40, steps=3,
                               recorder=PLAIN).TestCase


class Counted(concurrent_machine("reference", concurrency=2, examples=40, steps=3,
                                 recorder=MARKED)):
    def __init__(self):
        super().__init__()
        RULES.append(0)

    @invariant()
    def count(self):  # Hypothesis checks invariants once at the start and after every rule
        RULES[-1] += 1


@pytest.mark.faultlab(examples=2, seed=11, steps=2)
class TestMarked(Counted.TestCase):
    pass


def test_zz_write_what_ran():
    Path("ran.json").write_text(json.dumps({
        **{name: {"examples": r.examples, "steps": r.steps,
                  "last": [s.describe() for s in r.last_steps]}
           for name, r in (("plain", PLAIN), ("marked", MARKED))},
        "marked_rules": max(RULES) - 1,
    }))
"""


def _concurrent_machines(pytester: pytest.Pytester, *options: str) -> dict[str, dict[str, object]]:
    pytester.makepyfile(test_concurrent_machine=CONCURRENT_MACHINE_TESTS)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider", *options)
    result.assert_outcomes(passed=3)
    ran: dict[str, dict[str, object]] = json.loads((pytester.path / "ran.json").read_text())
    return ran


def test_the_options_and_the_marker_reach_concurrent_machines(pytester: pytest.Pytester) -> None:
    """--faultlab-examples, --faultlab-seed and the marker set a concurrent machine's
    TestCase as they set a sequential one's (it ran 40 examples of its own before)."""
    first = _concurrent_machines(pytester, "--faultlab-examples", "3", "--faultlab-seed", "3")
    assert 3 <= int(first["plain"]["examples"]) < 10  # type: ignore[call-overload]
    assert 2 <= int(first["marked"]["examples"]) < 5  # type: ignore[call-overload]
    assert first["marked_rules"] == 2  # the marker's steps: at most 2 rules an example
    again = _concurrent_machines(pytester, "--faultlab-examples", "3", "--faultlab-seed", "3")
    assert again == first  # the same seed, the same examples, step for step
    other = _concurrent_machines(pytester, "--faultlab-examples", "3", "--faultlab-seed", "4")
    assert other["plain"] != first["plain"]
    assert other["marked"] == first["marked"]  # its seed is the marker's


SPIED_STEPS = """
import pytest

import faultlab
import faultlab.api as api

SEEN = []


def spy(system, **given):  # records what the TestCase asks explore for; runs nothing
    SEEN.append((given["examples"], given["steps"]))
    return None


api._explore_as_test = spy
TestLanes = faultlab.state_machine("reference", concurrency=2, examples=2, steps=5).TestCase


@pytest.mark.faultlab(examples=3, steps=3)
class TestMarked(TestLanes):
    pass


def test_zz_what_explore_was_asked():
    assert SEEN == [(2, 5), (3, 3)]
"""


def test_the_markers_steps_reach_a_concurrent_state_machine_as_given(
        pytester: pytest.Pytester) -> None:
    """The marker's steps are explore's steps: faultlab.state_machine's TestCase gives them
    to explore, which adds the lanes' opening step itself (the plugin added it too: 4)."""
    pytester.makepyfile(test_spied=SPIED_STEPS)
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(passed=3)


@pytest.mark.parametrize(("options", "words"), [
    (("--faultlab-examples", "0"), "--faultlab-examples must be at least 1, not 0"),
    (("--faultlab-deadline", "-1"), "--faultlab-deadline must be a positive number"),
    (("--faultlab-deadline", "nan"), "--faultlab-deadline must be a positive number"),
])
def test_bad_plugin_options_are_usage_errors(pytester: pytest.Pytester,
                                             options: tuple[str, ...], words: str) -> None:
    pytester.makepyfile(test_plain="def test_one():\n    pass\n")
    result = pytester.runpytest_subprocess(*PLUGIN, *options)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert words in result.stderr.str()


@pytest.mark.parametrize(("marker", "words"), [
    ('examples="abc"', "examples must be an integer of at least 1, not 'abc'"),
    ("steps=0", "steps must be an integer of at least 1, not 0"),
    ("5", "takes keyword arguments only"),
])
def test_a_bad_marker_fails_its_test_in_one_line(pytester: pytest.Pytester, marker: str,
                                                 words: str) -> None:
    pytester.makepyfile(test_marked=f"""
import pytest
import faultlab

Machine = faultlab.state_machine("reference", examples=1, steps=1)


@pytest.mark.faultlab({marker})
class TestMarked(Machine.TestCase):
    pass
""")
    result = pytester.runpytest_subprocess(*PLUGIN, "-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    text = result.stdout.str()
    assert words in text and "Traceback" not in text


def test_an_empty_corpus_says_no_regression_test_ran(pytester: pytest.Pytester) -> None:
    empty = pytester.mkdir("corpus")
    result = pytester.runpytest_subprocess(*PLUGIN, "--faultlab-corpus", str(empty))
    assert f"faultlab: --faultlab-corpus {empty} gave no trace to replay: no regression " \
        "test ran from it" in result.stdout.str()
