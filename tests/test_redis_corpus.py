"""A shared Redis corpus: shards as separate processes against the local Redis server.

Needs a Redis server on 127.0.0.1:6379 and the redis client; skips when absent, fails
instead when FAULTLAB_REQUIRE_SERVICES names redis. Each test takes a database that is
empty when it starts and deletes only the keys it made.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, lock_redis_database, require_service

from faultlab.base.errors import UsageError
from faultlab.corpus.redis_store import MARKER, MARKER_KEY, parse_url

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)

HOST, PORT = "127.0.0.1", 6379


def _client(db: int) -> Any:
    try:
        import redis
    except ImportError:
        require_service("redis", "the redis client is not installed")
    client = redis.Redis(host=HOST, port=PORT, db=db, socket_connect_timeout=2,
                         decode_responses=True)
    try:
        client.ping()
    except (redis.RedisError, OSError) as error:
        require_service("redis", f"no server at {HOST}:{PORT}: {error}")
    return client


@pytest.fixture
def empty_db() -> Iterator[tuple[str, Any]]:
    """A redis://... URL of a database holding no keys, and a client on it."""
    for db in range(15, 0, -1):
        lock = lock_redis_database(db)
        if lock is None:
            continue  # another test process is using it
        client = _client(db)
        if client.dbsize() == 0:
            break
        client.close()
        lock.close()
    else:
        pytest.fail("no empty Redis database among 1-15 to test in")
    try:
        yield f"redis://{HOST}:{PORT}/{db}", client
    finally:
        keys = list(client.scan_iter("faultlab:*"))
        if keys:
            client.delete(*keys)
        client.close()
        lock.close()


def faultlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_url_parsing() -> None:
    assert str(parse_url("redis://h:1234/3")) == "redis://h:1234/3"
    assert str(parse_url("redis://h")) == "redis://h:6379/0"
    for bad in ("redis://", "redis://h:x/1", "redis://h/a", "redis://u:p@h/1", "http://h/1"):
        with pytest.raises(UsageError):
            parse_url(bad)


