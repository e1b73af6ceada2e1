"""The concurrency mutants on trial in ``mutants``: explore and enumerate with two lanes.

A concurrency mutant (:mod:`faultlab.system.builtin.race_mutants`) is invisible to
sequential traces, so :func:`faultlab.trials.zoo.judge` hands it here: ``explore
--concurrency 2`` with the zoo's seed and budget, then ``enumerate --concurrency
2`` with its defaults. ``REFERENCE_CONCURRENT`` names the reference judged the
same way (it must stay clean).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from faultlab.process.records import SpawnMode

#: The row in ``mutants`` for the reference judged with two lanes.
REFERENCE_CONCURRENT = "reference-concurrent"
CONCURRENCY = 2


def judge_concurrent(
    name: str, *, examples: int, steps: int, seed: int, spawn: SpawnMode, deadline: float,
    corpus_directory: str | None,
) -> dict[str, Any]:
    """The fields of :class:`faultlab.trials.zoo.Judgement` for one system judged with two
    lanes; a PostgreSQL mutant that needs faultlab's own server (its clock moved by the
    ticks) on a private server started for it, or a row saying why it cannot start here."""
    from faultlab.system.builtin.registry import BY_NAME

    if name in BY_NAME and getattr(BY_NAME[name], "private_server", False):
        return _on_private_server(name, examples=examples, steps=steps, seed=seed,
                                  spawn=spawn, deadline=deadline,
                                  corpus_directory=corpus_directory)
    return _judge(name, examples=examples, steps=steps, seed=seed, spawn=spawn,
                  deadline=deadline, corpus_directory=corpus_directory)


def _on_private_server(name: str, **budget: Any) -> dict[str, Any]:
    """Judge ``name`` on a private server with a virtual clock, stopped and removed
    whatever happens (a judge runs in a process of its own: one server each)."""
    from faultlab.stores import pgserver
    from faultlab.stores import postgres as pgstores
    from faultlab.system.builtin.registry import BY_NAME

    reason = pgserver.unavailable()
    if reason is None:
        try:
            pgserver.psycopg_module()
            with pgserver.PrivateServer(virtual_clock=True) as server:
                pgstores.configure(server.conninfo, server=server)
                try:
                    return _judge(name, **budget)
                finally:
                    pgstores.close_run()
                    pgstores.configure(None)
        except pgserver.PrivateServerUnavailable as error:
            reason = str(error)
    cls = BY_NAME[name]
    return dict(
        system=name, defect=cls.description, reference=False,
        caught_by=list(getattr(cls, "caught_by", ())),
        minimal_steps=getattr(cls, "minimal_steps", None), enumerate_found=False,
        enumerate_invariants=[], enumerate_seconds=0.0, enumerate_traces=0,
        explore_found=False, explore_invariants=[], examples_until_found=None,
        seconds_until_found=None, shrunk_steps=None, explore_seconds=0.0, explore_steps=0,
        corpus_file=None, enumerable=False,
        unjudged=f"needs --postgres private, which cannot start here: {reason}",
    )


def _judge(
    name: str, *, examples: int, steps: int, seed: int, spawn: SpawnMode, deadline: float,
    corpus_directory: str | None,
) -> dict[str, Any]:
    from faultlab.corpus import files as corpus
    from faultlab.search.schedule_enumeration import enumerate_concurrent
    from faultlab.search.schedules import explore_concurrent
    from faultlab.system import load_system

    reference = name == REFERENCE_CONCURRENT
    system = load_system("reference" if reference else name)
    explored = explore_concurrent(
        system, concurrency=CONCURRENCY, examples=examples, steps=steps, seed_value=seed,
        spawn=spawn, deadline=deadline,
    )
    began = time.monotonic()
    # a PostgreSQL mutant (enumerable = False) is judged by explore alone, as sequentially
    enumerable = bool(getattr(system, "enumerable", True))
    enumerated = enumerate_concurrent(system, concurrency=CONCURRENCY, spawn=spawn,
                                      deadline=deadline) if enumerable else None
    enumerate_seconds = time.monotonic() - began
    trace = explored.trace
    saved = None
    if trace is not None and corpus_directory is not None:
        saved = str(corpus.save(trace, Path(corpus_directory), system.name))
    recorder = explored.recorder
    found = enumerated.execution if enumerated is not None else None
    return dict(
        system=name,
        defect=system.description if not reference else "the reference, two dispatchers at once",
        reference=reference,
        caught_by=list(getattr(system, "caught_by", ())),
        minimal_steps=getattr(system, "minimal_steps", None),
        enumerate_found=found is not None,
        enumerate_invariants=sorted(found.verdict.invariants) if found is not None else [],
        enumerate_seconds=round(enumerated.seconds if enumerated is not None and found is not None
                                else enumerate_seconds, 3),
        enumerate_traces=enumerated.sequences if enumerated is not None else 0,
        explore_found=trace is not None,
        explore_invariants=list(trace.expected.invariants) if trace and trace.expected else [],
        examples_until_found=recorder.first_failure_examples,
        seconds_until_found=None if recorder.first_failure_seconds is None
        else round(recorder.first_failure_seconds, 3),
        shrunk_steps=explored.shrunk_steps,
        explore_seconds=round(explored.seconds, 3),
        explore_steps=recorder.steps,
        corpus_file=saved,
        enumerable=enumerable,
    )
