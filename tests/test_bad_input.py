"""Every bad input is one line on stderr, exit status 2, and nothing created or changed.

The basic cases first (each once a traceback, exit 1, or a file created),
then hostile trace and system files beyond that list, output paths faultlab must not
replace, and exit status 3 for a run that failed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT

from faultlab.base.output import write_json
from faultlab.cli import main
from faultlab.process.spawn import child_environment

STANDALONE = ROOT / "examples" / "standalone_outbox" / "system.json"


def tree(*roots: Path) -> dict[str, tuple[int, int]]:
    """Every path below the roots with its type and size: what 'nothing changed' compares."""
    found: dict[str, tuple[int, int]] = {}
    for root in roots:
        for directory, names, files in os.walk(root):
            for name in names + files:
                path = os.path.join(directory, name)
                info = os.lstat(path)
                found[path] = (stat.S_IFMT(info.st_mode), info.st_size)
    return found


def run_directories() -> list[str]:
    shm = Path("/dev/shm")
    mine = f"faultlab-{os.getpid()}-"
    return sorted(p.name for p in shm.iterdir() if p.name.startswith(mine)) if shm.is_dir() else []


def refused(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str,
            watch: tuple[Path, ...] = ()) -> str:
    """Run the CLI in this process; assert exit 2, one line naming the problem, no change."""
    before = tree(*watch), run_directories(), sorted(os.listdir(ROOT))
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (out, err)
    assert out == ""
    assert len(err.splitlines()) == 1 and err.startswith("faultlab: error: "), err
    for word in words:
        assert word in err, err
    assert (tree(*watch), run_directories(), sorted(os.listdir(ROOT))) == before
    return err


def trace_file(tmp_path: Path, steps: Any = None, **fields: Any) -> Path:
    data = {"format": "faultlab-trace", "version": 1, "system": "reference",
            "deduplication": True,
            "steps": steps if steps is not None else [{"action": "dispatch"}], **fields}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    return path


# --- the basic cases ----------------------------------------------------------------------


def test_output_into_proc_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """As root, os.access says /proc is writable; the real probe says otherwise."""
    refused(capsys, ["suite", "--examples", "0", "--output", "/proc/version"],
            "--output /proc/version", "cannot create a file in /proc")


def test_a_trace_nested_five_thousand_levels_deep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = tmp_path / "deep.json"
    path.write_text('{"format": "faultlab-trace", "version": 1, "system": "reference", '
                    '"deduplication": true, "steps": [{"action": "accept", '
                    '"operation_id": "op-1", "payload": ' + "[" * 5000 + "]" * 5000 + "}]}")
    refused(capsys, ["replay", str(path)], "nested more than 64 levels", watch=(tmp_path,))


def test_a_payload_nested_deeper_than_faultlab_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Deep enough to parse, too deep to be a payload (it would blow up a worker instead)."""
    payload = json.loads("[" * 200 + "]" * 200)
    path = trace_file(tmp_path, [{"action": "accept", "operation_id": "op-1",
                                  "payload": payload}])
    refused(capsys, ["replay", str(path)], "nested more than 64 levels", watch=(tmp_path,))


