"""Run one worker as a real OS process and observe how it ended.

Two spawn modes give the same process boundary:

* ``fork`` (default): a fork server started once per run has already imported
  what a worker uses (:func:`preload`); it forks one child per worker, the next
  one while the current one runs (a few milliseconds a worker: bench/spawn.py),
  and keeps a spare for the next service a worker asks it for
  (:func:`run_service`).
* ``exec``: a fresh interpreter per worker, ``python -m faultlab worker ...``.

Each worker runs in its own process group, and the service it calls joins that
group, so a missed deadline kills exactly that worker and its service, and
nothing else. Every child is reaped before :func:`Spawner.run` returns, except
a fork server's worker that ended its action: it closed every file it held and
said its exit status, so the server answers while its memory is still being
unmapped and reaps it right after, before it runs the next worker
(:func:`_end_action`).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found, unused-ignore]
import gc
import json
import os
import select
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from functools import partial
from typing import IO, TYPE_CHECKING, Any, NoReturn, Protocol, TypeVar, cast

from faultlab.base import interrupt
from faultlab.base.clock import CLOCK_ENV
from faultlab.base.errors import ExecutionError
from faultlab.base.wall_clock import (
    FOLLOW_VARIABLE,
    LOAD_VARIABLES,
    SHARED_VARIABLE,
    SharedArea,
    server_variables,
    under_library,
)
from faultlab.process.records import (
    DEFAULT_DEADLINE,
    POWER_LOG_VARIABLE,
    SPAWN_MODES,
    ProcessRecord,
    SpawnMode,
    WorkerSpec,
    parse_response,
)

if TYPE_CHECKING:
    import subprocess

#: The fork server's entry point, named as exec mode names ``python -m faultlab worker``: the
#: process layer starts it by name and never imports the worker or the systems it runs.
FORK_SERVER_ENTRY = "faultlab.run.worker:serve_forks"
_MAX_OUTPUT = 1 << 20
#: After a deadline kill, how long to wait for the pipes to close. A process that left the
#: worker's group can hold them open forever; faultlab must not wait for it.
_KILL_GRACE = 2.0
#: How a worker runs inside a process: the role's code, returning the exit status.
WorkerMain = Callable[[WorkerSpec], int]
#: Environment variables a forked worker sets itself, before it runs: each is read where it
#: is used, not as the process starts (faultlab's clock file, the file libfaketime follows,
#: the power-loss recording's log directory).
_CHILD_VARIABLES = frozenset({CLOCK_ENV, FOLLOW_VARIABLE, POWER_LOG_VARIABLE})
#: Environment variables only a process's start can give (a preloaded library and the
#: settings it reads as it loads): a fork server started with them passes them on.
_SERVER_VARIABLES = frozenset(LOAD_VARIABLES)


#: What a fork server does with one request line a worker wrote on its service channel,
#: given the seconds left before the worker's deadline.
ServeRequest = Callable[[bytes, float], None]


def _collect(pid: int, fds: dict[int, str], deadline: float, group: bool,
             requests: tuple[int, ServeRequest] | None = None) -> tuple[
    dict[str, bytes], int, bool
]:
    """Read the child's pipes to EOF and reap it; kill it (or its group) at the deadline.

    ``requests`` is a descriptor on which the child asks for services, one line each,
    and what serves them (:func:`_serve_service`), called as each line completes.

    If anything interrupts the wait (SIGINT, SIGTERM), the child is killed and reaped
    before the exception goes on: an interrupted run leaves no worker behind.
    """
    outputs, status, timed_out, _ = _collect_announced(pid, fds, deadline, group, requests)
    return outputs, status, timed_out


def _collect_announced(
    pid: int, fds: dict[int, str], deadline: float, group: bool,
    requests: tuple[int, ServeRequest] | None = None, announced: int = -1,
) -> tuple[dict[str, bytes], int, bool, bool]:
    """:func:`_collect`, for a child that says its exit status on ``announced`` as it
    ends its action (:func:`_end_action`): (outputs, wait status, timed out, exiting).

    When the pipes closed with a status said, the child is not waited for: the status is
    returned as a wait status, and ``exiting`` tells the caller to reap it with
    :func:`_confirm_exit` before it starts another. Otherwise (killed at a crash point,
    no status) it is reaped here, as :func:`_collect` does.
    """
    try:
        outputs, end, timed_out = _read_outputs(pid, fds, deadline, group, requests)
        code = _announced_status(announced) if announced >= 0 and not timed_out else None
        if code is not None:
            return outputs, code << 8, False, True
        status, timed_out = _reap(pid, end, timed_out, group)
    except BaseException:
        end_child(pid, group)
        raise
    if timed_out and group:
        reap_group(pid)  # what the killed worker started (its service) goes too
    return outputs, status, timed_out, False


def _announced_status(fd: int) -> int | None:
    """The exit status a child wrote on ``fd`` as it ended its action, if it did."""
    os.set_blocking(fd, False)
    try:
        data = os.read(fd, 1)
    except BlockingIOError:
        return None
    return data[0] if data else None


def _confirm_exit(pid: int, code: int) -> str | None:
    """Reap a child that said it ends with ``code`` and closed everything it held; a
    description of the difference if it ended otherwise (something outside killed it in
    the moment between): the run is then broken, not a finding.

    It has nothing left to do but exit; if it has not within :data:`_KILL_GRACE`, it is
    killed (it is our unreaped child, so the pid is still its own).
    """
    try:
        status, _ = _reap(pid, time.monotonic() + _KILL_GRACE, False, False)
    except ChildProcessError:
        return f"worker {pid} was reaped before its status could be confirmed"
    ended = os.waitstatus_to_exitcode(status)
    if ended == code:
        return None
    return f"worker {pid} said it ends with status {code} but ended with {ended}"


def end_child(pid: int, group: bool) -> None:
    """Kill and reap our child ``pid`` (and its group), unless it was already reaped.

    The child is signalled only while it is known unreaped, so its pid cannot have been
    reused by a process faultlab did not start.
    """
    with interrupt.deferred():
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return  # reaped already
        if waited:
            return
        _kill(pid, group)
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass
        if group:
            reap_group(pid)


def _group_stats(pgid: int) -> Iterator[tuple[int, list[bytes]]]:
    """(pid, the fields of /proc/PID/stat after the command name) of every process in
    group ``pgid`` (Linux /proc; elsewhere none)."""
    try:
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stream:
                fields = stream.read().rsplit(b")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:
            yield int(entry), fields


def _group_members(pgid: int) -> list[tuple[int, int]]:
    """(pid, parent pid) of every process in group ``pgid``."""
    return [(pid, int(fields[1])) for pid, fields in _group_stats(pgid)]


def _tree_stats(pid: int) -> Iterator[list[bytes]]:
    """The /proc/PID/stat fields (after the command name) of ``pid`` and its descendants,
    found through each process's ``children`` file: a few reads, not a scan of /proc."""
    stack = [pid]
    while stack:
        current = stack.pop()
        try:
            with open(f"/proc/{current}/stat", "rb") as stream:
                fields = stream.read().rsplit(b")", 1)[1].split()
            with open(f"/proc/{current}/task/{current}/children", "rb") as stream:
                children = stream.read().split()
        except OSError:
            continue
        yield fields
        stack.extend(int(child) for child in children)


