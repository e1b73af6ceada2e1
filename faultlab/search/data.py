"""Generated data: payloads and operation ids that look like real requests.

Outbox bugs hide in data as much as in crashes: a collation that ignores case, a
``VARCHAR(64)`` key that truncates, a JSON decoder that turns integers into doubles, a
receiver that normalises unicode. So the state machine draws:

* **payloads** (JSON objects): half of them simple (a title, a priority, a small
  count), the rest realistic: non-BMP characters, combining marks, right-to-left
  text, kilobyte strings, integers beyond 2^53 and negative, floats that a lossy encoder
  does not round-trip, nested objects and arrays, the empty object; a new operation may
  also reuse the payload of an earlier one (see :func:`payload_for_new`);
* **operation ids**: ``op-N`` most of the time, otherwise an id that differs from an
  existing one only in case, by a trailing space or by unicode normalisation; unicode
  ids; ids with quotes and SQL metacharacters; long ids sharing a long prefix; ids that
  sort in surprising orders (``op-10`` before ``op-9``).

Every strategy lists its simple case first, so Hypothesis's shrinker (and faultlab's
own data simplification, :mod:`faultlab.search.simplify`) lands on readable values.

A system can declare its own data. A Python system defines ``payloads()`` and/or
``operation_ids()`` returning Hypothesis strategies; a command-line system gives
``payload_schema`` (a JSON Schema, drawn with hypothesis-jsonschema, the ``jsonschema``
extra) and ``operation_ids`` (a regular expression, drawn with ``st.from_regex``).
Whatever it does not declare gets the defaults here.

Payload equality is byte equality of canonical JSON (:mod:`faultlab.base.canonical`): the
payload is canonicalised once, at the caller, and every store and comparison sees those
bytes; a number is the text Python's ``json`` writes (integers exact at any size, floats
the shortest text that round-trips), so the reference compares what it stored and no
encoding can raise a false alarm there.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable
from typing import Any

from hypothesis import strategies as st

from faultlab.base.errors import UsageError
from faultlab.base.inputs import check_operation_id

TWO_53 = 2**53

#: The titles of simple payloads (the reference's ordering key).
TITLES: tuple[str, ...] = ("backlog", "invoice", "report")
#: The simple payloads: still the simple (and shrink-target) case.
SIMPLE_PAYLOADS: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(
    {"title": st.sampled_from(TITLES)},
    optional={
        "priority": st.sampled_from(["low", "normal", "urgent"]),
        "count": st.integers(min_value=0, max_value=3),
    },
)

#: Strings real requests carry: non-BMP, combining marks, right-to-left, look-alikes.
SPECIMEN_STRINGS: tuple[str, ...] = (
    "caf\u00e9",                      # precomposed é (NFC)
    "cafe\u0301",                     # e + combining acute (NFD): equal to the above after NFC
    "\U0001f4e6 parcel",              # non-BMP emoji
    "\U0001d4b3\U0001d4ae",           # mathematical script letters (non-BMP)
    "\u0641\u0627\u062a\u0648\u0631\u0629",  # Arabic "invoice", right to left
    "\u202eevil\u202c",               # right-to-left override
    "\u05e2\u05d1\u05e8\u05d9\u05ea 42",  # Hebrew with digits
    "\uff49\uff4e\uff56\uff4f\uff49\uff43\uff45",  # fullwidth letters (NFKC: "invoice")
    "\u0130stanbul",                  # dotted capital I: lower() changes its length
    "Stra\u00dfe",                    # ß: upper() gives "STRASSE"
    "\u00c5ngstr\u00f6m",
    "line\nbreak\ttab",
    "quote \" and \\ backslash",
    "",
)

#: Numbers that break lossy encoders (doubles, 32-bit floats, fixed decimals).
SPECIMEN_NUMBERS: tuple[int | float, ...] = (
    TWO_53 + 1, -(TWO_53 + 1), 2**63, 2**64 + 1, -(2**31), 12345678901234567890,
    0.1, 0.30000000000000004, 1e-7, 5e-324, 1.7976931348623157e308, 123456.789012345,
    -0.0, 1e21, 16777217.0,
)


def _text() -> st.SearchStrategy[str]:
    """Any text except surrogates and NUL (ids and payloads must reach argv and SQLite)."""
    return st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"),
                   max_size=12)


def strings() -> st.SearchStrategy[str]:
    """Plain titles first; then specimens, arbitrary unicode and kilobyte strings."""
    return st.one_of(
        st.sampled_from(["backlog", "invoice", "report"]),
        st.sampled_from(SPECIMEN_STRINGS),
        _text(),
        st.builds(lambda unit, count: unit * count,
                  st.sampled_from(["x", "\u00e9", "\U0001f4e6", "ab"]),
                  st.integers(min_value=1024, max_value=4096)),
    )


def numbers() -> st.SearchStrategy[int | float]:
    """Small counts first; then big and negative integers, awkward floats."""
    return st.one_of(
        st.integers(min_value=0, max_value=3),
        st.sampled_from(SPECIMEN_NUMBERS),
        st.integers(min_value=-(2**64), max_value=2**64),
        st.floats(allow_nan=False, allow_infinity=False),
    )


def json_values() -> st.SearchStrategy[Any]:
    """Any JSON value, nesting included (shallow, so steps stay cheap)."""
    scalars = st.one_of(st.none(), st.booleans(), numbers(), strings())
    return st.recursive(
        scalars,
        lambda children: st.one_of(
            st.lists(children, max_size=3),
            st.dictionaries(strings(), children, max_size=3),
        ),
        max_leaves=6,
    )


def realistic_payloads() -> st.SearchStrategy[dict[str, Any]]:
    """Request-shaped objects with awkward values, and the empty object."""
    return st.one_of(
        st.fixed_dictionaries(
            {"title": strings()},
            optional={
                "priority": st.sampled_from(["low", "normal", "urgent"]),
                "count": numbers(),
                "amount": numbers(),
                "note": strings(),
                "tags": st.lists(strings(), max_size=3),
                "meta": st.dictionaries(strings(), json_values(), max_size=3),
            },
        ),
        st.just({}),
        st.dictionaries(strings(), json_values(), min_size=1, max_size=4),
    )


def default_payloads() -> st.SearchStrategy[dict[str, Any]]:
    """Simple payloads half the time (the shrink target), realistic ones otherwise."""
    return st.one_of(SIMPLE_PAYLOADS, realistic_payloads())


# --- operation ids -------------------------------------------------------------------------

#: ``op-N`` is the most common kind; look-alikes (of an existing id) come next, since a
#: sloppy comparison only shows with two ids.
ID_KINDS = ("op", "op", "op", "op", "op", "lookalike", "lookalike", "lookalike", "unicode",
            "meta", "long", "sort")

_UNICODE_IDS = ("op-{n}-\U0001f4e6", "caf\u00e9-{n}", "\uff4f\uff50-{n}",
                "\u0627\u0644\u0637\u0644\u0628-{n}", "\u0130d-{n}", "\u00e5-{n}")
_META_IDS = ("op'{n}", 'op"{n}', "op-{n}'; DROP TABLE operations; --", "op-{n} OR 1=1",
             "op%{n}", "op_{n}", "op\\{n}", "op-{n};", "op-{n}--")
_SORT_IDS = ("op-{n}0", "op-0{n}", " op-{n}", "~op-{n}", "Op-{n}", "{n}", "op-{n}.")
#: A long shared prefix: a key column that truncates makes these ids collide.
LONG_PREFIX = "tenant-0042/region-eu-west-1/customer-7f3a9c2e/order-2026-11-30/"


def lookalikes(existing: str) -> list[str]:
    """Ids a sloppy comparison confuses with ``existing``: case, trailing space, NFD/NFC."""
    import unicodedata

    found = [existing.swapcase(), existing.upper(), existing.lower(), existing + " ",
             unicodedata.normalize("NFD", existing), unicodedata.normalize("NFC", existing)]
    return [candidate for candidate in dict.fromkeys(found) if candidate != existing]


def fair_choice(data: st.DataObject, options: tuple[str, ...], salt: str, label: str) -> str:
    """One of ``options``, evenly over a run.

    Inside a state machine Hypothesis's choices lean heavily to the first option (in a
    200-example run the first of five crash points was armed 26 times, the third 3), so
    the drawn index is offset by a hash of ``salt`` (the example's steps so far): a
    function of the example's own choices, so a replay picks the same option.
    """
    drawn = data.draw(st.integers(0, len(options) - 1), label=label)
    mix = int.from_bytes(hashlib.blake2b(salt.encode(), digest_size=4).digest(), "big")
    return options[(drawn + mix) % len(options)]


def new_operation_id(data: st.DataObject, existing: list[str], number: int,
                     salt: str = "") -> str:
    """Draw an id that is not in ``existing``; ``op-<number>`` is the common case."""
    kind = fair_choice(data, ID_KINDS, f"{salt}|id", "id kind")
    candidate = f"op-{number}"
    if kind == "lookalike" and existing:
        base = fair_choice(data, tuple(existing), f"{salt}|base", "look-alike of")
        options = tuple(c for c in lookalikes(base) if c not in existing)
        if options:
            candidate = fair_choice(data, options, f"{salt}|variant", "look-alike id")
    elif kind in ("unicode", "meta", "sort"):
        table = {"unicode": _UNICODE_IDS, "meta": _META_IDS, "sort": _SORT_IDS}[kind]
        candidate = data.draw(st.sampled_from(table), label=f"{kind} id").format(n=number)
    elif kind == "long":
        candidate = f"{LONG_PREFIX}op-{number}"
    while candidate in existing:
        number += 1
        candidate = f"op-{number}"
    return candidate


# --- what a system declares ----------------------------------------------------------------


def payload_strategy(system: Any) -> st.SearchStrategy[Any]:
    """The system's own payload strategy or schema, else :func:`default_payloads`."""
    declared = getattr(system, "payloads", None)
    if callable(declared):
        strategy = declared()
        if not isinstance(strategy, st.SearchStrategy):
            raise UsageError(f"system {system.name!r}: payloads() must return a strategy")
        return strategy
    schema = getattr(system, "payload_schema", None)
    if schema is not None:
        return schema_strategy(schema)
    return default_payloads()


#: Keywords that only describe a schema: they do not change what it admits.
_ANNOTATIONS = frozenset({"title", "description", "$schema", "$comment", "examples",
                          "default"})
#: The keywords of the object and array schemas faultlab draws itself.
OBJECT_KEYWORDS = frozenset({"type", "properties", "required", "additionalProperties",
                             "minProperties", "maxProperties"})
ARRAY_KEYWORDS = frozenset({"type", "items", "minItems", "maxItems", "uniqueItems"})


def schema_strategy(schema: Any) -> st.SearchStrategy[Any]:
    """Payloads from a JSON Schema (needs the optional hypothesis-jsonschema).

    Objects, arrays and their ``anyOf``/``oneOf`` are built here when they use only the
    keywords :data:`OBJECT_KEYWORDS`, :data:`ARRAY_KEYWORDS` and annotations: an object's
    required properties always, the others optionally, extra properties only as many as
    ``minProperties`` needs, or up to three for an object that names none. Every other
    part is drawn by hypothesis-jsonschema, whose own object support uses Hypothesis
    internals that recent Hypothesis versions no longer have (hypothesis-jsonschema
    0.23.1 fails on Hypothesis 6.170 with ``'many' object has no attribute 'more'``):
    left to it, payload schemas, which are objects, would not be drawn at all. A part
    that cannot be drawn is named by :func:`check_schema` before a run.
    """
    try:
        from hypothesis_jsonschema import from_schema
    except ImportError:
        raise UsageError("payload_schema needs hypothesis-jsonschema: "
                         "pip install 'faultlab[jsonschema]'") from None

    def build(part: Any) -> st.SearchStrategy[Any]:
        if _is_object(part):
            return _object_strategy(part, build)
        if _is_array(part):
            return st.lists(build(part.get("items", {})), min_size=part.get("minItems", 0),
                            max_size=part.get("maxItems"),
                            unique_by=_canonical if part.get("uniqueItems") else None)
        if _is_choice(part):
            key = "anyOf" if "anyOf" in part else "oneOf"
            options = st.one_of([build(option) for option in part[key]])
            if key == "anyOf":
                return options
            from jsonschema.validators import validator_for  # type: ignore[import-untyped,unused-ignore]
            checks = [validator_for(option)(option).is_valid for option in part[key]]
            return options.filter(lambda value: sum(check(value) for check in checks) == 1)
        return from_schema(part)

    try:
        return build(schema)
    except Exception as error:  # the library raises several kinds for a bad schema
        raise UsageError(f"payload_schema is not a usable JSON Schema: {error}") from None


def _object_strategy(part: dict[str, Any],
                     build: Callable[[Any], st.SearchStrategy[Any]]
                     ) -> st.SearchStrategy[dict[str, Any]]:
    properties: dict[str, Any] = part.get("properties", {})
    required = [key for key in part.get("required", []) if isinstance(key, str)]
    additional = part.get("additionalProperties", True)
    extra_values = build(additional) if isinstance(additional, dict) else (
        None if additional is False else json_values())
    fixed: dict[str, st.SearchStrategy[Any]] = {}
    for key in required:
        if key in properties:
            fixed[key] = build(properties[key])
        elif extra_values is not None:
            fixed[key] = extra_values
        else:  # a required property no schema admits
            return st.nothing()
    optional = {key: build(sub) for key, sub in properties.items() if key not in fixed}
    strategy: st.SearchStrategy[dict[str, Any]] = st.fixed_dictionaries(fixed,
                                                                        optional=optional)
    least = part.get("minProperties", 0)
    most = part.get("maxProperties")
    known = set(properties) | set(fixed)
    # extra properties: as many as minProperties needs, and a few for an object that
    # names none (any object: the empty one is its simple case, not its only one)
    needed = max(least - len(known), 0)
    spare = 3 if not known and extra_values is not None else 0
    if (needed or spare) and extra_values is not None:
        extras = st.dictionaries(strings().filter(lambda key: key not in known),
                                 extra_values, min_size=needed, max_size=needed + spare)
        strategy = st.builds(lambda base, more: {**more, **base}, strategy, extras)
    if least or most is not None:
        strategy = strategy.filter(
            lambda value: least <= len(value) and (most is None or len(value) <= most))
    return strategy


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _is_object(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "object" \
        and set(part) <= OBJECT_KEYWORDS | _ANNOTATIONS \
        and isinstance(part.get("properties", {}), dict) \
        and isinstance(part.get("additionalProperties", True), (bool, dict))


def _is_array(part: Any) -> bool:
    return isinstance(part, dict) and part.get("type") == "array" \
        and set(part) <= ARRAY_KEYWORDS | _ANNOTATIONS \
        and isinstance(part.get("items", {}), dict)


def _is_choice(part: Any) -> bool:
    if not isinstance(part, dict) or len({"anyOf", "oneOf"} & set(part)) != 1:
        return False
    options = part.get("anyOf", part.get("oneOf"))
    return set(part) <= {"anyOf", "oneOf"} | _ANNOTATIONS and isinstance(options, list) \
        and bool(options)


def _built_parts(part: Any) -> list[tuple[str, Any]]:
    """The parts of a schema :func:`schema_strategy` builds itself, each with its path
    below it (none: the whole is drawn by hypothesis-jsonschema)."""
    if _is_object(part):
        parts = [(f".properties[{key!r}]", sub)
                 for key, sub in part.get("properties", {}).items()]
        if isinstance(part.get("additionalProperties"), dict):
            parts.append((".additionalProperties", part["additionalProperties"]))
        return parts
    if _is_array(part):
        return [(".items", part.get("items", {}))]
    if _is_choice(part):
        key = "anyOf" if "anyOf" in part else "oneOf"
        return [(f".{key}[{index}]", sub) for index, sub in enumerate(part[key])]
    return []


def id_strategy(system: Any) -> st.SearchStrategy[str] | None:
    """The system's own id strategy or pattern; ``None`` means :func:`new_operation_id`."""
    declared = getattr(system, "operation_ids", None)
    if callable(declared):
        strategy = declared()
        if not isinstance(strategy, st.SearchStrategy):
            raise UsageError(f"system {system.name!r}: operation_ids() must return a strategy")
        return strategy
    pattern = getattr(system, "operation_id_pattern", None)
    if pattern is not None:
        return pattern_strategy(pattern)
    return None


def pattern_strategy(pattern: str) -> st.SearchStrategy[str]:
    """Ids matching the whole regular expression that are usable ids
    (:func:`~faultlab.base.inputs.check_operation_id`: no NUL or other control character,
    since ids travel in argv; not empty; not too long)."""
    try:
        re.compile(pattern)
    except re.error as error:
        raise UsageError(f"operation_ids is not a regular expression: {error}") from None
    return st.from_regex(pattern, fullmatch=True).filter(_usable_id)


def _usable_id(text: str) -> bool:
    try:
        check_operation_id(text)
    except UsageError:
        return False
    return True


# --- declared data, checked before a run starts ----------------------------------------------


def check_declared(system: Any) -> None:
    """Refuse (UsageError, one line) a command-line system's payload schema or id pattern
    from which no value can be drawn, before anything is created.

    Hypothesis would otherwise fail inside the search, where the error became a traceback
    and exit 1 (the finding status): a ``{"$ref": "#"}`` schema cannot be resolved, a
    ``false`` or impossible schema (``minimum`` above ``maximum``) admits nothing, a bad
    ``type`` trips an assertion in hypothesis-jsonschema, an id pattern with a look-behind
    or one that matches nothing leaves every example unsatisfiable. A Python system's own
    ``payloads()``/``operation_ids()`` must return strategies; what they draw is its code,
    and not drawn here."""
    payload_strategy(system)  # a Python system's payloads()/operation_ids() must return
    id_strategy(system)  # strategies: refused here, not inside a --jobs job (exit 3)
    schema = getattr(system, "payload_schema", None)
    pattern = getattr(system, "operation_id_pattern", None)
    try:
        if schema is not None and not callable(getattr(system, "payloads", None)):
            check_schema(schema)
        if pattern is not None and not callable(getattr(system, "operation_ids", None)):
            check_pattern(pattern)
    except UsageError as error:
        raise UsageError(f"system {system.name!r}: {error}") from None


def check_schema(schema: Any) -> None:
    """A payload schema must be a valid JSON Schema from which a payload can be drawn."""
    if schema is False:
        raise UsageError("payload_schema is false: it admits no payload")
    try:
        from jsonschema.exceptions import SchemaError  # type: ignore[import-untyped,unused-ignore]
        from jsonschema.validators import validator_for  # type: ignore[import-untyped,unused-ignore]
    except ImportError:  # hypothesis-jsonschema requires jsonschema; schema_strategy says so
        pass
    else:
        try:
            validator_for(schema).check_schema(schema)
        except SchemaError as error:
            where = "".join(f"[{json_key(part)}]" for part in error.absolute_path)
            raise UsageError(f"payload_schema{where} is not a valid JSON Schema: "
                             f"{error.message[:200]}") from None
    _check_part(schema, "payload_schema")


def json_key(part: Any) -> str:
    return str(part) if isinstance(part, int) else repr(part)


def _check_part(part: Any, where: str) -> None:
    """Draw from each schema :func:`schema_strategy` builds (every part of one built here
    first, since an optional property or one option may never be drawn at the top, and
    the innermost part that cannot be drawn is the one to name)."""
    for below, sub in _built_parts(part):
        _check_part(sub, where + below)
    problem = _draw_problem(schema_strategy(part))
    if problem is not None and "'many' object has no attribute" in problem:
        raise UsageError(
            f"{where} holds an object that faultlab does not draw itself, and "
            f"hypothesis-jsonschema {_version('hypothesis-jsonschema')} draws no object under "
            f"Hypothesis {_version('hypothesis')} ({problem.removeprefix('is not usable: ')}): "
            "write its objects with only the keywords "
            f"{', '.join(sorted(OBJECT_KEYWORDS))} (arrays: "
            f"{', '.join(sorted(ARRAY_KEYWORDS))}), alone or in anyOf/oneOf")
    if problem is not None:
        raise UsageError(f"{where} {problem}")


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version(distribution)
    except PackageNotFoundError:  # pragma: no cover - imported, so installed
        return "?"


def check_pattern(pattern: str) -> None:
    """An id pattern must match some usable operation id that Hypothesis can draw."""
    problem = _draw_problem(pattern_strategy(pattern))
    if problem is None:
        return
    if _has_lookbehind(pattern):
        raise UsageError(f"operation_ids {pattern!r} uses a look-behind assertion, from "
                         "which no id can be drawn (st.from_regex cannot generate for it)")
    raise UsageError(f"operation_ids {pattern!r} {problem.replace('value', 'operation id')}"
                     " (an id is 1 to 200 characters, none of them a control character)")


def _draw_problem(strategy: st.SearchStrategy[Any]) -> str | None:
    """Why no value can be drawn from ``strategy``, or None once one was (deterministic:
    a derandomized search that stops at the first value)."""
    from hypothesis import HealthCheck, Phase, find, settings
    from hypothesis.errors import NoSuchExample, Unsatisfiable

    chosen = settings(database=None, max_examples=50, derandomize=True, deadline=None,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    try:
        find(strategy, lambda _: True, settings=chosen)
    except (NoSuchExample, Unsatisfiable):
        return "admits no value faultlab could draw"
    except UsageError:
        raise
    except Exception as error:  # the libraries raise many kinds (even AssertionError)
        text = str(error).strip().splitlines()[0][:200] if str(error).strip() else ""
        return f"is not usable: {type(error).__name__}{': ' + text if text else ''}"
    return None


def _has_lookbehind(pattern: str) -> bool:
    try:
        from re import _parser as parser
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser

    def walk(items: Any) -> bool:
        for op, av in items:
            name = str(op)
            if name in ("ASSERT", "ASSERT_NOT") and av[0] == -1:
                return True
            for value in av if isinstance(av, (list, tuple)) else (av,):
                if isinstance(value, parser.SubPattern) and walk(value):
                    return True
                if isinstance(value, (list, tuple)) and any(
                        isinstance(v, parser.SubPattern) and walk(v) for v in value):
                    return True
        return False

    try:
        return walk(parser.parse(pattern))
    except Exception:  # already compiled once: only a guess at the cause is lost
        return False
