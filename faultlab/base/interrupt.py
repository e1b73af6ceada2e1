"""SIGINT and SIGTERM as an outcome of their own: the run stops, nothing is reported.

A command installs :func:`handling` once. The first signal raises
:class:`Interrupted` wherever the main thread is (a wait for a worker, Hypothesis's
generation, a shrink); ``finally`` blocks then end and reap the workers, stop the
fork server and remove the run directories, and the command exits 130 (SIGINT) or
143 (SIGTERM) with one line. Later signals are only noted, so that cleanup is not
itself cut short.

:class:`Interrupted` subclasses :class:`KeyboardInterrupt` on purpose: Hypothesis
treats a ``KeyboardInterrupt`` as the user stopping the search, never as a failing
example to replay, shrink or save, and ``except Exception`` does not catch it.

Two more guards keep a late signal from turning into a result:

* :func:`check` raises if a signal arrived; the executor calls it before every step,
  so code that runs after the exception (a state machine's teardown) starts no worker.
* :func:`deferred` holds the exception back around a short critical section (removing
  a run directory, committing an output file); :func:`finished` marks the moment a
  result is committed, after which a signal can no longer undo it.

This module imports nothing from faultlab: every layer may use it.
"""

from __future__ import annotations

import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(KeyboardInterrupt):
    """The run was stopped by a signal; exit status 128 + the signal number."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum

    @property
    def exit_code(self) -> int:
        return 128 + self.signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def __str__(self) -> str:
        return f"interrupted by {self.name}"


class _State:
    received: int | None = None  # the first signal, once one arrived
    raised = False  # Interrupted has been raised once: later signals are only noted
    deferring = 0  # depth of deferred() sections in the main thread
    finished = False  # the result is committed: a signal no longer changes the outcome


_state = _State()


def received() -> int | None:
    """The signal that interrupted this run, or None."""
    return _state.received


#: Code whose exceptions the interpreter prints and swallows ("Exception ignored in ..."):
#: a signal that lands there is only noted; the next :func:`check` raises it.
_SWALLOWING = frozenset({"__del__", "gc_callback", "_remove", "callback"})


def handler(signum: int, frame: FrameType | None) -> None:
    """The signal handler: note the signal and raise :class:`Interrupted` once."""
    if _state.received is None:
        _state.received = signum
    if _state.raised or _state.deferring or _state.finished:
        return
    if frame is not None and frame.f_code.co_name in _SWALLOWING:
        return
    _state.raised = True
    raise Interrupted(_state.received)


def check() -> None:
    """Raise :class:`Interrupted` if a signal arrived (and no result was committed yet)."""
    if _state.received is not None and not _state.finished:
        _state.raised = True
        raise Interrupted(_state.received)


def in_main_thread() -> bool:
    """Whether this is the main thread, without importing :mod:`threading`.

    A process that never imported :mod:`threading` started no thread through it, so it
    runs in its main thread. Not importing it matters in the fork server: every module
    loaded there is loaded in every worker, and :mod:`threading` registers an after-fork
    hook whose Python code costs each forked child about 120 copy-on-write page faults
    (half a millisecond; ``bench/spawn.py``).
    """
    threading = sys.modules.get("threading")
    return threading is None or threading.current_thread() is threading.main_thread()


@contextmanager
def deferred() -> Iterator[None]:
    """Run a short critical section to its end; a signal during it is raised afterwards.

    Outside the main thread (where no handler runs) this only adds the check at the end.
    """
    main = in_main_thread()
    if main:
        _state.deferring += 1
    try:
        yield
    finally:
        if main:
            _state.deferring -= 1
    if not _state.deferring and not _state.raised:
        check()  # raised once already: the cleanup under way must not be cut short


def finished() -> None:
    """The run's result is committed (its output renamed into place): report it normally."""
    _state.finished = True


def reset() -> None:
    """Forget an earlier interruption (for a process that runs several commands: tests)."""
    _state.received = None
    _state.raised = False
    _state.deferring = 0
    _state.finished = False


@contextmanager
def held_for_children() -> Iterator[None]:
    """Block SIGINT and SIGTERM in this thread while it starts child interpreters (the
    jobs of ``--jobs``, the judges of ``mutants``).

    The terminal sends SIGINT to the whole foreground group, a child still importing
    included, and a child interrupted before it installs its handlers printed a
    ``KeyboardInterrupt`` traceback of ``multiprocessing``'s own start-up. A child inherits
    the blocked mask across exec, so the signal waits in it until it has its handlers and
    calls :func:`release_held`; here it is delivered as the block ends. Nothing is lost
    either way."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def release_held() -> None:
    """Unblock SIGINT and SIGTERM in a child started under :func:`held_for_children`, once
    its handlers are in place: a signal that arrived meanwhile is handled now."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def install() -> None:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the rest of this process
    (a process that only ever runs faultlab work: a pool worker of ``mutants``)."""
    reset()
    for signum in SIGNALS:
        signal.signal(signum, handler)


@contextmanager
def handling(*, restore: bool = True) -> Iterator[None]:
    """Turn SIGINT and SIGTERM into :class:`Interrupted` for the duration of a command.

    ``restore=False`` (the ``faultlab`` program) ignores both signals after the command,
    so one that arrives once the outcome is decided (and printed) changes nothing: no
    traceback, no death by the default action during interpreter shutdown. Only the main
    thread can install handlers; elsewhere this changes nothing.
    """
    if not in_main_thread():
        yield
        return
    reset()
    previous = {signum: signal.signal(signum, handler) for signum in SIGNALS}
    try:
        yield
    finally:
        for signum, previous_handler in previous.items():
            # not restoring: ignore, since interpreter shutdown puts the default (deadly)
            # action back in place of a Python handler, but leaves SIG_IGN alone
            signal.signal(signum, previous_handler if restore else signal.SIG_IGN)
