"""Generated data (faultlab/search/data.py): each kind of awkward value is really drawn, payloads
are judged by canonical JSON, and shrunk findings come back with simple data."""

from __future__ import annotations

import json
import math
import shutil
import unicodedata
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from faultlab.base.canonical import canonical_json
from faultlab.base.errors import UsageError
from faultlab.process.spawn import Spawner
from faultlab.run.executor import execute
from faultlab.search import data
from faultlab.search.simplify import simplify_data
from faultlab.system import System, load_system
from faultlab.system.command import CommandSystem
from faultlab.trace import Step

# derandomised: a random run shrank one payload only part of the way once (a loaded machine)
FIND = settings(max_examples=5000, database=None, derandomize=True,
                suppress_health_check=list(HealthCheck))


def _strings(value: Any) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list):
        return [s for item in value for s in _strings(item)]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in [k, *_strings(v)]]
    return []


def _numbers(value: Any) -> list[int | float]:
    if isinstance(value, bool):
        return []
    if isinstance(value, int | float):
        return [value]
    if isinstance(value, list):
        return [n for item in value for n in _numbers(item)]
    if isinstance(value, dict):
        return [n for v in value.values() for n in _numbers(v)]
    return []


def _payload_with(predicate: Any) -> Any:
    return find(data.default_payloads(), predicate, settings=FIND)


def test_payloads_include_non_bmp_text() -> None:
    found = _payload_with(lambda p: any(ord(c) > 0xFFFF for s in _strings(p) for c in s))
    assert any(ord(c) > 0xFFFF for s in _strings(found) for c in s)


def test_payloads_include_combining_marks_and_rtl() -> None:
    combining = _payload_with(
        lambda p: any(unicodedata.combining(c) for s in _strings(p) for c in s))
    assert any(unicodedata.normalize("NFC", s) != s for s in _strings(combining)) or any(
        unicodedata.combining(c) for s in _strings(combining) for c in s)
    rtl = _payload_with(
        lambda p: any(unicodedata.bidirectional(c) in ("R", "AL", "RLO")
                      for s in _strings(p) for c in s))
    assert rtl


def test_payloads_include_kilobyte_strings() -> None:
    found = _payload_with(lambda p: any(len(s) >= 1024 for s in _strings(p)))
    assert max(len(s) for s in _strings(found)) >= 1024


def test_payloads_include_integers_beyond_2_53_and_negatives() -> None:
    big = _payload_with(lambda p: any(isinstance(n, int) and abs(n) > 2**53 for n in _numbers(p)))
    assert any(isinstance(n, int) and abs(n) > 2**53 for n in _numbers(big))
    exact = _payload_with(lambda p: 2**53 + 1 in _numbers(p))
    assert json.loads(canonical_json(exact)) == exact  # canonical JSON keeps it exact
    assert _payload_with(lambda p: any(n < 0 for n in _numbers(p)))


def test_payloads_include_floats_a_lossy_encoder_changes() -> None:
    found = _payload_with(lambda p: any(
        isinstance(n, float) and math.isfinite(n) and float(f"{n:.6g}") != n
        for n in _numbers(p)))
    assert any(isinstance(n, float) and float(f"{n:.6g}") != n for n in _numbers(found))


def test_payloads_include_nesting_and_the_empty_object() -> None:
    assert _payload_with(lambda p: p == {}) == {}
    nested = _payload_with(lambda p: any(isinstance(v, dict | list) and v
                                         for v in (p.values() if isinstance(p, dict) else [])))
    assert nested


def test_payloads_shrink_to_simple_values() -> None:
    assert find(data.default_payloads(), lambda p: True, settings=FIND) == {}
    big = _payload_with(lambda p: any(isinstance(n, int) and abs(n) > 2**53 for n in _numbers(p)))
    assert [abs(n) for n in _numbers(big)] == [2**53 + 1]
    assert len(json.dumps(big)) < 60, big


def _ids_until(predicate: Any, existing: list[str]) -> str:
    @st.composite
    def ids(draw: Any) -> str:
        return data.new_operation_id(draw(st.data()), existing, len(existing) + 1,
                                     salt=str(draw(st.integers(0, 1000))))

    return find(ids(), predicate, settings=FIND)


def test_ids_include_a_case_only_pair() -> None:
    found = _ids_until(lambda i: i != "op-1" and i.lower() == "op-1", ["op-1"])
    assert found == "OP-1"


