"""Tables (tabulate) and the evidence JSON; nothing here runs a process."""

from __future__ import annotations

import json
import platform
import signal
import sqlite3
import sys
from collections.abc import Collection, Sequence
from typing import Any

from tabulate import tabulate

from faultlab.base.messages import printable
from faultlab.base.version import __version__
from faultlab.process.records import KILLED, ProcessRecord
from faultlab.run.executor import Execution, Observation
from faultlab.run.interleaving import ConcurrentExecution
from faultlab.search.coverage import Coverage
from faultlab.system.contract import System
from faultlab.trials.scenarios import Outcome

PASS_LINE = "PASS: 5 scenarios; real SIGKILL, separate caller and downstream stores"


def table(rows: Sequence[Sequence[Any]], headers: Sequence[str], fmt: str) -> str:
    return str(tabulate(rows, headers=headers, tablefmt=fmt))


def scenario_table(outcomes: Sequence[Outcome], fmt: str) -> str:
    rows = []
    for outcome in outcomes:
        summary = outcome.summary
        observations = outcome.execution.observations
        tickets_before = summary.get("tickets_before", summary.get("partial_operations", "-"))
        if outcome.name == "changed_payload_rejected":
            tickets_before = len(observations[-1].before.tickets)
        result = (observations[-1].record.response or {})
        recovered = next(
            (o.record.response for o in reversed(observations)
             if (o.record.response or {}).get("result") is not None), None,
        )
        shown = result.get("error") or json.dumps((recovered or {}).get("result"))
        rows.append([
            outcome.name,
            outcome.crash_point,
            summary.get("crash_exit", summary.get("exit_code")),
            tickets_before,
            summary["tickets_after"],
            shown,
            outcome.verdict,
        ])
    headers = ["scenario", "crash point", "exit", "tickets before", "tickets after", "result",
               "verdict"]
    return table(rows, headers, fmt)


def summary_lines(outcomes: Sequence[Outcome]) -> list[str]:
    return [f"{o.name} {json.dumps(o.summary, sort_keys=False)}" for o in outcomes]


def environment() -> dict[str, Any]:
    """``signal`` and ``platform`` as the original results format wrote them (anything
    that read its results file reads ours); faultlab's richer values under keys of their own."""
    return {
        "python": sys.version.split()[0],
        "sqlite": sqlite3.sqlite_version,
        "platform": platform.system(),
        "signal": "SIGKILL",
        "platform_detail": platform.platform(),
        "signal_number": int(signal.SIGKILL),
    }


def evidence(outcomes: Sequence[Outcome], *, spawn: str, seconds: float) -> dict[str, Any]:
    """The seed's results.json keys, plus faultlab's version, spawn mode and timings."""
    return {
        "experiment": "two-store outbox crash recovery (faultlab suite)",
        **environment(),
        "faultlab": __version__,
        "spawn": spawn,
        "passed": all(o.passed for o in outcomes),
        "scenarios": {
            o.name: {
                "passed": o.passed,
                "failures": o.failures,
                **({"unknown": o.unknowns} if o.unknowns else {}),
                **o.evidence,
                "summary": o.summary,
                "seconds": round(o.seconds, 4),
            }
            for o in outcomes
        },
        "timings": {"total_seconds": round(seconds, 4),
                    **{o.name: round(o.seconds, 4) for o in outcomes}},
    }


REPLAY_HEADERS = [
    "#", "action", "operation", "crash", "pid", "exit", "ops p/c", "outbox p/c", "tickets",
    "receipts", "violations",
]


def observation_row(observation: Observation) -> list[Any]:
    step = observation.step
    counts = observation.snapshot.counts()
    action = step.action if observation.phase == "step" else f"{step.action} (settle)"
    if step.action != "dispatch" and step.payload is not None:
        action += f" {json.dumps(step.payload, sort_keys=True, separators=(',', ':'))}"
    violations = ", ".join(sorted({v.invariant for v in observation.violations})) or "-"
    operation = step.operation_id or (observation.record.response or {}).get("operation_id") or "-"
    return [
        observation.index,
        action if len(action) <= 60 else action[:57] + "...",
        operation,
        step.crash or "-",
        observation.record.pid,
        observation.record.exit_code,
        f"{counts['operations_pending']}/{counts['operations_complete']}",
        f"{counts['outbox_pending']}/{counts['outbox_complete']}",
        counts["tickets"],
        counts["receipts"],
        violations,
    ]


