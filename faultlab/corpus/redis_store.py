"""A shared corpus in Redis, for shards on many machines (``--corpus redis://HOST:PORT/DB``).

What the database holds, all under the ``faultlab:`` prefix:

* ``faultlab:corpus`` - the marker, a string naming the format. faultlab writes only
  to a database that carries it, or to an empty database (where it sets it first): a
  database holding anything else is refused, as a store without faultlab's
  ``application_id`` is;
* ``faultlab:finding:<name>`` - one trace per finding, the JSON a corpus file holds,
  where ``<name>`` is :func:`faultlab.corpus.files.finding_name` (system, invariant and a hash
  of the trace's steps): shards that find the same trace write one key (``SET NX``);
  findings have no expiry and stay until someone deletes them;
* ``faultlab:findings`` - a set of those names, for ``corpus export`` and ``status``;
* ``faultlab:shard:<K>/<N>`` - a hash of live counters per shard (system, seed, state,
  examples, steps, SIGKILLs, findings, seconds, updated), refreshed about once a second
  while the shard runs; it expires :data:`COUNTER_TTL_SECONDS` after the last update, so
  the status table shows the current cluster and not last month's.

Needs the ``redis`` client (the ``redis`` extra).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from faultlab.base.errors import ExecutionError, UsageError

MARKER_KEY = "faultlab:corpus"
MARKER = "faultlab-corpus 1"
#: The marker, or mark an empty database as a corpus; nil when it holds other keys.
_CLAIM = """
local marker = redis.call('GET', KEYS[1])
if marker then return marker end
if redis.call('DBSIZE') ~= 0 then return nil end
redis.call('SET', KEYS[1], ARGV[1])
return ARGV[1]
"""
FINDINGS = "faultlab:findings"
FINDING_PREFIX = "faultlab:finding:"
SHARD_PREFIX = "faultlab:shard:"
COUNTER_TTL_SECONDS = 7 * 24 * 3600
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.json")
COUNTER_FIELDS = ("system", "seed", "state", "examples", "steps", "sigkills", "findings",
                  "seconds", "updated")


def is_redis_url(text: str) -> bool:
    return text.startswith("redis://")


@dataclass(frozen=True)
class Address:
    host: str
    port: int
    db: int

    def __str__(self) -> str:
        return f"redis://{self.host}:{self.port}/{self.db}"


def parse_url(text: str) -> Address:
    """``redis://HOST:PORT/DB`` (port default 6379, database default 0)."""
    parsed = urlparse(text)
    if parsed.scheme != "redis" or not parsed.hostname:
        raise UsageError(f"{text!r}: expected redis://HOST:PORT/DB")
    if parsed.query or parsed.fragment or parsed.username or parsed.password:
        raise UsageError(f"{text!r}: expected redis://HOST:PORT/DB (no user, query or fragment)")
    path = parsed.path.strip("/") or "0"
    try:
        port = parsed.port or 6379
        db = int(path)
    except ValueError:
        raise UsageError(f"{text!r}: the port and database must be numbers") from None
    if db < 0:
        raise UsageError(f"{text!r}: the database must be a number >= 0")
    return Address(parsed.hostname, port, db)


class RedisCorpus:
    """Findings and live counters in one Redis database (see the module docstring)."""

    def __init__(self, url: str, *, create: bool) -> None:
        try:
            import redis
        except ImportError:
            raise UsageError("a redis:// corpus needs the redis client: "
                             "pip install 'faultlab[redis]'") from None
        self.address = parse_url(url)
        self.client: Any = redis.Redis(host=self.address.host, port=self.address.port,
                                       db=self.address.db, socket_timeout=5,
                                       socket_connect_timeout=5, decode_responses=True)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        try:
            marker = self.client.get(MARKER_KEY)
            if marker is None:
                if not create:
                    raise UsageError(f"{self.address}: not a faultlab corpus (no {MARKER_KEY})")
                # one atomic step: shards started together must not see each other's first
                # keys as someone else's data (check, then set, raced in CI)
                marker = self.client.eval(  # type: ignore[no-untyped-call,unused-ignore]
                    _CLAIM, 1, MARKER_KEY, MARKER)
                if marker is None:
                    raise UsageError(f"{self.address}: the database holds keys and no "
                                     f"{MARKER_KEY} marker; refusing to write to it")
            if marker != MARKER:
                raise UsageError(f"{self.address}: {MARKER_KEY} is {marker!r}, not {MARKER!r}")
        except self._errors as error:
            self.client.close()
            raise UsageError(f"{self.address}: {error}") from None

    def close(self) -> None:
        self.client.close()

    def save(self, trace_json: dict[str, Any], name: str) -> tuple[str, bool]:
        """Store a finding under its content name; False when it was already there."""
        try:
            new = bool(self.client.set(FINDING_PREFIX + name, json.dumps(trace_json), nx=True))
            self.client.sadd(FINDINGS, name)
        except self._errors as error:
            raise ExecutionError(f"{self.address}: cannot save {name}: {error}") from None
        return f"{self.address}#{name}", new

    def findings(self) -> dict[str, dict[str, Any]]:
        names = sorted(self.client.smembers(FINDINGS))
        values = self.client.mget([FINDING_PREFIX + n for n in names]) if names else []
        return {n: json.loads(v) for n, v in zip(names, values, strict=True) if v is not None}

    def update_counters(self, shard: str, fields: dict[str, Any]) -> None:
        """Refresh this shard's live counters (a lost update is retried by the next one)."""
        key = SHARD_PREFIX + shard
        try:
            self.client.hset(key, mapping={**{k: str(v) for k, v in fields.items()},
                                           "updated": f"{time.time():.0f}"})
            self.client.expire(key, COUNTER_TTL_SECONDS)
        except self._errors as error:
            raise ExecutionError(f"{self.address}: cannot update counters: {error}") from None

    def counters(self) -> dict[str, dict[str, str]]:
        shards = sorted(k[len(SHARD_PREFIX):] for k in self.client.scan_iter(SHARD_PREFIX + "*"))
        return {shard: self.client.hgetall(SHARD_PREFIX + shard) for shard in shards}


def export(corpus: RedisCorpus, directory: Path) -> tuple[list[Path], list[Path]]:
    """Write every finding as an ordinary trace file named by its content; a file of that
    name already there is left alone (the same name is the same trace). Returns the files
    written and the ones left alone."""
    from faultlab.trace import from_document, write_json_atomically

    findings = corpus.findings()  # either trace version: concurrent explores save here too
    traces = {name: from_document(data, source=name) for name, data in findings.items()}
    directory.mkdir(parents=True, exist_ok=True)
    written, present = [], []
    for name, trace in traces.items():
        if not _SAFE_NAME.fullmatch(name):
            raise UsageError(f"{corpus.address}: finding name {name!r} is not a plain file name")
        path = directory / name
        if path.exists():
            present.append(path)
            continue
        write_json_atomically(path, trace.to_json())
        written.append(path)
    return written, present
