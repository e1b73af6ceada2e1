"""Run one worker as a real OS process and observe how it ended.

Two spawn modes give the same process boundary:

* ``fork`` (default): a fork server started once per run has already imported
  what a worker uses (:func:`preload`); it forks one child per worker, the next
  one while the current one runs (a few milliseconds a worker: bench/spawn.py).
* ``exec``: a fresh interpreter per worker, ``python -m faultlab worker ...``.

Each worker runs in its own process group, so a missed deadline kills exactly
that worker and the service child it started, and nothing else. Every child is
reaped before :func:`Spawner.run` returns.
"""

from __future__ import annotations

import json
import os
import select
import selectors
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from typing import IO, Any, NoReturn

from faultlab.errors import ExecutionError
from faultlab.records import (
    DEFAULT_DEADLINE,
    SPAWN_MODES,
    ProcessRecord,
    SpawnMode,
    WorkerSpec,
    parse_response,
)

#: The fork server's entry point, named as exec mode names ``python -m faultlab worker``: the
#: process layer starts it by name and never imports the worker or the systems it runs.
FORK_SERVER_ENTRY = "faultlab.worker:serve_forks"
_MAX_OUTPUT = 1 << 20
#: After a deadline kill, how long to wait for the pipes to close. A process that left the
#: worker's group can hold them open forever; faultlab must not wait for it.
_KILL_GRACE = 2.0
#: How a worker runs inside a process: the role's code, returning the exit status.
WorkerMain = Callable[[WorkerSpec], int]


def _collect(pid: int, fds: dict[int, str], deadline: float, group: bool) -> tuple[
    dict[str, bytes], int, bool
]:
    """Read the child's pipes to EOF and reap it; kill it (or its group) at the deadline."""
    chunks: dict[str, list[bytes]] = {name: [] for name in fds.values()}
    sizes = dict.fromkeys(fds.values(), 0)
    selector = selectors.DefaultSelector()
    for fd in fds:
        os.set_blocking(fd, False)
        selector.register(fd, selectors.EVENT_READ)
    end = time.monotonic() + deadline
    timed_out = False
    try:
        while selector.get_map():
            remaining = end - time.monotonic()
            if remaining <= 0 and not timed_out:
                timed_out = True
                _kill(pid, group)
            if timed_out and remaining <= -_KILL_GRACE:
                break  # something outside the killed group still holds the pipes
            for key, _ in selector.select(timeout=max(remaining, 0.05) if not timed_out else 1):
                fd = int(key.fd)
                data = os.read(fd, 65536)
                if not data:
                    selector.unregister(fd)
                    continue
                name = fds[fd]
                if sizes[name] < _MAX_OUTPUT:
                    chunks[name].append(data)
                    sizes[name] += len(data)
    finally:
        selector.close()
        for fd in fds:
            os.close(fd)
    status, timed_out = _reap(pid, end, timed_out, group)
    return {name: b"".join(parts) for name, parts in chunks.items()}, status, timed_out


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


def _child_main(
    out_w: int, err_w: int, *, new_group: bool, read_spec: Callable[[], WorkerSpec | None],
    run: WorkerMain, keep: int = -1,
) -> NoReturn:
    """The body of a forked worker: its own group, stdout/stderr to the pipes, run, exit."""
    code = 70
    try:
        if new_group:
            os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if keep >= 3:
            os.closerange(3, keep)
            os.closerange(keep + 1, 1024)
        else:
            os.closerange(3, 1024)
        # Python-level streams on the new descriptors, made before a spare waits for
        # its spec: building them costs a quarter of a millisecond in a fresh child.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        spec = read_spec()
        if spec is None:  # a spare that was never assigned: the fork server is closing
            code = 0
        else:
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
        os._exit(code)


def fork_worker(spec: WorkerSpec, run: WorkerMain, *, new_group: bool) -> ProcessRecord:
    """Fork this (already warmed-up) process and run ``run(spec)`` in the child."""
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:  # child: never returns
        os.close(out_r)
        os.close(err_r)
        _child_main(out_w, err_w, new_group=new_group, read_spec=lambda: spec, run=run)
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


def _rehearse() -> None:
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
    _rehearse()
    chunks = []
    while data := os.read(fd, 65536):
        chunks.append(data)
    os.close(fd)
    return WorkerSpec(**json.loads(b"".join(chunks))) if chunks else None


def _fork_spare(run: WorkerMain) -> _Spare:
    """Fork the next worker ahead of time, so fork and copy-on-write happen off the clock.

    The spare is a fresh process like any other worker: it starts in its own process
    group, blocks until the fork server writes its spec, runs it once and exits.
    """
    control_r, control_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns
        for fd in (control_w, out_r, err_r):
            os.close(fd)
        _child_main(out_w, err_w, new_group=True, read_spec=lambda: _read_spec(control_r),
                    run=run, keep=control_r)
    for fd in (control_r, out_w, err_w):
        os.close(fd)
    return _Spare(pid, control_w, out_r, err_r)


def _assign(worker: _Spare, line: bytes) -> float:
    """Hand the spare its spec (EOF after it); the worker's clock starts now."""
    started = time.monotonic()
    try:
        os.write(worker.control, line)
    finally:
        os.close(worker.control)
    return started


def _finish(worker: _Spare, spec: WorkerSpec, started: float) -> ProcessRecord:
    outputs, status, timed_out = _collect(
        worker.pid, {worker.stdout: "stdout", worker.stderr: "stderr"}, spec.deadline, True
    )
    return _record(worker.pid, outputs, status, started, timed_out)


