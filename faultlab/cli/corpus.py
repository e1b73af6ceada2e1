"""``corpus export`` and ``corpus status``: a shared (Redis) corpus as files, and as a table."""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from faultlab.base.errors import EXIT_OK, UsageError
from faultlab.cli.common import TOOL_EPILOG, Commands, add_format, check_format


def register(commands: Commands) -> None:
    corpus = commands.add_parser(
        "corpus", help="export a shared corpus as trace files, or show its findings and shards",
        description="A Redis corpus (explore --corpus redis://HOST:PORT/DB) holds the findings "
                    "of every shard, deduplicated by trace content, and live counters per "
                    "shard. Exit 0 on success, 2 on bad input (an unreachable server, a "
                    "database that is not a faultlab corpus).",
        epilog=TOOL_EPILOG,
    )
    actions = corpus.add_subparsers(dest="corpus_command", metavar="ACTION",
                                   parser_class=type(corpus))
    export = actions.add_parser(
        "export", help="write every finding as an ordinary trace file (replayable)",
        description="Write each finding of SOURCE into DIR as <system>-<INVARIANT>-<hash>.json, "
                    "the files explore writes to a directory corpus; `faultlab replay` runs "
                    "them. A file of the same name (the same trace) is left alone.",
        epilog=TOOL_EPILOG,
    )
    export.add_argument("source", metavar="SOURCE", help="redis://HOST:PORT/DB")
    export.add_argument("directory", type=Path, metavar="DIR",
                        help="where the trace files go (created when needed)")
    export.set_defaults(handler=cmd_export)
    status = actions.add_parser(
        "status", help="the cluster table: counters per shard, and the findings",
        description="One row per shard (state, examples, steps, SIGKILLs, findings, seconds, "
                    "seconds since its last update) and one per finding.",
        epilog=TOOL_EPILOG,
    )
    status.add_argument("source", metavar="SOURCE", help="redis://HOST:PORT/DB")
    add_format(status)
    status.set_defaults(handler=cmd_status)
    corpus.set_defaults(handler=_no_action)


def _no_action(args: argparse.Namespace) -> int:
    raise UsageError("corpus needs an action: export SOURCE DIR, or status SOURCE")


def _open(source: str) -> Any:
    from faultlab.corpus.redis_store import RedisCorpus, is_redis_url

    if not is_redis_url(source):
        raise UsageError(f"SOURCE {source!r}: expected redis://HOST:PORT/DB")
    return RedisCorpus(source, create=False)


def cmd_export(args: argparse.Namespace) -> int:
    from faultlab.base.output import check_output_directory
    from faultlab.corpus.redis_store import export

    # where the directory cannot be made (under a file, in /proc): one line, nothing made
    check_output_directory(args.directory, "corpus export DIR")
    corpus = _open(args.source)
    try:
        written, present = export(corpus, args.directory)
    finally:
        corpus.close()
    for path in written:
        print(f"wrote {path}")
    print(f"{len(written)} traces written to {args.directory}"
          + (f", {len(present)} already there" if present else ""))
    return EXIT_OK


def cmd_status(args: argparse.Namespace) -> int:
    from faultlab.report import tables as report

    check_format(args.format)
    corpus = _open(args.source)
    try:  # both checked whole (numbers, trace documents) before anything is printed
        counters = corpus.counters()
        findings = corpus.traces()
    finally:
        corpus.close()
    now = time.time()
    rows = []
    for shard, fields in counters.items():
        updated = fields.get("updated")
        age = f"{now - float(updated):.0f}" if updated else "-"
        rows.append([shard, fields.get("system", "-"), fields.get("seed", "-"),
                     fields.get("state", "-"), fields.get("examples", "0"),
                     fields.get("steps", "0"), fields.get("sigkills", "0"),
                     fields.get("findings", "0"), fields.get("seconds", "-"), age])
    print(report.table(rows, ["shard", "system", "seed", "state", "examples", "steps",
                              "SIGKILLs", "findings", "seconds", "updated (s ago)"],
                       args.format))
    print()
    finding_rows = []
    for name, trace in findings.items():
        invariants = "+".join(trace.expected.invariants) if trace.expected else ""
        finding_rows.append([name, trace.system, invariants, len(trace.steps),
                             trace.meta.get("shard", "-"), trace.meta.get("seed", "-")])
    print(report.table(finding_rows, ["finding", "system", "invariants", "steps", "shard",
                                      "round seed"], args.format))
    total = sum(int(float(fields.get("steps", "0"))) for fields in counters.values())
    print(f"\n{len(counters)} shards, {total} steps, {len(findings)} distinct findings "
          f"in {corpus.address}")
    return EXIT_OK
