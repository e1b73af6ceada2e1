"""The sequential executor: one worker at a time, the fast path of every trace without lanes.

Scenarios, sequential exploration, enumeration and the replay of a sequential trace run
here (:func:`faultlab.run.interleaving.execute_trace` sends a laned trace through the
lanes). :class:`Executor` runs steps one at a time on fresh stores: each step is a real
worker process (through the system's :meth:`~faultlab.system.contract.System.run_step`),
then both stores are read back and every invariant is checked.

A system with ``virtual_wall_clock`` runs every sequential trace on a virtual
clock too: its workers run under libfaketime with the trace's clock file
(:mod:`faultlab.base.wall_clock`; forked from a fork server started under it, or
exec'd in exec mode), time stands still during the trace's steps, and the
final recovery advances it by :data:`~faultlab.base.clock.SETTLE_HORIZON` before it
dispatches, so a retry the system scheduled (a back-off after a crashed worker)
comes due instead of being reported lost.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from faultlab.base import inputs, interrupt
from faultlab.base.canonical import canonical_json
from faultlab.base.clock import SETTLE_HORIZON, VirtualClock
from faultlab.base.errors import EXIT_USAGE, ExecutionError, UsageError
from faultlab.base.messages import worker_message
from faultlab.base.wall_clock import WallClock
from faultlab.checks.history import History
from faultlab.checks.invariants import (
    STEP_INVARIANTS,
    UNCLAIMED_HISTORY,
    Check,
    Model,
    Violation,
    check_history,
    check_live,
    check_step,
    covered,
)
from faultlab.process.records import (
    DEFAULT_DEADLINE,
    POWER_LOG_VARIABLE,
    ProcessRecord,
    WorkerSpec,
)
from faultlab.process.spawn import Spawner
from faultlab.run.directory import POWER_LOG, RunDirectory, store_digests
from faultlab.stores import vfs
from faultlab.stores.sqlite import (
    Snapshot,
    kept_connections,
    readers_kept_open,
)
from faultlab.system.contract import System, check_crash_point
from faultlab.trace import ACTIONS, POWER, SERVER_CRASH, Step, Verdict

#: How a power step shows as a process record: no process ran.
NO_PROCESS = ProcessRecord(pid=0, exit_code=0, response=None, stdout="", stderr="", elapsed=0.0)


@dataclass(frozen=True)
class Observation:
    """One executed step: the workers that ended at it, both stores before and after, what
    failed and what was checked. One type for every trace: a sequential step's worker is
    its one ``exited`` record; a laned step also shows each lane's state after it."""

    index: int
    step: Step
    before: Snapshot
    snapshot: Snapshot
    violations: tuple[Violation, ...]
    phase: str = "step"
    #: The workers that ended at this step (their ordinal in the trace, their record); a
    #: sequential step's own worker, none for a power cut or a server crash.
    exited: tuple[tuple[int, ProcessRecord], ...] = ()
    #: Each lane's state after the step, as the replay table shows it (none: sequential).
    lanes: tuple[str, ...] = ()
    #: The processes SIGKILLed at this step (workers and the services they started).
    sigkills: int = 0
    #: The processes started at this step (workers and the services they started).
    processes: int = 0
    #: Invariant checks run after the step.
    checks: int = 0
    #: The invariants that had something to check at this step (coverage's unit).
    covered: frozenset[str] = frozenset()
    #: The crash point this step armed (a worker started with one), and the armed points
    #: that fired at it (a worker or its service SIGKILLed there, not by a kill step).
    armed: str | None = None
    fired: tuple[str, ...] = ()
    check: Check | None = field(default=None, compare=False, repr=False)  # what was checked

    @property
    def record(self) -> ProcessRecord:
        """The first worker that ended at this step (a sequential step's own), else
        :data:`NO_PROCESS`."""
        return self.exited[0][1] if self.exited else NO_PROCESS

    @property
    def pids(self) -> tuple[int, ...]:
        return tuple(record.pid for _, record in self.exited)

    @property
    def crashed(self) -> bool:
        """The armed point fired: the worker, or the service it started, was SIGKILLed."""
        return bool(self.fired)

    @property
    def held(self) -> int:
        """1 when some lane is held at a point after the step (workers overlap), else 0."""
        return int(any(" @" in state for state in self.lanes))  # as Lane.shown shows it

    @property
    def blocked(self) -> int:
        """The lanes blocked on another lane's lock after the step."""
        return sum(state.endswith("blocked") for state in self.lanes)

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "phase": self.phase,
            "step": self.step.to_json(),
            "record": self.record.to_json(),
            "snapshot": self.snapshot.to_json(),
            "violations": [v.to_json() for v in self.violations],
        }


