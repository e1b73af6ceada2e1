"""What one worker process costs in fork mode and in exec mode, measured side by side.

    python bench/spawn.py [--repeat N] [--output FILE]

In one run, with the two modes interleaved (alternating which goes first on
each repetition, so machine noise hits both alike), it measures:

* the median milliseconds per worker process, as seen by the caller of
  ``Spawner.run``, for (a) a worker that commits one transaction (an accept of a
  fresh operation id on the reference system) and (b) a worker that SIGKILLs
  itself (an accept armed with ``during_accept``);
* the floor: a bare ``os.fork()`` + ``os.waitpid()`` from this process;
* the CPU time one fork-mode worker costs, summed over every process involved
  (this one, the fork server, the worker and the spare prepared for the next),
  and the share of all CPUs that keeps busy: near 100% means fork mode is
  CPU-bound here, so work moved off the clock (into the spare) still costs;
* the wall time of the five regression scenarios run in this process, spawner
  start-up (the fork server) included, interpreter start-up excluded.

It prints a table with the ratios exec/fork and whether the targets hold:
fork-mode worker <= 5 ms median, >= 10x faster than exec per process, and the
five scenarios >= 8x faster in fork mode. Exit status 0 when they all hold, 1
when one does not, 2 on bad options. Every temporary directory is removed.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import sqlite3
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# this checkout's faultlab, never an installed copy (a tox environment holds a wheel of
# whatever was built when it was made): a benchmark measures the code beside it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from faultlab import __version__  # noqa: E402
from faultlab.base import output  # noqa: E402
from faultlab.base.errors import UsageError  # noqa: E402
from faultlab.base.output import Kind  # noqa: E402
from faultlab.process.records import SPAWN_MODES, SpawnMode, WorkerSpec  # noqa: E402
from faultlab.process.spawn import Spawner, spawner  # noqa: E402
from faultlab.stores.sqlite import scratch_directory  # noqa: E402
from faultlab.system import System, load_system  # noqa: E402
from faultlab.trials.scenarios import SCENARIOS  # noqa: E402

PAYLOAD = '{"priority":"normal","project":"bench","title":"one transaction"}'
DEFAULT_REPEAT = 30
BLOCK = 5  # workers per mode in a row before the other mode runs
TARGET_FORK_MS = 5.0
TARGET_PROCESS_RATIO = 10.0
TARGET_SCENARIO_RATIO = 8.0


class BenchError(Exception):
    """A measured run did not do what it was supposed to: the figures would be meaningless."""


def _orders(repeat: int) -> list[tuple[SpawnMode, ...]]:
    """Alternate which mode runs first on each repetition."""
    return [SPAWN_MODES if i % 2 == 0 else SPAWN_MODES[::-1] for i in range(repeat)]


def _time_worker(runner: Spawner, spec: WorkerSpec, expected_exit: int) -> float:
    started = time.perf_counter()
    record = runner.run(spec)
    elapsed = time.perf_counter() - started
    if record.exit_code != expected_exit:
        raise BenchError(
            f"{runner.mode} {spec.role} (crash={spec.crash}) exited {record.exit_code}, "
            f"expected {expected_exit}: {record.stderr.strip()[-300:]}"
        )
    return elapsed * 1000


def measure_workers(system: System, repeat: int) -> dict[str, dict[str, list[float]]]:
    """Per-process milliseconds, interleaving modes; the fork server is warm (started once)."""
    samples: dict[str, dict[str, list[float]]] = {
        "commit": {mode: [] for mode in SPAWN_MODES},
        "kill": {mode: [] for mode in SPAWN_MODES},
    }
    # the stores live where faultlab's own runs put them (RAM-backed when available)
    with tempfile.TemporaryDirectory(prefix="faultlab-bench-", dir=scratch_directory()) as root, \
            spawner("fork") as fork_runner, spawner("exec") as exec_runner:
        runners = {"fork": fork_runner, "exec": exec_runner}
        directories = {}
        for mode in SPAWN_MODES:
            directories[mode] = Path(root) / mode
            directories[mode].mkdir()
            system.initialise(directories[mode])

        def spec(mode: SpawnMode, operation_id: str, crash: str | None) -> WorkerSpec:
            return WorkerSpec(
                system=system.ref, role="accept", directory=str(directories[mode]),
                operation_id=operation_id, payload=PAYLOAD, crash=crash,
            )

        for mode in SPAWN_MODES:  # warm-up: start the fork server, fill the page cache
            _time_worker(runners[mode], spec(mode, "warm-up", None), 0)
            _time_worker(runners[mode], spec(mode, "warm-up-kill", "during_accept"), -9)
        # Modes alternate in blocks (the order flips each round), so both see the same
        # machine noise while each mode runs as it does in a real run: back to back.
        block = max(1, min(BLOCK, repeat))
        done = 0
        for order in _orders((repeat + block - 1) // block):
            size = min(block, repeat - done)
            for mode in order:
                for i in range(done, done + size):
                    samples["commit"][mode].append(
                        _time_worker(runners[mode], spec(mode, f"operation-{i:05d}", None), 0))
                for _ in range(size):
                    samples["kill"][mode].append(
                        _time_worker(runners[mode], spec(mode, "killed", "during_accept"), -9))
            done += size
    return samples


def measure_fork_floor(repeat: int) -> list[float]:
    """A bare os.fork() whose child exits at once, and the parent's waitpid."""
    samples = []
    for _ in range(repeat):
        started = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _fork_run_cpu(system: System, root: Path, workers: int) -> tuple[float, float]:
    """CPU seconds (every process: this one, the fork server, its workers) and wall
    seconds of one fork-mode run of ``workers`` back-to-back commit workers."""
    directory = Path(tempfile.mkdtemp(dir=root))
    system.initialise(directory)
    before, started = os.times(), time.perf_counter()
    with spawner("fork") as runner:  # closing it reaps the fork server, so its CPU
        for i in range(workers):     # and its reaped workers' CPU count as our children's
            _time_worker(runner, WorkerSpec(
                system=system.ref, role="accept", directory=str(directory),
                operation_id=f"operation-{i:05d}", payload=PAYLOAD,
            ), 0)
    wall, after = time.perf_counter() - started, os.times()
    cpu = sum(after[:4]) - sum(before[:4])  # user, system, children's user and system
    return cpu, wall


