"""Workers that run alongside one another, forked by a quiet helper process.

A concurrent trace keeps several workers alive at once, each held at its points, so
they cannot be run to completion one request at a time as the fork server runs them.
Forked by the explorer itself, every fork marked the explorer's whole heap
copy-on-write, and the explorer (Hypothesis, the model, the recorder) then took a page
fault for about every page it wrote while a worker lived: as many faults as the worker
itself, about 3 ms of system CPU per concurrent step. A :class:`Starter` starts one
helper that does nothing but fork workers, report their pids and reap them; this
process forks no more. One helper serves a whole run of one system (the run's spawner
keeps its launcher).

The helper is a fresh interpreter, as the fork server is, not a fork of this process:
it imports only what a worker needs (its caller names a preparation that loads it, the
system included) and forks every worker from that image. Forked from the explorer, it
carried the explorer's image (about 26 MiB of private memory against 10), so every
worker's fork copied, and its exit tore down, two and a half times the pages; and a caller with
threads (a pytest-xdist worker) forked it from a threaded process. Its start costs a
quarter of a second once a run.

The helper forks each worker ahead of its use: a *spare*, leading its own group,
rehearsed as the fork server's spares are and waiting for its request, whose socket the
helper hands to the caller. A start is one message from the caller straight to the
spare (its spec, its environment and the child's ends of its four pipes) and needs no
answer: the pid is known already. Asked through the helper instead, a start waited
about 1.7 ms for the helper's reply, most of it page faults: each page the helper
touched after forking was copied, since a worker still shared it.

The helper is this process's child, in a session of its own (a terminal's Ctrl-C is the
caller's to handle); each worker is the helper's child, leads its own process group (so
the caller signals it, its group, pauses and kills it as it would a child of its own)
and is reaped by the helper, which reports its wait status. Orphans of a killed worker
(a dispatcher's service) go to the helper, a child subreaper. The helper ends when its
socket closes: it kills the groups of workers still alive, the spare's too (only ever
its own children), reaps them and exits; it ignores SIGINT and SIGTERM (the caller
decides when a run stops), and a caller that dies closes the socket too.

Protocol, over ``AF_UNIX`` ``SOCK_SEQPACKET`` pairs (one message per datagram):

* helper to caller: ``spare PID`` with one descriptor attached, the caller's end of
  the spare's own socket, once the spare leads its own group;
* caller to spare: JSON ``{"spec": {...}, "environment": {...}}`` led by its length
  (8 bytes, big-endian) and cut into datagrams of at most 64 KiB (a generated payload
  may be larger than one datagram can be), four descriptors attached to the first:
  the child's ends of its pipes (schedule decisions in, announcements out, stdout,
  stderr); the spare runs it as a worker;
* caller to helper: ``took`` once a spare was given its request: fork the next one;
* helper to caller: ``exited PID STATUS`` whenever a worker or spare ends (its raw wait
  status).
"""

from __future__ import annotations

import gc
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from importlib import import_module
from typing import Any, NoReturn

from faultlab.base import interrupt
from faultlab.base.errors import ExecutionError
from faultlab.process.records import WorkerSpec
from faultlab.process.spawn import (
    StandardStreams,
    become_subreaper,
    bootstrap,
    child_main,
    freeze,
    lead_own_group,
    preloaded_environment,
    rehearse,
    standard_streams,
)

#: The body of a started worker: the spec, the environment variables it must set, and its
#: two control descriptors as numbered in the child (decisions in, announcements out).
StartedMain = Callable[[WorkerSpec, dict[str, str], tuple[int, int]], int]
#: What the helper's interpreter runs (:func:`serve`).
HELPER_ENTRY = "faultlab.process.starter:serve"
#: A request (a spec and an environment) goes in datagrams of at most this many bytes: one
#: datagram may not exceed the sender's socket buffer (``wmem_default``, 208 KiB on many
#: machines), and a generated payload can be larger than that.
_CHUNK = 64 << 10
#: The length that leads a request, so the spare knows when it has all of it.
_LENGTH = 8
_NOTICE = 256  # bytes: "spare PID", "exited PID STATUS", "took"
#: While orphans it has taken in are still alive, the helper looks again this often (ms).
ORPHAN_POLL_MS = 5


