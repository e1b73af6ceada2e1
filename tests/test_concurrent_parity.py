"""What a sequential trace checks, a concurrent one checks too.

Each test here is a hole the concurrent stack (``explore --concurrency N``, the lane
executor, trace format version 2) once had beside the sequential one: a command-line
system's ``response_fields``, crash points armed by argument, realistic data, a run
that failed, byte-stable corpus files, the pytest plugin and ``--statement-points``.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest
from conftest import explore_lanes

from faultlab.cli import main
from faultlab.run.executor import Executor
from faultlab.system import load_system
from faultlab.trace import Step

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

ROOT = Path(__file__).resolve().parent.parent
UNMODIFIED = ROOT / "examples" / "unmodified_outbox"
P = {"title": "backlog"}


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


#: Exit statuses of a run that found nothing: clean, or vacuous (4: an argument-mode
#: system's lanes never hold at a point, so its workers never overlap).
NOTHING_FOUND = (0, 4)


def checked(out: str, invariant: str) -> int:
    """How often the coverage table says ``invariant`` had something to check."""
    found = re.search(rf"^{invariant}\s+(\d+)\s*$", out, re.MULTILINE)
    assert found is not None, out
    return int(found.group(1))


# --- 1. response_fields -----------------------------------------------------------------------


def taken_system(directory: Path) -> Path:
    """examples/unmodified_outbox with an accept that answers ``{"taken": ...}``, which its
    system file maps with ``"accepted": "/taken"``: without the mapping no accept is an
    acknowledgement, and ACK has nothing to check."""
    source = (UNMODIFIED / "outbox_lab.py").read_text()
    assert source.count('{"accepted": key') == 2
    (directory / "outbox_lab.py").write_text(source.replace('{"accepted": key', '{"taken": key'))
    data = json.loads((UNMODIFIED / "system.json").read_text())
    data["name"] = "unmodified-outbox-taken"
    data["response_fields"] = {**data["response_fields"], "accepted": "/taken"}
    path = directory / "system.json"
    path.write_text(json.dumps(data))
    return path


def test_a_lane_reads_a_response_through_response_fields(tmp_path: Path) -> None:
    system = load_system(str(taken_system(tmp_path)))
    with Executor(system, concurrency=2) as ex:
        accepted = ex.run(Step("accept", "op-1", P, lane=1))
        ((_, record),) = accepted.exited
        assert record.raw_response is not None and "taken" in record.raw_response
        assert record.response is not None and record.response["accepted"] == "op-1"
        assert list(ex.model.acknowledged) == ["op-1"]
        ex.run(Step("dispatch", lane=2))
        assert "ACK" in ex.checked


def test_response_fields_make_ack_checked_sequentially_and_in_lanes(tmp_path: Path) -> None:
    path = str(taken_system(tmp_path))
    corpus = str(tmp_path / "corpus")
    code, out, _ = cli("explore", "--system", path, "--examples", "5", "--steps", "4",
                       "--seed", "0", "--quiet", "--corpus", corpus)
    assert code == 0, out
    assert checked(out, "ACK") > 0
    code, out, _ = cli("explore", "--system", path, "--concurrency", "2", "--examples", "6",
                       "--steps", "6", "--seed", "0", "--quiet", "--corpus", corpus)
    assert code in NOTHING_FOUND, out
    assert checked(out, "ACK") > 0


# --- 2. crash points armed by argument ------------------------------------------------------

STANDALONE = ROOT / "examples" / "standalone_outbox"
ARGUMENT = str(STANDALONE / "system.json")
ANNOUNCE = str(STANDALONE / "system-announce.json")


def test_a_lane_step_arms_a_crash_point_by_argument() -> None:
    """A program armed by argument never holds, so only an armed step can crash it: the
    dispatcher dies at after_downstream_commit (one ticket, still pending), the recovery
    replays the receipt; the table shows the armed point."""
    from faultlab.report.tables import replay_table
    from faultlab.run.executor import execute

    system = load_system(ARGUMENT)
    steps = [Step("accept", "op-1", P, lane=1),
             Step("dispatch", lane=2, crash="after_downstream_commit")]
    execution = execute(system, steps, concurrency=2, settle=True)
    crashed = execution.observations[1]
    assert [record.exit_code for _, record in crashed.exited] == [-9]
    assert crashed.sigkills == 1
    assert len(crashed.snapshot.tickets) == 1 and crashed.snapshot.pending_outbox()
    assert execution.verdict.clean and len(execution.observations[-1].snapshot.tickets) == 1
    assert "L2 run dispatch(crash=after_downstream_commit)" in replay_table(
        execution, "simple")
    control = execute(system, steps[:1] + [Step("dispatch", lane=2)], concurrency=2, settle=True)
    assert control.observations[1].sigkills == 0  # unarmed: it runs to its end


def test_an_armed_point_of_an_announcing_program_is_killed_there() -> None:
    """An announcing program holds at the points before its armed one and is SIGKILLed at
    the armed one by faultlab, as the sequential nemesis does."""
    system = load_system(ANNOUNCE)
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", P, lane=1))
        held = ex.run(Step("dispatch", lane=2, hold=True, crash="after_downstream_commit"))
        assert held.lanes == ("exit 0", "dispatch @before_dispatch")
        while ex.lanes[2].alive:  # the service holds at its own points on the way
            killed = ex.run(Step("release", lane=2))
        assert ex.lanes[2].points == ["before_dispatch", "service_before_commit",
                                      "service_after_commit"]
        assert [r.exit_code for _, r in killed.exited] == [-9] and killed.sigkills == 1
        assert len(killed.snapshot.tickets) == 1 and killed.snapshot.pending_outbox()


def test_the_crash_field_is_written_only_when_set(tmp_path: Path) -> None:
    from faultlab.base.errors import UsageError
    from faultlab.trace import Trace

    armed = Step("dispatch", lane=1, crash="before_dispatch")
    assert armed.to_json() == {"action": "run", "lane": 1, "role": "dispatch",
                               "crash": "before_dispatch"}
    assert Step.from_lane_json(armed.to_json()) == armed
    assert "crash" not in Step("dispatch", lane=1).to_json()
    for saved in sorted((ROOT / "corpus").glob("*.json")):  # old files read and write as before
        data = json.loads(saved.read_text())
        if data["version"] == 2:
            trace = Trace.load(saved)
            assert isinstance(trace, Trace)
            assert [s.to_json() for s in trace.steps] == data["steps"]
    bad = Trace(system="reference", deduplication=True, concurrency=2, steps=[]).to_json()
    bad["steps"] = [{"action": "release", "lane": 1, "crash": "before_dispatch"}]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(bad))
    try:
        Trace.load(path)
    except UsageError as error:
        assert "only run and start arm a crash point" in str(error)
    else:
        raise AssertionError("a release that arms a crash point was read")


def test_an_undeclared_crash_point_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from faultlab.trace import Trace

    trace = Trace(system=ARGUMENT, deduplication=True, concurrency=2,
                  steps=[Step("dispatch", lane=1, crash="nowhere")])
    path = tmp_path / "armed.json"
    path.write_text(json.dumps(trace.to_json()))
    code, _, err = cli("replay", str(path), "--system", ARGUMENT)
    assert code == 2 and "unknown crash point 'nowhere'" in err, err


def test_argument_mode_crash_points_fire_under_concurrency(tmp_path: Path) -> None:
    code, out, _ = cli("explore", "--system", ARGUMENT, "--concurrency", "2", "--examples",
                       "6", "--steps", "6", "--seed", "0", "--quiet",
                       "--corpus", str(tmp_path / "corpus"))
    assert code in NOTHING_FOUND, out
    sigkills = re.search(r"^SIGKILLs\s+(\d+)\s*$", out, re.MULTILINE)
    assert sigkills is not None and int(sigkills.group(1)) > 0, out


# --- 3. realistic data ----------------------------------------------------------------------


def _drawn_accepts(system: str, examples: int) -> list[Step]:
    """Every accept step the concurrent machine drew in ``examples`` examples (seed 0)."""
    from dataclasses import dataclass, field

    from hypothesis import Phase, Verbosity, seed, settings
    from hypothesis.stateful import run_state_machine_as_test

    from faultlab.search.recorder import Recorder
    from faultlab.search.schedules import concurrent_machine

    @dataclass
    class Collecting(Recorder):
        seen: list[Step] = field(default_factory=list)

        def finish(self, steps: list[Step], *args: object, **kwargs: object) -> None:
            self.seen += steps
            super().finish(steps, *args, **kwargs)  # type: ignore[arg-type]

    recorder = Collecting()
    machine = concurrent_machine(system, concurrency=2, examples=examples, steps=6,
                                 recorder=recorder)
    chosen = settings(machine.TestCase.settings, verbosity=Verbosity.quiet,
                      phases=(Phase.generate,))
    run_state_machine_as_test(seed(0)(machine), settings=chosen)
    return [s for s in recorder.seen if s.action == "accept"]


def test_the_concurrent_machine_draws_a_systems_declared_data() -> None:
    accepts = _drawn_accepts("systems_for_tests:DeclaredDataOutbox", 4)
    assert accepts
    assert all(re.fullmatch(r"ORD-\d{5}", s.operation_id or "") for s in accepts)
    assert all(isinstance(s.payload, dict) and "sku" in s.payload for s in accepts)


def test_the_concurrent_machine_draws_realistic_default_data() -> None:
    """Look-alike, unicode or SQL-ish ids and realistic payloads, as sequentially (always
    op-N and a simple payload before)."""
    from faultlab.search.data import TITLES

    accepts = _drawn_accepts("reference", 12)
    assert any(not re.fullmatch(r"op-\d+", s.operation_id or "") for s in accepts)
    assert any(set(s.payload) - {"title", "priority", "count"}
               or s.payload.get("title") not in TITLES for s in accepts)


def test_case_insensitive_key_is_caught_with_concurrency(tmp_path: Path) -> None:
    """The receiver that compares ids without case: caught sequentially, and now with two
    lanes too; the finding's data simplified as sequentially (op-1 and OP-1, {})."""
    from faultlab.trace import Trace

    corpus = tmp_path / "corpus"
    code, out, _ = cli("explore", "--system", "case-insensitive-key", "--concurrency", "2",
                       "--examples", "200", "--seed", "0", "--quiet", "--corpus", str(corpus))
    assert code == 1, out
    (path,) = corpus.glob("*.json")
    trace = Trace.load(path)
    assert isinstance(trace, Trace)
    accepts = [s for s in trace.steps if s.role == "accept"]
    assert {s.operation_id for s in accepts} == {"op-1", "OP-1"}
    assert all(s.payload == {} for s in accepts)
    code, out, _ = cli("replay", str(path))
    assert code == 0, out


