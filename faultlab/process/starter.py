"""Workers that run alongside one another, forked by a quiet helper process.

A concurrent trace keeps several workers alive at once, each held at its points, so
they cannot be run to completion one request at a time as the fork server runs them.
Forked by the explorer itself, every fork marked the explorer's whole heap
copy-on-write, and the explorer (Hypothesis, the model, the recorder) then took a page
fault for about every page it wrote while a worker lived: as many faults as the worker
itself, about 3 ms of system CPU per concurrent step. A :class:`Starter` forks one
helper from this process, once, that does nothing but fork workers on request, report
their pids and reap them; this process forks no more.

The helper is this process's child; each worker is the helper's child, leads its own
process group (so the caller signals it, its group, pauses and kills it as it would a
child of its own) and is reaped by the helper, which reports its wait status. Orphans
of a killed worker (a dispatcher's service) go to the nearest child subreaper above,
as before. The helper ends when its socket closes: it kills the groups of workers still
alive (only ever its own children), reaps them and exits; it ignores SIGINT and SIGTERM
(the caller decides when a run stops), and a caller that dies closes the socket too.

Protocol, over an ``AF_UNIX`` ``SOCK_SEQPACKET`` pair (one message per datagram):

* request: JSON ``{"spec": {...}, "environment": {...}}`` with four descriptors
  attached, the child's ends of its pipes (schedule decisions in, announcements out,
  stdout, stderr); the helper closes its copies once the child has them;
* reply: ``started PID`` once the child leads its own group, or ``error TEXT``;
* notice: ``exited PID STATUS`` whenever a child ends (its raw wait status).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import time
from collections.abc import Callable, Mapping
from typing import NoReturn

from faultlab.base import interrupt
from faultlab.base.errors import ExecutionError
from faultlab.process.records import WorkerSpec
from faultlab.process.spawn import child_main, lead_own_group

#: The body of a started worker: the spec, the environment variables it must set, and its
#: two control descriptors as numbered in the child (decisions in, announcements out).
StartedMain = Callable[[WorkerSpec, dict[str, str], tuple[int, int]], int]
_MESSAGE = 1 << 20  # bytes: a request is a spec and an environment, far below this


def available() -> bool:
    """Whether the helper can watch its children (``pidfd_open``: Linux 5.3, Python 3.9)."""
    return hasattr(os, "pidfd_open")


class Starter:
    """Client side of the helper: start workers, learn when they end. One per executor."""

    def __init__(self, run: StartedMain) -> None:
        """Fork the helper now; ``run`` is the worker's body in each child (it is already
        in the helper's memory: nothing is pickled or imported)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with interrupt.deferred():  # the helper is known by its pid, or not started
            pid = os.fork()
            if pid == 0:  # the helper: never returns
                ours.close()
                _helper(theirs, run)
            self.pid = pid
        theirs.close()
        self._socket = ours
        #: Wait statuses reported and not yet taken, by pid.
        self._ended: dict[int, int] = {}

    def fileno(self) -> int:
        """Readable when a notice arrives: put it in a selector beside the workers' pipes
        and call :meth:`collect` when it is."""
        return self._socket.fileno()

    def start(self, spec: WorkerSpec, environment: Mapping[str, str],
              descriptors: tuple[int, int, int, int]) -> int:
        """Fork a worker running ``spec`` with the child's ends of its four pipes
        (decisions in, announcements out, stdout, stderr); its pid once it leads its own
        process group. The descriptors stay open here (the caller closes its copies)."""
        request = json.dumps({"spec": vars(spec), "environment": dict(environment)}).encode()
        try:
            socket.send_fds(self._socket, [request], list(descriptors))
            while True:
                reply = self._receive(None)
                if reply.startswith(b"started "):
                    return int(reply.split()[1])
                if reply.startswith(b"error "):
                    raise ExecutionError(f"could not start a worker: {reply[6:].decode()}")
        except OSError as error:
            raise ExecutionError(f"the worker starter (pid {self.pid}) is gone: {error}"
                                 ) from None

    def collect(self) -> None:
        """Take every notice that has arrived (never blocks)."""
        while select.select([self._socket], [], [], 0)[0]:
            self._receive(0)

    def ended(self, pid: int, timeout: float) -> int | None:
        """The wait status of worker ``pid`` once the helper reaped it, waiting at most
        ``timeout`` seconds for the notice; None if it has not ended by then."""
        end = time.monotonic() + timeout
        while pid not in self._ended:
            remaining = end - time.monotonic()
            if remaining <= 0 or not select.select([self._socket], [], [], remaining)[0]:
                return None
            self._receive(0)
        return self._ended.pop(pid)

    def _receive(self, timeout: float | None) -> bytes:
        """One message; a notice is recorded as it is read (and returned too)."""
        if timeout is not None and not select.select([self._socket], [], [], timeout)[0]:
            return b""
        # deferred: a notice read is a notice recorded. A SIGTERM raised between the two
        # lost a worker's end for good, and the executor's cleanup then waited out the
        # deadline, twice, for a notice the helper had already sent
        with interrupt.deferred():
            message = self._socket.recv(_MESSAGE)
            if message.startswith(b"exited "):
                _, pid, status = message.split()
                self._ended[int(pid)] = int(status)
        if not message:
            raise OSError("its socket closed")
        return message

    def close(self) -> None:
        """End the helper (it kills and reaps any worker still alive) and reap it."""
        with interrupt.deferred():
            self._socket.close()
            os.waitpid(self.pid, 0)


