"""Progress: a bar with the budget, rate and ETA on a terminal; plain lines otherwise."""

from __future__ import annotations

import fcntl
import os
import struct
import subprocess
import sys
import termios
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ARGV = ["explore", "--examples", "10", "--seed", "0", "--corpus", "{corpus}"]


def _in_a_terminal(argv: list[str], columns: int) -> tuple[int, str]:
    """Run faultlab with stdin/stdout/stderr on a pseudo-terminal of ``columns`` columns.

    Started by ``subprocess`` (no fork of this process, which pytest-xdist runs threaded);
    the child leads a session of its own, so the terminal is its controlling one."""
    leader, follower = os.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, columns, 0, 0))
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "faultlab", *argv], cwd=ROOT,
            stdin=follower, stdout=follower, stderr=follower, start_new_session=True)
    finally:
        os.close(follower)
    out = b""
    try:
        while True:
            try:
                chunk = os.read(leader, 65536)
            except OSError:  # EIO: every follower descriptor is closed
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(leader)
    return child.wait(), out.decode("utf-8", "replace")


def test_a_terminal_gets_a_bar_with_the_budget_and_eta(tmp_path: Path) -> None:
    pytest.importorskip("tqdm")
    argv = [a.format(corpus=tmp_path / "c") for a in ARGV]
    code, text = _in_a_terminal(argv, 120)
    assert code == 0, text
    assert "explore:" in text and "%|" in text and "/10 [" in text  # the budget
    assert "steps/s" in text and "<" in text  # rate and remaining time
    assert "clean: no invariant failed" in text


def test_a_pipe_gets_plain_lines_and_no_bar(tmp_path: Path) -> None:
    """Control: the same run with stderr on a pipe prints plain lines, no bar."""
    argv = [a.format(corpus=tmp_path / "c") for a in ARGV]
    result = subprocess.run([sys.executable, "-m", "faultlab", *argv], cwd=ROOT,
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    assert "%|" not in result.stderr
    assert "explore: " in result.stderr and " examples, " in result.stderr


def test_a_bar_starts_no_thread() -> None:
    """tqdm starts a monitor thread with its first bar unless told not to; faultlab forks
    from this process, and a fork from a threaded process may deadlock the child."""
    import threading

    pytest.importorskip("tqdm")
    from faultlab.report.progress import Progress

    leader, follower = os.openpty()
    os.set_blocking(leader, False)
    try:
        fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 80, 0, 0))
        with open(follower, "w", closefd=False) as terminal:
            before = {thread.name for thread in threading.enumerate()}
            progress = Progress(examples=10, duration=None, label="explore", stream=terminal)
            assert progress.drawing
            progress.update(examples=1, seconds=0.1, line="", postfix="")
            after = {thread.name for thread in threading.enumerate()}
            progress.close()
    finally:
        os.close(leader)
        os.close(follower)
    assert after == before, after - before
