"""The starter: workers of a concurrent trace forked by a quiet helper, not by the caller.

Forked by the explorer, every worker made the explorer's heap copy-on-write; the helper
forks them instead, reports their pids and wait statuses and reaps them. These tests run
real processes: who is whose parent, which pipe ends the helper holds, what it reports,
and that nothing outlives :meth:`Starter.close`.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

from faultlab.base import interrupt
from faultlab.process import starter
from faultlab.process.records import WorkerSpec
from faultlab.process.spawn import spawner
from faultlab.run.executor import Executor
from faultlab.system import System
from faultlab.trace import Step

pytestmark = pytest.mark.skipif(not starter.available(), reason="no pidfd_open here")

SPEC = WorkerSpec(system="reference", role="accept", directory="/nonexistent",
                  operation_id="op-1", payload="{}", crash=None)


def _body(spec: WorkerSpec, environment: dict[str, str], channel: tuple[int, int]) -> int:
    """A worker that reports what it was given, then waits for a word on its channel."""
    decide, announce = channel
    os.write(announce, f"{spec.role} {environment['WHO']} {os.getppid()}\n".encode())
    word = os.read(decide, 16)
    return 3 if word == b"three" else 0


def _parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _start(chosen: starter.Starter) -> tuple[int, int, int, int]:
    """Start one worker; (pid, decide write end, announce read end, stdout read end)."""
    decide_r, decide_w = os.pipe()
    announce_r, announce_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = chosen.start(SPEC, {"WHO": "lane"}, (decide_r, announce_w, out_w, err_w))
    for fd in (decide_r, announce_w, out_w, err_w):
        os.close(fd)
    os.close(err_r)
    return pid, decide_w, announce_r, out_r


def _ends_with(chosen: starter.Starter, pid: int, code: int, bound: float,
              descriptors: tuple[int, ...]) -> None:
    """The helper reports worker ``pid`` ended with exit ``code`` within ``bound``
    seconds; this process's ends of its pipes are closed."""
    status = chosen.ended(pid, bound)
    assert status is not None and os.waitstatus_to_exitcode(status) == code
    for fd in descriptors:
        os.close(fd)


def test_a_started_worker_is_the_helpers_child_in_its_own_group_and_reported() -> None:
    chosen = starter.Starter(_body)
    try:
        pid, decide, announce, out = _start(chosen)
        said = os.read(announce, 100).decode().split()
        assert said[:2] == ["accept", "lane"] and int(said[2]) == chosen.pid
        assert _parent_of(pid) == chosen.pid != os.getpid()
        assert os.getpgid(pid) == pid  # leads its own group: the caller signals the group
        assert chosen.ended(pid, 0.2) is None  # alive, waiting for its word
        os.write(decide, b"three")
        status = chosen.ended(pid, 10)
        assert status is not None and os.waitstatus_to_exitcode(status) == 3
        # the helper holds no end of the worker's pipes: the caller sees them close
        assert os.read(announce, 100) == b"" and os.read(out, 100) == b""
        for fd in (decide, announce, out):
            os.close(fd)
    finally:
        chosen.close()
    assert not Path(f"/proc/{chosen.pid}").exists()  # the helper is reaped


def test_a_killed_worker_is_reported_killed_and_close_ends_the_rest() -> None:
    chosen = starter.Starter(_body)
    try:
        killed, decide_1, announce_1, out_1 = _start(chosen)
        alive, decide_2, announce_2, out_2 = _start(chosen)
        for announce in (announce_1, announce_2):
            assert os.read(announce, 100)
        os.killpg(killed, signal.SIGKILL)
        status = chosen.ended(killed, 10)
        assert status is not None and os.waitstatus_to_exitcode(status) == -signal.SIGKILL
    finally:
        chosen.close()  # the helper kills the worker still waiting and reaps it
    assert not Path(f"/proc/{alive}").exists() and not Path(f"/proc/{chosen.pid}").exists()
    for fd in (decide_1, announce_1, out_1, decide_2, announce_2, out_2):
        os.close(fd)


