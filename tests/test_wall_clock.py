"""Virtual time for code that reads the wall clock: workers under libfaketime.

The issue's scenario, as a new user meets it: a relay built the way outbox
libraries are (it reads ``time.time()``) retries the entry of a dispatcher that
died after a 5 s back-off. On the real clock the final recovery runs at once and
reports ``LIVE`` although the retry would complete the work 5 s later; on the
virtual wall clock the recovery's clock advance reaches the retry. Work whose
retry lies beyond the horizon is still reported lost.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import NoReturn

import pytest

from faultlab.base import wall_clock
from faultlab.base.clock import SETTLE_HORIZON
from faultlab.base.errors import UsageError
from faultlab.process import spawn
from faultlab.process.spawn import spawner
from faultlab.run.executor import Executor, execute
from faultlab.run.observation import Execution
from faultlab.search.rounds import Plan, run_stream
from faultlab.stores.sqlite import scratch_directory
from faultlab.system import load_system
from faultlab.trace import Step
from tests.conftest import require_service
from tests.test_starter import _parent_of

P = {"title": "backlog"}
#: Accept, a dispatcher claims (the entry is hidden for the back-off) and is SIGKILLed.
TRACE = [Step("accept", "op-1", P, lane=1), Step("dispatch", lane=1, hold=True),
         Step("kill", lane=1)]


@pytest.fixture
def faketime() -> None:
    if wall_clock.library() is None:
        require_service("libfaketime", "libfaketime is not installed (pip install "
                        "'faultlab[faketime]' or apt-get install libfaketime)")


def test_workers_read_faultlabs_clock_through_time_time(faketime: None) -> None:
    with Executor(load_system("systems_for_tests:WallClockRetryOutbox"), concurrency=2) as ex:
        ex.run(Step("tick", ticks=7))
        (_, record), = ex.run(Step("dispatch", lane=2)).exited
        assert record.exit_code == 0 and record.response is not None
        assert record.response["wall_time"] == wall_clock.EPOCH + 7
        assert record.response["idle"] is True


def test_lanes_on_the_virtual_wall_clock_are_forked_by_a_helper_under_libfaketime(
        faketime: None) -> None:
    """A lane's worker is forked (not exec'd: an interpreter's start each) by the lanes'
    helper, started under libfaketime as a fork server is; it reads the trace's clock, and
    the helper's libfaketime area goes with the helper."""
    system = load_system("systems_for_tests:WallClockRetryOutbox")
    ours = f"faultlab-faketime-{os.getpid()}-"  # libfaketime areas this process made
    with spawner("fork") as runner:
        with Executor(system, runner, concurrency=2) as ex:
            ex.run(Step("accept", "op-1", P, lane=1))
            ex.run(Step("tick", ticks=3))
            ex.run(Step("dispatch", lane=1, hold=True))
            worker = ex.lanes[1].pid
            helper = _parent_of(worker)
            command = Path(f"/proc/{worker}/cmdline").read_bytes()
            assert helper != os.getpid() and b"\x00worker\x00" not in command  # not exec'd
            assert "libfaketime" in Path(f"/proc/{helper}/maps").read_text()
            (_, record), = ex.run(Step("finish", lane=1)).exited
            assert record.exit_code == 0, record.stderr
            assert (record.response or {})["wall_time"] == wall_clock.EPOCH + 3
        assert Path(f"/proc/{helper}").exists()  # one helper for the run, not the trace
    assert not Path(f"/proc/{helper}").exists()
    assert [name for name in os.listdir("/dev/shm") if ours in name] == []


def test_a_retry_after_a_back_off_is_not_reported_lost(faketime: None) -> None:
    system = load_system("systems_for_tests:WallClockRetryOutbox")
    result = execute(system, TRACE, concurrency=2, settle=True)
    assert result.verdict.clean, result.final
    killed = result.observations[2].exited[0][1]
    assert killed.killed
    recovery = [o for o in result.observations if o.phase == "settle" and o.exited]
    last = recovery[-1].exited[0][1].response or {}
    assert last["wall_time"] == wall_clock.EPOCH + SETTLE_HORIZON
    snapshot = result.observations[-1].snapshot
    assert [op.state for op in snapshot.operations] == ["complete"]
    assert len(snapshot.tickets) == 1


