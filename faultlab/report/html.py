"""One self-contained HTML page for executed traces: for people who were not there.

A replay table says what happened in numbers; this page shows it. For each trace:

* a timeline with one lane per process (each worker, and the service child a
  dispatcher started), a column per step, where each process ran, how it ended,
  and where the armed crash point fired (SIGKILL);
* the violated invariants marked at the step where they failed (or at the final
  recovery check);
* for every step, the four tables of both stores after it (the caller's
  operations and outbox, the downstream tickets and receipts), with rows the
  step added or changed highlighted and rows it removed struck through.

A concurrent (version 2) trace gets the same page with one timeline row per lane,
each cell the lane's state after the step (held at a point, blocked, paused, how
its worker ended), as the replay table of :func:`faultlab.report.tables.replay_table` shows it.

The page is built from the executed observations alone (no process runs here).
Everything is inline (CSS, a little JavaScript, no fonts or images), so it opens
offline and fetches nothing.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from html import escape
from pathlib import Path
from typing import Any

from faultlab.base.output import Kind
from faultlab.process.records import KILLED
from faultlab.run.observation import Execution, Observation
from faultlab.stores.sqlite import TABLES, Snapshot

STORES = (("caller", ("operations", "outbox")), ("downstream", ("tickets", "receipts")))
COLUMNS: dict[str, tuple[str, ...]] = {
    "operations": ("id", "payload", "state", "result"),
    "outbox": ("operation_id", "state"),
    "tickets": ("id", "operation_id", "payload"),
    "receipts": ("operation_id", "payload", "result"),
}
SIGKILL_EXIT = -9


@dataclass(frozen=True)
class TraceReport:
    """One executed trace and how to title it."""

    title: str
    execution: Execution
    system: str
    deduplication: bool = True
    verdict: str = ""
    expected: str = ""


@dataclass(frozen=True)
class Process:
    """One lane: a process that ran at a step (``pid`` None: a child nobody reported)."""

    pid: int | None
    label: str
    step: int
    exit_code: int | None
    crashed_here: bool
    parent: int | None = None

    @property
    def lane(self) -> str:
        return str(self.pid) if self.pid is not None else f"unreported-{self.step}"


def processes(observation: Observation) -> list[Process]:
    """The worker of a step, and the service child it reported, in that order.

    A dispatcher killed after its service committed never reports that child; the
    downstream store shows it ran, so it gets a lane of its own, its PID unknown.
    """
    record = observation.record
    step = observation.step
    service = (record.response or {}).get("service")
    service = service if isinstance(service, dict) else {}
    service_exit = service.get("exit_code")
    service_killed = service_exit == SIGKILL_EXIT
    armed = step.crash is not None
    if not record.pid:  # a power cut or a server crash: no process ran, no lane to draw
        return []
    found = [Process(record.pid, step.action, observation.index, record.exit_code,
                     armed and record.killed)]
    pid = service.get("pid")
    if isinstance(pid, int) and not isinstance(pid, bool):
        found.append(Process(pid, "service (child)", observation.index,
                             service_exit if isinstance(service_exit, int) else None,
                             armed and service_killed and not record.killed, record.pid))
    elif step.action == "dispatch" and _downstream_changed(observation):
        found.append(Process(None, "service (child, not reported)", observation.index, None,
                             False, record.pid))
    return found


def _downstream_changed(observation: Observation) -> bool:
    before, after = observation.before, observation.snapshot
    return before.tickets != after.tickets or before.receipts != after.receipts


def _changes(before: Sequence[tuple[Any, ...]], after: Sequence[tuple[Any, ...]]) -> tuple[
    dict[int, str], list[tuple[Any, ...]]
]:
    """For each row of ``after``: "added" or "changed" (keyed by the first column); and the
    rows of ``before`` whose key is gone."""
    old = {row[0]: row for row in before}
    marks: dict[int, str] = {}
    keys = set()
    for index, row in enumerate(after):
        keys.add(row[0])
        previous = old.get(row[0])
        if previous is None:
            marks[index] = "added"
        elif previous != row:
            marks[index] = "changed"
    removed = [row for row in before if row[0] not in keys]
    return marks, removed


def _cell(value: Any) -> str:
    if value is None:
        return '<span class="null">NULL</span>'
    return escape(str(value))


def _table(name: str, before: Snapshot, after: Snapshot) -> str:
    rows_before = list(getattr(before, name))
    rows_after = list(getattr(after, name))
    marks, removed = _changes(rows_before, rows_after)
    head = "".join(f"<th>{escape(column)}</th>" for column in COLUMNS[name])
    body = []
    for index, row in enumerate(rows_after):
        mark = marks.get(index, "")
        body.append(f'<tr class="{mark}">' + "".join(f"<td>{_cell(v)}</td>" for v in row)
                    + "</tr>")
    for row in removed:
        body.append('<tr class="removed">' + "".join(f"<td>{_cell(v)}</td>" for v in row)
                    + "</tr>")
    if not body:
        body.append(f'<tr class="empty"><td colspan="{len(COLUMNS[name])}">no rows</td></tr>')
    changed = len(marks) + len(removed)
    note = f' <span class="delta">{changed} changed</span>' if changed else ""
    return (f'<table class="store-table" data-table="{name}" data-changed="{changed}">'
            f"<caption>{escape(name)}{note}</caption><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table>")


def _process_cell(process: Process) -> str:
    if process.crashed_here:
        ending = '<span class="kill">SIGKILL</span>'
    elif process.exit_code is None:
        ending = "exit ?"
    elif process.exit_code == SIGKILL_EXIT:
        ending = '<span class="kill">killed (-9)</span>'
    else:
        ending = f"exit {process.exit_code}"
    classes = "run" + (" crashed" if process.crashed_here else "")
    pid = "unknown" if process.pid is None else str(process.pid)
    return (f'<a class="{classes}" href="#{{anchor}}-step-{process.step}" '
            f'title="pid {pid}">{escape(process.label)}<br>{ending}</a>')


def _timeline(anchor: str, observations: Sequence[Observation], final: bool,
              final_names: str) -> str:
    lanes: dict[str, list[Process]] = {}
    for observation in observations:
        for process in processes(observation):
            lanes.setdefault(process.lane, []).append(process)
    columns = [o.index for o in observations]
    header = ['<th class="lane-name">process</th>']
    for observation in observations:
        crash = f" crash={observation.step.crash}" if observation.step.crash else ""
        header.append(_step_header(anchor, observation, observation.step.action, crash))
    if final:
        header.append("<th>final check</th>")
    rows = ["<tr>" + "".join(header) + "</tr>"]
    for lane, runs in lanes.items():
        first = runs[0]
        parent = f" &larr; {first.parent}" if first.parent is not None else ""
        name = "pid ?" if first.pid is None else f"pid {first.pid}"
        cells = [f'<th class="lane-name">{name}{parent}</th>']
        by_step = {run.step: run for run in runs}
        for index in columns:
            run = by_step.get(index)
            cells.append("<td></td>" if run is None else
                         "<td>" + _process_cell(run).replace("{anchor}", anchor) + "</td>")
        if final:
            cells.append("<td></td>")
        rows.append(f'<tr class="lane" data-pid="{lane}">' + "".join(cells) + "</tr>")
    rows.append(_invariants_row(observations, final, final_names))
    return f'<table class="timeline">{"".join(rows)}</table>'


def _step_header(anchor: str, observation: Observation, label: str,
                 suffix: str = "") -> str:
    """A timeline column's heading: the step's number (a link to its stores) and label."""
    settle = " (settle)" if observation.phase != "step" else ""
    return (f'<th><a href="#{anchor}-step-{observation.index}">step {observation.index}</a>'
            f"<br><small>{escape(label)}{escape(settle)}{escape(suffix)}</small></th>")


def _invariants_row(observations: Sequence[Observation], final: bool,
                    final_names: str) -> str:
    marks = ['<th class="lane-name">invariants</th>']
    for observation in observations:
        names = sorted({v.invariant for v in observation.violations})
        marks.append(f'<td class="violated">{escape(", ".join(names))}</td>' if names
                     else '<td class="ok">ok</td>')
    if final:
        marks.append(f'<td class="violated">{escape(final_names)}</td>' if final_names
                     else '<td class="ok">ok</td>')
    return '<tr class="invariants">' + "".join(marks) + "</tr>"


def _lane_timeline(anchor: str, observations: Sequence[Observation], final: bool,
                   final_names: str) -> str:
    """A concurrent trace: a row per lane, a column per scheduling choice."""
    header = ['<th class="lane-name">lane</th>']
    for observation in observations:
        header.append(_step_header(anchor, observation, observation.step.describe()))
    if final:
        header.append("<th>final check</th>")
    rows = ["<tr>" + "".join(header) + "</tr>"]
    lanes = max((len(o.lanes) for o in observations), default=0)
    for number in range(1, lanes + 1):
        cells = [f'<th class="lane-name">L{number}</th>']
        previous = "-"
        for observation in observations:
            state = observation.lanes[number - 1]
            # a kill step on this lane, or its worker ending by SIGKILL at its armed point
            killed = (observation.step.action == "kill" and observation.step.lane == number) \
                or (state == f"exit {KILLED}" and previous != state)
            previous = state
            if state == "-":
                cells.append("<td></td>")
                continue
            shown = '<span class="kill">SIGKILL</span>' if killed else escape(state)
            cells.append(f'<td><a class="run{" crashed" if killed else ""}" '
                         f'href="#{anchor}-step-{observation.index}">{shown}</a></td>')
        if final:
            cells.append("<td></td>")
        rows.append(f'<tr class="lane" data-lane="{number}">' + "".join(cells) + "</tr>")
    rows.append(_invariants_row(observations, final, final_names))
    return f'<table class="timeline">{"".join(rows)}</table>'


def _stores(before: Snapshot, after: Snapshot) -> str:
    stores = []
    for store, tables in STORES:
        inner = "".join(_table(t, before, after) for t in tables)
        stores.append(f'<div class="store"><h4>{store} store</h4>{inner}</div>')
    return f'<div class="stores">{"".join(stores)}</div>'


def _violations(observation: Observation) -> str:
    items = "".join(f"<li><b>{escape(v.invariant)}</b>: {escape(v.message)}</li>"
                    for v in observation.violations)
    return (f'<div class="violations"><b>invariant violated at this step</b>'
            f"<ul>{items}</ul></div>") if items else ""


def _lane_step_section(anchor: str, observation: Observation) -> str:
    """A scheduling choice: the lanes after it, the workers that ended, both stores."""
    killed = observation.step.action == "kill" or observation.sigkills > 0
    classes = "step" + (" violated" if observation.violations else "")
    classes += " crashed" if killed else ""
    settle = " (settle: recovery)" if observation.phase != "step" else ""
    lanes = ", ".join(f"L{n} {state}" for n, state in enumerate(observation.lanes, start=1))
    ended = "; ".join(
        f"pid {record.pid} {'SIGKILL' if record.killed else f'exit {record.exit_code}'}, "
        f"response <code>{escape(json.dumps(record.response, sort_keys=True))}</code>"
        for _, record in observation.exited) or "no worker ended"
    return (
        f'<section class="{classes}" id="{anchor}-step-{observation.index}" '
        f'data-step="{observation.index}">'
        f"<h3>step {observation.index}: {escape(observation.step.describe())}{escape(settle)}</h3>"
        f'<p class="record">lanes after it: {escape(lanes)}; {ended}</p>'
        f"{_violations(observation)}{_stores(observation.before, observation.snapshot)}"
        "</section>"
    )


def _step_section(anchor: str, observation: Observation) -> str:
    record = observation.record
    classes = "step" + (" violated" if observation.violations else "")
    classes += " crashed" if observation.crashed else ""
    settle = " (settle: recovery)" if observation.phase != "step" else ""
    ending = "SIGKILL" if record.killed else f"exit {record.exit_code}"
    response = json.dumps(record.response, sort_keys=True) if record.response is not None \
        else "(no response)"
    what = (f"pid {record.pid}, {escape(ending)}, {record.elapsed * 1000:.1f} ms; "
            f"response <code>{escape(response)}</code>") if record.pid else \
        "no worker process: a fault of the machine or the server, between two workers"
    return (
        f'<section class="{classes}" id="{anchor}-step-{observation.index}" '
        f'data-step="{observation.index}">'
        f"<h3>step {observation.index}: {escape(observation.step.describe())}{escape(settle)}</h3>"
        f'<p class="record">{what}</p>{_violations(observation)}'
        f"{_stores(observation.before, observation.snapshot)}</section>"
    )


def _trace_section(number: int, report: TraceReport) -> str:
    anchor = f"t{number}"
    execution = report.execution
    final_names = ", ".join(sorted({v.invariant for v in execution.final_violations}))
    final = bool(execution.final_violations)
    if execution.lanes:
        steps = "".join(_lane_step_section(anchor, o) for o in execution.observations)
        timeline = _lane_timeline(anchor, execution.observations, final, final_names)
        legend = ("one row per lane; a cell is the lane's state after the step (held at a "
                  'point, blocked, paused, its exit); <span class="kill">SIGKILL</span> marks '
                  "a kill; ")
    else:
        steps = "".join(_step_section(anchor, o) for o in execution.observations)
        timeline = _timeline(anchor, execution.observations, final, final_names)
        legend = ('one lane per process; a cell is where that process ran; '
                  '<span class="kill">SIGKILL</span> marks the armed crash point firing; ')
    final_section = ""
    if final:
        items = "".join(f"<li><b>{escape(v.invariant)}</b>: {escape(v.message)}</li>"
                        for v in execution.final_violations)
        final_section = (f'<section class="step violated" id="{anchor}-final"><h3>final check '
                         f"after recovery</h3><div class=\"violations\"><ul>{items}</ul></div>"
                         "</section>")
    dedup = "" if report.deduplication else " (deduplication off)"
    facts = [f"system <code>{escape(report.system)}</code>{escape(dedup)}",
             f"{len(execution.observations)} steps"]
    if report.verdict:
        facts.append(f"verdict <b>{escape(report.verdict)}</b>")
    if report.expected:
        facts.append(f"expected {escape(report.expected)}")
    return (
        f'<article class="trace" id="{anchor}"><h2>{escape(report.title)}</h2>'
        f'<p class="facts">{"; ".join(facts)}</p>'
        f'<h3>timeline</h3>{timeline}<p class="legend">{legend}'
        f'<span class="added-key">added</span> and <span class="changed-key">changed</span> rows '
        f'are what the step wrote, <span class="removed-key">struck</span> rows what it '
        f"removed</p>{steps}{final_section}</article>"
    )


_CSS = """
body{font:14px/1.4 system-ui,sans-serif;margin:1.5em;color:#1d1d1f;background:#fff}
h1{font-size:1.4em}h2{margin-top:2em;border-bottom:2px solid #444}h3{margin:1.2em 0 .3em}
code{font:12px ui-monospace,monospace;background:#f3f3f3;padding:0 .2em;word-break:break-all}
table{border-collapse:collapse;margin:.3em 0}
td,th{border:1px solid #bbb;padding:.2em .45em;vertical-align:top;font-size:12px}
.timeline td{min-width:6.5em;text-align:center}.lane-name{text-align:left;white-space:nowrap}
.run{display:block;background:#dde8ff;border-radius:4px;padding:.2em;color:#123;text-decoration:none}
.run.crashed{background:#ffd9d6;outline:2px solid #c0261b}
.kill{color:#fff;background:#c0261b;border-radius:3px;padding:0 .3em;font-weight:bold}
td.violated{background:#ffe3e0;color:#8a1208;font-weight:bold}.ok{color:#4a7a3d}
.step{border-left:4px solid #9ab;padding-left:.8em;margin:1em 0}
.step.crashed{border-left-color:#c0261b}.step.violated{border-left-color:#8a1208;background:#fff6f5}
.step.focus{box-shadow:0 0 0 3px #fb0}
.stores{display:flex;flex-wrap:wrap;gap:1.2em}.store h4{margin:.2em 0}
caption{text-align:left;font-weight:bold}.delta{font-weight:normal;color:#8a5a00}
tr.added td,.added-key{background:#d9f7d2}tr.changed td,.changed-key{background:#fff1b8}
tr.removed td,.removed-key{background:#eee;text-decoration:line-through;color:#777}
tr.empty td{color:#888;font-style:italic}.null{color:#999}
.violations{border:1px solid #c0261b;background:#fff;padding:.3em .6em;margin:.4em 0}
.legend,.facts{color:#444}#toggle{margin:.5em 0}
body.changed-only tr:not(.added):not(.changed):not(.removed){display:none}
"""

_SCRIPT = """
(function () {
  var body = document.body;
  var toggle = document.getElementById('toggle');
  toggle.addEventListener('click', function () {
    body.classList.toggle('changed-only');
    toggle.textContent = body.classList.contains('changed-only') ? 'show all rows'
                                                               : 'show changed rows only';
  });
  var links = document.querySelectorAll('.timeline a');
  for (var i = 0; i < links.length; i++) {
    links[i].addEventListener('click', function (event) {
      var target = document.getElementById(this.getAttribute('href').slice(1));
      var focused = document.querySelectorAll('.step.focus');
      for (var j = 0; j < focused.length; j++) { focused[j].classList.remove('focus'); }
      if (target) { target.classList.add('focus'); }
    });
  }
  body.setAttribute('data-steps-rendered',
                    String(document.querySelectorAll('section.step[data-step]').length));
  body.setAttribute('data-ready', 'yes');
})();
"""


#: How every page begins: what marks it as faultlab's own (``--html`` replaces nothing else).
HEAD = ('<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="generator" content="faultlab">')
#: How a page began before it carried the generator tag, up to its title (a command's own).
_EARLIER_HEAD = (
    '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
    '<meta name="viewport" content="width=device-width, initial-scale=1">'
    "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
    "style-src 'unsafe-inline'; script-src 'unsafe-inline'\"><title>faultlab ")
#: What ``--html`` writes, and so the only file it replaces.
PAGE = Kind("a faultlab HTML page", (
    re.compile(re.escape(HEAD.encode())),
    re.compile(re.escape(_EARLIER_HEAD.encode()) + rb"(?:replay|trace report)</title>"),
))


def render(reports: Sequence[TraceReport], *, title: str = "faultlab trace report") -> str:
    """The whole page as one string."""
    sections = "".join(_trace_section(number, report)
                       for number, report in enumerate(reports, start=1))
    return (
        HEAD
        + "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        # a policy that forbids every fetch: the page is all here
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; "
        "style-src 'unsafe-inline'; script-src 'unsafe-inline'\">"
        f"<title>{escape(title)}</title><style>{_CSS}</style></head>"
        f"<body><h1>{escape(title)}</h1>"
        '<button id="toggle" type="button">show changed rows only</button>'
        f"{sections}<script>{_SCRIPT}</script></body></html>\n"
    )


def write(path: Path, reports: Sequence[TraceReport], *, title: str = "faultlab trace report"
          ) -> None:
    """Write the page atomically (a temporary file beside it, then rename), as every output
    file is written (:mod:`faultlab.base.output`)."""
    from faultlab.base.output import write_text

    write_text(path, render(reports, title=title), kind=PAGE)


__all__ = ["HEAD", "PAGE", "TABLES", "Process", "TraceReport", "processes", "render", "write"]
