"""``replay --html`` and ``explore --html``: one self-contained page, rendered by a real browser.

The page is checked twice: as text (lanes, SIGKILL cells, highlighted rows, the
violated invariant at its step, nothing fetched from anywhere) and in headless
Chromium from Debian's packages (it renders every step, its script runs, the
console stays silent, a screenshot is taken). A deliberately broken page shows
that the console check catches errors.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from conftest import require_service

from faultlab.process.spawn import Spawner, child_environment
from faultlab.report import html as html_report
from faultlab.run.executor import execute
from faultlab.system import load_system
from faultlab.trace import Step, Trace

ROOT = Path(__file__).resolve().parent.parent
CORPUS = ROOT / "corpus"
#: The negative control as the README once showed it (a dispatcher killed during completion,
#: then a recovering one): this test's own copy, since regenerating corpus/ may find
#: another 3-step form (today: a direct delivery) with no service child to draw.
NEGATIVE_CONTROL = Path(__file__).resolve().parent / "traces" / "negative-control-dispatch.json"
SPLIT_COMPLETE = next(CORPUS.glob("split-complete-PAIR-*.json"))
CHROMIUM = "/usr/bin/chromium"


def faultlab(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "faultlab", *args], capture_output=True, text=True,
        env=child_environment(), timeout=300, check=False, cwd=cwd,
    )


def _report(path: Path, fork_spawner: Spawner) -> html_report.TraceReport:
    trace = Trace.load(path)
    execution = execute(load_system(trace.system), trace.steps, fork_spawner,
                        deduplication=trace.deduplication, settle=trace.settle)
    return html_report.TraceReport(str(path.name), execution, trace.system,
                                   trace.deduplication, execution.verdict.describe())


def test_page_shows_lanes_sigkill_changed_rows_and_the_violation(fork_spawner: Spawner) -> None:
    report = _report(NEGATIVE_CONTROL, fork_spawner)
    page = html_report.render([report])
    observations = report.execution.observations
    assert len(observations) == 3
    # one lane per process: three workers; the service child step 2's dispatcher started and
    # never reported (killed during completion; its ticket shows it ran), PID unknown; and
    # the service child the last dispatch reported
    lanes = re.findall(r'<tr class="lane" data-pid="([\w-]+)">', page)
    service_pid = observations[2].record.response["service"]["pid"]  # type: ignore[index]
    pids = [str(o.record.pid) for o in observations]
    assert lanes == [pids[0], pids[1], "unreported-2", pids[2], str(service_pid)]
    assert "service (child, not reported)" in page
    # the crash point fired in step 2's dispatcher: its cell, and only it, says SIGKILL
    assert observations[1].record.exit_code == -9
    assert page.count('<a class="run crashed"') == 1
    crashed_lane = re.search(rf'data-pid="{observations[1].record.pid}">(.*?)</tr>', page)
    assert crashed_lane is not None and "SIGKILL" in crashed_lane.group(1)
    # the violated invariants are marked at step 3, the other steps are ok
    marks = re.search(r'<tr class="invariants">(.*?)</tr>', page)
    assert marks is not None
    cells = re.findall(r"<td class=\"(ok|violated)\">([^<]*)</td>", marks.group(1))
    assert cells == [("ok", "ok"), ("ok", "ok"), ("violated", "DONE, ONE")]
    assert "ONE</b>: operation op-1 has 2 tickets" in page
    # every step's section, with both stores' four tables
    for index in (1, 2, 3):
        section = re.search(rf'<section class="[^"]*" id="t1-step-{index}" data-step="{index}">'
                            r"(.*?)</section>", page)
        assert section is not None
        assert re.findall(r'data-table="(\w+)"', section.group(1)) == [
            "operations", "outbox", "tickets", "receipts"]
    step3 = page.split('id="t1-step-3"')[1]
    tickets = re.search(r'data-table="tickets" data-changed="(\d)".*?<tbody>(.*?)</tbody>', step3)
    assert tickets is not None and tickets.group(1) == "1"
    rows = re.findall(r'<tr class="(\w*)"><td>(\d)</td>', tickets.group(2))
    assert rows == [("", "1"), ("added", "2")]  # ticket 2 is the duplicate: highlighted
    operations = re.search(r'data-table="operations".*?<tbody>(.*?)</tbody>', step3)
    assert operations is not None and '<tr class="changed">' in operations.group(1)


def test_page_fetches_nothing_and_escapes_what_it_shows(fork_spawner: Spawner,
                                                         reference: object) -> None:
    steps = [Step("accept", "op-<script>", {"title": "</table><script>alert(1)</script>"}),
             Step("dispatch")]
    execution = execute(load_system("reference"), steps, fork_spawner)
    page = html_report.render([html_report.TraceReport("<b>t</b>", execution, "reference")])
    assert "<script>alert" not in page and "op-<script>" not in page
    assert "&lt;/table&gt;&lt;script&gt;alert(1)" in page
    assert page.count("<script>") == 1  # the page's own, inline
    assert not re.search(r"(src|href)=\"(?!#)", page)  # only in-page links
    assert "http://" not in page and "https://" not in page and "@import" not in page
    assert "default-src 'none'" in page  # and the browser would refuse any fetch anyway


def test_replay_html_writes_one_page_for_every_trace(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    result = faultlab("replay", str(NEGATIVE_CONTROL), str(SPLIT_COMPLETE), "--html", str(page))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"wrote {page}" in result.stdout
    text = page.read_text()
    assert text.count('<article class="trace"') == 2
    assert 'id="t1-step-3"' in text and 'id="t2-step-2"' in text
    assert "PAIR" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["page.html"]  # no temporary left


def test_a_power_cut_is_shown_as_no_process(tmp_path: Path) -> None:
    """A power step runs no worker: the page drew it as a lane "pid 0 ... exit 0", and the
    table's pid and exit read 0 and 0."""
    trace = ROOT / "corpus" / "sync-off-caller-ACK-e6ccfd521d.json"
    page = tmp_path / "page.html"
    result = faultlab("replay", str(trace), "--html", str(page), "--format", "github")
    assert result.returncode == 0, result.stdout + result.stderr
    power = [line for line in result.stdout.splitlines() if "| power" in line]
    assert power and all([cell.strip() for cell in line.split("|")[5:7]] == ["-", "-"]
                         for line in power), power
    text = page.read_text()
    assert "pid 0" not in text and 'data-pid="0"' not in text
    assert "no worker process: a fault of the machine or the server" in text