def tree_pids(pid: int) -> Iterator[int]:
    """``pid`` and then its descendants (a worker and the service child it started), found
    through each process's ``children`` file, lazily: a caller that finds what it looks
    for in the worker itself reads nothing more."""
    stack = [pid]
    while stack:
        current = stack.pop()
        yield current
        try:
            with open(f"/proc/{current}/task/{current}/children", "rb") as stream:
                stack.extend(int(child) for child in stream.read().split())
        except OSError:
            continue


def tree_activity(pid: int) -> tuple[bool, int]:
    """Whether ``pid`` or a descendant of it is on a CPU or waiting for one (state R, or
    D: in the kernel on its behalf), and their CPU time so far in clock ticks.

    A worker waiting on another's SQLite lock sleeps (state S) and burns next to no CPU;
    one still starting (an exec'd interpreter on a loaded machine), or waiting for a
    service child that is, is runnable or burns CPU. Telling the two apart keeps a slow
    start from being judged blocked.
    """
    runnable, ticks = False, 0
    for fields in _tree_stats(pid):
        runnable = runnable or fields[0] in (b"R", b"D")
        ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return runnable, ticks


def group_exists(pgid: int) -> bool:
    """Whether any process (a zombie too) is left in group ``pgid``: ``killpg`` with signal
    0, which sends nothing and only checks (POSIX). A group that exists is then looked for
    in /proc, which takes milliseconds on a busy machine: every process's stat is read."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a process of another user leads a group of that number now
        return True
    return True


def reap_group(pgid: int, wait: float = 1.0) -> None:
    """After a killed worker's leader is reaped: reap the rest of its group (a service the
    dispatcher started) where it was reparented to this process (a child subreaper), and
    give the others a moment to be reaped by theirs. Never signals anything."""
    me = os.getpid()
    end = time.monotonic() + wait
    while True:
        if not group_exists(pgid):
            return  # the usual case, in one system call rather than a scan of /proc
        members = _group_members(pgid)
        for pid, parent in members:
            if parent == me:
                try:
                    os.waitpid(pid, os.WNOHANG)
                except ChildProcessError:
                    pass
        if not members or time.monotonic() >= end:
            return
        time.sleep(0.005)


def _read_outputs(pid: int, fds: dict[int, str], deadline: float, group: bool,
                  requests: tuple[int, ServeRequest] | None = None) -> tuple[
    dict[str, bytes], float, bool
]:
    """Read the child's pipes to EOF, killing it (or its group) at the deadline: (outputs,
    the deadline as a monotonic time, timed out). It waits with ``select.poll`` rather than the
    ``selectors`` module: the fork server runs it for every worker, and each page of
    Python it touches is a copy-on-write fault while a spare shares it (measured: about
    15 fewer faults a step, and one module less in its image)."""
    chunks: dict[str, list[bytes]] = {name: [] for name in fds.values()}
    sizes = dict.fromkeys(fds.values(), 0)
    poller = select.poll()
    for fd in fds:
        os.set_blocking(fd, False)
        poller.register(fd, select.POLLIN)
    reading = set(fds)
    pending = b""  # a service request not yet complete
    if requests is not None:
        os.set_blocking(requests[0], False)
        poller.register(requests[0], select.POLLIN)
    end = time.monotonic() + deadline
    timed_out = False
    try:
        while reading:
            remaining = end - time.monotonic()
            if remaining <= 0 and not timed_out:
                timed_out = True
                _kill(pid, group)
            if timed_out and remaining <= -_KILL_GRACE:
                break  # something outside the killed group still holds the pipes
            for fd, _ in poller.poll((max(remaining, 0.05) if not timed_out else 1) * 1000):
                if requests is not None and fd == requests[0]:
                    data = os.read(fd, 65536)
                    if not data:  # the worker ended: it asks for nothing more
                        poller.unregister(fd)
                        continue
                    pending += data
                    while b"\n" in pending and not timed_out:
                        line, _, pending = pending.partition(b"\n")
                        requests[1](line, end - time.monotonic())
                    continue
                data = os.read(fd, 65536)
                if not data:  # end of file (POLLHUP): the writer closed it or exited
                    poller.unregister(fd)
                    reading.discard(fd)
                    continue
                name = fds[fd]
                if sizes[name] < _MAX_OUTPUT:
                    chunks[name].append(data)
                    sizes[name] += len(data)
    finally:
        for fd in fds:
            os.close(fd)
    return {name: b"".join(parts) for name, parts in chunks.items()}, end, timed_out


def _reap(pid: int, end: float, timed_out: bool, group: bool) -> tuple[int, bool]:
    """Wait for the child to exit (its pipes may close first), killing it at ``end``.

    Where the kernel offers a pidfd the wait wakes the moment the child exits;
    elsewhere it polls every half millisecond.
    """
    waited, status = os.waitpid(pid, os.WNOHANG)
    if waited:
        return status, timed_out
    pidfd: int | None = None
    try:
        pidfd = os.pidfd_open(pid) if hasattr(os, "pidfd_open") else None
    except OSError:
        pidfd = None
    try:
        while True:
            remaining = end - time.monotonic()
            if remaining <= 0 and not timed_out:
                timed_out = True
                _kill(pid, group)
            if pidfd is not None:
                select.select([pidfd], [], [], max(remaining, 0.05))
            else:
                time.sleep(0.0005)
            waited, status = os.waitpid(pid, os.WNOHANG)
            if waited:
                return status, timed_out
    finally:
        if pidfd is not None:
            os.close(pidfd)


def lead_own_group(pid: int) -> None:
    """Make a just-forked child the leader of its own process group, from the parent.

    The child does the same (``setpgid(0, 0)``) as it starts, but a parent that killed the
    group before the child got that far would find no such group and kill nothing: the
    child would run on, unknown (seen: an interrupt right after a lane's fork left it
    alive). Both sides calling it, as job-control shells do, closes that window. A child
    that already did it, exec'd or ended makes this fail harmlessly.
    """
    try:
        os.setpgid(pid, pid)
    except OSError:
        pass


def _kill(pid: int, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, signal.SIGKILL)
        else:
            os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _record(pid: int, outputs: dict[str, bytes], status: int, started: float,
            timed_out: bool) -> ProcessRecord:
    stdout = outputs["stdout"].decode("utf-8", "replace")
    stderr = outputs["stderr"].decode("utf-8", "replace")
    if timed_out:
        stderr += "faultlab: worker missed its deadline and was killed\n"
    return ProcessRecord(
        pid=pid,
        exit_code=os.waitstatus_to_exitcode(status),
        response=parse_response(stdout),
        stdout=stdout,
        stderr=stderr,
        elapsed=time.monotonic() - started,
        timed_out=timed_out,
    )


#: Signals a worker takes with their default action (the fork server ignores or handles them).
_DEFAULT_ACTIONS = (int(signal.SIGINT), int(signal.SIGTERM), int(signal.SIGPIPE))
_SIG_DFL = int(signal.SIG_DFL)
#: Text streams on descriptors 0, 1 and 2: stdin, stdout, stderr.
StandardStreams = tuple[IO[str], IO[str], IO[str]]


def standard_streams() -> StandardStreams:
    """New, empty text streams on descriptors 0, 1 and 2 (not closing them on release).

    Built before a fork and never written in the parent, they hold no buffered data that
    a child could inherit and write a second time.
    """
    return (
        open(0, closefd=False),  # noqa: SIM115
        open(1, "w", closefd=False),  # noqa: SIM115
        open(2, "w", closefd=False),  # noqa: SIM115
    )


def child_main(
    out_w: int, err_w: int, *, new_group: bool, read_spec: Callable[[], WorkerSpec | None],
    run: WorkerMain, keep: tuple[int, ...] = (), streams: StandardStreams | None = None,
    announce: int | None = None,
) -> NoReturn:
    """The body of a forked worker: its own group, stdout/stderr to the pipes, run, exit.

    ``streams`` are unused text streams on descriptors 0, 1 and 2 built by the parent
    (:func:`standard_streams`), so that the child does not build its own. ``announce``
    (kept open, like ``keep``) is where a worker that ran its spec says how it ends
    (:func:`_end_action`).
    """
    code = 70
    ran = False
    try:
        if new_group:
            os.setpgid(0, 0)
        for signum in _DEFAULT_ACTIONS:
            # the C function: signal.signal's enum conversion of the old handler touches
            # enough shared objects to cost the child ~60 copy-on-write page faults
            _signal.signal(signum, _SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        low = 3  # close every other descriptor: the child holds only its own pipes
        for fd in sorted(keep):
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1024)
        # Python-level streams on the new descriptors, made before a spare waits for its
        # spec. Building them costs a fresh child ~100 copy-on-write faults (half a
        # millisecond); a fork server hands its spares a set it built once and never used.
        sys.stdin, sys.stdout, sys.stderr = streams or standard_streams()
        spec = read_spec()
        if spec is None:  # a spare that was never assigned: the fork server is closing
            code = 0
        else:
            ran = True
            code = run(spec)
    except BaseException:
        try:
            os.write(2, traceback.format_exc().encode())
        except OSError:
            pass
        code = 70
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:  # noqa: BLE001
            pass
        if announce is not None and ran:
            _end_action(announce, code)
        os._exit(code)


#: Above every descriptor a worker can hold: its limit of open files (``closerange``
#: closes what is open in one system call where the kernel has ``close_range``, and
#: closes each number in turn where it has not, so the bound is the real one).
_DESCRIPTOR_LIMIT = max(os.sysconf("SC_OPEN_MAX"), 1024)


def _end_action(announce: int, code: int) -> None:
    """End a worker's action before its process exits: close every file it holds, say its
    exit status on ``announce``, then close its output pipes.

    A process's exit first unmaps its memory and only then closes its files: about a
    millisecond on this VM, on the clock of every step while the fork server waited for
    the pipes to close (docs/internals/speed.md). Closed here, every store's file, lock
    and connection is released before the pipes close, so once the server sees them
    closed with a status said, the action is over: it answers with that status and reaps
    the process right after (:func:`_confirm_exit`, which reports a process that then ends
    otherwise). Nothing runs after this but ``os._exit(code)``, so only a process with no
    other thread says its status: another thread could still act (open a file, write a
    store) after the descriptors were closed; for such a process, or where ``/proc`` does
    not say, the server waits for the exit, as for a killed worker.
    """
    try:
        if len(os.listdir("/proc/self/task")) != 1:
            return
        os.closerange(3, announce)
        os.closerange(announce + 1, _DESCRIPTOR_LIMIT)
        os.write(announce, bytes((code & 0xFF,)))
        for fd in (0, 1, 2, announce):
            os.close(fd)
    except OSError:
        pass  # the server finds no status, or the pipes still open, and waits for the exit


def fork_worker(spec: WorkerSpec, run: WorkerMain, *, new_group: bool) -> ProcessRecord:
    """Fork this (already warmed-up) process and run ``run(spec)`` in the child."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(out_r)
        os.close(err_r)
        child_main(out_w, err_w, new_group=new_group, read_spec=lambda: spec, run=run)
    if new_group:
        lead_own_group(pid)
    os.close(out_w)
    os.close(err_w)
    outputs, status, timed_out = _collect(
        pid, {out_r: "stdout", err_r: "stderr"}, spec.deadline, new_group
    )
    return _record(pid, outputs, status, started, timed_out)


