"""Power loss for a command-line system: recorded when its program asks, refused when not.

A system's own program runs its own SQLite, which faultlab's VFS does not see unless the
program installs it (``faultlab.record_power_loss()``). Without that a power cut would
find every write durable and call the run clean; it ends with exit status 3 instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import faultlab
from faultlab.process.records import POWER_LOG_VARIABLE
from faultlab.stores import vfs
from faultlab.trace import Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

ROOT = Path(__file__).resolve().parent.parent
UNMODIFIED = ROOT / "examples" / "unmodified_outbox"
PRELUDE = "import faultlab\nfaultlab.record_power_loss()\n\n"


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def copy_of_the_example(directory: Path, *, records: bool) -> Path:
    """examples/unmodified_outbox in ``directory``; ``records``: its program calls
    ``faultlab.record_power_loss()`` before it opens a store."""
    source = (UNMODIFIED / "outbox_lab.py").read_text()
    anchor = 'ORDERS = "orders.db"\n'
    assert source.count(anchor) == 1
    if records:
        source = source.replace(anchor, PRELUDE + anchor)
    (directory / "outbox_lab.py").write_text(source)
    system = directory / "system.json"
    system.write_text((UNMODIFIED / "system.json").read_text())
    return system


def test_the_variable_has_one_name() -> None:
    assert vfs.LOG_VARIABLE == POWER_LOG_VARIABLE


def test_record_power_loss_does_nothing_outside_a_power_trace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(POWER_LOG_VARIABLE, raising=False)
    assert faultlab.record_power_loss() is False
    assert vfs.installed_directory() is None


def test_record_power_loss_installs_the_vfs_from_the_environment(tmp_path: Path) -> None:
    """In a fresh interpreter, as a program of the user's would: its commit is recorded."""
    log = tmp_path / "log"
    program = ("import sqlite3, faultlab\n"
               "assert faultlab.record_power_loss() is True\n"
               f"c = sqlite3.connect({str(tmp_path / 'x.db')!r}, isolation_level=None)\n"
               "c.execute('CREATE TABLE t(x)'); c.execute('INSERT INTO t VALUES (1)')\n")
    done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                          env={**os.environ, POWER_LOG_VARIABLE: str(log)}, timeout=60)
    assert done.returncode == 0, done.stderr
    files = vfs.summary(log)["files"]
    assert str(tmp_path / "x.db") in files and files[str(tmp_path / "x.db")]["changes"] > 0


def test_a_connection_left_open_at_exit_is_recorded_as_if_closed(tmp_path: Path) -> None:
    """Python 3.12+ tears the module down before it closes a connection left open: the close's
    checkpoint went unrecorded through failing callbacks (and, in CI, crashed with SIGSEGV)."""
    def records(close: bool) -> tuple[str, dict[str, Any]]:
        directory = tmp_path / ("closed" if close else "open")
        directory.mkdir()
        program = ("import sqlite3, faultlab\n"
                   "faultlab.record_power_loss()\n"
                   f"c = sqlite3.connect({str(directory / 'x.db')!r}, isolation_level=None)\n"
                   "c.execute('PRAGMA journal_mode=WAL')\n"
                   "c.execute('CREATE TABLE t(x)'); c.execute('INSERT INTO t VALUES (1)')\n"
                   + ("c.close()\n" if close else ""))
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True,
                              env={**os.environ, POWER_LOG_VARIABLE: str(directory / "log")},
                              timeout=60)
        assert done.returncode == 0, done.stderr
        files = vfs.summary(directory / "log")["files"]
        return done.stderr, {Path(path).name: counts for path, counts in files.items()}

    closed_stderr, closed = records(close=True)
    open_stderr, left_open = records(close=False)
    assert closed_stderr == "" and open_stderr == ""
    assert closed["x.db"]["changes"] > 0 and "x.db-wal" in closed
    assert left_open == closed


def test_a_program_that_does_not_record_ends_the_run_with_exit_3(tmp_path: Path) -> None:
    """Before, the same run printed ``clean`` with OPEN and DURABLE "checked"."""
    system = copy_of_the_example(tmp_path, records=False)
    corpus = tmp_path / "corpus"
    done = run_cli("explore", "--system", str(system), "--power-loss", "--examples", "30",
                   "--seed", "0", "--corpus", str(corpus), cwd=tmp_path)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "does not record its SQLite writes" in done.stderr
    assert "faultlab.record_power_loss()" in done.stderr
    assert "clean" not in done.stdout
    assert not corpus.exists() or not list(corpus.glob("*.json"))


def test_a_program_that_records_is_cut_and_its_default_full_sync_is_found(
        tmp_path: Path) -> None:
    """The example commits with SQLite's default synchronous=FULL in rollback-journal mode:
    the journal's deletion (the commit point) is never directory-synced, so a power cut
    after an acknowledged accept rolls it back. Found, shrunk to two steps, replayed."""
    system = copy_of_the_example(tmp_path, records=True)
    corpus = tmp_path / "corpus"
    done = run_cli("explore", "--system", str(system), "--power-loss", "--no-statement-points",
                   "--examples", "30", "--seed", "0", "--corpus", str(corpus), "--quiet",
                   cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    (found,) = sorted(corpus.glob("*.json"))
    trace = Trace.load(found)
    assert [step.action for step in trace.steps] == ["accept", "power"]
    assert trace.steps[-1].choice == {"kind": "drop_all"}
    assert trace.expected is not None and "DURABLE" in trace.expected.invariants
    assert "expect" not in json.loads(found.read_text())  # a regression test: fails until fixed
    replayed = run_cli("replay", str(found), "--system", str(system), cwd=tmp_path)
    assert replayed.returncode == 1 and "STILL FAILS" in replayed.stdout, \
        replayed.stdout + replayed.stderr
