"""The Hypothesis state machine that generates traces.

Every rule is one :class:`faultlab.trace.Step`, executed as a real process by
the same :class:`faultlab.run.executor.Executor` that runs scenarios and replays;
the executor checks every invariant after the step and the rule raises
:class:`InvariantFailure` when one fails. Teardown recovers to quiescence and
checks ``LIVE``. :class:`faultlab.search.recorder.Recorder` keeps the failing example.
``faultlab explore`` drops Hypothesis's shrink phase (unless ``--hypothesis-shrink``)
and shrinks the first failing example with its own minimiser
(:func:`faultlab.search.shrink.minimise`); run as a pytest test case, Hypothesis shrinks
as usual.

Use it from your own pytest suite::

    from faultlab.search.machine import outbox_machine
    TestMyOutbox = outbox_machine("mypkg.outbox:SYSTEM").TestCase
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from hypothesis import HealthCheck, Verbosity, assume, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    multiple,
    precondition,
    rule,
)

from faultlab.checks.invariants import Violation
from faultlab.process.records import DEFAULT_DEADLINE
from faultlab.process.spawn import Spawner
from faultlab.run.executor import Executor
from faultlab.run.observation import Observation
from faultlab.search import data as generated
from faultlab.search import defaults
from faultlab.search.recorder import Recorder
from faultlab.system import load_system
from faultlab.trace import SERVER_CRASH, Step, Verdict, changed_payload

STATEMENT_POINTS = ("sql:1", "sql:2", "sql:3", "sql:4", "sql:5", "sql:6", "commit:1")

PAYLOADS = generated.SIMPLE_PAYLOADS


@dataclass(frozen=True)
class Weights:
    """How many times each weighted rule is registered (see :func:`outbox_machine`):
    Hypothesis picks among rules evenly, so a rule registered twice is drawn twice as often."""

    crash: int = 5
    accept: int = 2
    service: int = 1
    #: False: no recovery right after a dispatch that crashed nowhere and changed neither
    #: store (it would do the same again); the step goes to a rule that adds work instead.
    idle_repeats: bool = True


#: explore's weights: deeper traces. The suite's weights left 45% of 200 examples (seed 7)
#: with three or more operations and 25% with a direct delivery; a third of them accepted
#: one operation and then dispatched an idle outbox again and again.
WEIGHTS = Weights(crash=5, accept=4, service=2, idle_repeats=False)
#: the suite's exploration keeps the weights its published figures were measured with.
SUITE_WEIGHTS = Weights(crash=5, accept=2, service=1, idle_repeats=True)
#: One example in this many reuses an earlier operation's payload for a new operation.
REUSE_ONE_IN = 6


class StopExploration(BaseException):
    """Raised before a step when the exploration was told to stop (time budget spent, or
    another job found something). A BaseException, so Hypothesis does not take it for a
    failure: it leaves the run at once, and the unfinished example is not reported.

    Hypothesis may still notice that the cut-short example drew less than an earlier one
    with the same start, and end the search with FlakyStrategyDefinition raised while
    handling this: :func:`ended_by_stop` recognises that as the stop it is."""


def ended_by_stop(error: BaseException) -> bool:
    """Whether ``error`` is a :class:`StopExploration`, or was raised while handling one.

    Seen with ``explore --duration``: the stop cut an example short, Hypothesis found that
    a run with the same choices had gone on drawing, and raised FlakyStrategyDefinition
    (5 runs in 12 of ``explore --duration 1.5``, each then reported a clean trace as a
    finding). A stop is only asked for while no example has failed (:func:`should_stop`),
    so a search that ended this way has found nothing."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, StopExploration):
            return True
        seen = seen.__context__
    return False


def not_a_finding(recorded: Verdict | None, replayed: Verdict,
                  failure: BaseException) -> str | None:
    """Why the example a search ended on is not reported, or None when it is a finding.

    A finding is a failure that its replay reproduces. A search can also end on an error
    of Hypothesis's own (Flaky) with no failing example at all: that is a note, never a
    corpus file (a clean one was once printed as "FOUND: clean"). A failing example whose
    replay does not show its failure again is neither: it is flaky (:func:`flaky_reason`)."""
    if replayed != recorded:
        shown = recorded.describe() if recorded else "nothing"
        return f"replay showed {replayed.describe()}, recorded {shown}: not reported"
    if replayed.clean:
        return (f"the search ended with {type(failure).__name__}, but no recorded example "
                "failed an invariant: nothing reported")
    return None