@dataclass(frozen=True)
class _Spare:
    """A forked worker waiting for its assignment on ``control``."""

    pid: int
    control: int
    stdout: int
    stderr: int
    #: The server's ends of the worker's service channel (-1 for a service, which has
    #: none): the worker's requests come in on one, their records go back on the other.
    requests: int = -1
    replies: int = -1
    #: The server's end of the pipe on which the worker says its exit status as it ends
    #: its action (:func:`_end_action`).
    status: int = -1


#: In a worker forked by a fork server: (its pid, where it writes a service request,
#: where it reads the service's record). See :func:`run_service`.
_service_channel: tuple[int, int, int] | None = None


def rehearse() -> None:
    """Start SQLite and JSON in the spare, before it is assigned.

    The first SQLite connection in a process initialises the library (mutexes,
    allocator, the file-system layer) and, in a forked child, pays copy-on-write
    faults for the pages that touches; opening and closing an in-memory database
    does that while the spare is idle. It is deliberately small: on a machine with
    two cores the spare prepares while the previous worker runs, and a fuller
    rehearsal (a table, a transaction) measured slower, not faster. No store is
    touched.
    """
    import sqlite3

    connection = sqlite3.connect(":memory:", isolation_level=None)
    try:
        connection.execute("PRAGMA application_id").fetchone()
    finally:
        connection.close()
    json.loads(json.dumps({"rehearsal": [1, "two", None]}, sort_keys=True))


