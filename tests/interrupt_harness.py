"""Run one faultlab command, send it a real signal at a chosen moment, report what was left.

Run as a separate process (``python interrupt_harness.py CONFIG_JSON``): it makes itself
a child subreaper, so any process faultlab leaves behind (a worker, the fork server, a
zombie) is reparented to the harness, where it can be seen, counted and then killed and
reaped. Prints one JSON object: the exit status, stdout, stderr, when the signal was
sent, the processes left behind and the run directories (``faultlab-<pid>-*``, and
libfaketime areas ``faultlab-faketime-<pid>-*``) left, of
faultlab and of every process seen below it (a ``--jobs`` run's jobs name their own).

CONFIG: ``argv``, ``cwd``, ``signal`` ("INT" or "TERM"), ``trigger`` ("ready": the
command has installed its SIGTERM handler; "stderr": a text appeared on stderr;
"rundir": a run directory of the command exists), ``text``, ``delay`` (seconds after
the trigger), ``limit`` (seconds to wait for the trigger and for the exit).
"""

from __future__ import annotations

import ctypes
import glob
import json
import os
import selectors
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Collection
from typing import Any


def children(me: int) -> dict[int, str]:
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = open(f"/proc/{entry}/stat").read().rsplit(")", 1)[1].split()  # noqa: SIM115
        except OSError:
            continue
        if int(fields[1]) == me:
            try:
                command = open(f"/proc/{entry}/cmdline", "rb").read()[:120]  # noqa: SIM115
            except OSError:
                command = b""
            shown = command.replace(b"\0", b" ").decode("utf-8", "replace")
            found[int(entry)] = f"{fields[0]} pgid={fields[2]} sid={fields[3]} {shown}"
    return found


def handles_sigterm(pid: int) -> bool:
    try:
        status = open(f"/proc/{pid}/status").read()  # noqa: SIM115
    except OSError:
        return False
    for line in status.splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & (1 << (signal.SIGTERM - 1)))
    return False


PLACES = ["/dev/shm", tempfile.gettempdir()]


def existing_directories() -> set[str]:
    """Every faultlab run directory there is now, whoever made it."""
    return {p for place in PLACES for pattern in ("faultlab-*", "sem.faultlab-*")
            for p in glob.glob(f"{place}/{pattern}")}


def run_directories(*pids: int, before: frozenset[str] = frozenset(),
                    alive: Collection[int] | None = None) -> list[str]:
    """The run directories of ``pids``, except those there before the command started:
    pids wrap (pid_max is often 32768), so a process below faultlab may carry the pid of
    an earlier, unrelated process whose directory was left behind; that is not a leftover
    of this run. ``alive``: faultlab's processes still alive (all below the harness); a
    pid held by any other process now was reused, and what its holder made is not this
    run's either (see :func:`made_by_another_holder`)."""
    patterns = [(pid, f"{kind}{pid}-*") for pid in pids
                for kind in ("faultlab-", "faultlab-lanes-", "faultlab-faketime-",
                             "sem.faultlab-faketime-")]
    return sorted(p for place in PLACES for pid, name in patterns
                  for p in glob.glob(f"{place}/{name}")
                  if p not in before
                  and not (alive is not None and pid not in alive
                           and made_by_another_holder(p, pid)))


def made_by_another_holder(path: str, pid: int) -> bool:
    """Whether ``path``, named for ``pid``, was made by the process that holds ``pid`` now
    (one that is not faultlab's): a run forks thousands of workers, so within a long run
    another test's process can get one of their pids. Its directory was made after it
    started; one that faultlab's process left was made before that process ended, so
    before any later holder of its pid started (reuse waits for the pid counter to wrap)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # since boot
        made = os.stat(path).st_ctime
    except (OSError, ValueError, IndexError):
        return False  # the pid is free (or the directory is gone): nothing to tell apart
    started = time.time() - time.clock_gettime(time.CLOCK_BOOTTIME) + ticks / _TICKS
    return made >= started


_TICKS = os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> set[int]:
    """Every process below ``root`` now (a ``--jobs`` run's job processes make run
    directories named by their own pids, not by faultlab's)."""
    parents: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()  # noqa: SIM115
                parents[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def main() -> None:
    config: dict[str, Any] = json.loads(sys.argv[1])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER
    me = os.getpid()
    started = time.monotonic()
    before = frozenset(existing_directories())
    child = subprocess.Popen(config["argv"], cwd=config["cwd"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE)
    assert child.stdout is not None and child.stderr is not None
    output = {"stdout": b"", "stderr": b""}
    selector = selectors.DefaultSelector()
    selector.register(child.stdout, selectors.EVENT_READ, "stdout")
    selector.register(child.stderr, selectors.EVENT_READ, "stderr")
    limit = started + float(config.get("limit", 60))
    signum = signal.SIGINT if config["signal"] == "INT" else signal.SIGTERM
    trigger, text = config["trigger"], config.get("text", "")
    sent_at: float | None = None
    triggered_at: float | None = None
    exited_at: float | None = None

    def pump(timeout: float) -> None:
        for key, _ in selector.select(timeout):
            data = os.read(key.fileobj.fileno(), 65536)  # type: ignore[union-attr]
            if not data:
                selector.unregister(key.fileobj)
            else:
                output[key.data] += data

    seen = {child.pid}  # faultlab and every process below it: whose run directories count
    looked = 0.0
    while selector.get_map() and time.monotonic() < limit:
        pump(0.005)
        if time.monotonic() - looked >= 0.05:
            looked = time.monotonic()
            seen |= descendants(child.pid)
        if sent_at is None and triggered_at is None:
            if (trigger == "ready" and handles_sigterm(child.pid)) or (
                trigger == "stderr" and text.encode() in output["stderr"]
            ) or (trigger == "rundir" and run_directories(child.pid, before=before)):
                triggered_at = time.monotonic()
        if triggered_at is not None and sent_at is None:
            if time.monotonic() - triggered_at >= float(config.get("delay", 0)):
                if child.poll() is None:  # still our unreaped child
                    child.send_signal(signum)
                    sent_at = time.monotonic()
    try:
        child.wait(timeout=max(limit - time.monotonic(), 1))
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()
    exited_at = time.monotonic()
    left = children(me)  # anything faultlab left behind is ours now
    directories = run_directories(*sorted(seen), before=before, alive=descendants(me))
    # clean up after a failing run, so the next test starts clean: what is killed here
    # may leave its own children to us, so repeat until nothing is left (bounded)
    end = time.monotonic() + 10
    while time.monotonic() < end:
        remaining = children(me)
        if not remaining:
            break
        for pid in remaining:
            for kill in (os.killpg, os.kill):
                try:
                    kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        time.sleep(0.05)
        while True:
            try:
                if os.waitpid(-1, os.WNOHANG)[0] == 0:
                    break
            except ChildProcessError:
                break
    print(json.dumps({
        "returncode": child.returncode,
        "stdout": output["stdout"].decode("utf-8", "replace"),
        "stderr": output["stderr"].decode("utf-8", "replace"),
        "signalled": sent_at is not None,
        "signal_after": None if sent_at is None else round(sent_at - started, 3),
        "exit_after_signal": None if sent_at is None else round(exited_at - sent_at, 3),
        "leftovers": {str(pid): state for pid, state in left.items()},
        "run_directories": directories,
    }))


if __name__ == "__main__":
    main()
