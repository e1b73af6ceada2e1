"""faultlab's pytest plugin (entry point ``pytest11``): corpus replay and state-machine settings.

Installing faultlab gives every pytest run:

* ``--faultlab-corpus DIR`` (repeatable): each trace file (``*.json``) in DIR
  becomes one test item, named after the file, that replays the trace on fresh
  stores and passes when the outcome matches its recording (``faultlab replay``
  as a test). A failing item prints the replay table. Without test paths on the
  command line only the corpus is collected, so ``pytest --faultlab-corpus
  corpus`` runs from any directory. A trace with ``"expect": "finding"`` passes
  while it shows its recorded finding; one without (a regression test) fails
  while its finding still shows and passes once the bug is fixed.
* ``--faultlab-system SYSTEM``: the system every corpus trace runs on. A trace
  never chooses code to run (:mod:`faultlab.corpus.trust`): without this
  option a trace runs on the built-in system it names, or on the one its
  project maps that name to in ``[tool.faultlab.systems]`` of the nearest
  ``pyproject.toml`` above the trace file; any other trace fails in one line
  saying how to name its system, and nothing runs for it.
* ``--faultlab-postgres DSN|private``: the PostgreSQL server for traces whose
  system keeps its stores there (as ``--postgres`` of the commands). ``private``
  starts faultlab's own server when the first such trace runs (never before, so
  a corpus without one pays nothing) and stops and removes it at the end of the
  session; a trace with a server fault, or of a system on the server's clock,
  needs it. Without the option such traces use libpq's environment.
* ``--faultlab-examples N`` and ``--faultlab-seed S`` for state-machine tests
  built with :func:`faultlab.state_machine` (its ``TestCase``; also the lower-level
  :func:`faultlab.search.machine.outbox_machine` and the concurrent
  :func:`faultlab.search.schedules.concurrent_machine`), and the marker
  ``@pytest.mark.faultlab(examples=..., seed=..., steps=...)``, as Hypothesis's own
  plugin does for its settings. A marker wins over an option, an option over what
  ``faultlab.state_machine`` was given. A failing ``faultlab.state_machine`` test saves
  its finding into the first ``--faultlab-corpus`` directory, when one is given, so the
  next run replays it as a regression test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from faultlab.base.errors import ExecutionError, UsageError

_CORPUS_KEY = pytest.StashKey[list[Path]]()
_SPAWNER_KEY = pytest.StashKey[contextlib.ExitStack]()
MARKER = ("faultlab(examples=None, seed=None, steps=None): settings for a faultlab "
          "state-machine test (faultlab.state_machine(...).TestCase)")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("faultlab", "faultlab: crash-testing outbox workers")
    group.addoption(
        "--faultlab-corpus", action="append", default=[], metavar="DIR",
        help="replay every trace file (*.json) in DIR as one test item named after the file; "
             "it passes when the outcome matches the recording (repeatable)",
    )
    group.addoption(
        "--faultlab-system", default=None, metavar="SYSTEM",
        help="run every corpus trace on this system (a built-in name, package.module:attribute "
             "or path/to/system.json); without it a trace runs on the built-in system it "
             "names, or the one [tool.faultlab.systems] of the nearest pyproject.toml above "
             "it maps that name to, and any other trace fails without running",
    )
    group.addoption(
        "--faultlab-postgres", default=None, metavar="DSN|private",
        help="PostgreSQL server for corpus traces of systems with PostgreSQL stores: a libpq "
             "connection string, or 'private' for faultlab's own server, started when the "
             "first such trace runs and removed at the end (needed by traces with a "
             "server_crash or drop_connection step); default: libpq's environment",
    )
    group.addoption(
        "--faultlab-spawn", choices=("fork", "exec"), default="fork",
        help="how corpus replays start workers: fork (default) or exec",
    )
    group.addoption(
        "--faultlab-deadline", type=float, default=15.0, metavar="SECONDS",
        help="kill a worker of a corpus replay that runs longer than this (default 15)",
    )
    group.addoption(
        "--faultlab-examples", type=int, default=None, metavar="N",
        help="examples for faultlab state-machine tests (faultlab.state_machine(...).TestCase); "
             "a @pytest.mark.faultlab(examples=...) marker wins",
    )
    group.addoption(
        "--faultlab-seed", type=int, default=None, metavar="S",
        help="seed for faultlab state-machine tests: the same seed, the same examples (with "
             "the same Hypothesis version); a @pytest.mark.faultlab(seed=...) marker wins",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER)
    examples = config.getoption("faultlab_examples")
    if examples is not None and examples < 1:
        raise pytest.UsageError(f"--faultlab-examples must be at least 1, not {examples}")
    deadline = config.getoption("faultlab_deadline")
    if not 0 < deadline < float("inf"):  # NaN fails this too
        raise pytest.UsageError(f"--faultlab-deadline must be a positive number of seconds, "
                                f"not {deadline}")
    corpora: list[Path] = []
    for text in config.getoption("faultlab_corpus") or ():
        path = Path(text).resolve()
        if not path.is_dir():
            raise pytest.UsageError(f"--faultlab-corpus {text}: not a directory")
        corpora.append(path)
    config.stash[_CORPUS_KEY] = corpora
    if corpora:
        source = getattr(config, "args_source", None)
        explicit = source is not None and source == pytest.Config.ArgsSource.ARGS
        paths = [str(path) for path in corpora]
        # no test paths given: collect only the corpus (not testpaths or the current directory)
        config.args[:] = (list(config.args) + paths) if explicit else paths


def pytest_unconfigure(config: pytest.Config) -> None:
    stack = config.stash.get(_SPAWNER_KEY, None)
    if stack is not None:
        stack.close()
    postgres = config.stash.get(_POSTGRES_KEY, None)
    if postgres is not None:
        postgres.close()


_POSTGRES_KEY = pytest.StashKey[contextlib.ExitStack]()
_POSTGRES_FAILED_KEY = pytest.StashKey[Exception]()


def _use_postgres(config: pytest.Config) -> None:
    """Point the stores at ``--faultlab-postgres`` once, before the first trace whose system
    keeps its stores on PostgreSQL; the databases this session created are dropped and a
    private server is stopped and removed when the session ends."""
    value = config.getoption("faultlab_postgres")
    failed = config.stash.get(_POSTGRES_FAILED_KEY, None)
    if failed is not None:  # every later trace fails the same way, none runs elsewhere
        raise failed
    if value is None or config.stash.get(_POSTGRES_KEY, None) is not None:
        return
    from faultlab.stores import postgres as pgstores

    stack = contextlib.ExitStack()
    config.stash[_POSTGRES_KEY] = stack
    server = None
    if value == "private":
        from faultlab.stores.pgserver import PrivateServer

        server = PrivateServer()
        stack.callback(server.stop)  # last: after the databases on it are dropped
    stack.callback(pgstores.configure, None)
    stack.callback(pgstores.close_run)  # first: drop what this session created
    if server is not None:
        try:
            server.start()
        except Exception as error:
            config.stash[_POSTGRES_FAILED_KEY] = error
            raise
    pgstores.configure(server.conninfo if server is not None else value, server=server)


def _in_corpus(config: pytest.Config, path: Path) -> bool:
    corpora = config.stash.get(_CORPUS_KEY, [])
    resolved = path.resolve()
    return any(resolved.parent == corpus or corpus in resolved.parents for corpus in corpora)


def pytest_collect_file(file_path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    if file_path.suffix == ".json" and _in_corpus(parent.config, file_path):
        collector: pytest.Collector = TraceFile.from_parent(parent, path=file_path)
        return collector
    return None


_EMPTY_KEY = pytest.StashKey[list[Path]]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Note each --faultlab-corpus from which no trace was collected (said at the end)."""
    corpora = config.stash.get(_CORPUS_KEY, [])
    traces = [item.path.resolve() for item in items if isinstance(item, TraceItem)]
    config.stash[_EMPTY_KEY] = [corpus for corpus in corpora if not any(
        corpus == path.parent or corpus in path.parents for path in traces)]


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    """A corpus that gave no regression test says so: a green run must not suggest that
    its findings were replayed (a corpus with nothing in it yet is a run of nothing; a
    flaky trace is collected and shown as skipped, with its reason)."""
    for corpus in config.stash.get(_EMPTY_KEY, []):
        terminalreporter.write_line(
            f"faultlab: --faultlab-corpus {corpus} gave no trace to replay: no regression "
            "test ran from it", yellow=True)