def flaky_reason(example: int | str | None, recorded: Verdict, replayed: Verdict) -> str:
    """What a flaky outcome's line says between ``flaky:`` and where its trace is kept:
    ``example`` (a number, or a label such as "example 3 of job 1") failed ``recorded``, and
    its re-run showed ``replayed``."""
    which = "an example" if example is None else \
        f"example {example}" if isinstance(example, int) else example
    again = "did not fail again when re-run" if replayed.clean else \
        f"did not fail the same way when re-run (it showed {replayed.describe()})"
    return f"an invariant failed in {which} ({recorded.describe()}) but {again}"


def should_stop(stop: Callable[[], bool] | None, failure_seen: bool) -> bool:
    """Whether to stop before the next step: asked only until an example has failed.

    Once one has (``report_multiple_bugs`` is off), Hypothesis generates nothing new and
    runs the failing example once more to report it; stopping that run would lose the
    finding, so it runs to its end, even past a time budget."""
    return stop is not None and not failure_seen and stop()


class InvariantFailure(Exception):
    """An invariant failed after a step (or in the final recovery)."""

    def __init__(self, step: int | None, violations: list[Violation]) -> None:
        where = f"after step {step}" if step is not None else "after recovery"
        super().__init__(f"{where}: " + "; ".join(str(v) for v in violations))
        self.step = step
        self.violations = violations


class NewOperations:
    """How a state machine draws a new operation: an id and a payload from the system's own
    data or the defaults (:mod:`faultlab.search.data`), now and then the payload of an
    earlier operation (two requests, one body). The sequential machine and the concurrent
    one (:mod:`faultlab.search.schedules`) both draw through it, so a concurrent trace
    carries the same realistic data a sequential one does."""

    payload_source: ClassVar[st.SearchStrategy[Any]]
    id_source: ClassVar[st.SearchStrategy[str] | None]
    #: every operation drawn so far, by id
    payloads: dict[str, Any]

    def history(self) -> str:
        """The example's steps so far, as text: the salt of :func:`generated.fair_choice`."""
        raise NotImplementedError

    @classmethod
    def draw_data_of(cls, system: Any) -> None:
        """Draw ``system``'s declared payloads and ids (or the defaults) from now on."""
        cls.payload_source = generated.payload_strategy(system)
        cls.id_source = generated.id_strategy(system)

    def new_operation_id(self, data: st.DataObject) -> str:
        existing = list(self.payloads)
        source = type(self).id_source
        if source is None:
            return generated.new_operation_id(data, existing, len(existing) + 1,
                                              self.history())
        for _ in range(3):
            candidate = data.draw(source, label="operation id")
            if candidate not in existing:
                return candidate
        assume(False)  # the system's ids are too few to draw a new one: abandon the example
        raise AssertionError("unreachable")  # pragma: no cover

    def new_payload(self, data: st.DataObject) -> Any:
        """A new payload or, one draw in :data:`REUSE_ONE_IN`, an earlier operation's."""
        earlier = list(dict.fromkeys(generated_key(p) for p in self.payloads.values()))
        if earlier and data.draw(st.integers(0, REUSE_ONE_IN - 1), label="reuse") == 1:
            chosen = data.draw(st.sampled_from(earlier), label="reused payload")
            return next(p for p in self.payloads.values() if generated_key(p) == chosen)
        return data.draw(type(self).payload_source, label="payload")


class TraceExecutor(Protocol):
    """What the frame asks of an executor, sequential or in lanes: fresh stores opened, a
    step run and judged, a recovery, the stores released."""

    def __enter__(self) -> Any: ...

    def run(self, step: Any, *, phase: str = "step") -> Any: ...

    def settle(self) -> tuple[Sequence[Any], list[Violation]]: ...

    def close(self) -> None: ...