def test_the_helper_is_a_lean_interpreter_prepared_with_the_system() -> None:
    """The helper is a fresh interpreter, not a fork of its caller: prepared as the lanes
    prepare it, it holds the fork server's image and the trace's system, and none of this
    process's Hypothesis, pytest or search, nor (for the reference) threading, subprocess,
    random or hashlib, which every worker forked from it would inherit."""
    import lane_probe

    from faultlab.run.worker import prepare_lanes

    assert {"pytest", "threading"} <= set(lane_probe.held())  # the probe sees them here
    for system, costly in (("reference", "-"), ("no-fencing", None)):
        chosen = starter.Starter(lane_probe.report_modules, prepare_lanes, (system,))
        try:
            pid, decide, announce, out = _start(chosen)
            said = os.read(announce, 300).decode()
            held, loaded = said.split("|")
            if costly is not None:  # a mutant's module brings more (the fork server's too)
                assert held.strip() == costly, said
            assert system in loaded.split(), said  # prepared with the trace's system
            _ends_with(chosen, pid, 0, 10, (decide, announce, out))
        finally:
            chosen.close()


def test_a_body_the_helper_cannot_import_by_name_is_refused() -> None:
    with pytest.raises(ValueError, match="top level of an importable module"):
        starter.Starter(lambda spec, environment, channel: 0)


def test_lane_workers_are_not_forked_by_the_executors_process(reference: System) -> None:
    """The executor's process starts the helper (once per trace here: an executor without
    a run's spawner); every lane worker is the helper's child."""
    payload = '{"title":"starter"}'
    with Executor(reference, concurrency=2) as ex:
        ex.run(Step("accept", "op-1", payload, lane=1, hold=True))
        ex.run(Step("dispatch", lane=2, hold=True))
        pids = [lane.pid for lane in ex.lanes.values()]
        assert ex._lanes is not None
        helper = ex._lanes._launcher._starter
        assert helper is not None and len(pids) == 2
        assert [_parent_of(pid) for pid in pids] == [helper.pid, helper.pid]
        ex.run(Step("finish", lane=1))
        done = ex.run(Step("finish", lane=2))
        assert done.lanes == ("exit 0", "exit 0")
        assert len(done.snapshot.tickets) == 1
    time.sleep(0.05)
    assert not any(Path(f"/proc/{pid}").exists() for pid in [*pids, helper.pid])


class _SignalAfterRecv:
    """The starter's socket, with a real SIGTERM raised at this process the moment a
    message has been read: the instant between reading a notice and recording it."""

    def __init__(self, wrapped: object) -> None:
        self.wrapped = wrapped

    def fileno(self) -> int:
        return int(self.wrapped.fileno())  # type: ignore[attr-defined]

    def recvmsg(self, size: int, ancillary: int) -> object:
        received = self.wrapped.recvmsg(size, ancillary)  # type: ignore[attr-defined]
        signal.raise_signal(signal.SIGTERM)
        return received


def test_a_signal_as_a_notice_is_read_does_not_lose_the_workers_end() -> None:
    """A SIGTERM that lands as a worker's end is read is raised once the end is recorded:
    before, the notice was lost and a cleanup waited out the deadline twice for it (an
    interrupted ``explore --jobs`` took 15-31 s to stop)."""
    chosen = starter.Starter(_body)
    try:
        pid, decide, announce, out = _start(chosen)
        assert os.read(announce, 100)
        while chosen._spare is None:  # the next spare's handover, read before the notice:
            chosen.collect()          # the one message read under the signal is the end
            time.sleep(0.005)
        os.write(decide, b"three")
        assert os.read(out, 100) == b""  # the worker has ended; its notice is on its way
        real = chosen._socket
        chosen._socket = _SignalAfterRecv(real)  # type: ignore[assignment]
        with interrupt.handling(), pytest.raises(interrupt.Interrupted):
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                chosen.collect()
                time.sleep(0.01)
        chosen._socket = real
        _ends_with(chosen, pid, 3, 2, (decide, announce, out))
    finally:
        chosen.close()
        interrupt.reset()  # the signal was this test's: later tests in this process start clean


