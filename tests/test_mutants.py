"""The bug zoo: every mutant loads by name, and its known minimal trace catches it.

Each mutant's minimal trace is a negative/positive control pair: on the mutant it
fails an invariant the mutant names in ``caught_by``, at exactly ``minimal_steps``
executed steps (recovery dispatches included); on the reference it is clean.
"""

from __future__ import annotations

import io
import json
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from faultlab.base.errors import UsageError
from faultlab.checks.invariants import BY_NAME
from faultlab.cli import main
from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute, validate_step
from faultlab.system import System, builtin_names, load_system
from faultlab.system.builtin import registry
from faultlab.system.builtin.mutants import CHANGED, OP, PAYLOAD, Mutant
from faultlab.system.builtin.reference import REFERENCE_POINTS
from faultlab.trace import Step

NAMES = registry.names(lanes=1, fault_drawn="", postgres=False)

ISSUE_TABLE = {
    "no-dedup", "split-accept", "split-accept-outbox-first", "split-complete",
    "split-complete-outbox-first", "split-receipt", "fresh-key-on-recovery", "no-payload-check",
    "caller-overwrite", "complete-before-send", "error-completes", "idle-resend",
    "non-canonical-retry", "shared-key",
}
#: Bugs that hide in data and depth; enumerate's fixed data cannot express them.
DATA_AND_DEPTH = {
    "case-insensitive-key", "truncated-key", "lossy-numbers", "unicode-normalising",
    "utf8mb3-column", "float32-amounts", "bounded-receipts",
}


#: Sequential mutants only a history invariant catches (TERM, ORDER): before sequential
#: traces kept a history, explore and enumerate called them clean.
HISTORY = {"retry-reopens", "newest-first"}


def mutant(name: str) -> Mutant:
    system = load_system(name)
    assert isinstance(system, Mutant)
    return system


def test_the_zoo_holds_every_mutant_of_the_issue_table() -> None:
    assert set(NAMES) == ISSUE_TABLE | DATA_AND_DEPTH | HISTORY
    assert set(NAMES) <= set(builtin_names())
    # newest-first needs two operations of one title; enumerate gives each its own
    assert {name for name in NAMES if not mutant(name).enumerable} == (
        DATA_AND_DEPTH | {"newest-first"})


@pytest.mark.parametrize("name", NAMES)
def test_mutant_loads_and_describes_itself(name: str) -> None:
    system = mutant(name)
    assert system.name == name and system.ref == name
    assert system.description and "\n" not in system.description
    assert system.caught_by and set(system.caught_by) <= set(BY_NAME)
    assert system.minimal_steps >= 1 and system.minimal_trace
    # the reference's points come first, unchanged; a mutant may only add its own
    assert system.crash_points[: len(REFERENCE_POINTS)] == REFERENCE_POINTS
    assert len({p.name for p in system.crash_points}) == len(system.crash_points)


@pytest.mark.parametrize("name", NAMES)
def test_minimal_trace_catches_the_mutant_and_is_clean_on_the_reference(
    name: str, fork_spawner: Spawner, reference: System,
) -> None:
    system = mutant(name)
    found = execute(system, system.minimal_trace, fork_spawner, settle=True)
    verdict = found.verdict
    assert not verdict.clean, f"{name}: minimal trace found nothing"
    assert set(verdict.invariants) <= set(system.caught_by), verdict.describe()
    assert len(found.executed_prefix()) == system.minimal_steps

    control = execute(reference, system.minimal_trace, fork_spawner, settle=True)
    assert control.verdict.clean, control.violations


@pytest.mark.parametrize(("name", "steps", "invariant", "step"), [
    ("split-accept", [Step("accept", OP, PAYLOAD, crash="accept_between_commits")], "ATOM", 1),
    ("split-accept-outbox-first",
     [Step("accept", OP, PAYLOAD, crash="accept_between_commits")], "ATOM", 1),
    ("split-complete",
     [Step("accept", OP, PAYLOAD), Step("dispatch", crash="completion_between_commits")],
     "PAIR", 2),
    ("split-complete-outbox-first",
     [Step("accept", OP, PAYLOAD), Step("dispatch", crash="completion_between_commits")],
     "PAIR", 2),
    ("split-receipt",
     [Step("accept", OP, PAYLOAD), Step("dispatch", crash="service_between_commits")],
     "RCPT", 2),
])
def test_points_between_split_transactions_are_declared_by_the_mutant_only(
    name: str, steps: list[Step], invariant: str, step: int, fork_spawner: Spawner,
    reference: System,
) -> None:
    verdict = execute(mutant(name), steps, fork_spawner, settle=True).verdict
    assert verdict.invariants == (invariant,) and verdict.step == step
    with pytest.raises(UsageError, match="unknown crash point"):
        validate_step(reference, steps[-1])


