"""Small things a report said badly: missing help texts, a system named by its path, a null
PID shown as a list ending in None, "a accept step", a refusal reported with "no message",
and the pytest plugin's help naming the lower-level outbox_machine.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.process.spawn import Spawner, child_environment
from faultlab.run.executor import execute
from faultlab.system import load_system
from faultlab.trace import Step

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parent.parent


def _subcommand(name: str) -> argparse.ArgumentParser:
    from faultlab.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = commands.choices[name]
    return found


@pytest.mark.parametrize(("command", "argument"), [
    ("systems", "--system"), ("worker", "--directory"), ("worker", "--operation-id"),
    ("worker", "--payload"), ("replay", "traces"),
])
def test_every_argument_has_help(command: str, argument: str) -> None:
    action = next(a for a in _subcommand(command)._actions
                  if argument in a.option_strings or a.dest == argument)
    assert action.help and len(action.help) > 20, (command, argument)


def test_a_system_is_named_by_its_name_then_where_it_came_from() -> None:
    from faultlab.cli.explore import system_label

    path = str(ROOT / "examples" / "standalone_outbox" / "system.json")
    assert system_label(load_system(path)) == f"standalone-outbox ({path})"
    assert system_label(load_system("reference")) == "reference"


def test_a_null_service_pid_names_the_missing_field(fork_spawner: Spawner) -> None:
    from faultlab.trials.scenarios import SCENARIOS

    scenario = next(s for s in SCENARIOS if s.name == "crash_before_dispatch")
    outcome = scenario.run(load_system("systems_for_tests:NullServicePidOutbox"), fork_spawner)
    assert ("the recovering dispatcher's response has no service_pid (holds null there, not "
            "a PID; response_fields: service_pid)") in outcome.failures
    assert not any("None]" in failure for failure in outcome.failures)


def test_an_unknown_crash_point_of_an_accept_step_reads_an_accept_step() -> None:
    from faultlab.system.contract import check_crash_point

    with pytest.raises(UsageError, match="for an accept step of system 'reference'"):
        check_crash_point(load_system("reference"), "accept", "no_such_point")
    with pytest.raises(UsageError, match="for a dispatch step of system 'reference'"):
        check_crash_point(load_system("reference"), "dispatch", "no_such_point")


def test_a_worker_exiting_2_with_a_json_error_shows_that_error(fork_spawner: Spawner) -> None:
    with pytest.raises(ExecutionError) as raised:
        execute(load_system("systems_for_tests:RefusingOutbox"), [Step("accept", "op-1", {})],
                fork_spawner)
    message = str(raised.value)
    assert 'refused its input (exit 2): error "unsupported_payload" {"operation_id": "op-1"}' \
        in message, message
    assert "no message" not in message


def test_the_plugin_help_names_faultlab_state_machine(pytester: pytest.Pytester,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", child_environment()["PYTHONPATH"])
    from importlib import metadata

    installed = any(ep.value == "faultlab.pytest_plugin"
                    for ep in metadata.entry_points(group="pytest11"))
    result = pytester.runpytest_subprocess(
        *([] if installed else ["-p", "faultlab.pytest_plugin"]), "--help")
    text = " ".join(result.stdout.str().split())
    start = text.index("--faultlab-examples")
    shown = text[start:text.index("--faultlab-seed", start)]
    assert "faultlab.state_machine(...).TestCase" in shown and "outbox_machine" not in shown