def _orphaning_body(spec: WorkerSpec, environment: dict[str, str],
                    channel: tuple[int, int]) -> int:
    """A worker that starts a child of its own (as a dispatcher starts its service), says
    the child's pid, and waits."""
    decide, announce = channel
    child = os.fork()
    if child == 0:
        os.read(decide, 1)  # waits until killed
        os._exit(0)
    os.write(announce, f"{child}\n".encode())
    os.read(decide, 1)
    return 0


def test_a_killed_workers_orphan_is_the_helpers_to_reap() -> None:
    """The helper is a child subreaper: a killed worker's child (a dispatcher's service)
    is reparented to it and reaped there, not left to whoever started faultlab (init, in
    a container, may reap it late or never; the executor waited up to 2 s for it)."""
    chosen = starter.Starter(_orphaning_body)
    try:
        worker, decide, announce, out = _start(chosen)
        grandchild = int(os.read(announce, 100).split()[0])
        assert _parent_of(grandchild) == worker
        os.kill(worker, signal.SIGKILL)  # the worker only: its child lives on, orphaned
        status = chosen.ended(worker, 10)
        assert status is not None and os.WIFSIGNALED(status)
        assert _parent_of(grandchild) == chosen.pid  # reparented to the helper
        os.kill(grandchild, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{grandchild}").exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not Path(f"/proc/{grandchild}").exists()  # reaped by the helper
        for fd in (decide, announce, out):
            os.close(fd)
    finally:
        chosen.close()


def test_orphans_of_the_workers_it_kills_as_it_closes_are_reaped_too() -> None:
    """Closing the starter kills the workers still alive with their groups; a worker's own
    child (a dispatcher's service) dies with it and is reaped by the helper before it
    exits, not handed on as a zombie to whoever is above."""
    chosen = starter.Starter(_orphaning_body)
    worker, decide, announce, out = _start(chosen)
    grandchild = int(os.read(announce, 100).split()[0])
    chosen.close()
    assert not Path(f"/proc/{worker}").exists()
    assert not Path(f"/proc/{grandchild}").exists()
    for fd in (decide, announce, out):
        os.close(fd)


def test_a_lane_worker_takes_a_payload_larger_than_one_datagram(reference: System) -> None:
    """A request to the starter's spare is sent in pieces: a generated payload of 210 KB
    failed a long concurrent exploration (``Message too long``: one datagram may not exceed
    the socket's buffer, 208 KiB by default). Accepted in a lane, it is stored whole."""
    payload = {"title": "big", "blob": "x" * 300_000}
    with Executor(reference, concurrency=2) as ex:
        done = ex.run(Step("accept", "op-1", payload, lane=1))
        assert done.lanes[0] == "exit 0" and done.violations == ()
        (operation,) = done.snapshot.operations
        assert json.loads(operation.payload) == payload


@pytest.mark.parametrize("laned", [False, True])
def test_an_exec_worker_takes_a_payload_longer_than_one_argument(reference: System,
                                                                   laned: bool) -> None:
    """An exec'd worker (``--spawn exec``; lanes that record for power cuts) got its payload
    as one argument, and Linux refuses to execute a command with an argument over 128 KiB
    (E2BIG): a generated payload of 210 KB would have ended the run. It now goes in a file
    of the run directory; accepted sequentially or in a lane, it is stored whole."""
    payload = {"title": "big", "blob": "x" * 300_000}
    step = Step("accept", "op-1", payload, lane=1 if laned else None)
    with spawner("exec") as runner, Executor(reference, runner, concurrency=2 if laned else 1,
                                             laned=laned) as ex:
        done = ex.run(step)
        assert done.violations == ()
        (operation,) = done.snapshot.operations
        assert json.loads(operation.payload) == payload
        (written,) = ex.directory.glob("payload-*.json")
        assert json.loads(written.read_text()) == payload
