"""One trace type: a sequential trace is the one-lane case of a laned one, and every
committed trace file reads and writes back byte for byte in the version it was written in."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faultlab.base.errors import UsageError
from faultlab.trace import Step, Trace

ROOT = Path(__file__).resolve().parent.parent
P = {"title": "a"}


def committed_traces() -> list[Path]:
    found = []
    for folder in ("corpus", "examples", "tests"):
        for path in sorted((ROOT / folder).rglob("*.json")):
            try:
                data = json.loads(path.read_text(encoding="utf-8"))
            except (ValueError, UnicodeDecodeError):
                continue
            if isinstance(data, dict) and data.get("format") == "faultlab-trace":
                found.append(path)
    return found


def test_every_committed_trace_of_either_version_writes_back_byte_for_byte() -> None:
    paths = committed_traces()
    versions = {json.loads(path.read_text())["version"] for path in paths}
    assert len(paths) >= 40 and versions == {1, 2}  # both versions are on record
    for path in paths:
        trace = Trace.load(path)
        assert isinstance(trace, Trace)
        written = json.dumps(trace.to_json(), indent=2) + "\n"
        assert written == path.read_text(encoding="utf-8"), path


def test_a_sequential_step_is_the_one_lane_case_of_a_run() -> None:
    sequential = Step("accept", "op-1", P, "after_commit")
    laned = Step("accept", "op-1", P, "after_commit", lane=1)
    assert not sequential.laned and laned.laned
    assert sequential.role == laned.role == "accept" and sequential.starts
    assert sequential.lane_number == laned.lane_number == 1
    assert sequential.describe() == 'accept(op-1, {"title":"a"}, crash=after_commit)'
    assert laned.describe() == 'L1 run accept(op-1, {"title":"a"}, crash=after_commit)'
    assert Step("dispatch", lane=2, hold=True).describe() == "L2 start dispatch()"
    assert sequential.to_json() == {"action": "accept", "operation_id": "op-1",
                                    "payload": P, "crash": "after_commit"}
    assert laned.to_lane_json() == {"action": "run", "lane": 1, "role": "accept",
                                    "operation_id": "op-1", "payload": P,
                                    "crash": "after_commit"}


def test_a_trace_is_written_in_the_version_its_steps_need() -> None:
    steps = [Step("accept", "op-1", P), Step("dispatch"), Step.power({"kind": "drop_all"})]
    sequential = Trace(system="reference", deduplication=True, steps=steps)
    assert not sequential.laned and sequential.to_json()["version"] == 1
    assert "concurrency" not in sequential.to_json()
    for laned in (
        Trace(system="reference", deduplication=True, steps=steps, concurrency=2),
        Trace(system="reference", deduplication=True, steps=steps, statement_points=True),
        Trace(system="reference", deduplication=True, steps=[*steps, Step("tick", ticks=3)]),
        Trace(system="reference", deduplication=True,
              steps=[Step("accept", "op-1", P, lane=1), Step("dispatch", lane=1)]),
    ):
        document = laned.to_json()
        assert laned.laned and document["version"] == 2
        assert [step.get("lane") for step in document["steps"]][:2] == [1, 1]  # the one lane
        again = Trace.from_json(json.loads(json.dumps(document)))
        assert again.to_json() == document
        assert [step.lane_number for step in again.steps] == [
            step.lane_number for step in laned.steps]


def test_a_laned_file_refuses_what_its_next_save_would_drop() -> None:
    def read(step: dict[str, object]) -> Trace:
        return Trace.from_json({"format": "faultlab-trace", "version": 2, "system": "x",
                                "deduplication": True, "concurrency": 2, "steps": [step]})

    with pytest.raises(UsageError, match="a release step takes no role"):
        read({"action": "release", "lane": 1, "role": "accept"})
    with pytest.raises(UsageError, match="run needs a role"):
        read({"action": "run", "lane": 1})
    with pytest.raises(UsageError, match="only run and start arm a crash point"):
        read({"action": "kill", "lane": 1, "crash": "after_commit"})
    start = read({"action": "start", "lane": 2, "role": "dispatch"}).steps[0]
    assert start == Step("dispatch", lane=2, hold=True)


def test_the_sequential_executor_refuses_a_laned_step() -> None:
    from faultlab.run.executor import validate_step
    from faultlab.system import load_system

    with pytest.raises(UsageError, match="names no lane"):
        validate_step(load_system("reference"), Step("dispatch", lane=1))
