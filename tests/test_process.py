"""Process hygiene: no child, zombie, descriptor or temporary directory outlives a run;
a worker that hangs is killed at its deadline, with its whole process group."""

from __future__ import annotations

import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from faultlab.base.errors import ExecutionError
from faultlab.cli import main
from faultlab.process import spawn
from faultlab.process.records import ProcessRecord, WorkerSpec, parse_response
from faultlab.process.spawn import Spawner, child_environment, spawner
from faultlab.run.executor import execute
from faultlab.system import System, builtin_names, load_system
from faultlab.trace import Step

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="needs Linux /proc")

PAYLOAD = {"title": "hang"}


def processes() -> dict[int, tuple[str, int, int]]:
    """Every visible process: pid -> (state, ppid, process group)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue  # exited while we looked
        fields = stat.rsplit(")", 1)[1].split()
        found[int(entry)] = (fields[0], int(fields[1]), int(fields[2]))
    return found


def descendants(root: int) -> dict[int, str]:
    """Every process below root (pid -> state), zombies included."""
    table = processes()
    found: dict[int, str] = {}
    frontier = [root]
    while frontier:
        parent = frontier.pop()
        for pid, (state, ppid, _) in table.items():
            if ppid == parent and pid not in found:
                found[pid] = state
                frontier.append(pid)
    return found


def shape(root: int) -> dict[int | str, str]:
    """Descendants of root, with a fork server's waiting spares named by their role, not
    their pids.

    Between workers a fork server (a child of root) has one or two children: the spare it
    forked ahead for the next worker, a new process after every worker, in a process group
    of its own; and, once a dispatcher asked for a service, the spare for the next
    service, a new process after every service, in the server's group. Anything else
    below root is listed by pid, so a leftover worker or zombie still shows. A process is
    "Z" (a zombie) or "alive": whether it is running or sleeping at the moment of the
    look is timing (a fork server forking its next spare), not a leftover. Nor is a worker
    whose process is exiting (answered as it ended its action, its memory still being
    unmapped; the server reaps it next, and one it did not would show as a zombie).
    """
    table = processes()
    found = descendants(root)
    named: dict[int | str, str] = {}
    for pid, state in found.items():
        if state != "Z" and exiting(pid):
            continue
        parent = table[pid][1] if pid in table else -1
        is_spare = parent in found and table.get(parent, ("", -1, 0))[1] == root
        role = "service spare" if table.get(pid, ("", 0, 0))[2] == parent else "spare"
        key: int | str = f"{role} of {parent}" if is_spare and state != "Z" else pid
        if key in named:
            key = pid  # a second waiting child in the same role is not a spare
        named[key] = "Z" if state == "Z" else "alive"
    return named


#: The kernel's flag for a process that is exiting (``PF_EXITING``, /proc/PID/stat's flags).
PF_EXITING = 0x4


def exiting(pid: int) -> bool:
    """Whether process ``pid`` has begun to exit (a zombie has too)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False  # gone already
    return bool(int(fields[6]) & PF_EXITING)


def in_group(pgid: int) -> dict[int, str]:
    return {pid: state for pid, (state, _, group) in processes().items() if group == pgid}


def alive(pid: int) -> bool:
    """Running or sleeping (a zombie has already died)."""
    info = processes().get(pid)
    return info is not None and info[0] != "Z"


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def wait_until(condition: Callable[[], bool], seconds: float = 5.0) -> bool:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.02)
    return condition()


@pytest.fixture
def private_tmp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """Point every temporary directory (here and in children) at an empty private one,
    and record the ones faultlab makes, so a concurrent run elsewhere cannot interfere."""
    directory = tmp_path / "tmp"
    directory.mkdir()
    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def spy(*args: Any, **kwargs: Any) -> str:
        path = real_mkdtemp(*args, **kwargs)
        made.append(path)
        return path

    monkeypatch.setenv("TMPDIR", str(directory))
    monkeypatch.setattr(tempfile, "tempdir", str(directory))
    monkeypatch.setattr(tempfile, "mkdtemp", spy)
    yield {"directory": directory, "made": made}