def worker_observation(index: int, step: Step, record: ProcessRecord, before: Snapshot,
                       after: Snapshot, violations: tuple[Violation, ...], phase: str = "step",
                       check: Check | None = None) -> Observation:
    """A sequential step's observation: its one worker (none for a power cut or a server
    crash), what it SIGKILLed and started, every per-step invariant and each history
    invariant that needs no announced claims (``TERM``, ``ORDER``) checked once."""
    killed = record.killed or record.service_killed
    return Observation(
        index, step, before, after, violations, phase,
        exited=((index, record),) if record.pid != 0 else (),
        sigkills=int(record.killed) + int(record.service_killed),
        processes=int(record.pid != 0) + int(bool(record.service)),
        checks=len(STEP_INVARIANTS) + len(UNCLAIMED_HISTORY),
        covered=frozenset() if check is None else covered(check),
        armed=step.crash,
        fired=(step.crash,) if step.crash is not None and killed else (),
        check=check,
    )


def validate_step(system: System, step: Step) -> None:
    """Refuse a step the system cannot run (before anything is executed)."""
    if step.laned:
        raise UsageError(f"{step.describe()}: a sequential trace's step names no lane and "
                         "never holds (a laned trace runs through the lanes)")
    if step.action == POWER:
        Step.power(step.choice)  # raises UsageError for a malformed choice
        return
    if step.action == SERVER_CRASH:
        check_server_crash(system)
        return
    if step.action not in ACTIONS:
        raise UsageError(f"unknown action {step.action!r}")
    if step.action in ("accept", "service"):
        if not step.operation_id:
            raise UsageError(f"{step.action} step needs an operation_id")
        inputs.check_operation_id(step.operation_id, f"{step.action} step operation_id")
        if step.payload is None:
            raise UsageError(f"{step.action} step needs a payload")
        inputs.check_value(step.payload, f"{step.action} step payload")
        try:
            canonical_json(step.payload)
        except (TypeError, ValueError) as error:
            raise UsageError(f"{step.action} payload is not JSON: {error}") from None
    check_crash_point(system, step.action, step.crash)


def check_server_crash(system: System, what: str = "a server_crash step") -> None:
    """Refuse a server fault (``server_crash``, ``drop_connection``) that cannot be run:
    only faultlab's own server may be crashed or have its sessions ended (a shared server
    is other people's), and only a PostgreSQL system's stores live on it."""
    from faultlab.stores import postgres as pgstores

    if pgstores.private_server() is None:
        raise UsageError(f"{what} needs faultlab's own PostgreSQL server "
                         "(--postgres private): a shared server is never touched")
    if getattr(system, "store_kind", None) != "postgres":
        raise UsageError(f"{what} needs a system whose stores are on PostgreSQL; "
                         f"{system.name} keeps them elsewhere")


def check_server_alive(system: System) -> None:
    """A private PostgreSQL server that died by itself fails the run (ExecutionError, exit
    3), whatever the step's worker showed: never a finding."""
    if getattr(system, "store_kind", None) != "postgres":
        return
    from faultlab.stores import postgres as pgstores

    pgstores.check_server_alive(wait=True)


