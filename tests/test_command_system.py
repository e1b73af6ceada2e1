"""Command-line systems (``--system path/to/system.json``) and the standalone example.

The standalone example (examples/standalone_outbox/) is a separate program that
does not import faultlab: its own CLI, its own stores and table names, its own
crash flag. It is described twice: ``system.json`` arms crash points with
``--crash POINT`` (the worker kills itself), ``system-announce.json`` uses the
announcement protocol (faultlab kills the worker from outside).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.cli import main
from faultlab.process.spawn import Spawner, child_environment
from faultlab.run.executor import Executor, execute
from faultlab.system import System, load_system
from faultlab.system.command import CommandSystem, load_command_system, substitute
from faultlab.trace import Step
from faultlab.trials.scenarios import SCENARIOS, scenario_names

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "standalone_outbox"
SYSTEM_FILES = {"argument": EXAMPLE / "system.json", "announce": EXAMPLE / "system-announce.json"}
PAYLOAD = {"project": "demo-agent", "title": "Investigate the synthetic queue backlog",
           "priority": "normal"}
SUMMARIES = {
    "crash_before_dispatch": {"crash_exit": -9, "tickets_before": 0, "tickets_after": 1,
                              "caller_state": "complete", "ticket_id": 1},
    "crash_after_downstream_commit": {"crash_exit": -9, "tickets_before": 1, "tickets_after": 1,
                                      "caller_state": "complete", "ticket_id": 1},
    "deduplication_disabled": {"crash_exit": -9, "tickets_before": 1, "tickets_after": 2,
                               "caller_state": "complete", "ticket_id": 2},
    "crash_during_acceptance": {"crash_exit": -9, "partial_operations": 0, "partial_outbox": 0,
                                "tickets_after": 1},
    "changed_payload_rejected": {"exit_code": 3, "tickets_after": 1},
}
MODES = list(SYSTEM_FILES)


@pytest.fixture(autouse=True)
def private_tempdir(tmp_path_factory: pytest.TempPathFactory,
                    monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Every temporary directory faultlab makes goes here; it must be empty afterwards."""
    directory = tmp_path_factory.mktemp("tmpdir")
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    yield directory
    assert list(directory.iterdir()) == [], "faultlab left a temporary directory behind"


@pytest.fixture(scope="module")
def runner() -> Iterator[Spawner]:
    # Command systems run their own programs: this spawner never starts a fork server.
    spawner = Spawner("fork")
    yield spawner
    spawner.close()


def standalone(mode: str) -> System:
    return load_system(str(SYSTEM_FILES[mode]))