def test_two_shards_share_a_corpus_and_the_export_replays(
    empty_db: tuple[str, Any], tmp_path: Path,
) -> None:
    url, client = empty_db
    command = [sys.executable, "-m", "faultlab", "explore", "--no-deduplication",
               "--examples", "40", "--seed", "5", "--quiet", "--corpus", url]
    shards = [subprocess.Popen([*command, "--shard", f"{k}/2"], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for k in range(2)]
    outputs = [shard.communicate(timeout=300) for shard in shards]
    for shard, (out, err) in zip(shards, outputs, strict=True):
        assert shard.returncode == 1, out + err  # each shard found the negative control
        assert f"saved {url}#" in out
    names = client.smembers("faultlab:findings")
    assert 1 <= len(names) <= 2
    counters = {k: client.hgetall(k) for k in client.scan_iter("faultlab:shard:*")}
    assert set(counters) == {"faultlab:shard:0/2", "faultlab:shard:1/2"}
    for fields in counters.values():
        assert fields["state"] == "found" and fields["findings"] == "1"
        assert int(fields["steps"]) > 0 and 0 < client.ttl("faultlab:shard:0/2")

    # the same shard again finds the same trace: one key, "already there"
    again = faultlab(*command[3:], "--shard", "0/2")
    assert again.returncode == 1 and "already there" in again.stdout, again.stdout
    assert client.smembers("faultlab:findings") == names

    status = faultlab("corpus", "status", url)
    assert status.returncode == 0, status.stderr
    assert "0/2" in status.stdout and "1/2" in status.stdout
    assert "2 shards" in status.stdout and f"{len(names)} distinct findings" in status.stdout

    exported = tmp_path / "exported"
    done = faultlab("corpus", "export", url, str(exported))
    assert done.returncode == 0, done.stderr
    files = sorted(exported.glob("*.json"))
    assert sorted(f.name for f in files) == sorted(names)
    replayed = faultlab("replay", *map(str, files))
    assert replayed.returncode == 0, replayed.stdout  # every outcome matches its recording
    twice = faultlab("corpus", "export", url, str(exported))
    assert twice.returncode == 0 and "already there" in twice.stdout


def test_a_database_holding_other_keys_is_refused(empty_db: tuple[str, Any],
                                                  tmp_path: Path) -> None:
    url, client = empty_db
    client.set("someone:else", "theirs")
    try:
        done = faultlab("explore", "--examples", "2", "--corpus", url)
        assert done.returncode == 2
        assert "refusing to write" in done.stderr and len(done.stderr.splitlines()) == 1
        assert client.keys("*") == ["someone:else"] and client.get("someone:else") == "theirs"
        status = faultlab("corpus", "status", url)
        assert status.returncode == 2 and "not a faultlab corpus" in status.stderr
        export = faultlab("corpus", "export", url, str(tmp_path / "out"))
        assert export.returncode == 2 and not (tmp_path / "out").exists()
    finally:
        client.delete("someone:else")


def test_bad_input_found_after_the_corpus_opened_writes_nothing_to_it(
        empty_db: tuple[str, Any]) -> None:
    """A PostgreSQL server faultlab cannot reach is found once the run starts, after the
    corpus was opened: the empty database stays empty (its marker and a "failed" shard
    were once left), and on a corpus in use the shard's earlier entry stays as it was."""
    pytest.importorskip("psycopg")
    url, client = empty_db
    argv = ("explore", "--system", "reference-pg", "--postgres", "host=127.0.0.1 port=1",
            "--examples", "2", "--corpus", url)
    done = faultlab(*argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and "cannot connect" in done.stderr
    assert client.dbsize() == 0, client.keys("*")
    client.set(MARKER_KEY, MARKER)
    client.hset("faultlab:shard:0/1", mapping={"state": "done", "steps": "12"})
    done = faultlab(*argv)
    assert done.returncode == 2, done.stdout + done.stderr
    assert client.hgetall("faultlab:shard:0/1") == {"state": "done", "steps": "12"}


def test_an_unreachable_server_is_a_usage_error(tmp_path: Path) -> None:
    done = faultlab("explore", "--examples", "2", "--corpus", "redis://127.0.0.1:1/0")
    assert done.returncode == 2 and "redis://127.0.0.1:1/0" in done.stderr


@pytest.mark.slow  # 25-35 s: two explorations, shrinking, export and replay
def test_concurrent_shards_share_a_corpus_and_the_export_replays(
    empty_db: tuple[str, Any], tmp_path: Path,
) -> None:
    """``explore --concurrency 2 --shard K/2``: version 2 findings go to the shared corpus by
    content, and export as trace files that replay with their recorded verdicts."""
    url, client = empty_db
    command = [sys.executable, "-m", "faultlab", "explore", "--concurrency", "2",
               "--no-deduplication", "--examples", "30", "--quiet", "--corpus", url]
    shards = [subprocess.Popen([*command, "--shard", f"{k}/2"], cwd=ROOT, text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
              for k in range(2)]
    outputs = [shard.communicate(timeout=300) for shard in shards]
    for shard, (out, err) in zip(shards, outputs, strict=True):
        assert shard.returncode == 1, out + err
        assert f"saved {url}#" in out and "scheduling steps" in out
    names = client.smembers("faultlab:findings")
    assert 1 <= len(names) <= 2
    counters = {k: client.hgetall(k) for k in client.scan_iter("faultlab:shard:*")}
    assert set(counters) == {"faultlab:shard:0/2", "faultlab:shard:1/2"}
    assert all(fields["state"] == "found" for fields in counters.values())

    exported = tmp_path / "exported"
    done = faultlab("corpus", "export", url, str(exported))
    assert done.returncode == 0, done.stderr
    files = sorted(exported.glob("*.json"))
    assert sorted(f.name for f in files) == sorted(names)
    for path in files:
        data = json.loads(path.read_text())
        assert data["version"] == 2 and data["concurrency"] == 2
        assert "ONE" in data["expected"]["invariants"]
    replayed = faultlab("replay", *map(str, files))
    assert replayed.returncode == 0, replayed.stdout  # every outcome matches its recording
    assert f"{len(files)} trace" in replayed.stdout and "every outcome matches" in replayed.stdout


# --- a marked corpus holding bad data: one line, exit 2, nothing written ---------------------

TRACE = json.dumps({"format": "faultlab-trace", "version": 1, "system": "reference",
                    "deduplication": True, "steps": [{"action": "dispatch"}]})


def _findings(client: Any, **values: str) -> None:
    for name, value in values.items():
        client.sadd("faultlab:findings", name)
        client.set(f"faultlab:finding:{name}", value)


@pytest.mark.parametrize(("setup", "actions", "words"), [
    (lambda c: _findings(c, **{"bad.json": "{not json"}), ("export", "status"),
     "invalid JSON"),
    (lambda c: _findings(c, **{"deep.json": "[" * 100_000 + "]" * 100_000}),
     ("export", "status"), "nested more than 64 levels"),
    (lambda c: _findings(c, **{"list.json": "[1, 2]"}), ("export", "status"),
     "a JSON list, not an object"),
    (lambda c: _findings(c, **{"huge.json": " " * (17 << 20)}), ("export", "status"),
     "at most"),
    (lambda c: _findings(c, **{"a-good.json": TRACE, "../escape.json": TRACE}),
     ("export", "status"), "not a plain file name"),
    (lambda c: _findings(c, **{"a-good.json": TRACE, "b-bad.json": '{"format": 1}'}),
     ("export", "status"), "not a faultlab trace"),
    (lambda c: c.set("faultlab:findings", "a string, not a set"), ("export", "status"),
     "WRONGTYPE"),
    (lambda c: c.hset("faultlab:shard:0/1", mapping={"steps": "many"}), ("status",),
     "counter steps is 'many', not a number"),
    (lambda c: c.hset("faultlab:shard:0/1", mapping={"updated": "yesterday"}), ("status",),
     "counter updated"),
    (lambda c: c.set("faultlab:shard:0/1", "a string, not a hash"), ("status",), "WRONGTYPE"),
])
def test_a_corpus_holding_bad_data_is_refused(
    empty_db: tuple[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str],
    setup: Any, actions: tuple[str, ...], words: str,
) -> None:
    """Anyone who reaches the server can write it: its findings are checked as trace files
    are (size, depth, strict JSON, a trace), every one before the first file is written."""
    from faultlab.cli import main

    url, client = empty_db
    client.set("faultlab:corpus", "faultlab-corpus 1")
    setup(client)
    out_dir = tmp_path / "out"
    for action in actions:
        argv = ["corpus", action, url] + ([str(out_dir)] if action == "export" else [])
        code = main(argv)
        out, err = capsys.readouterr()
        assert code == 2, (action, out, err)
        assert len(err.splitlines()) == 1 and err.startswith("faultlab: error: "), err
        assert words in err, err
        assert not out_dir.exists() and out == ""


def test_a_shard_that_tested_nothing_says_vacuous_not_done(
    empty_db: tuple[str, Any], tmp_path: Path,
) -> None:
    """A shard's counters are what a cluster's operator reads: a run that accepted nothing
    exits 4 (vacuous), and its shard says ``vacuous``, never ``done``; the reference, as a
    control, says ``done``."""
    from test_vacuous import garbage_accept

    url, client = empty_db
    system = garbage_accept(tmp_path)
    done = faultlab("explore", "--system", str(system), "--examples", "4", "--steps", "3",
                    "--quiet", "--corpus", url, "--shard", "0/2")
    assert done.returncode == 4, done.stdout + done.stderr
    assert client.hget("faultlab:shard:0/2", "state") == "vacuous"
    control = faultlab("explore", "--examples", "4", "--steps", "3", "--quiet", "--corpus",
                       url, "--shard", "1/2")
    assert control.returncode == 0, control.stdout + control.stderr
    assert client.hget("faultlab:shard:1/2", "state") == "done"


def test_export_where_no_directory_can_be_made_or_a_finding_is_not_a_file(
    empty_db: tuple[str, Any], tmp_path: Path,
) -> None:
    """Under a regular file or in /proc (a traceback, exit 1, once), and a directory where a
    finding's file goes (once "1 already there", exit 0, with nothing exported): one line,
    exit 2, nothing written."""
    url, client = empty_db
    client.set(MARKER_KEY, MARKER)
    _findings(client, **{"a-good.json": TRACE})
    (tmp_path / "afile").write_text("mine\n")
    for target in (tmp_path / "afile" / "sub", Path("/proc/faultlab-export-test")):
        done = faultlab("corpus", "export", url, str(target))
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stdout == "" and len(done.stderr.splitlines()) == 1, done.stderr
        assert str(target) in done.stderr and "Traceback" not in done.stderr
    occupied = tmp_path / "out"
    (occupied / "a-good.json").mkdir(parents=True)
    done = faultlab("corpus", "export", url, str(occupied))
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr == (f"faultlab: error: {occupied / 'a-good.json'}: exists and is not a "
                           "faultlab trace; exported nothing\n")
    assert sorted(p.name for p in occupied.iterdir()) == ["a-good.json"]
    assert (tmp_path / "afile").read_text() == "mine\n"