def _check_suite_leaves_nothing(mode: str, private_tmp: dict[str, Any],
                                capsys: pytest.CaptureFixture[str]) -> None:
    me = os.getpid()
    children_before = shape(me)
    # another test's session-wide fork server may hold an orphan it reaps at its next
    # request: only zombies this run makes count
    zombies_before = {pid for pid, state in descendants(me).items() if state == "Z"}
    fds_before = open_fds()
    assert main(["suite", "--examples", "0", "--spawn", mode]) == 0
    assert capsys.readouterr().out.splitlines()[-1].startswith("PASS: 5 scenarios")
    leftover = {pid: state for pid, state in shape(me).items()
                if pid not in children_before}
    assert leftover == {}, f"processes left behind: {leftover}"
    assert {pid for pid, state in descendants(me).items() if state == "Z"} <= zombies_before
    assert open_fds() == fds_before
    made = private_tmp["made"]
    stores = [path for path in made
              if not Path(path).name.startswith("faultlab-hypothesis-")]  # Hypothesis's own
    assert len(stores) == 5  # one fresh store directory per scenario ...
    assert all(Path(path).name.startswith("faultlab-") for path in made)
    assert not any(Path(path).exists() for path in made)  # ... and none left
    assert list(private_tmp["directory"].iterdir()) == []


def test_fork_suite_leaves_no_process_fd_or_temp_dir(
    private_tmp: dict[str, Any], capsys: pytest.CaptureFixture[str],
) -> None:
    _check_suite_leaves_nothing("fork", private_tmp, capsys)


@pytest.mark.slow
def test_exec_suite_leaves_no_process_fd_or_temp_dir(
    private_tmp: dict[str, Any], capsys: pytest.CaptureFixture[str],
) -> None:
    _check_suite_leaves_nothing("exec", private_tmp, capsys)


@pytest.fixture(params=["fork", "exec"])
def warm_spawner(request: pytest.FixtureRequest, reference: System) -> Spawner:
    runner: Spawner = request.getfixturevalue(f"{request.param}_spawner")
    # the fork server is up before we count ...
    warm_up = execute(reference, [Step("dispatch")], runner).observations[0].record.pid
    # ... and has reaped that worker: it answers as the worker ends its action and reaps
    # it right after, so a look in between can still see it (not yet exiting), and the
    # next look, without it, would differ by a process no test made
    assert wait_until(lambda: warm_up not in processes())
    return runner


def test_a_hanging_worker_is_killed_at_its_deadline(
    warm_spawner: Spawner, private_tmp: dict[str, Any],
) -> None:
    system = load_system("systems_for_tests:HangingOutbox")
    me = os.getpid()
    before = shape(me)
    started = time.monotonic()
    with pytest.raises(ExecutionError) as caught:
        execute(system, [Step("accept", "op-1", PAYLOAD)], warm_spawner, deadline=1.0)
    elapsed = time.monotonic() - started
    message = str(caught.value)
    assert 1.0 <= elapsed < 10, elapsed
    assert "deadline" in message and "1s" in message
    match = re.search(r"worker pid (\d+)", message)
    assert match is not None, message
    pid = int(match.group(1))
    assert pid not in processes()  # killed and reaped, not a zombie
    assert in_group(pid) == {}
    assert shape(me) == before
    assert [Path(p).exists() for p in private_tmp["made"]] == [False]  # stores removed


