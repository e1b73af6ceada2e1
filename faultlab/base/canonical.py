"""Canonical JSON: the one byte form in which payloads are stored and compared.

Two payloads are the same request exactly when their canonical forms are equal,
so a retry that re-encodes a payload cannot masquerade as a conflict.
"""

from __future__ import annotations

import json
from typing import Any

from faultlab.base.inputs import parse_json


def canonical_json(value: Any) -> str:
    """Keys sorted, separators ``,`` and ``:``, NaN and infinities refused."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)


def parse_payload(text: str, *, what: str = "--payload") -> str:
    """Parse user-supplied JSON and return its canonical form, or raise UsageError."""
    return canonical_json(parse_json(text, f"{what} is not valid JSON"))