def _read_spec(fd: int) -> WorkerSpec | None:
    """A spare's assignment. The variables of its environment are set here, in the child
    (the client chose a fork server started with what only a process's start can give:
    :func:`server_environment`)."""
    rehearse()
    chunks = []
    while data := os.read(fd, 65536):
        chunks.append(data)
    os.close(fd)
    if not chunks:
        return None
    spec = WorkerSpec(**json.loads(b"".join(chunks)))
    for name, value in spec.environment:
        os.environ[name] = value
    return spec


def _fork_spare(run: WorkerMain, streams: StandardStreams | None, *,
                service: bool = False) -> _Spare:
    """Fork the next worker ahead of time, so fork and copy-on-write happen off the clock.

    The spare is a fresh process like any other worker: it blocks until the fork server
    writes its spec, runs it once and exits. A worker starts in its own process group and
    gets a service channel (:func:`run_service`); a ``service`` spare stays in the
    server's group until a worker's request moves it into that worker's.
    """
    global _service_channel
    control_r, control_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    status_r, status_w = os.pipe()
    channel = () if service else (*os.pipe(), *os.pipe())  # requests r, w; replies r, w
    server = os.getpid()
    pid = os.fork()
    if pid == 0:  # child: never returns
        _die_with(server)
        keep: tuple[int, ...] = (control_r, status_w)
        for fd in (control_w, out_r, err_r, status_r, *channel[0::3]):
            os.close(fd)
        if channel:
            _service_channel = (os.getpid(), channel[1], channel[2])
            keep += (channel[1], channel[2])
        child_main(out_w, err_w, new_group=not service,
                   read_spec=lambda: _read_spec(control_r), run=run, keep=keep,
                   streams=streams, announce=status_w)
    if not service:
        lead_own_group(pid)
    for fd in (control_r, out_w, err_w, status_w, *channel[1:3]):
        os.close(fd)
    if channel:
        return _Spare(pid, control_w, out_r, err_r, channel[0], channel[3], status_r)
    return _Spare(pid, control_w, out_r, err_r, status=status_r)


def _assign(worker: _Spare, line: bytes) -> float:
    """Hand the spare its spec (EOF after it); the worker's clock starts now."""
    started = time.monotonic()
    try:
        os.write(worker.control, line)
    finally:
        os.close(worker.control)
    return started


def _finish(own: _Children, worker: _Spare, spec: WorkerSpec, started: float,
            serve: ServeRequest) -> ProcessRecord:
    """Collect an assigned worker's record; one that ended its action and said its status
    is left to exit, in ``own.exiting``, for :meth:`_Children.confirm` to reap."""
    outputs, status, timed_out, exiting = _collect_announced(
        worker.pid, {worker.stdout: "stdout", worker.stderr: "stderr"}, spec.deadline,
        True, (worker.requests, serve), worker.status,
    )
    if exiting:
        own.exiting.append((worker.pid, os.waitstatus_to_exitcode(status)))
    return _record(worker.pid, outputs, status, started, timed_out)


def _close_channel(worker: _Spare) -> None:
    """Close the server's ends of an assigned worker's service channel and status pipe."""
    for fd in (worker.requests, worker.replies, worker.status):
        if fd >= 0:
            os.close(fd)


def _close_ends(spare: _Spare) -> None:
    """Close the server's ends of every pipe of a spare that was never assigned."""
    for fd in (spare.control, spare.stdout, spare.stderr):
        os.close(fd)
    _close_channel(spare)


def _retire(spare: _Spare) -> None:
    """Release a spare that will not be used: EOF on its control pipe makes it exit."""
    _close_ends(spare)
    os.waitpid(spare.pid, 0)


def _discard(spare: _Spare) -> None:
    """Kill and reap a spare that cannot be used (unless it was reaped already), and close
    the server's ends of its pipes."""
    end_child(spare.pid, False)
    _close_ends(spare)


def _serve_service(own: _Children, worker: _Spare, line: bytes, remaining: float,
                   run: WorkerMain, streams: StandardStreams) -> None:
    """Run the service ``worker`` asked for (``line``: its spec) and write back its record.

    The service is the server's service spare, moved into the worker's process group
    first, so that the worker's deadline kills it with the worker, as it would a child
    the worker forked itself. It has the service's own deadline, or what is left of the
    worker's if that is shorter. A new service spare is forked after the reply, while the
    worker goes on. A spare that cannot join the group is replaced once (it may have been
    killed from outside while it waited); when the fresh one cannot join either, the
    worker died after asking: it gets no reply, and the fresh spare is kept.
    """
    try:
        spec = WorkerSpec(**json.loads(line))
    except (ValueError, TypeError) as error:
        _reply(worker, {"error": f"bad service request: {error}"})
        return
    for attempt in range(2):
        with interrupt.deferred():
            own.serving = own.service if own.service is not None else \
                _fork_spare(run, streams, service=True)
            own.service = None
        service = own.serving
        try:
            os.setpgid(service.pid, worker.pid)
            break
        except OSError:
            # a spare that died (something outside killed it), or a worker that did
            own.serving = None
            if attempt == 0:
                _discard(service)
            else:  # a fresh spare too: the worker's group is gone, it asks for nothing
                own.service = service
                return
    started = _assign(service, line)
    limit = min(spec.deadline, max(remaining, 0.0))
    outputs, status, timed_out, exiting = _collect_announced(
        service.pid, {service.stdout: "stdout", service.stderr: "stderr"}, limit, False,
        announced=service.status,
    )
    if exiting:
        own.exiting.append((service.pid, os.waitstatus_to_exitcode(status)))
    _close_channel(service)
    own.serving = None
    if timed_out and limit < spec.deadline:
        # the worker's own deadline: its whole group goes (the service went first), and
        # it must not go on with a reply, as when it waited for a child of its own
        _kill(worker.pid, True)
    else:
        _reply(worker, {"record": _record(service.pid, outputs, status, started,
                                          timed_out).to_json()})
    with interrupt.deferred():
        own.service = _fork_spare(run, streams, service=True)
    own.confirm()  # while the worker goes on with the reply


