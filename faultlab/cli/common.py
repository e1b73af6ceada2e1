"""What every command shares: the parser class, common options, checks of user input.

Each command is a module of this package with ``register(commands)`` and its
handler; they import these helpers and nothing from each other.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn, TypeAlias

from faultlab import system as registry
from faultlab.base import output
from faultlab.base.errors import EXIT_FLAKY, EXIT_VACUOUS, UsageError
from faultlab.base.inputs import MAX_CONCURRENCY, MAX_INT_DIGITS
from faultlab.process.records import DEFAULT_DEADLINE, SPAWN_MODES
from faultlab.system.contract import System

#: The object ``add_subparsers`` returns: each command module registers itself on it.
Commands: TypeAlias = "argparse._SubParsersAction[Parser]"


EPILOG = """exit status:
  0        clean: nothing found
  1        a finding: an invariant failed
  2        bad input (one line on stderr; nothing created or changed)
  3        the run itself failed (a worker missed its deadline or broke the announcement
           protocol, a store could not be read, the system's own error); nothing reported
  130/143  interrupted by SIGINT/SIGTERM: workers ended, run directories removed,
           nothing reported or saved"""

_OUTCOMES = "0        clean: nothing found\n  1        a finding: an invariant failed"

#: Commands that judge nothing (init, systems, corpus): no finding, so no exit 1.
TOOL_EPILOG = EPILOG.replace(_OUTCOMES + "\n", "0        done\n").replace(
    "the run itself failed (a worker missed its deadline or broke the announcement\n"
    "           protocol, a store could not be read, the system's own error); nothing reported",
    "the command itself failed (one line on stderr)",
).replace("workers ended, run directories removed,\n           nothing reported or saved",
          "nothing left half-written")

SUITE_EPILOG = EPILOG.replace(
    _OUTCOMES,
    "0        every scenario and the exploration phase passed\n"
    "  1        a scenario check failed, or the exploration phase did not pass",
)

MUTANTS_EPILOG = EPILOG.replace(
    _OUTCOMES,
    "0        the reference is clean and every mutant is caught (by both searches, or by\n"
    "           explore alone where enumerate cannot express it); a row that could not be\n"
    "           judged here says why\n"
    "  1        a mutant was missed, or the reference was not clean",
)

REPLAY_EPILOG = EPILOG.replace(
    _OUTCOMES,
    "0        every outcome matches: an expected finding (\"expect\": \"finding\") shows as\n"
    "           recorded, a regression test (no \"expect\") replays clean: its bug is fixed\n"
    "  1        an outcome differs: a regression test still fails, an expected finding\n"
    "           did not show as recorded, or a flaky trace failed again",
).replace("  130/143",
          "  5        a flaky trace (\"expect\": \"flaky\") did not fail again, and no\n"
          "           outcome differs\n  130/143")


#: The searches' exit statuses (explore, enumerate): every command's, 4 for a run that
#: tested nothing and 5 for a failure that did not fail again.
SEARCH_EPILOG = EPILOG.replace("  130/143", f"""\
  {EXIT_VACUOUS}        vacuous: nothing failed, but nothing was tested (no operation was ever
           accepted, an invariant family never had anything to check, --power-loss
           took no power cut, the declared crash points were armed and never fired,
           or --concurrency workers never overlapped); one line says which
  {EXIT_FLAKY}        flaky: an invariant failed, but not again when its trace was re-run;
           nothing saved to the corpus, the trace kept in flaky/ beside it (one line
           names the file)
  130/143""")

#: The program's own --help: every status any command returns.
PROGRAM_EPILOG = SEARCH_EPILOG.replace(
    "  130/143",
    "  141      the output went into a closed pipe (as in: faultlab systems | head -1)\n"
    "  130/143",
)


class _Formatter(argparse.HelpFormatter):
    """Wraps descriptions as usual but keeps an epilog's table of exit statuses as written."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("exit status:"):
            return text
        return super()._fill_text(text, width, indent)


class Parser(argparse.ArgumentParser):
    """argparse, but bad input is one line on stderr and exit status 2; every command's
    --help ends with the exit statuses."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", _Formatter)
        kwargs.setdefault("epilog", EPILOG)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        # main() prints "faultlab: error: "; name the subcommand, not the program twice
        command = self.prog.removeprefix("faultlab").strip()
        raise UsageError(f"{command + ': ' if command else ''}{message} (see --help)")


def _formats() -> list[str]:
    from tabulate import tabulate_formats

    return list(tabulate_formats)


def add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format", default="simple", metavar="FMT",
        help="table format, passed to tabulate's tablefmt: simple (default), plain, github, "
             "grid, pipe, ...",
    )


def add_system(parser: argparse.ArgumentParser, *, dedup: bool = True) -> None:
    parser.add_argument(
        "--system", default="reference", metavar="NAME",
        help="system under test: a built-in name (reference, or a bug-zoo mutant; see "
             "`faultlab systems`), package.module:attribute, or path/to/system.json",
    )
    add_postgres(parser)
    if dedup:
        parser.add_argument(
            "--no-deduplication", dest="deduplication", action="store_false",
            help="switch the receiver's deduplication off (the negative control)",
        )


#: ``--postgres private``: faultlab starts a server of its own for the run.
PRIVATE_POSTGRES = "private"


def add_postgres(parser: argparse.ArgumentParser) -> None:
    """``--postgres DSN|private``: applied by ``main`` before the command runs."""
    parser.add_argument(
        "--postgres", metavar="DSN|private",
        help="PostgreSQL server for systems with PostgreSQL stores (reference-pg, ...): a "
             "libpq connection string or URI; default: libpq's environment (PGHOST, PGPORT, "
             "PGUSER, ...). faultlab creates and drops its own marked databases there. "
             "'private' starts faultlab's own server for this run instead (initdb into a "
             "RAM directory, its own socket, no network; about 1 s to start; run as the "
             "machine's postgres user when faultlab runs as root), stopped and removed when "
             "the run ends, fails or is interrupted. Only a private server can be crashed: "
             "with it explore draws server_crash steps (the whole server SIGKILLed between "
             "two steps, then restarted through crash recovery) for a system whose stores "
             "are on PostgreSQL, and replay runs them; without it a trace with one is "
             "refused",
    )


def add_spawn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spawn", choices=SPAWN_MODES, default="fork",
        help="how workers start: fork (default; a fork server forks one child per worker) or "
             "exec (a fresh interpreter per worker, python -m faultlab worker)",
    )
    parser.add_argument(
        "--deadline", type=positive_float, default=DEFAULT_DEADLINE, metavar="SECONDS",
        help=f"kill a worker that runs longer than this (default {DEFAULT_DEADLINE:g})",
    )


def positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def int_at_least(minimum: int | None) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum`` (None: any), of at most
    :data:`~faultlab.base.inputs.MAX_INT_DIGITS` digits, since a finding records its
    ``--seed`` and ``--examples`` and a trace file with a longer integer is refused."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text[:40]!r}") from None
        if len(str(abs(value))) > MAX_INT_DIGITS:
            raise argparse.ArgumentTypeError(
                f"an integer of at most {MAX_INT_DIGITS} digits, not {len(str(abs(value)))}")
        if minimum is not None and value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}: {text!r}")
        return value

    return parse


positive_int = int_at_least(1)
#: ``--seed``: any integer a trace file can record.
seed_int = int_at_least(None)
count = int_at_least(0)


def check_format(fmt: str) -> None:
    if fmt not in _formats():
        raise UsageError(f"unknown --format {fmt!r} (one of: {', '.join(_formats())})")


def check_output_path(path: Path, option: str, kind: output.Kind) -> None:
    """Refuse an output path we could not write or must not replace (an existing file that
    is not faultlab's own output of ``kind``), before running anything
    (:mod:`faultlab.base.output`)."""
    output.check_output_file(path, option, kind)


def add_html(parser: argparse.ArgumentParser, help_text: str) -> None:
    """``--html FILE``: a self-contained page of the executed traces (faultlab.report.html)."""
    parser.add_argument("--html", type=Path, metavar="FILE",
                        help=help_text + " (an existing FILE is replaced only if it is a "
                                         "faultlab HTML page; written atomically; no network "
                                         "fetches)")


def check_new_directory(path: Path, option: str = "--directory") -> None:
    output.check_new_directory(path, option)


def refuse_unused_postgres(system: System, postgres: str | None) -> None:
    """``--postgres`` names the server of a system's PostgreSQL stores; with a system whose
    stores are SQLite files it would change nothing, so it is a mistake (say, the wrong
    ``--system``) worth one line rather than a run that silently ignores it."""
    if postgres is not None and system.store_kind != "postgres":
        raise UsageError(f"--postgres: system {system.name!r} keeps its stores in SQLite "
                         "files, not PostgreSQL; drop --postgres or name a PostgreSQL system")


def load_system(ref: str, deduplication: bool = True, *, drawn: bool = True) -> System:
    """Load the system named on the command line; refuse an impossible --no-deduplication,
    and (``drawn``: a command that draws payloads and ids) a declared payload schema or id
    pattern nothing can be drawn from (before any store, corpus or job exists).

    The worker command is given its payload: it passes ``drawn=False`` and so never
    imports Hypothesis, which would cost an exec-mode worker tens of milliseconds a step."""
    system = registry.load_system(ref)
    system.require_deduplication_switch(deduplication)
    if drawn:
        from faultlab.search.data import check_declared

        check_declared(system)
    return system


#: The most job processes ``--jobs`` starts: each is an interpreter with its own fork server
#: (100000 once started ~160 processes and then failed with tracebacks).
MAX_JOBS = 64


def jobs(text: str) -> int:
    """An argparse type for ``--jobs``: 1 to :data:`MAX_JOBS`."""
    value = int_at_least(1)(text)
    if value > MAX_JOBS:
        raise argparse.ArgumentTypeError(f"at most {MAX_JOBS}: {text!r}")
    return value


def concurrency(text: str) -> int:
    """An argparse type for ``--concurrency``: 1 to :data:`MAX_CONCURRENCY`."""
    value = int_at_least(1)(text)
    if value > MAX_CONCURRENCY:
        raise argparse.ArgumentTypeError(f"at most {MAX_CONCURRENCY}: {text!r}")
    return value
