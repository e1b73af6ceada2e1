"""What a sequential trace checks, a concurrent one checks too.

Each test here is a hole the concurrent stack (``explore --concurrency N``, the lane
executor, trace format version 2) once had beside the sequential one: a command-line
system's ``response_fields``, crash points armed by argument, realistic data, a run
that failed, byte-stable corpus files, the pytest plugin and ``--statement-points``.
"""

from __future__ import annotations

import io
import json
import re
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

from faultlab.cli import main
from faultlab.run.interleaving import LaneExecutor
from faultlab.system import load_system
from faultlab.trace import LaneStep

ROOT = Path(__file__).resolve().parent.parent
UNMODIFIED = ROOT / "examples" / "unmodified_outbox"
P = {"title": "backlog"}


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


#: Exit statuses of a run that found nothing: clean, or vacuous (4: an argument-mode
#: system's lanes never hold at a point, so its workers never overlap).
NOTHING_FOUND = (0, 4)


def checked(out: str, invariant: str) -> int:
    """How often the coverage table says ``invariant`` had something to check."""
    found = re.search(rf"^{invariant}\s+(\d+)\s*$", out, re.MULTILINE)
    assert found is not None, out
    return int(found.group(1))


# --- 1. response_fields -----------------------------------------------------------------------


def taken_system(directory: Path) -> Path:
    """examples/unmodified_outbox with an accept that answers ``{"taken": ...}``, which its
    system file maps with ``"accepted": "/taken"``: without the mapping no accept is an
    acknowledgement, and ACK has nothing to check."""
    source = (UNMODIFIED / "outbox_lab.py").read_text()
    assert source.count('{"accepted": key') == 2
    (directory / "outbox_lab.py").write_text(source.replace('{"accepted": key', '{"taken": key'))
    data = json.loads((UNMODIFIED / "system.json").read_text())
    data["name"] = "unmodified-outbox-taken"
    data["response_fields"] = {**data["response_fields"], "accepted": "/taken"}
    path = directory / "system.json"
    path.write_text(json.dumps(data))
    return path


def test_a_lane_reads_a_response_through_response_fields(tmp_path: Path) -> None:
    system = load_system(str(taken_system(tmp_path)))
    with LaneExecutor(system, concurrency=2) as ex:
        accepted = ex.run(LaneStep("run", 1, "accept", "op-1", P))
        ((_, record),) = accepted.exited
        assert record.raw_response is not None and "taken" in record.raw_response
        assert record.response is not None and record.response["accepted"] == "op-1"
        assert list(ex.model.acknowledged) == ["op-1"]
        ex.run(LaneStep("run", 2, "dispatch"))
        assert "ACK" in ex.checked


def test_response_fields_make_ack_checked_sequentially_and_in_lanes(tmp_path: Path) -> None:
    path = str(taken_system(tmp_path))
    corpus = str(tmp_path / "corpus")
    code, out, _ = cli("explore", "--system", path, "--examples", "5", "--steps", "4",
                       "--seed", "0", "--quiet", "--corpus", corpus)
    assert code == 0, out
    assert checked(out, "ACK") > 0
    code, out, _ = cli("explore", "--system", path, "--concurrency", "2", "--examples", "20",
                       "--seed", "0", "--quiet", "--corpus", corpus)
    assert code in NOTHING_FOUND, out
    assert checked(out, "ACK") > 0