def execution_table(execution: Execution, fmt: str) -> str:
    rows = [observation_row(o) for o in execution.observations]
    if execution.final_violations:
        names = ", ".join(sorted({v.invariant for v in execution.final_violations}))
        rows.append([len(rows) + 1, "settle: final check", "-", "-", "-", "-", "", "", "", "",
                     names])
    return table(rows, REPLAY_HEADERS, fmt)


def violation_lines(execution: Execution) -> list[str]:
    lines = []
    for observation in execution.observations:
        lines += [f"  step {observation.index}: {v}" for v in observation.violations]
    lines += [f"  final: {v}" for v in execution.final_violations]
    return lines


#: How much of a failed worker's stderr is shown: the end of a traceback says what broke.
WORKER_STDERR_LINES = 20
WORKER_STDERR_WIDTH = 200


def unexpected_exit(record: ProcessRecord) -> bool:
    """Whether a worker ended with an error nobody declared: a non-zero exit that is neither
    faultlab's SIGKILL, nor the deadline's, nor a refusal the worker printed as
    ``{"error": ...}`` (a payload conflict exits 3 on purpose)."""
    if record.exit_code in (0, KILLED) or record.timed_out:
        return False
    response = record.response
    return not (isinstance(response, dict) and "error" in response)


def worker_error(execution: Execution) -> Observation | None:
    """The first step whose worker died with an unexpected error (a traceback, a store
    error), or None. Every check after it fails for the same reason, so a report shows
    this one cause, with what the worker printed on stderr, before anything else."""
    return next((o for o in execution.observations if unexpected_exit(o.record)), None)


def worker_stderr(record: ProcessRecord, indent: str = "    ") -> list[str]:
    """The worker's stderr, its last :data:`WORKER_STDERR_LINES` lines, each escaped
    (a user's program may print control characters) and cut to a terminal's width."""
    lines = record.stderr.rstrip("\n").splitlines()
    if not lines:
        return [f"{indent}(nothing on stderr)"]
    shown = lines[-WORKER_STDERR_LINES:]
    cut = [f"{indent}... ({len(lines) - len(shown)} earlier lines)"] if len(shown) < len(lines) \
        else []
    return cut + [f"{indent}{printable(line, WORKER_STDERR_WIDTH)}" for line in shown]


def worker_error_lines(execution: Execution | ConcurrentExecution) -> list[str]:
    """``step N: the ROLE worker (pid P) failed with exit E; its stderr:`` and the stderr,
    for the first unexpected worker error of ``execution`` (none: no lines). In a concurrent
    execution the first such worker of any lane, at the scheduling step it ended in."""
    if isinstance(execution, ConcurrentExecution):
        for lane_step in execution.observations:
            for _, record in lane_step.exited:
                if unexpected_exit(record):
                    return [f"  step {lane_step.index} ({lane_step.step.describe()}): a worker "
                            f"(pid {record.pid}) failed with exit {record.exit_code}; its "
                            "stderr:",
                            *worker_stderr(record, "    ")]
        return []
    observation = worker_error(execution)
    if observation is None:
        return []
    record = observation.record
    return [f"  step {observation.index}: the {observation.step.action} worker (pid "
            f"{record.pid}) failed with exit {record.exit_code}; its stderr:",
            *worker_stderr(record, "    ")]


def print_coverage(coverage: Coverage, system: System, fmt: str,
                   faults: Collection[str] = (), *, history: bool = False) -> None:
    """Which crash points fired and which invariants had something to check, in steps
    (those of a fault, e.g. ``power``, only when the run drew it; the history invariants
    only when it had lanes, ``history``)."""
    print(table(coverage.crash_rows(system), ["crash point", "armed", "fired"], fmt))
    print()
    print(table(coverage.invariant_rows(faults, history=history),
                ["invariant", "steps that checked it non-vacuously"], fmt))
