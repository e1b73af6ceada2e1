"""The one replay table: a one-lane trace's columns (action, operation, crash, pid, exit), a
column per lane when a trace has lanes, and the final check's row aligned under both."""

from __future__ import annotations

from faultlab.checks.invariants import Violation
from faultlab.process.spawn import Spawner
from faultlab.report.tables import replay_table, violation_lines
from faultlab.run.executor import execute
from faultlab.system import load_system
from faultlab.trace import Step

P = {"amount": 1}


def _rows(text: str) -> list[list[str]]:
    return [[cell.strip() for cell in line.split("\t")] for line in text.splitlines()]


def test_a_one_lane_trace_shows_each_workers_pid_and_exit() -> None:
    steps = [Step("accept", "op-1", P), Step("dispatch", crash="after_downstream_commit")]
    execution = execute(load_system("reference"), steps, Spawner("fork"), settle=True)
    rows = _rows(replay_table(execution, "tsv"))
    assert rows[0] == ["#", "action", "operation", "crash", "pid", "exit", "ops p/c",
                       "outbox p/c", "tickets", "receipts", "violations"]
    killed = rows[2]
    assert killed[1:4] == ["dispatch", "-", "after_downstream_commit"]
    assert int(killed[4]) == execution.observations[1].record.pid and killed[5] == "-9"
    assert rows[-1][1] == "dispatch (settle)" and rows[-1][-1] == "-"
    assert violation_lines(execution) == []


def test_a_final_check_row_is_aligned_under_both_layouts() -> None:
    """The row of a violation found after recovery (LIVE, added to a real execution) has
    as many cells as the header, with a column per lane or without."""
    steps = [Step("accept", "op-1", P), Step("dispatch", crash="after_downstream_commit")]
    sequential = execute(load_system("reference"), steps, Spawner("fork"), settle=False)
    sequential.final_violations.append(_live())
    rows = _rows(replay_table(sequential, "tsv"))
    assert len(rows[-1]) == len(rows[0]) and rows[-1][1] == "settle: final check"
    assert rows[-1][-1] == "LIVE"
    lanes = execute(load_system("reference"), [Step("accept", "op-1", P, lane=1),
                                               Step("dispatch", lane=2, hold=True)],
                    concurrency=2, settle=False)
    lanes.final_violations.append(_live())
    rows = _rows(replay_table(lanes, "tsv"))
    assert rows[0][:5] == ["#", "step", "L1", "L2", "ended (pid exit)"]
    assert len(rows[-1]) == len(rows[0]) and rows[-1][-1] == "LIVE"
    assert violation_lines(lanes)[-1].startswith("  final: LIVE")


def _live() -> Violation:
    return Violation("LIVE", "operation op-1 is still pending after recovery")
