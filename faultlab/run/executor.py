"""The one executor behind scenarios, exploration, enumeration and replay.

:class:`Executor` runs a trace's steps on one set of fresh stores and checks every
invariant after each. A sequential trace is the one-lane case and takes the fast path:
each step is one real worker process run to its end (through the system's
:meth:`~faultlab.system.contract.System.run_step`), no other worker alive beside it.
A laned trace keeps several workers alive at once (:class:`faultlab.run.interleaving.Lanes`
starts, holds, releases, kills and pauses them); each step is one scheduling choice, and
the trace has its own virtual clock (:mod:`faultlab.base.clock`). Either way the stores
are read back after every step and every invariant is checked: per worker that ended,
and over the trace's history (:mod:`faultlab.checks.history`).

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
from collections.abc import Iterable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import TracebackType

from faultlab.base import inputs, interrupt
from faultlab.base.canonical import canonical_json
from faultlab.base.clock import SETTLE_HORIZON, VirtualClock
from faultlab.base.errors import EXIT_USAGE, ExecutionError, UsageError
from faultlab.base.messages import worker_message
from faultlab.base.wall_clock import WallClock
from faultlab.checks.history import History, LoneRun
from faultlab.checks.invariants import (
    BY_NAME,
    HISTORY_INVARIANTS,
    STEP_INVARIANTS,
    Check,
    Model,
    Violation,
    check_history,
    check_live,
    check_quiet,
    check_step,
)
from faultlab.process.records import (
    DEFAULT_DEADLINE,
    POWER_LOG_VARIABLE,
    ProcessRecord,
    WorkerSpec,
)
from faultlab.process.spawn import Spawner
from faultlab.run.directory import POWER_LOG, RunDirectory
from faultlab.run.faults import (
    check_power_cut,
    check_server_alive,
    check_server_crash,
    cut_power,
)
from faultlab.run.interleaving import BLOCK_BOUND, Lane, Lanes
from faultlab.run.observation import NO_PROCESS, Execution, Observation, worker_observation
from faultlab.stores import postgres as pgstores
from faultlab.stores import vfs
from faultlab.stores.sqlite import (
    Snapshot,
    kept_connections,
    readers_kept_open,
)
from faultlab.system.contract import System, check_crash_point
from faultlab.trace import ACTIONS, DROP_CONNECTION, POWER, SERVER_CRASH, Step, Trace

#: Per-step checks that judge one worker's whole run against the snapshot before it
#: started; in a laned trace, with other lanes changing the stores meanwhile, they apply
#: only to a worker that was alone from its start to its end (:meth:`Executor._quiet`).
SEQUENTIAL_ONLY = ("QUIET",)
QUIET = BY_NAME["QUIET"]
#: The per-step invariants judged after every step of a laned trace (QUIET apart).
PER_STEP: tuple[str, ...] = tuple(i.name for i in STEP_INVARIANTS if i.name not in SEQUENTIAL_ONLY)


def checks_after(ended: int) -> int:
    """Invariant checks run after a scheduling choice at which ``ended`` workers ended: each
    per-step invariant per worker (at least once), and each history invariant once."""
    return len(PER_STEP) * max(1, ended) + len(HISTORY_INVARIANTS)


def validate_step(system: System, step: Step) -> None:
    """Refuse a step the system cannot run (before anything is executed)."""
    if step.laned:
        raise UsageError(f"{step.describe()}: a sequential trace's step names no lane and "
                         "never holds (a laned trace runs through the lanes)")
    if step.action == POWER:
        Step.power(step.choice)  # raises UsageError for a malformed choice
        check_power_cut(system)
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


class Executor:
    """Runs a trace's steps on one set of fresh stores and checks every invariant after each.

    ``concurrency`` lanes; the trace is laned (several workers alive at once) when it has
    more than one lane or ``statement_points``, or when ``laned`` says so (a laned trace
    of one lane); otherwise each step runs one worker to its end, the fast path. Workers
    start through ``spawner`` (one of the executor's own, closed with it, when None).
    """

    def __init__(
        self,
        system: System,
        spawner: Spawner | None = None,
        *,
        concurrency: int = 1,
        laned: bool | None = None,
        statement_points: bool = False,
        deduplication: bool = True,
        directory: Path | None = None,
        deadline: float = DEFAULT_DEADLINE,
        power: bool = False,
        block_bound: float = BLOCK_BOUND,
    ) -> None:
        system.require_deduplication_switch(deduplication)
        if power:
            check_power_cut(system, "recording for power cuts")
        if statement_points:
            system.require_statement_points()
        #: Record every SQLite change (workers and this process's readers) so that power
        #: steps can rebuild the stores as a power cut would leave them.
        self.power = power
        self.system = system
        self._own_spawner = spawner is None
        self.spawner = Spawner() if spawner is None else spawner
        self.concurrency = concurrency
        self.laned = concurrency > 1 or statement_points if laned is None else laned
        self.statement_points = statement_points
        self.block_bound = block_bound
        self.deduplication = deduplication
        self.deadline = deadline
        #: The trace's stores, made at enter and gone at close; None for a resumed branch,
        #: whose directory its caller owns.
        self._run: RunDirectory | None = RunDirectory(
            system, "faultlab-lanes-" if self.laned else "faultlab-", power=power,
            requested=directory)
        #: A laned trace's live workers (made at enter).
        self._lanes: Lanes | None = None
        #: The per-step invariants (and LIVE) that had something to check in a laned trace.
        self.checked: set[str] = set()
        #: Why each store does not open after the power cut of the step being observed.
        self._unopenable: tuple[str, ...] = ()
        self.directory = Path()
        self.model = Model()
        #: What earlier steps established (``TERM``'s terminal results, ``ORDER``'s
        #: acceptance order): the history invariants a sequential trace can check.
        self.history = History(ordering_key=system.ordering_key)
        self.snapshot = Snapshot()
        self.observations: list[Observation] = []
        #: The trace's virtual clock (a laned trace's own; a sequential trace's only on the
        #: virtual wall clock) and libfaketime's file, for virtual_wall_clock systems.
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
        """The trace's clock variables (and libfaketime's), and where to record for power
        cuts, in every worker's spec."""
        power = {POWER_LOG_VARIABLE: str(self._power_log())} if self.power else {}
        clock = self.clock.environment() if self.clock is not None else {}
        wall = self.wall.environment() if self.wall is not None else {}
        return tuple(sorted({**clock, **wall, **power}.items()))

    def _set_server_clock(self) -> None:
        """A private PostgreSQL server's ``now()`` follows a laned trace's clock (one tick,
        one second after its epoch), so a lease the server stamps lapses at the tick that
        passes it; each trace starts the server's clock at 0 again. A shared server's
        clock is not faultlab's: nothing moves there."""
        if self.clock is not None and getattr(self.system, "store_kind", None) == "postgres":
            pgstores.set_server_clock(self.clock.ticks)

    @property
    def lanes(self) -> dict[int, Lane]:
        """The lanes' current workers, by lane number (none in a sequential trace)."""
        return {} if self._lanes is None else self._lanes.lanes

    @property
    def workers(self) -> int:
        """The workers a laned trace started so far."""
        return 0 if self._lanes is None else self._lanes.workers

    @property
    def processes(self) -> int:
        """The processes the trace started so far: workers and the services they started."""
        if self._lanes is not None:
            return self._lanes.processes
        return sum(observation.processes for observation in self.observations)

    def _power_log(self) -> Path:
        return self.directory / POWER_LOG

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
            # inside the try: a signal held back while the directory is made is raised as
            # the deferred block ends, and close() must then remove the directory. With
            # power, recording starts before the readers open: their recovery of a hot
            # journal is recorded too
            self.directory = self._run.open()
            self.unrecorded_baseline = self._run.baseline
            if self.laned:
                # a laned trace's own clock; its readers are kept open too (released before
                # this process forks: see Lanes._spawn), under power cuts as well: a
                # worker's connection closed as a WAL store's last checkpoints and syncs what
                # a cut must be able to lose (closing its snapshot's did the same)
                self._readers.enter_context(readers_kept_open())
                self.clock = VirtualClock(self.directory)
                self._set_server_clock()
                if getattr(self.system, "virtual_wall_clock", False):
                    self.wall = WallClock(self.directory)
                self._lanes = Lanes(
                    self.system, self.spawner, concurrency=self.concurrency,
                    history=self.history, ticks=self._ticks, deadline=self.deadline,
                    block_bound=self.block_bound, statement_points=self.statement_points,
                    power=self.power,
                    wall=self.wall.environment() if self.wall is not None else None)
            else:
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
        """Kill every lane still alive (faultlab started them all), reap, remove the stores.

        Under deferred signals: a SIGINT that lands here (at the end of an example) must
        not leave the run directory behind; it is raised once the directory is gone."""
        with interrupt.deferred():
            try:
                if self._lanes is not None:
                    self._lanes.close()
            finally:  # the stores go whatever happened above (the helper kills the rest)
                self._readers.close()  # before the stores go
                if self.wall is not None:
                    self.wall.close()
                # PostgreSQL databases (and their snapshot connection) never outlive a
                # trace: a long concurrent run would otherwise exhaust the server's
                # connections
                if self._run is not None:
                    self._run.close()
                elif self.power and vfs.installed_directory() == str(self._power_log()):
                    vfs.uninstall()
                if self._own_spawner:
                    self.spawner.close()

    def _ticks(self) -> int:
        return self.clock.ticks if self.clock is not None else 0

    @property
    def steps(self) -> list[Step]:
        return [observation.step for observation in self.observations]

    def run(self, step: Step, *, phase: str = "step") -> Observation:
        """Run one step and check it: a worker to its end (the fast path of a sequential
        trace), a scheduling choice among the lanes, or a fault."""
        # after a SIGINT/SIGTERM no further step runs: a state machine's teardown would
        # otherwise settle the interrupted trace (resume, finish, recover), and a worker
        # left waiting on a lock held that up to its deadline
        interrupt.check()
        if self._lanes is not None:
            return self._schedule(self._lanes, step, phase)
        validate_step(self.system, step)
        if step.action == POWER:
            return self._power_cut(step, phase)
        if step.action == SERVER_CRASH:
            return self._server_crash(step, phase)
        spec = self._spec(step)
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
        self.model.observe(step.action, spec.operation_id, spec.payload, record)
        return self._observe(step, phase, after, record, spec.operation_id, spec.payload)

    def _spec(self, step: Step) -> WorkerSpec:
        """The worker a step starts, as the system will run it; the history learns of a
        direct delivery and of an acceptance as it begins."""
        payload = None if step.action == "dispatch" else canonical_json(step.payload)
        if step.action == "service" and step.operation_id is not None:
            self.history.direct.add(step.operation_id)  # the caller's own delivery
        if step.action == "accept" and step.operation_id is not None:
            self.history.accept_begins(step.operation_id)
        return WorkerSpec(
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
        unopenable = self._cut_stores(step)
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
        A laned trace first lets every lane run to its end (:meth:`_settle_lanes`).
        """
        if self._lanes is not None:
            return self._settle_lanes(self._lanes)
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


    # -- a laned trace -------------------------------------------------------------------

    def check_step(self, step: Step) -> None:
        """Refuse a step the trace cannot run now (UsageError): malformed, a fault faultlab
        cannot cause for real here, or one the lanes' current states do not allow."""
        if self._lanes is None:
            validate_step(self.system, step)
            return
        step.validate(self.concurrency)
        if step.action == SERVER_CRASH:
            check_server_crash(self.system)
        elif step.action == DROP_CONNECTION:
            check_server_crash(self.system, "a drop_connection step")
        elif step.starts:
            check_crash_point(self.system, step.action, step.crash)
        self._lanes.check(step)

    def _schedule(self, lanes: Lanes, step: Step, phase: str) -> Observation:
        """One scheduling choice of a laned trace, then every check."""
        self.check_step(step)
        lanes.begin()
        sigkills = 0
        started = lanes.processes
        moved: Lane | None = None
        if step.action == "tick":
            if self.clock is None:
                raise ExecutionError("the executor is not open")
            self.clock.advance(step.ticks or 0)
            self._set_server_clock()
            if self.wall is not None:
                self.wall.set(self.clock.ticks)
        elif step.action == SERVER_CRASH:
            # every live lane's connections die with the server; its worker runs on (held,
            # blocked or paused where it was) and meets the failure at its next statement
            pgstores.crash_server()
        elif step.action == POWER:
            sigkills = self._cut_lanes(lanes, step)
        elif step.starts:
            moved = lanes.start(step, self._spec(step), self.snapshot)
        else:
            moved, sigkills = lanes.move(step, self.directory)
        if step.action not in ("tick", "pause", POWER):  # none can free a lock (a cut
            lanes.settle_blocked(moved)                  # leaves no lane alive)
        return self._observe_lanes(lanes, step, moved, phase, sigkills,
                                   lanes.processes - started)

    def _cut_lanes(self, lanes: Lanes, step: Step) -> int:
        """The machine loses power now: every live lane dies with its service, then the
        stores are rebuilt as the step's choice says (:func:`faultlab.run.faults.cut_power`).
        Returns the SIGKILLs."""
        if not self.power:
            raise ExecutionError("a power step needs an executor that records (power=True)")
        killed = lanes.kill_all()
        self._unopenable = self._cut_stores(step)
        return killed

    def _cut_stores(self, step: Step) -> tuple[str, ...]:
        """Rebuild the stores as the power step's choice says (every process that recorded
        is dead): this process's readers are closed first without checkpointing a WAL (a
        checkpoint would sync what the cut must be able to lose) and kept open again
        afterwards. Returns why each store that no longer opens does not."""
        for connection in kept_connections():
            vfs.keep_wal_on_close(connection)
        self._readers.close()
        self._readers = ExitStack()
        unopenable, self.unrecorded_baseline = cut_power(
            self.system, self.directory, self._power_log(), step.choice or {},
            self.unrecorded_baseline, f"power step {step.describe()}")
        self._readers.enter_context(readers_kept_open())
        return unopenable

    def _observe_lanes(self, lanes: Lanes, step: Step, moved: Lane | None, phase: str,
                       sigkills: int, processes: int) -> Observation:
        """Check a scheduling choice: the per-step invariants for each worker that ended at
        it (once for a step that ended none), QUIET for a worker that was alone, and the
        history, claims included."""
        before = self.snapshot
        unopenable, self._unopenable = self._unopenable, ()
        after = before if unopenable else self.system.snapshot(self.directory)
        violations: list[Violation] = []
        covered: set[str] = set()
        exited = list(lanes.exited)
        for worker, record in exited:
            lane = lanes.worker_lane(worker)
            self.model.observe(lane.spec.role, lane.spec.operation_id, lane.spec.payload, record)
        checks: list[tuple[WorkerSpec | None, ProcessRecord]] = [
            (lanes.worker_lane(worker).spec, record) for worker, record in exited
        ]
        if not checks or step.action in (SERVER_CRASH, POWER):  # DURABLE judges the fault
            checks.append((None, NO_PROCESS))
        for spec, record in checks:
            check = Check(
                model=self.model, before=before, after=after,
                action=spec.role if spec is not None else step.action,
                operation_id=spec.operation_id if spec is not None else None,
                payload=spec.payload if spec is not None else None, record=record,
                deduplication=self.deduplication,
                unopenable=unopenable if spec is None else (),
            )
            for invariant in STEP_INVARIANTS:
                if invariant.check is not None and invariant.name not in SEQUENTIAL_ONLY:
                    if not invariant.vacuous(check):
                        covered.add(invariant.name)
                    violations += [Violation(invariant.name, message)
                                   for message in invariant.check(check)]
        violations += self._quiet(lanes, exited, after, covered)
        others_moving = any(
            lane is not moved and lane.alive and not lane.paused and lane.status != "held"
            for lane in lanes.lanes.values()
        )
        alone = moved.worker if moved is not None and not others_moving else None
        ended = {worker for worker, _ in exited}
        lone = tuple(LoneRun(lane.worker, lane.start_snapshot, lane.started_at)
                     for lane in lanes.lanes.values()
                     if lane.worker in ended and lane.solitary)
        found = self.history.check(
            before, after, alone=alone, exited=exited, acknowledged=self.model.acknowledged,
            lone=lone)
        judged = Check(model=self.model, before=before, after=after, action=step.action,
                       operation_id=None, payload=None, record=NO_PROCESS,
                       deduplication=self.deduplication, history=found)
        covered.update(i.name for i in HISTORY_INVARIANTS if not i.vacuous(judged))
        violations += check_history(judged)
        self.checked |= covered
        self.snapshot = after
        # an armed point that fired: the worker, or the service a dispatcher started (a kill
        # or power step's own SIGKILLs are counted by the step)
        fired: list[str] = []
        for worker, record in exited:
            here = int(record.killed and step.action not in ("kill", POWER)) \
                + int(record.service_killed)
            sigkills += here
            point = lanes.worker_lane(worker).spec.crash
            if here and point is not None:
                fired.append(point)
        observation = Observation(
            len(self.observations) + 1, step, before, after, tuple(dict.fromkeys(violations)),
            phase, exited=tuple(exited), lanes=lanes.states(), sigkills=sigkills,
            processes=processes, checks=checks_after(len(exited)),
            covered=frozenset(covered), armed=step.crash if step.starts else None,
            fired=tuple(fired),
        )
        self.observations.append(observation)
        return observation

    def _quiet(self, lanes: Lanes, exited: list[tuple[int, ProcessRecord]], after: Snapshot,
               covered: set[str]) -> list[Violation]:
        """QUIET for a dispatcher that was the only worker alive from its start to its exit:
        judged against the stores as it found them, as a sequential trace judges it (added
        to ``covered`` when it had something to check)."""
        found: list[Violation] = []
        for worker, record in exited:
            lane = lanes.worker_lane(worker)
            if lane.spec.role != "dispatch" or not lane.solitary:
                continue
            check = Check(
                model=self.model, before=lane.start_snapshot, after=after, action="dispatch",
                operation_id=None, payload=None, record=record,
                deduplication=self.deduplication,
            )
            if not QUIET.vacuous(check):
                covered.add(QUIET.name)
            found += [Violation(QUIET.name, message) for message in check_quiet(check)]
        return found

    def _settle_lanes(self, lanes: Lanes) -> tuple[list[Observation], list[Violation]]:
        """A laned trace's recovery: paused lanes resume and every lane runs to its end (in
        lane order); then the virtual clock advances by :data:`SETTLE_HORIZON` ticks, so
        every lease and delay shorter than that lapses; then fresh dispatchers run one at
        a time while work is pending, stopping when one makes no progress."""
        observations: list[Observation] = []

        def step(lane_step: Step) -> bool:
            observation = self.run(lane_step, phase="settle")
            observations.append(observation)
            return bool(observation.violations)

        for _ in range(3):
            for number in sorted(lanes.lanes):
                lane = lanes.lanes[number]
                if lane.alive and lane.paused and step(Step("resume", lane=number)):
                    return observations, []
                if lane.alive and lane.status == "held" and step(Step("finish", lane=number)):
                    return observations, []
            if not lanes.alive:
                break
            for lane in lanes.lanes.values():
                if lane.alive and lane.status == "blocked":
                    lanes.wait(lane, self.deadline)
        for lane in lanes.lanes.values():
            if lane.alive:
                raise ExecutionError(f"lane {lane.number} pid {lane.pid} is still "
                                     f"{lane.status} after recovery")
        if step(Step("tick", ticks=SETTLE_HORIZON)):
            return observations, []
        bound = 2 * len(self.snapshot.pending_outbox()) + 2
        recovered = 0
        while self.snapshot.pending_outbox() and recovered < bound:
            recovered += 1
            if step(Step("dispatch", lane=1)):
                return observations, []
            if observations[-1].snapshot == observations[-1].before:
                break
        stuck = recovered if self.snapshot.pending_outbox() else None
        self.checked.add("LIVE")
        return observations, check_live(self.snapshot, still_pending_after=stuck)


def execute(
    system: System,
    steps: Iterable[Step],
    spawner: Spawner | None = None,
    *,
    concurrency: int = 1,
    laned: bool | None = None,
    statement_points: bool = False,
    deduplication: bool = True,
    settle: bool = False,
    directory: Path | None = None,
    deadline: float = DEFAULT_DEADLINE,
    lenient: bool = False,
) -> Execution:
    """Run a fixed list of steps on fresh stores; settle afterwards when asked and still clean.

    A laned trace stops at its first failing step. A step the lanes' states do not allow
    raises UsageError before it runs; with ``lenient`` (shrinking) it is skipped instead,
    and the observations show only the steps that ran.
    """
    steps = list(steps)
    power = any(step.action == POWER for step in steps)
    with Executor(
        system, spawner, concurrency=concurrency, laned=laned,
        statement_points=statement_points, deduplication=deduplication,
        directory=directory, deadline=deadline, power=power,
    ) as executor:
        if not executor.laned:
            for step in steps:
                validate_step(system, step)
        for step in steps:
            if lenient and executor.laned:
                try:
                    executor.check_step(step)
                except UsageError:
                    continue  # a shrinking candidate: this step lost its worker; drop it
            observation = executor.run(step)
            if observation.violations and executor.laned:
                break
        final: list[Violation] = []
        if settle and not any(o.violations for o in executor.observations):
            _, final = executor.settle()
        lanes = executor.concurrency if executor.laned else 0
        return Execution(list(executor.observations), final, lanes)


def execute_trace(system: System, trace: Trace, spawner: Spawner | None = None, *,
                  deadline: float = DEFAULT_DEADLINE, lenient: bool = False) -> Execution:
    """Run a whole trace on fresh stores, as it is saved (its own steps, its recovery when
    it settles): the one way replay, exploration and the API run a trace."""
    return execute(system, trace.steps, spawner, concurrency=trace.concurrency,
                   laned=trace.laned, statement_points=trace.statement_points,
                   deduplication=trace.deduplication, settle=trace.settle,
                   deadline=deadline, lenient=lenient)
