"""The corpus: one JSON trace per finding, replayable without Hypothesis."""

from __future__ import annotations

import hashlib
import json
import os
import shlex
from pathlib import Path

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.base.output import check_output_directory, write_json
from faultlab.trace import EXPECT_FINDING, Trace, is_trace_file, trace_file

DEFAULT_CORPUS = Path("corpus")


def check_corpus_directory(path: Path) -> None:
    """Refuse a corpus path faultlab could not save into, before running anything. A
    missing corpus directory is created when its first finding is saved, but only inside
    a directory that exists: a mistyped path is an error, not a new tree of directories."""
    if not os.path.lexists(path):
        parent = Path(os.path.dirname(os.path.abspath(path)))
        if not os.path.lexists(parent):  # one that is not a directory is named below
            raise UsageError(f"--corpus {path}: parent directory {parent} does not exist")
    check_output_directory(path, "--corpus")


def finding_name(trace: Trace, system_name: str | None = None) -> str:
    """``<system>-<INVARIANT>-<hash>.json``; the hash makes equal findings one file."""
    steps = json.dumps(trace.to_json()["steps"], sort_keys=True)  # as the file holds them
    # the same steps held at every statement are another trace (absent: names as before)
    held = "|statement_points" if trace.statement_points else ""
    digest = hashlib.sha256(
        f"{trace.system}|{trace.deduplication}|{steps}{held}".encode()
    ).hexdigest()[:10]
    expected = trace.expected
    invariant = expected.invariants[0] if expected and expected.invariants else "clean"
    base = system_name or trace.system.rsplit("/", 1)[-1]
    system = "".join(c if c.isalnum() or c in "-_" else "_" for c in base)
    suffix = "" if trace.deduplication else "-nodedup"
    return f"{system}{suffix}-{invariant}-{digest}.json"


def finding_on_purpose(trace: Trace) -> bool:
    """True when the trace's finding is there by design, not a bug to fix: it ran on a
    built-in mutant of the zoo, or with deduplication off (the negative control).

    The mark follows from what the trace ran on, never from the command that saved it, so
    ``mutants`` and ``explore --system MUTANT`` write the same finding as the same bytes
    (the committed ``corpus/`` stays byte-stable whichever regenerates it), and a finding
    on the reference or on a user's system is always a regression test.
    """
    from faultlab.system import is_builtin, is_reference

    if not trace.deduplication:
        return True
    return is_builtin(trace.system) and not is_reference(trace.system)


def marked(trace: Trace) -> Trace:
    """The trace as the corpus saves it: ``"expect": "finding"`` when
    :func:`finding_on_purpose`, else without the field (a regression test)."""
    if trace.expect is None and trace.expected is not None and not trace.expected.clean \
            and finding_on_purpose(trace):
        trace.expect = EXPECT_FINDING
    return trace


#: Where ``explore`` keeps a flaky outcome's trace: beside the corpus directory, never in it.
FLAKY_DIRECTORY = "flaky"


def flaky_directory(corpus: str) -> Path:
    """Where a flaky outcome's trace is kept for a run whose corpus is ``corpus``: a
    ``flaky/`` directory beside a corpus directory (``corpus/`` gives ``flaky/``), or in
    the current directory for a Redis corpus. Never inside the corpus: replay of the corpus
    and the pytest plugin see only findings that reproduced."""
    from faultlab.corpus.redis_store import is_redis_url

    if is_redis_url(corpus):
        return Path(FLAKY_DIRECTORY)
    directory = Path(corpus)
    kept = directory.parent / FLAKY_DIRECTORY
    resolved = directory.resolve()
    if kept.resolve() == resolved or resolved in kept.resolve().parents:  # corpus flaky/ or .
        kept = resolved.parent / f"{resolved.name}-{FLAKY_DIRECTORY}"
    return kept


def save(trace: Trace, directory: Path, system_name: str | None = None) -> Path:
    """Write the trace into the corpus directory (created if needed), atomically, marked
    as an expected finding or a regression test (:func:`marked`).

    Saving is the run's commit point (:func:`faultlab.base.output.write_text` with ``final``):
    a signal before the rename leaves neither the file nor a directory made for it.
    """
    missing = []
    parent = directory
    while not parent.exists() and parent != parent.parent:
        missing.append(parent)
        parent = parent.parent
    path = directory / finding_name(trace, system_name)
    if os.path.lexists(path) and not is_trace_file(path):
        raise ExecutionError(
            f"{path}: exists and is not a faultlab trace; the finding was not saved over it "
            "(move it away and run again: the same seed finds the same trace)")
    try:
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise ExecutionError(f"cannot create {directory}: {error.strerror or error}") from None
        write_json(path, marked(trace).to_json(), final=True, kind=trace_file())
    except BaseException:
        for made in missing:  # innermost first; only directories this call created
            try:
                made.rmdir()
            except OSError:
                break
        raise
    return path


def replay_command(path: Path | str, system_ref: str) -> str:
    """The command that replays a saved finding, as explore and a state-machine test print it.

    A trace never chooses the code it runs (:mod:`faultlab.corpus.trust`): a built-in system
    is found by the name the trace records, any other one must be named, so the command says
    ``--system`` with the reference the finding was explored with.

    A finding made on faultlab's own PostgreSQL server replays on one too
    (``--postgres private``): its server_crash steps run nowhere else. Paths are quoted
    for a POSIX shell (a corpus "my corp" is printed as 'my corp'), so the line can be
    pasted as it is.
    """
    from faultlab.stores import postgres as pgstores
    from faultlab.system import is_builtin

    named = "" if is_builtin(system_ref) else f" --system {shlex.quote(system_ref)}"
    private = " --postgres private" if pgstores.private_server() is not None else ""
    return f"python -m faultlab replay {shlex.quote(str(path))}{named}{private}"