def test_version_true_is_not_version_one(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    path = trace_file(tmp_path, version=True)
    refused(capsys, ["replay", str(path)], "unsupported trace version true",
            watch=(tmp_path,))


def test_an_operation_id_with_a_lone_surrogate(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.json"
    path.write_text('{"format": "faultlab-trace", "version": 1, "system": "reference", '
                    '"deduplication": true, "steps": [{"action": "accept", '
                    '"operation_id": "op-\\udc80", "payload": {"title": "x"}}]}')
    refused(capsys, ["replay", str(path)], "lone surrogate", watch=(tmp_path,))


def test_a_non_utf8_operation_id_on_the_worker_command_line(tmp_path: Path,
                                                             reference: Any) -> None:
    reference.initialise(tmp_path)
    before = tree(tmp_path)
    done = subprocess.run(
        [os.fsencode(sys.executable), b"-m", b"faultlab", b"worker", b"accept",
         b"--directory", os.fsencode(tmp_path), b"--operation-id", b"op-\xff",
         b"--payload", b'{"title":"x"}'],
        capture_output=True, cwd=ROOT, env=child_environment(), timeout=60,
    )
    err = done.stderr.decode()
    assert done.returncode == 2, err
    assert done.stdout == b"" and len(err.splitlines()) == 1, err
    assert "--operation-id" in err and "UTF-8" in err
    assert tree(tmp_path) == before


def test_an_operation_id_with_nul_for_a_command_line_system(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    path = trace_file(tmp_path, [{"action": "accept", "operation_id": "op\u00001",
                                  "payload": {"title": "x"}}], system=str(STANDALONE))
    refused(capsys, ["replay", str(path)], "control character", watch=(tmp_path,))


def test_a_system_module_that_calls_sys_exit_at_import(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    refused(capsys, ["explore", "--system", "exits_at_import:SYSTEM", "--corpus",
                     str(tmp_path / "corpus")], "called sys.exit(3)", watch=(tmp_path,))


@pytest.mark.parametrize("query", [
    "VACUUM INTO '{target}'",
    "ATTACH '{target}' AS elsewhere",
])
def test_a_snapshot_query_cannot_create_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], query: str,
) -> None:
    data = json.loads(STANDALONE.read_text())
    target = tmp_path / "created-by-the-query.db"
    data["snapshot"]["receipts"]["query"] = query.format(target=target)
    system = tmp_path / "system" / "system.json"
    system.parent.mkdir()
    system.write_text(json.dumps(data))
    (system.parent / "outbox.py").symlink_to(STANDALONE.parent / "outbox.py")
    refused(capsys, ["systems", "--system", str(system)], "may only read",
            watch=(tmp_path,))
    assert not target.exists()


# --- beyond the list: hostile trace files ----------------------------------------------------


@pytest.mark.parametrize(("content", "words"), [
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "accept", "operation_id": "op-1", '
     '"payload": {"n": NaN}}]}', "NaN is not valid JSON"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "accept", "operation_id": "op-1", '
     '"payload": {"n": 1e999}}]}', "out of range"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "accept", "operation_id": "op-1", '
     '"payload": {"n": ' + "9" * 5000 + "}}]}", "digits"),
    ('{"format": "faultlab-trace", "version": 1.0, "system": "reference", '
     '"deduplication": true, "steps": []}', "unsupported trace version 1.0"),
    ('{"format": "faultlab-trace", "version": 2.0, "system": "reference", "concurrency": 2, '
     '"deduplication": true, "steps": []}', "unsupported trace version 2.0"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": "dispatch"}', "steps must be a list"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [], "settle": "no"}', "settle must be a boolean"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [], "expected": {"clean": false, "step": 1e300, '
     '"invariants": ["ONE"]}}', "expected.step"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [], "expected": {"clean": false, "step": 2, '
     '"invariants": "ONE"}}', "expected.invariants"),
    ('{"format": "faultlab-trace", "version": 1, "system": 7, '
     '"deduplication": true, "steps": []}', "system must be a string"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "accept", "operation_id": 12, '
     '"payload": {}}]}', "operation_id must be a non-empty string"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "accept", "operation_id": "' + "x" * 300
     + '", "payload": {}}]}', "at most 200"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "dispatch", "crash": ["sql:1"]}]}',
     "step crash must be a point name"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [], "meta": [1]}', "meta must be an object"),
    # hand edits the next save would drop unseen, and traces that would test nothing
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "accept", "operation_id": "op-1", '
     '"payload": {}, "lane": 2}]}', "an accept step takes no lane"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "dispatch", "payload": {}}]}',
     "a dispatch step takes no payload"),
    ('{"format": "faultlab-trace", "version": 2, "system": "reference", "concurrency": 2, '
     '"deduplication": true, "steps": [{"action": "run", "lane": 1, "role": "dispatch", '
     '"payload": {}}]}', "a run step takes no payload"),
    ('{"format": "faultlab-trace", "version": 2, "system": "reference", "concurrency": 2, '
     '"deduplication": true, "steps": [{"action": "run", "lane": 1, "role": "accept", '
     '"operation_id": "op-1", "payload": {}, "priority": 1}]}', "a run step takes no priority"),
    ('{"format": "faultlab-trace", "version": 2, "system": "reference", "concurrency": 2, '
     '"deduplication": true, "steps": [{"action": "tick", "ticks": 5, "note": "x"}]}',
     "a tick step takes no note"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "steps": [{"action": "dispatch"}], "expected": {"clean": false, '
     '"final": "yes", "invariants": ["LIVE"]}}', "expected.final' must be a boolean"),
    ('{"format": "faultlab-trace", "version": 1, "system": "reference", '
     '"deduplication": true, "settle": false, "steps": [{"action": "dispatch"}], "expected": '
     '{"clean": false, "final": true, "invariants": ["LIVE"]}}', "'settle' is false"),
    ('{"format": "faultlab-trace", "version": 2, "system": "reference", "concurrency": 2, '
     '"deduplication": true, "steps": [{"action": "tick", "ticks": 5}]}',
     "only moves the clock: it would test nothing"),
])
def test_hostile_trace_files(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                             content: str, words: str) -> None:
    path = tmp_path / "hostile.json"
    path.write_text(content)
    refused(capsys, ["replay", str(path)], words, watch=(tmp_path,))