def _reply(worker: _Spare, reply: dict[str, Any]) -> None:
    """Write one reply line on the worker's channel; a worker that died is not an error."""
    os.set_blocking(worker.replies, True)
    try:
        _write_line(worker.replies, reply)
    except OSError:
        pass


def _write_line(fd: int, value: dict[str, Any]) -> None:
    """Write ``value`` as one JSON line, whole (a pipe may take it in parts)."""
    data = json.dumps(value).encode() + b"\n"
    while data:
        data = data[os.write(fd, data):]


#: In a worker whose services no fork server runs (a lane's, forked by the lanes' helper)
#: and that records for power cuts: the service spare it forked before it recorded
#: anything (:func:`keep_service_spare`), until a service takes it.
_clean_service: _Spare | None = None


def keep_service_spare(run: WorkerMain) -> None:
    """Fork, now, the service this worker may ask for: a spare waiting for its spec.

    For a worker about to record for power cuts with no fork server to run its services
    (a lane's dispatcher): a service forked from it once it records inherits its open
    connections and the recording VFS's open files (it left a WAL database malformed), so
    such a service was exec'd, an interpreter's start (about 100 ms) per service. Forked
    before this process opens or records anything, the spare shares neither, and
    installs the recording VFS itself when it runs. It is this worker's child in its
    group, as a service forked on demand is; unused, :func:`release_service_spare` ends it.
    There is one: a second service the same worker asks for is exec'd.
    """
    global _clean_service
    if _clean_service is None:
        _clean_service = _fork_spare(run, None, service=True)


def has_service_spare() -> bool:
    """Whether this worker holds a spare of :func:`keep_service_spare` for its service."""
    return _clean_service is not None


def release_service_spare() -> None:
    """End the spare of :func:`keep_service_spare` if no service took it (EOF on its
    control pipe, then reaped: the worker's group holds nothing of it afterwards)."""
    global _clean_service
    spare, _clean_service = _clean_service, None
    if spare is not None:
        _retire(spare)


def server_runs_services() -> bool:
    """Whether this process is a worker whose fork server runs its services (from a spare
    forked off the server's clean image): :func:`run_service` then forks nothing here."""
    return _service_channel is not None and _service_channel[0] == os.getpid()


def run_service(spec: WorkerSpec, run: WorkerMain) -> ProcessRecord:
    """Run a service for the worker in this process, as a process of its own in its group.

    A worker forked by a fork server asks the server for it: the server keeps a spare
    forked from its clean image, so the service starts warm and its fork is off this
    worker's clock (forking it here, from a worker that has run, made sequential
    exploration about 1.08x slower: docs/internals/speed.md). Anywhere else (a worker in
    a lane, started by the lanes' starter) it is the spare this worker forked before it
    recorded (:func:`keep_service_spare`), or else forked from this process now.
    """
    global _clean_service
    channel = _service_channel
    if channel is None or not server_runs_services():
        spare, _clean_service = _clean_service, None
        if spare is None:
            return fork_worker(spec, run, new_group=False)
        started = _assign(spare, json.dumps(vars(spec)).encode())
        try:
            outputs, status, timed_out = _collect(
                spare.pid, {spare.stdout: "stdout", spare.stderr: "stderr"}, spec.deadline,
                False)
        finally:
            _close_channel(spare)
        return _record(spare.pid, outputs, status, started, timed_out)
    _, requests, replies = channel
    _write_line(requests, vars(spec))
    chunks: list[bytes] = []
    while not chunks or not chunks[-1].endswith(b"\n"):
        chunk = os.read(replies, 65536)
        if not chunk:
            raise ExecutionError("the fork server ended before the service's record came")
        chunks.append(chunk)
    reply = json.loads(b"".join(chunks))
    if "error" in reply:
        raise ExecutionError(f"the fork server could not run the service: {reply['error']}")
    return ProcessRecord.from_json(reply["record"])