def children() -> list[str]:
    """Command lines of this process's children (Linux), to show none is left behind."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            fields = text[text.rindex(")") + 2:].split()
            if int(fields[1]) == os.getpid():
                found.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except (OSError, ValueError):
            continue
    return found


def tree(directory: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(directory)): path.read_bytes() if path.is_file() else b"<dir>"
        for path in sorted(directory.rglob("*"))
    }


def faultlab(*args: str, cwd: Path | None = None,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        env=env or child_environment(), timeout=120, check=False, cwd=cwd,
    )


# --- the five scenarios ------------------------------------------------------------------------


@pytest.mark.e2e  # the five scenarios, as the suite runs them
@pytest.mark.parametrize("mode", MODES)
def test_standalone_example_passes_the_five_scenarios(mode: str, runner: Spawner) -> None:
    system = standalone(mode)
    assert isinstance(system, CommandSystem)
    assert system.supports_no_deduplication
    outcomes = {s.name: s.run(system, runner) for s in SCENARIOS}
    assert list(outcomes) == scenario_names()
    for name, outcome in outcomes.items():
        assert outcome.passed, (name, outcome.failures)
        assert outcome.summary == SUMMARIES[name], name
    # the negative control really ran without deduplication: two tickets, no receipt for #2
    negative = outcomes["deduplication_disabled"].execution.observations[-1].snapshot
    assert [t.id for t in negative.tickets] == [1, 2]
    assert negative.receipts == ()
    assert not any("outbox.py" in c for c in children())


@pytest.mark.slow  # the same five scenarios as above, through the command line
def test_suite_cli_runs_the_standalone_example(tmp_path: Path) -> None:
    result = faultlab("suite", "--system", str(SYSTEM_FILES["argument"]), "--examples", "0",
                      "--directory", str(tmp_path / "kept"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("PASS: 5 scenarios")
    kept = tmp_path / "kept" / "crash_after_downstream_commit"
    assert sorted(p.name for p in kept.iterdir()) == ["orders.db", "tickets.db"]


# --- every declared crash point ----------------------------------------------------------------


def _point_trace(point: str, role: str, direct: bool) -> list[Step]:
    accept = Step("accept", "op-1", PAYLOAD)
    if role == "accept":
        return [Step("accept", "op-1", PAYLOAD, crash=point), accept, Step("dispatch")]
    if role == "service" and direct:
        return [accept, Step("service", "op-1", PAYLOAD, crash=point)]
    return [accept, Step("dispatch", crash=point)]


# tickets right after the crash, for each point
TICKETS_AFTER_CRASH = {
    "during_accept": 0, "before_dispatch": 0, "after_downstream_commit": 1,
    "during_completion": 1, "service_before_commit": 0, "service_after_commit": 1,
}
# The five scenarios above already kill at during_accept, before_dispatch and
# after_downstream_commit in both modes; those cases run again only with -m slow.
IN_SCENARIOS = {"during_accept", "before_dispatch", "after_downstream_commit"}
POINT_CASES = [
    pytest.param(
        mode, point, role, direct,
        marks=[pytest.mark.slow] if point in IN_SCENARIOS else [],
        id=f"{mode}-{point}{'-direct' if direct else ''}",
    )
    for mode in MODES
    for point, role in [
        ("during_accept", "accept"), ("before_dispatch", "dispatch"),
        ("after_downstream_commit", "dispatch"), ("during_completion", "dispatch"),
        ("service_before_commit", "service"), ("service_after_commit", "service"),
    ]
    for direct in ((False, True) if role == "service" else (False,))
]


@pytest.mark.parametrize(("mode", "point", "role", "direct"), POINT_CASES)
def test_each_declared_crash_point_fires_and_recovers(
    mode: str, point: str, role: str, direct: bool, runner: Spawner,
) -> None:
    system = standalone(mode)
    assert {p.name: p.role for p in system.crash_points}[point] == role
    execution = execute(system, _point_trace(point, role, direct), runner, settle=True)
    assert execution.verdict.clean, execution.violations
    crashed = next(o for o in execution.observations if o.step.crash == point)
    assert crashed.crashed
    record = crashed.record
    if role == "service" and not direct:
        # the user's dispatcher started the service; it was the service that died
        assert record.exit_code == 4
        assert record.response is not None
        assert record.response["error"] == "downstream_failure"
        assert record.response["service"]["exit_code"] == -9
        assert record.response["service"]["pid"] != record.pid
    else:
        assert record.exit_code == -9
    assert len(crashed.snapshot.tickets) == TICKETS_AFTER_CRASH[point]
    if role == "accept":
        assert crashed.snapshot.operations == () and crashed.snapshot.outbox == ()
    final = execution.observations[-1].snapshot
    assert [(o.id, o.state, o.result) for o in final.operations] == [
        ("op-1", "complete", '{"ticket_id":1}')
    ]
    assert [(t.id, t.operation_id) for t in final.tickets] == [(1, "op-1")]
    assert final.receipts[0].result == '{"ticket_id":1}'


def test_points_not_armed_are_passed_through_in_announce_mode(runner: Spawner) -> None:
    """Every point is announced and answered; only the armed one kills."""
    execution = execute(standalone("announce"), [
        Step("accept", "op-1", PAYLOAD), Step("dispatch"), Step("dispatch"),
    ], runner)
    accept, dispatch, idle = execution.observations
    assert accept.record.exit_code == 0 and dispatch.record.exit_code == 0
    assert dispatch.record.response is not None
    assert dispatch.record.response["result"] == {"ticket_id": 1}
    assert idle.record.response == {"idle": True}


def test_statement_crash_points_are_refused_for_command_systems(runner: Spawner) -> None:
    system = standalone("argument")
    assert system.supports_statement_points is False
    with Executor(system, runner) as executor, pytest.raises(UsageError, match="statement"):
        executor.run(Step("dispatch", crash="sql:1"))


def test_snapshot_never_writes_the_users_stores(runner: Spawner, tmp_path: Path) -> None:
    system = standalone("argument")
    with Executor(system, runner, directory=tmp_path / "run") as executor:
        executor.run(Step("accept", "op-1", PAYLOAD))
        executor.run(Step("dispatch", crash="after_downstream_commit"))
        before = tree(tmp_path)
        first = system.snapshot(executor.directory)
        for _ in range(3):
            assert system.snapshot(executor.directory) == first
        assert tree(tmp_path) == before
    assert first.operations[0].state == "pending"
    assert len(first.tickets) == 1


# --- the worker CLI proxies to the command -----------------------------------------------------


def test_faultlab_worker_runs_the_users_command(
    tmp_path: Path, capfd: pytest.CaptureFixture[str],
) -> None:
    system = standalone("argument")
    system.initialise(tmp_path)
    ref = str(SYSTEM_FILES["argument"])
    payload = json.dumps(PAYLOAD)
    worker = ["worker", "accept", "--system", ref, "--directory", str(tmp_path),
              "--operation-id", "op-1"]
    # the user's worker is SIGKILLed at the point, so `faultlab worker` dies the same way
    crashed = faultlab(*worker, "--payload", payload, "--crash", "during_accept")
    assert crashed.returncode == -9
    capfd.readouterr()
    assert main([*worker, "--payload", payload]) == 0
    assert json.loads(capfd.readouterr().out.splitlines()[-1])["accepted"] is True
    assert main([*worker, "--payload", '{"other": 1}']) == 3
    assert json.loads(capfd.readouterr().out.splitlines()[-1])["error"] == "payload_conflict"
    snapshot = system.snapshot(tmp_path)
    assert [o.id for o in snapshot.operations] == ["op-1"]


# --- bad system files: one line, exit 2, nothing created or changed -----------------------------


def _example_data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(SYSTEM_FILES["argument"].read_text())
    return data


def _write(directory: Path, data: dict[str, Any], name: str = "system.json") -> Path:
    """A copy of the example's description beside a copy of its program."""
    shutil.copy(EXAMPLE / "outbox.py", directory / "outbox.py")
    path = directory / name
    path.write_text(json.dumps(data, indent=2))
    return path


