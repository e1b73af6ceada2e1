"""``explore --concurrency N``: a Hypothesis state machine whose rules are scheduling choices.

With N lanes, each plain rule is one :class:`faultlab.trace.Step`: start a
worker in a free lane (it runs to its first point and holds: a dispatcher, a direct
delivery, or the acceptor of a new operation) or run one to its end, start one armed
at a crash point (``crash``), release a held lane to its next point, finish it,
SIGKILL it where it is, SIGSTOP/SIGCONT it, or advance the virtual clock. Four rules
set up, in a few steps, the moment a class of concurrency bug waits for: ``rescue``
(the clock to the earliest lease's end, a rescuer, the holder waking), ``overtake``
(a second relay on the key a first one holds), ``redeliver`` (a second delivery of
an operation while the first is in flight) and ``overlap`` (an acceptance that
commits after a later one). On faultlab's own PostgreSQL server a fifth set-up,
``sever`` (the server ends a held claim's session), is an opening only. Every example
opens with one of these set-ups or none, drawn (the ``opening`` initialize rule). Hypothesis
switches rules off per example (swarm testing), and each example draws the payload
titles it uses as a swarm (:func:`faultlab.search.machine.swarm`). Every step runs for real in
:class:`faultlab.run.executor.Executor`, which checks the per-step and history
invariants after it; teardown recovers (finishes every lane, advances the clock
past every lease, dispatches) and checks ``LIVE``. A failure is minimised by
delta debugging over the scheduling choices, saved as a version 2 trace and
replayed.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import (
    initialize,
    precondition,
    rule,
)

from faultlab.base.errors import UsageError
from faultlab.process.records import DEFAULT_DEADLINE
from faultlab.process.spawn import Spawner
from faultlab.run.executor import Executor
from faultlab.search import data as generated
from faultlab.search import defaults
from faultlab.search.data import TITLES
from faultlab.search.machine import (
    POWER_CHOICES,
    TraceMachine,
    generated_key,
    machine_settings,
    server_crashes_possible,
    swarm,
)
from faultlab.search.recorder import Recorder
from faultlab.system import load_system
from faultlab.trace import DROP_CONNECTION, SERVER_CRASH, Step

#: How many points a rescue's or overtake's holder is released past until it holds its
#: claim (:meth:`ConcurrentMachine.release_until_claimed`).
CLAIM_RELEASES = 3

#: Clock advances the machine draws: a little, and a typical lease or more.
TICKS = (1, 5, 10)

#: How an example chooses the lane that moves (``explore --scheduler``): ``uniform``, any
#: held lane a drawn release or finish can move; ``pct``, probabilistic concurrency testing
#: (random lane priorities and PCT_DEPTH - 1 change points: only the highest-priority held
#: lane moves, and at a change point the lane that moved drops below all the others);
#: ``swarm``, each example draws one of the two. Starting a worker in a free lane is the
#: trace's own choice under every scheduler (PCT schedules the workers alive).
SCHEDULERS = defaults.SCHEDULERS
DEFAULT_SCHEDULER = defaults.SCHEDULER
#: PCT's bug depth d: an example draws d - 1 priority change points among its holds.
PCT_DEPTH = 3
#: What an example opens with (the ``opening`` initialize rule, :func:`_opening_rule`): one
#: of the rules that set up in one step the moment a class of concurrency bug waits for (a
#: lease that lapses under its holder, a relay overtaken on its key, a delivery retried
#: while the first is in flight, an acceptance committed after a later one), or nothing
#: (``None``: an example of plain draws only).
OPENINGS: tuple[str | None, ...] = ("rescue", "overtake", "redeliver", "overlap", None)
#: On faultlab's own PostgreSQL server (where it can end a session) one more opening: a
#: claim whose session the server ends under its worker (:meth:`ConcurrentMachine.sever`).
SERVER_OPENINGS: tuple[str | None, ...] = (*OPENINGS[:-1], "sever", None)


class ConcurrentMachine(TraceMachine):
    """Rules are scheduling choices over ``concurrency`` lanes (see the module docstring)."""

    concurrency: ClassVar[int] = 2
    statement_points: ClassVar[bool] = False
    #: One of SCHEDULERS; ``steps`` is the example's length, where PCT's change points lie.
    scheduler: ClassVar[str] = "uniform"
    steps: ClassVar[int] = 10
    recorder: ClassVar[Recorder]
    payload_source: ClassVar[st.SearchStrategy[Any]] = generated.default_payloads()
    #: What an example may open with (:data:`OPENINGS`, :data:`SERVER_OPENINGS`).
    openings: ClassVar[tuple[str | None, ...]] = OPENINGS

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        self.executor = Executor(
            load_system(cls.system_ref), cls.runner(), concurrency=cls.concurrency,
            laned=True, deduplication=cls.deduplication, deadline=cls.deadline,
            statement_points=cls.statement_points, power=cls.power_loss,
        )
        self.titles: tuple[str, ...] | None = None  # the example's swarm, drawn when first used
        # PCT (drawn by the ``schedule`` initialize rule): a priority per lane (None: any
        # held lane may move), and the change points: the holds (steps that leave the lane
        # they moved held at a point) after which that lane drops below the others
        self.priorities: dict[int, int] | None = None
        self.change_points: frozenset[int] = frozenset()
        self.holds = 0
        self._open(self.executor)  # last (see TraceMachine._open)

    # -- helpers -----------------------------------------------------------------------

    def should_stop(self) -> bool:
        # an example failed: that is the finding, whatever Hypothesis makes of it (it may
        # have abandoned the example); nothing later is explored
        return (self.recorder.first_failure is not None or self.recorder.run_error is not None
                or super().should_stop())

    def _example(self, recovered: bool) -> tuple[Sequence[Any], int, bool]:
        steps = [o.step for o in self.executor.observations if o.phase == "step"]
        return steps, self.executor.processes, "LIVE" in self.executor.checked

    def execute(self, step: Step) -> None:
        self.run_step(step)
        moved = self.executor.lanes.get(step.lane) if step.lane is not None else None
        if self.priorities is not None and moved is not None and moved.alive \
                and moved.status == "held":  # the lane moved to a point: one PCT may preempt
            self.holds += 1
            if self.holds in self.change_points:  # it drops below every other lane
                self.priorities[moved.number] = min(self.priorities.values()) - 1

    def lanes_where(self, test: Callable[[Any], bool]) -> list[int]:
        lanes = self.executor.lanes
        return [n for n in range(1, self.concurrency + 1)
                if (n in lanes and lanes[n].alive and test(lanes[n]))]

    def free_lanes(self) -> list[int]:
        """The lanes a worker may start in (a start is the trace's choice, never PCT's)."""
        lanes = self.executor.lanes
        return [n for n in range(1, self.concurrency + 1) if n not in lanes or not lanes[n].alive]

    def held_lanes(self) -> list[int]:
        """The lanes that may be released: every held lane not paused, or under PCT the
        highest-priority one (a blocked or paused lane cannot move)."""
        held = self.lanes_where(lambda lane: lane.status == "held" and not lane.paused)
        if self.priorities is None or not held:
            return held
        priorities = self.priorities
        return [max(held, key=lambda n: priorities[n])]

    def has_pending_work(self) -> bool:
        return bool(self.executor.snapshot.pending_outbox())

    def leases(self) -> list[tuple[int, int]]:
        """(ticks until it lapses, lane) of each unexpired lease a live worker holds,
        soonest first."""
        executor = self.executor
        alive = {lane.worker: lane.number for lane in executor.lanes.values() if lane.alive}
        now = executor.clock.ticks if executor.clock is not None else 0
        return sorted({(math.ceil(claim.lease_until - now), alive[claim.worker])
                       for claim in executor.history.claims
                       if claim.worker in alive and claim.lease_until is not None
                       # a claim held for the session's life (lease inf) cannot be waited out
                       and now < claim.lease_until < math.inf})

    def release_until_claimed(self, lane: int) -> None:
        """Release a dispatcher just started in ``lane`` point by point (at most
        :data:`CLAIM_RELEASES` times) until it holds a claim, ends or blocks. A dispatcher
        whose first point is inside its claim transaction (reference-pg's ``during_claim``)
        holds nothing yet: a holder to be superseded or overtaken must hold its claim. One
        whose first point comes after its claim (the SQLite reference) moves no further."""
        for _ in range(CLAIM_RELEASES):
            if not self.claiming(lane):
                return
            self.execute(Step("release", lane=lane))

    def claiming(self, lane: int) -> bool:
        """Whether the worker in ``lane`` is held (not paused) and has claimed nothing yet."""
        current = self.executor.lanes[lane]
        return current.status == "held" and not current.paused and not any(
            claim.worker == current.worker for claim in self.executor.history.claims)

    def start_holder(self, data: st.DataObject, label: str) -> int | None:
        """Start a dispatcher that holds its claim, in a free lane drawn under ``label``
        (after accepting new work when nothing is pending), as rescue, overtake and sever
        begin: its lane, or None when the acceptor blocked and left no work or lane."""
        if not self.has_pending_work() and not self.accept_first(data):
            return None
        lane = data.draw(st.sampled_from(self.free_lanes()), label=label)
        self.execute(Step("dispatch", lane=lane, hold=True))
        self.release_until_claimed(lane)
        return lane

    def accepted(self) -> list[str]:
        return [op.id for op in self.executor.snapshot.operations if op.id in self.payloads]

    def history(self) -> str:
        """The example's steps so far, as text: the salt of :func:`generated.fair_choice`."""
        return "|".join(o.step.describe() for o in self.executor.observations)

    # -- rules -------------------------------------------------------------------------

    # One rule per kind of event, its variants drawn as arguments: Hypothesis picks a rule
    # uniformly among the enabled ones, so every extra rule thins out the two (rescue,
    # overtake) that most concurrency bugs wait behind.

    @precondition(lambda self: bool(self.free_lanes()))
    @rule(data=st.data(), held=st.booleans())
    def accept(self, data: st.DataObject, held: bool) -> None:
        """A new operation accepted: the acceptor runs to its end or, ``held``, holds at its
        first point, to be released, killed or paused while other lanes accept and relay
        (an acceptance that commits late). Held inside its transaction it makes other
        writers wait: they show as blocked, and the schedule goes on with the lanes that
        can move."""
        self.new_acceptor(data, hold=held)

    def new_acceptor(self, data: st.DataObject, *, hold: bool, crash: str | None = None,
                     title: str | None = None) -> None:
        """Accept a new operation, its id and payload drawn as the sequential machine draws
        them (:class:`faultlab.search.machine.NewOperations`: the system's declared data or
        realistic defaults, look-alike ids, a reused body). A fresh payload titled with one
        of the simple titles (a realistic one, three times in four) gets one of the
        example's swarm of titles (the ordering key, see
        :func:`faultlab.search.machine.swarm`) instead: an example on one key is all
        collisions, where per-key order, skipping and overtaking show."""
        operation_id = self.new_operation_id(data)
        payload = self.new_payload(data)
        reused = any(generated_key(p) == generated_key(payload) for p in self.payloads.values())
        if title is not None and isinstance(payload, dict) and not reused:
            payload = {**payload, "title": title}  # the key the caller asked for
        elif isinstance(payload, dict) and "title" in payload and not reused and (
                payload["title"] in TITLES
                # a realistic payload keeps its own title one time in four: the rest share
                # the swarm's keys too (two operations of one key were rare, and a relay
                # that breaks per-key order took hundreds of examples to meet)
                or data.draw(st.integers(0, 3), label="own title") != 3):
            if self.titles is None:
                self.titles = data.draw(swarm(TITLES), label="titles")
            payload = {**payload,
                       "title": data.draw(st.sampled_from(self.titles), label="title")}
        lane = data.draw(st.sampled_from(self.free_lanes()), label="lane")
        self.payloads[operation_id] = payload
        self.execute(Step("accept", operation_id, payload, crash, lane=lane, hold=hold))

    @precondition(lambda self: bool(self.free_lanes()) and bool(self.all_points))
    @rule(data=st.data(), through=st.booleans())
    def crash(self, data: st.DataObject, through: bool) -> None:
        """A worker armed at one of the example's crash points, drawn as the sequential
        machine's crash rule draws them (a swarm per example, each point fairly): an accept
        point arms a new operation's acceptor, any other point a dispatcher (which arms its
        service's points too), after accepting new work when nothing is pending. It starts
        and holds at the points before the armed one or, ``through``, runs to its end. The
        only crash a system whose workers never hold (a command-line program armed by
        argument) can have in a concurrent trace."""
        if self.enabled_points is None:
            self.enabled_points = data.draw(swarm(self.all_points), label="swarm")
        point = generated.fair_choice(data, self.enabled_points, self.history(), "crash point")
        if point in type(self).accept_points:
            self.new_acceptor(data, hold=not through, crash=point)
            return
        if not self.has_pending_work():
            self.new_acceptor(data, hold=False)
            if not self.free_lanes():
                return  # the acceptor blocked on a lock another lane holds: no lane left
        lane = data.draw(st.sampled_from(self.free_lanes()), label="lane")
        self.execute(Step("dispatch", crash=point, lane=lane, hold=not through))

    def accept_first(self, data: st.DataObject) -> bool:
        """Accept new work for a rule that needs some pending (rescue, overtake); False when
        the acceptor did not leave two lanes free (it blocked on a lock another lane holds):
        the rule then has nothing more to do."""
        self.new_acceptor(data, hold=False)
        return len(self.free_lanes()) >= 2 and self.has_pending_work()

    @precondition(lambda self: bool(self.free_lanes()) and bool(self.payloads))
    @rule(data=st.data(), held=st.booleans())
    def dispatch(self, data: st.DataObject, held: bool) -> None:
        """A dispatcher run to its end (recovery) or, ``held`` and with work pending, one
        that holds at its first point, to be released, killed or paused (only once some
        operation was accepted: before that it can only report idle)."""
        lane = data.draw(st.sampled_from(self.free_lanes()), label="lane")
        self.execute(Step("dispatch", lane=lane, hold=held and self.has_pending_work()))

    @precondition(lambda self: bool(self.free_lanes()) and (bool(self.leases()) or (
        len(self.free_lanes()) >= 2)))
    @rule(data=st.data(), wake=st.booleans())
    def rescue(self, data: st.DataObject, wake: bool) -> None:
        """The lease every rescue exists for: the clock runs to the end of the earliest
        lease a live worker holds, a dispatcher starts in a free lane (and claims what
        lapsed), and, when ``wake``, the superseded holder then runs to its end while the
        rescuer holds (the paused holder that wakes up; before or after the claim of a
        rescuer whose first point precedes it, as drawn). With no lease held yet, a
        dispatcher first starts and holds its claim: the holder to be superseded (after
        accepting new work when nothing is pending, as the crash rule does). A plain
        tick rarely lands between one lease's end and the next; every lease bug waits
        behind this rule."""
        if not self.leases():
            if self.start_holder(data, "holder") is None:
                return
            if not self.leases() or not self.free_lanes():
                return  # it held no lease (idle, or no lease to lapse): nothing to rescue
        ticks, holder = self.leases()[0]
        self.execute(Step("tick", ticks=ticks))
        lane = data.draw(st.sampled_from(self.free_lanes()), label="lane")
        self.execute(Step("dispatch", lane=lane, hold=True))
        if wake and holder in self.held_lanes():
            # A rescuer whose first point comes before its claim (reference-pg's is inside
            # its claim transaction, stale-rescue's between its read and its write) has
            # claimed nothing yet: the holder wakes either superseded, the rescuer released
            # until it claims, or first, while the rescuer has only read.
            if self.claiming(lane) and not data.draw(st.booleans(), label="holder first"):
                self.release_until_claimed(lane)
            if holder in self.held_lanes():  # a finish needs a held lane, as checked above
                self.execute(Step("finish", lane=holder))

    @precondition(lambda self: len(self.free_lanes()) >= 2)
    @rule(data=st.data(), through=st.booleans())
    def overtake(self, data: st.DataObject, through: bool) -> None:
        """The moment every per-key order bug waits for: a relay holds its claim, new work of
        the claimed operation's key is accepted in another lane, and a second relay starts
        while the first still holds (after accepting the first work when nothing is
        pending) and, when ``through``, runs to its end while the first still holds (it
        overtakes). Drawn step by step from the plain rules, this took hundreds of examples
        (four steps in the right lanes, on one key)."""
        lane = self.start_holder(data, "lane")
        if lane is None:
            return
        holder = self.executor.lanes[lane]
        if holder.status != "held" or not self.free_lanes():
            return  # it ended or blocked without holding: nothing to overtake
        claimed = [claim.operation_id for claim in self.executor.history.claims
                   if claim.worker == holder.worker]
        payload = self.payloads.get(claimed[-1]) if claimed else None
        key = payload.get("title") if isinstance(payload, dict) else None
        self.new_acceptor(data, hold=False, title=key if isinstance(key, str) else None)
        if holder.alive and self.free_lanes():
            lane = data.draw(st.sampled_from(self.free_lanes()), label="second relay")
            self.execute(Step("dispatch", lane=lane, hold=True))
            if through and lane in self.held_lanes():
                self.execute(Step("finish", lane=lane))

    def sever(self, data: st.DataObject) -> None:
        """The moment every claim bound to a session waits for (an advisory lock, a lock
        held by an open transaction): a dispatcher holds its claim, the server ends its
        sessions while it runs on, and a second dispatcher starts in another lane (after
        accepting new work when nothing is pending). An opening only, where the machine can
        drop a connection: drawn step by step, the three moves in the right lanes took
        about a hundred examples."""
        lane = self.start_holder(data, "holder")
        if lane is None:
            return
        if not self.executor.lanes[lane].alive or not self.free_lanes():
            return  # it ended or blocked without a claim to lose
        self.execute(Step(DROP_CONNECTION, lane=lane))
        if self.free_lanes():
            second = data.draw(st.sampled_from(self.free_lanes()), label="second relay")
            self.execute(Step("dispatch", lane=second, hold=True))

    @precondition(lambda self: bool(self.free_lanes()) and bool(self.accepted()))
    @rule(data=st.data())
    def service(self, data: st.DataObject) -> None:
        """A direct second delivery of an accepted operation, held at its first point."""
        lane = data.draw(st.sampled_from(self.free_lanes()), label="lane")
        operation_id = data.draw(st.sampled_from(self.accepted()), label="operation")
        self.execute(Step("service", operation_id, self.payloads[operation_id], lane=lane,
                          hold=True))

    @precondition(lambda self: len(self.free_lanes()) >= 2)
    @rule(data=st.data())
    def overlap(self, data: st.DataObject) -> None:
        """The moment every outbox-position bug waits for: an acceptance holds at its first
        point while a later one runs to its end in another lane, so the later commits
        first (positions or ids taken in one order, committed in the other). Drawn from two
        accept rules in a row, this took about 100 examples."""
        self.new_acceptor(data, hold=True)
        if self.free_lanes():
            self.new_acceptor(data, hold=False)

    @precondition(lambda self: len(self.free_lanes()) >= 2)
    @rule(data=st.data())
    def redeliver(self, data: st.DataObject) -> None:
        """The moment every deduplication race waits for: a direct delivery of an accepted
        operation holds at its first point while a second delivery of the same operation
        starts in another lane (a retry that arrives while the first is still in flight),
        after accepting one when none is. Drawn from two service rules in a row, this took
        about 70 examples."""
        if not self.accepted():
            self.new_acceptor(data, hold=False)
        accepted = self.accepted()
        if not accepted:
            return  # the acceptor blocked or failed: nothing to deliver
        operation_id = data.draw(st.sampled_from(accepted), label="operation")
        for label in ("lane", "second delivery"):
            if not self.free_lanes():
                return  # the first delivery blocked another lane's worker
            lane = data.draw(st.sampled_from(self.free_lanes()), label=label)
            self.execute(Step("service", operation_id, self.payloads[operation_id], lane=lane,
                              hold=True))

    @precondition(lambda self: bool(self.held_lanes()))
    @rule(data=st.data(), to_end=st.booleans())
    def move(self, data: st.DataObject, to_end: bool) -> None:
        """A held lane moves to its next point (``release``) or, ``to_end``, runs to its end
        (``finish``)."""
        lane = data.draw(st.sampled_from(self.held_lanes()))
        self.execute(Step("finish" if to_end else "release", lane=lane))

    @precondition(lambda self: bool(self.lanes_where(lambda lane: True)))
    @rule(data=st.data())
    def nemesis(self, data: st.DataObject) -> None:
        """A live worker SIGKILLed, SIGSTOPped (paused) or, if paused, SIGCONTed (resumed).

        A lane blocked on another lane's lock is killed, never paused: it is inside
        SQLite's busy loop, which takes and drops a shared lock on every retry, and a
        SIGSTOP that lands while it holds one leaves the lock held for the rest of the
        pause. Whether it does is a matter of microseconds, so the same trace would
        replay differently (a writer then waits on it, and the stores cannot be read)."""
        lane = data.draw(st.sampled_from(self.lanes_where(lambda lane: True)))
        state = self.executor.lanes[lane]
        choices = ("kill", "resume") if state.paused else \
            ("kill",) if state.status == "blocked" else ("kill", "pause")
        action = data.draw(st.sampled_from(choices))
        self.execute(Step(action, lane=lane))

    @precondition(lambda self: bool(self.lanes_where(lambda lane: True)))
    @rule(ticks=st.sampled_from(TICKS))
    def tick(self, ticks: int) -> None:
        """Time only matters while a worker is alive (a lease held, a delay pending)."""
        self.execute(Step("tick", ticks=ticks))


def _opening_rule(scheduler: str) -> Any:
    """The ``opening`` initialize rule, before an example's first step: under PCT (swarm:
    when the example draws PCT, as in swarm testing) a priority per lane and the change
    points, then the example's opening (:data:`OPENINGS`), every draw Hypothesis's, so a
    seed draws the same. A trace records its concrete lane steps: replay needs none of it.

    The opening is drawn first in the example, so Hypothesis's first examples, which take
    a new value of an early draw and the simplest value of every later one, each open with
    a different scenario (they would otherwise all repeat its one simplest example), and
    every later example opens with one of them on its fresh stores: the moments most
    concurrency bugs wait for, while the rest of the example is drawn from every rule."""

    def opening(self: ConcurrentMachine, data: st.DataObject) -> None:
        if scheduler == "pct" or (scheduler == "swarm" and data.draw(st.booleans(),
                                                                     label="pct")):
            order = data.draw(st.permutations(range(1, self.concurrency + 1)),
                              label="priorities")
            span = st.integers(1, pct_span(self.steps))
            points = data.draw(st.lists(span, min_size=PCT_DEPTH - 1,
                                        max_size=PCT_DEPTH - 1), label="change points")
            self.priorities = {lane: len(order) - rank for rank, lane in enumerate(order)}
            self.change_points = frozenset(points)
            self.recorder.pct_draws.append((tuple(order), tuple(sorted(points))))
        scenario = data.draw(st.sampled_from(type(self).openings), label="opening")
        self.recorder.openings[scenario or "none"] += 1
        if scenario == "rescue":
            self.rescue(data, data.draw(st.booleans(), label="wake"))
        elif scenario == "overtake":
            self.overtake(data, data.draw(st.booleans(), label="through"))
        elif scenario is not None:
            getattr(self, scenario)(data)

    return initialize(data=st.data())(opening)


def pct_span(steps: int) -> int:
    """Where PCT's change points are drawn: among the first ``steps // 2`` holds (PCT's k,
    the scheduling points of an example: about every other step leaves a lane held)."""
    return max(1, steps // 2)


def check_scheduler(scheduler: str) -> str:
    if scheduler not in SCHEDULERS:
        raise UsageError(f"unknown scheduler {scheduler!r}: choose from {', '.join(SCHEDULERS)}")
    return scheduler


def scheduled_steps(steps: int) -> int:
    """Hypothesis's steps per example: the ``opening`` initialize rule counts as one."""
    return steps + 1


def _server_crash_rule() -> Any:
    """The ``server_crash`` rule: the private PostgreSQL server crashes while the lanes'
    workers live on (held, blocked or paused), each meeting its dead connection next."""

    def server_crash(self: ConcurrentMachine) -> None:
        self.execute(Step(SERVER_CRASH))

    # before the first accept there is nothing a crash could lose
    return precondition(lambda self: bool(self.payloads))(rule()(server_crash))


def _power_rule() -> Any:
    """The ``power`` rule: the machine loses power; every live lane dies with it and the
    stores keep what the drawn choice keeps of their unsynced writes (as sequentially)."""

    def power(self: ConcurrentMachine, choice: dict[str, Any]) -> None:
        self.execute(Step.power(choice))

    # before the first accept there is nothing a cut could lose, as sequentially
    return precondition(lambda self: bool(self.payloads))(
        rule(choice=st.sampled_from(POWER_CHOICES))(power))


def _drop_connection_rule() -> Any:
    """The ``drop_connection`` rule: the server ends a live lane's sessions (a dropped
    connection) while its worker runs on."""

    def drop_connection(self: ConcurrentMachine, data: st.DataObject) -> None:
        lane = data.draw(st.sampled_from(self.lanes_where(lambda lane: True)))
        self.execute(Step(DROP_CONNECTION, lane=lane))

    alive = precondition(lambda self: bool(self.lanes_where(lambda lane: True)))
    return alive(rule(data=st.data())(drop_connection))


def concurrent_machine(
    system_ref: str, *, concurrency: int, deduplication: bool = True,
    deadline: float = DEFAULT_DEADLINE, examples: int = 100, steps: int = 10,
    recorder: Recorder | None = None, statement_points: bool = False,
    scheduler: str = DEFAULT_SCHEDULER, power_loss: bool = False,
    spawner: Spawner | None = None,
) -> type[ConcurrentMachine]:
    check_scheduler(scheduler)
    system = load_system(system_ref)
    system.require_deduplication_switch(deduplication)

    class Machine(ConcurrentMachine):  # noqa: D101
        pass

    Machine.__name__ = Machine.__qualname__ = f"ConcurrentMachine_{system.name}".replace("-", "_")
    Machine.system_ref = system.ref
    Machine.concurrency = concurrency
    Machine.deduplication = deduplication
    Machine.spawner = spawner
    Machine.deadline = deadline
    Machine.statement_points = statement_points
    Machine.scheduler, Machine.steps = scheduler, steps
    Machine.opening = _opening_rule(scheduler)
    Machine.draw_data_of(system)  # the system's own payloads and ids, as sequentially
    Machine.accept_points = tuple(p.name for p in system.points_for("accept"))
    Machine.dispatch_points = tuple(p.name for p in system.points_for("dispatch"))
    Machine.recorder = recorder if recorder is not None else Recorder()
    if server_crashes_possible(system):  # on a private server only, as sequentially
        Machine.server_crash = _server_crash_rule()
        Machine.drop_connection = _drop_connection_rule()
        Machine.openings = SERVER_OPENINGS
    if power_loss:  # only then: without it the rules, and so every seed's examples, are as before
        Machine.power_loss = True
        Machine.power = _power_rule()
    Machine.TestCase.settings = machine_settings(examples, scheduled_steps(steps))
    return Machine
