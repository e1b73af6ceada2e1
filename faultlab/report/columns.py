"""The replay table of a concurrent trace: one column per lane, so a reader sees who held
what when. Nothing here runs a process."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from faultlab.run.interleaving import ConcurrentExecution, LaneObservation
from faultlab.trace import LaneStep


def lane_headers(concurrency: int) -> list[str]:
    return ["#", "step", *[f"L{n}" for n in range(1, concurrency + 1)], "ended (pid exit)",
            "ops p/c", "outbox p/c", "tickets", "receipts", "violations"]


#: The widest step the table shows; a longer one is cut, its armed crash point kept.
STEP_WIDTH = 60


def shown_step(step: LaneStep) -> str:
    """The step as the table's step column shows it: a long payload is cut, the armed crash
    point (``crash=P``) always shown."""
    text = step.describe()
    if len(text) <= STEP_WIDTH:
        return text
    if step.crash is None:
        return text[:STEP_WIDTH - 3] + "..."
    armed = f"... crash={step.crash})"
    return replace(step, crash=None).describe()[:max(STEP_WIDTH - len(armed), 20)] + armed


def lane_row(observation: LaneObservation) -> list[Any]:
    counts = observation.snapshot.counts()
    step = shown_step(observation.step)
    if observation.phase != "step":
        step += " (settle)"
    ended = ", ".join(f"{record.pid} {record.exit_code}" for _, record in observation.exited)
    violations = ", ".join(sorted({v.invariant for v in observation.violations})) or "-"
    return [
        observation.index,
        step,
        *observation.lanes,
        ended or "-",
        f"{counts['operations_pending']}/{counts['operations_complete']}",
        f"{counts['outbox_pending']}/{counts['outbox_complete']}",
        counts["tickets"],
        counts["receipts"],
        violations,
    ]


def concurrent_table(execution: ConcurrentExecution, concurrency: int, fmt: str) -> str:
    from faultlab.report.tables import table

    rows = [lane_row(o) for o in execution.observations]
    if execution.final_violations:
        names = ", ".join(sorted({v.invariant for v in execution.final_violations}))
        rows.append([len(rows) + 1, "settle: final check", *["" for _ in range(concurrency)],
                     "-", "", "", "", "", names])
    return table(rows, lane_headers(concurrency), fmt)


def concurrent_violation_lines(execution: ConcurrentExecution) -> list[str]:
    lines = []
    for observation in execution.observations:
        lines += [f"  step {observation.index}: {v}" for v in observation.violations]
    lines += [f"  final: {v}" for v in execution.final_violations]
    return lines
