"""Replaying a saved trace, of either format version: what ``replay``, the pytest plugin and
the tests all do with a corpus file.

A trace is checked against its system before anything runs (:func:`plan`), then
executed on fresh stores by the one executor (:func:`replay`,
:func:`faultlab.run.executor.execute_trace`): one worker at a time for version 1,
through the lanes for version 2. The outcome
carries its table and verdict line, so every caller prints the same thing.

Which system a trace runs on is :func:`faultlab.corpus.trust.system_for`. How it
is judged depends on what the file says it is:

* ``"expect": "finding"`` (the zoo's traces, the negative control's): the finding
  is there on purpose; the replay passes when it shows the recorded verdict.
* no ``expect`` (what ``explore`` saves for the reference or a user's system): a
  regression test, as a saved Hypothesis example or a pytest test is. It fails
  while its finding (or any other) still shows and passes once the bug is fixed,
  when it replays clean.
* ``"expect": "flaky"`` (what ``explore`` keeps beside the corpus when a failure did not
  fail again): never a regression test, since a clean replay says nothing was fixed. A
  clean replay is flaky again (``replay`` exits 5), a failing one differs (exit 1: it
  failed again).
* ``replay --against``: another system than recorded; it passes when clean.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from faultlab.base.errors import UsageError
from faultlab.process.spawn import Spawner
from faultlab.report import tables as report
from faultlab.run.executor import execute_trace, validate_step
from faultlab.run.faults import check_power_cut
from faultlab.run.observation import Execution
from faultlab.system.contract import System, check_crash_point
from faultlab.trace import EXPECT_FINDING, EXPECT_FLAKY, POWER, SERVER_CRASH, Trace, Verdict

#: The line a failing regression replay ends with: what to do about it.
STILL_FAILS = "still fails: fix the bug, then replay again; it passes once fixed"


@dataclass(frozen=True)
class Plan:
    """One trace file, its trace and the system it will run on (checked)."""

    path: Path
    trace: Trace
    system: System
    against: bool = False  # replayed on another system than recorded: expect clean


def plan(path: Path, trace: Trace, system: System, *,
         against: bool = False) -> Plan:
    """Refuse, before anything runs, a trace its system cannot run (one line naming the file)."""
    try:
        system.require_deduplication_switch(trace.deduplication)
        if not trace.laned:
            for step in trace.steps:
                validate_step(system, step)
        else:
            if trace.statement_points:
                system.require_statement_points()
            started: set[int] = set()
            for step in trace.steps:  # a crash point the step's role cannot arm
                check_crash_point(system, step.role or "", step.crash)
                if step.action == POWER:
                    check_power_cut(system)
                # a lane's worker may end by itself, so whether a lane is busy or paused
                # shows only as the trace runs; a lane no step ever started is certain
                if step.action in ("tick", SERVER_CRASH, POWER):
                    continue  # names no lane
                if step.starts:
                    started.add(step.lane or 0)
                elif (step.lane or 0) not in started:
                    raise UsageError(f"{step.describe()}: lane {step.lane} never started a "
                                     "worker")
    except UsageError as error:
        raise UsageError(f"{path}: {error}") from None
    return Plan(Path(path), trace, system, against)


@dataclass(frozen=True)
class Replayed:
    """What one replay showed, and whether it matches what was expected."""

    plan: Plan
    verdict: Verdict
    expected_text: str
    matches: bool
    table: str
    violation_lines: list[str]
    execution: Execution | None  # what ran (a page is drawn from it)
    regression: bool = False  # a regression test of a recorded finding (no "expect")
    flaky: bool = False  # a flaky outcome's kept trace ("expect": "flaky")

    @property
    def still_fails(self) -> bool:
        """A regression test whose bug is still there."""
        return self.regression and not self.matches

    @property
    def status(self) -> str:
        if self.flaky:
            return "flaky: did not fail again" if self.matches else "FAILED AGAIN"
        if self.matches:
            return "matches"
        return "STILL FAILS" if self.still_fails else "DIFFERS"

    def lines(self) -> list[str]:
        """The header, the table, the violations and the verdict line, as ``replay`` prints
        (and, for a regression test that still fails, what to do about it)."""
        trace, system = self.plan.trace, self.plan.system
        header = f"{self.plan.path}: {system.ref}" + (
            "" if trace.deduplication else " (deduplication off)")
        advice = [f"{self.plan.path}: {STILL_FAILS}"] if self.still_fails else []
        return [header, self.table, *self.violation_lines,
                f"verdict: {self.verdict.describe()}; expected {self.expected_text}: "
                f"{self.status}", *advice]


def replay(planned: Plan, runner: Spawner, *, deadline: float, fmt: str = "simple") -> Replayed:
    """Execute one planned trace on fresh stores and judge it."""
    trace, system = planned.trace, planned.system
    try:
        execution = execute_trace(system, trace, runner, deadline=deadline)
    except UsageError as error:  # a step the lanes' states refuse once the trace runs
        raise UsageError(f"{planned.path}: {error}") from None
    verdict = execution.verdict
    table = report.replay_table(execution, fmt)
    # a worker's undeclared error, with its stderr: why the checks after it failed
    violations = [*report.violation_lines(execution), *report.worker_error_lines(execution)]
    regression = flaky = False
    if planned.against:
        expected_text = f"clean (replayed --against {system.ref})"
        matches = verdict.clean
    elif trace.expect == EXPECT_FLAKY:
        flaky = True
        recorded = trace.expected.describe() if trace.expected else "a failure"
        expected_text = (f"nothing to judge (a flaky trace: {recorded} when explored, not "
                         "again when re-run; kept for inspection, not a regression test)")
        matches = verdict.clean
    elif trace.expect == EXPECT_FINDING or trace.expected is None or trace.expected.clean:
        expected = trace.expected if trace.expected is not None else Verdict()
        expected_text = expected.describe() if trace.expected else "clean (nothing recorded)"
        matches = verdict == expected
    else:  # a recorded finding, not expected on purpose: a regression test
        regression = True
        expected_text = f"clean once fixed (a regression test of {trace.expected.describe()})"
        matches = verdict.clean
    return Replayed(planned, verdict, expected_text, matches, table, violations, execution,
                    regression, flaky)