@pytest.mark.parametrize("name", ["split-accept", "split-accept-outbox-first"])
def test_the_first_commit_of_a_split_accept_is_not_the_reference_s(
    name: str, fork_spawner: Spawner, reference: System,
) -> None:
    """commit:1 is the only acceptance commit of the reference, the first of two here."""
    crashed = [Step("accept", OP, PAYLOAD, crash="commit:1")]
    (observation,) = execute(mutant(name), crashed, fork_spawner).observations
    assert observation.record.exit_code == -9
    assert len(observation.snapshot.operations) + len(observation.snapshot.outbox) == 1
    (control,) = execute(reference, crashed, fork_spawner).observations
    assert control.record.exit_code == -9
    assert len(control.snapshot.operations) == len(control.snapshot.outbox) == 1


def test_statement_points_fire_in_mutants_in_exec_mode_too(exec_spawner: Spawner) -> None:
    system = mutant("split-complete")
    verdict = execute(system, system.minimal_trace, exec_spawner, settle=True).verdict
    assert verdict.invariants == ("PAIR",) and verdict.step == 2


def test_no_dedup_under_no_deduplication_is_the_negative_control(fork_spawner: Spawner) -> None:
    """With deduplication off RCPT does not apply; the duplicate after recovery is ONE."""
    steps = [Step("accept", OP, PAYLOAD), Step("dispatch", crash="after_downstream_commit")]
    verdicts = [
        execute(load_system(name), steps, fork_spawner, deduplication=False, settle=True).verdict
        for name in ("no-dedup", "reference")
    ]
    assert verdicts[0] == verdicts[1]
    assert verdicts[0].invariants[0] == "ONE" and verdicts[0].step == 3


def test_a_changed_service_call_is_refused_by_the_reference_but_replayed_by_no_payload_check(
    fork_spawner: Spawner, reference: System,
) -> None:
    steps = [Step("accept", OP, PAYLOAD), Step("dispatch"), Step("service", OP, CHANGED)]
    broken = execute(mutant("no-payload-check"), steps, fork_spawner).observations[-1]
    assert broken.record.exit_code == 0 and broken.record.response is not None
    assert broken.record.response["replayed"] is True
    fixed = execute(reference, steps, fork_spawner).observations[-1]
    assert fixed.record.exit_code == 3 and fixed.snapshot == fixed.before


def test_hidden_attempt_counter_is_not_in_the_snapshot(fork_spawner: Spawner) -> None:
    """fresh-key-on-recovery counts attempts in its own table; the four tables do not change."""
    system = mutant("fresh-key-on-recovery")
    execution = execute(system, [Step("accept", OP, PAYLOAD), Step("dispatch")], fork_spawner)
    assert execution.verdict.clean
    assert [t.operation_id for t in execution.observations[-1].snapshot.tickets] == [OP]


def test_systems_command_lists_the_zoo() -> None:
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["systems", "--format", "plain"]) == 0
    for name in NAMES:
        assert name in out.getvalue()
    out = io.StringIO()
    with redirect_stdout(out):
        assert main(["systems", "--system", "split-receipt", "--format", "plain"]) == 0
    assert "service_between_commits" in out.getvalue()


def test_mutants_judges_the_power_rows_by_name(capsys: pytest.CaptureFixture[str]) -> None:
    """reference-power and the power mutants are rows of ``mutants`` (an unknown --only
    lists every row it could judge)."""
    assert main(["mutants", "--only", "no-such-row"]) == 2
    refused = capsys.readouterr().err
    assert refused.count("\n") == 1
    for name in ("reference-power", "wal-normal-receiver", "sync-off-caller"):
        assert name in refused


@pytest.mark.slow
def test_mutants_catches_a_power_mutant_by_explore_power_loss(tmp_path: Path) -> None:
    output = tmp_path / "mutants.json"
    with redirect_stdout(io.StringIO()) as printed:
        code = main(["mutants", "--only", "sync-off-caller", "--corpus", str(tmp_path),
                     "--jobs", "1", "--output", str(output)])
    assert code == 0, printed.getvalue()
    (row,) = json.loads(output.read_text())["systems"]
    # enumerate --power-loss catches it too (explore --power-loss finds it shortest)
    assert row["explore_found"] and row["enumerable"] and row["enumerate_found"]
    assert row["ok"] and row["at_minimum"]
    assert row["shrunk_steps"] == 2 and set(row["explore_invariants"]) == {"ACK", "DURABLE"}
    (saved,) = tmp_path.glob("sync-off-caller-*.json")
    assert [s["action"] for s in json.loads(saved.read_text())["steps"]] == ["accept", "power"]