#: A trace document of each version with every key it needs (and one step).
_WHOLE = {1: {"format": "faultlab-trace", "version": 1, "system": "reference",
              "deduplication": True, "steps": [{"action": "dispatch"}]},
          2: {"format": "faultlab-trace", "version": 2, "system": "reference",
              "deduplication": True, "concurrency": 2,
              "steps": [{"action": "run", "lane": 1, "role": "dispatch"}]}}


@pytest.mark.parametrize(("version", "key"), [
    (1, "system"), (1, "deduplication"), (1, "steps"),
    (2, "system"), (2, "deduplication"), (2, "steps"), (2, "concurrency"),
])
def test_a_trace_without_a_key_it_needs_names_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], version: int, key: str) -> None:
    """It once said ``corrupt trace: 'system'``, a bare KeyError's text."""
    data = {k: v for k, v in _WHOLE[version].items() if k != key}
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(data))
    err = refused(capsys, ["replay", str(path)], watch=(tmp_path,))
    assert err == f'faultlab: error: {path}: trace has no "{key}"\n'


def test_a_nested_object_without_a_key_it_needs_names_the_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = trace_file(tmp_path, violations=[{"message": "m"}])
    err = refused(capsys, ["replay", str(path)], watch=(tmp_path,))
    assert err == f"faultlab: error: {path}: corrupt trace: missing key 'invariant'\n"


@pytest.mark.parametrize("version", [1, 2])
def test_a_trace_with_no_steps_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          version: int) -> None:
    """A trace with no steps tests nothing: it once replayed as ``verdict: clean; expected
    clean: matches``, exit 0."""
    path = tmp_path / "empty.json"
    path.write_text(json.dumps({**_WHOLE[version], "steps": [], "expected": {"clean": True}}))
    err = refused(capsys, ["replay", str(path)], watch=(tmp_path,))
    assert err == f"faultlab: error: {path}: trace has no steps: it would test nothing\n"


def test_a_postgres_value_that_is_no_connection_string_is_one_clean_line(
        tmp_path: Path) -> None:
    """psycopg's message ends in a newline, once shown escaped as a literal ``\\x0a``."""
    assert _explore_pg_refused(tmp_path, "zzz") == (
        'faultlab: error: --postgres: not a connection string: missing "=" after "zzz" in '
        'connection info string\n')


