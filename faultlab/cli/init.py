"""``init --system S DIR``: create a system's empty stores, for the ``worker`` command by hand.

``faultlab worker`` runs one role against a directory whose stores already exist
(faultlab's own runs make a fresh directory per trace). ``init`` makes such a
directory: it creates DIR (or uses it when it exists and is empty) and runs the
system's own initialisation there, so ``worker accept/dispatch/service
--directory DIR`` can be tried step by step. On failure nothing is left behind.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path

from faultlab.base.errors import EXIT_OK, ExecutionError, UsageError
from faultlab.cli.common import TOOL_EPILOG, Commands, load_system, positive_float


def register(commands: Commands) -> None:
    parser = commands.add_parser(
        "init", help="create a system's empty stores in a directory (for `worker`)",
        description="Create DIR (or use it if it exists and is empty) and initialise the "
                    "system's stores in it, empty, as every trace starts. Then run roles by "
                    "hand: faultlab worker accept --directory DIR --system S --operation-id ID "
                    "--payload JSON. Exit 0 on success, 2 on bad input (nothing is left "
                    "behind).",
        epilog=TOOL_EPILOG,
    )
    parser.add_argument("directory", type=Path, metavar="DIR",
                        help="the directory for the stores: new, or existing and empty")
    parser.add_argument(
        "--system", default="reference", metavar="NAME",
        help="system whose stores to create: a built-in name, package.module:attribute or "
             "path/to/system.json (default reference)",
    )
    parser.add_argument(
        "--deadline", type=positive_float, default=15.0, metavar="SECONDS",
        help="kill a command-line system's init that runs longer than this (default 15)",
    )
    parser.set_defaults(handler=cmd_init)


def _check_directory(path: Path) -> bool:
    """True when DIR must be created; refuses a path that is not a new or empty directory."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        raise UsageError(f"{path}: exists and is not a directory")
    if path.is_dir():
        if any(path.iterdir()):
            raise UsageError(f"{path}: directory is not empty (give a new or empty directory)")
        if not os.access(path, os.W_OK):
            raise UsageError(f"{path}: directory is not writable")
        return False
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UsageError(f"{path}: parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{path}: parent directory {parent} is not writable")
    return True


def cmd_init(args: argparse.Namespace) -> int:
    directory: Path = args.directory
    create = _check_directory(directory)
    system = load_system(args.system)
    if system.store_kind != "sqlite":  # its databases live only as long as one run
        raise UsageError(f"init: system {system.name!r} keeps its stores in "
                         f"{system.store_kind}, dropped when the run ends; try its workers "
                         "through suite, explore or replay")
    if create:
        try:
            directory.mkdir()
        except OSError as error:  # os.access says yes to root, even in /proc
            raise UsageError(f"{directory}: cannot create the directory "
                             f"({error.strerror or error})") from None
    try:
        system.initialise(directory)
    except BaseException as error:  # an interruption too: no half-initialised directory
        if create:
            shutil.rmtree(directory, ignore_errors=True)
        else:
            for child in directory.iterdir():
                shutil.rmtree(child) if child.is_dir() else child.unlink()
        if isinstance(error, (ExecutionError, UsageError, OSError)):
            raise UsageError(f"init {directory}: {error}") from None
        raise
    files = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file())
    print(f"initialised {system.name} in {directory}: {', '.join(files) or 'no files'}")
    print(f"next: python -m faultlab worker accept --directory {directory} --system "
          f"{args.system} --operation-id op-1 --payload '{{\"title\":\"backlog\"}}'")
    return EXIT_OK