def _spawner(config: pytest.Config) -> Any:
    """One spawner (fork server) for every replay of the session, closed at the end."""
    stack = config.stash.get(_SPAWNER_KEY, None)
    if stack is None:
        from faultlab.process.spawn import spawner

        stack = contextlib.ExitStack()
        config.stash[_SPAWNER_KEY] = stack
        config.stash[_RUNNER_KEY] = stack.enter_context(
            spawner(config.getoption("faultlab_spawn"))
        )
    return config.stash[_RUNNER_KEY]


_RUNNER_KEY = pytest.StashKey[Any]()


class TraceMismatch(Exception):
    """A replay whose outcome differs from its recording; the message is the replay table."""


class TraceFile(pytest.File):
    """A corpus file: one item."""

    def collect(self) -> Iterator[pytest.Item]:
        yield TraceItem.from_parent(self, name=self.path.name)


def _system_for(config: pytest.Config, trace: Any, trace_path: Path) -> Any:
    """The system a corpus trace runs on: ``--faultlab-system`` if given, else by the rule
    ``faultlab replay`` follows (:func:`faultlab.corpus.trust.system_for`)."""
    from faultlab.corpus.trust import system_for
    from faultlab.system import load_system

    named = config.getoption("faultlab_system")
    return system_for(
        trace_path, trace, load_system(named) if named else None,
        how=lambda system: f"pytest --faultlab-corpus {trace_path.parent} "
                           f"--faultlab-system {system}")


