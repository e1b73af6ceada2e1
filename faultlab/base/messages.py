"""Wording shared by every command's output: counts with the right plural, safe echoes.

A message may quote what a user's program printed or what a file held; control
characters and undecodable bytes in it would garble the terminal, so they are
shown escaped, and a long quote is cut.
"""

from __future__ import annotations

import unicodedata

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
