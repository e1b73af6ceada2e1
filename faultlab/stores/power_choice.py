"""What a power step chooses to lose, and the rules a choice must follow.

A power step's choice (``{"kind": "prefix", "keep": 2}``) is read from a stored trace
long before anything runs, and checked then with the rules
:func:`faultlab.stores.vfs.power_image` applies when it rebuilds the files. The rules
live here, apart from the recording VFS (ctypes and all), so that a trace, and a system
whose minimal trace holds a power step, can be loaded without loading the VFS: a fork
server that loads such a system keeps its image, and every worker's fork, small.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Choice:
    """A parsed choice: its kind, the count it keeps or drops, and a torn write's sectors."""

    kind: str
    count: int = 0
    sector: int = 512
    sectors: int = 1


#: Each kind's keys, each marked required (True) or optional.
CHOICE_KEYS: dict[str, dict[str, bool]] = {
    "drop_all": {},
    "prefix": {"keep": True},
    "torn": {"keep": True, "sector": False, "sectors": False},
    "reorder": {"drop": True},
}


def parse_choice(choice: Mapping[str, Any]) -> Choice:
    """Validate a choice strictly (a typo in a stored trace must fail, not mean drop_all);
    ValueError names what is wrong."""
    if not isinstance(choice, Mapping):
        raise ValueError(f"a power choice is a mapping, not {choice!r}")
    kind = choice.get("kind")
    if not isinstance(kind, str) or kind not in CHOICE_KEYS:
        raise ValueError(f"unknown power choice kind {kind!r}: one of {sorted(CHOICE_KEYS)}")
    allowed = CHOICE_KEYS[kind]
    extra = set(choice) - set(allowed) - {"kind"}
    if extra:
        raise ValueError(f"power choice {kind!r} takes no {sorted(extra)}")
    values: dict[str, int] = {}
    for key, required in allowed.items():
        if key not in choice:
            if required:
                raise ValueError(f"power choice {kind!r} needs {key!r}")
            continue
        value = choice[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"power choice {kind!r}: {key} must be an integer >= 0, not "
                             f"{value!r}")
        values[key] = value
    if values.get("sector", 1) < 1 or values.get("sectors", 1) < 1:
        raise ValueError("power choice 'torn': sector and sectors must be >= 1")
    return Choice(kind=kind, count=values.get("keep", values.get("drop", 0)),
                  sector=values.get("sector", 512), sectors=values.get("sectors", 1))
