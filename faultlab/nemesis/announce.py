"""The announcement protocol: a command-line worker reports each crash point and waits.

Every worker of a system armed in ``announce`` mode gets two inherited file
descriptors, named by ``FAULTLAB_ANNOUNCE_FD`` and ``FAULTLAB_RESUME_FD``. At each
crash point it writes ``reached POINT PID`` and a newline to the first and blocks
reading one line from the second. faultlab answers ``continue`` unless POINT is
the armed point, in which case it SIGKILLs PID (only if PID is in the process
group faultlab created for this worker) and never answers.

This is the nemesis for programs faultlab cannot arm from inside: the kill comes
from outside, at the point the program itself names.
"""

from __future__ import annotations

import os
import selectors
import signal
import threading

ANNOUNCE_FD_VARIABLE = "FAULTLAB_ANNOUNCE_FD"
RESUME_FD_VARIABLE = "FAULTLAB_RESUME_FD"
CONTINUE = b"continue\n"


class ProtocolError(Exception):
    """A worker broke the announcement protocol (the message says how)."""


def channel_environment(announce_fd: int, resume_fd: int) -> dict[str, str]:
    """The variables that tell a worker its two descriptors."""
    return {ANNOUNCE_FD_VARIABLE: str(announce_fd), RESUME_FD_VARIABLE: str(resume_fd)}


def parse_announcement(line: str, known: set[str] | frozenset[str],
                       group: int) -> tuple[str, int]:
    """``(POINT, PID)`` of one announcement line, checked: a declared point, a pid in the
    worker's process group ``group``. Raises :class:`ProtocolError` otherwise. One check
    for sequential steps (:class:`Announcements`) and lanes (faultlab.run.interleaving)."""
    parts = line.split()
    if len(parts) != 3 or parts[0] != "reached" or not parts[2].isdigit():
        raise ProtocolError(f"expected 'reached POINT PID', got {line[:80]!r}")
    point, pid = parts[1], int(parts[2])
    if point not in known:
        raise ProtocolError(f"announced {point!r}, which the system file does not declare")
    try:
        in_group = pid > 0 and os.getpgid(pid) == group
    except OSError:
        in_group = False
    if not in_group:
        raise ProtocolError(
            f"announced pid {pid}, which is not in the worker's process group {group}"
        )
    return point, pid


class Announcements:
    """faultlab's side of the announcement protocol for one worker run."""

    def __init__(self, armed: str | None, known: set[str] | frozenset[str]) -> None:
        self.armed = armed
        self.known = known
        self.errors: list[str] = []
        self.reached: list[str] = []
        self.group = 0
        self._announce_r, self._announce_w = os.pipe()
        self._resume_r, self._resume_w = os.pipe()
        self._stop_r, self._stop_w = os.pipe()
        self._child_ends_open = True
        self._closed = False
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Announcements:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def environment(self) -> dict[str, str]:
        return channel_environment(self._announce_w, self._resume_r)

    def child_fds(self) -> tuple[int, int]:
        return self._announce_w, self._resume_r

    def _close_child_ends(self) -> None:
        if self._child_ends_open:
            self._child_ends_open = False
            os.close(self._announce_w)
            os.close(self._resume_r)

    def start(self, pid: int) -> None:
        """The worker (pid, leader of its own process group) is running: serve it."""
        self.group = pid
        self._close_child_ends()
        self._thread = threading.Thread(target=self._serve, name="faultlab-announce", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        buffer = b""
        with selectors.DefaultSelector() as selector:
            selector.register(self._announce_r, selectors.EVENT_READ)
            selector.register(self._stop_r, selectors.EVENT_READ)
            while True:
                events = selector.select()
                if any(key.fd == self._stop_r for key, _ in events):
                    return
                data = os.read(self._announce_r, 4096)
                if not data:
                    return
                buffer += data
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    self._handle(line.decode("utf-8", "replace").strip())

    def _handle(self, line: str) -> None:
        try:
            point, pid = parse_announcement(line, self.known, self.group)
        except ProtocolError as error:
            self._protocol_error(str(error))
            return
        self.reached.append(point)
        if point == self.armed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            return
        try:
            os.write(self._resume_w, CONTINUE)
        except OSError:
            pass

    def _protocol_error(self, message: str) -> None:
        """Record the error and end the worker's process group (ours), so nothing hangs."""
        self.errors.append(message)
        try:
            os.killpg(self.group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_child_ends()
        if self._thread is not None:
            os.write(self._stop_w, b"x")
            self._thread.join()
            self._thread = None
        for fd in (self._announce_r, self._resume_w, self._stop_r, self._stop_w):
            os.close(fd)
