"""A shared corpus in Redis, for shards on many machines (``--corpus redis://HOST:PORT/DB``).

What the database holds, all under the ``faultlab:`` prefix:

* ``faultlab:corpus`` - the marker, a string naming the format. faultlab writes only
  to a database that carries it, or to an empty database (where it sets it with its
  first write, so a run refused before it wrote leaves the database empty): a database
  holding anything else is refused, as a store without faultlab's ``application_id``
  is;
* ``faultlab:finding:<name>`` - one trace per finding, the JSON a corpus file holds,
  where ``<name>`` is :func:`faultlab.corpus.files.finding_name` (system, invariant and a hash
  of the trace's steps): shards that find the same trace write one key (``SET NX``);
  findings have no expiry and stay until someone deletes them;
* ``faultlab:findings`` - a set of those names, for ``corpus export`` and ``status``;
* ``faultlab:shard:<K>/<N>`` - a hash of live counters per shard (system, seed, state,
  examples, steps, SIGKILLs, findings, seconds, updated), refreshed about once a second
  while the shard runs. A ``running`` entry expires :data:`RUNNING_TTL_SECONDS` after its
  last update, so a run that died (killed, its machine gone, its Redis connection lost)
  does not look alive for long; an ended one (``done``, ``found``, ``flaky``, ``vacuous``,
  ``failed``, ``interrupted``) expires :data:`COUNTER_TTL_SECONDS` after it, so the
  status table shows the current cluster and not last month's.

Every command has a socket timeout (:data:`SOCKET_TIMEOUT_SECONDS`, one retry): a server
that stops answering in the middle of a run fails the run within seconds, never hangs it.

Needs the ``redis`` client (the ``redis`` extra).
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.base.inputs import MAX_FILE_BYTES, parse_json
from faultlab.base.messages import printable

if TYPE_CHECKING:
    from faultlab.trace import Trace

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
#: A ``running`` shard's counters: refreshed about once a second while steps run, so five
#: minutes without an update outlasts a slow step or a shrink and still ends a dead run's
#: entry the same hour.
RUNNING_TTL_SECONDS = 300
#: Per command, connecting included; a command is tried once more after a timeout or a
#: lost connection, so a server that stalls costs a run at most about twice this.
SOCKET_TIMEOUT_SECONDS = 2.0
_SAFE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*\.json")
COUNTER_FIELDS = ("system", "seed", "state", "examples", "steps", "sigkills", "findings",
                  "seconds", "updated")
#: The counters ``corpus status`` computes with: each must read as a finite number.
NUMERIC_FIELDS = ("examples", "steps", "sigkills", "findings", "seconds", "updated")


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
    try:
        parsed = urlparse(text)
        parsed.hostname, parsed.port  # noqa: B018 - both parse now, raising for "[::1"
        if "[" in parsed.netloc:  # Python 3.10 takes "[zz]" for a host; 3.11 refuses it
            import ipaddress

            ipaddress.ip_address(parsed.hostname or "")
    except ValueError as error:
        raise UsageError(f"{text!r}: not a redis://HOST:PORT/DB URL ({error})") from None
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
            from redis.backoff import NoBackoff
            from redis.retry import Retry
        except ImportError:
            raise UsageError("a redis:// corpus needs the redis client: "
                             "pip install 'faultlab[redis]'") from None
        self.address = parse_url(url)
        # the client's own default retries (three, with backoff, in redis-py 6) made a
        # stalled server cost about 20 s a command: one retry, no backoff
        self.client: Any = redis.Redis(host=self.address.host, port=self.address.port,
                                       db=self.address.db,
                                       socket_timeout=SOCKET_TIMEOUT_SECONDS,
                                       socket_connect_timeout=SOCKET_TIMEOUT_SECONDS,
                                       retry=Retry(NoBackoff(), 1), decode_responses=True)
        self._errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        #: Whether the database carries the marker. An empty one is only checked here and
        #: marked by the first write (:meth:`_claim`): a run refused after this (bad input
        #: found later, a PostgreSQL server it cannot reach) leaves nothing in it.
        self.claimed = False
        try:
            marker = self.client.get(MARKER_KEY)
            if marker is None:
                if not create:
                    raise UsageError(f"{self.address}: not a faultlab corpus (no {MARKER_KEY})")
                if self.client.dbsize() != 0:
                    raise UsageError(f"{self.address}: the database holds keys and no "
                                     f"{MARKER_KEY} marker; refusing to write to it")
            elif marker != MARKER:
                raise UsageError(f"{self.address}: {MARKER_KEY} is {marker!r}, not {MARKER!r}")
            else:
                self.claimed = True
        except UsageError:
            self.client.close()
            raise
        except self._errors as error:
            self.client.close()
            raise UsageError(f"{self.address}: {error}") from None

    def _claim(self) -> None:
        """Mark the empty database as a corpus before the first write, in one atomic step:
        shards started together must not see each other's first keys as someone else's
        data (check, then set, raced in CI)."""
        if self.claimed:
            return
        marker = self.client.eval(  # type: ignore[no-untyped-call,unused-ignore]
            _CLAIM, 1, MARKER_KEY, MARKER)
        if marker != MARKER:
            raise ExecutionError(f"{self.address}: the database was given other keys while "
                                 "this run started; refusing to write to it")
        self.claimed = True

    def close(self) -> None:
        self.client.close()

    def went_away(self, error: BaseException) -> str:
        """The one line a run that lost this server ends with (exit 3)."""
        return f"the Redis corpus at {self.address} went away: {printable(str(error), 200)}"

    def save(self, trace_json: dict[str, Any], name: str) -> tuple[str, bool]:
        """Store a finding under its content name; False when it was already there."""
        try:
            self._claim()
            new = bool(self.client.set(FINDING_PREFIX + name, json.dumps(trace_json), nx=True))
            self.client.sadd(FINDINGS, name)
        except self._errors as error:
            raise ExecutionError(f"{self.went_away(error)} (saving {name})") from None
        return f"{self.address}#{name}", new

    def _read(self, what: str, call: Callable[[], Any]) -> Any:
        """One read; a key of the wrong type is bad input (exit 2), a lost server a run
        failure (exit 3)."""
        import redis

        try:
            return call()
        except redis.ResponseError as error:  # WRONGTYPE: someone else's key, or a hand edit
            raise UsageError(f"{self.address}: cannot read {what}: {error}") from None
        except self._errors as error:
            raise ExecutionError(f"{self.address}: cannot read {what}: {error}") from None

    def findings(self) -> dict[str, dict[str, Any]]:
        """Every finding's trace document, checked as a trace file is (untrusted: anyone who
        can reach the server can write it): bounded size and depth, strict JSON, an object,
        and a plain file name."""
        names = sorted(self._read(FINDINGS, lambda: self.client.smembers(FINDINGS)))
        for name in names:
            if not _SAFE_NAME.fullmatch(name):
                raise UsageError(f"{self.address}: finding name {printable(name, 80)!r} is "
                                 "not a plain file name")
        values = self._read("the findings", lambda: self.client.mget(
            [FINDING_PREFIX + n for n in names])) if names else []
        found: dict[str, dict[str, Any]] = {}
        for name, value in zip(names, values, strict=True):
            if value is None:
                continue
            where = f"{self.address}: {FINDING_PREFIX}{name}"
            if len(value) > MAX_FILE_BYTES:
                raise UsageError(f"{where}: {len(value)} characters; a trace has at most "
                                 f"{MAX_FILE_BYTES} bytes")
            data = parse_json(value, f"{where}: not a faultlab trace")
            if not isinstance(data, dict):
                raise UsageError(f"{where}: not a faultlab trace (a JSON "
                                 f"{_json_kind(data)}, not an object)")
            found[name] = data
        return found

    def traces(self) -> dict[str, Trace]:
        """Every finding as a trace (either version), each checked completely."""
        from faultlab.trace import Trace

        return {name: Trace.from_json(data, source=f"{self.address}: {FINDING_PREFIX}{name}")
                for name, data in self.findings().items()}

    def update_counters(self, shard: str, fields: dict[str, Any]) -> None:
        """Refresh this shard's live counters, and their expiry by state (a ``running``
        entry lives :data:`RUNNING_TTL_SECONDS`): one transaction, so no entry is ever left
        without an expiry."""
        key = SHARD_PREFIX + shard
        ttl = RUNNING_TTL_SECONDS if fields.get("state") == "running" else COUNTER_TTL_SECONDS
        try:
            self._claim()
            pipeline = self.client.pipeline(transaction=True)
            pipeline.hset(key, mapping={**{k: str(v) for k, v in fields.items()},
                                        "updated": f"{time.time():.0f}"})
            pipeline.expire(key, ttl)
            pipeline.execute()
        except self._errors as error:
            raise ExecutionError(self.went_away(error)) from None

    def counters(self) -> dict[str, dict[str, str]]:
        """Each shard's counters; a counter that is not a number is refused (exit 2)."""
        shards = sorted(k[len(SHARD_PREFIX):] for k in self._read(
            "the shards", lambda: list(self.client.scan_iter(SHARD_PREFIX + "*"))))
        found: dict[str, dict[str, str]] = {}
        for shard in shards:
            key = SHARD_PREFIX + shard
            fields: dict[str, str] = self._read(key, partial(self.client.hgetall, key))
            for name in NUMERIC_FIELDS:
                value = fields.get(name)
                if value is not None and not _is_number(value):
                    raise UsageError(f"{self.address}: {printable(key, 80)}: counter {name} "
                                     f"is {printable(value, 40)!r}, not a number")
            found[shard] = fields
        return found


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def _json_kind(value: Any) -> str:
    return {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(
        type(value), "number")


def export(corpus: RedisCorpus, directory: Path) -> tuple[list[Path], list[Path]]:
    """Write every finding as an ordinary trace file named by its content; a file of that
    name already there is left alone (the same name is the same trace). Returns the files
    written and the ones left alone. Every finding (name and trace) is checked before the
    directory is made or a file written: a bad one refuses the export with nothing created."""
    from faultlab.trace import is_trace_file, write_json_atomically

    traces = corpus.traces()  # either trace version: concurrent explores save here too
    present = [directory / name for name in traces if os.path.lexists(directory / name)]
    for path in present:  # the same name is the same trace, if it is a trace at all
        if not is_trace_file(path):
            raise UsageError(f"{path}: exists and is not a faultlab trace; exported nothing")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise ExecutionError(f"cannot create {directory}: {error.strerror or error}") from None
    written = []
    for name, trace in traces.items():
        path = directory / name
        if path in present:
            continue
        write_json_atomically(path, trace.to_json())
        written.append(path)
    return written, present