class Executor:
    """Runs steps on one set of fresh stores and checks every invariant after each."""

    def __init__(
        self,
        system: System,
        spawner: Spawner,
        *,
        deduplication: bool = True,
        directory: Path | None = None,
        deadline: float = DEFAULT_DEADLINE,
        power: bool = False,
    ) -> None:
        system.require_deduplication_switch(deduplication)
        #: Record every SQLite change (workers and this process's readers) so that power
        #: steps can rebuild the stores as a power cut would leave them.
        self.power = power
        self.system = system
        self.spawner = spawner
        self.deduplication = deduplication
        self.deadline = deadline
        #: The trace's stores, made at enter and gone at close; None for a resumed branch,
        #: whose directory its caller owns.
        self._run: RunDirectory | None = RunDirectory(system, "faultlab-", power=power,
                                                      requested=directory)
        self.directory = Path()
        self.model = Model()
        #: What earlier steps established (``TERM``'s terminal results, ``ORDER``'s
        #: acceptance order): the history invariants a sequential trace can check.
        self.history = History(ordering_key=system.ordering_key)
        self.snapshot = Snapshot()
        self.observations: list[Observation] = []
        #: The trace's virtual clock and libfaketime's file, for virtual_wall_clock systems.
        self.clock: VirtualClock | None = None
        self.wall: WallClock | None = None
        #: The snapshots' read connections, kept open from enter to close.
        self._readers = ExitStack()
        #: How long each server_crash step's crash and restart (recovery included) took.
        self.server_crash_seconds: list[float] = []
        #: The stores' content when recording began or at the last power cut: a store that
        #: changed since without a recorded write was written by a program that does not
        #: record, and a power cut of it would be a pretence.
        #: Keyed by file name, so that it travels with a copy of the run directory.
        self.unrecorded_baseline: dict[str, str] = {}

    def _start_clock(self, *, existing: bool) -> None:
        if getattr(self.system, "virtual_wall_clock", False):
            self.clock = VirtualClock(self.directory, existing=existing)
            self.wall = WallClock(self.directory, self.clock.ticks)

    def _advance_clock(self, ticks: int) -> None:
        if self.clock is not None and self.wall is not None:
            self.wall.set(self.clock.advance(ticks))

    def _environment(self) -> tuple[tuple[str, str], ...]:
        power = {POWER_LOG_VARIABLE: str(self._power_log())} if self.power else {}
        if self.clock is None or self.wall is None:
            return tuple(sorted(power.items()))
        return tuple(sorted({**self.clock.environment(), **self.wall.environment(),
                             **power}.items()))

    def _power_log(self) -> Path:
        return self.directory / POWER_LOG

    def _store_digests(self) -> dict[str, str]:
        return store_digests(self.system, self.directory)

    @classmethod
    def resume(
        cls, system: System, spawner: Spawner, directory: Path, model: Model,
        snapshot: Snapshot, history: History, *, deduplication: bool = True,
        deadline: float = DEFAULT_DEADLINE, power: bool = False,
        baseline: Mapping[str, str] | None = None,
    ) -> Executor:
        """Continue from stores already in ``directory`` (a branch the caller owns and removes),
        with a copy of the model and of the history that produced them.

        ``power``: the branch records (its log was copied and relocated with its stores, see
        :func:`faultlab.stores.vfs.relocate`); run its steps inside :meth:`recording`.
        ``baseline``: the :attr:`unrecorded_baseline` of the executor it continues.
        """
        executor = cls(system, spawner, deduplication=deduplication, deadline=deadline,
                       power=power)
        executor.unrecorded_baseline = dict(baseline or {})
        executor._run = None
        executor.directory = directory
        executor.model = copy.deepcopy(model)
        executor.history = copy.deepcopy(history)
        executor.snapshot = snapshot
        executor._start_clock(existing=True)  # the clock file was copied with the stores
        return executor

    @contextmanager
    def recording(self) -> Iterator[None]:
        """While a resumed executor with ``power`` runs steps: this process records into the
        branch's log too (its reads recover a hot journal, a write a power cut may lose).

        Its readers are open before a worker runs, as through a whole trace of
        :meth:`__enter__`: otherwise a worker's connection would be a WAL store's last, and
        closing it checkpoints and syncs what a power cut must be able to lose. On leaving,
        they close without a checkpoint (the branch goes on from there) and recording stops.
        """
        if not self.power:
            yield
            return
        vfs.install(self._power_log())
        try:
            self._readers.enter_context(readers_kept_open())
            self.system.snapshot(self.directory)  # opens the readers
            yield
        finally:
            for connection in kept_connections():
                vfs.keep_wal_on_close(connection)
            self._readers.close()
            self._readers = ExitStack()
            if vfs.installed_directory() == str(self._power_log()):
                vfs.uninstall()

    def __enter__(self) -> Executor:
        try:
            if self._run is None:
                raise ExecutionError("a resumed executor runs in its caller's directory; "
                                     "it is not entered")
            # with power, recording starts before the readers open: their recovery of a
            # hot journal is recorded too
            self.directory = self._run.open()
            self.unrecorded_baseline = self._run.baseline
            self._readers.enter_context(readers_kept_open())
            self._start_clock(existing=False)
            self.snapshot = self.system.snapshot(self.directory)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        with interrupt.deferred():  # a signal must not leave half a run directory
            self._readers.close()  # before the stores go
            if self.wall is not None:
                self.wall.close()
            if self._run is not None:
                self._run.close()
            elif self.power and vfs.installed_directory() == str(self._power_log()):
                vfs.uninstall()

    @property
    def steps(self) -> list[Step]:
        return [observation.step for observation in self.observations]

    def run(self, step: Step, *, phase: str = "step") -> Observation:
        interrupt.check()  # after a SIGINT/SIGTERM no further worker starts
        validate_step(self.system, step)
        if step.action == POWER:
            return self._power_cut(step, phase)
        if step.action == SERVER_CRASH:
            return self._server_crash(step, phase)
        payload = None if step.action == "dispatch" else canonical_json(step.payload)
        spec = WorkerSpec(
            system=self.system.ref,
            role=step.action,
            directory=str(self.directory),
            operation_id=step.operation_id if step.action != "dispatch" else None,
            payload=payload,
            crash=step.crash,
            deduplication=self.deduplication,
            spawn=self.spawner.mode,
            deadline=self.deadline,
            environment=self._environment(),
        )
        if step.action == "service" and step.operation_id is not None:
            self.history.direct.add(step.operation_id)  # the caller's own delivery
        if step.action == "accept" and step.operation_id is not None:
            self.history.accept_begins(step.operation_id)
        record = self.system.run_step(spec, self.spawner)
        if record.exit_code != 0:  # not the step's doing if the server died under it
            check_server_alive(self.system)
        where = f"step {len(self.observations) + 1} {step.describe()}: worker pid {record.pid}"
        if record.timed_out:
            raise ExecutionError(
                f"{where} missed its {self.deadline:g}s deadline and was killed"
            )
        if record.exit_code == EXIT_USAGE:
            last = worker_message(record.stderr, record.response)
            raise ExecutionError(f"{where} refused its input (exit 2): {last}")
        after = self.system.snapshot(self.directory)
        self.model.observe(step.action, spec.operation_id, payload, record)
        return self._observe(step, phase, after, record, spec.operation_id, payload)

    def _observe(self, step: Step, phase: str, after: Snapshot, record: ProcessRecord,
                 operation_id: str | None = None, payload: str | None = None,
                 unopenable: tuple[str, ...] = ()) -> Observation:
        """Check the step that left the stores as ``after``: every per-step invariant, then
        the history (no worker announced a claim: only ``TERM`` and ``ORDER`` have input)."""
        before = self.snapshot
        found = self.history.check(before, after, alone=None, exited=[],
                                   acknowledged=self.model.acknowledged)
        check = Check(
            model=self.model, before=before, after=after, action=step.action,
            operation_id=operation_id, payload=payload, record=record,
            deduplication=self.deduplication, unopenable=unopenable, history=found,
        )
        self.snapshot = after
        observation = worker_observation(
            len(self.observations) + 1, step, record, before, after,
            (*check_step(check), *check_history(check)), phase, check,
        )
        self.observations.append(observation)
        return observation

    def _power_cut(self, step: Step, phase: str) -> Observation:
        """The machine loses power now (the previous worker is dead: it ended or was killed).

        The stores are rebuilt from the recording as the step's choice says, each must still
        open (``OPEN``), and what was acknowledged before the cut must still be there
        (``DURABLE``, with every other invariant). This process's readers are closed first
        without checkpointing a WAL (a checkpoint would sync what the cut must be able to
        lose) and reopened on the rebuilt files.
        """
        if not self.power:
            raise ExecutionError("a power step needs an executor that records (power=True)")
        for connection in kept_connections():
            vfs.keep_wal_on_close(connection)
        self._readers.close()
        self._readers = ExitStack()
        unopenable, self.unrecorded_baseline = cut_power(
            self.system, self.directory, self._power_log(), step.choice or {},
            self.unrecorded_baseline, f"power step {step.describe()}")
        self._readers.enter_context(readers_kept_open())
        after = self.snapshot if unopenable else self.system.snapshot(self.directory)
        return self._observe(step, phase, after, NO_PROCESS, unopenable=unopenable)

    def _server_crash(self, step: Step, phase: str) -> Observation:
        """The private PostgreSQL server crashes now and restarts (the previous worker has
        ended: nothing of the trace's holds a connection but this process's readers, which
        are reopened). What was acknowledged before must still be there after crash
        recovery (``DURABLE``, with every other invariant)."""
        from faultlab.stores import postgres as pgstores

        seconds = pgstores.crash_server()
        self.server_crash_seconds.append(seconds)
        return self._observe(step, phase, self.system.snapshot(self.directory), NO_PROCESS)

    def settle(self) -> tuple[list[Observation], list[Violation]]:
        """Recover to quiescence, then check LIVE.

        Dispatch while outbox work is pending; stop early when a dispatch changes
        neither store (recovery is stuck: another attempt would do the same). On a
        virtual clock, time first advances by the horizon (see the module docstring).
        """
        self._advance_clock(SETTLE_HORIZON)
        bound = 2 * len(self.snapshot.pending_outbox()) + 2
        observations: list[Observation] = []
        while self.snapshot.pending_outbox() and len(observations) < bound:
            observation = self.run(Step("dispatch"), phase="settle")
            observations.append(observation)
            if observation.violations:
                return observations, []
            if observation.snapshot == observation.before:
                break
        stuck = len(observations) if self.snapshot.pending_outbox() else None
        return observations, check_live(self.snapshot, still_pending_after=stuck)


