"""Where faultlab finds each field it reads in a command-line worker's response.

A program faultlab has never seen prints its own JSON: its dispatcher may report
the service it started under ``downstream`` instead of ``service``, or
acknowledge an accept as ``{"accepted": "<id>"}``. The system file's
``response_fields`` maps each field faultlab reads to a JSON Pointer (RFC 6901)
into the worker's response; the defaults are the keys faultlab's own workers
print, so a file without ``response_fields`` behaves as before.

:func:`ResponseFields.apply` rewrites a worker's response into faultlab's form
(the mapped values at faultlab's keys, everything else kept as printed) and
records every field the response should have held but did not, so a check that
needs it can say "unknown" instead of blaming the system.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from faultlab.process.records import ProcessRecord

#: Each field faultlab reads, and where faultlab's own workers print it.
DEFAULTS: dict[str, str] = {
    "accepted": "/accepted",
    "operation_id": "/operation_id",
    "result": "/result",
    "error": "/error",
    "idle": "/idle",
    "service_pid": "/service/pid",
    "service_exit_code": "/service/exit_code",
}
FIELDS = tuple(DEFAULTS)
_MISSING = object()


class PointerError(ValueError):
    """A string that is not a JSON Pointer (RFC 6901)."""


def parse_pointer(pointer: str) -> tuple[str, ...]:
    """Split a JSON Pointer into reference tokens, undoing ``~1`` (``/``) and ``~0`` (``~``)."""
    if pointer == "":
        return ()
    if not pointer.startswith("/"):
        raise PointerError(f"{pointer!r} is not a JSON Pointer (it must be empty or start "
                           "with /)")
    tokens = []
    for token in pointer[1:].split("/"):
        rest = token.replace("~0", "").replace("~1", "")
        if "~" in rest:
            raise PointerError(f"{pointer!r}: '~' must be followed by 0 or 1 (RFC 6901)")
        tokens.append(token.replace("~1", "/").replace("~0", "~"))
    return tuple(tokens)


def resolve(document: Any, pointer: str) -> Any:
    """The value ``pointer`` names in ``document``, or :data:`_MISSING` when there is none."""
    value = document
    for token in parse_pointer(pointer):
        if isinstance(value, dict):
            if token not in value:
                return _MISSING
            value = value[token]
        elif isinstance(value, list):
            if not (token == "0" or (token.isdigit() and not token.startswith("0"))):
                return _MISSING
            index = int(token)
            if index >= len(value):
                return _MISSING
            value = value[index]
        else:
            return _MISSING
    return value


def found(document: Any, pointer: str) -> bool:
    return resolve(document, pointer) is not _MISSING


def _expected(role: str, exit_code: int, get: Callable[[str], Any]) -> tuple[str, ...]:
    """The fields a response of this role and exit status must carry."""
    if exit_code < 0:
        return ()  # killed: whatever it printed is not a verdict
    if exit_code == 0:
        if role == "accept":
            return ("accepted",)
        if role == "service":
            return ("result",)
        if get("idle") is True:
            return ()
        return ("operation_id", "result", "service_pid", "service_exit_code")
    if role == "dispatch" and get("error") == "downstream_failure":
        return ("error", "service_pid", "service_exit_code")
    return ("error",)


@dataclass(frozen=True)
class ResponseFields:
    """The system file's ``response_fields``: a JSON Pointer per field (defaults filled in)."""

    pointers: Mapping[str, str] = field(default_factory=lambda: dict(DEFAULTS))

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, str]) -> ResponseFields:
        """Check every name and pointer; ValueError (PointerError) naming the bad one."""
        pointers = dict(DEFAULTS)
        for name, pointer in mapping.items():
            if name not in DEFAULTS:
                raise ValueError(f"unknown field {name!r} (fields: {', '.join(FIELDS)})")
            if not isinstance(pointer, str):
                raise ValueError(f"{name} must be a JSON Pointer string such as "
                                 f"{DEFAULTS[name]!r}")
            parse_pointer(pointer)
            pointers[name] = pointer
        return cls(pointers)

    @property
    def custom(self) -> bool:
        return dict(self.pointers) != DEFAULTS

    def apply(self, role: str, record: ProcessRecord) -> ProcessRecord:
        """The record with its response in faultlab's form and its unknown fields named."""
        raw = record.response
        if record.timed_out:
            return record

        def get(name: str) -> Any:
            value = resolve(raw, self.pointers[name]) if raw is not None else _MISSING
            return None if value is _MISSING else value

        unknown = {
            name: self.pointers[name]
            for name in _expected(role, record.exit_code, get)
            if raw is None or not found(raw, self.pointers[name])
        }
        response = raw
        if raw is not None and self.custom:
            response = self._canonical(raw)
        if response is raw and not unknown:
            return record
        return replace(
            record, response=response, unknown_fields=unknown or None,
            raw_response=raw if response is not raw else None,
        )

    def _canonical(self, raw: dict[str, Any]) -> dict[str, Any]:
        """faultlab's keys hold the mapped values; the rest of the response is kept."""
        response = copy.deepcopy(raw)
        for name in ("accepted", "operation_id", "result", "error", "idle"):
            if self.pointers[name] == DEFAULTS[name]:
                continue
            value = resolve(raw, self.pointers[name])
            if value is _MISSING:
                response.pop(name, None)
            else:
                response[name] = value
        service: dict[str, Any] = {}
        for name, key in (("service_pid", "pid"), ("service_exit_code", "exit_code")):
            value = resolve(raw, self.pointers[name])
            if value is not _MISSING:
                service[key] = value
        if service:
            response["service"] = service
        elif self.pointers["service_pid"] != DEFAULTS["service_pid"]:
            response.pop("service", None)
        return response


def describe_unknown(record: ProcessRecord, name: str, who: str) -> str | None:
    """A check's message when ``name`` was not in the response, else None."""
    unknown = record.unknown_fields or {}
    if name not in unknown:
        return None
    return (f"cannot check: {who}'s response has no {name} (nothing at JSON Pointer "
            f"{unknown[name]!r}; set response_fields.{name} in the system file)")
