"""The Unicode character map Hypothesis builds is kept in faultlab's cache between runs.

Every run gives Hypothesis a private directory (nothing in the user's); the map, about
0.2 s of CPU to build, would otherwise be rebuilt by every run and every job process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from faultlab.process.spawn import child_environment
from faultlab.search import storage

_PROBE = """
import os, sys
from pathlib import Path
from faultlab.search.storage import KEPT, private_storage
with private_storage() as directory:
    had = sorted(str(p.relative_to(directory)) for p in (Path(directory) / KEPT).rglob("*.gz"))
    from hypothesis.internal.charmap import charmap
    charmap()
    built = sorted(str(p.relative_to(directory)) for p in (Path(directory) / KEPT).rglob("*.gz"))
print(len(had), len(built))
"""


def _run(cache: Path, cwd: Path) -> str:
    environment = {**child_environment(), "XDG_CACHE_HOME": str(cache)}
    environment.pop(storage.VARIABLE, None)
    completed = subprocess.run([sys.executable, "-c", _PROBE], cwd=cwd, env=environment,
                               capture_output=True, text=True, timeout=60, check=False)
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.strip()


def test_the_character_map_is_built_once_and_then_copied_in(tmp_path: Path) -> None:
    cache, work = tmp_path / "cache", tmp_path / "work"
    work.mkdir()
    assert _run(cache, work) == "0 1"  # built in the private directory, none to copy in
    kept = list((cache / "faultlab" / "hypothesis" / storage.KEPT).rglob("charmap.json.gz"))
    assert len(kept) == 1 and kept[0].stat().st_size > 0
    assert _run(cache, work) == "1 1"  # there before Hypothesis ran: copied from the cache
    assert list(work.iterdir()) == []  # nothing in the user's directory
    assert not list(cache.rglob(".partial-*"))


def test_an_unwritable_cache_costs_only_the_rebuild(tmp_path: Path) -> None:
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere: an unwritable cache cannot be made")
    cache = tmp_path / "cache"
    cache.mkdir(mode=0o500)
    try:
        assert _run(cache, tmp_path) == "0 1"
        assert list(cache.iterdir()) == []
    finally:
        cache.chmod(0o700)


def test_a_cache_that_is_a_file_costs_only_the_rebuild(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.write_text("not a directory")
    assert _run(cache, tmp_path) == "0 1"
    assert cache.read_text() == "not a directory"