def measure_fork_cpu(system: System, workers: int) -> tuple[float, float]:
    """CPU milliseconds per fork-mode worker, and the share of all CPUs kept busy.

    A run of one worker is subtracted from a run of ``workers``, so the fork
    server's start-up cancels out. On a machine with few cores this says whether
    the fork server is CPU-bound: then work moved off the clock still costs.
    """
    with tempfile.TemporaryDirectory(prefix="faultlab-bench-", dir=scratch_directory()) as root:
        one_cpu, one_wall = _fork_run_cpu(system, Path(root), 1)
        many_cpu, many_wall = _fork_run_cpu(system, Path(root), workers)
    per_worker = (many_cpu - one_cpu) / (workers - 1)
    busy = (many_cpu - one_cpu) / ((many_wall - one_wall) * (os.cpu_count() or 1))
    return per_worker * 1000, busy


def measure_scenarios(system: System, repeat: int) -> dict[str, list[float]]:
    """Seconds for the five scenarios in this process, spawner start-up included."""
    samples: dict[str, list[float]] = {mode: [] for mode in SPAWN_MODES}
    for order in _orders(repeat):
        for mode in order:
            started = time.perf_counter()
            with spawner(mode) as runner:
                outcomes = [scenario.run(system, runner) for scenario in SCENARIOS]
            samples[mode].append(time.perf_counter() - started)
            failed = [o.name for o in outcomes if not o.passed]
            if failed:
                raise BenchError(f"{mode} mode: scenarios failed: {', '.join(failed)}")
    return samples


def _ratio(exec_value: float, fork_value: float) -> float:
    return exec_value / fork_value if fork_value > 0 else float("inf")


#: What ``--output`` writes, recognised by its first key, so a re-run replaces only it.
RESULTS = Kind("a bench/spawn.py results file",
               (re.compile(rb'\{\s*"benchmark": "bench/spawn\.py"'),))


