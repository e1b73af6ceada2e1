"""The concurrent executor: several real worker processes alive at once, scheduled by faultlab.

Each lane runs one worker at a time as a real OS process (forked from this
process, or a fresh interpreter in exec mode) with a control pipe
(:mod:`faultlab.schedule`): the worker holds at every named point it reaches
and announces it, and faultlab decides which lane moves next. Between points
the processes run for real against the same SQLite files, with SQLite's own
locks and busy timeouts. Only one lane is released at a time; a released lane
that neither reaches a point nor ends within :data:`BLOCK_BOUND` seconds, and
whose processes are not working (:func:`_still_working`), is
*blocked* (waiting on a lock another lane holds at its point) and the step
ends there, so the schedule can release the lane that holds the lock: a run
never deadlocks. ``kill`` is a SIGKILL of the lane's process group from outside,
``pause``/``resume`` SIGSTOP/SIGCONT of it; nothing here ever signals a process
it did not start.

A command-line system's program is scheduled through the announcement protocol
it already speaks (:mod:`faultlab.nemesis.announce`: ``reached POINT PID``,
answered ``continue``); a program that announces nothing runs free from start
to end, and can still be paused, resumed and killed.

After every step both stores are read back and every per-step invariant is
checked, plus the history invariants of :mod:`faultlab.checks.history`.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

from faultlab.base import interrupt
from faultlab.base.canonical import canonical_json
from faultlab.base.clock import SETTLE_HORIZON, VirtualClock
from faultlab.base.errors import EXIT_USAGE, ExecutionError, UsageError
from faultlab.base.messages import printable, worker_message
from faultlab.base.wall_clock import WallClock
from faultlab.checks.history import Claim, History, LoneRun
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
)
from faultlab.nemesis.announce import CONTINUE as ANNOUNCE_CONTINUE
from faultlab.nemesis.announce import ProtocolError, channel_environment, parse_announcement
from faultlab.nemesis.schedule import CONTINUE, RETRY_SIGNAL, SCHEDULE_ENV, STATEMENTS_ENV
from faultlab.process.launch import Launcher, Running
from faultlab.process.records import (
    DEFAULT_DEADLINE,
    POWER_LOG_VARIABLE,
    ProcessRecord,
    SpawnMode,
    WorkerSpec,
    parse_response,
)
from faultlab.process.spawn import (
    Spawner,
    child_environment,
    reap_group,
    tree_activity,
    tree_pids,
)

# Imported here, not in the forked child: a child that imported a module from disk would
# run whatever the file holds at that moment, not what this run loaded.
from faultlab.run.directory import POWER_LOG, RunDirectory
from faultlab.run.executor import (
    NO_PROCESS,
    Execution,
    Observation,
    check_server_crash,
    cut_power,
    execute,
)
from faultlab.run.worker import run_worker
from faultlab.stores import postgres as pgstores
from faultlab.stores.sqlite import Snapshot, readers_are_kept
from faultlab.system.contract import Program, System, check_crash_point
from faultlab.trace import DROP_CONNECTION, POWER, SERVER_CRASH, Step, Trace

#: Seconds a released lane may run without reaching a point or ending before it counts as
#: blocked on another lane's lock. Generous: a loaded machine must not misjudge a slow lane.
BLOCK_BOUND = 1.0
#: Past the bound, a lane whose processes still work gets another slice of this many
#: seconds, and is blocked once a slice passes with none of them runnable or busy.
WORK_SLICE = 0.25
#: CPU ticks (1/100 s) in one slice above which a lane counts as working: a worker in
#: SQLite's busy wait sleeps and uses next to none.
WORKING_TICKS = 2
#: A faultlab worker seen asleep in SQLite's busy handler, while another lane is alive,
#: is woken to retry at once (:data:`RETRY_SIGNAL`); seen asleep
#: again after that (it retried and failed), and not working, it waits for a lock another
#: lane holds: blocked without waiting for :data:`BLOCK_BOUND`. A worker that never shows
#: the retry (no handler: the signal is ignored) is blocked once it was seen asleep at
#: every poll for :data:`LOCK_WAIT` (the busy handler sleeps at most 100 ms at a time).
#: Polled every :data:`LOCK_POLL`, every :data:`RETRY_POLL` after a wake.
LOCK_WAIT = 0.05
LOCK_POLL = 0.004
RETRY_POLL = 0.002
#: What /proc/PID/wchan shows for a process in nanosleep() (SQLite's busy handler).
SLEEPING = ("hrtimer_nanosleep", "do_nanosleep")
#: Per-step checks that judge one worker's whole run against the snapshot before it
#: started; with other lanes changing the stores meanwhile they do not apply.
SEQUENTIAL_ONLY = ("QUIET",)  # judged apart, by :meth:`LaneExecutor._quiet`
QUIET = BY_NAME["QUIET"]
#: The per-step invariants judged after every lane step (QUIET apart).
PER_STEP: tuple[str, ...] = tuple(i.name for i in STEP_INVARIANTS if i.name not in SEQUENTIAL_ONLY)
MAX_OUTPUT = 1 << 20  # bytes of a lane's stdout or stderr kept, as for sequential workers


def checks_after(ended: int) -> int:
    """Invariant checks run after a scheduling choice at which ``ended`` workers ended: each
    per-step invariant per worker (at least once), and each history invariant once."""
    return len(PER_STEP) * max(1, ended) + len(HISTORY_INVARIANTS)


def _lock_waiting(pid: int) -> bool:
    """Whether the process sleeps in nanosleep() now (False where /proc does not say)."""
    try:
        return Path(f"/proc/{pid}/wchan").read_text() in SLEEPING
    except OSError:
        return False


def _lock_sleeper(pid: int) -> int | None:
    """The process of a lane asleep in nanosleep() now: the worker, or, while the worker
    waits for a service child it started, that child (a dispatcher's service waiting for
    the receiver's lock while another lane holds it at a point; the dispatcher itself
    sleeps in poll, and the lane was judged blocked only at :data:`BLOCK_BOUND`, a
    second later). None when none is."""
    for member in tree_pids(pid):
        if _lock_waiting(member):
            return member
    return None


def _sleeps(pid: int) -> int:
    """How many times the process went to sleep by itself so far (its voluntary context
    switches; -1 where /proc does not say): a count that grew since a wake shows that the
    process ran again, and slept again, after it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return -1
    for line in status.splitlines():
        if line.startswith("voluntary_ctxt_switches:"):
            return int(line.split()[1])
    return -1


