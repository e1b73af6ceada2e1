"""Command line: ``python -m faultlab COMMAND``.

Heavy imports (hypothesis, tabulate) happen inside the commands that need them,
so an exec-mode worker (``python -m faultlab worker ...``) starts quickly.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from faultlab import __version__
from faultlab.errors import ExecutionError, UsageError

EXIT_OK, EXIT_FOUND, EXIT_USAGE = 0, 1, 2


class _Parser(argparse.ArgumentParser):
    """argparse, but bad input is one line on stderr and exit status 2."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{self.prog}: {message} (see --help)")


def _formats() -> list[str]:
    from tabulate import tabulate_formats

    return list(tabulate_formats)


def _add_format(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--format", default="simple", metavar="FMT",
        help="table format, passed to tabulate's tablefmt: simple (default), plain, github, "
             "grid, pipe, ...",
    )


def _add_system(parser: argparse.ArgumentParser, *, dedup: bool = True) -> None:
    parser.add_argument(
        "--system", default="reference", metavar="NAME",
        help="system under test: a built-in name (reference, or a bug-zoo mutant; see "
             "`faultlab systems`), package.module:attribute, or path/to/system.json",
    )
    if dedup:
        parser.add_argument(
            "--no-deduplication", dest="deduplication", action="store_false",
            help="switch the receiver's deduplication off (the negative control)",
        )


def _add_spawn(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--spawn", choices=("fork", "exec"), default="fork",
        help="how workers start: fork (default; a fork server forks one child per worker) or "
             "exec (a fresh interpreter per worker, python -m faultlab worker)",
    )
    parser.add_argument(
        "--deadline", type=_positive_float, default=15.0, metavar="SECONDS",
        help="kill a worker that runs longer than this (default 15)",
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0 or value != value or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number: {text!r}")
    return value


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}: {text!r}")
        return value

    return parse


_positive_int = int_at_least(1)


def check_format(fmt: str) -> None:
    if fmt not in _formats():
        raise UsageError(f"unknown --format {fmt!r} (one of: {', '.join(_formats())})")


def check_output_path(path: Path) -> None:
    """Refuse an output path we could not write, before running anything."""
    if path.is_dir():
        raise UsageError(f"--output {path}: is a directory")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"--output {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UsageError(f"--output {path}: not writable")


def check_new_directory(path: Path, option: str = "--directory") -> None:
    if path.exists() or path.is_symlink():
        raise UsageError(f"{option} {path}: already exists; give a path that does not exist")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{option} {path}: parent directory {parent} is not writable")


def _load_system(ref: str, deduplication: bool = True) -> Any:
    from faultlab.system import load_system

    system = load_system(ref)
    if not deduplication and not system.supports_no_deduplication:
        raise UsageError(f"system {ref!r} cannot switch deduplication off")
    return system


# --- suite -------------------------------------------------------------------------------------


def cmd_suite(args: argparse.Namespace) -> int:
    from faultlab import report
    from faultlab.process import spawner
    from faultlab.scenarios import SCENARIOS
    from faultlab.trace import write_json_atomically

    check_format(args.format)
    system = _load_system(args.system)
    if args.output is not None:
        check_output_path(args.output)
    if args.directory is not None:
        check_new_directory(args.directory)
    exploration = None
    outcomes = []
    started = time.perf_counter()
    with spawner(args.spawn) as runner:
        if args.directory is not None:
            args.directory.mkdir()
        for scenario in SCENARIOS:
            directory = args.directory / scenario.name if args.directory is not None else None
            began = time.perf_counter()
            outcome = scenario.run(system, runner, directory)
            outcome.seconds = time.perf_counter() - began
            outcomes.append(outcome)
        scenario_seconds = time.perf_counter() - started
        if args.examples > 0 and _explore_available():
            exploration = _suite_exploration(args, system, runner)
    seconds = time.perf_counter() - started
    print(report.scenario_table(outcomes, args.format))
    print()
    for line in report.summary_lines(outcomes):
        print(line)
    failed = [o for o in outcomes if not o.passed]
    for outcome in failed:
        for failure in outcome.failures:
            print(f"FAIL: {outcome.name}: {failure}")
    if exploration is not None:
        for line in exploration["lines"]:
            print(line)
    passed = not failed and (exploration is None or exploration["passed"])
    if passed:
        print(report.PASS_LINE)
    if args.output is not None:
        data = report.evidence(outcomes, spawn=args.spawn, seconds=seconds)
        data["timings"]["scenarios_seconds"] = round(scenario_seconds, 4)
        if exploration is not None:
            data["exploration"] = exploration["evidence"]
            data["passed"] = data["passed"] and exploration["passed"]
        write_json_atomically(args.output, data)
    return EXIT_OK if passed else EXIT_FOUND


def _explore_available() -> bool:
    try:
        import faultlab.explore  # noqa: F401
    except ImportError:
        return False
    return True


def _suite_exploration(args: argparse.Namespace, system: Any, runner: Any) -> dict[str, Any]:
    from faultlab.explore import suite_exploration

    result: dict[str, Any] = suite_exploration(
        system, runner, examples=args.examples, seed=args.seed, deadline=args.deadline,
    )
    return result


# --- worker ------------------------------------------------------------------------------------