def child_environment() -> dict[str, str]:
    """Environment for exec-mode children: they must import what this process imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


#: A payload longer than this many bytes reaches an exec'd worker in a file, not as one
#: argument (:func:`worker_command`): Linux refuses an argument over 128 KiB.
ARGUMENT_BYTES = 64 << 10


def worker_command(spec: WorkerSpec) -> list[str]:
    """The command line that runs ``spec`` in a fresh interpreter. A payload longer than
    :data:`ARGUMENT_BYTES` is written to a file of the run directory first (named by its
    content, so a retry of the same payload reuses it; written whole or not at all) and
    passed as ``--payload-file``: Linux refuses to execute a command with one argument
    over 128 KiB (E2BIG), and a generated payload can be longer."""
    data = (spec.payload or "").encode()
    if len(data) <= ARGUMENT_BYTES:
        return spec.argv()
    import hashlib  # here, not in the fork server's image: exec mode only

    path = os.path.join(spec.directory, f"payload-{hashlib.sha256(data).hexdigest()[:16]}.json")
    if not os.path.exists(path):
        partial = f"{path}.{os.getpid()}.partial"
        with open(partial, "wb") as stream:
            stream.write(data)
        os.replace(partial, path)
    return spec.argv(payload_file=path)


def exec_worker(spec: WorkerSpec, *, new_group: bool) -> ProcessRecord:
    """Run the worker in a fresh interpreter: ``python -m faultlab worker ...``."""
    return run_command(worker_command(spec), deadline=spec.deadline,
                       env={**child_environment(), **dict(spec.environment)},
                       new_group=new_group)


def run_command(
    argv: Sequence[str],
    *,
    deadline: float = DEFAULT_DEADLINE,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    pass_fds: Sequence[int] = (),
    started: Callable[[int], None] | None = None,
    new_group: bool = True,
) -> ProcessRecord:
    """Run a program as a worker: an exec-mode faultlab worker, or a command-line system's.

    No shell; stdin is /dev/null; the program gets its own process group (unless
    ``new_group`` is false: a service child stays in its dispatcher's group), so the
    deadline kills it and any child it started, and nothing else. ``started`` is
    called with the pid before its output is collected. The child is reaped
    before this returns; a program that cannot be started raises ExecutionError.
    """
    import subprocess

    began = time.monotonic()
    child: subprocess.Popen[bytes] | None = None
    fds: dict[int, str] = {}
    try:
        # deferred: a signal as the child starts is raised once it is known here, so the
        # handler below kills and reaps it (it ran on, unreaped, when the signal came first)
        with interrupt.deferred():
            try:
                child = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=None if env is None else dict(env),
                    cwd=cwd,
                    pass_fds=tuple(pass_fds),
                    start_new_session=new_group,
                )
            except OSError as error:
                raise ExecutionError(
                    f"cannot run {argv[0]}: {error.strerror or error}") from None
            if child.stdout is None or child.stderr is None:
                raise ExecutionError("worker pipes were not created")
            fds = {os.dup(child.stdout.fileno()): "stdout",
                   os.dup(child.stderr.fileno()): "stderr"}
            child.stdout.close()
            child.stderr.close()
        if started is not None:
            started(child.pid)
    except BaseException:
        if child is not None:
            _kill(child.pid, new_group)
            _collect(child.pid, fds, deadline, new_group)
            child.returncode = -signal.SIGKILL
        raise
    try:
        outputs, status, timed_out = _collect(child.pid, fds, deadline, new_group)
    except BaseException:
        child.returncode = -signal.SIGKILL  # killed and reaped by _collect
        raise
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped by _collect
    return _record(child.pid, outputs, status, began, timed_out)


# --- the fork server ---------------------------------------------------------------------

def bootstrap(entry: str) -> str:
    """The ``python -c`` program of a helper process of ours (the fork server, the lanes'
    starter): restore the caller's sys.path from ``sys.argv[1]``, call ``module:function``."""
    module, _, function = entry.partition(":")
    return (
        "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
        f"from {module} import {function} as main; main()"
    )


def become_subreaper() -> None:
    """Become the reaper of orphaned grandchildren (Linux), so none stays a zombie.

    The fork server is one; so is the ``faultlab`` program (a killed exec-mode
    dispatcher's service is reparented to it, and reaped, not left to its caller)."""
    _set_child_subreaper()


#: The C library's ``prctl``, kept once this process has made itself a child subreaper
#: (so the fork server has it before it forks a spare, which uses it: :func:`_die_with`).
_prctl: Callable[..., int] | None = None
_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_SIGKILL = int(signal.SIGKILL)  # a plain int: no enum work in a forked child


def _set_child_subreaper() -> None:
    """Become the reaper of orphaned grandchildren (Linux), so none stays a zombie."""
    global _prctl
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        _prctl = libc.prctl
    except (OSError, AttributeError):
        pass


def _die_with(parent: int) -> None:
    """Have the kernel SIGKILL this forked child when ``parent``, which forked it, dies.

    A fork server's worker runs in a group of its own, and only the server knows its pid:
    a server killed from outside (by hand, or by the kernel's out-of-memory killer) would
    leave it running, orphaned, for as long as it hangs (a waiting spare ends by itself,
    its spec's pipe closed). A parent that died before the request took effect is seen
    at once: the child then has another parent, and ends. Called by a spare before it
    waits for its spec, off the clock; where ``prctl`` is not to be had, nothing changes.
    """
    if _prctl is None:
        return
    _prctl(_PR_SET_PDEATHSIG, _SIGKILL, 0, 0, 0)
    if os.getppid() != parent:
        os._exit(70)


def _reap_orphans(wait: float = 0.0) -> None:
    """Reap orphaned grandchildren that were reparented to the fork server.

    The waiting spare is alive and blocked, so ``WNOHANG`` never takes it. With ``wait``
    (as the server ends), keep reaping for up to that long while children remain: a
    killed worker's service may still be dying.
    """
    end = time.monotonic() + wait
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= end:
                return
            time.sleep(0.005)


@dataclass
class _Children:
    """The fork server's children that are not reaped yet: the spares (a worker's and a
    service's), the running worker and the service it asked for, and those that ended
    their action and are exiting."""

    spare: _Spare | None = None
    running: _Spare | None = None  # assigned a spec and not yet reaped
    service: _Spare | None = None  # forked for the next service a worker asks for
    serving: _Spare | None = None  # the service a running worker asked for
    #: (pid, the status it said) of each worker or service answered for and not yet reaped
    exiting: list[tuple[int, int]] = field(default_factory=list)
    #: Why the run is broken: a process that ended otherwise than it said. Every later
    #: request is answered with it, and the server ends with it.
    broken: str | None = None

    def confirm(self) -> None:
        """Reap the exiting children, keeping the first difference from what they said.

        An interruption waits for each reap (a child that has nothing left to do but exit,
        at most :data:`_KILL_GRACE`): raised between the reap and the list's update, it
        would leave a reaped pid to be waited for again, and a spare unreleased."""
        while self.exiting:
            with interrupt.deferred():
                pid, code = self.exiting[0]
                difference = _confirm_exit(pid, code)
                del self.exiting[0]
            self.broken = self.broken or difference

    def end(self) -> None:
        """Kill and reap the running worker and its service, reap the exiting ones, release
        the spares, reap orphans."""
        self.confirm()
        if self.serving is not None:
            end_child(self.serving.pid, False)
            self.serving = None
        if self.running is not None:
            end_child(self.running.pid, True)  # its pipes close as this process exits
            self.running = None
        for spare in (self.spare, self.service):
            if spare is not None:
                _retire(spare)
        self.spare = self.service = None
        _reap_orphans(wait=_KILL_GRACE)


def zygote_main(run: WorkerMain, prepare: Callable[[WorkerSpec], None]) -> None:
    """The fork server: read one request per line, fork a worker, answer with its record.

    ``prepare(spec)`` runs here before the fork (loading the spec's system once, so every
    child inherits it warm); ``run(spec)`` is the worker's body in the child.

    A request is ``{"id": N, "spec": {...}}`` and its reply echoes ``"id"``, so the
    client can never take one worker's record for another's. SIGTERM (what the client
    sends after an interruption) raises :class:`~faultlab.base.interrupt.Interrupted`, at most
    once, wherever the server is (even as its loop ends on EOF); the running worker's
    group is then killed and reaped, the spare released and the server ends quietly.
    SIGINT is ignored (the client decides).
    """
    children = _Children()
    try:
        try:
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, interrupt.handler)
            _serve(children, run, prepare)
        finally:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stopping: no second raise
    except (interrupt.Interrupted, BrokenPipeError):
        pass  # the client stopped the run or went away
    children.end()