def _helper(channel: socket.socket, run: StartedMain) -> NoReturn:
    """The helper's whole life: fork on request, report, reap; end when the channel does."""
    code = 0
    children: dict[int, int] = {}  # pidfd -> pid
    try:
        # Nothing of the caller's but the channel and the standard streams: a pipe end
        # kept here would hide a worker's end from the caller (it waits for EOF). The
        # objects that owned them are never collected here, so no stale number is closed.
        gc.disable()
        os.closerange(3, channel.fileno())
        os.closerange(channel.fileno() + 1, _max_descriptor())
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        poller = select.poll()
        poller.register(channel.fileno(), select.POLLIN)
        while True:
            for fd, _ in poller.poll():
                if fd != channel.fileno():
                    pid = children.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    channel.send(f"exited {pid} {status}".encode())
                    continue
                message, descriptors, _, _ = socket.recv_fds(channel, _MESSAGE, 4)
                if not message:
                    raise EOFError
                reply, pidfd = _fork(channel, message, descriptors, children, run)
                if pidfd is not None:
                    poller.register(pidfd, select.POLLIN)
                channel.send(reply)
    except (EOFError, OSError):
        pass  # the caller closed the channel or went away
    except BaseException:  # noqa: BLE001 - the helper must still end its children
        code = 70
    for pidfd, pid in children.items():
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
        os.waitpid(pid, 0)
        os.close(pidfd)
    os._exit(code)


def _max_descriptor() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


def _fork(channel: socket.socket, message: bytes, descriptors: list[int],
          children: dict[int, int], run: StartedMain) -> tuple[bytes, int | None]:
    """Fork one worker for a request; the reply to send, and the pidfd that says when the
    worker ends (None when none was forked)."""
    try:
        if len(descriptors) != 4:
            return b"error the request did not carry four descriptors", None
        request = json.loads(message)
        spec = WorkerSpec(**request["spec"])
        environment = dict(request["environment"])
        decide, announce, out, err = descriptors
        pid = os.fork()
        if pid == 0:  # the worker: never returns
            channel.close()
            for pidfd in children:
                os.close(pidfd)
            child_main(out, err, new_group=True, read_spec=lambda: spec,
                       run=lambda spec: run(spec, environment, (decide, announce)),
                       keep=(decide, announce))
        lead_own_group(pid)  # a kill right after the reply must reach it
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:  # never leave a worker nobody knows of
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        children[pidfd] = pid
        return f"started {pid}".encode(), pidfd
    except Exception as error:  # noqa: BLE001 - reported to the caller
        return f"error {type(error).__name__}: {error}".encode(), None
    finally:
        for fd in descriptors:
            os.close(fd)
