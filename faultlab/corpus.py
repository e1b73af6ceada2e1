"""The corpus: one JSON trace per finding, replayable without Hypothesis."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

from faultlab.errors import UsageError
from faultlab.trace import Trace, write_json_atomically

if TYPE_CHECKING:
    from faultlab.concurrent_trace import ConcurrentTrace

DEFAULT_CORPUS = Path("corpus")


def check_corpus_directory(path: Path) -> None:
    """Refuse a corpus path that exists but is not a directory (before running anything)."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"--corpus {path}: exists and is not a directory")
    parent = path
    while not parent.exists():
        parent = parent.parent if parent.parent != parent else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--corpus {path}: {parent} is not a directory")


def finding_name(trace: Trace | ConcurrentTrace, system_name: str | None = None) -> str:
    """``<system>-<INVARIANT>-<hash>.json``; the hash makes equal findings one file."""
    steps = json.dumps([s.to_json() for s in trace.steps], sort_keys=True)
    digest = hashlib.sha256(
        f"{trace.system}|{trace.deduplication}|{steps}".encode()
    ).hexdigest()[:10]
    expected = trace.expected
    invariant = expected.invariants[0] if expected and expected.invariants else "clean"
    base = system_name or trace.system.rsplit("/", 1)[-1]
    system = "".join(c if c.isalnum() or c in "-_" else "_" for c in base)
    suffix = "" if trace.deduplication else "-nodedup"
    return f"{system}{suffix}-{invariant}-{digest}.json"


def save(trace: Trace | ConcurrentTrace, directory: Path, system_name: str | None = None) -> Path:
    """Write the trace into the corpus directory (created if needed), atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / finding_name(trace, system_name)
    write_json_atomically(path, trace.to_json())
    return path