def test_the_deadline_kills_the_workers_whole_group(
    warm_spawner: Spawner, tmp_path: Path, reference: System,
) -> None:
    reference.initialise(tmp_path)
    spec = WorkerSpec(
        system="systems_for_tests:HangingFamilyOutbox", role="accept", directory=str(tmp_path),
        operation_id="op-1", payload='{"title":"hang"}',
        # an exec'd interpreter needs more than a second to start on a loaded machine
        # (seen: 1.2-1.9 s), and must print its response before the deadline hits
        deadline=1.0 if warm_spawner.mode == "fork" else 4.0,
    )
    started = time.monotonic()
    record: ProcessRecord = warm_spawner.run(spec)
    assert time.monotonic() - started < 10
    assert record.timed_out
    assert record.exit_code == -9
    assert "missed its deadline" in record.stderr
    assert record.response is not None
    assert record.response["worker"] == record.pid
    grandchild = record.response["grandchild"]
    assert grandchild != record.pid
    assert not alive(record.pid)
    assert wait_until(lambda: not alive(grandchild)), "the worker's own child survived"
    assert wait_until(lambda: not any(s != "Z" for s in in_group(record.pid).values()))
    # the next run reaps whatever the killed group left to faultlab (only the killed
    # group's pids are asked about: another test's worker may be ending in this process)
    execute(reference, [Step("dispatch")], warm_spawner)
    killed = {record.pid, grandchild}
    assert wait_until(lambda: not killed & set(descendants(os.getpid()))), (
        descendants(os.getpid()))


def test_a_forked_dispatchers_service_is_a_spare_of_its_fork_server_in_its_group(
    fork_spawner: Spawner,
) -> None:
    """A fork-mode dispatcher's service is forked by the fork server (ahead of time, from
    its clean image), not by the dispatcher, and runs in the dispatcher's process group;
    the dispatcher gets its record as from a child of its own, once per call."""
    system = load_system("systems_for_tests:FamilyOutbox")
    steps = [Step("accept", "op-1", PAYLOAD), Step("accept", "op-2", PAYLOAD),
             Step("dispatch"), Step("dispatch"), Step("dispatch")]
    observations = execute(system, steps, fork_spawner).observations
    server = fork_spawner.server_pid
    services = []
    for observation in observations[2:4]:
        record = observation.record
        assert record.exit_code == 0 and record.response is not None
        dispatcher = record.response["dispatcher"]
        assert dispatcher == [record.pid, record.pid]  # its own group's leader
        service_pid = record.response["service"]["pid"]
        # pid, parent, group: the fork server's child, in the dispatcher's group
        assert record.response["families"] == [[service_pid, server, record.pid]]
        services.append(service_pid)
    assert len(set(services)) == 2 and not set(services) & {o.record.pid for o in observations}
    assert observations[4].record.response is not None
    assert observations[4].record.response["families"] == []  # nothing left to deliver


def test_a_fork_server_replaces_a_spare_service_that_died(tmp_path: Path) -> None:
    """A spare service killed from outside while it waits (reaped by the server as an
    orphan) is replaced when a dispatcher asks: the dispatch delivers, nothing hangs."""
    system = load_system("systems_for_tests:FamilyOutbox")
    with spawner("fork") as runner:
        execute(system, [Step("accept", "op-1", PAYLOAD), Step("dispatch")], runner)
        server = runner.server_pid
        assert server is not None
        spares = [pid for pid, (_, ppid, group) in processes().items()
                  if ppid == server and group == server]
        assert len(spares) == 1  # the service spare stays in the server's group
        os.kill(spares[0], signal.SIGKILL)  # a process of this test's own fork server
        assert wait_until(lambda: processes().get(spares[0], ("Z",))[0] == "Z")
        started = time.monotonic()
        observations = execute(system, [Step("accept", "op-2", PAYLOAD), Step("dispatch")],
                               runner).observations
        assert time.monotonic() - started < 5
        record = observations[1].record
        assert record.exit_code == 0 and record.response is not None
        assert record.response["families"][0][1:] == [server, record.pid]
        assert record.response["service"]["pid"] != spares[0]
    assert spares[0] not in processes()


