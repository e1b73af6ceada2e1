"""Workers started and left running: the non-blocking half of the process layer.

:meth:`faultlab.process.spawn.Spawner.run` runs a worker to its end (a sequential
step). A concurrent trace keeps several alive at once, each held at its points until
the schedule moves it, so it needs the other half: :meth:`Launcher.start` returns at
once with a :class:`Running` worker (its pid, the parent's ends of its pipes), and
:meth:`Running.reap` collects its wait status once its pipes have closed.

Every worker leads its own process group (so its group is signalled, paused and killed
as one, a dispatcher's service with it) and gets a control channel of two pipes
(decisions in, announcements out) whose child ends the caller names in the worker's
environment. How it starts is the caller's choice, and this is the only module that
starts one:

* :meth:`Launcher.start_worker` forks faultlab's own worker body: from the starter's
  quiet helper where ``pidfd_open`` exists (:mod:`faultlab.process.starter`: a fresh
  interpreter holding only what a worker uses; the caller's heap is never marked
  copy-on-write), else from this process;
* :meth:`Launcher.start_command` executes a command line (a fresh interpreter in exec
  mode, or a command-line system's own program).

A started worker is always known by its pid (a signal is held back until it is), and
:meth:`Launcher.close` ends the helper, which kills and reaps any worker still alive.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from faultlab.base import interrupt
from faultlab.base.errors import ExecutionError
from faultlab.process import starter
from faultlab.process.records import WorkerSpec
from faultlab.process.spawn import child_main, lead_own_group

#: The environment a worker needs, given the child's ends of its control channel
#: (decisions in, announcements out): the caller names them in its own variables.
ChannelEnvironment = Callable[[int, int], Mapping[str, str]]


@dataclass
class Running:
    """A started worker not yet reaped: its pid (it leads its own group), the parent's
    end of its decisions pipe, and the parent's read ends of announcements, stdout and
    stderr (named by descriptor). The caller reads and closes the read ends; :meth:`reap`
    closes the decisions pipe."""

    pid: int
    decide: int
    outputs: dict[int, str]
    started: float
    #: The helper that forked and reaps it; None: this process is its parent.
    starter: starter.Starter | None = None

    def signal(self, signum: int) -> None:
        """Signal the worker's whole group (a process of ours: it leads the group)."""
        try:
            os.killpg(self.pid, signum)
        except ProcessLookupError:
            pass

    def reap(self, bound: float) -> int:
        """The worker's wait status once it has ended (its pipes have closed): waits at
        most ``bound`` seconds, then kills its group and waits as long again; an
        :class:`ExecutionError` if it still has not ended."""
        try:
            return self._ended(bound)
        finally:
            os.close(self.decide)

    def _ended(self, bound: float) -> int:
        if self.starter is not None:  # the starter's helper reaps it and says so
            status = self.starter.ended(self.pid, bound)
            if status is None:
                self.signal(signal.SIGKILL)
                status = self.starter.ended(self.pid, bound)
            if status is None:
                raise ExecutionError(f"worker pid {self.pid} did not end")
            return status
        end = time.monotonic() + bound
        while True:
            waited, status = os.waitpid(self.pid, os.WNOHANG)
            if waited:
                return status
            if time.monotonic() > end:
                self.signal(signal.SIGKILL)
                return os.waitpid(self.pid, 0)[1]
            time.sleep(0.0005)