def cut_power(system: System, directory: Path, log: Path, choice: Mapping[str, Any],
              baseline: Mapping[str, str], what: str) -> tuple[tuple[str, ...], dict[str, str]]:
    """The machine loses power now: every process that recorded into ``log`` is dead and
    this process's readers are closed. Rebuild the stores as ``choice`` says; return why
    each store that no longer opens does not (``OPEN``), and the new baseline. Recording
    into ``log`` goes on afterwards (the recovery the opening ran is durable).

    Refuses (ExecutionError, exit 3) a cut of a store whose writes were not recorded: a
    system's own program (a command-line system) runs its own SQLite, and unless it
    installs faultlab's VFS (:func:`faultlab.record_power_loss`) every write would count as
    durable and the cut would check nothing: a run that cannot test what it claims, not
    a clean one. A store is suspect when it changed since ``baseline`` (its digests when
    recording began or at the last cut) and ``log`` records no write of it.
    """
    vfs.uninstall()
    recorded = {os.path.realpath(name) for name in vfs.summary(log)["files"]}
    for name, digest in store_digests(system, directory).items():
        names = {os.path.realpath(directory / (name + suffix))
                 for suffix in ("", "-journal", "-wal")}
        if digest != baseline.get(name) and not names & recorded:
            raise ExecutionError(
                f"{what}: {name} was written without a recorded write, so a power cut "
                f"cannot be modelled: the system's program does not record its SQLite "
                f"writes (a Python program calls faultlab.record_power_loss() before it "
                f"opens a store; see the power loss guide)")
    try:
        vfs.power_image(log, choice)
    except vfs.VfsError as error:
        raise ExecutionError(f"{what}: {error}") from None
    unopenable = tuple(
        f"{path.name} does not open after the power cut: {problem}"
        for path in system.store_files(directory)
        if (problem := vfs.opens_cleanly(path)) is not None
    )
    after = store_digests(system, directory)
    vfs.install(log)
    return unopenable, after


