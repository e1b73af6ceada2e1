"""What a PostgreSQL trace costs beside an SQLite one, measured in one run.

    python bench/postgres.py [--traces N] [--postgres DSN] [--output FILE]

It measures, against the server libpq's environment (or ``--postgres``) names:

* per-trace database setup: the milliseconds ``System.initialise`` takes for
  ``reference-pg`` (two databases) with the background pool of pre-cloned
  databases, and without it (each ``CREATE DATABASE ... TEMPLATE`` on the clock),
  beside ``reference`` (two SQLite files); setups are 0.3 s apart (about one
  trace), the time the pool has to refill;
* steps per second: the same fixed traces (accept, a crashing dispatch, the
  recovery, an idle dispatch; every invariant checked after each step) run on
  ``reference`` and on ``reference-pg``, alternating, in fork mode, setup and
  teardown included.

Exit status 0, or 2 when no server answers. Every database it created is dropped.
"""

from __future__ import annotations

import argparse
import platform
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

# this checkout's faultlab, never an installed copy (a tox environment holds a wheel of
# whatever was built when it was made): a benchmark measures the code beside it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from faultlab import __version__
from faultlab.base import output  # noqa: E402
from faultlab.base.errors import UsageError  # noqa: E402
from faultlab.base.output import Kind  # noqa: E402
from faultlab.process.spawn import Spawner, spawner  # noqa: E402
from faultlab.run.executor import execute  # noqa: E402
from faultlab.stores import postgres as pgstores  # noqa: E402
from faultlab.stores.sqlite import scratch_directory  # noqa: E402
from faultlab.system import System, load_system  # noqa: E402
from faultlab.trace import Step  # noqa: E402

PAYLOAD = {"title": "bench", "count": 1}
POINTS = ("before_dispatch", "after_downstream_commit", "during_completion")


#: the pause between setups: about one trace of five PostgreSQL steps, during which the
#: background pool refills (back to back, setups would only measure the pool running dry)
PAUSE = 0.3


def _setup_ms(system: System, traces: int, pause: float = 0.0) -> list[float]:
    times = []
    for _ in range(traces):
        time.sleep(pause)
        with tempfile.TemporaryDirectory(prefix="faultlab-bench-", dir=scratch_directory()) as d:
            started = time.perf_counter()
            system.initialise(Path(d))
            times.append((time.perf_counter() - started) * 1000)
            system.release(Path(d))
    return times


def _trace(point: str) -> list[Step]:
    return [Step("accept", "op-1", PAYLOAD), Step("dispatch", crash=point), Step("dispatch"),
            Step("dispatch")]


def _steps_per_second(system: System, runner: Spawner, traces: int) -> tuple[float, int, float]:
    steps = 0
    started = time.perf_counter()
    for index in range(traces):
        execution = execute(system, _trace(POINTS[index % len(POINTS)]), runner)
        if not execution.verdict.clean:
            raise SystemExit(f"bench: {system.name} trace not clean: {execution.verdict}")
        steps += len(execution.observations)
    seconds = time.perf_counter() - started
    return steps / seconds, steps, seconds


#: What ``--output`` writes, recognised by its first keys (the form before it named the
#: bench too), so a re-run replaces only it.
RESULTS = Kind("a bench/postgres.py results file", (
    re.compile(rb'\{\s*"benchmark": "bench/postgres\.py"'),
    re.compile(rb'\{\s*"faultlab": "[^"]*",\s*"postgresql": '),
))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--traces", type=int, default=30, metavar="N",
                        help="traces per system and measurement (default 30)")
    parser.add_argument("--postgres", metavar="DSN",
                        help="libpq connection string (default: libpq's environment)")
    parser.add_argument("--output", type=Path, metavar="FILE", help="also write JSON here")
    args = parser.parse_args(argv)
    if args.traces < 3:
        parser.error("--traces must be at least 3")
    try:
        if args.output is not None:  # replaced only when it is this bench's own output
            output.check_output_file(args.output, "--output", RESULTS)
        pgstores.configure(args.postgres)
        return _run(args)
    except UsageError as error:
        print(f"bench/postgres.py: {error}", file=sys.stderr)
        return 2
    finally:
        pgstores.close_run()


def _run(args: argparse.Namespace) -> int:
    sqlite_system, pg_system = load_system("reference"), load_system("reference-pg")
    run = pgstores.current_run()
    server = run._admin.execute("SHOW server_version").fetchone()
    with tempfile.TemporaryDirectory(prefix="faultlab-bench-warm-") as warm:
        pg_system.initialise(Path(warm))  # the templates, made once for the run
        pg_system.release(Path(warm))
    time.sleep(1)  # let the pool fill before the pooled measurement
    pooled = _setup_ms(pg_system, args.traces, PAUSE)
    pool, run.pool = run.pool, 0
    # without the pool: wait for the background thread to go idle, then measure inline
    while not run._work.empty():
        time.sleep(0.05)
    for template in run._templates.values():  # use up the ready clones first
        while not template.ready.empty():
            run.release(template.ready.get_nowait())
    while not run._work.empty():
        time.sleep(0.05)
    unpooled = _setup_ms(pg_system, args.traces, PAUSE)
    run.pool = pool
    sqlite_setup = _setup_ms(sqlite_system, args.traces)
    rates: dict[str, list[tuple[float, int, float]]] = {"reference": [], "reference-pg": []}
    with spawner("fork") as runner:
        for round_ in range(2):  # alternate which system goes first
            order = (sqlite_system, pg_system) if round_ == 0 else (pg_system, sqlite_system)
            for system in order:
                rates[system.name].append(_steps_per_second(system, runner, args.traces // 2))

    def total(name: str) -> tuple[float, int, float]:
        steps = sum(r[1] for r in rates[name])
        seconds = sum(r[2] for r in rates[name])
        return steps / seconds, steps, seconds

    sqlite_rate, pg_rate = total("reference"), total("reference-pg")
    rows = [
        ["per-trace store setup, median (ms)", f"{statistics.median(sqlite_setup):.2f}",
         f"{statistics.median(pooled):.2f}", f"{statistics.median(unpooled):.2f}"],
        ["per-trace store setup, worst (ms)", f"{max(sqlite_setup):.2f}",
         f"{max(pooled):.2f}", f"{max(unpooled):.2f}"],
        ["steps/s (fork mode, invariants checked)", f"{sqlite_rate[0]:.1f}",
         f"{pg_rate[0]:.1f}", "-"],
        ["steps measured", str(sqlite_rate[1]), str(pg_rate[1]), "-"],
    ]
    print(f"faultlab {__version__}, Python {platform.python_version()}, PostgreSQL "
          f"{server[0] if server else '?'}, {platform.platform()}; {args.traces} traces per "
          "measurement; steps/s over alternating halves")
    print(tabulate(rows, ["median", "reference (SQLite)", "reference-pg (pool)",
                          "reference-pg (no pool)"], tablefmt="github"))
    print(f"PostgreSQL runs {sqlite_rate[0] / pg_rate[0]:.1f}x slower than SQLite per step")
    if args.output is not None:
        data: dict[str, Any] = {
            "benchmark": "bench/postgres.py",
            "faultlab": __version__, "postgresql": server[0] if server else None,
            "setup_ms": {"sqlite": sqlite_setup, "postgres_pool": pooled,
                         "postgres_no_pool": unpooled},
            "steps_per_second": {"sqlite": sqlite_rate[0], "postgres": pg_rate[0]},
        }
        output.write_json(args.output, data, final=True, kind=RESULTS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