def _wake(pid: int) -> None:
    """Wake a lane's worker from the busy handler's sleep so it retries its lock now."""
    try:
        os.kill(pid, RETRY_SIGNAL)
    except ProcessLookupError:
        pass


@dataclass
class Lane:
    """One live worker process in a lane, and what it has announced so far."""

    number: int
    worker: int
    spec: WorkerSpec
    #: The worker's process (its pid, its pipes), started by the process layer.
    process: Running
    #: The read ends of its pipes not yet at their end (announce, stdout, stderr).
    fds: dict[int, str]
    go: bytes = CONTINUE  # what lets this lane's worker continue from a point
    status: str = "running"  # running, held, blocked, exited
    paused: bool = False
    point: str | None = None
    points: list[str] = field(default_factory=list)
    chunks: dict[str, list[bytes]] = field(default_factory=dict)
    pending_line: bytes = b""
    record: ProcessRecord | None = None
    #: The stores when the worker started, and whether it stayed the only worker alive
    #: from start to exit (then a dispatch's QUIET can be judged as in a sequential trace).
    start_snapshot: Snapshot = field(default_factory=Snapshot)
    solitary: bool = True
    #: The virtual clock when it started.
    started_at: int = 0
    #: The system's own program running the worker (None: faultlab's worker).
    program: Program | None = None
    #: It broke its protocol: killed, and whatever else it wrote is not read as an
    #: announcement (close() drains its pipes; the run has already failed).
    broken: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def alive(self) -> bool:
        return self.status != "exited"

    def shown(self) -> str:
        """The lane's state as the replay table shows it."""
        if self.status == "exited" and self.record is not None:
            return f"exit {self.record.exit_code}"
        where = f"@{self.point}" if self.status == "held" and self.point else self.status
        return f"{self.spec.role} {where}{' paused' if self.paused else ''}"


def _run_lane_worker(spec: WorkerSpec, environment: dict[str, str],
                     channel: tuple[int, int]) -> int:
    """The body of a forked lane worker, after :func:`faultlab.process.spawn.child_main` gave it
    its own group and pipes: the schedule's channel (its two descriptors as numbered in this
    process) and the clock's variables, then the worker."""
    os.environ.update(environment)
    os.environ[SCHEDULE_ENV] = f"{channel[0]},{channel[1]}"
    return run_worker(spec)


def _program_environment(program: Program, decide: int, announce: int) -> dict[str, str]:
    """A system's own program's environment, as the system gave it; one that speaks the
    announcement protocol also finds its channel there (and holds at every point it
    announces, ``reached POINT PID``, until faultlab answers ``continue``); any other runs
    free between start and end (it can still be paused, resumed and killed)."""
    environment = dict(program.env)
    if program.announces:
        environment.update(channel_environment(announce_fd=announce, resume_fd=decide))
    return environment