def _state_and_start(pid: int) -> tuple[str, str] | None:
    """A process's state and start time (/proc/PID/stat), or None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return fields[0], fields[19]


def _running_since(pid: int, started: str) -> bool:
    """Whether the process ``pid`` that started at ``started`` still runs: not gone, not
    a zombie, not another process that took its pid since."""
    now = _state_and_start(pid)
    return now is not None and now[0] != "Z" and now[1] == started


def test_a_fork_server_killed_from_outside_takes_its_worker_and_spares_with_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The fork server killed from outside (by hand, or by the kernel's out-of-memory
    killer) while its worker runs: the run fails, and the worker and the spares die with
    the server (a parent-death signal each spare asked for as it was forked). Before, the
    worker ran on, orphaned, in a group of its own that nothing else knew of (the spare
    ended, seeing its spec's pipe close)."""
    witnesses = tmp_path / "witnesses"
    witnesses.mkdir()
    monkeypatch.setenv("FAULTLAB_TEST_WITNESS", str(witnesses))  # the server inherits it
    stores = tmp_path / "stores"
    stores.mkdir()
    load_system("reference").initialise(stores)
    server = spawn.ForkServer()
    watching = WorkerSpec(system="systems_for_tests:StoreWatchingOutbox", role="accept",
                          directory=str(stores), operation_id="op-1",
                          payload='{"title":"x"}', deadline=60)
    seen: dict[int, str] = {}  # the server's children as it was killed: pid -> start time

    def kill_the_server() -> None:
        try:
            wait_until(lambda: (witnesses / "watching").exists(), 30)
            for pid, (_, parent, _) in processes().items():
                now = _state_and_start(pid) if parent == server.pid else None
                if now is not None:  # a child of the server that had not ended as we looked
                    seen[pid] = now[1]
        finally:
            os.kill(server.pid, signal.SIGKILL)  # this test's own fork server, whatever came

    killer = threading.Thread(target=kill_the_server)
    try:
        killer.start()
        with pytest.raises(ExecutionError, match=r"the fork server \(pid \d+\) died"):
            server.run(watching)
    finally:
        killer.join()
        server.close()
    worker = int((witnesses / "watching").read_text().split()[1])
    assert worker in seen and len(seen) >= 2, seen  # and the spare forked while it runs
    assert wait_until(lambda: not any(_running_since(p, s) for p, s in seen.items())), [
        pid for pid, started in seen.items() if _running_since(pid, started)]


def test_an_exec_mode_dispatchers_service_is_its_own_child(exec_spawner: Spawner) -> None:
    system = load_system("systems_for_tests:FamilyOutbox")
    observations = execute(system, [Step("accept", "op-1", PAYLOAD), Step("dispatch")],
                           exec_spawner).observations
    record = observations[1].record
    assert record.response is not None
    service_pid = record.response["service"]["pid"]
    assert record.response["families"] == [[service_pid, record.pid, record.pid]]


def test_values_that_look_like_options_reach_an_exec_mode_worker_as_values(
        exec_spawner: Spawner, reference: System) -> None:
    """An id "--crash" and a payload -1e300 are values: as separate arguments argparse
    took them for options, and a valid trace failed only under --spawn exec (exit 3)."""
    steps = [Step("accept", "--crash", -1e300), Step("dispatch")]
    result = execute(reference, steps, exec_spawner, settle=True)
    records = [observation.record for observation in result.observations]
    assert [record.exit_code for record in records] == [0, 0]
    assert records[0].response is not None
    assert records[0].response["operation_id"] == "--crash"
    assert result.verdict.clean, result.verdict