def test_ids_include_unicode_quotes_sql_and_long_ones() -> None:
    assert any(not c.isascii() for c in _ids_until(lambda i: not i.isascii(), ["op-1"]))
    assert "'" in _ids_until(lambda i: "'" in i, ["op-1"])
    assert "DROP TABLE" in _ids_until(lambda i: "DROP TABLE" in i, ["op-1"])
    assert len(_ids_until(lambda i: len(i) > 64, ["op-1"])) > 64
    # an id that sorts before op-1 although made later
    assert _ids_until(lambda i: i < "op-1" and not i.startswith("op-1"), ["op-1"]) < "op-1"


@given(st.data(), st.lists(st.sampled_from(["op-1", "OP-1", "op-2", "x"]), unique=True))
@settings(max_examples=200, database=None)
def test_ids_are_new_and_mostly_op_n(drawn: st.DataObject, existing: list[str]) -> None:
    new = data.new_operation_id(drawn, existing, len(existing) + 1)
    assert new not in existing and "\x00" not in new and new


def test_a_python_system_declares_its_own_data() -> None:
    system = load_system("systems_for_tests:DeclaredDataOutbox")
    payload = find(data.payload_strategy(system), lambda p: True, settings=FIND)
    assert payload == {"sku": "A"}
    strategy = data.id_strategy(system)
    assert strategy is not None
    assert find(strategy, lambda i: True, settings=FIND).startswith("ORD-")


def test_a_command_system_declares_a_schema_and_an_id_pattern() -> None:
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 7}},
              "required": ["n"], "additionalProperties": False}

    class Declared:
        name = "declared"
        payload_schema = schema
        operation_id_pattern = r"[a-z]{3}-[0-9]{2}"

    payload = find(data.payload_strategy(Declared()), lambda p: p["n"] > 10, settings=FIND)
    assert set(payload) == {"n"} and payload["n"] > 10
    strategy = data.id_strategy(Declared())
    assert strategy is not None
    found = find(strategy, lambda i: True, settings=FIND)
    assert len(found) == 6 and found[3] == "-"


#: Object schemas users write, beyond properties and required: every one is drawn by
#: faultlab itself, and everything drawn must validate.
DRAWN_SCHEMAS: tuple[dict[str, Any], ...] = (
    {"type": "object", "properties": {"sku": {"type": "string"}}, "required": ["sku"],
     "minProperties": 1},
    {"anyOf": [{"type": "object"}]},
    {"type": "object", "minProperties": 3, "maxProperties": 4,
     "properties": {"a": {"type": "integer"}}},
    {"type": "object", "required": ["lines"], "properties": {"lines": {
        "type": "array", "minItems": 1, "maxItems": 3, "uniqueItems": True,
        "items": {"type": "object", "required": ["q"],
                  "properties": {"q": {"type": "integer", "minimum": 1}}}}}},
    {"oneOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
               {"type": "object", "properties": {"b": {"type": "integer"}}, "required": ["b"]}]},
    {"type": "object", "additionalProperties": {"type": "boolean"}, "minProperties": 2},
)


@pytest.mark.parametrize("schema", DRAWN_SCHEMAS)
def test_object_schemas_are_drawn_and_what_is_drawn_validates(schema: dict[str, Any]) -> None:
    pytest.importorskip("hypothesis_jsonschema")
    from jsonschema.validators import validator_for

    data.check_schema(schema)
    valid = validator_for(schema)(schema).is_valid
    distinct: set[str] = set()

    @settings(max_examples=60, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(data.schema_strategy(schema))
    def drawn_validates(value: Any) -> None:
        assert valid(value), value
        distinct.add(canonical_json(value))

    drawn_validates()
    assert len(distinct) > 10  # not one value over and over


def test_an_object_schema_neither_library_draws_is_named_in_one_line() -> None:
    """An object with keywords faultlab does not build is left to hypothesis-jsonschema,
    which cannot draw objects under recent Hypothesis: the refusal names the part and says
    which keywords to use; where the library draws it, what it draws validates."""
    pytest.importorskip("hypothesis_jsonschema")
    from jsonschema.validators import validator_for

    inner = {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}
    schema = {"type": "object", "properties": {"x": inner}}
    try:
        data.check_schema(schema)
    except UsageError as error:
        message = str(error)
        assert "\n" not in message
        assert message.startswith("payload_schema.properties['x'] holds an object that "
                                  "faultlab does not draw itself, and hypothesis-jsonschema ")
        assert "write its objects with only the keywords additionalProperties, " \
            "maxProperties, minProperties, properties, required, type" in message
    else:  # a hypothesis-jsonschema that draws objects again
        valid = validator_for(inner)(inner).is_valid
        assert valid(find(data.schema_strategy(inner), lambda v: bool(v), settings=FIND))


def test_a_bad_pattern_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="not a regular expression"):
        data.pattern_strategy("([")