@pytest.mark.e2e  # an exploration and its shrinking, then the page
def test_explore_html_writes_the_finding(tmp_path: Path) -> None:
    page = tmp_path / "finding.html"
    result = faultlab("explore", "--no-deduplication", "--examples", "20", "--seed", "0",
                      "--quiet", "--corpus", str(tmp_path / "corpus"), "--html", str(page))
    assert result.returncode == 1, result.stdout + result.stderr
    text = page.read_text()
    assert "explore finding: reference-nodedup-ONE-" in text
    assert '<td class="violated">' in text
    clean = tmp_path / "clean.html"
    result = faultlab("explore", "--examples", "3", "--quiet", "--corpus",
                      str(tmp_path / "corpus2"), "--html", str(clean))
    assert result.returncode == 0 and not clean.exists()  # nothing found, nothing written


@pytest.mark.parametrize("target", ["missing-dir/page.html", "."])
def test_bad_html_path_is_refused_before_anything_runs(target: str, tmp_path: Path) -> None:
    result = faultlab("replay", str(NEGATIVE_CONTROL), "--html", target, cwd=tmp_path)
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and "--html" in result.stderr
    assert list(tmp_path.iterdir()) == []


# --- a real browser --------------------------------------------------------------------------


def _chromium(page: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    if not Path(CHROMIUM).is_file():
        require_service("chromium", f"{CHROMIUM} is not installed (apt-get install chromium)")
    profile = tempfile.mkdtemp(prefix="faultlab-chromium-")
    try:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
             "--no-first-run", "--disable-background-networking", "--disable-component-update",
             "--disable-sync", f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0",
             *extra, page.resolve().as_uri()],
            capture_output=True, text=True, timeout=120, check=False,
        )
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def _console(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if ":CONSOLE" in line or "Uncaught" in line]


def test_chromium_renders_every_step_without_console_errors(tmp_path: Path) -> None:
    page = tmp_path / "page.html"
    result = faultlab("replay", str(NEGATIVE_CONTROL), str(SPLIT_COMPLETE), "--html", str(page))
    assert result.returncode == 0, result.stdout + result.stderr
    steps = len(Trace.load(NEGATIVE_CONTROL).steps) + len(Trace.load(SPLIT_COMPLETE).steps)

    dom = _chromium(page, "--dump-dom")
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert _console(dom.stderr) == []
    # the page's script ran to its end and counted the rendered step sections
    assert 'data-ready="yes"' in dom.stdout
    assert f'data-steps-rendered="{steps}"' in dom.stdout
    assert len(re.findall(r'<section class="step[^"]*" id="t\d-step-\d+"', dom.stdout)) == steps

    screenshot = tmp_path / "page.png"
    shot = _chromium(page, f"--screenshot={screenshot}", "--window-size=1400,2000")
    assert shot.returncode == 0, shot.stderr[-2000:]
    assert _console(shot.stderr) == []
    data = screenshot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1400, 2000)
    assert len(data) > 20_000  # a rendered page, not a blank one


def test_the_console_check_catches_a_broken_page(tmp_path: Path) -> None:
    """Negative control: a page whose script throws is caught by the same check."""
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><body><p>x</p><script>notDefined();</script>"
                    "</body></html>")
    dom = _chromium(page, "--dump-dom")
    assert any("Uncaught ReferenceError" in line for line in _console(dom.stderr))