def _missing_command(data: dict[str, Any]) -> None:
    del data["commands"]["service"]


def _unknown_placeholder(data: dict[str, Any]) -> None:
    data["commands"]["accept"][-1] = "{body}"


def _failing_query(data: dict[str, Any]) -> None:
    data["snapshot"]["tickets"]["query"] = "SELECT ticket_no, request_key, body FROM tickets_v2"


def _missing_store(data: dict[str, Any]) -> None:
    data["stores"]["downstream"] = "downstream.sqlite"


@pytest.mark.parametrize(("change", "words"), [
    (_missing_command, ["commands.service is missing"]),
    (_unknown_placeholder, ["commands.accept", "unknown placeholder {body}"]),
    (_failing_query, ["tickets query failed", "no such table: tickets_v2"]),
    (_missing_store, ["store downstream (downstream.sqlite) does not exist after init"]),
], ids=["missing-command", "unknown-placeholder", "failing-query", "missing-store"])
def test_bad_system_file_is_refused_by_the_cli(change: Any, words: list[str],
                                               tmp_path: Path) -> None:
    workspace = tmp_path / "work"
    workspace.mkdir()
    data = _example_data()
    change(data)
    path = _write(workspace, data, "bad.json")
    temporary = tmp_path / "tmp"
    temporary.mkdir()
    env = {**child_environment(), "TMPDIR": str(temporary)}
    before = tree(workspace)
    result = faultlab("suite", "--system", str(path), "--examples", "0",
                      "--directory", str(workspace / "kept"), "--output",
                      str(workspace / "results.json"), cwd=workspace, env=env)
    assert result.returncode == 2, result
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "bad" in result.stderr or "standalone-outbox" in result.stderr
    for word in words:
        assert word in result.stderr
    assert tree(workspace) == before
    assert list(temporary.iterdir()) == []


