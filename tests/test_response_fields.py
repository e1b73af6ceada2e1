"""``response_fields``: a program that prints its own JSON, read through JSON Pointers.

examples/unmodified_outbox/outbox_lab.py stands for a program faultlab has never
seen: its dispatcher reports the service it started under ``downstream`` and an
accept answers ``{"accepted": "<id>"}``. With ``response_fields`` it passes the
five scenarios, explores clean and is caught without deduplication; without
them, the service PID is reported unknown (the check cannot run), not wrong.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from faultlab.base.errors import UsageError
from faultlab.process.records import ProcessRecord
from faultlab.process.spawn import child_environment
from faultlab.system.command import load_command_system
from faultlab.system.fields import (
    DEFAULTS,
    PointerError,
    ResponseFields,
    found,
    parse_pointer,
    resolve,
)

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "unmodified_outbox"
MAPPED = EXAMPLE / "system.json"
UNMAPPED = EXAMPLE / "system-no-fields.json"
SCENARIOS = ("crash_before_dispatch", "crash_after_downstream_commit", "deduplication_disabled",
             "crash_during_acceptance", "changed_payload_rejected")


def faultlab(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        env=child_environment(), timeout=300, check=False, cwd=ROOT,
    )


# --- JSON Pointer (RFC 6901) ---------------------------------------------------------------------

RFC_DOCUMENT: dict[str, Any] = {
    "foo": ["bar", "baz"], "": 0, "a/b": 1, "c%d": 2, "e^f": 3, "g|h": 4, "i\\j": 5,
    'k"l': 6, " ": 7, "m~n": 8,
}


@pytest.mark.parametrize(("pointer", "value"), [
    ("", RFC_DOCUMENT), ("/foo", ["bar", "baz"]), ("/foo/0", "bar"), ("/", 0), ("/a~1b", 1),
    ("/c%d", 2), ("/e^f", 3), ("/g|h", 4), ("/i\\j", 5), ('/k"l', 6), ("/ ", 7), ("/m~0n", 8),
])
def test_pointers_resolve_as_rfc_6901_section_5_says(pointer: str, value: Any) -> None:
    assert resolve(RFC_DOCUMENT, pointer) == value


@pytest.mark.parametrize("pointer", ["/nope", "/foo/2", "/foo/01", "/foo/-", "/foo/0/x", "/a/b"])
def test_pointers_to_nothing_are_missing(pointer: str) -> None:
    assert not found(RFC_DOCUMENT, pointer)


@pytest.mark.parametrize("pointer", ["foo", "/a~2", "/~"])
def test_malformed_pointers_are_refused(pointer: str) -> None:
    with pytest.raises(PointerError):
        parse_pointer(pointer)


def _record(response: dict[str, Any] | None, exit_code: int = 0) -> ProcessRecord:
    return ProcessRecord(pid=10, exit_code=exit_code, response=response, stdout="", stderr="",
                         elapsed=0.0)


def test_mapped_fields_land_at_faultlabs_keys_and_the_printed_response_is_kept() -> None:
    fields = ResponseFields.from_mapping({"service_pid": "/downstream/pid",
                                          "service_exit_code": "/downstream/exit_code"})
    printed = {"operation_id": "op-1", "result": {"ticket_id": 1},
               "downstream": {"pid": 77, "exit_code": 0}}
    record = fields.apply("dispatch", _record(printed))
    assert record.response == {**printed, "service": {"pid": 77, "exit_code": 0}}
    assert record.raw_response == printed
    assert record.unknown_fields is None
    idle = fields.apply("dispatch", _record({"idle": True}))
    assert idle.response == {"idle": True} and idle.unknown_fields is None


def test_fields_a_response_lacks_are_named_with_their_pointer() -> None:
    fields = ResponseFields()
    record = fields.apply("dispatch", _record({"operation_id": "op-1", "result": {}}))
    assert record.unknown_fields == {"service_pid": "/service/pid",
                                     "service_exit_code": "/service/exit_code"}
    assert fields.apply("accept", _record({"ok": 1})).unknown_fields == {"accepted": "/accepted"}
    assert fields.apply("service", _record({}, 3)).unknown_fields == {"error": "/error"}
    killed = fields.apply("dispatch", _record(None, -9))
    assert killed.unknown_fields is None  # a killed worker owes no answer


@pytest.mark.parametrize(("mapping", "words"), [
    ({"service_pidd": "/x"}, ["response_fields", "unknown field 'service_pidd'"]),
    ({"service_pid": "downstream/pid"}, ["response_fields", "not a JSON Pointer"]),
    ({"result": 3}, ["response_fields", "result must be a JSON Pointer"]),
])
def test_bad_response_fields_are_a_one_line_usage_error(
    mapping: dict[str, Any], words: list[str], tmp_path: Path
) -> None:
    data = json.loads(MAPPED.read_text())
    data["response_fields"] = mapping
    (tmp_path / "outbox_lab.py").write_bytes((EXAMPLE / "outbox_lab.py").read_bytes())
    path = tmp_path / "system.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as raised:
        load_command_system(str(path))
    for word in words:
        assert word in str(raised.value)
    before = sorted(p.name for p in tmp_path.iterdir())
    result = faultlab("suite", "--system", str(path), "--examples", "0")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and words[1] in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == before


def test_defaults_are_the_keys_faultlabs_own_workers_print() -> None:
    assert ResponseFields().pointers == DEFAULTS
    assert not ResponseFields().custom


# --- the unmodified program ----------------------------------------------------------------------


def test_unmodified_program_passes_the_five_scenarios_with_response_fields(
    tmp_path: Path,
) -> None:
    output = tmp_path / "results.json"
    result = faultlab("suite", "--system", str(MAPPED), "--examples", "0", "--output",
                      str(output))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS: 5 scenarios" in result.stdout
    evidence = json.loads(output.read_text())
    assert evidence["passed"] is True
    assert sorted(evidence["scenarios"]) == sorted(SCENARIOS)
    for name in ("crash_before_dispatch", "crash_after_downstream_commit",
                 "deduplication_disabled"):
        scenario = evidence["scenarios"][name]
        recovery = scenario["recovery"]
        printed = recovery["printed_response"]
        # the three-PID check read the service PID the program printed under /downstream/pid
        assert "service" not in printed
        assert recovery["response"]["service"] == printed["downstream"]
        pids = {scenario["crash"]["pid"], recovery["pid"], printed["downstream"]["pid"]}
        assert len(pids) == 3 and all(isinstance(pid, int) and pid > 0 for pid in pids)
        assert printed["downstream"]["exit_code"] == 0
    accept = evidence["scenarios"]["crash_during_acceptance"]["acceptance"]
    assert accept["response"] == {"accepted": "operation-001", "state": "pending"}


def test_without_response_fields_the_service_pid_is_unknown_not_wrong(tmp_path: Path) -> None:
    output = tmp_path / "results.json"
    result = faultlab("suite", "--system", str(UNMAPPED), "--examples", "0", "--output",
                      str(output))
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL:" not in result.stdout  # nothing says the program is wrong
    assert "PASS: 5 scenarios" not in result.stdout
    unknown = [line for line in result.stdout.splitlines() if line.startswith("UNKNOWN: ")]
    assert len(unknown) == 3
    assert all("has no service_pid" in line and "'/service/pid'" in line for line in unknown)
    evidence = json.loads(output.read_text())
    assert evidence["passed"] is False
    scenario = evidence["scenarios"]["crash_before_dispatch"]
    assert scenario["failures"] == []
    assert scenario["unknown"] and "response_fields.service_pid" in scenario["unknown"][0]
    assert scenario["recovery"]["unknown_fields"] == {"service_pid": "/service/pid",
                                                      "service_exit_code": "/service/exit_code"}
    assert evidence["scenarios"]["crash_during_acceptance"]["passed"] is True


EXPLORE = ("explore", "--system", str(MAPPED), "--no-statement-points", "--steps", "6",
           "--seed", "1", "--quiet")


def test_unmodified_program_explores_clean(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab(*EXPLORE, "--examples", "10", "--corpus", str(corpus))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "clean: no invariant failed" in result.stdout
    assert not corpus.exists()


def test_unmodified_program_is_caught_without_deduplication(tmp_path: Path) -> None:
    corpus = tmp_path / "corpus"
    result = faultlab(*EXPLORE, "--no-deduplication", "--examples", "10", "--corpus",
                      str(corpus))
    assert result.returncode == 1, result.stdout + result.stderr
    (found,) = corpus.iterdir()
    trace = json.loads(found.read_text())
    assert trace["expected"]["invariants"][0] == "ONE"
    assert len(trace["steps"]) == 3
    replay = faultlab("replay", str(found), "--system", str(MAPPED))  # named: not built in
    assert replay.returncode == 0, replay.stdout + replay.stderr