def freeze() -> None:
    """Move every object this process holds into the collector's permanent generation.

    A collection in a forked child then never walks (and writes the headers of) the
    objects it shares with its parent, which would copy their pages. The fork server does
    it once the image is loaded, and again when a request loads a system (its own
    per-request objects are freed by reference counting, not by the collector); the
    lanes' helper once it is prepared.
    """
    gc.collect()
    gc.freeze()


def _serve(own: _Children, run: WorkerMain, prepare: Callable[[WorkerSpec], None]) -> None:
    _set_child_subreaper()
    streams = standard_streams()  # every spare's sys.stdin, stdout and stderr
    requests = sys.stdin.buffer
    replies = sys.stdout.buffer
    freeze()
    modules = len(sys.modules)
    for line in requests:
        request_id: Any = None
        try:
            request = json.loads(line)
            request_id = request["id"]
            if own.broken is not None:
                raise ExecutionError(own.broken)
            spec = WorkerSpec(**request["spec"])
            prepare(spec)
            if len(sys.modules) != modules:  # a system loaded for the first time
                freeze()
                modules = len(sys.modules)
            with interrupt.deferred():  # a forked child is always known by its pid
                own.running = own.spare if own.spare is not None else _fork_spare(run, streams)
                own.spare = None
            started = _assign(own.running, json.dumps(request["spec"]).encode())
            with interrupt.deferred():
                own.spare = _fork_spare(run, streams)  # the next worker forks while this one runs
            running = own.running
            record = _finish(own, running, spec, started,
                             partial(_serve_service, own, running, run=run, streams=streams))
            own.running = None
            _close_channel(running)
            reply: dict[str, Any] = {"id": request_id, "record": record.to_json()}
        except Exception as error:  # noqa: BLE001 - reported to the client, not swallowed
            if own.running is not None:
                end_child(own.running.pid, True)
                _close_channel(own.running)
                own.running = None
            reply = {"id": request_id, "error": f"{type(error).__name__}: {error}"}
        try:
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()
        except BrokenPipeError:
            break  # the client went away
        own.confirm()  # while the client judges the record; before the next worker runs
        _reap_orphans()
    if own.broken is not None:
        own.confirm()
        replies.write(json.dumps({"id": None, "error": own.broken}).encode() + b"\n")
        replies.flush()


class ForkServer:
    """Client side of the fork server; one per run, closed (and reaped) at the end.

    Every request carries a fresh id that the reply must echo. An exchange cut short
    (a signal between writing a request and reading its reply) leaves the channel
    unusable: no later request can read the earlier reply, and the server is stopped at
    once with SIGTERM (:meth:`close`), which kills and reaps the worker it was running.
    """

    def __init__(self, entry: str = FORK_SERVER_ENTRY,
                 environment: Mapping[str, str] | None = None) -> None:
        """Start the server; ``environment`` is added to this process's for the server
        itself (a preload its workers inherit: :func:`server_environment`)."""
        import subprocess

        #: libfaketime's area for a server under it and every worker it forks
        #: (:class:`faultlab.base.wall_clock.SharedArea`), removed at close
        started_with, self._area = preloaded_environment(environment)
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-c", bootstrap(entry), json.dumps(sys.path)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                start_new_session=True,
                env=started_with,
            )
        except BaseException:
            if self._area is not None:
                self._area.remove()
            raise
        self.pid = self._process.pid
        self._requests = 0
        self._in_flight = False  # a request was written and its reply not yet read
        #: The interruption that cut a request short, raised again by any later request.
        self._interrupted_by: KeyboardInterrupt | None = None

    def run(self, spec: WorkerSpec) -> ProcessRecord:
        process = self._process
        stdin: IO[bytes] | None = process.stdin
        stdout: IO[bytes] | None = process.stdout
        if self._in_flight:
            if self._interrupted_by is not None:
                # the run is being interrupted (a Ctrl-C where no handler of faultlab's
                # runs: pytest, a script): a teardown asking for one more worker must not
                # turn that into a run failure the caller would carry on past
                raise type(self._interrupted_by)(*self._interrupted_by.args)
            raise ExecutionError(
                f"the fork server (pid {self.pid}) is unusable: an earlier request was "
                "interrupted before its reply"
            )
        if stdin is None or stdout is None or process.poll() is not None:
            raise ExecutionError("the fork server is not running")
        self._requests += 1
        request_id = self._requests
        self._in_flight = True  # stays set if anything interrupts the exchange
        try:
            reply = self._exchange(request_id, spec, stdin, stdout)
        except KeyboardInterrupt as error:  # raised again by any later request
            self._interrupted_by = error
            raise
        self._in_flight = False
        if "error" in reply:
            raise ExecutionError(f"the fork server could not run the worker: {reply['error']}")
        return ProcessRecord.from_json(reply["record"])

    def _exchange(self, request_id: int, spec: WorkerSpec, stdin: IO[bytes],
                  stdout: IO[bytes]) -> dict[str, Any]:
        """Write one request and read its reply (checked to be that request's)."""
        try:
            stdin.write(json.dumps({"id": request_id, "spec": vars(spec)}).encode() + b"\n")
            stdin.flush()
            line = stdout.readline()
        except BrokenPipeError:
            line = b""
        except BaseException:
            # interrupted while the worker runs: stop the server now, which kills and reaps
            # that worker (and its service), before the caller removes the stores it uses;
            # a worker left running until the run's end could still write in them
            self.close()
            raise
        if not line:
            raise ExecutionError(f"the fork server (pid {self.pid}) died")
        reply = json.loads(line)
        if not isinstance(reply, dict) or reply.get("id") != request_id:
            raise ExecutionError(
                f"the fork server (pid {self.pid}) answered request "
                f"{reply.get('id') if isinstance(reply, dict) else '?'}, not {request_id}"
            )
        return reply

    def close(self) -> None:
        """End the server and reap it; after an interruption, stop its worker first.

        Raises :class:`ExecutionError` when the server's last words say the run is broken
        (a worker that ended otherwise than it said, after its record was answered)."""
        import subprocess

        last_words = b""
        with interrupt.deferred():
            process = self._process
            stopping = self._in_flight or interrupt.received() is not None
            if stopping:
                if process.poll() is None:  # not reaped, so the pid is still ours
                    process.send_signal(signal.SIGTERM)
            if process.stdin is not None:
                try:
                    process.stdin.close()
                except BrokenPipeError:
                    pass
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            if process.stdout is not None:
                if not stopping:
                    os.set_blocking(process.stdout.fileno(), False)
                    last_words = process.stdout.read() or b""
                process.stdout.close()
            if self._area is not None:  # the server and its workers are gone
                self._area.remove()
                self._area = None
        for line in last_words.splitlines():
            reply = json.loads(line)
            if isinstance(reply, dict) and "error" in reply:
                raise ExecutionError(f"the fork server (pid {self.pid}): {reply['error']}")