def test_a_dispatchers_deadline_kills_the_service_it_waits_for(
    warm_spawner: Spawner, tmp_path: Path, reference: System,
) -> None:
    system = load_system("systems_for_tests:HangingServiceOutbox")
    system.initialise(tmp_path)
    accepted = warm_spawner.run(WorkerSpec(
        system=system.ref, role="accept", directory=str(tmp_path), operation_id="op-1",
        payload='{"title":"hang"}'))
    assert accepted.exit_code == 0
    started = time.monotonic()
    record = warm_spawner.run(WorkerSpec(
        system=system.ref, role="dispatch", directory=str(tmp_path),
        deadline=1.0 if warm_spawner.mode == "fork" else 4.0))
    assert time.monotonic() - started < 10
    assert record.timed_out and record.exit_code == -9
    service = int((tmp_path / "service.pid").read_text())
    assert service != record.pid
    assert wait_until(lambda: not alive(service)), "the service outlived its dispatcher"
    # the spawner goes on, and what the killed group left is reaped by the next run
    execution = execute(reference, [Step("accept", "op-2", PAYLOAD), Step("dispatch")],
                        warm_spawner)
    assert [o.record.exit_code for o in execution.observations] == [0, 0]
    assert wait_until(lambda: not {record.pid, service} & set(descendants(os.getpid())))


def test_only_the_late_worker_is_killed(warm_spawner: Spawner, reference: System) -> None:
    """A deadline miss is that worker's failure: the spawner keeps working afterwards."""
    system = load_system("systems_for_tests:HangingOutbox")
    with pytest.raises(ExecutionError, match="deadline"):
        execute(system, [Step("accept", "op-1", PAYLOAD)], warm_spawner, deadline=0.5)
    execution = execute(reference, [Step("accept", "op-1", PAYLOAD), Step("dispatch")],
                        warm_spawner)
    assert [o.record.exit_code for o in execution.observations] == [0, 0]
    assert execution.observations[-1].record.response is not None
    assert execution.observations[-1].record.response["result"] == {"ticket_id": 1}


def test_a_crashed_worker_reports_minus_nine(fork_spawner: Spawner, reference: System) -> None:
    (crashed,) = execute(reference, [Step("accept", "op-1", PAYLOAD, crash="during_accept")],
                         fork_spawner).observations
    assert crashed.record.exit_code == -9 and crashed.record.killed
    assert not crashed.record.timed_out
    assert crashed.record.pid not in processes()


def test_spawners_are_the_modes_they_say(fork_spawner: Spawner, exec_spawner: Spawner) -> None:
    assert (fork_spawner.mode, exec_spawner.mode) == ("fork", "exec")
    with pytest.raises(ValueError, match="unknown spawn mode"):
        Spawner("thread")  # type: ignore[arg-type]


def test_a_forked_worker_is_answered_once_its_files_are_closed_and_reaped_before_the_next(
    fork_spawner: Spawner, tmp_path: Path,
) -> None:
    """A worker that finished its action closes every file it holds and says its status
    before its exit unmaps its memory: its record may come while it is still exiting, but
    never while it holds a lock, and the next worker runs only once it is reaped."""
    system = load_system("systems_for_tests:LockLeavingOutbox")
    system.initialise(tmp_path)

    def accept(operation_id: str, payload: dict[str, Any]) -> ProcessRecord:
        return fork_spawner.run(WorkerSpec(
            system=system.ref, role="accept", directory=str(tmp_path),
            operation_id=operation_id, payload=json.dumps(payload)))

    first = accept("op-1", {"title": "lock"})
    assert first.exit_code == 0 and first.response is not None
    assert first.response["worker"] == first.pid
    with open(tmp_path / "held.lock", "r+b") as held:  # the worker's lock is released ...
        fcntl.lockf(held, fcntl.LOCK_EX | fcntl.LOCK_NB)  # ... or this raises
    second = accept("op-2", {"title": "lock", "previous": first.pid})
    assert second.exit_code == 0 and second.response is not None
    assert second.response == {"worker": second.pid, "previous_in_proc": False}


