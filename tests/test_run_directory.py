"""A trace's run directory: both executors make it the same way and never leave it behind.

Every trace runs on stores of its own (:mod:`faultlab.run.directory`). These tests open
real executors on real SQLite stores and look at the disk: the directory is named by
this process's pid, is removed after the trace, and is removed even when the system
cannot release its stores (a PostgreSQL server that died).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from faultlab.process.spawn import Spawner
from faultlab.run.directory import RunDirectory
from faultlab.run.executor import Executor
from faultlab.stores.sqlite import StoreError
from faultlab.system import System, load_system
from faultlab.trace import Step


def test_both_executors_name_their_directory_by_pid_and_remove_it(
    reference: System, fork_spawner: Spawner,
) -> None:
    with Executor(reference, fork_spawner) as sequential:
        sequential.run(Step("accept", "op-1", {"title": "a"}))
        one = sequential.directory
        assert one.is_dir() and one.name.startswith(f"faultlab-{os.getpid()}-")
    with Executor(reference, concurrency=2) as lanes:
        lanes.run(Step("accept", "op-1", '{"title":"a"}', lane=1))
        two = lanes.directory
        assert two.is_dir() and two.name.startswith(f"faultlab-lanes-{os.getpid()}-")
    assert not one.exists() and not two.exists()


def test_a_requested_directory_is_released_and_kept(reference: System, tmp_path: Path) -> None:
    run = RunDirectory(reference, "faultlab-", requested=tmp_path / "kept")
    path = run.open()
    assert path == tmp_path / "kept" and any(path.iterdir())
    run.close()
    run.close()  # idempotent
    assert path.is_dir()


@pytest.mark.parametrize("lanes", [False, True], ids=["sequential", "lanes"])
def test_the_directory_goes_when_the_stores_cannot_be_released(
    lanes: bool, fork_spawner: Spawner,
) -> None:
    """The system's release fails at the trace's end: that error is the run's, and the
    directory is gone all the same (the lane executor left it behind before)."""
    system = load_system("systems_for_tests:UnreleasableOutbox")
    made: list[Path] = []
    with pytest.raises(StoreError, match="the server is gone"):
        if lanes:
            with Executor(system, concurrency=2) as ex:
                made.append(ex.directory)
                ex.run(Step("accept", "op-1", '{"title":"a"}', lane=1))
        else:
            with Executor(system, fork_spawner) as sequential:
                made.append(sequential.directory)
                sequential.run(Step("accept", "op-1", {"title": "a"}))
    assert len(made) == 1 and made[0].name.startswith("faultlab-")
    assert not made[0].exists()