class TraceMachine(NewOperations, RuleBasedStateMachine):
    """What every exploring machine does, whatever its concurrency: its example runs on
    fresh stores its executor opens as the example starts; each drawn step runs there and
    the first failed invariant ends the example; at its end the trace recovers (unless it
    failed, stopped or errored), the stores go and the recorder is told. A run error (stores
    that could not be made or released, a worker that could not run) is the recorder's,
    never a finding: the example stops there, is not recovered and is not counted.

    The sequential machine (:class:`OutboxMachine`) and the one in lanes
    (:class:`faultlab.search.schedules.ConcurrentMachine`) differ in their rules and in
    what their executor is; the example's frame is this one."""

    system_ref: ClassVar[str] = "reference"
    deduplication: ClassVar[bool] = True
    deadline: ClassVar[float] = DEFAULT_DEADLINE
    recorder: ClassVar[Recorder]
    payload_source: ClassVar[st.SearchStrategy[Any]] = generated.SIMPLE_PAYLOADS
    id_source: ClassVar[st.SearchStrategy[str] | None] = None
    #: The system's named crash points a step of each kind may arm.
    accept_points: ClassVar[tuple[str, ...]] = ()
    dispatch_points: ClassVar[tuple[str, ...]] = ()
    #: ``explore --power-loss``: the stores are recorded and a ``power`` rule cuts power.
    power_loss: ClassVar[bool] = False
    #: The run's spawner (its fork server and its lanes' starter last the whole run), or
    #: None: a machine used from a user's pytest run shares one fork-mode spawner with
    #: every machine of its process (:func:`shared_spawner`).
    spawner: ClassVar[Spawner | None] = None

    @classmethod
    def runner(cls) -> Spawner:
        """The spawner this machine's examples start their workers through."""
        return cls.spawner if cls.spawner is not None else shared_spawner()

    def _open(self, executor: TraceExecutor) -> None:
        """Start the example: its state, then its executor's stores (last: once they exist,
        nothing of the constructor is left to fail, and teardown removes them)."""
        cls = type(self)
        self.payloads: dict[str, Any] = {}
        self.failure: InvariantFailure | None = None
        self.stopped = False
        #: this example's step (or its recovery) stopped with an error: no verdict
        self.errored = False
        # Swarm testing: an example's first crashing step enables a subset of the crash
        # points for the whole example (drawn then, not in an @initialize rule: that rule
        # made Hypothesis end examples early, 6 steps on average instead of 9).
        self.all_points: tuple[str, ...] = cls.accept_points + cls.dispatch_points
        self.enabled_points: tuple[str, ...] | None = None
        #: The executor as the frame sees it (a subclass keeps its own, typed, as
        #: ``executor``).
        self.trace_executor: TraceExecutor = executor
        self.recorder.open_example = executor.close  # before the stores exist
        try:
            executor.__enter__()
        except Exception as error:  # the stores could not be made: the run's error, not
            self.recorder.run_error = self.recorder.run_error or error  # the example's
            raise

    def should_stop(self) -> bool:
        """Whether the exploration is over before this step: a time budget spent, or
        another job found something."""
        return should_stop(self.recorder.stop, self.recorder.first_failure_examples is not None)

    def run_step(self, step: Any) -> Any:
        """Run ``step`` on the example's stores; its observation, once every invariant
        held (else :class:`InvariantFailure`)."""
        if self.should_stop():
            self.stopped = True
            raise StopExploration
        try:
            observation = self.trace_executor.run(step)
        except Exception as error:
            self.errored = True
            self.recorder.run_error = self.recorder.run_error or error
            raise
        self._observed(observation)
        if observation.violations:
            self.failure = InvariantFailure(observation.index, list(observation.violations))
            raise self.failure
        return observation

    def _observed(self, observation: Any) -> None:
        """A step (or a recovery step) was observed: the recorder counts it."""
        self.recorder.observe(observation)

    def _example(self, recovered: bool) -> tuple[Sequence[Any], int, bool]:
        """The ended example's steps, the processes it started and whether LIVE was judged
        (``recovered``: the recovery ran and failed nothing)."""
        raise NotImplementedError

    def teardown(self) -> None:
        found: InvariantFailure | None = None
        recovered = False
        executor = self.trace_executor
        try:
            if self.failure is None and not self.stopped and not self.errored:
                try:
                    observations, final = executor.settle()
                except Exception as error:
                    self.errored = True
                    self.recorder.run_error = self.recorder.run_error or error
                    raise
                for observation in observations:
                    self._observed(observation)
                failed = next((o for o in observations if o.violations), None)
                if failed is not None:
                    found = InvariantFailure(failed.index, list(failed.violations))
                elif final:
                    found = InvariantFailure(None, final)
                recovered = failed is None
                self.failure = found
        finally:
            # first: a signal landing anywhere later must not leave the run directory. The
            # example stays open until close returns: a signal that lands as close begins
            # (before its deferred section) leaves the stores to the search's own cleanup
            try:
                executor.close()
            except Exception as error:  # releasing the stores failed: the run's error
                self.recorder.open_example = None
                self.recorder.run_error = self.recorder.run_error or error
                raise
            self.recorder.open_example = None
            verdict, violations = Verdict(), []
            if self.failure is not None:
                violations = self.failure.violations
                verdict = Verdict.of(self.failure.step, violations)
            # an unfinished example is neither counted nor reported, and a failed run is
            # not a finding
            if not self.stopped and not self.errored:
                steps, processes, live = self._example(recovered)
                self.recorder.finish(steps, verdict, violations, processes=processes,
                                     live=live)
        if found is not None:
            raise found