@dataclass
class Execution:
    """A whole trace executed: every observation, the final LIVE check, the verdict.
    ``lanes``: the trace's lanes (0: a sequential trace, run one worker at a time)."""

    observations: list[Observation]
    final_violations: list[Violation]
    lanes: int = 0

    @property
    def verdict(self) -> Verdict:
        return Verdict.first(self.observations, self.final_violations)

    @property
    def violations(self) -> list[Violation]:
        found = [v for o in self.observations for v in o.violations]
        return found + self.final_violations

    def executed_prefix(self) -> list[Step]:
        """The steps a finding is measured and shrunk by, up to the failing check (all of
        them for a clean run or a final LIVE): a sequential trace's executed steps, its
        recovery's included; a laned trace's own scheduling choices (its recovery is
        implicit, the same for every trace)."""
        upto = self.verdict.step
        observations = self.observations if upto is None else self.observations[:upto]
        return [o.step for o in observations if not self.lanes or o.phase == "step"]


def execute(
    system: System,
    steps: Iterable[Step],
    spawner: Spawner,
    *,
    deduplication: bool = True,
    settle: bool = False,
    directory: Path | None = None,
    deadline: float = DEFAULT_DEADLINE,
) -> Execution:
    """Run a fixed list of steps on fresh stores; settle afterwards when asked and still clean."""
    steps = list(steps)
    for step in steps:
        validate_step(system, step)
    power = any(step.action == POWER for step in steps)
    with Executor(
        system, spawner, deduplication=deduplication, directory=directory, deadline=deadline,
        power=power,
    ) as executor:
        for step in steps:
            executor.run(step)
        final: list[Violation] = []
        if settle and not any(o.violations for o in executor.observations):
            _, final = executor.settle()
        return Execution(list(executor.observations), final)