def preloaded_environment(
    environment: Mapping[str, str] | None,
) -> tuple[dict[str, str] | None, SharedArea | None]:
    """The whole environment to start a process that forks workers with (a fork server,
    the lanes' helper) so that its children run under ``environment``'s preload
    (:func:`server_environment`), and libfaketime's shared area made for it when that
    preload is libfaketime: the caller removes the area once the process and its children
    are gone. (None, None) when ``environment`` is empty: the process inherits this one's."""
    if not environment:
        return None, None
    area = SharedArea() if under_library(dict(environment)) else None
    extra = {SHARED_VARIABLE: area.variable} if area is not None else {}
    return {**os.environ, **environment, **extra}, area


def server_environment(
    environment: Sequence[tuple[str, str]],
) -> tuple[tuple[str, str], ...] | None:
    """What a fork server must be started with to fork a worker with ``environment``, or
    None when only exec can give it.

    The variables read as a process starts (a preload: libfaketime's library and
    settings) are the server's, inherited by every child; those read where they are used
    (the clock files, the power-loss recording's log directory) each child sets itself
    (:func:`_read_spec`), and what libfaketime needs until it does is the server's too
    (:func:`faultlab.base.wall_clock.server_variables`). Any other variable is given by
    exec.
    """
    fixed = []
    for name, value in environment:
        if name in _SERVER_VARIABLES:
            fixed.append((name, value))
        elif name == SHARED_VARIABLE:
            continue  # a forked child uses its server's libfaketime area (ForkServer)
        elif name not in _CHILD_VARIABLES:
            return None
    fixed.extend(server_variables(dict(fixed)).items())
    return tuple(sorted(fixed))


class _Closable(Protocol):
    def close(self) -> None: ...


_C = TypeVar("_C", bound=_Closable)


class Spawner:
    """Runs workers in the chosen mode; the only way faultlab starts a worker.

    It is the :class:`faultlab.system.contract.StepRunner` systems run their steps
    through: :meth:`run` for faultlab's own worker processes, :meth:`run_program` for a
    command-line system's programs. ``processes`` counts both.

    In fork mode there is one fork server per distinct start-up environment: the plain
    one, and one started under libfaketime for a system on the virtual wall clock
    (:func:`server_environment`), each started with the first worker that needs it.

    It also keeps what another starter of processes shares for the whole run
    (:meth:`shared`: the lanes' worker starter) and closes it with the servers, so
    whoever makes a spawner closes it.
    """

    def __init__(self, mode: SpawnMode = "fork") -> None:
        if mode not in SPAWN_MODES:
            raise ValueError(f"unknown spawn mode {mode!r}")
        self.mode: SpawnMode = mode
        self._servers: dict[tuple[tuple[str, str], ...], ForkServer] = {}
        self._shared: dict[str, tuple[str, _Closable]] = {}
        self.processes = 0

    def shared(self, name: str, key: str, make: Callable[[], _C]) -> _C:
        """The run's one ``name`` for ``key``, made by ``make`` when first asked for and
        closed when this spawner closes, or when ``name`` is asked for with another key
        (then made again): a starter of processes kept from trace to trace rather than made
        and ended for each, as long as what it was made for stays the same."""
        kept = self._shared.get(name)
        if kept is not None and kept[0] != key:
            del self._shared[name]
            kept[1].close()
            kept = None
        if kept is None:
            kept = self._shared[name] = (key, make())
        return cast(_C, kept[1])

    def run_program(
        self, argv: Sequence[str], *, deadline: float, env: Mapping[str, str] | None = None,
        cwd: str | None = None, pass_fds: Sequence[int] = (),
        started: Callable[[int], None] | None = None,
    ) -> ProcessRecord:
        """Run a program that is not faultlab as one worker (see :func:`run_command`)."""
        self.processes += 1
        return run_command(argv, deadline=deadline, env=env, cwd=cwd, pass_fds=pass_fds,
                           started=started)

    def run(self, spec: WorkerSpec) -> ProcessRecord:
        if spec.spawn != self.mode:
            spec = replace(spec, spawn=self.mode)
        self.processes += 1
        fixed = server_environment(spec.environment) if self.mode == "fork" else None
        if fixed is None:
            return exec_worker(spec, new_group=True)
        server = self._servers.get(fixed)
        if server is None:
            # deferred: a signal as the server starts is raised once it is known here, so
            # close() ends and reaps it (seen: it was left a zombie of the caller)
            with interrupt.deferred():
                server = self._servers[fixed] = ForkServer(environment=dict(fixed))
        return server.run(spec)

    @property
    def server_pid(self) -> int | None:
        """The first fork server's pid while it runs (it starts with the first forked
        worker)."""
        return next((server.pid for server in self._servers.values()), None)

    @property
    def server_pids(self) -> list[int]:
        """Every running fork server's pid (one per start-up environment)."""
        return [server.pid for server in self._servers.values()]

    def close(self) -> None:
        """Close what it keeps and every fork server; the first server's failure is
        raised once all are closed (a worker that ended otherwise than it said)."""
        failure: ExecutionError | None = None
        try:
            while self._shared:
                _, (_, kept) = self._shared.popitem()
                kept.close()
        finally:
            while self._servers:
                _, server = self._servers.popitem()
                try:
                    server.close()
                except ExecutionError as error:
                    failure = failure or error
        if failure is not None:
            raise failure


@contextmanager
def spawner(mode: SpawnMode = "fork") -> Iterator[Spawner]:
    runner = Spawner(mode)
    try:
        yield runner
    finally:
        runner.close()


def stop_resource_tracker() -> None:
    """End multiprocessing's resource tracker (a child a spawn-context pool or queue
    started) and reap it, so faultlab leaves no process behind, interrupted or not."""
    from multiprocessing import resource_tracker

    stop = getattr(getattr(resource_tracker, "_resource_tracker", None), "_stop", None)
    if callable(stop):
        try:
            stop()
        except Exception:  # noqa: BLE001 - a tracker that is already gone
            pass