class OutboxMachine(TraceMachine):
    """Base class: :func:`outbox_machine` adds rules drawn from a system's crash points."""

    recorder: ClassVar[Recorder]
    operations_bundle: ClassVar[Bundle[str]] = Bundle("operations")

    def __init__(self) -> None:
        super().__init__()
        cls = type(self)
        self.system = load_system(cls.system_ref)
        self.executor = Executor(
            self.system, cls.runner(), deduplication=cls.deduplication, deadline=cls.deadline,
            power=cls.power_loss,
        )
        self.fired: set[str] = set()
        self.unacknowledged: list[str] = []
        #: the last step was a dispatch that crashed nowhere and changed neither store
        self.idle = False
        self._open(self.executor)

    def execute(self, step: Step) -> Observation:
        observation: Observation = self.run_step(step)
        return observation

    def _example(self, recovered: bool) -> tuple[Sequence[Any], int, bool]:
        processes = sum(o.processes for o in self.executor.observations)
        return self.executor.steps, processes, recovered

    def _observed(self, observation: Observation) -> None:
        self.recorder.observe(observation)
        step = observation.step
        self.idle = (step.action == "dispatch" and step.crash is None
                     and observation.snapshot == observation.before)
        if observation.crashed and observation.step.crash is not None:
            self.fired.add(observation.step.crash)

    def accepted(self, observation: Observation) -> Any:
        """Put an acknowledged operation into the bundle; remember an unacknowledged one."""
        operation_id = observation.step.operation_id or ""
        acknowledged = operation_id in self.executor.model.acknowledged
        if operation_id in self.unacknowledged:
            self.unacknowledged.remove(operation_id)
        if acknowledged:
            return operation_id
        self.unacknowledged.append(operation_id)
        return multiple()

    def accept_new(self, data: st.DataObject, crash: str | None) -> Any:
        """Accept a new operation: a fresh id (see :mod:`faultlab.search.data`), a new payload or,
        now and then, the payload of an earlier operation (two requests, one body)."""
        operation_id = self.new_operation_id(data)
        payload = self.new_payload(data)
        self.payloads[operation_id] = payload
        return self.accepted(self.execute(Step("accept", operation_id, payload, crash)))

    def history(self) -> str:
        """The example's steps so far, as text: the salt of :func:`generated.fair_choice`."""
        return "|".join(step.describe() for step in self.executor.steps)

    def pick_point(self, data: st.DataObject, points: tuple[str, ...]) -> str:
        """One of ``points``, fairly (see :func:`faultlab.search.data.fair_choice`)."""
        return generated.fair_choice(data, points, self.history(), "crash point")

    def has_pending_work(self) -> bool:
        return bool(self.executor.snapshot.pending_outbox())

    def complete_operations(self) -> list[str]:
        return [
            op.id for op in self.executor.snapshot.operations
            if op.state == "complete" and op.id in self.payloads
        ]


def run_example(machine: type[OutboxMachine], steps: Iterable[Step]) -> OutboxMachine:
    """Run fixed steps through the machine's own executor, invariants and teardown.

    Hypothesis has no ``@example`` for state machines; this is faultlab's. Raises
    :class:`InvariantFailure` exactly as a generated example would.
    """
    instance = machine()
    try:
        for step in steps:
            instance.execute(step)
    finally:
        instance.teardown()
    return instance


_shared: list[Spawner] = []


def shared_spawner() -> Spawner:
    """One fork-mode spawner (its fork server, its lanes' starter) for the machines of a
    user's pytest run, which gives them none of its own; closed at exit."""
    if not _shared:
        import atexit

        _shared.append(Spawner("fork"))
        atexit.register(_shared[0].close)
    return _shared[0]


def machine_settings(
    examples: int = defaults.TESTCASE_EXAMPLES, steps: int = defaults.STEPS
) -> settings:
    """Settings for slow real steps: no deadline, no too-slow health check, no database."""
    return settings(
        max_examples=examples,
        stateful_step_count=steps,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                               HealthCheck.data_too_large],
        verbosity=Verbosity.normal,
    )