def test_command_system_reads_payload_schema_and_ids(tmp_path: Path) -> None:
    example = Path(__file__).resolve().parent.parent / "examples" / "standalone_outbox"
    copy = tmp_path / "standalone"
    shutil.copytree(example, copy, ignore=shutil.ignore_patterns("corpus", "__pycache__"))
    description = json.loads((copy / "system.json").read_text())
    description["payload_schema"] = {"type": "object", "properties": {"title": {"type": "string"}}}
    description["operation_ids"] = "order-[0-9]{1,4}"
    (copy / "declared.json").write_text(json.dumps(description))
    system = load_system(str(copy / "declared.json"))
    assert isinstance(system, CommandSystem)
    assert system.payload_schema == description["payload_schema"]
    assert system.operation_id_pattern == "order-[0-9]{1,4}"
    description["operation_ids"] = "(["
    (copy / "bad.json").write_text(json.dumps(description))
    with pytest.raises(UsageError, match="operation_ids is not a regular expression"):
        load_system(str(copy / "bad.json"))


def test_canonical_json_decides_payload_equality() -> None:
    """What the README states: byte equality of canonical JSON."""
    assert canonical_json({"b": 1, "a": 2**53 + 1}) == '{"a":9007199254740993,"b":1}'
    assert canonical_json({"x": 1}) != canonical_json({"x": 1.0})
    assert canonical_json("caf\u00e9") != canonical_json("cafe\u0301")
    assert canonical_json(0.1) == "0.1" and json.loads(canonical_json(5e-324)) == 5e-324


def test_reference_is_clean_on_awkward_data(fork_spawner: Spawner, reference: System) -> None:
    """The data no generated value may break on the reference (no false alarm)."""
    awkward = {"title": "cafe\u0301 \U0001f4e6 \u0641", "count": 2**64 + 1, "amount": 0.1,
               "neg": -(2**53 + 1), "big": 1.7976931348623157e308, "tiny": 5e-324,
               "nested": {"a": [[], {}, None, True]}, "long": "x" * 4096}
    steps = [Step("accept", "op-1", awkward), Step("accept", "OP-1", awkward),
             Step("accept", "op-1'; DROP TABLE operations; --", {}),
             Step("dispatch", crash="after_downstream_commit"),
             Step("service", "OP-1", awkward)]
    execution = execute(reference, steps, fork_spawner, settle=True)
    assert execution.verdict.clean, execution.violations
    tickets = execution.observations[-1].snapshot.tickets
    assert sorted(t.operation_id for t in tickets) == sorted(
        ["op-1", "OP-1", "op-1'; DROP TABLE operations; --"])
    assert {t.payload for t in tickets if t.operation_id != "op-1'; DROP TABLE operations; --"} \
        == {canonical_json(awkward)}


def test_simplify_data_renames_ids_and_simplifies_payloads() -> None:
    """A candidate 'fails' when some payload has an integer beyond 2^53: the result keeps
    exactly that, as 2^53+1, and nothing else."""
    calls: list[list[Step]] = []

    def attempt(candidate: list[Step]) -> list[Step] | None:
        calls.append(candidate)
        big = any(isinstance(n, int) and abs(n) > 2**53
                  for s in candidate if s.payload is not None for n in _numbers(s.payload))
        return candidate if big else None

    steps = [Step("accept", "op-1'x", {"title": "\U0001f4e6" * 30, "n": 12345678901234567890,
                                      "tags": ["a", "b"]}),
             Step("dispatch"),
             Step("service", "op-1'x", {"title": "\U0001f4e6" * 30, "n": 12345678901234567890,
                                        "tags": ["a", "b"], "revision": 1})]
    simplified = simplify_data(steps, attempt)
    assert simplified[0] == Step("accept", "op-1", {"n": 2**53 + 1})
    assert simplified[2] == Step("service", "op-1", {"n": 2**53 + 1, "revision": 1})
    assert len(calls) <= 60
