"""The process layer's non-blocking start: real workers left running, then reaped.

A concurrent trace's executor starts every worker through :class:`Launcher` and
collects it with :meth:`Running.reap`; these tests run real processes without the
executor: who is whose parent, which group each leads, what its control channel and
environment hold, and that a worker that will not end is killed at the bound.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from faultlab.base.errors import ExecutionError
from faultlab.process import launch, starter
from faultlab.process.records import WorkerSpec

SPEC = WorkerSpec(system="reference", role="accept", directory="/nonexistent",
                  operation_id="op-1", payload="{}", crash=None)

#: A command that says what it was given on its announcement pipe, waits for a word on
#: its decisions pipe, and exits 3 on "three".
ECHO = (
    "import os; d, a = map(int, os.environ['CHANNEL'].split(',')); "
    "os.write(a, (os.environ['WHO'] + ' ' + str(os.getpgid(0))).encode()); "
    "raise SystemExit(3 if os.read(d, 16) == b'three' else 0)"
)


def _body(spec: WorkerSpec, environment: dict[str, str], channel: tuple[int, int]) -> int:
    decide, announce = channel
    os.write(announce, f"{spec.role} {environment['WHO']} {os.getppid()}".encode())
    return 3 if os.read(decide, 16) == b"three" else 0


def _channel(decide: int, announce: int) -> dict[str, str]:
    return {"CHANNEL": f"{decide},{announce}", "WHO": "lane", "PATH": os.environ["PATH"]}


def _read(fd: int, timeout: float = 10.0) -> bytes:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            return os.read(fd, 200)
        except BlockingIOError:
            time.sleep(0.005)
    raise AssertionError("nothing to read")


def _close_outputs(running: launch.Running) -> None:
    for fd in running.outputs:
        os.close(fd)


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_command_gets_its_channel_and_environment_and_leads_its_own_group() -> None:
    launcher = launch.Launcher(_body)
    running = launcher.start_command([sys.executable, "-c", ECHO], _channel)
    try:
        announce = next(fd for fd, name in running.outputs.items() if name == "announce")
        who, group = _read(announce).decode().split()
        assert who == "lane" and int(group) == running.pid  # leads its own group
        os.write(running.decide, b"three")
        status = running.reap(10)
        assert os.waitstatus_to_exitcode(status) == 3
        with pytest.raises(OSError):
            os.write(running.decide, b"x")  # reap closed the decisions pipe
    finally:
        _close_outputs(running)
        launcher.close()


# Without the helper the launcher forks from this process, as it does for a caller without
# pidfd_open; pytest-xdist's worker runs threads, hence the warning on 3.12 and later.
@pytest.mark.filterwarnings("ignore:This process .* is multi-threaded:DeprecationWarning")
@pytest.mark.parametrize("helper", [True, False], ids=["starter", "direct-fork"])
def test_a_forked_worker_is_reaped_by_whoever_forked_it(
    helper: bool, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With ``pidfd_open`` the starter's helper forks and reaps it; without, this process."""
    if helper and not starter.available():
        pytest.skip("no pidfd_open here")
    if not helper:
        monkeypatch.setattr(starter, "available", lambda: False)
    launcher = launch.Launcher(_body)
    try:
        running = launcher.start_worker(SPEC, _channel)
        announce = next(fd for fd, name in running.outputs.items() if name == "announce")
        role, who, parent = _read(announce).decode().split()
        assert (role, who) == ("accept", "lane")
        forked_by = launcher._starter.pid if helper else os.getpid()  # type: ignore[union-attr]
        assert int(parent) == forked_by
        assert (launcher.notices() is not None) == helper
        assert os.getpgid(running.pid) == running.pid
        os.write(running.decide, b"three")
        assert os.waitstatus_to_exitcode(running.reap(10)) == 3
        _close_outputs(running)
    finally:
        launcher.close()
    assert not Path(f"/proc/{running.pid}").exists()


def test_a_worker_that_does_not_end_is_killed_at_the_bound() -> None:
    launcher = launch.Launcher(_body)
    running = launcher.start_command(["sleep", "60"], _channel, control=False)
    try:
        began = time.monotonic()
        status = running.reap(0.3)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        assert time.monotonic() - began < 5
    finally:
        _close_outputs(running)
        launcher.close()


def test_a_command_that_cannot_run_is_named_and_leaves_no_descriptor() -> None:
    launcher = launch.Launcher(_body)
    before = _descriptors()
    with pytest.raises(ExecutionError, match="cannot run /nonexistent/program"):
        launcher.start_command(["/nonexistent/program"], _channel)
    assert _descriptors() == before
    launcher.close()