def test_a_forked_worker_with_a_second_thread_is_answered_only_once_reaped(
    fork_spawner: Spawner, tmp_path: Path,
) -> None:
    """A worker whose process still has another thread could act after its descriptors
    were closed: it says no status, and the server answers only once it has exited and
    been reaped (its pid is gone from /proc when the record comes)."""
    system = load_system("systems_for_tests:ThreadLeavingOutbox")
    system.initialise(tmp_path)
    for number in range(3):
        record = fork_spawner.run(WorkerSpec(
            system=system.ref, role="accept", directory=str(tmp_path),
            operation_id=f"op-{number}", payload='{"title": "thread"}'))
        assert record.exit_code == 0 and record.response is not None
        assert record.response["worker"] == record.pid
        assert record.pid not in processes()


def _announcing_child(status: int, killed: bool) -> tuple[int, int, int]:
    """Start a child that says ``status`` on a status pipe and closes its stdout, then
    exits with it or (``killed``) SIGKILLs itself: (pid, stdout's read end, the status
    pipe's read end). A fresh interpreter rather than a fork of this (threaded) process."""
    out_r, out_w = os.pipe()
    status_r, status_w = os.pipe()
    program = (f"import os, signal; os.write({status_w}, bytes(({status},))); os.close(1); "
               + ("os.kill(os.getpid(), signal.SIGKILL)" if killed else f"os._exit({status})"))
    try:
        child = subprocess.Popen([sys.executable, "-c", program], stdout=out_w,
                                 pass_fds=(status_w,))
    finally:
        os.close(out_w)
        os.close(status_w)
    child.returncode = 0  # reaped by the test, not by Popen
    return child.pid, out_r, status_r


@pytest.mark.parametrize("killed", [False, True], ids=["exits-as-it-said", "killed-after"])
def test_a_child_that_ends_otherwise_than_it_said_breaks_the_run(killed: bool) -> None:
    """The fork server answers with the status a worker said and reaps it after: a process
    that then ends otherwise (here it SIGKILLs itself after saying 3) is reported as a
    broken run, never passed off as the status it said."""
    pid, out_r, status_r = _announcing_child(3, killed)
    try:
        outputs, status, timed_out, exiting = spawn._collect_announced(
            pid, {out_r: "stdout"}, 5.0, False, announced=status_r)
    finally:
        os.close(status_r)
    assert (outputs, os.waitstatus_to_exitcode(status), timed_out, exiting) == (
        {"stdout": b""}, 3, False, True)
    children = spawn._Children(exiting=[(pid, 3)])
    children.confirm()
    assert children.exiting == []
    assert pid not in processes()  # reaped either way
    if killed:
        assert children.broken == f"worker {pid} said it ends with status 3 but ended with -9"
    else:
        assert children.broken is None


def test_a_spawner_closes_every_fork_server_when_one_reports_a_broken_run() -> None:
    """A fork server whose last worker ended otherwise than it said fails its close; the
    spawner still closes (and reaps) its other servers, then raises that failure."""
    closed: list[str] = []

    class Server:
        def __init__(self, name: str, failure: str | None) -> None:
            self.name, self.failure = name, failure

        def close(self) -> None:
            closed.append(self.name)
            if self.failure is not None:
                raise ExecutionError(self.failure)

    runner = Spawner("fork")
    runner._servers = {(("A", "1"),): Server("plain", None),  # type: ignore[dict-item]
                       (("B", "2"),): Server("broken", "said 0, ended with -9"),
                       (("C", "3"),): Server("wall clock", None)}
    with pytest.raises(ExecutionError, match="said 0, ended with -9"):
        runner.close()
    assert sorted(closed) == ["broken", "plain", "wall clock"]


def test_parse_response_takes_the_last_json_object_line() -> None:
    assert parse_response('noise\n{"a": 1}\n[1]\n{"b": 2}\n{"broken": \n') == {"b": 2}
    assert parse_response("") is None
    assert parse_response("[1, 2]\n") is None



