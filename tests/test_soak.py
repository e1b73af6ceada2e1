"""Soak: 20,000 explored steps leave exactly what was there before.

Processes below this one (zombies included), open descriptors, faultlab's temporary
directories and its /dev/shm run directories are counted before and after a long
exploration. The run directories carry the creating process's pid, so runs of other
processes sharing /dev/shm do not disturb the count.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
from test_process import descendants, open_fds

from faultlab.process.spawn import spawner
from faultlab.search.explore import explore
from faultlab.system import System

pytestmark = pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs Linux /proc")


def faultlab_directories() -> list[str]:
    """Run and probe directories of this process in /dev/shm and the temporary directory."""
    mine = (f"faultlab-{os.getpid()}-", "faultlab-probe-")
    found = []
    for place in ("/dev/shm", tempfile.gettempdir()):
        if os.path.isdir(place):
            found += [f"{place}/{name}" for name in os.listdir(place) if name.startswith(mine)]
    return sorted(found)


def census() -> dict[str, object]:
    below = descendants(os.getpid())
    return {
        "processes": sorted(below),
        "zombies": sorted(pid for pid, state in below.items() if state == "Z"),
        "descriptors": open_fds(),
        "directories": faultlab_directories(),
    }


@pytest.mark.slow  # about three minutes on 2 cores: 20,000 real worker processes and more
def test_twenty_thousand_steps_leave_nothing_behind(reference: System) -> None:
    before = census()
    with spawner("fork") as runner:
        result = explore(reference, runner, examples=2000, steps=10, seed_value=20)
    after = census()
    assert result.trace is None  # the reference stays clean
    assert result.recorder.steps >= 20_000, result.recorder.steps
    assert result.recorder.sigkills > 1000
    assert after == before