class TraceItem(pytest.Item):
    """Replay one trace on fresh stores; pass when the verdict matches the recording."""

    def runtest(self) -> None:
        from faultlab.corpus.replay import plan, replay
        from faultlab.trace import EXPECT_FLAKY, Trace

        trace = Trace.load(self.path)
        if trace.expect == EXPECT_FLAKY:  # kept for inspection: never a regression test
            pytest.skip("a flaky trace (it did not fail again when re-run): not a test")
        system = _system_for(self.config, trace, self.path)
        if getattr(system, "store_kind", None) == "postgres":
            _use_postgres(self.config)
        planned = plan(self.path, trace, system)
        outcome = replay(planned, _spawner(self.config),
                         deadline=self.config.getoption("faultlab_deadline"))
        if not outcome.matches:
            raise TraceMismatch("\n".join(outcome.lines()))

    def repr_failure(self, excinfo: pytest.ExceptionInfo[BaseException],
                     style: Any = None) -> str | Any:
        if isinstance(excinfo.value, (TraceMismatch, UsageError, ExecutionError)):
            text = str(excinfo.value)
            if "--postgres private" in text and self.config.getoption("faultlab_postgres") is None:
                text += " (under pytest: --faultlab-postgres private)"
            return text
        return super().repr_failure(excinfo, style=style)

    def reportinfo(self) -> tuple[Path, int | None, str]:
        return self.path, None, f"faultlab replay {self.path.name}"


# --- state-machine tests ----------------------------------------------------------------------


def _machine_of(item: pytest.Item) -> Any:
    """The faultlab state machine behind a TestCase item, or None: a sequential one
    (:class:`~faultlab.search.machine.OutboxMachine`) or a concurrent one
    (:class:`~faultlab.search.schedules.ConcurrentMachine`); both take the same settings."""
    cls = getattr(item, "cls", None)
    run = getattr(cls, "runTest", None) if cls is not None else None
    machine = getattr(run, "_hypothesis_state_machine_class", None)
    if machine is None:
        return None
    from faultlab.search.machine import OutboxMachine
    from faultlab.search.schedules import ConcurrentMachine

    machines = (OutboxMachine, ConcurrentMachine)
    return machine if isinstance(machine, type) and issubclass(machine, machines) else None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    machine = _machine_of(item)
    if machine is None:
        yield
        return
    marker = item.get_closest_marker("faultlab")
    given = dict(marker.kwargs) if marker is not None else {}
    if marker is not None and marker.args:
        pytest.fail("@pytest.mark.faultlab takes keyword arguments only (examples=, seed=, "
                    f"steps=), not {marker.args[0]!r}", pytrace=False)
    unknown = sorted(set(given) - {"examples", "seed", "steps"})
    if unknown:
        pytest.fail(f"@pytest.mark.faultlab: unknown argument {unknown[0]!r} (examples, seed, "
                    "steps)", pytrace=False)
    for name, value in given.items():
        least = None if name == "seed" else 1
        if isinstance(value, bool) or not isinstance(value, int) or \
                (least is not None and value < least):
            pytest.fail(f"@pytest.mark.faultlab: {name} must be an integer"
                        + ("" if least is None else f" of at least {least}")
                        + f", not {value!r}", pytrace=False)
    examples = given.get("examples", item.config.getoption("faultlab_examples"))
    seed = given.get("seed", item.config.getoption("faultlab_seed"))
    steps = given.get("steps")
    cls = item.cls  # type: ignore[attr-defined]
    original = cls.__dict__.get("settings")
    had_seed = "_hypothesis_internal_use_seed" in machine.__dict__
    old_seed = machine.__dict__.get("_hypothesis_internal_use_seed")
    changes: dict[str, Any] = {}
    if examples is not None:
        changes["max_examples"] = int(examples)
    if steps is not None:
        from faultlab.search.schedules import ConcurrentMachine, scheduled_steps

        # a concurrent machine's opening is one more Hypothesis step, as explore counts
        # it; faultlab.state_machine's TestCase gives its steps to explore, which adds it
        hypothesis_loop = not hasattr(cls, "faultlab_plugin_corpus")
        changes["stateful_step_count"] = scheduled_steps(int(steps)) \
            if issubclass(machine, ConcurrentMachine) and hypothesis_loop else int(steps)
    if changes:
        cls.settings = type(cls.settings)(cls.settings, **changes)
    if seed is not None:
        from hypothesis import seed as hypothesis_seed

        hypothesis_seed(int(seed))(machine)
    corpora = item.config.stash.get(_CORPUS_KEY, [])
    # faultlab.state_machine's TestCase saves a finding where this run replays its corpus
    saves = bool(corpora) and hasattr(cls, "faultlab_plugin_corpus")
    had_corpus = "faultlab_plugin_corpus" in cls.__dict__
    old_corpus = cls.__dict__.get("faultlab_plugin_corpus")
    if saves:
        cls.faultlab_plugin_corpus = corpora[0]
    try:
        yield
    finally:
        if saves:
            if had_corpus:
                cls.faultlab_plugin_corpus = old_corpus
            else:
                del cls.faultlab_plugin_corpus
        if changes:
            if original is None:
                del cls.settings
            else:
                cls.settings = original
        if seed is not None:
            if had_seed:
                machine._hypothesis_internal_use_seed = old_seed
            else:
                del machine._hypothesis_internal_use_seed