def test_the_deadline_bounds_the_wait_even_when_a_process_escapes_the_group(
    fork_spawner: Spawner, tmp_path: Path, reference: System,
) -> None:
    """A grandchild that left the worker's group still holds its pipes: faultlab must stop
    reading shortly after the deadline instead of waiting for EOF forever."""
    reference.initialise(tmp_path)
    execute(reference, [Step("dispatch")], fork_spawner)  # fork server up
    spec = WorkerSpec(
        system="systems_for_tests:EscapingOutbox", role="accept", directory=str(tmp_path),
        operation_id="op-1", payload='{"title":"escape"}', deadline=0.5,
    )
    started = time.monotonic()
    record = fork_spawner.run(spec)
    elapsed = time.monotonic() - started
    assert record.response is not None
    escaped = int(record.response["escaped"])
    try:
        assert elapsed < 10, elapsed
        assert record.timed_out
        assert record.exit_code == -9
        assert alive(escaped)  # faultlab signals only its worker's group, never the escapee
    finally:
        os.kill(escaped, 9)  # this test started it (through the worker); end it by its PID
    assert wait_until(lambda: not alive(escaped))
    execute(reference, [Step("dispatch")], fork_spawner)  # the fork server reaps the orphan
    assert wait_until(lambda: escaped not in processes())


def test_what_a_forked_worker_prints_is_in_its_own_record_once(
    fork_spawner: Spawner, tmp_path: Path
) -> None:
    """Workers and their service children take text streams their fork server built and
    never wrote: each process's print() reaches its own record, once, and no other
    process's line comes with it."""
    system = "systems_for_tests:ChattyOutbox"
    load_system(system).initialise(tmp_path)
    for number in range(1, 4):
        operation_id = f"op-{number}"
        record = fork_spawner.run(WorkerSpec(
            system=system, role="accept", directory=str(tmp_path),
            operation_id=operation_id, payload='{"title":"chatty"}', crash=None,
        ))
        assert record.exit_code == 0, record.stderr
        lines = record.stdout.splitlines()  # the response is written unbuffered, print()
        assert lines[1:] == [f"chatty accept stdout {operation_id} pid {record.pid}"]
        assert record.response is not None and record.response["operation_id"] == operation_id
        assert record.stderr == f"chatty accept stderr {operation_id} pid {record.pid}\n"
        dispatcher = fork_spawner.run(WorkerSpec(
            system=system, role="dispatch", directory=str(tmp_path), crash=None,
        ))
        assert dispatcher.exit_code == 0, dispatcher.stderr
        assert dispatcher.stderr == ""
        assert dispatcher.response is not None
        [[stdout, stderr, pid]] = dispatcher.response["service_outputs"]
        assert pid != str(dispatcher.pid)
        assert stdout.splitlines()[1:] == [f"chatty service stdout {operation_id} pid {pid}"]
        assert stderr == f"chatty service stderr {operation_id} pid {pid}\n"


_IMPORTS_PROBE = """
import json, sys
from faultlab.process.records import WorkerSpec
from faultlab.run.worker import preload
from faultlab.system import load_system
preload()
# modules no worker needs whose weight every fork copies (random, hashlib and OpenSSL came
# in through ``secrets`` once: 3.6 MiB more image)
costly = sorted(name for name in ("threading", "subprocess", "random", "hashlib")
                if name in sys.modules)
from faultlab.run.worker import run_worker
imported = set()
for system, directory in json.loads(sys.argv[1]).items():
    load_system(system)  # as the fork server does before it forks the system's workers
    before = set(sys.modules)
    for role, operation_id, payload in (
        ("accept", "op-1", sys.argv[2]), ("accept", "op-1", sys.argv[2]),
        ("dispatch", None, None), ("dispatch", None, None), ("service", "op-1", sys.argv[2]),
    ):
        run_worker(WorkerSpec(system=system, role=role, directory=directory,
                              operation_id=operation_id, payload=payload, crash=None))
    imported |= set(sys.modules) - before
print(json.dumps({"imported": sorted(imported), "costly": costly}))
"""