def generated_key(payload: Any) -> str:
    """Payloads compare as canonical JSON (1 and 1.0, or True and 1, are different)."""
    from faultlab.base.canonical import canonical_json

    return canonical_json(payload)


def swarm(points: tuple[str, ...]) -> st.SearchStrategy[tuple[str, ...]]:
    """A non-empty subset of ``points``, each in with probability one half (swarm testing:
    an example that leaves out the common points exercises the rare ones in depth)."""
    if not points:
        return st.just(())
    return st.lists(st.booleans(), min_size=len(points), max_size=len(points)).map(
        lambda flags: tuple(p for p, on in zip(points, flags, strict=True) if on) or points
    )


def _weighted_copy(original: Callable[..., Any], name: str,
                   guard: Callable[[Any], bool] | None = None) -> Any:
    """Another rule doing what ``original`` (a ``target=operations, data=st.data()`` rule)
    does, under its own name."""

    def copy(self: OutboxMachine, data: st.DataObject) -> Any:
        return original(self, data)

    copy.__name__ = copy.__qualname__ = name
    decorated = rule(target=OutboxMachine.operations_bundle, data=st.data())(copy)
    return precondition(guard)(decorated) if guard is not None else decorated


def _service_copy(original: Callable[..., Any], name: str) -> Any:
    """Another rule doing what the ``service`` rule does, under its own name."""

    def copy(self: OutboxMachine, operation: str) -> None:
        original(self, operation)

    copy.__name__ = copy.__qualname__ = name
    return rule(operation=OutboxMachine.operations_bundle)(copy)


#: What a power cut keeps of the unsynced writes, drop_all first so a finding shrinks to it
#: (:mod:`faultlab.stores.vfs`); a small fixed set, so every choice replays as data.
POWER_CHOICES: tuple[dict[str, Any], ...] = (
    {"kind": "drop_all"},
    {"kind": "prefix", "keep": 1},
    {"kind": "torn", "keep": 0, "sector": 512},
    {"kind": "reorder", "drop": 0},
)


def _power_rule() -> Any:
    """The ``power`` rule: the machine loses power between two steps."""

    def power(self: OutboxMachine, choice: dict[str, Any]) -> None:
        self.execute(Step.power(choice))

    # before the first accept there is nothing a cut could lose (the stores' creation is
    # durable): a cut then would spend a step and check nothing
    return precondition(lambda self: bool(self.payloads))(
        rule(choice=st.sampled_from(POWER_CHOICES))(power))


def _server_crash_rule() -> Any:
    """The ``server_crash`` rule: the private PostgreSQL server crashes between two steps."""

    def server_crash(self: OutboxMachine) -> None:
        self.execute(Step(SERVER_CRASH))

    # before the first accept there is nothing a crash could lose
    return precondition(lambda self: bool(self.payloads))(rule()(server_crash))


def server_crashes_possible(system: Any) -> bool:
    """Whether the machines draw ``server_crash``: automatically, for a PostgreSQL system
    whose stores are on faultlab's own server (``--postgres private``); never on a shared
    server (not ours to crash), so every other run draws what it drew before."""
    from faultlab.stores import postgres as pgstores

    return getattr(system, "store_kind", None) == "postgres" \
        and pgstores.private_server() is not None