def available() -> bool:
    """Whether the helper can watch its children (``pidfd_open``: Linux 5.3, Python 3.9)."""
    return hasattr(os, "pidfd_open")


class Starter:
    """Client side of the helper: start workers, learn when they end. One per run (or per
    trace, for an executor given no spawner of a run)."""

    def __init__(self, run: StartedMain, prepare: Callable[..., object] | None = None,
                 arguments: Sequence[str] = (),
                 environment: Mapping[str, str] | None = None) -> None:
        """Start the helper: a fresh interpreter with this process's ``sys.path`` that
        imports ``run`` (the worker's body in each child) and ``prepare``, both
        module-level functions named by their module and name, calls ``prepare(*arguments)``
        (loading what the workers use, so that none imports anything from disk) and forks
        the first spare. ``environment`` is added to this process's for the helper itself:
        a preload every worker it forks inherits (libfaketime's, as for a fork server:
        :func:`faultlab.process.spawn.server_environment`)."""
        import subprocess  # here: the helper's own image holds no threading module

        names = [_name(run), _name(prepare) if prepare is not None else ""]
        #: libfaketime's area for a helper under it and every worker it forks, removed at
        #: close
        started_with, self._area = preloaded_environment(environment)
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with interrupt.deferred():  # the helper is known by its pid, or not started
                self._process = subprocess.Popen(
                    [sys.executable, "-c", bootstrap(HELPER_ENTRY), json.dumps(sys.path),
                     str(theirs.fileno()), *names, *arguments],
                    stdin=subprocess.DEVNULL, pass_fds=(theirs.fileno(),),
                    start_new_session=True, env=started_with)
        except BaseException:
            ours.close()
            if self._area is not None:
                self._area.remove()
            raise
        finally:
            theirs.close()
        self.pid = self._process.pid
        self._socket = ours
        #: Wait statuses reported and not yet taken, by pid.
        self._ended: dict[int, int] = {}
        #: The spare the helper handed over and no start has taken: its pid and socket.
        self._spare: tuple[int, socket.socket] | None = None

    def fileno(self) -> int:
        """Readable when a notice arrives: put it in a selector beside the workers' pipes
        and call :meth:`collect` when it is."""
        return self._socket.fileno()

    def start(self, spec: WorkerSpec, environment: Mapping[str, str],
              descriptors: tuple[int, int, int, int]) -> int:
        """Start a worker running ``spec`` with the child's ends of its four pipes
        (decisions in, announcements out, stdout, stderr): the waiting spare takes them;
        its pid (it leads its own process group already). The descriptors stay open here
        (the caller closes its copies)."""
        request = json.dumps({"spec": vars(spec), "environment": dict(environment)}).encode()
        framed = len(request).to_bytes(_LENGTH, "big") + request
        try:
            while self._spare is None:
                self._receive(None)
            pid, spare = self._spare
            self._spare = None
            try:
                socket.send_fds(spare, [framed[:_CHUNK]], list(descriptors))
                for at in range(_CHUNK, len(framed), _CHUNK):  # the spare reads as we send
                    spare.sendall(framed[at:at + _CHUNK])
            finally:
                spare.close()
            self._socket.send(b"took")  # the helper forks the next spare meanwhile
        except OSError as error:
            raise ExecutionError(f"the worker starter (pid {self.pid}) is gone: {error}"
                                 ) from None
        return pid

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

    def _receive(self, timeout: float | None) -> None:
        """One message, recorded as it is read: a spare handed over, or a worker's end."""
        if timeout is not None and not select.select([self._socket], [], [], timeout)[0]:
            return
        # deferred: a message read is a message recorded. A SIGTERM raised between the
        # two lost a worker's end for good (the executor's cleanup then waited out the
        # deadline, twice, for a notice the helper had already sent), or a spare's socket
        with interrupt.deferred():
            message, descriptors, _, _ = socket.recv_fds(self._socket, _NOTICE, 1)
            if message.startswith(b"spare ") and len(descriptors) == 1:
                if self._spare is not None:  # never two: the helper forks on "took"
                    self._spare[1].close()
                self._spare = (int(message.split()[1]), socket.socket(fileno=descriptors[0]))
            else:
                for fd in descriptors:
                    os.close(fd)
                if message.startswith(b"exited "):
                    _, pid, status = message.split()
                    self._ended[int(pid)] = int(status)
        if not message:
            raise OSError("its socket closed")

    def close(self) -> None:
        """End the helper (it kills and reaps any worker still alive, and the spare) and
        reap it."""
        with interrupt.deferred():
            if self._spare is not None:
                self._spare[1].close()
                self._spare = None
            self._socket.close()
            self._process.wait()
            if self._area is not None:  # the helper and its workers are gone
                self._area.remove()
                self._area = None


