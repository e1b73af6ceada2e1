"""The concurrency mutants' median in ``mutants``: computed from the judgements alone."""

from __future__ import annotations

from typing import Any

from faultlab.trials.zoo import Judgement, concurrency_examples


def judgement(system: str, examples: int | None, *, lanes: int = 2, reference: bool = False,
              unjudged: str | None = None) -> Judgement:
    fields: dict[str, Any] = dict(
        defect="", reference=reference, caught_by=[], minimal_steps=None,
        enumerate_found=False, enumerate_invariants=[], enumerate_seconds=0.0,
        enumerate_traces=0, explore_found=examples is not None, explore_invariants=[],
        examples_until_found=examples, seconds_until_found=None, shrunk_steps=None,
        explore_seconds=0.0, explore_steps=0, corpus_file=None)
    return Judgement(system=system, lanes=lanes, unjudged=unjudged, **fields)


def test_the_median_counts_two_lane_mutants_only() -> None:
    summary = concurrency_examples([
        judgement("no-fencing", 5), judgement("skip-locked", 30), judgement("racy-dedup", 7),
        judgement("advisory-lock-pg", 26),
        judgement("split-accept", 1, lanes=1),  # sequential: not counted
        judgement("reference-concurrent", None, reference=True),  # clean on purpose
        judgement("server-clock-lease-pg", None, unjudged="no server"),  # not judged
    ])
    assert summary["examples"] == {"no-fencing": 5, "skip-locked": 30, "racy-dedup": 7,
                                   "advisory-lock-pg": 26}
    assert summary["median"] == 16.5
    assert summary["sqlite_median"] == 7 and summary["sqlite"] == 3


def test_a_missed_mutant_leaves_no_median() -> None:
    """A miss has no count: a median over the rest would flatter the search."""
    summary = concurrency_examples([judgement("no-fencing", 5), judgement("skip-locked", None)])
    assert summary["median"] is None and summary["sqlite_median"] is None
