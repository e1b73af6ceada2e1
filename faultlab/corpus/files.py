"""The corpus: one JSON trace per finding, replayable without Hypothesis."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from faultlab.base.errors import ExecutionError
from faultlab.base.output import check_output_directory, write_json
from faultlab.trace import Trace

if TYPE_CHECKING:
    from faultlab.trace import ConcurrentTrace

DEFAULT_CORPUS = Path("corpus")


def check_corpus_directory(path: Path) -> None:
    """Refuse a corpus path faultlab could not save into, before running anything."""
    check_output_directory(path, "--corpus")


def finding_name(trace: Trace | ConcurrentTrace, system_name: str | None = None) -> str:
    """``<system>-<INVARIANT>-<hash>.json``; the hash makes equal findings one file."""
    steps = json.dumps([s.to_json() for s in trace.steps], sort_keys=True)
    # the same steps held at every statement are another trace (absent: names as before)
    held = "|statement_points" if getattr(trace, "statement_points", False) else ""
    digest = hashlib.sha256(
        f"{trace.system}|{trace.deduplication}|{steps}{held}".encode()
    ).hexdigest()[:10]
    expected = trace.expected
    invariant = expected.invariants[0] if expected and expected.invariants else "clean"
    base = system_name or trace.system.rsplit("/", 1)[-1]
    system = "".join(c if c.isalnum() or c in "-_" else "_" for c in base)
    suffix = "" if trace.deduplication else "-nodedup"
    return f"{system}{suffix}-{invariant}-{digest}.json"


def save(trace: Trace | ConcurrentTrace, directory: Path, system_name: str | None = None) -> Path:
    """Write the trace into the corpus directory (created if needed), atomically.

    Saving is the run's commit point (:func:`faultlab.base.output.write_text` with ``final``):
    a signal before the rename leaves neither the file nor a directory made for it.
    """
    missing = []
    parent = directory
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    path = directory / finding_name(trace, system_name)
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ExecutionError(f"cannot create {directory}: {error.strerror or error}") from None
        write_json(path, trace.to_json(), final=True)
    except BaseException:
        for made in missing:  # innermost first; only directories this call created
            try:
                made.rmdir()
            except OSError:
                break
        raise
    return path
