"""Command-line systems whose stores are PostgreSQL databases.

A store declared ``{"kind": "postgres"}`` in the system file is a database
faultlab creates: the system's ``init`` command runs *once per run*, against
empty marked template databases (``{dsn:STORE}`` is each one's libpq connection
string); every trace then gets clones of them (:mod:`faultlab.stores.postgres`). Worker
commands get their trace's databases through the same ``{dsn:STORE}``
placeholders, whose ``application_name`` (``<run>-worker-cmd<N>``, one tag per worker)
lets faultlab see in ``pg_stat_activity`` when a killed worker's backend is gone, and tell
a live lane's backends from an ended worker's. Snapshot queries
run in a ``READ ONLY`` transaction: a query that writes is refused by the server.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Protocol

from faultlab.base.errors import ExecutionError, UsageError
from faultlab.process.records import DEFAULT_DEADLINE
from faultlab.process.spawn import run_command
from faultlab.stores import postgres as pgstores
from faultlab.stores.sqlite import TABLES, Snapshot, StoreError
from faultlab.system.description import COLUMNS, Description


class CommandSystem(Protocol):
    """What this module uses of :class:`faultlab.system.command.CommandSystem`."""

    name: str
    config: Description

    def values(self, directory: Path, operation_id: str | None = None,
               payload: str | None = None) -> dict[str, str]: ...

    def argv(self, role: str, values: Mapping[str, str], *, crash_point: str | None = None,
             deduplication: bool = True) -> list[str]: ...

    def environment(self, values: Mapping[str, str], *, crash_point: str | None = None,
                    deduplication: bool = True) -> dict[str, str]: ...

    def row(self, table: str, row: tuple[Any, ...]) -> tuple[Any, ...]: ...

    @property
    def snapshot_deadline(self) -> float: ...


def dsn_values(directory: Path, tag: str = "cmd") -> dict[str, str]:
    """``{"dsn:STORE": conninfo}`` for the trace in ``directory`` (empty before initialise),
    whose ``application_name`` is ``<run>-worker-<tag>``: one worker's tag
    (:func:`faultlab.stores.postgres.command_worker_tag`) lets a snapshot attribute its
    backends to it while it lives."""
    if not (directory / pgstores.STORES_FILE).is_file():
        return {}
    info = pgstores.stores_info(directory)
    return {
        f"dsn:{store}": pgstores.conninfo_for(
            info.conninfo, dbname=database, application_name=f"{info.application}-worker-{tag}")
        for store, database in info.databases.items()
    }


def initialise(system: CommandSystem, directory: Path, error: type[Exception]) -> None:
    """Clone the system's templates for this trace, building them with ``init`` on first use."""
    run = pgstores.current_run()

    def build(conninfos: dict[str, str]) -> None:
        with tempfile.TemporaryDirectory(prefix="faultlab-init-") as scratch:
            values = {**system.values(Path(scratch)),
                      **{f"dsn:{store}": conninfo for store, conninfo in conninfos.items()}}
            record = run_command(system.argv("init", values), deadline=DEFAULT_DEADLINE,
                                 env=system.environment(values), cwd=scratch)
        if record.exit_code != 0:
            last = (record.stderr.strip().splitlines() or ["no message on stderr"])[-1]
            raise error(f"system {system.name!r}: init command exited {record.exit_code}: "
                        f"{last}")

    keys = run.templates(f"command:{system.config.path.resolve()}",
                         list(system.config.postgres), build)
    pgstores.clone_stores(directory, keys)


def snapshot(system: CommandSystem, directory: Path) -> Snapshot:
    """Wait for the step's backends to end, then run each table's query read-only."""
    pgstores.wait_for_backends(directory)
    by_store: dict[str, dict[str, str]] = {}
    for table in TABLES:
        query = system.config.queries[table]
        by_store.setdefault(query.store, {})[table] = query.sql
    tables: dict[str, Iterable[Iterable[Any]]] = {}
    for store, queries in by_store.items():
        try:
            described = pgstores.query_described(directory, store, queries,
                                                 timeout=system.snapshot_deadline)
        except StoreError as problem:
            raise UsageError(f"system {system.name!r}: store {store}: {problem}") from None
        except ExecutionError as problem:  # a query past its deadline: the run failed (exit 3)
            raise ExecutionError(f"system {system.name!r}: store {store}: {problem}") from None
        for table, (width, rows) in described.items():
            if width != len(COLUMNS[table]):
                raise UsageError(
                    f"system {system.name!r}: the {table} query returns {width} columns, "
                    f"expected {len(COLUMNS[table])} ({', '.join(COLUMNS[table])})"
                )
            tables[table] = [system.row(table, tuple(row)) for row in rows]
    return Snapshot.from_rows(tables)


