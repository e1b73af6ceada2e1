"""Python systems (``--system package.module:attribute``) and the example in examples/python_system.

The example is imported by its dotted name from the repository root, in this
process, in the fork server and in exec-mode workers.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from faultlab.base.errors import UsageError
from faultlab.process.spawn import Spawner, child_environment
from faultlab.run.executor import execute
from faultlab.system import System, load_system
from faultlab.trace import Step
from faultlab.trials.scenarios import SCENARIOS

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # examples/ is importable from the repository root
    sys.path.append(str(ROOT))

EXAMPLE = "examples.python_system.my_outbox:SYSTEM"


def faultlab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        env=child_environment(), timeout=120, check=False, cwd=ROOT,
    )


def test_example_passes_the_five_scenarios_in_fork_mode(fork_spawner: Spawner) -> None:
    system = load_system(EXAMPLE)
    assert system.name == "ledger"
    assert system.ref == EXAMPLE
    for scenario in SCENARIOS:
        outcome = scenario.run(system, fork_spawner)
        assert outcome.passed, (scenario.name, outcome.failures)


def test_example_crash_points_in_exec_mode(exec_spawner: Spawner) -> None:
    system = load_system(EXAMPLE)
    steps = [
        Step("accept", "a", {"n": 1}, crash="during_accept"),
        Step("accept", "a", {"n": 1}),
        Step("dispatch", crash="service_after_commit"),
        Step("dispatch", crash="after_downstream_commit"),
    ]
    execution = execute(system, steps, exec_spawner, settle=True)
    assert execution.verdict.clean, execution.violations
    first, _, service_crash, dispatch_crash = execution.observations[:4]
    assert first.record.exit_code == -9
    assert service_crash.record.exit_code == 4
    assert service_crash.crashed and dispatch_crash.crashed
    final = execution.observations[-1].snapshot
    assert [(o.id, o.state) for o in final.operations] == [("a", "complete")]
    assert len(final.tickets) == 1


def test_suite_cli_with_the_python_example() -> None:
    result = faultlab("suite", "--system", EXAMPLE, "--examples", "0")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[-1].startswith("PASS: 5 scenarios")


def test_systems_cli_lists_its_crash_points() -> None:
    result = faultlab("systems", "--system", EXAMPLE, "--format", "plain")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("ledger: ")
    for point in ("during_accept", "before_dispatch", "after_downstream_commit",
                  "service_after_commit"):
        assert point in result.stdout


# --- a clear error when the object does not satisfy the contract --------------------------------

MODULE = '''
from pathlib import Path
from typing import Any
from faultlab.system import CrashPoint, System

class Incomplete(System):
    def initialise(self, directory: Path) -> None: ...
    def snapshot(self, directory: Path) -> Any: ...

class NotASystem:
    def accept(self) -> None: ...

class Complete(Incomplete):
    def accept(self, context: Any, operation_id: str, payload: str) -> Any: ...
    def dispatch(self, context: Any) -> Any: ...
    def service(self, context: Any, operation_id: str, payload: str) -> Any: ...

class BadRole(Complete):
    crash_points = (CrashPoint("x", "caller", ""),)  # type: ignore[arg-type]

class Twice(Complete):
    crash_points = (CrashPoint("x", "accept", ""), CrashPoint("x", "dispatch", ""))

class NeedsArgument(Complete):
    def __init__(self, setting: str) -> None: ...

INSTANCE = Complete()
NUMBER = 3
'''


@pytest.fixture
def module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
           request: pytest.FixtureRequest) -> str:
    name = f"user_systems_{request.node.name.replace('[', '_').replace(']', '').replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


@pytest.mark.parametrize(("attribute", "words"), [
    ("Incomplete", ["Incomplete does not implement accept, dispatch, service"]),
    ("NotASystem", ["class NotASystem does not subclass faultlab.system.System"]),
    ("NUMBER", ["int is not a faultlab.system.System",
                "lacks initialise, accept, dispatch, service, snapshot"]),
    ("BadRole", ["crash point 'x' has unknown role 'caller'"]),
    ("Twice", ["declared twice"]),
    ("NeedsArgument", ["cannot instantiate NeedsArgument"]),
    ("Missing", ["has no attribute 'Missing'"]),
])
def test_contract_violations_are_named(module: str, attribute: str, words: list[str]) -> None:
    with pytest.raises(UsageError) as raised:
        load_system(f"{module}:{attribute}")
    for word in words:
        assert word in str(raised.value)


def test_a_class_or_an_instance_is_accepted(module: str) -> None:
    from_class = load_system(f"{module}:Complete")
    from_instance = load_system(f"{module}:INSTANCE")
    assert isinstance(from_class, System) and isinstance(from_instance, System)
    assert from_class.name == "Complete"  # no name given: the attribute's


def test_import_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(UsageError, match="cannot import no_such_module_xyz"):
        load_system("no_such_module_xyz:SYSTEM")
    (tmp_path / "exploding_system_module.py").write_text("raise RuntimeError('boom')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(UsageError, match="importing exploding_system_module failed: "
                                         "RuntimeError: boom"):
        load_system("exploding_system_module:SYSTEM")
    with pytest.raises(UsageError, match="expected package.module:attribute"):
        load_system("module_only:")


def test_cli_refuses_a_missing_python_system_in_one_line() -> None:
    result = faultlab("suite", "--system", "examples.python_system.my_outbox:NOPE",
                      "--examples", "0")
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1
    assert "has no attribute 'NOPE'" in result.stderr