def _write_json(path: Path, data: Any) -> None:
    output.write_json(path, data, final=True, kind=RESULTS)


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--repeat", type=_positive, default=DEFAULT_REPEAT, metavar="N",
        help=f"timed worker processes per kind and mode (default {DEFAULT_REPEAT}); the "
             "five scenarios run max(3, N // 10) times per mode",
    )
    parser.add_argument("--output", type=Path, metavar="FILE",
                        help="also write the samples, medians and ratios as JSON")
    args = parser.parse_args(argv)
    if args.output is not None:
        try:  # an existing file is replaced only when it is this bench's own output
            output.check_output_file(args.output, "--output", RESULTS)
        except UsageError as error:
            print(f"spawn.py: {error}", file=sys.stderr)
            return 2

    system = load_system("reference")
    scenario_repeat = max(3, args.repeat // 10)
    began = time.perf_counter()
    print(f"faultlab {__version__}, Python {platform.python_version()}, SQLite "
          f"{sqlite3.sqlite_version}, {platform.platform()}, {os.cpu_count()} CPUs; "
          f"{args.repeat} workers per kind and mode, {scenario_repeat} scenario runs per mode, "
          f"modes interleaved", flush=True)
    try:
        workers = measure_workers(system, args.repeat)
        floor = measure_fork_floor(max(200, args.repeat * 5))
        cpu_ms, busy = measure_fork_cpu(system, max(100, args.repeat * 4))
        scenarios = measure_scenarios(system, scenario_repeat)
    except BenchError as error:
        print(f"spawn.py: {error}", file=sys.stderr)
        return 1
    total = time.perf_counter() - began

    median: Callable[[list[float]], float] = statistics.median
    commit = {mode: median(workers["commit"][mode]) for mode in SPAWN_MODES}
    kill = {mode: median(workers["kill"][mode]) for mode in SPAWN_MODES}
    suite = {mode: median(scenarios[mode]) for mode in SPAWN_MODES}
    floor_ms = median(floor)
    ratios = {
        "commit": _ratio(commit["exec"], commit["fork"]),
        "kill": _ratio(kill["exec"], kill["fork"]),
        "scenarios": _ratio(suite["exec"], suite["fork"]),
    }
    rows = [
        ["worker that commits one transaction (ms/process)",
         f"{commit['exec']:.2f}", f"{commit['fork']:.2f}", f"{ratios['commit']:.1f}x"],
        ["worker that SIGKILLs itself (ms/process)",
         f"{kill['exec']:.2f}", f"{kill['fork']:.2f}", f"{ratios['kill']:.1f}x"],
        ["bare os.fork() + waitpid floor (ms)", "-", f"{floor_ms:.3f}", "-"],
        ["CPU per commit worker, all processes (ms)", "-",
         f"{cpu_ms:.2f} ({busy:.0%} of {os.cpu_count()} CPUs)", "-"],
        ["five scenarios, spawner start-up included (s)",
         f"{suite['exec']:.3f}", f"{suite['fork']:.3f}", f"{ratios['scenarios']:.1f}x"],
    ]
    print(tabulate(rows, headers=["median", "exec", "fork", "exec/fork"],
                   tablefmt="github", disable_numparse=True))
    print()
    fork_worst = max(commit["fork"], kill["fork"])
    process_ratio = min(ratios["commit"], ratios["kill"])
    targets = {
        f"fork-mode worker <= {TARGET_FORK_MS:g} ms median": (
            fork_worst <= TARGET_FORK_MS,
            f"commit {commit['fork']:.2f} ms, SIGKILL {kill['fork']:.2f} ms",
        ),
        f"fork >= {TARGET_PROCESS_RATIO:g}x faster than exec per process": (
            process_ratio >= TARGET_PROCESS_RATIO,
            f"commit {ratios['commit']:.1f}x, SIGKILL {ratios['kill']:.1f}x",
        ),
        f"five scenarios >= {TARGET_SCENARIO_RATIO:g}x faster in fork mode": (
            ratios["scenarios"] >= TARGET_SCENARIO_RATIO,
            f"{suite['exec']:.3f} s / {suite['fork']:.3f} s = {ratios['scenarios']:.1f}x",
        ),
    }
    for name, (holds, figures) in targets.items():
        print(f"{'HOLDS' if holds else 'MISSED'}: {name} ({figures})")
    print(f"(measured in {total:.1f} s)")

    if args.output is not None:
        _write_json(args.output, {
            "benchmark": "bench/spawn.py",
            "faultlab": __version__,
            "python": platform.python_version(),
            "sqlite": sqlite3.sqlite_version,
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "repeat": args.repeat,
            "scenario_repeat": scenario_repeat,
            "median_ms": {"commit": commit, "kill": kill, "fork_floor": floor_ms},
            "fork_cpu_ms_per_worker": cpu_ms,
            "fork_cpu_busy_share": busy,
            "median_scenarios_seconds": suite,
            "ratios_exec_over_fork": ratios,
            "targets": {name: holds for name, (holds, _) in targets.items()},
            "samples": {"workers_ms": workers, "fork_floor_ms": floor,
                        "scenarios_seconds": scenarios},
            "seconds": round(total, 3),
        })
    return 0 if all(holds for holds, _ in targets.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