def _retire(spare: _Spare) -> None:
    """Release a spare that will not be used: EOF on its control pipe makes it exit."""
    for fd in (spare.control, spare.stdout, spare.stderr):
        os.close(fd)
    os.waitpid(spare.pid, 0)


def child_environment() -> dict[str, str]:
    """Environment for exec-mode children: they must import what this process imports."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    return env


def exec_worker(spec: WorkerSpec, *, new_group: bool) -> ProcessRecord:
    """Run the worker in a fresh interpreter: ``python -m faultlab worker ...``."""
    return run_command(spec.argv(), deadline=spec.deadline, env=child_environment(),
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
    began = time.monotonic()
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
        raise ExecutionError(f"cannot run {argv[0]}: {error.strerror or error}") from None
    if child.stdout is None or child.stderr is None:
        raise ExecutionError("worker pipes were not created")
    fds = {os.dup(child.stdout.fileno()): "stdout", os.dup(child.stderr.fileno()): "stderr"}
    child.stdout.close()
    child.stderr.close()
    try:
        if started is not None:
            started(child.pid)
    except BaseException:
        _kill(child.pid, new_group)
        _collect(child.pid, fds, deadline, new_group)
        child.returncode = -signal.SIGKILL
        raise
    outputs, status, timed_out = _collect(child.pid, fds, deadline, new_group)
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped by _collect
    return _record(child.pid, outputs, status, began, timed_out)


# --- the fork server ---------------------------------------------------------------------

def _bootstrap(entry: str) -> str:
    """The fork server's ``python -c`` program: restore sys.path, call ``module:function``."""
    module, _, function = entry.partition(":")
    return (
        "import sys, json; sys.path[:] = json.loads(sys.argv[1]); "
        f"from {module} import {function} as main; main()"
    )


def _set_child_subreaper() -> None:
    """Become the reaper of orphaned grandchildren (Linux), so none stays a zombie."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass


def _reap_orphans() -> None:
    """Reap orphaned grandchildren that were reparented to the fork server.

    The waiting spare is alive and blocked, so ``WNOHANG`` never takes it.
    """
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def zygote_main(run: WorkerMain, prepare: Callable[[WorkerSpec], None]) -> None:
    """The fork server: read one spec per line, fork a worker, answer with its record.

    ``prepare(spec)`` runs here before the fork (loading the spec's system once, so every
    child inherits it warm); ``run(spec)`` is the worker's body in the child.
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _set_child_subreaper()
    requests = sys.stdin.buffer
    replies = sys.stdout.buffer
    spare: _Spare | None = None
    try:
        for line in requests:
            try:
                spec = WorkerSpec(**json.loads(line))
                prepare(spec)
                worker = spare if spare is not None else _fork_spare(run)
                spare = None
                started = _assign(worker, line)
                spare = _fork_spare(run)  # the next worker forks while this one runs
                record = _finish(worker, spec, started)
                reply: dict[str, Any] = {"record": record.to_json()}
            except Exception as error:  # noqa: BLE001 - reported to the client, not swallowed
                reply = {"error": f"{type(error).__name__}: {error}"}
            _reap_orphans()
            replies.write(json.dumps(reply).encode() + b"\n")
            replies.flush()
    finally:
        if spare is not None:
            _retire(spare)


class ForkServer:
    """Client side of the fork server; one per run, closed (and reaped) at the end."""

    def __init__(self, entry: str = FORK_SERVER_ENTRY) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-c", _bootstrap(entry), json.dumps(sys.path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,
        )
        self.pid = self._process.pid

    def run(self, spec: WorkerSpec) -> ProcessRecord:
        process = self._process
        stdin: IO[bytes] | None = process.stdin
        stdout: IO[bytes] | None = process.stdout
        if stdin is None or stdout is None or process.poll() is not None:
            raise ExecutionError("the fork server is not running")
        try:
            stdin.write(json.dumps(vars(spec)).encode() + b"\n")
            stdin.flush()
            line = stdout.readline()
        except BrokenPipeError:
            line = b""
        if not line:
            raise ExecutionError(f"the fork server (pid {self.pid}) died")
        reply = json.loads(line)
        if "error" in reply:
            raise ExecutionError(f"the fork server could not run the worker: {reply['error']}")
        return ProcessRecord.from_json(reply["record"])

    def close(self) -> None:
        process = self._process
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
            process.stdout.close()


class Spawner:
    """Runs workers in the chosen mode; the only way faultlab starts a worker.

    It is the :class:`faultlab.system.contract.StepRunner` systems run their steps
    through: :meth:`run` for faultlab's own worker processes, :meth:`run_program` for a
    command-line system's programs. ``processes`` counts both.
    """

    def __init__(self, mode: SpawnMode = "fork") -> None:
        if mode not in SPAWN_MODES:
            raise ValueError(f"unknown spawn mode {mode!r}")
        self.mode: SpawnMode = mode
        self._server: ForkServer | None = None
        self.processes = 0

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
        if self.mode == "exec":
            return exec_worker(spec, new_group=True)
        if self._server is None:
            self._server = ForkServer()
        return self._server.run(spec)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None


@contextmanager
def spawner(mode: SpawnMode = "fork") -> Iterator[Spawner]:
    runner = Spawner(mode)
    try:
        yield runner
    finally:
        runner.close()