# --- 4. a run that failed is not a finding -------------------------------------------------

GARBAGE = '''\
import os, sys
fd = os.environ.get("FAULTLAB_ANNOUNCE_FD")
if fd is not None:
    os.write(int(fd), b"hello there\\n")  # not 'reached POINT PID'
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
'''


def garbage_system(directory: Path) -> Path:
    """examples/standalone_outbox announcing its points, but its dispatcher first writes a
    line that is not the protocol on its announcement channel."""
    (directory / "garbage.py").write_text(GARBAGE)
    (directory / "outbox.py").write_bytes((STANDALONE / "outbox.py").read_bytes())
    data = json.loads(Path(ANNOUNCE).read_text())
    data["name"] = "garbage-announcer"
    data["commands"]["dispatch"] = ["{python}", "{system_dir}/garbage.py",
                                    *data["commands"]["dispatch"][1:]]
    path = directory / "system.json"
    path.write_text(json.dumps(data))
    return path


def test_a_broken_announcement_in_a_lane_is_a_run_failure(tmp_path: Path) -> None:
    from faultlab.base.errors import ExecutionError

    system = load_system(str(garbage_system(tmp_path)))
    with Executor(system, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", P, lane=1))
        try:
            ex.run(Step("dispatch", lane=2, hold=True))
        except ExecutionError as error:
            assert "broke the announcement protocol" in str(error)
            assert "expected 'reached POINT PID'" in str(error)
        else:
            raise AssertionError("a garbage announcement was taken for a hold")


def _run_failed(code: int, out: str, err: str, corpus: Path, words: str) -> None:
    assert code == 3, out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("faultlab: run failed: "), err
    assert words in lines[0], err
    assert "FOUND" not in out and not corpus.exists()


def test_explore_concurrency_ends_a_broken_protocol_with_exit_3(tmp_path: Path) -> None:
    path = str(garbage_system(tmp_path))
    corpus = tmp_path / "corpus"
    code, out, err = cli("explore", "--system", path, "--concurrency", "2", "--examples", "10",
                         "--seed", "0", "--quiet", "--corpus", str(corpus))
    _run_failed(code, out, err, corpus, "broke the announcement protocol")


def test_explore_concurrency_ends_a_refusing_worker_with_exit_3(tmp_path: Path) -> None:
    """A worker that refuses its input (exit 2) is an ExecutionError of the lane executor."""
    corpus = tmp_path / "corpus"
    code, out, err = cli("explore", "--system", "systems_for_tests:RefusingOutbox",
                         "--concurrency", "2", "--examples", "10", "--seed", "0", "--quiet",
                         "--corpus", str(corpus))
    _run_failed(code, out, err, corpus, "refused its input (exit 2)")


def test_a_run_error_is_raised_even_when_another_example_failed(tmp_path: Path) -> None:
    """The concurrent search keeps the step's error: a later invariant failure, or
    Hypothesis's own report of the error, never turns it into a finding."""
    from faultlab.base.errors import ExecutionError
    system = load_system(str(garbage_system(tmp_path)))
    try:
        explore_lanes(system, examples=10, seed_value=0, deduplication=False)
    except ExecutionError as error:
        assert "broke the announcement protocol" in str(error)
    else:
        raise AssertionError("a broken protocol ended the search without an error")


def test_an_error_hypothesis_cannot_reproduce_is_still_a_run_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A dispatcher refuses its input once: the search stops with exit 3 naming it. Before,
    Hypothesis reran the example, saw no error, called it flaky, and the run ended with a
    note (or as clean) instead."""
    flag = tmp_path / "once"
    flag.write_text("")
    monkeypatch.setenv("FAULTLAB_TEST_ONCE_FLAG", str(flag))
    corpus = tmp_path / "corpus"
    code, out, err = cli("explore", "--system", "systems_for_tests:OnceRefusingOutbox",
                         "--concurrency", "2", "--examples", "10", "--seed", "0", "--quiet",
                         "--corpus", str(corpus))
    assert not flag.exists()  # the refusal happened
    _run_failed(code, out, err, corpus, "refused its input (exit 2)")


# --- 5. byte-stable corpus files ----------------------------------------------------------


def test_a_concurrent_finding_saves_the_same_bytes_every_time(tmp_path: Path) -> None:
    """No timestamp in meta, no PID in a violation (EXCL names the lanes' workers by their
    number in the trace): two runs of the same seed save byte-identical files."""
    saved = []
    for run in ("first", "second"):
        corpus = tmp_path / run
        code, out, _ = cli("explore", "--system", "eager-rescue", "--concurrency", "2",
                           "--seed", "0", "--quiet", "--corpus", str(corpus))
        assert code == 1, out
        (path,) = corpus.glob("*.json")
        saved.append(path)
    first, second = (path.read_bytes() for path in saved)
    assert saved[0].name == saved[1].name and first == second
    data = json.loads(first)
    assert "recorded" not in data["meta"]
    messages = [v["message"] for v in data["violations"]]
    assert any("(worker " in m for m in messages) and not any("pid" in m for m in messages)


def test_a_quiet_violation_quotes_no_pid() -> None:
    from faultlab.checks.invariants import Check, Model, check_quiet
    from faultlab.process.records import ProcessRecord
    from faultlab.stores.sqlite import Snapshot

    record = ProcessRecord(pid=4242, exit_code=0, stdout="", stderr="", elapsed=0.0, response={
        "operation_id": "op-1", "result": {"ticket_id": 1},
        "service": {"pid": 4243, "exit_code": 0}})
    check = Check(model=Model(), before=Snapshot(), after=Snapshot(), action="dispatch",
                  operation_id=None, payload=None, record=record, deduplication=True)
    (message,) = check_quiet(check)
    assert "4243" not in message and '"service": {"exit_code": 0}' in message


# --- 7. one spelling for statement points ---------------------------------------------------


def _tables(out: str) -> str:
    """What a run explored: its output without the timing rows."""
    return "\n".join(line for line in out.splitlines()
                     if not line.startswith(("wall time", "steps/s")))


def test_statement_points_have_one_spelling_and_the_old_one_still_works(
    tmp_path: Path,
) -> None:
    run = ("explore", "--examples", "3", "--steps", "4", "--seed", "1", "--quiet",
           "--corpus", str(tmp_path / "corpus"))
    code, default, err = cli(*run)
    assert code == 0 and err == "", err
    code, off, err = cli(*run, "--no-statement-points")
    assert code == 0 and err == "", err
    code, old, err = cli(*run, "--no-statement-crashes")
    assert code == 0, old + err
    assert err.splitlines() == [
        "faultlab: note: --no-statement-crashes is deprecated; use --no-statement-points"]
    assert _tables(old) == _tables(off)
    assert "sql:" in default and "sql:" not in off  # the crash-point table: armed, fired
    code, on, _ = cli(*run, "--statement-points")
    assert code == 0 and _tables(on) == _tables(default)  # on is the sequential default


def test_statement_points_with_concurrency_default_off(tmp_path: Path) -> None:
    run = ("explore", "--concurrency", "2", "--examples", "2", "--steps", "3", "--seed", "0",
           "--quiet", "--corpus", str(tmp_path / "corpus"))
    code, default, err = cli(*run)
    assert code == 0 and err == "", default + err
    code, off, err = cli(*run, "--no-statement-points")  # refused before: now just off
    assert code == 0 and err == "", off + err
    assert _tables(off) == _tables(default) and "statement points" not in default
    code, on, err = cli(*run, "--statement-points")
    assert code == 0 and "statement points" in on, on + err


def test_explore_help_shows_only_the_new_spelling() -> None:
    import contextlib

    buffer = io.StringIO()
    with contextlib.suppress(SystemExit), redirect_stdout(buffer):
        main(["explore", "--help"])
    usage, _, options = buffer.getvalue().partition("options:")
    assert "[--statement-points | --no-statement-points]" in usage
    assert "--no-statement-crashes" not in usage  # hidden: an alias, not an option
    text = " ".join(options.split())
    assert "default on where the system supports them" in text and "(default off:" in text