def test_work_dropped_for_good_is_still_reported(faketime: None) -> None:
    result = execute(load_system("systems_for_tests:WallClockDroppedOutbox"), TRACE,
                     concurrency=2, settle=True)
    assert result.verdict.invariants == ("LIVE",)


def test_control_on_the_real_clock_the_retry_is_reported_lost() -> None:
    """Without the virtual wall clock the same library is reported LIVE: the retry is
    5 real seconds away when recovery runs (what the virtual wall clock fixes)."""
    result = execute(load_system("systems_for_tests:RealClockRetryOutbox"), TRACE,
                     concurrency=2, settle=True)
    assert result.verdict.invariants == ("LIVE",)


def test_a_missing_named_library_is_one_line_error(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    """A FAULTLAB_LIBFAKETIME naming no file is named as such, not as libfaketime missing
    (it may well be installed)."""
    missing = tmp_path / "missing.so"
    monkeypatch.setenv(wall_clock.LIBRARY_ENV, str(missing))
    scratch = Path(scratch_directory() or tempfile.gettempdir())
    before = set(scratch.glob("faultlab-lanes-*"))
    with pytest.raises(UsageError) as raised:
        with Executor(load_system("systems_for_tests:WallClockRetryOutbox"), concurrency=2):
            pass
    assert str(raised.value) == (
        "this system asks for a virtual wall clock (virtual_wall_clock) and "
        f"{wall_clock.LIBRARY_ENV} names {str(missing)!r}, which is not a file")
    # nothing left behind (another test running beside this one may remove its own)
    assert set(scratch.glob("faultlab-lanes-*")) <= before


def test_no_library_found_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(wall_clock.LIBRARY_ENV, raising=False)
    monkeypatch.setattr(wall_clock, "library", lambda: None)  # none on this machine
    with pytest.raises(UsageError, match="libfaketime is not installed: pip install") as raised:
        wall_clock.require_library()
    assert "\n" not in str(raised.value)


def _command_system(tmp_path: Path, wall: object) -> Path:
    """The standalone example's system file, its dispatcher replaced by a program that
    reports the wall time it reads, with ``virtual_wall_clock`` set to ``wall``."""
    example = Path(__file__).resolve().parent.parent / "examples" / "standalone_outbox"
    document = json.loads((example / "system.json").read_text())
    document["commands"] = {
        role: [part.replace("{system_dir}", str(example)) for part in argv]
        for role, argv in document["commands"].items()
    }
    document["commands"]["dispatch"] = [
        "{python}", "-c",
        "import json, time; print(json.dumps(dict(idle=True, wall_time=time.time())))",
    ]
    document["virtual_wall_clock"] = wall
    path = tmp_path / "system.json"
    path.write_text(json.dumps(document))
    return path


def test_a_command_line_system_switches_it_on_in_its_file(faketime: None,
                                                          tmp_path: Path) -> None:
    system = load_system(str(_command_system(tmp_path, True)))
    with Executor(system, concurrency=1, laned=True) as ex:
        ex.run(Step("tick", ticks=12))
        (_, record), = ex.run(Step("dispatch", lane=1)).exited
        assert record.exit_code == 0, record.stderr
        assert (record.response or {})["wall_time"] == wall_clock.EPOCH + 12


def test_a_bad_virtual_wall_clock_value_is_one_line_error(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="virtual_wall_clock must be true or false"):
        load_system(str(_command_system(tmp_path, "yes")))


#: The same story as a sequential trace: the dispatcher dies after the downstream
#: committed, and the entry it claimed is hidden for the back-off.
SEQUENTIAL = [Step("accept", "op-1", P), Step("dispatch", crash="after_downstream_commit")]


def _sequential(name: str) -> Execution:
    with spawner("fork") as runner:
        return execute(load_system(f"systems_for_tests:{name}"), SEQUENTIAL, runner,
                       settle=True)


def test_sequential_traces_run_on_the_virtual_wall_clock_too(faketime: None) -> None:
    """The issue's new user ran a sequential exploration: the recovery's horizon reaches
    the retry there too, and the workers ran under libfaketime (wall time 0 during the
    trace, the horizon during recovery)."""
    result = _sequential("WallClockRetryOutbox")
    assert result.verdict.clean, result.violations
    crashed, *recovery = result.observations[1:]
    assert crashed.record.killed
    assert [o.phase for o in recovery] == ["settle"] * len(recovery) and recovery
    assert (recovery[-1].record.response or {})["wall_time"] == wall_clock.EPOCH + SETTLE_HORIZON
    assert [op.state for op in recovery[-1].snapshot.operations] == ["complete"]
    assert len(recovery[-1].snapshot.tickets) == 1


def test_sequential_work_dropped_for_good_is_still_reported(faketime: None) -> None:
    assert _sequential("WallClockDroppedOutbox").verdict.invariants == ("LIVE",)


def test_sequential_control_on_the_real_clock_is_reported() -> None:
    assert _sequential("RealClockRetryOutbox").verdict.invariants == ("LIVE",)


def test_a_command_line_system_reads_it_in_sequential_traces(faketime: None,
                                                             tmp_path: Path) -> None:
    """Tick 0 through a sequential trace's steps, the horizon in its recovery."""
    system = load_system(str(_command_system(tmp_path, True)))
    with spawner("fork") as runner:
        result = execute(system, [Step("dispatch")], runner)
    record = result.observations[0].record
    assert record.exit_code == 0, record.stderr
    assert (record.response or {})["wall_time"] == wall_clock.EPOCH


def _no_exec(*args: object, **kwargs: object) -> NoReturn:
    raise AssertionError("a worker was exec'd")


def test_a_virtual_wall_clock_system_is_forked_from_a_fork_server_under_libfaketime(
        faketime: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """No worker is exec'd: they are forked from a fork server started under libfaketime,
    and each reads its own trace's clock (tick 0 during the steps, the horizon in the
    recovery), through time.time(), as an exec'd one did."""
    monkeypatch.setattr(spawn, "exec_worker", _no_exec)
    system = load_system("systems_for_tests:WallClockRetryOutbox")
    with spawner("fork") as runner:
        first = execute(system, SEQUENTIAL, runner, settle=True)
        second = execute(system, [Step("accept", "op-1", P), Step("dispatch")], runner)
        servers = runner.server_pids
        preloaded = [pid for pid in servers
                     if "libfaketime" in Path(f"/proc/{pid}/maps").read_text()]
    assert first.verdict.clean, first.violations
    assert len(servers) == 1 and preloaded == servers
    crashed, *recovery = first.observations[1:]
    assert crashed.record.killed
    assert (recovery[-1].record.response or {})["wall_time"] == (
        wall_clock.EPOCH + SETTLE_HORIZON)
    dispatched = second.observations[1].record
    assert dispatched.exit_code == 0, dispatched.stderr
    assert (dispatched.response or {})["wall_time"] == wall_clock.EPOCH  # a fresh clock
    assert (dispatched.response or {})["service"]["exit_code"] == 0


def test_a_virtual_wall_clock_system_explores_in_fork_mode(
        faketime: None, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """An exploration of it forks every worker (exec mode ran 1.2 to 1.7 steps/s: an
    interpreter start per worker); the rate is printed, and bounded well above exec's."""
    monkeypatch.setattr(spawn, "exec_worker", _no_exec)
    system = load_system("systems_for_tests:WallClockRetryOutbox")
    plan = Plan(system=system.ref, deduplication=True, seed=0, examples=5, steps=6,
                statement_points=True, hypothesis_shrink=False, spawn="fork")
    with spawner("fork") as runner:
        result, _ = run_stream(system, runner, plan, 0)
        mode = runner.mode
    rate = result.totals.steps / (result.ended - result.began)
    with capsys.disabled():
        print(f"\nvirtual wall clock, spawn mode {mode}: {result.totals.steps} steps, "
              f"{rate:.1f} steps/s")
    assert mode == "fork" and result.totals.steps > 0
    assert rate > 4.0  # an exec'd worker alone takes 250 ms


def test_the_clock_file_holds_whole_seconds_exactly(tmp_path: Path) -> None:
    """libfaketime follows the file's modification time: setting it is one utime."""
    path = tmp_path / wall_clock.CLOCK_FILE
    wall_clock.set_file(path, 61)
    assert path.stat().st_mtime_ns == (wall_clock.EPOCH + 61) * 1_000_000_000
    wall_clock.set_file(path, 7.0)
    assert path.stat().st_mtime_ns == (wall_clock.EPOCH + 7) * 1_000_000_000
    with pytest.raises(ValueError, match="whole seconds"):
        wall_clock.set_file(path, 7.5)
    assert path.stat().st_mtime_ns == (wall_clock.EPOCH + 7) * 1_000_000_000


def test_a_fork_server_under_libfaketime_follows_its_library_until_a_child_names_a_file(
) -> None:
    load = {"LD_PRELOAD": "/lib/libfaketime.so.1 /lib/other.so", **wall_clock.SETTINGS}
    assert wall_clock.server_variables(load) == {
        wall_clock.FOLLOW_VARIABLE: "/lib/libfaketime.so.1"}
    assert wall_clock.server_variables({"LD_PRELOAD": "/lib/other.so"}) == {}
    environment = (("LD_PRELOAD", "/lib/libfaketime.so.1"), *wall_clock.SETTINGS.items(),
                   (wall_clock.FOLLOW_VARIABLE, "/trace/faultlab-faketime"))
    fixed = dict(spawn.server_environment(environment) or ())
    assert fixed[wall_clock.FOLLOW_VARIABLE] == "/lib/libfaketime.so.1"
    assert fixed["FAKETIME"] == "%x0"


def _libfaketime_files(*pids: int) -> list[str]:
    """What libfaketime leaves in /dev/shm when a process that made its own area dies
    without exiting normally (its names carry the pid), and faultlab's areas of this
    process."""
    names = [f"faketime_shm_{pid}" for pid in pids] + [
        f"sem.faketime_sem_{pid}" for pid in pids]
    left = [name for name in names if Path("/dev/shm", name).exists()]
    return left + sorted(p.name for p in Path("/dev/shm").glob(
        f"*faultlab-faketime-{os.getpid()}-*"))


@pytest.mark.parametrize("mode", ["lanes", "exec", "fork"])
def test_a_killed_worker_under_libfaketime_leaves_nothing_in_dev_shm(
        faketime: None, mode: str) -> None:
    """Each worker started under libfaketime uses an area faultlab made (FAKETIME_SHARED)
    and removes with the trace or the fork server: before, an exec'd worker SIGKILLed at a
    crash point left libfaketime's own semaphore and memory, named by its pid, in /dev/shm
    (two more files for every such crash)."""
    system = load_system("systems_for_tests:WallClockRetryOutbox")
    servers: list[int] = []
    if mode == "lanes":
        lanes = execute(system, TRACE, concurrency=2, settle=True)
        killed = lanes.observations[2].exited[0][1]
    else:
        with spawner(mode) as runner:
            sequential = execute(system, SEQUENTIAL, runner, settle=True)
            servers = list(runner.server_pids)
        killed = sequential.observations[1].record
    assert killed.killed and killed.pid > 0
    assert _libfaketime_files(killed.pid, *servers) == []
