"""Output into a closed pipe (``faultlab systems | head -1``) ends quietly."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _with_closed_reader(argv: list[str]) -> subprocess.CompletedProcess[bytes]:
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first byte is written
    try:
        return subprocess.run([sys.executable, "-m", "faultlab", *argv], stdout=write,
                              stderr=subprocess.PIPE, cwd=ROOT, timeout=120, check=False)
    finally:
        os.close(write)


def test_a_closed_pipe_ends_the_command_quietly_with_the_sigpipe_status() -> None:
    for argv in (["systems"], ["replay", "corpus/no-dedup-RCPT-baa0069205.json"]):
        result = _with_closed_reader(argv)
        assert result.stderr == b"", result.stderr.decode()
        assert result.returncode == 128 + 13


def test_an_open_pipe_still_gets_everything() -> None:
    """Control: with a reader, the same command prints its table and exits 0."""
    result = subprocess.run([sys.executable, "-m", "faultlab", "systems"], capture_output=True,
                            cwd=ROOT, timeout=120, check=False)
    assert result.returncode == 0
    assert b"reference" in result.stdout
