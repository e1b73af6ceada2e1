"""Seed streams: which Hypothesis seed each round of each job of each shard uses.

Kept apart from :mod:`faultlab.search.rounds` (which imports Hypothesis) so the command line
can parse ``--shard`` without loading the search machinery.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

from faultlab.base.errors import UsageError


@dataclass(frozen=True)
class Shard:
    """This run's place among ``count`` cooperating runs (``index`` from 0)."""

    index: int = 0
    count: int = 1

    def __str__(self) -> str:
        return f"{self.index}/{self.count}"


def parse_shard(text: str) -> Shard:
    """``K/N`` with 0 <= K < N; UsageError otherwise."""
    parts = text.split("/")
    try:
        index, count = (int(part) for part in parts)
    except ValueError:
        raise UsageError(f"--shard {text!r}: expected K/N, e.g. 0/4") from None
    if count < 1 or not 0 <= index < count:
        raise UsageError(f"--shard {text!r}: need 0 <= K < N")
    return Shard(index, count)


def round_seed(seed: int, global_round: int) -> int:
    """The seed of global round ``g`` of a run started with ``seed``."""
    if global_round == 0:
        return seed
    digest = hashlib.blake2b(f"faultlab-round:{seed}:{global_round}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") >> 1
