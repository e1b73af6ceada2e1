"""Command line: ``python -m faultlab COMMAND``.

One module of this package per command, each with ``register(commands)`` and its
handler, listed once in :data:`COMMANDS`; shared options and input checks live in
:mod:`faultlab.cli.common`. Adding a command is a new module and one line here.
Heavy imports (hypothesis, tabulate) happen inside the handlers that need them,
so an exec-mode worker (``python -m faultlab worker ...``) starts quickly.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from faultlab.base import interrupt
from faultlab.base.errors import EXIT_RUN_FAILED, EXIT_USAGE, ExecutionError, UsageError
from faultlab.base.messages import printable
from faultlab.base.version import __version__
from faultlab.cli.common import PRIVATE_POSTGRES, PROGRAM_EPILOG, Parser
from faultlab.stores.sqlite import StoreError

if TYPE_CHECKING:
    from faultlab.stores.pgserver import PrivateServer

#: Every command and the module of this package that holds it, in the order ``--help``
#: lists them. A module is imported only when its command is built: an exec-mode worker
#: (started once per step) imports the worker command alone, not the search machinery.
COMMANDS = {
    "suite": "suite",
    "explore": "explore",
    "replay": "replay",
    "enumerate": "enumeration",
    "mutants": "mutants",
    "corpus": "corpus",
    "systems": "systems",
    "init": "init",
    "worker": "worker",
}


def build_parser(*, only: str | None = None) -> argparse.ArgumentParser:
    """The whole command line, or just one command's (``only``: an exec-mode worker)."""
    parser = Parser(
        prog="faultlab",
        description="Property-based crash testing for two-store outbox workers: real "
                    "processes, real SIGKILL, real SQLite or PostgreSQL stores.",
        epilog=PROGRAM_EPILOG,
    )
    parser.add_argument("--version", action="version", version=f"faultlab {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for name, module in COMMANDS.items():
        if only is None or name == only:
            importlib.import_module(f"{__name__}.{module}").register(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command. Without ``argv`` this is the ``faultlab`` program: signal handlers
    stay installed to the end (a signal after the result is decided changes nothing), and
    the process reaps orphans of the workers it kills (a child subreaper)."""
    program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    worker_process = argv[:1] == ["worker"]
    if worker_process:  # a worker is ended by SIGKILL only
        return _run(argv, worker_process)
    if program:
        from faultlab.process.spawn import become_subreaper

        become_subreaper()
    try:
        # every other command stops cleanly on a signal
        with interrupt.handling(restore=not program):
            code = _run(argv, worker_process)
            # a pipe is block-buffered: flush here, where a closed reader is handled,
            # not in the interpreter's final flush, which would print a traceback
            sys.stdout.flush()
            interrupt.finished()  # the outcome is decided and printed
    except interrupt.Interrupted as stopped:
        print(f"faultlab: {stopped}; workers stopped, nothing reported or saved",
              file=sys.stderr)
        code = stopped.exit_code
    except KeyboardInterrupt:
        print("faultlab: interrupted; nothing reported or saved", file=sys.stderr)
        code = 130
    except BrokenPipeError:
        code = _closed_pipe()
    if program and "multiprocessing.resource_tracker" in sys.modules:
        # the exception and its frames are gone, so multiprocessing's semaphores are
        # released: end its resource tracker too, rather than leave it to outlive us.
        # Frames in a reference cycle (an error a library kept, whose frames reach back to
        # run_jobs and its queue) are collected first: a tracker that outlives their
        # semaphores prints a traceback for each one at exit. A run that never loaded the
        # tracker's module started no tracker, and skips the collection (tens of
        # milliseconds at the end of every command, and of every interrupted one).
        import gc

        gc.collect()
        from faultlab.process.spawn import stop_resource_tracker

        stop_resource_tracker()
    return code


def _run(argv: list[str], worker_process: bool) -> int:
    try:
        # an exec-mode worker is started per step: build only its own command line
        parser = build_parser(only="worker" if worker_process else None)
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(
                f"no command given (one of: {', '.join(COMMANDS)}; see --help)"
            )
        if getattr(args, "deadline", None) is not None:
            from faultlab.system.command import set_init_deadline

            set_init_deadline(args.deadline)  # a command-line system's init obeys it too
        if getattr(args, "postgres", None) is not None:
            from faultlab.stores import postgres as pgstores

            dsn, server = _postgres_server(args.postgres)
            pgstores.configure(dsn, server=server)
        if worker_process:
            result: int = args.handler(args)
            return result
        from faultlab.search.storage import private_storage

        with private_storage():  # Hypothesis's files stay out of the user's directory
            result = args.handler(args)
        return result
    except Exception as error:
        # an error that follows a signal is the interruption's doing (a worker killed, or
        # Hypothesis tripping over a KeyboardInterrupt during its own setup): report that
        interrupt.check()
        if isinstance(error, UsageError):
            print(f"faultlab: error: {printable(str(error))}", file=sys.stderr)
            return EXIT_USAGE
        if isinstance(error, (ExecutionError, StoreError)):
            print(f"faultlab: run failed: {printable(str(error))}", file=sys.stderr)
            return EXIT_RUN_FAILED
        raise
    finally:
        _close_postgres()
        _stop_private_server()


#: The status of a program whose reader closed the pipe (what a shell shows for SIGPIPE).
EXIT_CLOSED_PIPE = 128 + 13


def _closed_pipe() -> int:
    """The reader of our output went away (``faultlab systems | head -1``): end quietly.

    Workers were already stopped by the ``with`` blocks the error unwound through. Point
    stdout at /dev/null so the interpreter's final flush does not raise again.
    """
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return EXIT_CLOSED_PIPE


#: The PostgreSQL server this run started for itself (``--postgres private``), if any.
_private_server: list[PrivateServer] = []


def _postgres_server(value: str) -> tuple[str, PrivateServer | None]:
    """``--postgres``'s connection string: as given, or that of a private server started now
    (returned too, so the stores can crash it, move its clock and drop its sessions).

    ``private`` starts faultlab's own cluster for this run (``initdb`` into a RAM
    directory, its own socket, no network): the shared server is never touched, and the
    cluster is stopped and removed when the command ends, fails or is interrupted.
    """
    if value != PRIVATE_POSTGRES:
        return value, None
    from faultlab.stores.pgserver import PrivateServer

    server = PrivateServer()
    _private_server.append(server)  # stopped in _run's finally, whatever happens next
    server.start()
    return server.conninfo, server


def _stop_private_server() -> None:
    while _private_server:
        _private_server.pop().stop()


def _close_postgres() -> None:
    """Drop every PostgreSQL database this run created (only if one was used at all)."""
    pgstores = sys.modules.get("faultlab.stores.postgres")
    if pgstores is None:
        return
    left = pgstores.close_run()
    if left:  # one line, whatever the number
        more = f" (and {len(left) - 1} more)" if len(left) > 1 else ""
        print(f"faultlab: could not drop {left[0]}{more}", file=sys.stderr)
    if pgstores.private_server() is not None:  # stopped next: a later command must not use it
        pgstores.configure(None)
