"""faultlab: prove that a crash, a pause or a race between two stores cannot lose or
duplicate work.

The public API is small on purpose::

    import faultlab

    found = faultlab.explore("no-dedup", examples=50, seed=0)
    print(found.clean, len(found.trace.steps))        # False 2: the shrunk finding
    print(faultlab.replay(found.trace).clean)          # False: it still fails
    print(faultlab.explore("reference", examples=20, concurrency=2).clean)   # True

    TestMyOutbox = faultlab.state_machine("my_package.outbox:SYSTEM").TestCase

A system under test implements :class:`System` (or is a command-line program
described by a JSON file); :class:`Trace` is a saved finding. Names are imported
on first use, so a worker process that imports ``faultlab`` pays for none of this.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from faultlab.base.version import __version__

if TYPE_CHECKING:
    from faultlab.api import Outcome, explore, replay, state_machine
    from faultlab.stores.vfs import record_power_loss
    from faultlab.system.contract import System
    from faultlab.trace import Trace

__all__ = [
    "Outcome",
    "System",
    "Trace",
    "__version__",
    "explore",
    "record_power_loss",
    "replay",
    "state_machine",
]

_LAZY: dict[str, str] = {
    "Outcome": "faultlab.api",
    "explore": "faultlab.api",
    "replay": "faultlab.api",
    "state_machine": "faultlab.api",
    "record_power_loss": "faultlab.stores.vfs",
    "System": "faultlab.system.contract",
    "Trace": "faultlab.trace",
}


def __getattr__(name: str) -> Any:
    """Import a public name on first use (PEP 562), keeping ``import faultlab`` cheap."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'faultlab' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})
