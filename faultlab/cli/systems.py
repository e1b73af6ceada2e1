"""``systems``: the built-in systems, or one system's crash points."""

from __future__ import annotations

import argparse

from faultlab.base.errors import EXIT_OK
from faultlab.cli.common import TOOL_EPILOG, Commands, add_format, check_format, positive_float


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "systems", help="list systems, or one system's crash points",
        description="Without --system: every built-in system. With --system: its crash points "
                    "and the outcome a correct system shows at each.",
        epilog=TOOL_EPILOG,
    )
    parser.add_argument("--system", metavar="SYSTEM",
                        help="show this system's crash points instead of the list: a built-in "
                             "name, package.module:attribute or path/to/system.json")
    parser.add_argument(
        "--deadline", type=positive_float, default=15.0, metavar="SECONDS",
        help="kill a command-line system's init (run once to check the system file) that runs "
             "longer than this (default 15)",
    )
    add_format(parser)
    parser.set_defaults(handler=cmd_systems)


def cmd_systems(args: argparse.Namespace) -> int:
    from faultlab.report import tables as report
    from faultlab.system import load_system

    check_format(args.format)
    if args.system is not None:
        system = load_system(args.system)
        rows = [[p.name, p.role, p.expected] for p in system.crash_points]
        print(f"{system.name}: {system.description}")
        print(report.table(rows, ["crash point", "role", "expected outcome"], args.format))
        return EXIT_OK
    from faultlab.system.builtin import registry  # every built-in, listed without psycopg

    rows = [[cls.name, str(len(cls.crash_points)), registry.needs(cls),
             cls.description + (" (PostgreSQL)" if registry.on_postgres(cls) else "")]
            for cls in registry.BUILTINS]
    print(report.table(rows, ["system", "crash points", "needs", "description"], args.format))
    return EXIT_OK