def _set(*keys: str, value: Any) -> Any:
    def change(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        target[keys[-1]] = value
    return change


def _delete(*keys: str) -> Any:
    def change(data: dict[str, Any]) -> None:
        target = data
        for key in keys[:-1]:
            target = target[int(key)] if isinstance(target, list) else target[key]
        del target[keys[-1]]
    return change


BAD_FILES = [
    ("unknown-key", _set("retries", value=3), ["unknown key retries"]),
    ("unknown-nested-key", _set("crash", "signal", value="KILL"), ["unknown key crash.signal"]),
    ("no-commands", _delete("commands"), ["commands is missing"]),
    ("empty-command", _set("commands", "init", value=[]), ["commands.init must be a non-empty"]),
    ("crash-in-command", _set("commands", "dispatch", value=["{python}", "x", "{crash}"]),
     ["{crash} may only appear in crash.arguments"]),
    ("payload-in-dispatch", _set("commands", "dispatch", value=["{python}", "{payload}"]),
     ["commands.dispatch[1]", "unknown placeholder {payload}"]),
    ("point-without-role", _delete("crash_points", "1", "role"),
     ["crash point 'before_dispatch' has no role"]),
    ("point-unknown-role", _set("crash_points", "1", "role", value="caller"),
     ["unknown role 'caller'"]),
    ("point-twice", lambda d: d["crash_points"].append(dict(d["crash_points"][0])),
     ["declared twice"]),
    ("point-reserved", _set("crash_points", "0", "name", value="sql:1"), ["reserved"]),
    ("no-crash-mode", _delete("crash"), ["crash is missing"]),
    ("bad-crash-mode", _set("crash", "mode", value="signal"), ["crash.mode must be one of"]),
    ("crash-without-placeholder", _set("crash", "arguments", value=["--crash"]),
     ["needs {crash}"]),
    ("program-missing", _set("commands", "init", value=["./no-such-program", "{directory}"]),
     ["commands.init", "program './no-such-program' not found"]),
    ("program-not-on-path", _set("commands", "init", value=["no-such-program-xyz"]),
     ["not found on PATH"]),
    ("program-not-executable", _set("commands", "init", value=["./outbox.py", "init"]),
     ["is not executable"]),
    ("program-depends-on-run", _set("commands", "init", value=["{directory}/x"]),
     ["may use only {python} and {system_dir}"]),
    ("unknown-store", _set("snapshot", "outbox", "store", value="orders"),
     ["unknown store 'orders'"]),
    ("missing-table", _delete("snapshot", "receipts"), ["snapshot.receipts is missing"]),
    ("store-outside", _set("stores", "caller", value="../orders.db"),
     ["inside the run directory"]),
    ("wrong-columns", _set("snapshot", "outbox", "query", value="SELECT request_key FROM requests"),
     ["outbox query returns 1 columns, expected 2"]),
    ("writing-query", _set("snapshot", "receipts", "query",
                           value="DELETE FROM idempotency_keys RETURNING 1, 2, 3"),
     ["receipts query failed", "may only read"]),
    ("init-fails", _set("commands", "init", value=["{python}", "-c", "raise SystemExit(5)"]),
     ["init command exited 5"]),
    ("env-bad-name", _set("environment", value={"NOT-A-NAME": "x"}),
     ["not an environment variable name"]),
    ("no-dedup-empty", _set("no_deduplication", value={}),
     ["no_deduplication needs arguments or environment"]),
]


@pytest.mark.parametrize(("change", "words"), [(c, w) for _, c, w in BAD_FILES],
                         ids=[name for name, _, _ in BAD_FILES])
def test_bad_system_file_is_a_usage_error(change: Any, words: list[str], tmp_path: Path) -> None:
    data = _example_data()
    change(data)
    path = _write(tmp_path, data)
    (tmp_path / "outbox.py").chmod(0o644)
    before = tree(tmp_path)
    with pytest.raises(UsageError) as raised:
        load_command_system(str(path))
    message = str(raised.value)
    assert "\n" not in message
    for word in words:
        assert word in message
    assert tree(tmp_path) == before


def test_unreadable_system_files(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="no such file"):
        load_system(str(tmp_path / "missing.json"))
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(UsageError, match="invalid JSON"):
        load_system(str(tmp_path / "broken.json"))
    (tmp_path / "list.json").write_text("[]")
    with pytest.raises(UsageError, match="must be a JSON object"):
        load_system(str(tmp_path / "list.json"))


def test_init_that_leaves_rows_is_refused(tmp_path: Path) -> None:
    data = _example_data()
    data["snapshot"]["tickets"]["query"] = "SELECT 1, 'x', '{}'"
    with pytest.raises(UsageError, match="init must create empty stores"):
        load_command_system(str(_write(tmp_path, data)))


def test_without_a_switch_deduplication_cannot_be_switched_off(
    tmp_path: Path, runner: Spawner,
) -> None:
    data = _example_data()
    del data["no_deduplication"]
    system = load_command_system(str(_write(tmp_path, data)))
    assert system.supports_no_deduplication is False
    with pytest.raises(UsageError, match="cannot switch deduplication off"):
        Executor(system, runner, deduplication=False)


def test_relative_programs_environment_and_literal_braces(tmp_path: Path,
                                                          runner: Spawner) -> None:
    """A relative program path is resolved against the file; {{ }} are literal braces."""
    script = tmp_path / "bin" / "outbox"
    script.parent.mkdir()
    script.write_text(f"#!{sys.executable}\n" + (EXAMPLE / "outbox.py").read_text())
    script.chmod(0o755)
    data = _example_data()
    for role, argv in data["commands"].items():
        data["commands"][role] = ["bin/outbox", *argv[2:]]
    data["environment"] = {"OUTBOX_NOTE": "{{literal}} {directory}"}
    system = load_command_system(str(_write(tmp_path, data)))
    assert isinstance(system, CommandSystem)
    assert system.programs["accept"] == str(script.resolve())
    env = system.environment(system.values(tmp_path))
    assert env["OUTBOX_NOTE"] == "{literal} " + str(tmp_path.resolve())
    assert substitute("{{x}}-{a}", {"a": "1"}) == "{x}-1"
    execution = execute(system, [Step("accept", "a", {"n": 1}), Step("dispatch")], runner)
    assert execution.verdict.clean
    assert execution.observations[-1].snapshot.operations[0].state == "complete"


# --- the announcement protocol against a misbehaving worker ------------------------------------

FAKE = '''\
import json, os, sqlite3, sys, time
role, directory = sys.argv[1], sys.argv[2]
behaviour = sys.argv[3] if len(sys.argv) > 3 else "ok"
if role == "init":
    with sqlite3.connect(os.path.join(directory, "c.db")) as db:
        db.executescript(
            "CREATE TABLE operations (id, payload, state, result);"
            "CREATE TABLE outbox (operation_id, state);"
            "CREATE TABLE tickets (id INTEGER PRIMARY KEY, operation_id, payload);"
            "CREATE TABLE receipts (operation_id, payload, result);")
    sys.exit(0)
with open(os.path.join(directory, "pid"), "w") as f:
    f.write(str(os.getpid()))
fd = int(os.environ.get("FAULTLAB_ANNOUNCE_FD", "-1"))
if behaviour == "undeclared":
    os.write(fd, b"reached nowhere %d\\n" % os.getpid())
elif behaviour == "foreign":
    os.write(fd, b"reached point_a 1\\n")
elif behaviour == "garbage":
    os.write(fd, b"hello\\n")
elif behaviour == "hang":
    time.sleep(60)
elif behaviour == "no-fd":
    print(json.dumps({"fd": fd}))
    sys.exit(0)
time.sleep(30)
'''


def _fake_system(tmp_path: Path, behaviour: str) -> System:
    (tmp_path / "fake.py").write_text(textwrap.dedent(FAKE))
    worker = ["{python}", "{system_dir}/fake.py"]
    tables = {
        "operations": "SELECT id, payload, state, result FROM operations",
        "outbox": "SELECT operation_id, state FROM outbox",
        "tickets": "SELECT id, operation_id, payload FROM tickets",
        "receipts": "SELECT operation_id, payload, result FROM receipts",
    }
    data = {
        "name": f"fake-{behaviour}",
        "commands": {
            "init": [*worker, "init", "{directory}"],
            "accept": [*worker, "accept", "{directory}", behaviour],
            "dispatch": [*worker, "dispatch", "{directory}", behaviour],
            "service": [*worker, "service", "{directory}", behaviour],
        },
        "crash": {"mode": "announce"},
        "crash_points": [{"name": "point_a", "role": "dispatch"}],
        "stores": {"caller": "c.db"},
        "snapshot": {t: {"store": "caller", "query": q} for t, q in tables.items()},
    }
    path = tmp_path / f"fake-{behaviour}.json"
    path.write_text(json.dumps(data))
    return load_command_system(str(path))


@pytest.mark.parametrize(("behaviour", "words"), [
    ("undeclared", "announced 'nowhere', which the system file does not declare"),
    ("foreign", "announced pid 1, which is not in the worker's process group"),
    ("garbage", "expected 'reached POINT PID'"),
])
def test_announcement_protocol_errors_end_the_worker(
    behaviour: str, words: str, tmp_path: Path, runner: Spawner,
) -> None:
    system = _fake_system(tmp_path, behaviour)
    with Executor(system, runner, directory=tmp_path / "run") as executor:
        with pytest.raises(ExecutionError, match="broke the announcement protocol") as raised:
            executor.run(Step("dispatch", crash="point_a"))
        assert words in str(raised.value)
        pid = int((executor.directory / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped, not left sleeping
        os.kill(pid, 0)


def test_a_hanging_command_is_killed_at_its_deadline(tmp_path: Path, runner: Spawner) -> None:
    system = _fake_system(tmp_path, "hang")
    with Executor(system, runner, directory=tmp_path / "run", deadline=0.5) as executor:
        with pytest.raises(ExecutionError, match="missed its 0.5s deadline"):
            executor.run(Step("dispatch"))
        pid = int((executor.directory / "pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert not any("fake.py" in c for c in children())


def test_announcement_descriptors_are_not_leaked(tmp_path: Path, runner: Spawner) -> None:
    system = _fake_system(tmp_path, "no-fd")
    before = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else 0
    with Executor(system, runner, directory=tmp_path / "run") as executor:
        for _ in range(5):
            observation = executor.run(Step("dispatch"))
            assert observation.record.exit_code == 0
            assert observation.record.response is not None
            assert observation.record.response["fd"] >= 3
    after = len(os.listdir("/proc/self/fd")) if Path("/proc/self/fd").is_dir() else 0
    assert after == before


# --- explore and replay ------------------------------------------------------------------------

(FINDING,) = (EXAMPLE / "corpus").glob("standalone-outbox-nodedup-ONE-*.json")
# A command-line system has no statement points; only its declared points are drawn.
EXPLORE = ["explore", "--system", "examples/standalone_outbox/system.json",
           "--no-statement-points", "--quiet", "--steps", "6", "--seed", "1"]


def test_a_saved_finding_replays_against_the_standalone_example() -> None:
    trace = json.loads(FINDING.read_text())
    assert trace["system"] == "examples/standalone_outbox/system.json"
    assert trace["deduplication"] is False
    result = faultlab("replay", str(FINDING.relative_to(ROOT)), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ONE: operation op-1 has 2 tickets" in result.stdout
    assert "matches" in result.stdout


@pytest.mark.slow  # about 25 s here: every step starts one or two Python interpreters
def test_explore_finds_nothing_with_deduplication(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab(*EXPLORE, "--examples", "10", "--corpus", str(corpus), cwd=ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert not corpus.exists() or list(corpus.iterdir()) == []


@pytest.mark.slow  # about 75 s here: Hypothesis shrinks with real processes
def test_explore_catches_missing_deduplication_and_the_finding_replays(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab(*EXPLORE, "--no-deduplication", "--examples", "5", "--corpus",
                      str(corpus), cwd=ROOT)
    assert result.returncode == 1, result.stdout + result.stderr
    (found,) = corpus.iterdir()
    trace = json.loads(found.read_text())
    assert trace["expected"]["invariants"][0] == "ONE"
    assert trace["deduplication"] is False
    assert len(trace["steps"]) == 3
    # a trace outside the project: its system runs only when named
    replay = faultlab("replay", str(found), "--system", EXPLORE[2], cwd=ROOT)
    assert replay.returncode == 0, replay.stdout + replay.stderr
