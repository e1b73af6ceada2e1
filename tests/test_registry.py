"""One table of built-in systems: every list faultlab shows or judges is a filter over it."""

from __future__ import annotations

import subprocess
import sys

from conftest import ROOT

from faultlab.system import (
    builtin_names,
    concurrency_mutant_names,
    is_builtin,
    load_system,
    postgres_names,
    power_mutant_names,
    server_crash_mutant_names,
)
from faultlab.system.builtin import registry


def test_every_built_in_loads_by_its_name_and_says_what_it_needs() -> None:
    for cls in registry.BUILTINS:
        assert is_builtin(cls.name)
        system = load_system(cls.name)
        assert type(system) is cls and system.ref == cls.name
    assert registry.needs(registry.BY_NAME["racy-dedup"]) == "--concurrency 2"
    assert registry.needs(registry.BY_NAME["sync-off-caller"]) == "--power-loss"
    assert registry.needs(registry.BY_NAME["async-commit-pg"]) == "--postgres private"
    assert registry.needs(registry.BY_NAME["advisory-lock-pg"]) == \
        "--postgres private --concurrency 2"
    assert registry.needs(registry.BY_NAME["reference"]) == "-"


def test_the_lists_are_disjoint_filters_that_cover_every_mutant() -> None:
    lists = {
        "sequential": builtin_names()[1:],
        "concurrency": concurrency_mutant_names(),
        "power": power_mutant_names(),
        "server crash": server_crash_mutant_names(),
    }
    judged = [name for names in lists.values() for name in names]
    assert len(judged) == len(set(judged))  # no mutant judged twice
    twins = [cls.name for cls in registry.BUILTINS if getattr(cls, "twin", None)]
    every_mutant = [cls.name for cls in registry.BUILTINS if not registry.is_reference(cls)]
    assert sorted(judged + twins) == sorted(every_mutant)
    for twin in twins:  # a PostgreSQL twin names the SQLite mutant that is judged
        assert registry.BY_NAME[twin].twin in lists["sequential"] + lists["concurrency"]
    assert builtin_names()[0] == "reference"
    assert set(postgres_names()) == {cls.name for cls in registry.BUILTINS
                                     if registry.on_postgres(cls)}
    assert lists["concurrency"][-2:] == ["advisory-lock-pg", "server-clock-lease-pg"]


def test_systems_lists_every_built_in_with_what_it_needs() -> None:
    done = subprocess.run([sys.executable, "-m", "faultlab", "systems"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split()[:4] == ["system", "crash", "points", "needs"]
    listed = [line.split()[0] for line in lines[2:]]
    assert listed == [cls.name for cls in registry.BUILTINS]
    row = next(line for line in lines if line.startswith("skip-locked "))
    assert "--concurrency 2" in row