class Launcher:
    """Starts the workers of concurrent traces: a run's, kept and closed by its spawner
    (:meth:`faultlab.process.spawn.Spawner.shared`), or one trace's, closed with it.

    ``body`` is faultlab's worker as a forked child runs it (the spec, its environment,
    its two control descriptors as numbered in the child); the helper that forks it has
    imported and prepared everything it uses, so a worker imports nothing from disk."""

    def __init__(self, body: starter.StartedMain, prepare: Callable[..., object] | None = None,
                 arguments: Sequence[str] = (),
                 environment: Mapping[str, str] | None = None) -> None:
        """``body`` and ``prepare`` are module-level functions: the helper, a fresh
        interpreter, imports both and calls ``prepare(*arguments)`` before it forks a
        worker; it is started with ``environment`` added to this process's (a preload its
        workers inherit) (:class:`faultlab.process.starter.Starter`)."""
        self._body = body
        self._prepare = prepare
        self._arguments = tuple(arguments)
        self._environment = dict(environment) if environment else None
        self._starter: starter.Starter | None = None

    def notices(self) -> int | None:
        """A descriptor readable when the helper reports a worker's end (put it in a
        selector beside the workers' pipes and call :meth:`collect` when it is), or None
        while no helper runs."""
        return None if self._starter is None else self._starter.fileno()

    def collect(self) -> None:
        """Take every report of a worker's end that has arrived (never blocks)."""
        if self._starter is not None:
            self._starter.collect()

    def forks_here(self) -> bool:
        """Whether :meth:`start_worker` forks this process: only where no helper can be
        made (the helper is a fresh interpreter, started without a fork of this one)."""
        return not starter.available()

    def start_worker(self, spec: WorkerSpec, environment: ChannelEnvironment) -> Running:
        """Fork faultlab's worker for ``spec``: from the starter's helper (started on the
        first start, before this worker's pipes), or from this process where the helper
        cannot watch its children."""
        if self._starter is None and starter.available():
            with interrupt.deferred():  # started and known, or neither
                self._starter = starter.Starter(self._body, self._prepare, self._arguments,
                                                self._environment)
        helper = self._starter

        def begin(decide: int, announce: int, out: int, err: int) -> int:
            variables = dict(environment(decide, announce))
            if helper is not None:  # forked by its helper, not here
                return helper.start(spec, variables, (decide, announce, out, err))
            pid = os.fork()
            if pid == 0:  # the worker: never returns
                child_main(out, err, new_group=True, read_spec=lambda: spec,
                           run=lambda spec: self._body(spec, variables, (decide, announce)),
                           keep=(decide, announce))
            lead_own_group(pid)  # a kill right after the fork must reach it
            return pid

        return self._start(begin, helper)

    def start_command(self, argv: Sequence[str], environment: ChannelEnvironment, *,
                      cwd: str | None = None, control: bool = True) -> Running:
        """Execute ``argv`` in a new session with ``environment`` as its whole environment;
        ``control`` passes it the channel's child ends (a program that does not speak
        the protocol gets none, but its environment is still asked for). A command that
        cannot be executed is an :class:`ExecutionError` naming it."""

        def begin(decide: int, announce: int, out: int, err: int) -> int:
            try:
                child = subprocess.Popen(
                    list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                    env=dict(environment(decide, announce)), cwd=cwd,
                    pass_fds=(decide, announce) if control else (), start_new_session=True,
                )
            except OSError as error:
                raise ExecutionError(f"cannot run {argv[0]}: {error.strerror or error}"
                                     ) from None
            child.returncode = 0  # reaped through Running.reap, not by Popen
            return child.pid

        return self._start(begin, None)

    def _start(self, begin: Callable[[int, int, int, int], int],
               helper: starter.Starter | None) -> Running:
        decide_r, decide_w = os.pipe()
        announce_r, announce_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        started = time.monotonic()
        try:
            with interrupt.deferred():  # a started worker is always known by its pid
                pid = begin(decide_r, announce_w, out_w, err_w)
        except BaseException:
            for fd in (decide_w, announce_r, out_r, err_r):
                os.close(fd)
            raise
        finally:
            for fd in (decide_r, announce_w, out_w, err_w):
                os.close(fd)
        outputs = {announce_r: "announce", out_r: "stdout", err_r: "stderr"}
        for fd in outputs:
            os.set_blocking(fd, False)
        return Running(pid, decide_w, outputs, started, helper)

    def close(self) -> None:
        """End the helper, if one was made: it kills and reaps any worker still alive."""
        if self._starter is not None:
            self._starter.close()
            self._starter = None
