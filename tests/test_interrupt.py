"""SIGINT and SIGTERM stop a run cleanly: no finding, no corpus file, nothing left behind.

Each test runs a real ``python -m faultlab explore`` under ``interrupt_harness.py``, a
child subreaper, and sends a real signal at a chosen moment: as soon as the command
handles signals (before the first worker), while a worker hangs (mid-step, both spawn
modes), while a finding is being shrunk. Whatever faultlab leaves behind (a worker, the
fork server, a zombie) is reparented to the harness and reported; the run directories
carry the command's pid, so a leftover is found even while other runs use /dev/shm.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import interrupt_harness
import pytest
from conftest import ROOT, TESTS

from faultlab.base import interrupt
from faultlab.base.output import write_json
from faultlab.process.records import WorkerSpec
from faultlab.process.spawn import ForkServer, child_environment

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="needs Linux /proc")

STATUS = {"INT": 130, "TERM": 143}


def interrupted_run(argv: list[str], sig: str, trigger: str, *, text: str = "",
                    delay: float = 0.0, limit: float = 60.0) -> dict[str, Any]:
    config = {
        "argv": [sys.executable, "-m", "faultlab", *argv], "cwd": str(ROOT), "signal": sig,
        "trigger": trigger, "text": text, "delay": delay, "limit": limit,
    }
    done = subprocess.run(
        [sys.executable, str(TESTS / "interrupt_harness.py"), json.dumps(config)],
        capture_output=True, text=True, env=child_environment(), timeout=limit + 30,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def assert_stopped_cleanly(result: dict[str, Any], sig: str, corpus: Path) -> None:
    """The run ended with 128+N, one line, no finding, no corpus file, nothing left."""
    assert result["signalled"], result
    assert result["returncode"] == STATUS[sig], result
    assert "FOUND" not in result["stdout"] and "clean" not in result["stdout"], result
    lines = [line for line in result["stderr"].splitlines()
             if not line.startswith(("explore: ", "explore ("))]
    assert lines == [
        f"faultlab: interrupted by SIG{sig}; workers stopped, nothing reported or saved"
    ], result["stderr"]
    assert not corpus.exists(), list(corpus.iterdir())
    assert result["leftovers"] == {}, result
    assert result["run_directories"] == [], result


def harness(argv: list[str]) -> dict[str, Any]:
    config = {"argv": argv, "cwd": str(ROOT), "signal": "TERM", "trigger": "rundir",
              "delay": 0.0, "limit": 20.0}
    done = subprocess.run(
        [sys.executable, str(TESTS / "interrupt_harness.py"), json.dumps(config)],
        capture_output=True, text=True, env=child_environment(), timeout=60,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def test_the_harness_reports_a_directory_left_by_the_run_but_not_one_from_before() -> None:
    """The negative control of ``run_directories``: a process that makes its run directory
    and dies by the signal is reported; a directory that was there before the command
    started (an earlier process with the same pid, since pids wrap) is not."""
    leaves = ("import os, time; os.mkdir(f'/dev/shm/faultlab-{os.getpid()}-control'); "
              "time.sleep(30)")
    result = harness([sys.executable, "-c", leaves])
    try:
        assert result["signalled"] and result["returncode"] == -signal.SIGTERM, result
        (left,) = result["run_directories"]
        assert left.startswith("/dev/shm/faultlab-") and left.endswith("-control"), result
    finally:
        for path in result["run_directories"]:
            os.rmdir(path)
    # pids wrap: a directory an earlier process with the same pid left is not this run's
    pid = os.getpid()
    old, new = Path(f"/dev/shm/faultlab-{pid}-old"), Path(f"/dev/shm/faultlab-{pid}-new")
    old.mkdir()
    try:
        before = frozenset(interrupt_harness.existing_directories())
        new.mkdir()
        assert interrupt_harness.run_directories(pid, before=before) == [new.as_posix()]
        assert interrupt_harness.run_directories(pid) == [new.as_posix(), old.as_posix()]
    finally:
        old.rmdir()
        new.rmdir()


#: Run inside a private pid namespace (pid 1 there): a process makes a run directory and
#: ends, leaving it; its pid is then given to another process on purpose, through the
#: namespace's own ns_last_pid, and that one makes its own. Prints both and what the
#: harness reports, with and without knowing which processes are faultlab's.
REUSED_PID = """
import json, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import interrupt_harness as harness