class LaneExecutor:
    """Runs a concurrent trace's steps on one set of fresh stores, with its own clock."""

    def __init__(
        self, system: System, *, concurrency: int, deduplication: bool = True,
        spawn: SpawnMode = "fork", deadline: float = DEFAULT_DEADLINE,
        block_bound: float = BLOCK_BOUND, statement_points: bool = False,
        power: bool = False,
    ) -> None:
        system.require_deduplication_switch(deduplication)
        #: Record every SQLite change (the lanes' workers and this process's reads) so that
        #: power steps can rebuild the stores as a power cut would leave them.
        self.power = power
        #: The stores' digests when recording began or at the last cut (see
        #: :func:`faultlab.run.executor.cut_power`).
        self.unrecorded_baseline: dict[str, str] = {}
        if statement_points and not system.supports_statement_points:
            raise UsageError(f"{system.name}: statement scheduling points (sql:K, commit:K) "
                             "need faultlab's own worker processes (a Python system)")
        #: Python workers also hold at sql:K and commit:K (before the K-th statement,
        #: after the K-th COMMIT), not only at their named points.
        self.statement_points = statement_points
        self.system = system
        self.concurrency = concurrency
        self.deduplication = deduplication
        self.spawn = spawn
        self.deadline = deadline
        self.block_bound = block_bound
        #: A Python system's workers sleep only in SQLite's busy handler (waiting for a
        #: lock); a command-line program may sleep for reasons of its own.
        self.fast_blocking = system.sleeps_only_on_locks
        #: The trace's stores, made at enter (named by this process's pid) and gone at close.
        self._run = RunDirectory(system, "faultlab-lanes-", power=power)
        self.directory = Path()
        self.clock: VirtualClock | None = None
        self.wall: WallClock | None = None  # libfaketime's file, for virtual_wall_clock
        self.model = Model()
        self.history = History(ordering_key=system.ordering_key)
        #: The per-step invariants (and LIVE) that had something to check in this trace.
        self.checked: set[str] = set()
        self.snapshot = Snapshot()
        self.lanes: dict[int, Lane] = {}
        self.observations: list[Observation] = []
        self.workers = 0
        self.processes = 0
        self._selector = selectors.DefaultSelector()
        #: Starts this trace's workers (the process layer's; closed with the trace).
        self._launcher = Launcher(_run_lane_worker)
        self._exited: list[tuple[int, ProcessRecord]] = []
        #: Why each store does not open after the power cut of the step being observed.
        self._unopenable: tuple[str, ...] = ()

    # -- lifetime ------------------------------------------------------------------------

    def __enter__(self) -> LaneExecutor:
        try:
            # inside the try: a signal held back while the directory is made is raised
            # as the deferred block ends, and close() must then remove the directory
            self.directory = self._run.open()
            self.unrecorded_baseline = self._run.baseline
            self.clock = VirtualClock(self.directory)
            self._set_server_clock()
            if getattr(self.system, "virtual_wall_clock", False):
                self.wall = WallClock(self.directory)
            self.snapshot = self.system.snapshot(self.directory)
        except BaseException:
            self.close()
            raise
        return self

    def _set_server_clock(self) -> None:
        """A private PostgreSQL server's ``now()`` follows the trace's clock (one tick, one
        second after its epoch), so a lease the server stamps lapses at the tick that
        passes it; each trace starts the server's clock at 0 again. A shared server's
        clock is not faultlab's: nothing moves there."""
        if self.clock is not None and getattr(self.system, "store_kind", None) == "postgres":
            pgstores.set_server_clock(self.clock.ticks)

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def close(self) -> None:
        """Kill every lane still alive (faultlab started them all), reap, remove the stores.

        Under deferred signals: a SIGINT that lands here (at the end of an example) must
        not leave the run directory behind; it is raised once the directory is gone."""
        with interrupt.deferred():
            try:
                lanes = list(self.lanes.values())
                for lane in lanes:  # every lane is killed first: they die together
                    if lane.alive:
                        self._signal(lane, signal.SIGKILL)
                        if lane.paused:
                            self._signal(lane, signal.SIGCONT)
                for lane in lanes:
                    if lane.alive:
                        self._wait_exit(lane)
                    # a service child reparented to this process; a killed group may take
                    # a while to die on a loaded machine (returns as soon as it is gone)
                    reap_group(lane.pid, wait=2.0)
            finally:  # the stores go whatever happened above (the helper kills the rest)
                self._selector.close()
                self._launcher.close()
                if self.wall is not None:
                    self.wall.close()
                # PostgreSQL databases (and their snapshot connection) never outlive a
                # trace: a long concurrent run would otherwise exhaust the server's
                # connections
                self._run.close()
                self.directory = Path()

    # -- processes -----------------------------------------------------------------------

    def _spawn(self, number: int, spec: WorkerSpec) -> Lane:
        if self.clock is None:
            raise ExecutionError("the lane executor is not open")
        # the system decides what runs: a program of its own (argv, environment, whether it
        # announces its points), or faultlab's worker (None), as for a sequential step
        program = self.system.program(spec)
        # exec for a libfaketime preload, and when recording for power cuts: a lane forked
        # from this (recording) process failed a dispatcher's first write (disk I/O error)
        forks = program is None and self.spawn == "fork" and self.wall is None \
            and not self.power
        if forks and readers_are_kept():  # needs an exec; SQLite: no open connection may
            raise ExecutionError("cannot fork a lane while snapshot connections are kept "
                                 "open (a sequential executor is open in this process)")
        variables = dict(spec.environment)
        if self.statement_points:
            variables[STATEMENTS_ENV] = "1"

        def scheduled(decide: int, announce: int) -> dict[str, str]:
            """faultlab's worker finds its channel (as numbered in the child) here."""
            return {SCHEDULE_ENV: f"{decide},{announce}", **variables}

        go = CONTINUE
        if program is not None:
            running = self._launcher.start_command(
                program.argv, lambda decide, announce: _program_environment(
                    program, decide, announce), cwd=program.cwd, control=program.announces)
            go = ANNOUNCE_CONTINUE
            if program.backend_tag is not None:  # its backends are a live worker's
                pgstores.command_worker_started(program.backend_tag, running.pid)
        elif forks:  # by the starter's helper where it can be (see faultlab.process.launch)
            running = self._launcher.start_worker(spec, scheduled)
            notices = self._launcher.notices()
            if notices is not None and notices not in self._selector.get_map():
                self._selector.register(notices, selectors.EVENT_READ, None)
        else:
            running = self._launcher.start_command(
                spec.argv(), lambda decide, announce: {**child_environment(),
                                                       **scheduled(decide, announce)})
        self.workers += 1
        self.processes += 1
        others = [other for other in self.lanes.values() if other.alive]
        for other in others:
            other.solitary = False
        lane = Lane(number, self.workers, spec, running, dict(running.outputs), go=go,
                    chunks={"stdout": [], "stderr": []}, start_snapshot=self.snapshot,
                    solitary=not others, program=program, started_at=self.clock.ticks)
        for fd in lane.fds:
            self._selector.register(fd, selectors.EVENT_READ, lane)
        return lane

    def _pump(self, timeout: float) -> None:
        """Read whatever any lane wrote; update held points, claims and ended lanes."""
        if not self._selector.get_map():
            time.sleep(min(timeout, 0.01))
            return
        for key, _ in self._selector.select(timeout=max(timeout, 0.0)):
            if key.data is None:  # the process layer's notices of ended workers
                self._launcher.collect()
                continue
            lane: Lane = key.data
            fd = int(key.fd)
            data = os.read(fd, 65536)
            if not data:
                # deferred: a signal landing between the last pipe's end and the wait would
                # leave an exited lane unreaped (a zombie) that close() could not find by its
                # pipes; held back, the lane is reaped and marked exited, or not touched
                with interrupt.deferred():
                    self._selector.unregister(fd)
                    os.close(fd)
                    del lane.fds[fd]
                    if not lane.fds:
                        self._reap(lane)
                continue
            name = lane.fds[fd]
            if name != "announce":
                if sum(map(len, lane.chunks[name])) < MAX_OUTPUT:  # read on, keep a bounded part
                    lane.chunks[name].append(data)
                continue
            lines = (lane.pending_line + data).split(b"\n")
            lane.pending_line = lines.pop()
            for line in lines:
                self._announced(lane, line.decode("utf-8", "replace"))

    def _announced(self, lane: Lane, line: str) -> None:
        if lane.broken:
            return
        if lane.program is not None:
            self._program_announced(lane, line)
            return
        kind, _, rest = line.partition(" ")
        if kind == "held":
            lane.status, lane.point = "held", rest
            lane.points.append(rest)
        elif kind == "claim":  # claim "OPERATION" TOKEN UNTIL (the id as a JSON string)
            try:
                quoted, token, until = rest.rsplit(" ", 2)
                operation_id = json.loads(quoted)
                claim = Claim(lane.worker, lane.number, lane.pid, str(operation_id),
                              int(token), None if until == "-" else float(until),
                              self.clock.ticks if self.clock is not None else 0)
            except ValueError:
                lane.broken = True
                self._signal(lane, signal.SIGKILL)
                raise ExecutionError(
                    f"system {self.system.name!r}: {lane.spec.role} worker (pid {lane.pid}) "
                    f"announced a malformed claim: {printable(line, 80)}") from None
            alive = {other.worker for other in self.lanes.values() if other.alive}
            self.history.claim(claim, alive=alive)

    def _program_announced(self, lane: Lane, line: str) -> None:
        """A system's own program speaks the announcement protocol, checked as a sequential
        step checks it (:func:`faultlab.nemesis.announce.parse_announcement`): ``reached
        POINT PID`` holds the lane at POINT, or, at the lane's armed crash point, SIGKILLs
        PID there (as a sequential step's nemesis does). Anything else ends the lane's
        process group and the run: the program broke the protocol."""
        points = lane.program.points if lane.program is not None else frozenset()
        try:
            point, pid = parse_announcement(line.strip(), points, lane.pid)
        except ProtocolError as error:
            lane.broken = True
            self._signal(lane, signal.SIGKILL)
            raise ExecutionError(
                f"system {self.system.name!r}: {lane.spec.role} worker (pid {lane.pid}) broke "
                f"the announcement protocol: {error}") from None
        if point == lane.spec.crash:
            try:
                os.kill(pid, signal.SIGKILL)  # in the lane's own group: checked above
            except ProcessLookupError:
                pass
            return
        lane.status, lane.point = "held", point
        lane.points.append(point)

    def _reap(self, lane: Lane) -> None:
        """The lane's pipes are closed: its process is ending; wait for it (bounded)."""
        try:
            status = lane.process.reap(self.deadline)
        except ExecutionError as error:
            raise ExecutionError(f"lane {lane.number}: {error}") from None
        if lane.program is not None and lane.program.backend_tag is not None:
            pgstores.command_worker_ended(lane.program.backend_tag)  # reaped: it has ended
        if os.WIFSIGNALED(status):
            # killed with its group: a dispatcher's service that was running comes to this
            # process (a child subreaper) to be reaped; now, not when the trace ends, since
            # the lane may start another worker and close() only knows the current one
            reap_group(lane.pid, wait=2.0)
        stdout = b"".join(lane.chunks["stdout"]).decode("utf-8", "replace")
        # the response read as the system prints it (response_fields), as sequentially
        lane.record = self.system.response(lane.spec, ProcessRecord(
            pid=lane.pid, exit_code=os.waitstatus_to_exitcode(status),
            response=parse_response(stdout), stdout=stdout,
            stderr=b"".join(lane.chunks["stderr"]).decode("utf-8", "replace"),
            elapsed=time.monotonic() - lane.process.started,
        ))
        if (lane.record.response or {}).get("service"):
            self.processes += 1  # the service child the dispatcher started
        lane.status, lane.point = "exited", None
        self._exited.append((lane.worker, lane.record))
        if lane.record.exit_code == EXIT_USAGE:
            last = worker_message(lane.record.stderr, lane.record.response)
            raise ExecutionError(f"lane {lane.number} worker pid {lane.pid} refused its input "
                                 f"(exit 2): {last}")

    def _wait(self, lane: Lane, bound: float) -> None:
        """Let a running lane go until it holds or ends; past ``bound`` it is blocked,
        unless its processes are still working (see :func:`_still_working`): then it gets
        another slice, up to the deadline. Before the bound, a faultlab worker seen sleeping
        for :data:`LOCK_WAIT` on end, not working, while another lane is alive, is blocked
        at once (see :func:`_lock_sleeper`: the worker, or the service child it waits for)."""
        began = now = time.monotonic()
        end = began + bound
        cpu = tree_activity(lane.pid)[1]
        # since when, the CPU used then, its sleeps once woken to retry its lock, and which
        # of the lane's processes sleeps (the worker, or the service child it waits for)
        sleeping: tuple[float, int, int, int] | None = None
        watch = self.fast_blocking and self._others_alive(lane)
        while lane.status in ("running", "blocked"):
            alone = not self._others_alive(lane)
            if alone:
                # no other worker is alive to hold a lock it could wait for: it is slow
                # (a network call, a back-off, a sleep), never blocked; only the deadline
                # ends the wait, and missing it fails the run, as a sequential step does
                end = max(end, began + self.deadline)
            remaining = end - now
            if remaining <= 0:
                if alone:
                    raise ExecutionError(
                        f"lane {lane.number} worker pid {lane.pid} ({lane.spec.role}) missed "
                        f"its deadline ({self.deadline:g} s) while no other worker was alive")
                working, cpu = _still_working(lane.pid, cpu)
                if working and time.monotonic() - began < self.deadline:
                    end = time.monotonic() + WORK_SLICE
                    now = time.monotonic()
                    continue
                lane.status = "blocked"
                return
            poll = LOCK_POLL if sleeping is None else RETRY_POLL
            self._pump(min(remaining, poll) if watch else remaining)
            now = time.monotonic()
            if not watch or lane.status not in ("running", "blocked") or lane.paused:
                continue
            sleeper = _lock_sleeper(lane.pid)
            if sleeper is None:
                sleeping = None
            elif sleeping is None or sleeping[3] != sleeper:
                sleeping = (now, tree_activity(lane.pid)[1], _sleeps(sleeper), sleeper)
                _wake(sleeper)
            elif _sleeps(sleeper) > sleeping[2] >= 0 or now - sleeping[0] >= LOCK_WAIT:
                working, _ = _still_working(lane.pid, sleeping[1])
                if not working:
                    lane.status = "blocked"
                    return
                sleeping = None

    def _others_alive(self, lane: Lane) -> bool:
        """Whether a worker other than ``lane``'s is alive (running, held, blocked or
        paused): only such a worker can hold a lock ``lane`` waits for."""
        return any(other is not lane and other.alive for other in self.lanes.values())

    def _wait_exit(self, lane: Lane) -> None:
        end = time.monotonic() + self.deadline + 5
        while lane.alive:
            if time.monotonic() > end:
                raise ExecutionError(f"lane {lane.number} pid {lane.pid} did not end")
            self._pump(0.1)

    def _signal(self, lane: Lane, signum: int) -> None:
        lane.process.signal(signum)

    def _settle_blocked(self, moved: Lane | None) -> None:
        """After a step, give lanes that were blocked a chance to reach their next point."""
        for lane in self.lanes.values():
            if lane is not moved and lane.status == "blocked" and not lane.paused:
                self._wait(lane, self.block_bound / 2)

    def _stopped(self, lane: Lane) -> None:
        """Wait until the kernel shows the lane's process stopped (so a pause is real)."""
        end = time.monotonic() + 2.0
        while time.monotonic() < end:
            try:
                state = Path(f"/proc/{lane.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                return
            if state in ("T", "t", "Z", "X"):
                return
            time.sleep(0.001)

    # -- steps ---------------------------------------------------------------------------

    def check_step(self, step: Step) -> None:
        """Refuse a step the lanes' current states do not allow (UsageError)."""
        step.validate(self.concurrency)
        if step.action == "tick":
            return
        if step.action == SERVER_CRASH:
            check_server_crash(self.system)
            return
        if step.action == POWER:
            return  # names no lane; the choice was checked when the step was made
        if step.action == DROP_CONNECTION:
            check_server_crash(self.system, "a drop_connection step")
        lane = self.lanes.get(step.lane or 0)
        alive = lane is not None and lane.alive
        if step.starts:
            if alive:
                raise UsageError(f"{step.describe()}: lane {step.lane} is busy")
            check_crash_point(self.system, step.role or "", step.crash)
            return
        if lane is None:
            raise UsageError(f"{step.describe()}: lane {step.lane} never started a worker")
        if not alive:
            return  # the worker already ended: nothing to do (a trace replayed elsewhere)
        if step.action in ("release", "finish") and lane.paused:
            raise UsageError(f"{step.describe()}: lane {step.lane} is paused")
        if step.action == "pause" and lane.paused:
            raise UsageError(f"{step.describe()}: lane {step.lane} is already paused")
        if step.action == "resume" and not lane.paused:
            raise UsageError(f"{step.describe()}: lane {step.lane} is not paused")

    def run(self, step: Step, *, phase: str = "step") -> Observation:
        # after a SIGINT/SIGTERM no further step runs, as sequentially: a state machine's
        # teardown would otherwise settle the interrupted trace (resume, finish, recover),
        # and a worker left waiting on a lock held that up to its deadline
        interrupt.check()
        self.check_step(step)
        self._exited = []
        sigkills = 0
        started = self.processes
        moved: Lane | None = None
        if step.action == "tick":
            if self.clock is None:
                raise ExecutionError("the lane executor is not open")
            self.clock.advance(step.ticks or 0)
            self._set_server_clock()
            if self.wall is not None:
                self.wall.set(self.clock.ticks)
        elif step.action == SERVER_CRASH:
            # every live lane's connections die with the server; its worker runs on (held,
            # blocked or paused where it was) and meets the failure at its next statement
            pgstores.crash_server()
        elif step.action == POWER:
            sigkills = self._power_cut(step)
        elif step.starts:
            moved = self._start(step)
            self._wait(moved, self.block_bound)
            if not step.hold:
                self._finish(moved)
        elif self.lanes[step.lane or 0].alive:
            moved = self.lanes[step.lane or 0]
            if moved.status == "blocked" and step.action in ("release", "finish"):
                self._wait(moved, self.block_bound)  # still blocked: the step waits once more
            if step.action == "release" and moved.status == "held":
                os.write(moved.process.decide, moved.go)
                moved.status = "running"
                self._wait(moved, self.block_bound)
            elif step.action == "finish":
                self._finish(moved)
            elif step.action == DROP_CONNECTION:
                # the process lives on (held, blocked or paused where it was); a statement
                # it was blocked in fails now, so it moves on to its next point or its end
                tag = moved.program.backend_tag if moved.program is not None else None
                pgstores.drop_worker_connections(self.directory, moved.pid, tag)
                if moved.status == "blocked" and not moved.paused:
                    self._wait(moved, self.block_bound)
            elif step.action == "kill":
                self._signal(moved, signal.SIGKILL)
                if moved.paused:
                    self._signal(moved, signal.SIGCONT)
                    moved.paused = False
                self._wait_exit(moved)
                sigkills = 1
            elif step.action == "pause":
                moved.paused = True  # first: a lane stopped is always known as paused
                self._signal(moved, signal.SIGSTOP)
                self._stopped(moved)
            elif step.action == "resume":
                self._signal(moved, signal.SIGCONT)
                moved.paused = False
                if moved.status == "blocked":
                    self._wait(moved, self.block_bound)
        if step.action not in ("tick", "pause", POWER):  # none can free a lock (a cut
            self._settle_blocked(moved)                  # leaves no lane alive)
        return self._observe(step, moved, phase, sigkills, self.processes - started)

    def _power_cut(self, step: Step) -> int:
        """The machine loses power now: every live lane dies with its service (SIGKILL of
        its group, reaped, so nothing records any more), then the stores are rebuilt as the
        step's choice says (:func:`faultlab.run.executor.cut_power`). Returns the SIGKILLs."""
        if not self.power:
            raise ExecutionError("a power step needs a lane executor that records (power=True)")
        killed = 0
        for lane in self.lanes.values():
            if not lane.alive:
                continue
            self._signal(lane, signal.SIGKILL)
            if lane.paused:
                self._signal(lane, signal.SIGCONT)
                lane.paused = False
            self._wait_exit(lane)
            reap_group(lane.pid, wait=2.0)
            killed += 1
        self._unopenable, self.unrecorded_baseline = cut_power(
            self.system, self.directory, self.directory / POWER_LOG, step.choice or {},
            self.unrecorded_baseline, f"power step {step.describe()}")
        return killed

    def _start(self, step: Step) -> Lane:
        number = step.lane or 0
        payload = None if step.role == "dispatch" else canonical_json(step.payload)
        spec = WorkerSpec(
            system=self.system.ref, role=step.role or "", directory=str(self.directory),
            operation_id=step.operation_id if step.role != "dispatch" else None,
            crash=step.crash, payload=payload, deduplication=self.deduplication,
            spawn=self.spawn, deadline=self.deadline, environment=self._environment(),
        )
        if step.role == "service" and step.operation_id is not None:
            self.history.direct.add(step.operation_id)
        if step.role == "accept" and step.operation_id is not None:
            self.history.accept_begins(step.operation_id)
        with interrupt.deferred():  # a started lane is known (killed and reaped at close)
            lane = self._spawn(number, spec)
            self.lanes[number] = lane
        return lane

    def _environment(self) -> tuple[tuple[str, str], ...]:
        """The trace's clock variables (and libfaketime's), and where to record for power
        cuts, in every lane worker's spec as in a sequential step's."""
        if self.clock is None:
            raise ExecutionError("the lane executor is not open")
        wall = self.wall.environment() if self.wall is not None else {}
        power = {POWER_LOG_VARIABLE: str(self.directory / POWER_LOG)} if self.power else {}
        return tuple(sorted({**self.clock.environment(), **wall, **power}.items()))

    def _finish(self, lane: Lane) -> None:
        """Release the lane point after point until it ends (or blocks on a lock)."""
        while lane.status == "held":
            os.write(lane.process.decide, lane.go)
            lane.status = "running"
            self._wait(lane, self.block_bound)

    def _observe(self, step: Step, moved: Lane | None, phase: str,
                 sigkills: int, processes: int) -> Observation:
        before = self.snapshot
        unopenable, self._unopenable = self._unopenable, ()
        after = before if unopenable else self.system.snapshot(self.directory)
        violations: list[Violation] = []
        covered: set[str] = set()
        exited = list(self._exited)
        for worker, record in exited:
            lane = next(lane for lane in self.lanes.values() if lane.worker == worker)
            self.model.observe(lane.spec.role, lane.spec.operation_id, lane.spec.payload, record)
        checks: list[tuple[WorkerSpec | None, ProcessRecord]] = [
            (lane.spec, record) for lane in self.lanes.values()
            for worker, record in exited if lane.worker == worker
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
        violations += self._quiet(exited, after, covered)
        others_moving = any(
            lane is not moved and lane.alive and not lane.paused and lane.status != "held"
            for lane in self.lanes.values()
        )
        alone = moved.worker if moved is not None and not others_moving else None
        ended = {worker for worker, _ in exited}
        lone = tuple(LoneRun(lane.worker, lane.start_snapshot, lane.started_at)
                     for lane in self.lanes.values()
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
            point = next(lane.spec.crash for lane in self.lanes.values()
                         if lane.worker == worker)
            if here and point is not None:
                fired.append(point)
        observation = Observation(
            len(self.observations) + 1, step, before, after, tuple(dict.fromkeys(violations)),
            phase, exited=tuple(exited), lanes=self.lane_states(), sigkills=sigkills,
            processes=processes,
            checks=checks_after(len(exited)),
            covered=frozenset(covered), armed=step.crash if step.starts else None,
            fired=tuple(fired),
        )
        self.observations.append(observation)
        return observation

    def _quiet(self, exited: list[tuple[int, ProcessRecord]], after: Snapshot,
               covered: set[str]) -> list[Violation]:
        """QUIET for a dispatcher that was the only worker alive from its start to its exit:
        judged against the stores as it found them, as a sequential trace judges it (added
        to ``covered`` when it had something to check)."""
        found: list[Violation] = []
        for worker, record in exited:
            lane = next(lane for lane in self.lanes.values() if lane.worker == worker)
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

    def lane_states(self) -> tuple[str, ...]:
        return tuple(
            self.lanes[n].shown() if n in self.lanes else "-"
            for n in range(1, self.concurrency + 1)
        )

    def settle(self) -> tuple[list[Observation], list[Violation]]:
        """Recover to quiescence, then check LIVE.

        Paused lanes resume and every lane runs to its end (in lane order); then the
        virtual clock advances by :data:`SETTLE_HORIZON` ticks, so every lease and
        delay shorter than that lapses; then fresh dispatchers run one at a time while
        work is pending, stopping when one makes no progress.
        """
        observations: list[Observation] = []

        def step(lane_step: Step) -> bool:
            observation = self.run(lane_step, phase="settle")
            observations.append(observation)
            return bool(observation.violations)

        for _ in range(3):
            for number in sorted(self.lanes):
                lane = self.lanes[number]
                if lane.alive and lane.paused and step(Step("resume", lane=number)):
                    return observations, []
                if lane.alive and lane.status == "held" and step(Step("finish", lane=number)):
                    return observations, []
            if not any(lane.alive for lane in self.lanes.values()):
                break
            for lane in self.lanes.values():
                if lane.alive and lane.status == "blocked":
                    self._wait(lane, self.deadline)
        for lane in self.lanes.values():
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


def _still_working(pid: int, cpu_before: int) -> tuple[bool, int]:
    """Whether a lane's worker (with any service child it started) is still starting or
    computing, not waiting on a lock: one of them is runnable, or they used CPU since
    ``cpu_before``."""
    runnable, cpu = tree_activity(pid)
    return runnable or cpu - cpu_before >= WORKING_TICKS, cpu


def execute_concurrent(
    system: System, steps: list[Step], *, concurrency: int, deduplication: bool = True,
    settle: bool = True, spawn: SpawnMode = "fork", deadline: float = DEFAULT_DEADLINE,
    lenient: bool = False, statement_points: bool = False,
) -> Execution:
    """Run a fixed concurrent trace on fresh stores; settle afterwards when asked and clean.

    A step the lanes' states do not allow raises UsageError before it runs; with
    ``lenient`` (shrinking) it is skipped instead, and the observations show only the
    steps that ran.
    """
    power = any(lane_step.action == POWER for lane_step in steps)
    with LaneExecutor(system, concurrency=concurrency, deduplication=deduplication,
                      spawn=spawn, deadline=deadline, statement_points=statement_points,
                      power=power) as executor:
        for lane_step in steps:
            if lenient:
                try:
                    executor.check_step(lane_step)
                except UsageError:
                    continue  # a shrinking candidate: this step lost its worker; drop it
            observation = executor.run(lane_step)
            if observation.violations:
                break
        final: list[Violation] = []
        if settle and not any(o.violations for o in executor.observations):
            _, final = executor.settle()
        return Execution(list(executor.observations), final, concurrency)



def execute_trace(system: System, trace: Trace, spawner: Spawner, *,
                  deadline: float = DEFAULT_DEADLINE) -> Execution:
    """Run a whole trace on fresh stores, as it is saved: a sequential trace (one lane, one
    worker at a time) one process after another (:func:`faultlab.run.executor.execute`), a
    laned one through the lanes (:func:`execute_concurrent`)."""
    if trace.laned:
        return execute_concurrent(
            system, trace.steps, concurrency=trace.concurrency,
            deduplication=trace.deduplication, settle=trace.settle, spawn=spawner.mode,
            deadline=deadline, statement_points=trace.statement_points)
    return execute(system, trace.steps, spawner, deduplication=trace.deduplication,
                   settle=trace.settle, deadline=deadline)
