"""faultlab from Python: explore a system, replay a trace, or get a Hypothesis state machine.

These functions are what the command line does, as calls that return data instead
of printing and exiting. Settings are arguments (never module globals), so two
calls in one process do not influence each other. Every call runs real worker
processes on fresh real stores and cleans up after itself.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from faultlab.base.errors import UsageError
from faultlab.base.inputs import MAX_CONCURRENCY
from faultlab.checks.invariants import Violation
from faultlab.process.records import DEFAULT_DEADLINE, SpawnMode
from faultlab.search import defaults
from faultlab.system import load_system
from faultlab.system.contract import System
from faultlab.trace import Trace, Verdict

if TYPE_CHECKING:
    from hypothesis.stateful import RuleBasedStateMachine


@dataclass(frozen=True)
class Outcome:
    """What an exploration or a replay showed.

    ``clean`` is True only when something was tested and no invariant failed (a vacuous
    exploration, one that accepted no operation, left a family of invariants with nothing to
    check, armed the declared crash points and never fired one, or ran lanes of workers that
    can never overlap, is not clean: ``notes`` says why). ``trace`` is
    the shrunk trace of a finding (``None`` when clean); ``violations`` the invariant
    failures its replay showed; ``path`` the corpus file a finding was saved to, if any;
    ``notes`` anything the run wants a reader to know.

    ``flaky`` is True when an exploration saw an invariant fail in an example but the
    failure did not happen again when the example was re-run (``explore``'s exit 5): not
    clean, and not a finding. ``trace`` is then that example's trace, marked ``"expect":
    "flaky"`` and never saved to ``corpus``; ``notes`` says what the re-run showed.
    """

    clean: bool
    trace: Trace | None = None
    violations: tuple[Violation, ...] = ()
    path: Path | None = None
    notes: tuple[str, ...] = ()
    stats: dict[str, Any] = field(default_factory=dict)
    flaky: bool = False

    def __bool__(self) -> bool:
        """True when clean, so ``assert faultlab.explore(...)`` reads as intended."""
        return self.clean


def _system(system: str | Path | System) -> System:
    if isinstance(system, System):
        if not system.ref:
            raise UsageError(
                f"system {system.name!r} has no ref: worker processes find a system by "
                "reference, so pass it as 'package.module:attribute'")
        return system
    if isinstance(system, Path):
        system = str(system)
    if not isinstance(system, str):
        raise UsageError(f"a system is a name, a path or a faultlab.System, not {system!r}")
    return load_system(system)


def _check_concurrency(concurrency: int) -> None:
    """Lanes from 1 to :data:`~faultlab.base.inputs.MAX_CONCURRENCY`: a trace with more
    could be saved but never loaded again."""
    if isinstance(concurrency, bool) or not isinstance(concurrency, int) \
            or not 1 <= concurrency <= MAX_CONCURRENCY:
        raise UsageError(f"concurrency must be an integer from 1 to {MAX_CONCURRENCY}, "
                         f"not {concurrency!r}")


def _check_arguments(*, examples: Any = 1, steps: Any = 1, seed: Any = 0,
                     deadline: Any = DEFAULT_DEADLINE, spawn: Any = "fork",
                     statement_points: Any = None) -> None:
    """What the command line's parser refuses, refused here before anything runs, in one
    line naming the argument (a string for ``examples`` was a bare TypeError deep in the
    search, a negative ``deadline`` a worker that missed it)."""
    import math

    from faultlab.base.inputs import MAX_INT_DIGITS
    from faultlab.process.records import SPAWN_MODES

    def integer(value: Any) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) \
            and len(str(abs(value))) <= MAX_INT_DIGITS

    for name, value in (("examples", examples), ("steps", steps)):
        if not integer(value) or value < 1:
            raise UsageError(f"{name} must be an integer of at least 1, not {value!r}")
    if not integer(seed):
        raise UsageError(f"seed must be an integer, not {seed!r}")
    if isinstance(deadline, bool) or not isinstance(deadline, (int, float)) \
            or not math.isfinite(deadline) or deadline <= 0:
        raise UsageError(f"deadline must be a positive number of seconds, not {deadline!r}")
    if spawn not in SPAWN_MODES:
        raise UsageError(f"spawn must be one of {', '.join(SPAWN_MODES)}, not {spawn!r}")
    if statement_points is not None and not isinstance(statement_points, bool):
        raise UsageError(f"statement_points must be True, False or None, not "
                         f"{statement_points!r}")


def _corpus_directory(corpus: str | Path | None) -> Path | None:
    """The corpus directory a finding is saved in, checked as ``--corpus`` is, before the
    run (a file there, or a missing parent, once failed only after the search)."""
    if corpus is None:
        return None
    from faultlab.corpus.files import check_corpus_directory
    from faultlab.corpus.redis_store import is_redis_url

    if not isinstance(corpus, (str, Path)):
        raise UsageError(f"corpus must be a directory path, not {corpus!r}")
    if is_redis_url(str(corpus)):
        raise UsageError(f"corpus {corpus}: the Python API saves findings to a directory; a "
                         "redis:// corpus is for the command line's shards")
    check_corpus_directory(Path(corpus))
    return Path(corpus)


def _explorable(system: str | Path | System) -> System:
    """The system, with its declared data checked before anything runs."""
    from faultlab.search.data import check_declared

    chosen = _system(system)
    check_declared(chosen)
    return chosen


def explore(
    system: str | Path | System,
    *,
    examples: int = defaults.EXAMPLES,
    seed: int = 0,
    steps: int = defaults.STEPS,
    concurrency: int = 1,
    deduplication: bool = True,
    corpus: str | Path | None = None,
    spawn: SpawnMode = "fork",
    deadline: float = DEFAULT_DEADLINE,
    statement_points: bool | None = None,
    progress: Callable[[Any], None] | None = None,
) -> Outcome:
    """Search for a trace that breaks an invariant of ``system``; shrink and confirm it.

    ``concurrency=1`` explores sequential traces; ``concurrency=N`` (N >= 2) runs up to N
    workers at once and searches their interleavings. A finding is replayed before it is
    reported, and saved under ``corpus`` when one is given.

    >>> import faultlab
    >>> found = faultlab.explore("no-dedup", examples=50, seed=0)   # doctest: +SKIP
    >>> found.clean, len(found.trace.steps)                         # doctest: +SKIP
    (False, 2)
    >>> faultlab.explore("reference", examples=20).clean            # doctest: +SKIP
    True
    """
    from faultlab.process.spawn import spawner
    from faultlab.search.coverage import vacuity

    _check_concurrency(concurrency)
    _check_arguments(examples=examples, steps=steps, seed=seed, deadline=deadline,
                     spawn=spawn, statement_points=statement_points)
    chosen = _explorable(system)
    if statement_points:
        chosen.require_statement_points(f"statement_points: {chosen.name}")
    directory = _corpus_directory(corpus)
    from faultlab.search.explore import explore as explore_system
    from faultlab.search.storage import private_storage

    # as the command line does: Hypothesis's files stay out of the caller's directory
    with private_storage(), spawner(spawn) as runner:
        result = explore_system(
            chosen, runner, concurrency=concurrency, deduplication=deduplication,
            examples=examples, steps=steps, seed_value=seed, deadline=deadline,
            progress=progress, statement_points=statement_points,
        )
    found, stats, notes = result.trace, result.stats(), result.notes
    flaky, flaky_reason = result.flaky, result.flaky_reason
    recorder = result.recorder
    checked = recorder.checks
    violations = tuple(result.replay.violations) if result.replay else ()
    vacuous = vacuity(recorder.coverage, chosen, recorder.examples, concurrency=concurrency,
                      held=recorder.held, can_hold=chosen.holds_in_lanes())
    if found is None and flaky is not None:  # not clean, not a finding, never saved
        return Outcome(clean=False, trace=flaky, notes=(*notes, f"flaky: {flaky_reason}"),
                       stats=stats, flaky=True)
    path = None
    if found is not None and directory is not None:
        from faultlab.corpus import files

        path = files.save(found, directory, chosen.name)  # named as the command line names it
    if found is None and not checked:
        notes = [*notes, "nothing was checked: the run is not clean"]
    elif found is None and vacuous is not None:
        notes = [*notes, f"vacuous: nothing was tested: {vacuous}"]
    tested = bool(checked) and vacuous is None
    return Outcome(clean=found is None and tested, trace=found, violations=violations,
                   path=path, notes=tuple(notes), stats=stats)


def replay(trace_or_path: Trace | str | Path, *,
           system: str | Path | System | None = None, spawn: SpawnMode = "fork",
           deadline: float = DEFAULT_DEADLINE) -> Outcome:
    """Run a saved trace again on fresh stores; ``clean`` when no invariant fails.

    A trace file is data: it never chooses what code runs. Built-in systems are found by
    the name the trace records; any other system must be given as ``system``, or mapped in
    the trace's project (``[tool.faultlab.systems]`` of the nearest ``pyproject.toml`` above
    the trace file): the rule of :mod:`faultlab.corpus.trust`, as ``faultlab replay`` has it.

    >>> outcome = faultlab.replay("corpus/no-dedup-RCPT-baa0069205.json")   # doctest: +SKIP
    >>> outcome.clean                                                       # doctest: +SKIP
    False
    """
    from faultlab.corpus.replay import plan
    from faultlab.corpus.replay import replay as replay_planned
    from faultlab.corpus.trust import system_for
    from faultlab.process.spawn import spawner

    _check_arguments(deadline=deadline, spawn=spawn)
    if isinstance(trace_or_path, (str, Path)):
        path = Path(trace_or_path)
        trace = Trace.load(path)
        call = f"faultlab.replay({str(path)!r}, system={{}})"
    elif isinstance(trace_or_path, Trace):
        path, trace = Path("<trace>"), trace_or_path  # no file: named so in messages
        call = "faultlab.replay(trace, system={})"
    else:
        raise UsageError(f"replay takes a Trace or a trace file's path, not "
                         f"{trace_or_path!r}"[:200])
    chosen = system_for(
        path, trace, None if system is None else _system(system),
        how=lambda placeholder: call.format(repr(placeholder)))
    planned = plan(path, trace, chosen)
    with spawner(spawn) as runner:
        replayed = replay_planned(planned, runner, deadline=deadline)
    verdict: Verdict = replayed.verdict
    executed = replayed.execution
    return Outcome(clean=verdict.clean, trace=trace if not verdict.clean else None,
                   violations=tuple(executed.violations) if executed is not None else (),
                   path=path if isinstance(trace_or_path, (str, Path)) else None)


#: Where a failing state-machine test saves its finding when neither ``corpus=`` nor the
#: pytest plugin's ``--faultlab-corpus`` says: beside the tests, apart from the committed
#: ``corpus/`` that ``explore`` writes, so a test run never mixes into it unasked.
TEST_CORPUS = Path("faultlab-corpus")


def state_machine(system: str | Path | System, *, concurrency: int = 1,
                  deduplication: bool = True, examples: int = defaults.EXAMPLES,
                  steps: int = defaults.STEPS, deadline: float = DEFAULT_DEADLINE,
                  corpus: str | Path | None = None) -> type[RuleBasedStateMachine]:
    """A Hypothesis ``RuleBasedStateMachine`` over ``system``; its ``TestCase`` runs under
    pytest or unittest and fails the way ``faultlab explore`` reports a finding.
    ``concurrency`` lanes: 1, sequential steps; 2 or more, scheduling choices among
    workers alive at once (as ``explore --concurrency N``).

    The ``TestCase`` does not run Hypothesis's own test loop: every example is real
    processes, and Hypothesis's shrinker spent minutes on them (114 s for a bug ``explore``
    reports in 5 s) and then printed its raw draws. It runs :func:`faultlab.search.explore.
    explore` instead: the search stops at the first failing example, faultlab's minimiser
    shrinks it, the replay confirms it, the finding is saved, and the test fails with an
    ``AssertionError`` whose message is the replay table (also printed), with the command
    that replays the saved trace. A clean run passes; so does a vacuous one (nothing was
    tested: ``explore`` would exit 4), with a warning that says why, since a short test
    run is often vacuous on purpose.

    Its ``settings`` give the examples (``max_examples``) and the steps per example
    (``stateful_step_count``); the seed is the machine's (``@hypothesis.seed``, or the
    plugin's ``--faultlab-seed`` and ``@pytest.mark.faultlab(seed=...)``), else explore's
    default, so a run is the same run every time. A finding is saved into ``corpus``; without
    it into the first ``--faultlab-corpus`` directory of the pytest run (where the plugin
    replays it as a regression test next time), else into ``./faultlab-corpus``.

    >>> TestMyOutbox = faultlab.state_machine("reference", examples=20).TestCase  # doctest: +SKIP
    """
    from faultlab.search.machine import machine_settings, outbox_machine
    from faultlab.search.schedules import concurrent_machine

    _check_concurrency(concurrency)
    _check_arguments(examples=examples, steps=steps, deadline=deadline)
    chosen = _system(system)
    chosen_corpus = _corpus_directory(corpus)
    machine: type[RuleBasedStateMachine] = concurrent_machine(
        chosen.ref, concurrency=concurrency, deduplication=deduplication, deadline=deadline,
        examples=examples, steps=steps,
    ) if concurrency > 1 else outbox_machine(
        chosen.ref, deduplication=deduplication, deadline=deadline, examples=examples,
        steps=steps)
    test_case = _finding_test_case(machine, chosen, concurrency=concurrency,
                                   deduplication=deduplication, deadline=deadline,
                                   corpus=chosen_corpus)
    # Hypothesis's TestCase property builds its class with _to_test_case: this one instead
    setattr(machine, "_to_test_case", classmethod(lambda cls: test_case))  # noqa: B010
    machine.TestCase.settings = machine_settings(examples, steps)
    return machine


def _finding_test_case(machine: type[RuleBasedStateMachine], system: System, *,
                       concurrency: int, deduplication: bool, deadline: float,
                       corpus: Path | None) -> type[unittest.TestCase]:
    """The ``TestCase`` of :func:`state_machine`: one exploration, reported as explore does."""
    from hypothesis import settings as Settings  # noqa: N812

    class StateMachineTestCase(unittest.TestCase):
        settings: ClassVar[Settings]
        #: set by the pytest plugin for the run of one test: its first --faultlab-corpus
        faultlab_plugin_corpus: ClassVar[Path | None] = None

        def runTest(self) -> None:  # noqa: N802 - unittest's name
            __tracebackhide__ = True  # pytest shows the message (the table), not this frame
            chosen = corpus or type(self).faultlab_plugin_corpus or TEST_CORPUS
            seed = getattr(machine, "_hypothesis_internal_use_seed", None)
            failure = _explore_as_test(
                system, concurrency=concurrency, examples=self.settings.max_examples,
                steps=self.settings.stateful_step_count,
                seed=defaults.SEED if seed is None else int(seed),
                deduplication=deduplication, deadline=deadline, corpus=chosen)
            if failure is not None:
                print(failure, flush=True)
                raise AssertionError(failure)

        # what Hypothesis's own TestCase carries: the plugin finds the machine by it
        runTest.is_hypothesis_test = True  # type: ignore[attr-defined]
        runTest._hypothesis_state_machine_class = machine  # type: ignore[attr-defined]

    StateMachineTestCase.__name__ = machine.__name__ + ".TestCase"
    StateMachineTestCase.__qualname__ = machine.__qualname__ + ".TestCase"
    return StateMachineTestCase


def _explore_as_test(system: System, *, concurrency: int, examples: int, steps: int,
                     seed: int, deduplication: bool, deadline: float, corpus: Path
                     ) -> str | None:
    """Explore ``system`` as ``faultlab explore`` does; the report of a finding, or None.

    The report is what explore prints for it: the ``FOUND`` line naming the saved file, the
    replay table, its violations, the first worker that died with an undeclared error (with
    its stderr) and the command that replays the saved trace. A flaky outcome (explore's
    exit 5: an invariant failed, but not again when re-run) fails the test too, with the
    ``flaky:`` line; nothing is saved. What explore only notes is a warning, and the test
    passes: a vacuous run (explore's exit 4: nothing was tested, for example no declared
    crash point ever fired), since a short test run is often vacuous on purpose.
    """
    import warnings

    from faultlab.corpus import files
    from faultlab.process.spawn import spawner
    from faultlab.report import tables as report
    from faultlab.search.coverage import vacuity
    from faultlab.search.explore import explore as explore_system
    from faultlab.search.storage import private_storage

    # as explore does: Hypothesis's files (its unicode and constants caches) stay out of
    # the directory the tests run in
    with private_storage(), spawner("fork") as runner:
        result = explore_system(
            system, runner, concurrency=concurrency, deduplication=deduplication,
            examples=examples, steps=steps, seed_value=seed, deadline=deadline)
    for note in result.notes:
        warnings.warn(f"faultlab: {note}", stacklevel=3)
    if result.trace is None and result.flaky is not None:
        return (f"flaky: {result.flaky_reason} (seed {seed}, {result.recorder.examples} "
                f"examples); nothing saved: {corpus} holds only failures that reproduce")
    if result.trace is None or result.replay is None:
        vacuous = vacuity(result.recorder.coverage, system, result.recorder.examples,
                          concurrency=concurrency, held=result.recorder.held,
                          can_hold=system.holds_in_lanes())
        if vacuous is not None:
            warnings.warn(f"faultlab: vacuous: nothing failed in {result.recorder.examples} "
                          f"examples, but nothing was tested: {vacuous}", stacklevel=3)
        return None
    path = files.save(result.trace, corpus, system.name)
    expected = result.trace.expected
    verdict = expected.describe() if expected else "a failure"
    return "\n".join([
        f"FOUND: {verdict}, shrunk to {result.shrunk_steps} executed steps "
        f"(seed {seed}, {result.recorder.examples} examples); saved {path}",
        report.replay_table(result.replay, "table"),
        *report.violation_lines(result.replay),
        *report.worker_error_lines(result.replay),
        f"replay with: {files.replay_command(path, system.ref)}",
    ])