def test_a_fork_mode_worker_imports_nothing_the_fork_server_did_not(tmp_path: Path) -> None:
    """Every role of every built-in system runs on what the fork server imported.

    A module first imported inside a worker is imported again in every worker
    process: on Python 3.13 ``Path.as_uri()`` alone cost 13 ms per worker that way.
    """
    directories = {}
    for name in builtin_names():
        directory = tmp_path / name
        directory.mkdir()
        load_system(name).initialise(directory)
        directories[name] = str(directory)
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORTS_PROBE, json.dumps(directories),
         json.dumps({"title": "imports"})],
        capture_output=True, text=True, env=child_environment(), timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    response = parse_response(completed.stdout)
    assert response is not None and "imported" in response, completed.stdout
    assert response["imported"] == []


def test_the_reference_fork_server_does_not_import_threading(tmp_path: Path) -> None:
    """:mod:`threading` registers an after-fork hook, Python code run in every forked child.

    In the fork server it cost each worker about 120 copy-on-write page faults (over half
    a millisecond of CPU, measured with ``bench/spawn.py``); :mod:`subprocess` imports it,
    so the process layer imports :mod:`subprocess` only where it starts a program. Nor
    :mod:`random` or :mod:`hashlib` (OpenSSL): no worker needs them, and every fork
    copies the page tables of what the image maps.
    """
    directory = tmp_path / "reference"
    directory.mkdir()
    load_system("reference").initialise(directory)
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORTS_PROBE, json.dumps({"reference": str(directory)}),
         json.dumps({"title": "imports"})],
        capture_output=True, text=True, env=child_environment(), timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    response = parse_response(completed.stdout)
    assert response is not None, completed.stdout
    assert response["costly"] == []
    assert response["imported"] == []


_SYSTEMS_PROBE = """
import json, sys
from faultlab.run.worker import preload
from faultlab.system import load_system
preload()
for name in json.loads(sys.argv[1]):
    load_system(name)  # as the fork server does before it forks the system's workers
print(json.dumps(sorted(name for name in ("threading", "subprocess", "random", "hashlib",
                                          "ctypes") if name in sys.modules)))
"""


def test_loading_any_sqlite_system_keeps_the_fork_servers_image_lean() -> None:
    """Every built-in system on SQLite loads into the fork server without the costly
    modules: a power mutant's minimal trace once brought in the recording VFS (ctypes,
    hashlib, threading), and with it threading's after-fork hook into every worker of
    every mutant. The fork server loads the VFS when a recording worker is asked for."""
    from faultlab.system.builtin import registry

    names = registry.names(postgres=False)
    assert "wal-normal-receiver" in names and "racy-dedup" in names
    completed = subprocess.run(
        [sys.executable, "-c", _SYSTEMS_PROBE, json.dumps(names)],
        capture_output=True, text=True, env=child_environment(), timeout=120, check=False,
    )
    assert completed.returncode == 0, completed.stderr
    assert json.loads(completed.stdout) == []


# The test forks from this process on purpose (pytest-xdist's worker runs threads): the
# child only sleeps and ends with os._exit.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
def test_the_parent_makes_a_forked_child_lead_its_own_group_at_once() -> None:
    """A group kill right after a fork reaches the child even before the child ran a line
    (here it sleeps first): the parent sets the group too. Without it, no such group."""
    import signal

    from faultlab.process.spawn import lead_own_group

    for parent_sets_group in (False, True):
        pid = os.fork()
        if pid == 0:  # a child slow to start: it never sets its own group
            time.sleep(5)
            os._exit(0)
        try:
            if parent_sets_group:
                lead_own_group(pid)
                assert os.getpgid(pid) == pid
                os.killpg(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
            else:
                assert os.getpgid(pid) == os.getpgid(0)
                with pytest.raises(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
        finally:
            try:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
            except (ProcessLookupError, ChildProcessError):
                pass