class _Spare:
    """A worker forked ahead of its start, waiting for its request on its own socket."""

    def __init__(self, channel: socket.socket, children: dict[int, int],
                 run: StartedMain, streams: StandardStreams) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        pid = os.fork()
        if pid == 0:  # the spare: never returns
            channel.close()
            ours.close()
            for pidfd in children:
                os.close(pidfd)
            _spare_main(theirs, run, streams)
        theirs.close()
        lead_own_group(pid)  # a kill as soon as the caller knows it must reach it
        try:
            self.pidfd = os.pidfd_open(pid)
        except OSError:  # never leave a worker nobody knows of
            ours.close()
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise
        self.pid = pid
        self.socket = ours

    def hand_over(self, channel: socket.socket) -> None:
        """Give the caller the spare's socket (the helper keeps no end of it)."""
        try:
            socket.send_fds(channel, [f"spare {self.pid}".encode()], [self.socket.fileno()])
        finally:
            self.socket.close()


def _batch(on: bool) -> None:
    """The helper runs as a batch process (``SCHED_BATCH``): woken by a start's "took", it
    forks the next spare without preempting the caller that woke it (the caller lost
    about 1.3 ms a start to that fork); its workers run as any process does."""
    policy = getattr(os, "SCHED_BATCH", None) if on else getattr(os, "SCHED_OTHER", None)
    if policy is None:
        return
    try:
        os.sched_setscheduler(0, policy, os.sched_param(0))
    except OSError:
        pass


def _spare_main(assignment: socket.socket, run: StartedMain,
                streams: StandardStreams) -> NoReturn:
    """A spare's life: lead its own group, rehearse (as a fork server's spare does, off
    the clock), wait for its request, run it as a worker with the text streams the helper
    built once. A request it cannot read ends it with status 70 and says why on its
    stderr."""
    os.setpgid(0, 0)
    _batch(False)
    try:
        rehearse()
        message, descriptors, _, _ = socket.recv_fds(assignment, _CHUNK, 4)
        if not message:  # the caller closed its end unused (the trace ended)
            os._exit(0)
        size = int.from_bytes(message[:_LENGTH], "big")
        body = bytearray(message[_LENGTH:])
        while len(body) < size:
            part = assignment.recv(_CHUNK)
            if not part:
                break  # the caller went away: the request below is short and refused
            body += part
        message = bytes(body)
    except BaseException:  # noqa: BLE001 - a spare never returns into the helper's loop
        os._exit(70)
    assignment.close()
    try:
        if len(descriptors) != 4:
            raise ValueError(f"the request carried {len(descriptors)} descriptors, not 4")
        request = json.loads(message)
        spec = WorkerSpec(**request["spec"])
        environment = dict(request["environment"])
    except Exception as error:  # noqa: BLE001 - said where the caller reads it
        if len(descriptors) == 4:
            os.write(descriptors[3], f"faultlab: bad worker request: {error}\n".encode())
        os._exit(70)
    decide, announce, out, err = descriptors
    child_main(out, err, new_group=True, read_spec=lambda: spec,
               run=lambda spec: run(spec, environment, (decide, announce)),
               keep=(decide, announce), streams=streams)


