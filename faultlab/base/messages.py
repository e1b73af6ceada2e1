"""Wording shared by every command's output: counts with the right plural, safe echoes.

A message may quote what a user's program printed or what a file held; control
characters and undecodable bytes in it would garble the terminal, so they are
shown escaped, and a long quote is cut.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping
from typing import Any

REPLACEMENT = "\ufffd"  # what errors="replace" decoding leaves for undecodable bytes


def plural(count: int, singular: str, plural_form: str | None = None) -> str:
    """``1 trace``, ``2 traces``."""
    return f"{count} {singular if count == 1 else (plural_form or singular + 's')}"


def printable(text: str, limit: int | None = None, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters escaped (``\\x1b``), undecodable bytes as ``\\ufffd``,
    and cut to ``limit`` characters (with an ellipsis)."""
    out = []
    for char in text:
        if char == "\n" and keep_newlines:
            out.append(char)
        elif char == REPLACEMENT or unicodedata.category(char) in ("Cc", "Cf", "Cs", "Co"):
            out.append(char.encode("unicode_escape").decode("ascii") if ord(char) > 0xFF
                       or char == REPLACEMENT else f"\\x{ord(char):02x}")
        else:
            out.append(char)
    result = "".join(out)
    if limit is not None and len(result) > limit:
        result = result[: max(limit - 3, 0)] + "..."
    return result


def worker_message(stderr: str, response: Mapping[str, Any] | None, limit: int = 200) -> str:
    """What a worker that refused to run said, for a one-line error: the ``error`` of the JSON
    line it printed (a refusal such as ``{"error": "bad_payload"}`` goes to stdout) and the
    last line of its stderr, escaped and cut to ``limit``; ``no message`` when it said neither.

    Only stderr was read once, so a worker exiting 2 with a JSON error was reported with "no
    message".
    """
    said = []
    error = response.get("error") if isinstance(response, Mapping) else None
    if error is not None:
        detail = {key: value for key, value in response.items() if key != "error"} \
            if isinstance(response, Mapping) else {}
        extra = f" {json.dumps(detail, sort_keys=True, default=str)}" if detail else ""
        said.append(f"error {json.dumps(error, default=str)}{extra}")
    last = (stderr.strip().splitlines() or [""])[-1].strip()
    if last:
        said.append(last)
    return printable("; ".join(said), limit) if said else "no message"
