"""Bounded exhaustive exploration: every trace up to a budget, every crash point, every statement.

Beside Hypothesis's random search, :func:`enumerate_system` walks the whole tree
of traces that use at most ``operations`` operation ids, at most ``crashes``
crashes and at most ``max_steps`` steps, built from these steps:

* ``accept`` of a fresh operation id, an accept again of a submitted id with its
  payload (a retry, or an idempotent repeat) and with a changed payload (a
  resubmission, which must be refused);
* ``dispatch`` (a dispatch with no crash is a recovery);
* ``service`` called directly: with the accepted payload while the outbox entry
  is pending (a second deliverer racing the dispatcher), and with a changed
  payload once the downstream holds a ticket for the id (a payload conflict, which
  the receiver must refuse; before delivery it cannot know the accepted payload).

While the crash budget lasts, each step is also tried with every crash point the
system declares for it and every statement point: ``sql:K`` for K = 1, 2, ... and
``commit:K`` likewise, until the worker no longer dies (so the number of
statements a worker runs is discovered, not configured). A crash point that does
not fire is a probe, not a new trace.

Every trace prefix is checked twice: the executor checks every invariant after
its last step, and a copy of its stores is recovered to quiescence
(:meth:`faultlab.run.executor.Executor.settle`) and checked for ``LIVE``.

The tree is walked breadth first, branching by copying the run directory (both
SQLite files, and any journal a SIGKILL left behind) after each step, so no
prefix is executed twice. Two reductions keep three operations practical:

* symmetry of operation ids: the payloads differ only by their id, so which
  unused id a fresh accept takes does not matter; a trace first uses op-1, then
  op-2, then op-3, and the renamed traces are counted (``symmetric``), not run;
* state deduplication: a prefix whose state was already reached at an earlier or
  equal depth with at least as many crashes left is not extended (``skipped``):
  its subtree can only repeat what the earlier one explores. The state is the
  logical content of every SQLite database in the run directory (every table, in
  storage order, including tables snapshots do not show) plus the model of what
  was acknowledged and submitted, with wall-clock times a worker stored (a
  sequential trace's claim and lease times) replaced by their order
  (:func:`state_key`): otherwise every dispatch made a state of its own.

With ``power`` (``enumerate --power-loss``), every SQLite change is recorded
(:mod:`faultlab.stores.vfs`) and each node is also extended by a power cut for
every choice of its unsynced writes that gives a distinct outcome; a cut counts
against the crash budget. A branch copies the recording with the stores and
relocates it, and the state includes what a cut could still lose, so two nodes
with the same rows but different unsynced writes stay two states. One job only:
the recording VFS is this process's default, for one log at a time.

A violating trace is a leaf: it is not extended. For each invariant the walk
keeps the violating trace that executes the fewest steps up to the failing
check (recovery dispatches included), then the one with the fewest trace steps,
then the first in a fixed order, so a run reports the same findings however its
worker threads interleave.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import queue
import shutil
import sqlite3
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from faultlab.base.canonical import canonical_json
from faultlab.checks.history import History
from faultlab.checks.invariants import Model
from faultlab.process.records import DEFAULT_DEADLINE
from faultlab.process.spawn import Spawner
from faultlab.run.directory import POWER_LOG, store_digests
from faultlab.run.executor import Executor, execute
from faultlab.run.observation import Execution
from faultlab.search import defaults
from faultlab.search.coverage import Coverage
from faultlab.stores import vfs
from faultlab.stores.sqlite import Snapshot, scratch_directory, uri
from faultlab.system.contract import System
from faultlab.trace import POWER, Step, Verdict, changed_payload

STATEMENT_LIMIT = 500  # a worker that runs more statements than this is not probed further
JOURNALS = ("-journal", "-wal", "-shm")


def operation_id(number: int) -> str:
    return f"op-{number}"


def payload_for(operation: str) -> dict[str, Any]:
    return {"title": f"task {operation}", "priority": "normal"}


def history_for(system: System, operations: int) -> History:
    """The history an enumeration starts from: the system's ordering key, unless no two of
    the enumeration's operations can share it. Every payload an enumeration accepts for an
    operation is :func:`payload_for` or a changed version of it (only ``revision`` differs),
    so when those carry a key of their own per operation (the reference's title) ``ORDER``
    has nothing it could ever compare, and keeping the acceptance order in the state key
    would only split states that behave alike."""
    key = system.ordering_key
    if key is None or key == "revision":
        return History(ordering_key=key)
    values = [payload_for(operation_id(n)).get(key) for n in range(1, operations + 1)]
    shared = len({repr(value) for value in values if value is not None}) < len(
        [value for value in values if value is not None])
    return History(ordering_key=key if shared else None)


# --- results -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Finding:
    """A violating trace: its steps (recovered afterwards) and what failed where."""

    steps: tuple[Step, ...]
    invariants: tuple[str, ...]
    executed: int  # steps executed up to the failing check, recovery dispatches included
    order: tuple[int, ...]  # position in the walk, for a deterministic choice among equals
    seconds: float  # since the start of the run

    def rank(self) -> tuple[int, int, tuple[int, ...]]:
        return (self.executed, len(self.steps), self.order)


@dataclass
class Enumeration:
    """What one enumeration did and found."""

    system: str
    deduplication: bool
    operations: int
    crashes: int
    max_steps: int
    power: bool = False  # power cuts were tried (each counts against the crash budget)
    traces: int = 0  # distinct traces executed (a step whose armed crash did not fire is a probe)
    skipped: int = 0  # traces that reached an already explored state: not extended
    #: traces not run because they differ from one that ran only by which unused operation
    #: id a fresh accept takes (ids are first used in the order op-1, op-2, ...)
    symmetric: int = 0
    probes: int = 0  # armed crash points that never fired
    states: int = 0  # distinct states explored
    crash_states: int = 0  # distinct states right after a crash
    violations: int = 0  # violating traces (each is a leaf: it is not extended)
    steps_executed: int = 0  # every worker run, recovery dispatches and probes included
    depth: int = 0  # the longest trace explored
    seconds: float = 0.0
    best: dict[str, Finding] = field(default_factory=dict)  # invariant -> shortest finding
    coverage: Coverage = field(default_factory=Coverage)

    @property
    def found(self) -> bool:
        return bool(self.best)

    def findings(self) -> list[Finding]:
        """Each distinct best finding once (one trace may be the best for several invariants)."""
        unique: dict[str, Finding] = {}
        for finding in sorted(self.best.values(), key=Finding.rank):
            unique.setdefault(canonical_json([s.to_json() for s in finding.steps]), finding)
        return list(unique.values())

    @property
    def first_found_seconds(self) -> float | None:
        return min((f.seconds for f in self.best.values()), default=None)

    def stats(self) -> dict[str, Any]:
        return {
            "traces": self.traces,
            "skipped": self.skipped,
            "symmetric": self.symmetric,
            "probes": self.probes,
            "states": self.states,
            "crash_states": self.crash_states,
            "violations": self.violations,
            "steps_executed": self.steps_executed,
            "depth": self.depth,
            "seconds": round(self.seconds, 3),
        }


# --- the walk ------------------------------------------------------------------------------------


@dataclass
class _Node:
    """A trace prefix whose stores sit in ``directory``, with the model after it."""

    steps: tuple[Step, ...]
    directory: Path
    model: Model
    history: History
    snapshot: Snapshot
    key: str
    crashes_left: int
    order: tuple[int, ...]
    #: With power cuts: each store's digest when recording began or at the last cut
    #: (:attr:`faultlab.run.executor.Executor.unrecorded_baseline`).
    baseline: dict[str, str] = field(default_factory=dict)


@dataclass
class _Child:
    step: Step
    fired: bool = False  # False: the armed crash point was never reached (a probe)
    invariants: tuple[str, ...] = ()  # what failed after the step
    key: str | None = None  # the state after a clean step
    node: _Node | None = None  # kept for the next level (None: already explored)


@dataclass
class _Expansion:
    """One task's share of expanding a node, done in a worker thread: the recovery
    verdict (the settle task) or the children of one candidate step."""

    settle_invariants: tuple[str, ...] = ()
    settle_executed: int = 0
    children: list[_Child] = field(default_factory=list)
    probes: int = 0
    skipped: int = 0
    symmetric: int = 0
    steps_executed: int = 0
    coverage: Coverage = field(default_factory=Coverage)


def _database_rows(path: Path) -> list[tuple[Any, ...]]:
    """The schema and every row of every table of one SQLite file, in storage order.

    Opening the file read-write lets SQLite roll back a hot journal a SIGKILL left:
    the rows are the logical content the next worker will see.
    """
    connection = sqlite3.connect(uri(path, "rw"), uri=True)
    try:
        connection.execute("PRAGMA query_only=ON")
        schema = connection.execute(
            "SELECT type, name, tbl_name, sql FROM sqlite_master ORDER BY type, name"
        ).fetchall()
        found: list[tuple[Any, ...]] = list(schema)
        for kind, name, _, sql in schema:
            if kind != "table" or (sql or "").upper().startswith("CREATE VIRTUAL"):
                continue
            quoted = '"' + str(name).replace('"', '""') + '"'
            found.append(("table", name))
            found += connection.execute(f"SELECT * FROM {quoted}").fetchall()
        return found
    finally:
        connection.close()


def _is_time(value: Any, since: float, until: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool)
            and since <= value <= until)


def _normal(value: Any, ranks: dict[Any, int]) -> Any:
    if ranks and isinstance(value, (int, float)) and not isinstance(value, bool) and value in ranks:
        return ("time", ranks[value])
    return value


def state_key(directory: Path, model: Model, history: History, *,
              since: float | None = None) -> str:
    """Every table of every SQLite database in the run directory, plus the model and what
    the history's later checks depend on (:meth:`~faultlab.checks.history.History.state`).

    ``since``: the wall-clock time (``time.time()``) before the stores were created.
    A number between it and now is a time a worker read from the real clock (a
    sequential trace's lease or claim time): it is replaced by its rank among such
    numbers in the state. Every future step runs later, so the order between stored
    times and every future "now" is all a worker can tell apart; two states that
    differ only in when their steps happened behave alike and are one state. A time
    in the future (a lease still running) is kept exact.
    """
    files: list[tuple[str, list[tuple[Any, ...]] | bytes]] = []
    for path in sorted(directory.iterdir()):
        if path.name.endswith(JOURNALS) or not path.is_file():
            continue
        with path.open("rb") as stream:
            header = stream.read(16)
        if header != b"SQLite format 3\x00":
            files.append((path.name, path.read_bytes()))
        else:
            files.append((path.name, _database_rows(path)))
    ranks: dict[Any, int] = {}
    if since is not None:
        until = time.time()
        times = {value for _, content in files if not isinstance(content, bytes)
                 for row in content for value in row if _is_time(value, since, until)}
        ranks = {value: rank for rank, value in enumerate(sorted(times))}
    digest = hashlib.sha256()
    for name, content in files:
        digest.update(name.encode() + b"\0")
        if isinstance(content, bytes):
            digest.update(content)
            continue
        for row in content:
            normal = tuple(_normal(value, ranks) for value in row)
            digest.update(repr(normal).encode() + b"\n")
    digest.update(canonical_json(sorted(model.acknowledged.items())).encode())
    digest.update(canonical_json(sorted(model.submitted)).encode())
    digest.update(canonical_json(history.state(model.acknowledged)).encode())
    return digest.hexdigest()


class _Walk:
    def __init__(
        self,
        system: System,
        spawners: Sequence[Spawner],
        *,
        deduplication: bool,
        operations: int,
        crashes: int,
        max_steps: int,
        deadline: float,
        first: bool,
        progress: Callable[[str], None] | None,
        power: bool = False,
    ) -> None:
        self.system = system
        self.power = power
        self.first = first
        self.deduplication = deduplication
        self.operations = operations
        self.max_steps = max_steps
        self.deadline = deadline
        self.progress = progress
        self.statement_points = bool(getattr(system, "supports_statement_points", True))
        self.result = Enumeration(system.ref, deduplication, operations, crashes, max_steps,
                                  power=power)
        self.spawners: queue.Queue[Spawner] = queue.Queue()
        for spawner in spawners:
            self.spawners.put(spawner)
        self.jobs = len(spawners)
        # the pid in the name tells whose run directory it is, as for every trace's
        self.root = Path(tempfile.mkdtemp(prefix=f"faultlab-enumerate-{os.getpid()}-",
                                          dir=scratch_directory()))
        self._names = itertools.count()
        self.seen: dict[str, int] = {}  # state -> most crashes left it was explored with
        self.crash_keys: set[str] = set()
        self.settled: dict[str, tuple[tuple[str, ...], int]] = {}
        self._settle_lock = threading.Lock()
        self.started = time.monotonic()
        # the wall clock before any store exists (a second early: a worker may truncate it)
        self.since = time.time() - 1.0
        self._reported = 0.0

    # -- stores -----------------------------------------------------------------------------

    def _directory(self) -> Path:
        return self.root / f"n{next(self._names)}"

    def _copy(self, source: Path) -> Path:
        target = self._directory()
        shutil.copytree(source, target)
        if self.power:  # the copied log must name the copies, or a cut rebuilds the source
            vfs.relocate(target / POWER_LOG, source, target)
        return target

    def _executor(self, node: _Node, directory: Path, spawner: Spawner, *,
                  power: bool = True) -> Executor:
        """An executor that continues from ``node`` on the stores copied into ``directory``
        (recording, with power cuts, unless ``power`` is False: a recovery no cut follows)."""
        return Executor.resume(
            self.system, spawner, directory, node.model, node.snapshot, node.history,
            deduplication=self.deduplication, deadline=self.deadline,
            power=self.power and power, baseline=node.baseline,
        )

    def _key(self, directory: Path, model: Model, history: History) -> str:
        key = state_key(directory, model, history, since=self.since)
        if not self.power:
            return key
        # equal content with different unsynced changes is not one state under a power cut
        lost = vfs.unsynced_digest(directory / POWER_LOG, directory)
        return hashlib.sha256(f"{key}\0{lost}".encode()).hexdigest()

    def root_node(self) -> _Node:
        directory = self._directory()
        directory.mkdir()
        self.system.initialise(directory)  # durable: nothing records it yet
        model = Model()
        history = history_for(self.system, self.operations)
        if not self.power:
            return _Node((), directory, model, history, self.system.snapshot(directory),
                         self._key(directory, model, history), self.result.crashes, ())
        baseline = store_digests(self.system, directory)
        vfs.install(directory / POWER_LOG)
        try:
            return _Node((), directory, model, history, self.system.snapshot(directory),
                         self._key(directory, model, history), self.result.crashes, (),
                         baseline)
        finally:
            vfs.uninstall()

    # -- steps ------------------------------------------------------------------------------

    def _crash_options(self, action: str) -> Iterator[str]:
        for point in self.system.points_for(action):
            yield point.name

    def _candidates(self, node: _Node) -> list[tuple[Step, bool]]:
        """Steps to try after ``node`` (without crash); the flag says whether to add crashes.

        With power cuts and crash budget left: a cut for every choice of unsynced writes
        that gives a distinct outcome now (:func:`faultlab.stores.vfs.choices`; drop_all
        even when nothing is unsynced, so what was acknowledged is checked after a cut).
        """
        submitted = sorted(node.model.submitted)
        steps: list[Step] = [Step("dispatch")]
        if self.power and node.crashes_left > 0:
            power = [Step.power(choice)
                     for choice in vfs.choices(node.directory / POWER_LOG)]
        else:
            power = []
        if len(submitted) < self.operations:
            fresh = operation_id(len(submitted) + 1)
            steps.append(Step("accept", fresh, payload_for(fresh)))
        for operation in submitted:
            steps.append(Step("accept", operation, payload_for(operation)))
            steps.append(Step("accept", operation, changed_payload(payload_for(operation))))
        for operation in submitted:
            stored = node.snapshot.operation(operation)
            if stored is None:
                continue
            payload = json.loads(stored.payload)
            outbox = node.snapshot.outbox_row(operation)
            if outbox is not None and outbox.state == "pending":
                steps.append(Step("service", operation, payload))
            if node.snapshot.tickets_for(operation) and isinstance(payload, dict):
                steps.append(Step("service", operation, changed_payload(payload)))
        return [(step, node.crashes_left > 0) for step in steps] + [(s, False) for s in power]

    # -- one node ---------------------------------------------------------------------------

    def tasks(self, node: _Node) -> list[Callable[[Spawner], _Expansion]]:
        """The independent pieces of expanding ``node``: its recovery, then each candidate."""
        found: list[Callable[[Spawner], _Expansion]] = [partial(self._settle, node)]
        if len(node.steps) < self.max_steps:
            found += [partial(self._step, node, step, crashes)
                      for step, crashes in self._candidates(node)]
        return found

    def run_task(self, task: Callable[[Spawner], _Expansion]) -> _Expansion:
        spawner = self.spawners.get()
        try:
            return task(spawner)
        finally:
            self.spawners.put(spawner)

    def _step(self, node: _Node, step: Step, crashes: bool, spawner: Spawner) -> _Expansion:
        """``step`` after ``node``, then (crash budget left) at every point that fires; a
        fresh accept counts the renamed traces it stands for."""
        expansion = _Expansion()
        expansion.children.append(self._child(node, step, spawner, expansion))
        self._steps(node, step, crashes, spawner, expansion)
        if step.action == "accept" and step.operation_id not in node.model.submitted:
            # op-N is the first unused id: each other unused id would rename these traces
            unused = self.operations - len(node.model.submitted)
            expansion.symmetric += (unused - 1) * len(expansion.children)
        return expansion

    def _steps(
        self, node: _Node, step: Step, crashes: bool, spawner: Spawner, expansion: _Expansion,
    ) -> None:
        """The crashing variants of ``step`` (crash budget left): every point that fires."""
        if not crashes:
            return
        for name in self._crash_options(step.action):
            child = self._child(node, _armed(step, name), spawner, expansion)
            if child.fired:
                expansion.children.append(child)
        if not self.statement_points:
            return
        for kind in ("sql", "commit"):
            for index in range(1, STATEMENT_LIMIT + 1):
                child = self._child(node, _armed(step, f"{kind}:{index}"), spawner, expansion)
                if not child.fired:
                    break
                expansion.children.append(child)

    def _settle(self, node: _Node, spawner: Spawner) -> _Expansion:
        """Recover a copy of the node's stores to quiescence and check the outcome."""
        expansion = _Expansion()
        with self._settle_lock:
            cached = self.settled.get(node.key)
        if cached is None:
            directory = self._copy(node.directory)
            try:
                executor = self._executor(node, directory, spawner, power=False)
                observations, final = executor.settle()
            finally:
                shutil.rmtree(directory, ignore_errors=True)
            expansion.steps_executed += len(observations)
            for observation in observations:
                expansion.coverage.observe(observation)
            failed = next((o for o in observations if o.violations), None)
            if failed is None:
                expansion.coverage.live_checked()
            if failed is not None:
                names = Verdict.of(None, failed.violations).invariants
                cached = (names, observations.index(failed) + 1)
            else:
                cached = (Verdict.of(None, final).invariants, len(observations))
            with self._settle_lock:
                self.settled[node.key] = cached
        expansion.settle_invariants = cached[0]
        expansion.settle_executed = len(node.steps) + cached[1]
        return expansion

    def _child(self, node: _Node, step: Step, spawner: Spawner, expansion: _Expansion) -> _Child:
        directory = self._copy(node.directory)
        keep = False
        try:
            executor = self._executor(node, directory, spawner)
            with executor.recording():  # the key's reads may recover a journal: recorded
                observation = executor.run(step)
                fired = step.crash is None or observation.crashed
                if fired and not observation.violations:
                    key = self._key(directory, executor.model, executor.history)
            expansion.steps_executed += 1
            expansion.coverage.observe(observation)
            child = _Child(step, fired=fired)
            if not child.fired:
                expansion.probes += 1
                return child
            if observation.violations:
                child.invariants = Verdict.of(None, observation.violations).invariants
                return child
            child.key = key
            crashes_left = node.crashes_left - (step.crash is not None or step.action == POWER)
            if self.seen.get(child.key, -1) >= crashes_left:
                expansion.skipped += 1
                return child
            child.node = _Node(
                (*node.steps, step), directory, executor.model, executor.history,
                observation.snapshot, child.key, crashes_left, (), executor.unrecorded_baseline,
            )
            keep = True
            return child
        finally:
            if not keep:
                shutil.rmtree(directory, ignore_errors=True)

    # -- levels -----------------------------------------------------------------------------

    def run(self) -> Enumeration:
        try:
            root = self.root_node()
            self.seen[root.key] = root.crashes_left
            self.result.states = 1
            level = [root]
            depth = 0
            with ThreadPoolExecutor(max_workers=self.jobs) as pool:
                while level:
                    self.result.depth = depth
                    expansions = self._expand_level(pool, level, depth)
                    level = self._next_level(level, expansions)
                    if self.first and self.result.found:
                        # the rest of this depth was searched: the finding is shortest;
                        # the traces run at this depth were one step longer than its nodes
                        self.result.depth = depth + 1
                        break
                    depth += 1
        finally:
            shutil.rmtree(self.root, ignore_errors=True)
        self.result.seconds = time.monotonic() - self.started
        return self.result

    def _expand_level(
        self, pool: ThreadPoolExecutor, level: list[_Node], depth: int
    ) -> list[_Expansion]:
        futures: list[list[Future[_Expansion]]] = [
            [pool.submit(self.run_task, task) for task in self.tasks(node)] for node in level
        ]
        every = [future for node_futures in futures for future in node_futures]
        pending = set(every)
        try:
            while pending:
                done, pending = wait(pending, timeout=1.0, return_when=FIRST_COMPLETED)
                for future in done:
                    future.result()  # raise a worker's error now
                self._report(depth, len(every) - len(pending), len(every))
        except BaseException:
            for future in every:
                future.cancel()
            raise
        return [_merge([future.result() for future in node_futures]) for node_futures in futures]

    def _next_level(self, level: list[_Node], expansions: list[_Expansion]) -> list[_Node]:
        result = self.result
        survivors: dict[str, _Node] = {}
        for position, (node, expansion) in enumerate(zip(level, expansions, strict=True)):
            result.probes += expansion.probes
            result.skipped += expansion.skipped
            result.symmetric += expansion.symmetric
            result.steps_executed += expansion.steps_executed
            result.coverage.merge(expansion.coverage)
            if expansion.settle_invariants:
                result.violations += 1
                self._found(node.steps, expansion.settle_invariants, expansion.settle_executed,
                            (*node.order, position, -1))
            shutil.rmtree(node.directory, ignore_errors=True)
            for index, child in enumerate(expansion.children):
                result.traces += 1
                order = (*node.order, position, index)
                if child.invariants:
                    result.violations += 1
                    steps = (*node.steps, child.step)
                    self._found(steps, child.invariants, len(steps), order)
                    continue
                if child.key is not None and child.step.crash is not None:
                    self.crash_keys.add(child.key)
                if child.node is None:
                    continue
                child.node.order = order
                other = survivors.get(child.node.key)
                if other is not None and other.crashes_left >= child.node.crashes_left:
                    result.skipped += 1
                    shutil.rmtree(child.node.directory, ignore_errors=True)
                    continue
                if other is not None:
                    result.skipped += 1
                    shutil.rmtree(other.directory, ignore_errors=True)
                survivors[child.node.key] = child.node
        nodes = sorted(survivors.values(), key=lambda n: n.order)
        for node in nodes:
            self.seen[node.key] = max(self.seen.get(node.key, -1), node.crashes_left)
        result.states = len(self.seen)
        result.crash_states = len(self.crash_keys)
        return nodes

    def _found(
        self, steps: tuple[Step, ...], invariants: tuple[str, ...], executed: int,
        order: tuple[int, ...],
    ) -> None:
        finding = Finding(steps, invariants, executed, order, time.monotonic() - self.started)
        for name in invariants:
            best = self.result.best.get(name)
            if best is None or finding.rank() < best.rank():
                self.result.best[name] = finding

    def _report(self, depth: int, done: int, total: int) -> None:
        now = time.monotonic()
        if self.progress is None or (now - self._reported < 1.0 and done < total):
            return
        self._reported = now
        r = self.result
        self.progress(
            f"enumerate {self.system.name}: depth {depth}, task {done}/{total}; "
            f"{r.traces} traces, {r.skipped} skipped, {r.symmetric} symmetric, "
            f"{len(self.seen)} states, "
            f"{r.violations} violations, {time.monotonic() - self.started:.1f}s"
        )


def _merge(parts: list[_Expansion]) -> _Expansion:
    merged = _Expansion(parts[0].settle_invariants, parts[0].settle_executed)
    for part in parts:
        merged.children += part.children
        merged.probes += part.probes
        merged.skipped += part.skipped
        merged.symmetric += part.symmetric
        merged.steps_executed += part.steps_executed
        merged.coverage.merge(part.coverage)
    return merged


def _armed(step: Step, point: str) -> Step:
    return Step(step.action, step.operation_id, step.payload, point)


def enumerate_system(
    system: System,
    spawners: Sequence[Spawner],
    *,
    deduplication: bool = True,
    operations: int = defaults.OPERATIONS,
    crashes: int = defaults.CRASHES,
    max_steps: int | None = None,
    deadline: float = DEFAULT_DEADLINE,
    first: bool = False,
    progress: Callable[[str], None] | None = None,
    power: bool = False,
) -> Enumeration:
    """Walk every trace within the budget, one worker thread per spawner.

    ``first``: stop after the depth (number of trace steps) at which the first
    violation showed; every shorter trace was searched by then. ``power``: power cuts
    too, each counted against the crash budget; one spawner only (this process records
    its own reads through a VFS that is the whole process's default, one log at a time).
    """
    if not spawners:
        raise ValueError("enumerate needs at least one spawner")
    if power and len(spawners) > 1:
        raise ValueError("enumerate with power cuts runs one job")
    if max_steps is None:
        max_steps = defaults.max_steps(operations, crashes)
    walk = _Walk(
        system, spawners, deduplication=deduplication, operations=operations, crashes=crashes,
        max_steps=max_steps, deadline=deadline, first=first, progress=progress, power=power,
    )
    return walk.run()


def confirm(
    system: System, finding: Finding, spawner: Spawner, *, deduplication: bool,
    deadline: float = DEFAULT_DEADLINE,
) -> Execution:
    """Execute a finding once more on fresh stores, as replay will (with recovery)."""
    return execute(
        system, finding.steps, spawner, deduplication=deduplication, settle=True,
        deadline=deadline,
    )


__all__ = [
    "Enumeration",
    "Finding",
    "confirm",
        "enumerate_system",
]
