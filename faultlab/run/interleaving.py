"""The lanes of a laned trace: several real worker processes alive at once, scheduled by faultlab.

Each lane runs one worker at a time as a real OS process (forked by the starter's
helper, or a fresh interpreter in exec mode) with a control pipe
(:mod:`faultlab.nemesis.schedule`): the worker holds at every named point it reaches
and announces it, and faultlab decides which lane moves next. Between points
the processes run for real against the same stores, with the stores' own
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

:class:`Lanes` runs the processes; the one executor (:class:`faultlab.run.executor.Executor`)
owns the stores, the clock and every check, and reads the stores back after each step.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from faultlab.base import interrupt
from faultlab.base.errors import EXIT_USAGE, ExecutionError, UsageError
from faultlab.base.messages import printable, worker_message
from faultlab.checks.history import Claim, History
from faultlab.nemesis.announce import CONTINUE as ANNOUNCE_CONTINUE
from faultlab.nemesis.announce import ProtocolError, channel_environment, parse_announcement
from faultlab.nemesis.schedule import CONTINUE, RETRY_SIGNAL, SCHEDULE_ENV, STATEMENTS_ENV
from faultlab.process.launch import Launcher, Running
from faultlab.process.records import (
    DEFAULT_DEADLINE,
    ProcessRecord,
    SpawnMode,
    WorkerSpec,
    parse_response,
)
from faultlab.process.spawn import (
    Spawner,
    child_environment,
    reap_group,
    server_environment,
    tree_activity,
    tree_pids,
    worker_command,
)

# The lanes' helper, a fresh interpreter, imports these two by name and forks every lane
# worker from what they loaded: no worker imports a module from disk.
from faultlab.run.worker import prepare_lanes, run_lane_worker
from faultlab.stores import postgres as pgstores
from faultlab.stores.sqlite import Snapshot, release_kept_readers
from faultlab.system.contract import Program, System
from faultlab.trace import DROP_CONNECTION, POWER, SERVER_CRASH, Step

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
MAX_OUTPUT = 1 << 20  # bytes of a lane's stdout or stderr kept, as for sequential workers


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


def _program_environment(program: Program, decide: int, announce: int) -> dict[str, str]:
    """A system's own program's environment, as the system gave it; one that speaks the
    announcement protocol also finds its channel there (and holds at every point it
    announces, ``reached POINT PID``, until faultlab answers ``continue``); any other runs
    free between start and end (it can still be paused, resumed and killed)."""
    environment = dict(program.env)
    if program.announces:
        environment.update(channel_environment(announce_fd=announce, resume_fd=decide))
    return environment


class Lanes:
    """The lanes of one laned trace: the worker processes alive at once, each started through
    the process layer with a control channel, held at its points, released, killed, paused
    and resumed, and judged blocked when it waits on another lane's lock.

    It runs processes and reads what they announce (held points; claims, which go to the
    trace's ``history``); the executor (:class:`faultlab.run.executor.Executor`) owns the
    stores, the clock and every check, and asks this class to move a lane.
    """

    def __init__(
        self, system: System, spawner: Spawner, *, concurrency: int, history: History,
        ticks: Callable[[], int], deadline: float = DEFAULT_DEADLINE,
        block_bound: float = BLOCK_BOUND, statement_points: bool = False,
        power: bool = False, wall: Mapping[str, str] | None = None,
    ) -> None:
        if statement_points:
            system.require_statement_points()
        self.system = system
        self.concurrency = concurrency
        #: Where the workers' announced claims go, and the trace's clock when they claimed.
        self.history = history
        self.ticks = ticks
        self.spawn: SpawnMode = spawner.mode
        self.deadline = deadline
        self.block_bound = block_bound
        #: Python workers also hold at sql:K and commit:K (before the K-th statement,
        #: after the K-th COMMIT), not only at their named points.
        self.statement_points = statement_points
        #: Workers record for power cuts (each forked by the helper, or exec'd where
        #: this process would fork them: a lane forked from a recording process failed a
        #: dispatcher's first write).
        self.power = power
        #: The variables of the trace's virtual wall clock (libfaketime's preload and the
        #: clock's file), or None. Its workers are forked by a helper started under the
        #: preload (as a fork server is); exec'd where none can be.
        self.wall = wall
        preload = server_environment(tuple(wall.items())) if wall else None
        #: A Python system's workers sleep only in SQLite's busy handler (waiting for a
        #: lock); a command-line program may sleep for reasons of its own.
        self.fast_blocking = system.sleeps_only_on_locks
        self.lanes: dict[int, Lane] = {}
        self.workers = 0
        self.processes = 0
        #: The workers that ended during the current step (see :meth:`begin`).
        self.exited: list[tuple[int, ProcessRecord]] = []
        self._selector = selectors.DefaultSelector()
        #: Whether the helper is started under the wall clock's preload, so that a forked
        #: worker runs under it (False: no wall clock, or one only exec can give).
        self._preloaded = preload is not None
        #: Starts the workers (the process layer's), kept by ``spawner`` from trace to trace
        #: of one system and closed with it (its helper, a fresh interpreter, starts once a
        #: run, not once a trace; made again for another system or preload, so that its
        #: workers find that system loaded, not imported from disk). The run's first trace
        #: decides whether it loads the recording VFS too. An executor given no spawner
        #: makes one of its own, closed with the trace.
        self._launcher = spawner.shared(
            "lanes", system.ref if preload is None else f"{system.ref} {preload}",
            lambda: Launcher(run_lane_worker, prepare_lanes,
                             (system.ref, *(("power",) if power else ())),
                             dict(preload) if preload is not None else None))

    def close(self) -> None:
        """Kill every lane still alive (faultlab started them all) and reap them."""
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
        finally:  # the helper (closed with the spawner) kills whatever is left
            self._selector.close()

    def begin(self) -> None:
        """A step begins: no worker has ended at it yet."""
        self.exited = []

    def worker_lane(self, worker: int) -> Lane:
        """The lane that ran the trace's ``worker``-th worker (its latest)."""
        return next(lane for lane in self.lanes.values() if lane.worker == worker)

    @property
    def alive(self) -> bool:
        return any(lane.alive for lane in self.lanes.values())

    # -- processes -----------------------------------------------------------------------

    def _spawn(self, number: int, spec: WorkerSpec, snapshot: Snapshot) -> Lane:
        # the system decides what runs: a program of its own (argv, environment, whether it
        # announces its points), or faultlab's worker (None), as for a sequential step
        program = self.system.program(spec)
        # The helper forks unless it cannot be made (then this process would): exec then
        # for a libfaketime preload, and when recording for power cuts: a lane forked from
        # this (recording) process failed a dispatcher's first write (disk I/O error),
        # where the helper, a fresh interpreter, holds no connection and no recording VFS
        # (the worker installs its own). A preload that only exec can give is exec'd too.
        here = self._launcher.forks_here()
        forks = program is None and self.spawn == "fork" \
            and not (self.power and here) \
            and (not self.wall or (self._preloaded and not here))
        if forks and here:
            # SQLite: no open connection may be carried across fork(); the executor's
            # snapshot opens them again after it (only where no helper can be made: the
            # helper is a fresh interpreter, which inherits no connection)
            release_kept_readers()
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
                worker_command(spec), lambda decide, announce: {**child_environment(),
                                                       **scheduled(decide, announce)})
        self.workers += 1
        self.processes += 1
        others = [other for other in self.lanes.values() if other.alive]
        for other in others:
            other.solitary = False
        lane = Lane(number, self.workers, spec, running, dict(running.outputs), go=go,
                    chunks={"stdout": [], "stderr": []}, start_snapshot=snapshot,
                    solitary=not others, program=program, started_at=self.ticks())
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
                              self.ticks())
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
        self.exited.append((lane.worker, lane.record))
        if lane.record.exit_code == EXIT_USAGE:
            last = worker_message(lane.record.stderr, lane.record.response)
            raise ExecutionError(f"lane {lane.number} worker pid {lane.pid} refused its input "
                                 f"(exit 2): {last}")

    def wait(self, lane: Lane, bound: float) -> None:
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

    def settle_blocked(self, moved: Lane | None) -> None:
        """After a step, give lanes that were blocked a chance to reach their next point."""
        for lane in self.lanes.values():
            if lane is not moved and lane.status == "blocked" and not lane.paused:
                self.wait(lane, self.block_bound / 2)

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

    def check(self, step: Step) -> None:
        """Refuse a step the lanes' current states do not allow (UsageError)."""
        if step.action in ("tick", SERVER_CRASH, POWER):
            return  # names no lane
        lane = self.lanes.get(step.lane or 0)
        alive = lane is not None and lane.alive
        if step.starts:
            if alive:
                raise UsageError(f"{step.describe()}: lane {step.lane} is busy")
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

    def launch(self, step: Step, spec: WorkerSpec, snapshot: Snapshot) -> Lane:
        """Start ``spec``'s worker in the step's lane and return at once. ``snapshot``: the
        stores as it starts."""
        with interrupt.deferred():  # a started lane is known (killed and reaped at close)
            lane = self.lanes[step.lane or 0] = self._spawn(step.lane or 0, spec, snapshot)
        return lane

    def start(self, step: Step, spec: WorkerSpec, snapshot: Snapshot) -> Lane:
        """Start ``spec``'s worker in the step's lane; it runs to its first point (or, for a
        ``run``, to its end)."""
        moved = self.launch(step, spec, snapshot)
        self.wait(moved, self.block_bound)
        if not step.hold:
            self.finish(moved)
        return moved

    def move(self, step: Step, directory: Path) -> tuple[Lane | None, int]:
        """Move the step's lane (release, finish, drop its connections, kill, pause,
        resume); the lane moved (None: its worker had ended) and the SIGKILLs it took."""
        moved = self.lanes[step.lane or 0]
        if not moved.alive:
            return None, 0
        sigkills = 0
        if moved.status == "blocked" and step.action in ("release", "finish"):
            self.wait(moved, self.block_bound)  # still blocked: the step waits once more
        if step.action == "release" and moved.status == "held":
            os.write(moved.process.decide, moved.go)
            moved.status = "running"
            self.wait(moved, self.block_bound)
        elif step.action == "finish":
            self.finish(moved)
        elif step.action == DROP_CONNECTION:
            # the process lives on (held, blocked or paused where it was); a statement
            # it was blocked in fails now, so it moves on to its next point or its end
            tag = moved.program.backend_tag if moved.program is not None else None
            pgstores.drop_worker_connections(directory, moved.pid, tag)
            if moved.status == "blocked" and not moved.paused:
                self.wait(moved, self.block_bound)
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
                self.wait(moved, self.block_bound)
        return moved, sigkills

    def kill_all(self) -> int:
        """Every live lane dies with its service (SIGKILL of its group, reaped, so nothing
        records any more): a power cut. Returns the SIGKILLs."""
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
        return killed

    def finish(self, lane: Lane) -> None:
        """Release the lane point after point until it ends (or blocks on a lock)."""
        while lane.status == "held":
            os.write(lane.process.decide, lane.go)
            lane.status = "running"
            self.wait(lane, self.block_bound)

    def states(self) -> tuple[str, ...]:
        """Each lane's state, as the replay table shows it."""
        return tuple(
            self.lanes[n].shown() if n in self.lanes else "-"
            for n in range(1, self.concurrency + 1)
        )


def _still_working(pid: int, cpu_before: int) -> tuple[bool, int]:
    """Whether a lane's worker (with any service child it started) is still starting or
    computing, not waiting on a lock: one of them is runnable, or they used CPU since
    ``cpu_before``."""
    runnable, cpu = tree_activity(pid)
    return runnable or cpu - cpu_before >= WORKING_TICKS, cpu