before = frozenset(harness.existing_directories())
make = ("import os, sys; pid = os.getpid(); "
        "os.mkdir(f'/dev/shm/faultlab-{pid}-{sys.argv[1]}') if sys.argv[2] in ('any', str(pid)) "
        "else None; "
        "print(pid, flush=True); sys.stdin.read()")
leaver = subprocess.Popen([sys.executable, "-c", make, "leaked", "any"], stdin=subprocess.PIPE,
                          stdout=subprocess.PIPE, text=True)
pid = leaver.pid
leaver.stdout.readline()  # its directory is made
leaver.stdin.close()
leaver.wait()  # ended, its directory left behind
leaked = f"/dev/shm/faultlab-{pid}-leaked"
time.sleep(0.1)  # pid reuse waits for the counter to wrap: far longer than a clock tick
with open("/proc/sys/kernel/ns_last_pid", "w") as last:
    last.write(str(pid - 1))
later = f"/dev/shm/faultlab-{pid}-later"
holder = subprocess.Popen([sys.executable, "-c", make, "later", str(pid)],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
try:
    holder.stdout.readline()  # its directory is made
    result = {"pid": pid, "holder": holder.pid, "leaked": leaked, "later": later,
              "known": harness.run_directories(pid, before=before, alive=set()),
              "unknown": harness.run_directories(pid, before=before)}
finally:
    holder.stdin.close()
    holder.wait()
    for path in (leaked, later):
        if os.path.isdir(path):
            os.rmdir(path)
print(json.dumps(result))
"""


def test_the_harness_does_not_count_a_directory_made_by_a_later_holder_of_a_pid() -> None:
    """Pids wrap within a long run (thousands of workers, pid_max 32768), so another
    test's process can hold one of the pids seen below faultlab when the harness looks.
    A real reuse, in a private pid namespace: the directory the first holder left is
    reported, the one its successor made is not. Without knowing faultlab's live
    processes the harness reports both (the false leftover it reported before)."""
    import shutil

    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("reusing a pid on purpose needs unshare(1) for a private pid namespace")
    done = subprocess.run(
        [unshare, "--pid", "--fork", "--mount-proc", sys.executable, "-c", REUSED_PID,
         str(TESTS)], capture_output=True, text=True, timeout=60)
    if done.returncode != 0 and "unshare failed" in done.stderr:
        pytest.skip(f"no private pid namespace here: {done.stderr.strip()}")
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["holder"] == result["pid"], result  # the pid was reused
    assert result["known"] == [result["leaked"]], result
    assert result["unknown"] == [result["later"], result["leaked"]], result
    assert not Path(result["leaked"]).exists() and not Path(result["later"]).exists()


@pytest.mark.parametrize("sig", ["INT", pytest.param("TERM", marks=pytest.mark.slow)])
def test_a_signal_before_the_first_worker(tmp_path: Path, sig: str) -> None:
    corpus = tmp_path / "corpus"
    result = interrupted_run(["explore", "--examples", "50", "--corpus", str(corpus)], sig,
                             "ready")
    assert_stopped_cleanly(result, sig, corpus)


@pytest.mark.parametrize(("spawn", "sig"), [("fork", "TERM"), ("exec", "INT")])
def test_a_signal_while_a_worker_hangs_ends_and_reaps_it(
    tmp_path: Path, spawn: str, sig: str,
) -> None:
    """The worker would hang for an hour (deadline 60 s): the signal ends it at once."""
    corpus = tmp_path / "corpus"
    result = interrupted_run(
        ["explore", "--system", "systems_for_tests:HangingOutbox", "--deadline", "60",
         "--spawn", spawn, "--corpus", str(corpus)],
        sig, "rundir", delay=1.0 if spawn == "exec" else 0.5,
    )
    assert_stopped_cleanly(result, sig, corpus)
    assert result["exit_after_signal"] < 10, result


@pytest.mark.parametrize("spawn", ["fork", "exec"])
def test_a_signal_mid_step_ends_the_worker_before_its_stores_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spawn: str,
) -> None:
    """The worker watches its stores' directory every millisecond while it runs: the
    interrupted run ends it before it removes the stores. A worker that outlived them
    could still write there (a rollback journal made as the directory was being removed
    left it behind, empty, after the commit) and says so. Before, a forked worker ran
    until the fork server was stopped, after the stores had gone."""
    witnesses = tmp_path / "witnesses"
    witnesses.mkdir()
    monkeypatch.setenv("FAULTLAB_TEST_WITNESS", str(witnesses))
    corpus = tmp_path / "corpus"
    result = interrupted_run(
        ["explore", "--system", "systems_for_tests:StoreWatchingOutbox", "--deadline", "60",
         "--spawn", spawn, "--corpus", str(corpus)],
        "TERM", "rundir", delay=1.0 if spawn == "exec" else 0.5,
    )
    assert_stopped_cleanly(result, "TERM", corpus)
    # a worker was watching when the signal came (it runs until killed): not vacuous
    assert (witnesses / "watching").exists(), result
    outlived = witnesses / "outlived"
    assert not outlived.exists(), outlived.read_text()


@pytest.mark.parametrize("sig", [pytest.param("INT", marks=pytest.mark.slow), "TERM"])
def test_a_signal_while_shrinking_saves_nothing(tmp_path: Path, sig: str) -> None:
    """The signal arrives as faultlab's shrinker starts on the negative control's finding."""
    corpus = tmp_path / "corpus"
    result = interrupted_run(
        ["explore", "--no-deduplication", "--examples", "50", "--corpus", str(corpus)],
        sig, "stderr", text="shrinking the trace", delay=0.0,
    )
    assert_stopped_cleanly(result, sig, corpus)


@pytest.mark.slow  # about 60 s: thirty runs of the negative control, interrupted at random
def test_a_signal_at_any_moment_is_all_or_nothing(tmp_path: Path) -> None:
    """Delays over the whole run (about a second: start-up, search, shrink, corpus write, and
    past it): either the run is interrupted (and
    nothing was saved or reported), or it had already committed its finding (exit 1,
    one complete corpus file that replays). Never half of each. The delays spread over
    1.2 times an uninterrupted run's time on this machine (a fixed 1.2 s interrupted too
    few runs on a fast one: 9 in 30)."""
    command = ["explore", "--no-deduplication", "--examples", "200"]
    began = time.monotonic()
    whole = subprocess.run([sys.executable, "-m", "faultlab", *command, "--corpus",
                            str(tmp_path / "uninterrupted")], cwd=ROOT, capture_output=True)
    took = time.monotonic() - began
    assert whole.returncode == 1, whole.stderr
    chooser = random.Random(10)
    outcomes = {"interrupted": 0, "committed": 0}
    for attempt in range(30):
        sig = "INT" if attempt % 2 else "TERM"
        corpus = tmp_path / f"corpus-{attempt}"
        result = interrupted_run(
            [*command, "--corpus", str(corpus)], sig, "ready",
            delay=chooser.uniform(0.0, 1.2 * took),
        )
        assert result["leftovers"] == {} and result["run_directories"] == [], result
        if result["returncode"] == STATUS[sig]:
            assert_stopped_cleanly(result, sig, corpus)
            outcomes["interrupted"] += 1
        else:
            assert result["returncode"] == 1, result
            assert "FOUND" in result["stdout"], result
            (saved,) = corpus.iterdir()
            assert json.loads(saved.read_text())["expected"]["invariants"][0] in ("ONE", "RCPT")
            outcomes["committed"] += 1
    assert outcomes["interrupted"] >= 10, outcomes


@pytest.mark.slow  # about 20 s: each command started and interrupted twice
@pytest.mark.parametrize("sig", ["INT", "TERM"])
@pytest.mark.parametrize(("command", "delay"), [
    (["suite", "--output", "{tmp}/out.json", "--directory", "{tmp}/stores"], 1.0),
    (["enumerate", "--no-deduplication", "--corpus", "{tmp}/corpus"], 1.0),
    (["explore", "--jobs", "2", "--examples", "500", "--corpus", "{tmp}/corpus"], 2.0),
    (["enumerate", "--spawn", "exec", "--jobs", "2", "--corpus", "{tmp}/corpus"], 1.5),
    (["mutants", "--only", "no-dedup", "--only", "split-accept", "--output", "{tmp}/out.json",
      "--corpus", "{tmp}/corpus"], 1.0),
    (["replay", "--spawn", "exec", "{corpus}/reference-nodedup-ONE-*.json"], 0.5),
])
def test_every_command_stops_cleanly(tmp_path: Path, command: list[str], delay: float,
                                     sig: str) -> None:
    argv = [part.replace("{tmp}", str(tmp_path)) for part in command]
    argv = [str(next((ROOT / "corpus").glob(Path(part).name))) if part.startswith("{corpus}")
            else part for part in argv]
    result = interrupted_run(argv, sig, "ready", delay=delay)
    assert result["signalled"], result
    assert result["returncode"] == STATUS[sig], result
    assert result["leftovers"] == {} and result["run_directories"] == [], result
    assert result["stderr"].splitlines()[-1] == (
        f"faultlab: interrupted by SIG{sig}; workers stopped, nothing reported or saved"
    ), result["stderr"]
    assert "FOUND" not in result["stdout"] and "PASS" not in result["stdout"]
    assert not (tmp_path / "out.json").exists()
    if command[0] in ("enumerate", "explore", "mutants"):
        assert not (tmp_path / "corpus").exists()
    if command[0] == "suite":  # the stores it was asked to keep belong to an unreported run
        assert not (tmp_path / "stores").exists()


def test_an_interrupted_suite_removes_the_directory_it_made(tmp_path: Path) -> None:
    """``suite --directory DIR`` keeps each scenario's stores for a run that reports; an
    interrupted one reports nothing, so DIR (which it created) goes too, and the same
    command can run again."""
    stores = tmp_path / "stores"
    result = interrupted_run(["suite", "--directory", str(stores)], "INT", "stderr",
                             text="suite: scenario 1/5")
    assert result["signalled"], result
    assert result["returncode"] == STATUS["INT"], result
    assert result["leftovers"] == {} and result["run_directories"] == [], result
    assert not stores.exists(), sorted(p.name for p in stores.iterdir())


@pytest.mark.parametrize("sig", ["INT", pytest.param("TERM", marks=pytest.mark.slow)])
def test_a_concurrent_exploration_stops_cleanly(tmp_path: Path, sig: str) -> None:
    """Lanes are killed and reaped, a dispatcher's orphaned service too, and the lanes' run
    directory (named by pid, like every run directory) is removed."""
    corpus = tmp_path / "corpus"
    result = interrupted_run(["explore", "--concurrency", "2", "--examples", "500",
                              "--corpus", str(corpus)], sig, "rundir", delay=1.0)
    assert_stopped_cleanly(result, sig, corpus)


@pytest.mark.slow  # about 60 s: twenty concurrent explorations, interrupted at random
def test_a_concurrent_exploration_interrupted_at_any_moment_leaves_nothing(
    tmp_path: Path,
) -> None:
    """Delays from the lanes' first run directory to well into the search: lanes starting,
    held, blocked, paused or being killed when the signal lands. Every run ends 128+N with
    no lane, service or run directory left. A sampler of many moments, not a proof for one:
    the early-fork race that once left a lane alive is pinned down by test_lanes' lane
    closed right after its fork, which fails without the fix (this test, without it,
    passed 20 runs here: its random moments seldom fall in that window)."""
    chooser = random.Random(13)
    for attempt in range(20):
        sig = "INT" if attempt % 2 else "TERM"
        corpus = tmp_path / f"corpus-{attempt}"
        result = interrupted_run(["explore", "--concurrency", "2", "--examples", "500",
                                  "--corpus", str(corpus)], sig, "rundir",
                                 delay=chooser.uniform(0.0, 2.5))
        assert_stopped_cleanly(result, sig, corpus)


@pytest.mark.parametrize("sig", ["TERM", pytest.param("INT", marks=pytest.mark.slow)])
def test_a_concurrent_exploration_with_jobs_stops_cleanly(tmp_path: Path, sig: str) -> None:
    """--concurrency 2 --jobs 2, interrupted while its jobs explore: each job process is a
    child subreaper, so a killed lane's orphaned service is reaped by its job, not left a
    zombie of whoever started faultlab (1 run in 10 left one before), and the run exits
    promptly (it took about 5 s when a job waited for such a process)."""
    corpus = tmp_path / "corpus"
    result = interrupted_run(["explore", "--concurrency", "2", "--jobs", "2", "--examples",
                              "500", "--corpus", str(corpus)], sig, "stderr",
                             text="explore (2 jobs)", delay=1.5)
    assert_stopped_cleanly(result, sig, corpus)
    assert result["exit_after_signal"] < 3, result


@pytest.mark.slow  # about 60 s: twenty interrupted explorations with two jobs of two lanes
def test_a_concurrent_exploration_with_jobs_interrupted_at_any_moment_leaves_nothing(
    tmp_path: Path,
) -> None:
    chooser = random.Random(1)
    for attempt in range(20):
        sig = "INT" if attempt % 2 else "TERM"
        corpus = tmp_path / f"corpus-{attempt}"
        result = interrupted_run(["explore", "--concurrency", "2", "--jobs", "2",
                                  "--examples", "500", "--corpus", str(corpus)], sig, "stderr",
                                 text="explore (2 jobs)", delay=chooser.uniform(0.0, 3.0))
        assert_stopped_cleanly(result, sig, corpus)
        assert result["exit_after_signal"] < 3, result


# --- in this process: the fork server's channel and the output commit point -------------


def test_an_interrupted_request_never_yields_a_stale_reply(tmp_path: Path) -> None:
    """A signal between writing a request and reading its reply: the next request must not
    read that reply; closing stops the server and the hanging worker it was running."""
    from faultlab.system import load_system

    load_system("reference").initialise(tmp_path)
    server = ForkServer()
    hanging = WorkerSpec(system="systems_for_tests:HangingOutbox", role="accept",
                         directory=str(tmp_path), operation_id="op-1",
                         payload='{"title":"x"}', deadline=60)
    timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
    try:
        with interrupt.handling():
            timer.start()
            with pytest.raises(interrupt.Interrupted):
                server.run(hanging)
        interrupt.reset()
        quick = WorkerSpec(system="reference", role="dispatch", directory=str(tmp_path))
        # the interruption again, not a run failure (a teardown's request after a Ctrl-C
        # under pytest once became an ExecutionError, and the session carried on)
        with pytest.raises(interrupt.Interrupted):
            server.run(quick)
    finally:
        timer.cancel()
        server.close()
        interrupt.reset()
    assert server._process.returncode is not None  # the server is gone and reaped
    group_members = [
        entry for entry in os.listdir("/proc") if entry.isdigit()
        and _ppid(entry) == server.pid
    ]
    assert group_members == []


def test_closing_an_interrupted_server_ends_the_service_its_worker_waits_for(
    tmp_path: Path,
) -> None:
    """Interrupted while a dispatcher waits for the service it asked the fork server for:
    closing stops the server, which kills and reaps both (the service is the server's
    child, in the dispatcher's group); nothing of theirs is left."""
    from faultlab.system import load_system

    system = load_system("systems_for_tests:HangingServiceOutbox")
    system.initialise(tmp_path)
    server = ForkServer()
    accept = WorkerSpec(system=system.ref, role="accept", directory=str(tmp_path),
                        operation_id="op-1", payload='{"title":"x"}')
    dispatch = WorkerSpec(system=system.ref, role="dispatch", directory=str(tmp_path),
                          deadline=60)
    timer = threading.Timer(1.5, os.kill, (os.getpid(), signal.SIGINT))
    try:
        assert server.run(accept).exit_code == 0
        with interrupt.handling():
            timer.start()
            with pytest.raises(interrupt.Interrupted):
                server.run(dispatch)
        service = int((tmp_path / "service.pid").read_text())
    finally:
        timer.cancel()
        server.close()
        interrupt.reset()
    assert server._process.returncode is not None  # the server is gone and reaped
    assert not Path(f"/proc/{service}").exists()  # killed and reaped, not a zombie
    assert [entry for entry in os.listdir("/proc")
            if entry.isdigit() and _ppid(entry) == server.pid] == []


class _SignalledPopen(subprocess.Popen):  # type: ignore[type-arg]
    """subprocess.Popen that sends this process a real SIGINT the moment its child exists
    (before the caller has stored the object): the narrowest window to be interrupted in."""

    started: list[subprocess.Popen[bytes]] = []

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        _SignalledPopen.started.append(self)
        os.kill(os.getpid(), signal.SIGINT)


def _gone(child: subprocess.Popen[bytes]) -> bool:
    """Reaped by faultlab: no longer a child of this process, and no such process."""
    try:
        os.waitpid(child.pid, os.WNOHANG)
    except ChildProcessError:
        return not Path(f"/proc/{child.pid}").exists()
    return False


def _end(child: subprocess.Popen[bytes]) -> None:
    """After a failed check: stop and reap the child faultlab left (ours, unreaped)."""
    try:
        if os.waitpid(child.pid, os.WNOHANG) == (0, 0):
            os.killpg(child.pid, signal.SIGKILL)
            os.waitpid(child.pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass


@pytest.mark.parametrize("mode", ["fork", "exec"])
def test_a_signal_as_a_process_starts_still_ends_and_reaps_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str,
) -> None:
    """A real SIGINT just after the fork server (fork mode) or an exec'd worker (exec mode)
    was started, before faultlab held on to it: the run ends with Interrupted, and the
    process is ended and reaped, not left running (exec) or a zombie of the caller (the
    fork server: seen once in the slow random-moment interrupt test)."""
    from faultlab.process.spawn import spawner
    from faultlab.system import load_system

    load_system("reference").initialise(tmp_path)
    spec = WorkerSpec(system="reference", role="accept", directory=str(tmp_path),
                      operation_id="op-1", payload='{"title":"x"}', spawn=mode)
    started: list[subprocess.Popen[bytes]] = []
    monkeypatch.setattr(_SignalledPopen, "started", started)
    monkeypatch.setattr(subprocess, "Popen", _SignalledPopen)
    try:
        with interrupt.handling(), pytest.raises(interrupt.Interrupted):
            with spawner(mode) as runner:
                runner.run(spec)
    finally:
        interrupt.reset()
        monkeypatch.undo()
    (child,) = started
    try:
        assert _gone(child), child.pid
    finally:
        _end(child)


def test_a_signal_as_the_first_job_starts_ends_that_job(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """explore --jobs 2 --duration 60 interrupted by a real SIGINT the moment its first job
    process has started: run_jobs raises Interrupted and every job it started has ended
    (before the fix the start loop was outside the handler: the job explored on for its
    whole minute, and the caller waited for it at exit)."""
    import multiprocessing.context

    started: list[Any] = []
    real_start = multiprocessing.context.SpawnProcess.start

    def start_then_signal(process: Any) -> None:
        real_start(process)
        started.append(process)
        if len(started) == 1:
            os.kill(os.getpid(), signal.SIGINT)

    began = time.monotonic()
    left = _jobs_interrupted(monkeypatch, start_then_signal, started)
    assert started and left == []
    assert time.monotonic() - began < 30


def _jobs_interrupted(monkeypatch: pytest.MonkeyPatch, start: Callable[[Any], None],
                      started: list[Any]) -> list[int]:
    """``explore --jobs 2 --duration 60``'s jobs (run_jobs) with ``start`` in place of a
    job process's start, which sends the signals: run_jobs must raise Interrupted. The
    pids of the started jobs still running after it; every one is ended here anyway."""
    import multiprocessing.context

    from faultlab.process.spawn import stop_resource_tracker
    from faultlab.search.rounds import Plan, run_jobs

    monkeypatch.setattr(multiprocessing.context.SpawnProcess, "start", start)
    plan = Plan("reference", True, 0, 20, 10, True, False, "fork", jobs=2, duration=60.0)
    try:
        with interrupt.handling(), pytest.raises(interrupt.Interrupted):
            run_jobs(plan)
        return [process.pid for process in started if process.exitcode is None]
    finally:
        interrupt.reset()
        for process in started:  # after a failed check: end what was left
            if process.is_alive():
                process.kill()
                process.join()
        stop_resource_tracker()  # the queue's tracker, as the faultlab command does at exit


def test_a_job_interrupted_while_its_interpreter_starts_prints_no_traceback(
    monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str],
) -> None:
    """The terminal's SIGINT reaches every process of its group, a job still importing
    included: one interrupted before its handlers printed multiprocessing's own
    KeyboardInterrupt traceback (seen in about one early Ctrl-C of six). Here the first job
    gets a real SIGINT 10 ms after its start and this process 0.3 s later: the run ends
    interrupted, every job ended, and no traceback reaches stderr (without the held
    signals the job printed one at every such delay from 5 to 20 ms)."""
    import multiprocessing.context

    started: list[Any] = []
    real_start = multiprocessing.context.SpawnProcess.start

    def start_then_signal(process: Any) -> None:
        real_start(process)
        started.append(process)
        time.sleep(0.01)  # the job is importing multiprocessing now
        os.kill(process.pid, signal.SIGINT)
        time.sleep(0.3)  # as a terminal's: the job had its signal first
        os.kill(os.getpid(), signal.SIGINT)

    left = _jobs_interrupted(monkeypatch, start_then_signal, started)
    assert started and left == []
    err = capfd.readouterr().err  # the jobs' stderr too: they share this descriptor
    assert "Traceback" not in err, err
    # nor did a job die of the signal's default action, before Python had a handler
    assert -signal.SIGINT not in [process.exitcode for process in started]


def _ppid(pid: str) -> int:
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return -1


class _SignalsWhileSerialised(dict[str, Any]):
    """A JSON object whose serialisation sends this process a real signal, mid-write
    (after the part of the file before it was written to the temporary file)."""

    def __init__(self, signum: int) -> None:
        super().__init__(after="the signal")
        self.signum = signum
        self.sent = False

    def items(self) -> Any:
        os.kill(os.getpid(), self.signum)
        self.sent = True
        return super().items()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_mid_write_leaves_no_file(tmp_path: Path, signum: int) -> None:
    target = tmp_path / "finding.json"
    trigger = _SignalsWhileSerialised(signum)
    data = {"before": "x" * 100_000, "steps": trigger}
    try:
        with interrupt.handling():
            with pytest.raises(interrupt.Interrupted) as stopped:
                write_json(target, data, final=True)
    finally:
        interrupt.reset()
    assert trigger.sent
    assert stopped.value.exit_code == 128 + signum
    assert list(tmp_path.iterdir()) == []  # neither the file nor its temporary


def test_a_signal_after_the_commit_leaves_the_whole_file(tmp_path: Path) -> None:
    """Negative control of the test above: without a signal the same write succeeds, and
    a signal after the commit changes nothing about the committed file."""
    target = tmp_path / "finding.json"
    try:
        with interrupt.handling():
            write_json(target, {"steps": [1, 2, 3]}, final=True)
            os.kill(os.getpid(), signal.SIGTERM)  # after the commit: noted, not raised
            interrupt.check()
    finally:
        interrupt.reset()
    assert json.loads(target.read_text()) == {"steps": [1, 2, 3]}
    assert list(tmp_path.iterdir()) == [target]


def test_a_signal_held_back_while_the_lanes_directory_is_made_leaves_no_directory(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A real SIGINT the moment the lanes' run directory exists, inside the block that holds
    signals back: it is raised as that block ends, and the directory must still go (it was
    left behind in about 7 % of interrupts landing at the start of a concurrent example)."""
    import tempfile

    from faultlab.run import directory, executor
    from faultlab.system import load_system

    made: list[str] = []
    real_mkdtemp = tempfile.mkdtemp

    def mkdtemp_then_signal(*args: Any, **kwargs: Any) -> str:
        made.append(real_mkdtemp(*args, **kwargs))
        os.kill(os.getpid(), signal.SIGINT)  # held back: the deferred block is still open
        return made[-1]

    monkeypatch.setattr(directory.tempfile, "mkdtemp", mkdtemp_then_signal)
    try:
        with interrupt.handling(), pytest.raises(interrupt.Interrupted):
            with executor.Executor(load_system("reference"), concurrency=2):
                raise AssertionError("the executor opened although a signal arrived")
    finally:
        interrupt.reset()
        monkeypatch.undo()
    assert len(made) == 1 and f"faultlab-lanes-{os.getpid()}-" in made[0], made
    assert not Path(made[0]).exists(), made


def test_after_a_signal_no_lane_step_runs() -> None:
    """A real SIGTERM lands while a concurrent trace runs (the state machine's body): the
    teardown that follows must not settle the trace, which would resume, finish and recover
    the lanes after the interrupt (a worker waiting on a paused lane's lock held that up to
    its deadline: an interrupted ``explore --jobs`` took 15 s to stop). The next step
    raises at once and starts no worker, as a sequential step does."""
    from faultlab.run import executor
    from faultlab.system import load_system
    from faultlab.trace import Step

    try:
        with executor.Executor(load_system("reference"), concurrency=2) as ex:
            ex.run(Step("accept", "op-1", '{"title":"a"}', lane=1, hold=True))
            held = ex.lanes[1].pid
            with interrupt.handling():
                with pytest.raises(interrupt.Interrupted):
                    os.kill(os.getpid(), signal.SIGTERM)
                    time.sleep(1)  # the handler raises here, as in a step's wait
                with pytest.raises(interrupt.Interrupted):
                    ex.run(Step("dispatch", lane=2, hold=True))
                with pytest.raises(interrupt.Interrupted):
                    ex.settle()
            assert ex.workers == 1 and list(ex.lanes) == [1]
            assert ex.lanes[1].status == "held" and ex.lanes[1].pid == held
    finally:
        interrupt.reset()
    assert not Path(f"/proc/{held}").exists()  # close() killed and reaped it


@pytest.mark.parametrize("concurrency", [1, 2])
@pytest.mark.parametrize("moment", ["opened", "closing"])
def test_a_signal_at_either_end_of_an_example_leaves_no_directory(
    moment: str, concurrency: int,
) -> None:
    """A real SIGTERM at either end of an example, where its teardown cannot close its
    stores: ``opened``, the moment a machine has opened them, before Hypothesis enters the
    block that calls its teardown (it makes the machine a few statements earlier);
    ``closing``, the moment the teardown calls its executor's ``close``, before ``close``
    holds signals back (the Interrupted leaves ``close`` at once). The search closes the
    stores itself. Before, the run directory was left in /dev/shm: ``opened`` was seen
    once in a few CI runs of an interrupted ``explore --jobs``; ``closing`` the teardown
    forgot either way."""
    from faultlab.process.spawn import spawner
    from faultlab.search.explore import _search
    from faultlab.search.machine import machine_settings, outbox_machine
    from faultlab.search.recorder import Recorder
    from faultlab.search.schedules import concurrent_machine

    recorder: Recorder = Recorder()
    prefix = "faultlab-lanes-" if concurrency > 1 else "faultlab-"
    mine = f"/dev/shm/{prefix}{os.getpid()}-*"
    before = set(glob_paths(mine))
    made: list[str] = []
    with spawner("fork") as runner:
        base: Any = (concurrent_machine("reference", concurrency=2, recorder=recorder)
                     if concurrency > 1 else
                     outbox_machine("reference", spawner=runner, recorder=recorder))

        class Signalled(base):  # type: ignore[misc,valid-type]
            def __init__(self) -> None:
                super().__init__()  # the stores exist now
                made.extend(set(glob_paths(mine)) - before)
                if moment == "opened":
                    os.kill(os.getpid(), signal.SIGTERM)  # raised here, at once
                    return
                executor, close = self.executor, self.executor.close

                def signalled_close() -> None:
                    os.kill(os.getpid(), signal.SIGTERM)  # raised here, before close runs
                    close()

                executor.close = signalled_close

        try:
            with interrupt.handling(), pytest.raises(interrupt.Interrupted):
                _search(Signalled, machine_settings(5, 2), 0, recorder,
                        hypothesis_shrink=False)
        finally:
            interrupt.reset()
    assert len(made) == 1, made  # the example's run directory, made by this process
    assert not Path(made[0]).exists(), made
    assert recorder.open_example is None


def glob_paths(pattern: str) -> list[str]:
    import glob

    return glob.glob(pattern)


def test_mutants_interrupted_after_a_judge_finished_saves_nothing(tmp_path: Path) -> None:
    """A finished judge's finding waits for the whole run: interrupted while the reference
    is still judged (no-dedup done and caught), ``mutants`` says nothing was saved, and
    the corpus holds nothing (a judge that saved its own finding left a file behind)."""
    corpus = tmp_path / "corpus"
    result = interrupted_run(
        ["mutants", "--only", "reference", "--only", "no-dedup", "--jobs", "2",
         "--examples", "400", "--corpus", str(corpus), "--output", str(tmp_path / "out.json")],
        "TERM", "stderr", text="mutants: no-dedup judged (ok)", delay=0.2, limit=120.0)
    assert result["signalled"], result
    assert "mutants: no-dedup judged (ok)" in result["stderr"], result
    assert result["returncode"] == STATUS["TERM"], result
    assert result["stderr"].splitlines()[-1] == (
        "faultlab: interrupted by SIGTERM; workers stopped, nothing reported or saved")
    assert not corpus.exists(), list(corpus.rglob("*"))
    assert not (tmp_path / "out.json").exists()
    assert result["leftovers"] == {} and result["run_directories"] == [], result
