"""Untrusted input (trace files, system files, worker arguments): refused in one line.

A trace file or a system file may come from anywhere: a colleague, a bug report, an
attacker. Everything faultlab reads from one is checked here before it is used, so
that the problems surface as :class:`~faultlab.base.errors.UsageError` (exit 2, one line,
nothing created) and not as a traceback deep inside a worker:

* the file must be a regular file (a FIFO would block, ``/dev/zero`` never ends) of at
  most :data:`MAX_FILE_BYTES`, UTF-8 text, and JSON without ``NaN``/``Infinity``;
* JSON nesting deeper than :data:`MAX_DEPTH` is refused (Python's parser raises
  ``RecursionError`` at about a thousand levels, and deep values are no payload);
* every string must be encodable as UTF-8 (a JSON ``"\\udc80"`` escape or a command-line
  argument that was not UTF-8 decodes to a lone surrogate, which SQLite, pipes and the
  terminal all reject later), numbers finite and integers of at most
  :data:`MAX_INT_DIGITS` digits;
* an operation id is a non-empty string of at most :data:`MAX_ID_LENGTH` characters
  without control characters (a NUL cannot even be passed to a command-line system).
"""

from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

from faultlab.base.errors import UsageError

MAX_FILE_BYTES = 16 << 20
MAX_DEPTH = 64
MAX_INT_DIGITS = 100
MAX_ID_LENGTH = 200
#: The most lanes a trace may have: a file naming more is refused, and so is a run asked
#: for more (``--concurrency``, :func:`faultlab.explore`).
MAX_CONCURRENCY = 8


def _refuse_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:20]} is out of range")
    return value


def _bounded_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"integer of {len(text)} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def utf8_problem(text: str) -> str | None:
    """Why ``text`` cannot be written as UTF-8 (a lone surrogate), or None."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        return f"not valid Unicode (a lone surrogate at character {error.start})"
    return None


def check_value(value: Any, where: str, depth: int = 0) -> None:
    """Refuse JSON that is too deep, has strings that are not Unicode, or odd numbers."""
    if depth > MAX_DEPTH:
        raise UsageError(f"{where}: nested more than {MAX_DEPTH} levels deep")
    if isinstance(value, str):
        problem = utf8_problem(value)
        if problem is not None:
            raise UsageError(f"{where}: a string is {problem}")
    elif isinstance(value, bool) or value is None:
        return
    elif isinstance(value, int):
        if len(str(abs(value))) > MAX_INT_DIGITS:
            raise UsageError(f"{where}: an integer has more than {MAX_INT_DIGITS} digits")
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise UsageError(f"{where}: a number is not finite")
    elif isinstance(value, list):
        for item in value:
            check_value(item, where, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            check_value(key, where, depth + 1)
            check_value(item, where, depth + 1)
    else:
        raise UsageError(f"{where}: {type(value).__name__} is not a JSON value")


def parse_json(text: str, where: str) -> Any:
    """Strict JSON: no NaN/Infinity, no overflowing numbers, bounded depth, valid Unicode."""
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_bounded_int)
    except RecursionError:
        # the same words whichever limit is met first (the parser's depends on the Python)
        raise UsageError(f"{where}: nested more than {MAX_DEPTH} levels deep") from None
    except ValueError as error:
        raise UsageError(f"{where} (invalid JSON: {error})") from None
    check_value(value, where)
    return value


def read_json_file(path: Path, what: str) -> Any:
    """Read a JSON document from a regular file of bounded size; UsageError naming it."""
    return parse_json(read_text_file(path, what), f"{path}: not a {what}")


def read_text_file(path: Path, what: str) -> str:
    """The UTF-8 text of a regular file of at most :data:`MAX_FILE_BYTES` (a FIFO would
    block, ``/dev/zero`` never ends); UsageError naming it."""
    try:
        info = os.stat(path)
    except OSError as error:
        raise UsageError(f"{path}: cannot read {what}: {error.strerror or error}") from None
    if not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{path}: not a regular file; a {what} is a JSON file")
    if info.st_size > MAX_FILE_BYTES:
        raise UsageError(f"{path}: {info.st_size} bytes; a {what} has at most "
                         f"{MAX_FILE_BYTES} bytes")
    try:
        with open(path, "rb") as stream:
            data = stream.read(MAX_FILE_BYTES + 1)
    except OSError as error:
        raise UsageError(f"{path}: cannot read {what}: {error.strerror or error}") from None
    if len(data) > MAX_FILE_BYTES:
        raise UsageError(f"{path}: a {what} has at most {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not a {what} (not UTF-8 text)") from None


def check_operation_id(value: Any, where: str = "operation id") -> str:
    """A usable operation id: a short string of printable Unicode characters."""
    if not isinstance(value, str) or not value:
        raise UsageError(f"{where} must be a non-empty string")
    if len(value) > MAX_ID_LENGTH:
        raise UsageError(f"{where} has {len(value)} characters (at most {MAX_ID_LENGTH})")
    problem = utf8_problem(value)
    if problem is not None:
        raise UsageError(f"{where} is {problem}; was it UTF-8?")
    control = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
    if control is not None:
        raise UsageError(f"{where} contains the control character {control!r}")
    return value
