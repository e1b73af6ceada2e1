"""A lane worker's body for tests/test_starter.py that says which costly modules the
image it was forked from holds (a worker inherits every module of the lanes' helper, and
its fork copies the page tables of all of them)."""

from __future__ import annotations

import os
import sys

from faultlab.process.records import WorkerSpec

#: Modules no lane worker needs: this process's (Hypothesis, pytest, the search), and
#: ones whose weight a fork copies or whose after-fork hook runs in every child.
COSTLY = ("hypothesis", "pytest", "faultlab.search", "threading", "subprocess", "random",
          "hashlib")


def held() -> list[str]:
    """The costly modules this process holds."""
    return sorted(name for name in COSTLY if name in sys.modules)


def report_modules(spec: WorkerSpec, environment: dict[str, str],
                   channel: tuple[int, int]) -> int:
    """Announce the costly modules held (``-`` for none) and the systems loaded, then end."""
    from faultlab import system  # already in the image: the systems it loaded

    _, announce = channel
    words = " ".join(held()) or "-"
    os.write(announce, f"{words} | {' '.join(sorted(system._cache))}\n".encode())
    return 0


def prepare_without_client_check(system: str) -> None:
    """The lanes' preparation, with the server's client connection check turned off in
    every worker the helper forks (a control for tests/test_postgres.py: a constant
    changed in the test's own process does not reach a fresh interpreter)."""
    from faultlab.run.worker import prepare_lanes
    from faultlab.stores import postgres

    postgres.CLIENT_CHECK_MS = 0
    prepare_lanes(system)