def outbox_machine(
    system_ref: str = "reference",
    *,
    deduplication: bool = True,
    spawner: Spawner | None = None,
    deadline: float = DEFAULT_DEADLINE,
    examples: int = defaults.TESTCASE_EXAMPLES,
    steps: int = defaults.STEPS,
    recorder: Recorder | None = None,
    statement_points: bool = True,
    weights: Weights = WEIGHTS,
    power_loss: bool = False,
) -> type[OutboxMachine]:
    """Build the state machine for one system; its ``TestCase`` runs under pytest/unittest."""
    system = load_system(system_ref)
    system.require_deduplication_switch(deduplication)
    statement_points = statement_points and system.supports_statement_points
    accept_points = tuple(p.name for p in system.points_for("accept"))
    dispatch_points = tuple(p.name for p in system.points_for("dispatch"))

    class Machine(OutboxMachine):  # noqa: D101
        """Crashing steps draw their point from the example's swarm (see :func:`swarm`), so
        over many examples every named point gets a fair share, however many there are."""

        operations = OutboxMachine.operations_bundle

        @rule(target=operations, data=st.data())
        def accept(self, data: st.DataObject) -> Any:
            return self.accept_new(data, None)

        @precondition(lambda self: bool(self.unacknowledged))
        @rule(target=operations)
        def retry_accept(self) -> Any:
            """The caller retries an accept that was never acknowledged (same id and payload)."""
            operation_id = self.unacknowledged[0]
            payload = self.payloads[operation_id]
            return self.accepted(self.execute(Step("accept", operation_id, payload)))

        @rule(operation=operations, change=st.booleans())
        def accept_again(self, operation: str, change: bool) -> None:
            payload = self.payloads[operation]
            self.execute(Step("accept", operation, changed_payload(payload) if change else payload))

        @precondition(lambda self: bool(self.payloads)
                      and (weights.idle_repeats or not self.idle))
        @rule()
        def recover(self) -> None:
            self.execute(Step("dispatch"))

        @rule(operation=operations)
        def service(self, operation: str) -> None:
            """A second delivery of an accepted operation, straight to the receiver."""
            self.execute(Step("service", operation, self.payloads[operation]))

        @precondition(lambda self: bool(self.complete_operations()))
        @rule(data=st.data())
        def service_changed(self, data: st.DataObject) -> None:
            """A payload conflict: a completed operation retried with a changed payload,
            which the receiver must refuse (only once complete: before delivery it cannot
            know the accepted one)."""
            operation = data.draw(st.sampled_from(self.complete_operations()), label="operation")
            self.execute(Step("service", operation, changed_payload(self.payloads[operation])))

        @precondition(lambda self: bool(self.all_points))
        @rule(target=operations, data=st.data())
        def crash(self, data: st.DataObject) -> Any:
            """Crash at one of the example's named points: an accept for an accept point, a
            dispatch for the others, after accepting a new operation when nothing is pending
            or, half the time, anyway (new work arriving keeps traces deep). Every point is
            armed where it can fire, and all points share one rule."""
            if self.enabled_points is None:
                self.enabled_points = data.draw(swarm(self.all_points), label="swarm")
            point = self.pick_point(data, self.enabled_points)
            if point in type(self).accept_points:
                return self.accept_new(data, point)
            held: Any = multiple()
            if not self.has_pending_work() or generated.fair_choice(
                    data, ("pending", "new work first"), self.history() + "|work",
                    "work") == "new work first":
                held = self.accept_new(data, None)
            self.execute(Step("dispatch", crash=point))
            return held

        @precondition(lambda self: statement_points)
        @rule(target=operations, data=st.data(), crash=st.sampled_from(STATEMENT_POINTS))
        def accept_statement_crash(self, data: st.DataObject, crash: str) -> Any:
            return self.accept_new(data, crash)

        @precondition(lambda self: statement_points and self.has_pending_work())
        @rule(crash=st.sampled_from(STATEMENT_POINTS))
        def dispatch_statement_crash(self, crash: str) -> None:
            self.execute(Step("dispatch", crash=crash))

    Machine.__name__ = Machine.__qualname__ = f"OutboxMachine_{system.name}".replace("-", "_")
    Machine.system_ref = system.ref
    Machine.deduplication = deduplication
    Machine.deadline = deadline
    Machine.spawner = spawner
    Machine.recorder = recorder if recorder is not None else Recorder()
    # Weights: Hypothesis picks among rules evenly (and switches rules off per example by
    # name), so the crash, accept and service rules get copies under names of their own.
    for copy in range(2, weights.crash + 1):
        setattr(Machine, f"crash_{copy}", _weighted_copy(
            Machine.crash, f"crash_{copy}", lambda self: bool(self.all_points)))
    for copy in range(2, weights.accept + 1):
        setattr(Machine, f"accept_{copy}", _weighted_copy(Machine.accept, f"accept_{copy}"))
    for copy in range(2, weights.service + 1):
        setattr(Machine, f"service_{copy}", _service_copy(Machine.service, f"service_{copy}"))
    Machine.accept_points, Machine.dispatch_points = accept_points, dispatch_points
    if power_loss:  # only then: without it the rules, and so every seed's examples, are as before
        Machine.power_loss = True
        Machine.power = _power_rule()
    if server_crashes_possible(system):  # likewise only then
        Machine.server_crash = _server_crash_rule()
    Machine.payload_source = generated.payload_strategy(system)
    Machine.id_source = generated.id_strategy(system)
    Machine.TestCase.settings = machine_settings(examples, steps)
    return Machine