def cmd_worker(args: argparse.Namespace) -> int:
    from faultlab.canonical import parse_payload
    from faultlab.records import WorkerSpec
    from faultlab.system.contract import check_crash_point
    from faultlab.worker import run_worker

    system = _load_system(args.system, args.deduplication)
    directory = Path(args.directory)
    if not directory.is_dir():
        raise UsageError(f"--directory {directory}: no such directory")
    payload = None
    if args.role in ("accept", "service"):
        if args.payload is None:
            raise UsageError(f"worker {args.role}: --payload is required")
        if args.operation_id is None:
            raise UsageError(f"worker {args.role}: --operation-id is required")
        payload = parse_payload(args.payload)
    check_crash_point(system, args.role, args.crash)
    spec = WorkerSpec(
        system=args.system, role=args.role, directory=str(directory),
        operation_id=args.operation_id, payload=payload, crash=args.crash,
        deduplication=args.deduplication, spawn=args.spawn, deadline=args.deadline,
    )
    return run_worker(spec)


# --- systems -----------------------------------------------------------------------------------


def cmd_systems(args: argparse.Namespace) -> int:
    from faultlab import report
    from faultlab.system import builtin_names, load_system

    check_format(args.format)
    if args.system is not None:
        system = load_system(args.system)
        rows = [[p.name, p.role, p.expected] for p in system.crash_points]
        print(f"{system.name}: {system.description}")
        print(report.table(rows, ["crash point", "role", "expected outcome"], args.format))
        return EXIT_OK
    rows = []
    for name in builtin_names():
        system = load_system(name)
        rows.append([name, str(len(system.crash_points)), system.description])
    print(report.table(rows, ["system", "crash points", "description"], args.format))
    return EXIT_OK


# --- parser ------------------------------------------------------------------------------------

Command = Callable[[argparse.Namespace], int]


def build_parser(*, extensions: bool = True) -> argparse.ArgumentParser:
    parser = _Parser(
        prog="faultlab",
        description="Property-based crash testing for two-store outbox workers: real "
                    "processes, real SIGKILL, real SQLite stores.",
    )
    parser.add_argument("--version", action="version", version=f"faultlab {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    suite = commands.add_parser(
        "suite", help="run the five regression scenarios (and a short exploration)",
        description="Run the five regression scenarios of the seed lab on fresh stores, print "
                    "a table and the seed's summary lines, then explore the system (fixed seed) "
                    "and run the negative control. Exit 0 when everything passes, 1 when a "
                    "check fails, 2 on bad input.",
    )
    _add_system(suite, dedup=False)
    suite.add_argument("--output", type=Path, metavar="FILE",
                       help="write the evidence JSON here (overwritten; written atomically)")
    suite.add_argument("--directory", type=Path, metavar="DIR",
                       help="keep each scenario's stores under DIR/<scenario>/ (DIR must not "
                            "exist)")
    suite.add_argument("--examples", type=int, default=50, metavar="N",
                       help="examples the exploration phase must complete (default 50; 0 skips "
                            "it); ones Hypothesis abandons partway come on top")
    suite.add_argument("--seed", type=int, default=0, metavar="S",
                       help="seed for the exploration phase (default 0)")
    _add_spawn(suite)
    _add_format(suite)
    suite.set_defaults(handler=cmd_suite)

    worker = commands.add_parser(
        "worker", help="run one worker role in this process (what exec mode spawns)",
        description="Run one worker role against an existing directory whose stores faultlab "
                    "initialised. Prints one JSON response line. Exit 0 on success, 3 "
                    "payload_conflict, 4 downstream_failure, 2 bad input, -9 when a crash "
                    "point fires.",
    )
    worker.add_argument("role", choices=("accept", "dispatch", "service"))
    worker.add_argument("--directory", required=True, metavar="DIR")
    worker.add_argument("--operation-id", metavar="ID")
    worker.add_argument("--payload", metavar="JSON")
    worker.add_argument("--crash", metavar="POINT",
                        help="arm a crash point: a declared name, sql:K or commit:K")
    _add_system(worker)
    _add_spawn(worker)
    worker.set_defaults(handler=cmd_worker)

    systems = commands.add_parser(
        "systems", help="list systems, or one system's crash points",
        description="Without --system: every built-in system. With --system: its crash points "
                    "and the outcome a correct system shows at each.",
    )
    systems.add_argument("--system", metavar="NAME")
    _add_format(systems)
    systems.set_defaults(handler=cmd_systems)

    if extensions:
        for register in _extensions():
            register(commands)
    return parser


def _extensions() -> list[Callable[[Any], None]]:
    """Commands defined beside their machinery (explore, replay, enumerate, mutants)."""
    registrars = []
    for module_name in ("faultlab.explore_cli", "faultlab.enumerate_cli", "faultlab.mutants_cli"):
        try:
            module = __import__(module_name, fromlist=["register"])
        except ModuleNotFoundError as error:
            if error.name != module_name:
                raise
            continue
        registrars.append(module.register)
    return registrars


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        # an exec-mode worker is started per step: skip importing the other commands
        parser = build_parser(extensions=not argv or argv[0] != "worker")
        args = parser.parse_args(argv)
        if args.command is None:
            raise UsageError(
                "no command given (one of: suite, explore, replay, enumerate, mutants, systems, "
                "worker; see --help)"
            )
        result: int = args.handler(args)
        return result
    except UsageError as error:
        print(f"faultlab: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ExecutionError as error:
        print(f"faultlab: {error}", file=sys.stderr)
        return EXIT_FOUND
    except KeyboardInterrupt:
        print("faultlab: interrupted", file=sys.stderr)
        return 130
