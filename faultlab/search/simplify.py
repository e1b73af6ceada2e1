"""Data simplification for shrunk traces: readable ids and payloads.

faultlab's trace minimiser (:func:`faultlab.search.shrink.minimise`) removes steps and
makes them simpler; this pass then simplifies the data the remaining steps carry, so a
finding that needs a 2^53+1 integer shows that integer and not a 19-digit one, and
a finding that needs no payload at all shows ``{}``:

* operation ids are renamed (everywhere) to ``op-1``, ``op-2``, ... in order of first
  appearance; a finding that needs ``OP-1`` beside ``op-1`` keeps it;
* each distinct payload is replaced (everywhere it occurs, and in the changed payloads
  derived from it with ``revision``) by simpler values: the empty object, a key
  removed, a value simplified (strings shortened or made uniform, numbers towards 0 or
  to 2^53+1, containers emptied).

The minimiser ends with it for both kinds of trace (a concurrent trace's ``run``/``start``
steps carry the same ids and payloads as a sequential trace's steps). Every candidate is a
real execution, judged by the same ``attempt`` the minimiser uses; the pass keeps only
candidates that still fail within the same number of executed steps, and stops after
:data:`ATTEMPTS` executions.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any

from faultlab.base.canonical import canonical_json
from faultlab.trace import Step

ATTEMPTS = 60
_OP_N = re.compile(r"op-[0-9]+")
TWO_53_PLUS_1 = 2**53 + 1
PARCEL = "\U0001f4e6"

def simplify_data(steps: list[Step], attempt: Callable[[list[Step]], list[Step] | None],
                  budget: int = ATTEMPTS) -> list[Step]:
    """The simplest data for ``steps`` that still fails; ``attempt`` returns the kept steps
    of a failing candidate or ``None``."""
    remaining = [budget]

    def trying(candidate: list[Step]) -> list[Step] | None:
        if remaining[0] <= 0 or candidate == steps:
            return None
        remaining[0] -= 1
        return attempt(candidate)

    for index, operation_id in enumerate(_ids(steps)):
        wanted = f"op-{index + 1}"  # ids in order of appearance: op-1, op-2, ...
        if operation_id == wanted or wanted in _ids(steps):
            if _OP_N.fullmatch(operation_id):
                continue
            used = set(_ids(steps))
            number = 1
            while f"op-{number}" in used:
                number += 1
            wanted = f"op-{number}"
        kept = trying(_rename(steps, operation_id, wanted))
        if kept is not None:
            steps = kept
    for first, second, look in _lookalike_pairs(steps):
        renamed = _rename(_rename(steps, first, "op-1"), second, look("op-1"))
        if "op-1" not in (first, second) and set(_ids(renamed)) != set(_ids(steps)):
            kept = trying(renamed) if not {"op-1", look("op-1")} & set(_ids(steps)) else None
            if kept is not None:
                steps = kept
    progress = True
    while progress and remaining[0] > 0:
        progress = False
        for base in _payload_bases(steps):
            for candidate in _simpler(base):
                replaced = _replace_payload(steps, base, candidate)
                if replaced is None:
                    continue
                kept = trying(replaced)
                if kept is not None:
                    steps, progress = kept, True
                    break
            if progress:
                break  # the bases changed: start again from the simplest
    return steps


def _ids(steps: list[Step]) -> list[str]:
    return list(dict.fromkeys(s.operation_id for s in steps if s.operation_id is not None))


_LOOKS: tuple[Callable[[str], str], ...] = (
    str.swapcase, str.upper, str.lower, lambda text: text + " ",
)


def _lookalike_pairs(steps: list[Step]) -> list[tuple[str, str, Callable[[str], str]]]:
    """Id pairs a finding may need together (``x`` and ``X``): renamed as a pair."""
    ids = _ids(steps)
    pairs = []
    for first in ids:
        for second in ids:
            for look in _LOOKS:
                if first != second and look(first) == second and look("op-1") != "op-1":
                    pairs.append((first, second, look))
                    break
    return pairs


def _rename(steps: list[Step], old: str, new: str) -> list[Step]:
    # replace(): a power step keeps its choice
    return [replace(s, operation_id=new if s.operation_id == old else s.operation_id)
            for s in steps]


def _without_revision(payload: Any) -> Any:
    if isinstance(payload, dict) and "revision" in payload:
        return {k: v for k, v in payload.items() if k != "revision"}
    return payload


def _payload_bases(steps: list[Step]) -> list[Any]:
    """Distinct payloads, a changed payload (``revision`` added) counted as its base."""
    plain = {canonical_json(s.payload): s.payload for s in steps if s.payload is not None}
    bases: dict[str, Any] = {}
    for text, payload in plain.items():
        base = _without_revision(payload)
        key = canonical_json(base)
        bases.setdefault(key if key in plain else text, base if key in plain else payload)
    return list(bases.values())


def _replace_payload(steps: list[Step], base: Any, new: Any) -> list[Step] | None:
    """Every payload equal to ``base`` becomes ``new``; a derived one keeps its revision."""
    base_text = canonical_json(base)
    out: list[Step] = []
    for step in steps:
        payload = step.payload
        if payload is not None and canonical_json(payload) == base_text:
            payload = new
        elif payload is not None and canonical_json(_without_revision(payload)) == base_text \
                and payload != base:
            if not isinstance(new, dict) or "revision" in new:
                return None
            payload = {**new, "revision": step.payload["revision"]}
        out.append(replace(step, payload=payload))
    return out


def _simpler(value: Any) -> Iterator[Any]:
    """Candidates simpler than ``value``, simplest first."""
    if isinstance(value, dict):
        if value:
            yield {}
        for key in value:
            yield {k: v for k, v in value.items() if k != key}
        for item in value.values():
            if isinstance(item, dict) and item:
                yield item  # hoist a nested object
        for key in value:
            if not _plain_key(key):
                for simpler_key in ("key", *_simpler_string(key)):
                    if simpler_key and simpler_key not in value:
                        yield {(simpler_key if k == key else k): v for k, v in value.items()}
        for key, item in value.items():
            if isinstance(item, list) and len(item) == 1:
                yield {**value, key: item[0]}  # unwrap a one-element array
            for smaller in _simpler(item):
                yield {**value, key: smaller}
    elif isinstance(value, list):
        if value:
            yield []
        for index in range(len(value)):
            yield value[:index] + value[index + 1:]
        for index, item in enumerate(value):
            for smaller in _simpler(item):
                yield value[:index] + [smaller] + value[index + 1:]
    elif isinstance(value, bool) or value is None:
        if value:
            yield False
    elif isinstance(value, int):
        if value != 0:
            yield 0
        if abs(value) > TWO_53_PLUS_1:
            yield TWO_53_PLUS_1 if value > 0 else -TWO_53_PLUS_1
        if value < 0:
            yield -value
    elif isinstance(value, float):
        if value != 0.0 or math.copysign(1.0, value) < 0:
            yield 0
        if math.isfinite(value) and value != int(value):
            yield float(int(value))
            for plain in (0.5, 0.1):  # exact in binary, and the classic that is not
                if value != plain:
                    yield plain
        if value < 0:
            yield -value
    elif isinstance(value, str):
        yield from _simpler_string(value)


def _plain_key(key: str) -> bool:
    return 0 < len(key) <= 12 and key.isascii() and key.replace("_", "").isalnum()


def _simpler_string(text: str) -> Iterator[str]:
    if text:
        yield ""
    if len(text) > 1:
        yield text[: len(text) // 2]
        yield text[: len(text) * 3 // 4]
        yield text[: len(text) * 7 // 8]
        yield text[:-1]
    if any(not c.isascii() or not c.isalnum() for c in text):
        yield "x" * len(text)
    unusual = list(dict.fromkeys(c for c in text if not c.isascii()))
    if len(text) > 1:
        yield from unusual  # the one character that matters, alone
    for character in unusual:
        if ord(character) > 0xFFFF and character != PARCEL:
            yield text.replace(character, PARCEL)  # a readable non-BMP character
    if len(set(text)) > 1:
        yield text[0] * len(text)