def _explore_pg_refused(tmp_path: Path, dsn: str) -> str:
    """``explore --system reference-pg --postgres DSN`` in ``tmp_path``: refused (exit 2,
    nothing created); its stderr."""
    pytest.importorskip("psycopg")
    done = subprocess.run([sys.executable, "-m", "faultlab", "explore", "--system",
                           "reference-pg", "--postgres", dsn, "--corpus",
                           str(tmp_path / "corpus")],
                          cwd=tmp_path, env=child_environment(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stdout == "" and sorted(os.listdir(tmp_path)) == []
    return done.stderr


def test_a_connect_timeout_psycopg_refuses_is_refused_before_any_database(
        tmp_path: Path) -> None:
    """faultlab's first connection passed its own connect_timeout, so a bad one in the
    string showed only at the next: a traceback, exit 1 (the finding status), after a
    database was created and dropped. The string names no reachable server: were it read
    past the timeout, the failure would be a connection's, not this line."""
    assert _explore_pg_refused(tmp_path, "host=127.0.0.1 port=1 connect_timeout=abc") == (
        "faultlab: error: --postgres: not a connection string: bad value for "
        "connect_timeout: 'abc'\n")


def test_a_gigantic_trace_file_is_refused_unread(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "huge.json"
    with open(path, "wb") as stream:
        stream.truncate(64 << 20)  # sparse: 64 MiB of nothing, costs no disk
    refused(capsys, ["replay", str(path)], "at most", watch=(tmp_path,))


def test_a_fifo_as_a_trace_does_not_block(tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "trace.json"
    os.mkfifo(fifo)
    started = time.monotonic()
    refused(capsys, ["replay", str(fifo)], "not a regular file", watch=(tmp_path,))
    assert time.monotonic() - started < 5
    refused(capsys, ["replay", "/dev/zero"], "not a regular file")


def test_a_hostile_system_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "system.json"
    path.write_text('{"name": ' + "[" * 3000 + "]" * 3000 + "}")
    refused(capsys, ["systems", "--system", str(path)], "nested more than 64 levels",
            watch=(tmp_path,))
    path.write_text('{"name": "\\ud800"}')
    refused(capsys, ["systems", "--system", str(path)], "lone surrogate", watch=(tmp_path,))


# --- output paths ---------------------------------------------------------------------------


def test_output_that_is_not_a_regular_file_is_never_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    refused(capsys, ["suite", "--examples", "0", "--output", str(fifo)], "a FIFO",
            watch=(tmp_path,))
    refused(capsys, ["suite", "--examples", "0", "--output", str(tmp_path)], "a directory",
            watch=(tmp_path,))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    refused(capsys, ["suite", "--examples", "0", "--output", str(dangling)],
            "does not exist", watch=(tmp_path,))
    if os.geteuid() == 0:  # a device node of our own (the /dev/null device), never /dev/full
        device = tmp_path / "device"
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
        refused(capsys, ["suite", "--examples", "0", "--output", str(device)],
                "a character device", watch=(tmp_path,))
        assert stat.S_ISCHR(os.lstat(device).st_mode)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and dangling.is_symlink()


def test_output_through_a_symbolic_link_replaces_the_target_not_the_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    target = tmp_path / "evidence.json"
    target.write_text('{"experiment": "two-store outbox crash recovery (faultlab suite)"}')
    target.chmod(0o640)
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert main(["suite", "--examples", "0", "--output", str(link)]) == 0
    capsys.readouterr()
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert json.loads(target.read_text())["passed"] is True
    assert stat.S_IMODE(target.stat().st_mode) == 0o640  # a replaced file keeps its mode
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evidence.json", "link.json"]


@pytest.mark.parametrize(("umask", "mode"), [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_a_new_output_file_honours_the_umask(tmp_path: Path, umask: int, mode: int) -> None:
    previous = os.umask(umask)
    try:
        write_json(tmp_path / "new.json", {"a": 1})
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "new.json").stat().st_mode) == mode


def test_an_unwritable_corpus_is_refused_before_the_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """Once found only after the search, losing the finding with a traceback."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    refused(capsys, ["explore", "--no-deduplication", "--corpus", str(blocker / "corpus")],
            "is a regular file", watch=(tmp_path,))
    refused(capsys, ["explore", "--no-deduplication", "--corpus", "/proc/faultlab-corpus"],
            "cannot create files in /proc")
    refused(capsys, ["enumerate", "--corpus", "/proc/faultlab-corpus"],
            "cannot create files in /proc")


def test_a_negative_suite_budget_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """0 skips the exploration phase; a negative number is a mistake, not another 0."""
    refused(capsys, ["suite", "--examples", "-1"], "--examples", "must be at least 0")


@pytest.mark.parametrize("command", [["explore", "--examples", "2"], ["enumerate"],
                                     ["suite", "--examples", "0"]])
def test_postgres_for_a_system_on_sqlite_is_refused(
    command: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """--postgres would change nothing for SQLite stores: a mistake, not a silent no-op
    (a DSN that names no server: the refusal comes before any connection)."""
    refused(capsys, [*command, "--system", "no-dedup", "--postgres", "host=/nonexistent",
                     *(["--corpus", str(tmp_path / "c")] if command[0] != "suite" else [])],
            "system 'no-dedup' keeps its stores in SQLite files", watch=(tmp_path,))


def test_enumerate_jobs_are_capped_as_explores_are(capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["enumerate", "--jobs", "100000"], "--jobs", "at most 64")


def test_a_system_that_is_some_other_file_is_named_as_such(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    notes = tmp_path / "notes.md"
    notes.write_text("# not a system\n")
    refused(capsys, ["explore", "--system", str(notes), "--corpus", str(tmp_path / "c")],
            "exists, but is not a .json system description", watch=(tmp_path,))


def test_a_corpus_under_a_missing_directory_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A mistyped --corpus is an error, not a tree of new directories (the corpus directory
    itself is created when its first finding is saved, inside a directory that exists)."""
    corpus = tmp_path / "no" / "such" / "corpus"
    for command in (["explore", "--no-deduplication", "--examples", "2"],
                    ["enumerate", "--operations", "1", "--crashes", "0"],
                    ["mutants", "--only", "no-dedup"]):
        refused(capsys, [*command, "--corpus", str(corpus)],
                f"parent directory {tmp_path / 'no' / 'such'} does not exist",
                watch=(tmp_path,))
    assert list(tmp_path.iterdir()) == []


def test_suite_directory_must_be_creatable(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    refused(capsys, ["suite", "--examples", "0", "--directory", "/proc/faultlab-stores"],
            "not writable")


# --- exit status 3: the run itself failed ----------------------------------------------------


def test_suite_deadline_reaches_the_scenarios_and_a_missed_deadline_exits_3(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """HangingOutbox's accept sleeps for an hour: --deadline 1 must end it in about 1 s
    (not the 15 s default), and a missed deadline is a failed run (3), not a finding (1)."""
    started = time.monotonic()
    code = main(["suite", "--system", "systems_for_tests:HangingOutbox", "--deadline", "1",
                 "--examples", "0"])
    elapsed = time.monotonic() - started
    out, err = capsys.readouterr()
    assert code == 3, (out, err)
    assert 1.0 <= elapsed < 8, elapsed
    assert "missed its 1s deadline" in err and len(err.splitlines()) == 1, err
    assert "PASS" not in out and "FOUND" not in out


@pytest.mark.parametrize(("argv", "judges"), [
    (["explore"], True), (["enumerate"], True), (["mutants"], True), (["suite"], True),
    (["replay"], True), (["init"], False), (["systems"], False), (["corpus"], False),
    (["corpus", "status"], False), (["corpus", "export"], False),
])
def test_every_help_ends_with_the_exit_statuses_it_can_give(
    argv: list[str], judges: bool, capsys: pytest.CaptureFixture[str],
) -> None:
    """A command that judges nothing never exits 1, and its --help does not say it might."""
    with pytest.raises(SystemExit) as exited:
        main([*argv, "--help"])
    assert exited.value.code == 0
    statuses = capsys.readouterr().out.split("exit status:")[1]
    assert ("  1  " in statuses) is judges
    assert "  2        bad input" in statuses and "130/143" in statuses


# --- a snapshot query that never ends --------------------------------------------------------

#: Loops for ever once the outbox has a row; on the empty stores of the load-time probe it
#: ends at once, so the system loads.
LOOPING_OUTBOX = (
    "WITH RECURSIVE spin(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM spin "
    "WHERE EXISTS (SELECT 1 FROM outbox_events)) "
    "SELECT request_key, CASE status WHEN 'NEW' THEN 'pending' WHEN 'SENT' THEN 'complete' "
    "ELSE status END FROM outbox_events WHERE (SELECT count(*) FROM spin) > 0"
)


def looping_system(tmp_path: Path) -> Path:
    data = json.loads(STANDALONE.read_text())
    data["snapshot"]["outbox"]["query"] = LOOPING_OUTBOX
    system = tmp_path / "looping" / "system.json"
    system.parent.mkdir()
    system.write_text(json.dumps(data))
    (system.parent / "outbox.py").symlink_to(STANDALONE.parent / "outbox.py")
    return system


def explore_looping(tmp_path: Path, deadline: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "faultlab", "explore", "--system", str(looping_system(tmp_path)),
         "--examples", "3", "--deadline", deadline, "--corpus", str(tmp_path / "corpus"),
         "--quiet"],
        cwd=ROOT, env=child_environment(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)


def test_a_snapshot_query_that_never_ends_misses_its_deadline_exit_3(tmp_path: Path) -> None:
    started = time.monotonic()
    process = explore_looping(tmp_path, "1")
    out, err = process.communicate(timeout=120)
    assert process.returncode == 3, (out, err)
    assert len(err.splitlines()) == 1, err
    assert "the outbox snapshot query on store caller ran longer than its 1s deadline" in err
    assert "FOUND" not in out and "clean" not in out
    assert time.monotonic() - started < 60
    assert not (tmp_path / "corpus").exists()


@pytest.mark.parametrize(("signum", "status"), [(2, 130), (15, 143)])
def test_a_snapshot_query_that_never_ends_stops_on_a_signal(tmp_path: Path, signum: int,
                                                           status: int) -> None:
    process = explore_looping(tmp_path, "600")
    time.sleep(4)  # the system loaded, an accept ran, the snapshot query spins
    assert process.poll() is None, process.communicate()
    sent = time.monotonic()
    process.send_signal(signum)
    out, err = process.communicate(timeout=30)
    assert process.returncode == status, (out, err)
    assert time.monotonic() - sent < 10
    assert "interrupted by SIG" in err and len(err.splitlines()) == 1, err


@pytest.mark.e2e  # an exploration on the server; every interpreter runs the SQLite twin
def test_a_postgres_snapshot_query_that_never_ends_is_cancelled_exit_3(tmp_path: Path) -> None:
    """The same loop on a real PostgreSQL server: statement_timeout cancels it."""
    from test_postgres import DSN, _admin

    _admin().close()  # skips (or fails) without a server
    source = ROOT / "examples" / "postgres_outbox" / "system.json"
    data = json.loads(source.read_text())
    data["snapshot"]["outbox"]["query"] = LOOPING_OUTBOX
    system = tmp_path / "looping-pg" / "system.json"
    system.parent.mkdir()
    system.write_text(json.dumps(data))
    (system.parent / "outbox.py").symlink_to(source.parent / "outbox.py")
    done = subprocess.run(
        [sys.executable, "-m", "faultlab", "explore", "--system", str(system),
         "--no-statement-points", "--examples", "2", "--deadline", "2", "--corpus",
         str(tmp_path / "corpus"), "--quiet", *(["--postgres", DSN] if DSN else [])],
        cwd=ROOT, env=child_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 3, done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert "store caller: snapshot query 'outbox' ran longer than its 2s deadline" in done.stderr
    assert not (tmp_path / "corpus").exists()


# --- system files, declared data and --jobs ---------------------------------------------------


def system_variant(tmp_path: Path, change: Any) -> Path:
    """The standalone outbox's system file, changed by ``change(data)``."""
    data = json.loads(STANDALONE.read_text())
    change(data)
    system = tmp_path / "variant" / "system.json"
    system.parent.mkdir()
    system.write_text(json.dumps(data))
    (system.parent / "outbox.py").symlink_to(STANDALONE.parent / "outbox.py")
    return system


@pytest.mark.parametrize(("change", "words"), [
    (lambda d: d["commands"]["dispatch"].append("a\x00b"),
     "commands.dispatch[5] contains a NUL character"),
    (lambda d: d.__setitem__("environment", {"TOKEN": "a\x00b"}),
     "environment.TOKEN contains a NUL character"),
    (lambda d: d["crash"]["arguments"].append("\x00{crash}"),
     "crash.arguments[2] contains a NUL character"),
    (lambda d: d.__setitem__("payload_schema", {"$ref": "#"}),
     "payload_schema is not usable: HypothesisRefResolutionError"),
    (lambda d: d.__setitem__("payload_schema", False), "payload_schema is false"),
    (lambda d: d.__setitem__("payload_schema", {"type": "nonsense"}),
     "payload_schema['type'] is not a valid JSON Schema"),
    (lambda d: d.__setitem__("payload_schema", {"type": "integer", "minimum": 5, "maximum": 1}),
     "payload_schema admits no value"),
    (lambda d: d.__setitem__("payload_schema", {"type": "object", "properties": {
        "n": {"type": "integer", "minimum": 5, "maximum": 1}}}),
     "payload_schema.properties['n'] admits no value"),
    (lambda d: d.__setitem__("operation_ids", "(?<=a)b"), "uses a look-behind assertion"),
    (lambda d: d.__setitem__("operation_ids", "a\\bb"), "admits no operation id"),
    (lambda d: d.__setitem__("operation_ids", "\\x00"), "admits no operation id"),
])
def test_a_system_file_nothing_can_run_or_be_drawn_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], change: Any, words: str,
) -> None:
    """Each was a traceback and exit 1 (the finding status) from inside the search."""
    system = system_variant(tmp_path, change)
    refused(capsys, ["explore", "--system", str(system), "--examples", "2", "--corpus",
                     str(tmp_path / "corpus")], words, watch=(tmp_path,))
    refused(capsys, ["explore", "--jobs", "2", "--system", str(system), "--examples", "2",
                     "--corpus", str(tmp_path / "corpus")], words, watch=(tmp_path,))


def test_bad_input_inside_a_job_is_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A Python system's payloads() that returns no strategy: exit 3 from a --jobs job,
    where a single stream said exit 2."""
    (tmp_path / "no_strategy.py").write_text(
        "from faultlab.system.builtin.reference import ReferenceOutbox\n"
        "class NoStrategy(ReferenceOutbox):\n"
        "    name = 'no-strategy'\n"
        "    def payloads(self):\n"
        "        return 42\n"
        "SYSTEM = NoStrategy()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for jobs in ("1", "2"):
        refused(capsys, ["explore", "--system", "no_strategy:SYSTEM", "--jobs", jobs,
                         "--examples", "2", "--corpus", str(tmp_path / "corpus")],
                "payloads() must return a strategy", watch=(tmp_path,))


def test_bad_input_a_job_finds_is_carried_out_as_exit_2() -> None:
    """What a job process reports as bad input (its UsageError) stays bad input."""
    from faultlab.base.errors import UsageError
    from faultlab.search.rounds import Plan, run_jobs

    plan = Plan(system="no-such-module-anywhere:SYSTEM", deduplication=True, seed=0,
                examples=2, steps=2, statement_points=True, hypothesis_shrink=False,
                spawn="fork", jobs=2)
    with pytest.raises(UsageError, match="no-such-module-anywhere"):
        run_jobs(plan)


@pytest.mark.parametrize("jobs", ["100000", "65"])
def test_jobs_has_an_upper_bound(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                 jobs: str) -> None:
    for command in (["explore", "--corpus", str(tmp_path / "corpus")], ["mutants"]):
        refused(capsys, [*command, "--jobs", jobs], "--jobs", "at most 64", watch=(tmp_path,))


@pytest.mark.parametrize("lanes", [0, 9, True, 2.0])
def test_the_api_refuses_lanes_no_trace_could_hold_before_anything_runs(lanes: object) -> None:
    """A trace holds 1 to 8 lanes: explore and state_machine refuse any other number in one
    line, as ``--concurrency`` does, and run nothing (no run directory of this process is
    made: its name carries this process's pid)."""
    import faultlab
    from faultlab.base.errors import UsageError
    from faultlab.stores.sqlite import scratch_directory

    scratch = Path(scratch_directory() or tempfile.gettempdir())

    def ours() -> set[str]:
        return {p.name for p in scratch.iterdir()
                if p.name.startswith((f"faultlab-{os.getpid()}-",
                                      f"faultlab-lanes-{os.getpid()}-"))}

    before = ours()
    for call in (lambda: faultlab.explore("reference", concurrency=lanes, examples=1),
                 lambda: faultlab.state_machine("reference", concurrency=lanes)):
        with pytest.raises(UsageError, match="concurrency must be an integer from 1 to 8"):
            call()
    assert ours() == before


@pytest.mark.parametrize("option", ["--seed", "--examples"])
def test_an_integer_no_trace_could_record_is_refused_before_the_search(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str,
) -> None:
    """A finding records --seed and --examples, and replay refuses a trace whose integers
    have more than 100 digits: such a value is refused up front, not saved as a finding
    nothing can replay."""
    corpus = tmp_path / "corpus"
    refused(capsys, ["explore", "--system", "no-dedup", option, "1" * 150,
                     "--corpus", str(corpus)], option, "at most 100 digits",
            watch=(tmp_path,))
    assert not corpus.exists()


@pytest.mark.parametrize("url", ["redis://[::1/0", "redis://[zz]:1/0", "redis://h:99999/0"])
def test_a_malformed_redis_url_is_one_line(capsys: pytest.CaptureFixture[str],
                                           url: str) -> None:
    refused(capsys, ["corpus", "status", url], url, "not a redis://HOST:PORT/DB URL")
    refused(capsys, ["explore", "--corpus", url, "--examples", "1"], url)


def test_init_where_no_directory_can_be_made_is_one_line(
        capsys: pytest.CaptureFixture[str]) -> None:
    """Root passes every os.access check, even in /proc: the mkdir itself is what fails."""
    err = refused(capsys, ["init", "/proc/faultlab-init-test"], "/proc/faultlab-init-test")
    assert "cannot create the directory" in err or "not writable" in err, err


@pytest.mark.parametrize("special", ["/dev/zero", "fifo"])
def test_a_payload_file_that_never_ends_is_refused_unread(
        tmp_path: Path, reference: Any, special: str) -> None:
    """A payload file is read like a trace file: a regular file of bounded size (read
    whole, /dev/zero once grew a worker to the whole machine's memory; a FIFO blocked)."""
    stores = tmp_path / "stores"
    stores.mkdir()
    reference.initialise(stores)
    path = special
    if special == "fifo":
        path = str(tmp_path / "payload")
        os.mkfifo(path)
    before = tree(stores)
    done = subprocess.run(
        [sys.executable, "-m", "faultlab", "worker", "accept", "--directory", str(stores),
         "--operation-id", "op-1", "--payload-file", path],
        capture_output=True, text=True, cwd=ROOT, env=child_environment(), timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert done.stdout == "" and done.stderr == (
        f"faultlab: error: {path}: not a regular file; a payload file is a JSON file\n")
    assert tree(stores) == before


def test_suite_output_and_directory_on_one_path_is_refused_before_the_run(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Both are checked alone and both are fine; together the run went ahead and failed at
    its end (exit 3) after printing PASS."""
    same = tmp_path / "same"
    refused(capsys, ["suite", "--output", str(same), "--directory", str(same)],
            "the same path", watch=(tmp_path,))
