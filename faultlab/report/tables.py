"""Tables (tabulate), the one replay table (a column per lane when a trace has lanes) and the
evidence JSON; nothing here runs a process."""

from __future__ import annotations

import json
import platform
import re
import signal
import sqlite3
import sys
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import Any

from tabulate import tabulate

from faultlab.base.messages import printable
from faultlab.base.output import Kind
from faultlab.base.version import __version__
from faultlab.checks.invariants import Violation
from faultlab.process.records import KILLED, ProcessRecord
from faultlab.run.observation import Execution, Observation
from faultlab.search.coverage import Coverage
from faultlab.stores.sqlite import Snapshot
from faultlab.system.contract import System
from faultlab.trace import Step
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


#: The evidence file's first key and value: what marks it as faultlab's own.
EXPERIMENT = "two-store outbox crash recovery (faultlab suite)"
#: What ``suite --output`` writes, and so the only file it replaces.
EVIDENCE = Kind("a faultlab suite evidence file", (
    re.compile(rb'\s*\{\s*"experiment"\s*:\s*' + re.escape(json.dumps(EXPERIMENT).encode())),
))


def evidence(outcomes: Sequence[Outcome], *, spawn: str, seconds: float) -> dict[str, Any]:
    """The seed's results.json keys, plus faultlab's version, spawn mode and timings; the
    first, ``experiment``, is what :data:`EVIDENCE` recognises."""
    return {
        "experiment": EXPERIMENT,
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


#: The replay table's columns after its step columns: what the step left in the stores.
STORE_HEADERS = ["ops p/c", "outbox p/c", "tickets", "receipts", "violations"]
#: A one-lane trace's step columns: the step, the worker that ran it and how it ended.
STEP_HEADERS = ["#", "action", "operation", "crash", "pid", "exit"]
#: The widest step the table shows; a longer one is cut, its armed crash point kept.
STEP_WIDTH = 60


def _store_cells(snapshot: Snapshot, violations: Sequence[Violation]) -> list[Any]:
    counts = snapshot.counts()
    return [
        f"{counts['operations_pending']}/{counts['operations_complete']}",
        f"{counts['outbox_pending']}/{counts['outbox_complete']}",
        counts["tickets"],
        counts["receipts"],
        ", ".join(sorted({v.invariant for v in violations})) or "-",
    ]


def observation_row(observation: Observation) -> list[Any]:
    """A one-lane step: its action (and payload), operation, armed point, worker and exit."""
    step = observation.step
    action = step.action if observation.phase == "step" else f"{step.action} (settle)"
    if step.action != "dispatch" and step.payload is not None:
        action += f" {json.dumps(step.payload, sort_keys=True, separators=(',', ':'))}"
    operation = step.operation_id or (observation.record.response or {}).get("operation_id") or "-"
    return [
        observation.index,
        action if len(action) <= STEP_WIDTH else action[:STEP_WIDTH - 3] + "...",
        operation,
        step.crash or "-",
        # a power cut or a server crash runs no worker: no pid 0 that looks like one
        observation.record.pid if observation.record.pid else "-",
        observation.record.exit_code if observation.record.pid else "-",
        *_store_cells(observation.snapshot, observation.violations),
    ]


def shown_step(step: Step) -> str:
    """A scheduling choice as the step column shows it: a long payload is cut, the armed
    crash point (``crash=P``) always shown."""
    text = step.describe()
    if len(text) <= STEP_WIDTH:
        return text
    if step.crash is None:
        return text[:STEP_WIDTH - 3] + "..."
    armed = f"... crash={step.crash})"
    return replace(step, crash=None).describe()[:max(STEP_WIDTH - len(armed), 20)] + armed


def lane_row(observation: Observation) -> list[Any]:
    """A scheduling choice: the choice, each lane's state after it, the workers it ended."""
    step = shown_step(observation.step)
    if observation.phase != "step":
        step += " (settle)"
    ended = ", ".join(f"{record.pid} {record.exit_code}" for _, record in observation.exited)
    return [observation.index, step, *observation.lanes, ended or "-",
            *_store_cells(observation.snapshot, observation.violations)]


def replay_table(execution: Execution, fmt: str) -> str:
    """The replay table every command prints for an executed trace: a row per step and the
    stores after it; a trace with lanes adds a column per lane (who holds what when) and
    shows the workers each scheduling choice ended in place of one worker's pid and exit."""
    rows: list[list[Any]]
    if execution.lanes:
        lanes = execution.lanes
        headers = ["#", "step", *[f"L{n}" for n in range(1, lanes + 1)], "ended (pid exit)",
                   *STORE_HEADERS]
        rows = [lane_row(o) for o in execution.observations]
        blank = [*["" for _ in range(lanes)], "-"]
    else:
        headers = [*STEP_HEADERS, *STORE_HEADERS]
        rows = [observation_row(o) for o in execution.observations]
        blank = ["-", "-", "-", "-"]
    if execution.final_violations:
        names = ", ".join(sorted({v.invariant for v in execution.final_violations}))
        rows.append([len(rows) + 1, "settle: final check", *blank, "", "", "", "", names])
    return table(rows, headers, fmt)


def violation_lines(execution: Execution) -> list[str]:
    """Every violation, by the step that showed it (``final`` for the check after recovery)."""
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


def worker_error_lines(execution: Execution) -> list[str]:
    """``step N: the ROLE worker (pid P) failed with exit E; its stderr:`` and the stderr,
    for the first unexpected worker error of ``execution`` (none: no lines). In a concurrent
    execution the first such worker of any lane, at the scheduling step it ended in."""
    if execution.lanes:
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
                   faults: Collection[str] = (), *, lanes: bool = False) -> None:
    """Which crash points fired and which invariants had something to check, in steps
    (those of a fault, e.g. ``power``, only when the run drew it; the history invariants
    that read announced claims only when it had ``lanes``)."""
    print(table(coverage.crash_rows(system), ["crash point", "armed", "fired"], fmt))
    print()
    print(table(coverage.invariant_rows(faults, lanes=lanes),
                ["invariant", "steps that checked it non-vacuously"], fmt))
