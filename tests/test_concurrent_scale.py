"""``explore --concurrency N`` with the sequential explore's scale options: ``--jobs``,
``--duration``, ``--html``, and ``--statement-points`` (lanes held at sql:K / commit:K).

Every run is the real command line in a child process (its jobs are processes too);
``--shard`` with a shared Redis corpus is in ``test_redis_corpus.py``.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import ROOT

from faultlab.trace import Trace

pytestmark = pytest.mark.e2e  # an end-to-end run: tox runs it once (see tox.ini)


def faultlab(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "faultlab", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def _rows(out: str) -> dict[str, str]:
    """The summary table's rows (name -> value)."""
    rows = {}
    for line in out.splitlines():
        parts = re.split(r"\s{2,}", line.strip(), maxsplit=1)
        if len(parts) == 2:
            rows.setdefault(parts[0], parts[1])
    return rows


def test_jobs_find_the_negative_control_write_the_page_and_the_finding_replays(
    tmp_path: Path,
) -> None:
    corpus, page = tmp_path / "corpus", tmp_path / "finding.html"
    done = faultlab("explore", "--concurrency", "2", "--jobs", "2", "--no-deduplication",
                    "--examples", "40", "--quiet", "--corpus", str(corpus), "--html", str(page))
    assert done.returncode == 1, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["concurrency"] == "2" and rows["jobs"] == "2" and rows["shard"] == "0/1"
    assert int(rows["concurrent steps"]) > 0 and int(rows["processes"]) > 0
    assert "FOUND: ONE" in done.stdout and "scheduling steps" in done.stdout
    files = list(corpus.glob("reference-nodedup-ONE-*.json"))
    assert files, done.stdout
    trace = Trace.load(files[0])
    assert isinstance(trace, Trace) and trace.concurrency == 2
    assert trace.meta["jobs"] == 2 and trace.meta["job"] in (0, 1)
    assert not trace.statement_points and "statement_points" not in json.loads(
        files[0].read_text())
    replayed = faultlab("replay", *map(str, files))
    assert replayed.returncode == 0 and "every outcome matches" in replayed.stdout

    html = page.read_text()
    assert f"wrote {page}" in done.stdout
    assert 'data-lane="1"' in html and 'data-lane="2"' in html  # a timeline row per lane
    assert "ONE" in html and 'class="step violated"' in html
    assert "http://" not in html and "https://" not in html


def test_a_time_budget_stops_a_clean_concurrent_exploration_in_time(tmp_path: Path) -> None:
    """A round of 1000 examples would take minutes: the budget stops it mid-round (the
    step in flight finishes, the unfinished example is not counted), as a stop: no note
    of a flaky search (Hypothesis called about 1 stop in 2 FlakyStrategyDefinition)."""
    corpus = tmp_path / "unused-corpus-never-written"
    started = time.monotonic()
    done = faultlab("explore", "--concurrency", "2", "--duration", "3", "--examples", "1000",
                    "--quiet", "--corpus", str(corpus), timeout=60)
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout + done.stderr
    rows = _rows(done.stdout)
    assert rows["time budget (s)"] == "3.0" and rows["rounds"] == "1"
    assert rows["concurrency"] == "2" and int(rows["concurrent steps"]) > 0
    assert 0 < int(rows["examples"]) < 1000
    assert float(rows["wall time (s)"]) < 3.0 + 4.0  # the step in flight, then the end
    assert elapsed < 20, elapsed  # interpreter start and teardown included
    assert "clean: no invariant failed" in done.stdout
    assert "note:" not in done.stdout, done.stdout
    assert not corpus.exists()


def test_statement_points_are_recorded_and_replay_identically(tmp_path: Path) -> None:
    """A lane held at sql:K: the trace says so, and every replay holds it at the same
    statement (the same table, PIDs aside, and the same verdict)."""
    corpus = tmp_path / "corpus"
    done = faultlab("explore", "--concurrency", "2", "--statement-points",
                    "--no-deduplication", "--examples", "40", "--quiet",
                    "--corpus", str(corpus))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "statement points" in _rows(done.stdout)
    (path,) = corpus.glob("*.json")
    trace = Trace.load(path)
    assert isinstance(trace, Trace) and trace.statement_points
    assert json.loads(path.read_text())["statement_points"] is True
    tables = set()
    for _ in range(3):
        replayed = faultlab("replay", str(path))
        assert replayed.returncode == 0 and "every outcome matches" in replayed.stdout
        assert re.search(r"@(sql|commit):\d", replayed.stdout), replayed.stdout
        # PIDs (300 and up) masked, and the spaces that pad them: a PID one digit longer
        # (the kernel's counter passing 99999) widens its column
        tables.add(re.sub(r" +", " ", re.sub(r"\b\d{3,}\b", "PID", replayed.stdout)))
    assert len(tables) == 1


@pytest.mark.parametrize("args, message", [
    (["--statement-points", "--system",
      str(ROOT / "examples" / "standalone_outbox" / "system.json")], "Python system"),
    (["--concurrency", "2", "--statement-points", "--system",
      str(ROOT / "examples" / "standalone_outbox" / "system.json")], "Python system"),
])
def test_statement_points_refused_where_they_cannot_hold(tmp_path: Path, args: list[str],
                                                         message: str) -> None:
    corpus = tmp_path / "corpus"
    done = faultlab("explore", *args, "--corpus", str(corpus), "--quiet")
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not corpus.exists()


@pytest.mark.parametrize("path", sorted((ROOT / "corpus").glob("*.json")), ids=lambda p: p.name)
def test_corpus_files_read_back_to_the_same_document(path: Path) -> None:
    """Files written before ``statement_points`` existed read as traces without them and
    write back unchanged (the field is only written when true), whichever version."""
    data = json.loads(path.read_text())
    trace = Trace.load(path)
    assert trace.to_json() == data
    assert "statement_points" not in data and not getattr(trace, "statement_points", False)


def test_statement_points_must_be_a_boolean(tmp_path: Path) -> None:
    from faultlab.base.errors import UsageError

    path = next(p for p in sorted((ROOT / "corpus").glob("*.json"))
                if json.loads(p.read_text())["version"] == 2)
    data = json.loads(path.read_text())
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**data, "statement_points": "yes"}))
    with pytest.raises(UsageError, match="statement_points must be a boolean"):
        Trace.load(bad)
    good = tmp_path / "good.json"
    good.write_text(json.dumps({**data, "statement_points": True}))
    loaded = Trace.load(good)
    assert isinstance(loaded, Trace) and loaded.statement_points
    assert loaded.to_json()["statement_points"] is True