def _helper(channel: socket.socket, run: StartedMain) -> NoReturn:
    """The helper's whole life: keep one spare forked and handed over, report and reap
    every worker; end when the channel does."""
    code = 0
    children: dict[int, int] = {}  # pidfd -> pid, the spare's included
    try:
        # Nothing but the channel and the standard streams (an interpreter of its own
        # inherits nothing else; this makes sure): a pipe end kept here would hide a
        # worker's end from the caller, which waits for EOF.
        gc.disable()
        os.closerange(3, channel.fileno())
        os.closerange(channel.fileno() + 1, _max_descriptor())
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, signal.SIG_IGN)
        _batch(True)
        # a killed worker's orphans (a dispatcher's service child) come here, not to
        # whoever started faultlab (init, in a container, may reap them late or never)
        become_subreaper()
        orphans = False  # some are still alive: look again soon
        poller = select.poll()
        poller.register(channel.fileno(), select.POLLIN)
        streams = standard_streams()  # every spare's, built once

        def fork_spare() -> None:
            spare = _Spare(channel, children, run, streams)
            children[spare.pidfd] = spare.pid  # reported when it ends, as every worker
            poller.register(spare.pidfd, select.POLLIN)
            spare.hand_over(channel)

        fork_spare()
        while True:
            for fd, _ in poller.poll(ORPHAN_POLL_MS if orphans else None):
                if fd != channel.fileno():
                    pid = children.pop(fd)
                    poller.unregister(fd)
                    os.close(fd)
                    _, status = os.waitpid(pid, 0)
                    channel.send(f"exited {pid} {status}".encode())
                    continue
                message = channel.recv(_NOTICE)
                if not message:
                    raise EOFError
                if message == b"took":
                    fork_spare()
            orphans = _reap_orphans(set(children.values()))
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
    # their orphans died with their groups and came here: reaped, not passed on as
    # zombies to whoever is above (bounded: a group member killed is gone in moments)
    end = time.monotonic() + 1.0
    while _reap_orphans(set()) and time.monotonic() < end:
        time.sleep(0.005)
    os._exit(code)


def _reap_orphans(tracked: set[int]) -> bool:
    """Reap the helper's children it did not fork (orphans of killed workers, reparented
    to it as a child subreaper); whether any of them is still alive."""
    me = os.getpid()
    try:
        with open(f"/proc/{me}/task/{me}/children", "rb") as stream:
            found = [int(pid) for pid in stream.read().split()]
    except OSError:
        return False
    alive = False
    for pid in found:
        if pid in tracked:
            continue
        try:
            waited, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            continue
        alive = alive or not waited
    return alive


def _max_descriptor() -> int:
    try:
        return max(int(name) for name in os.listdir("/proc/self/fd")) + 1
    except (OSError, ValueError):
        return os.sysconf("SC_OPEN_MAX")


def serve() -> NoReturn:
    """The helper's interpreter (:data:`HELPER_ENTRY`): import the body and the preparation
    named on its command line, prepare, freeze what every worker will share (as the fork
    server does) and serve the channel it was given."""
    fd, run_name, prepare_name, *arguments = sys.argv[2:]
    run: StartedMain = _named(run_name)
    if prepare_name:
        _named(prepare_name)(*arguments)
    freeze()
    _helper(socket.socket(fileno=int(fd)), run)


def _name(function: Callable[..., Any]) -> str:
    """``module:name`` of a module-level function, which the helper imports by it."""
    name = function.__qualname__
    if "." in name or "<" in name or function.__module__ == "__main__":
        raise ValueError(f"the lanes' helper imports {name!r} by name: give a function "
                         "defined at the top level of an importable module")
    return f"{function.__module__}:{name}"


def _named(name: str) -> Any:
    module, _, attribute = name.partition(":")
    return getattr(import_module(module), attribute)
