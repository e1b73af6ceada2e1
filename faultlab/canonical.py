"""Canonical JSON: the one byte form in which payloads are stored and compared.

Two payloads are the same request exactly when their canonical forms are equal,
so a retry that re-encodes a payload cannot masquerade as a conflict.
"""

from __future__ import annotations

import json
import math
from typing import Any

from faultlab.errors import UsageError


def canonical_json(value: Any) -> str:
    """Keys sorted, separators ``,`` and ``:``, NaN and infinities refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_payload(text: str, *, what: str = "--payload") -> str:
    """Parse user-supplied JSON and return its canonical form, or raise UsageError."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as error:
        raise UsageError(f"{what} is not valid JSON: {error}") from None
    if isinstance(value, float) and not math.isfinite(value):
        raise UsageError(f"{what} is not valid JSON: non-finite number")
    return canonical_json(value)
