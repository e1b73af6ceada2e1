"""Exploration throughput: steps/s with one job and with two, against the fork floor.

    python bench/explore.py [--seconds S] [--repeat N] [--seed S] [--output FILE]

In one run, alternating the two (jobs 1, jobs 2, jobs 1, jobs 2, ...) so machine noise
hits both alike, it explores the reference for ``--seconds`` each time (``explore
--duration``, rounds of 20 examples) and measures:

* steps/s with ``--jobs 1`` (in this process) and ``--jobs 2`` (two job processes,
  each with its own fork server; their start-up is inside the measured time);
* the parent's CPU per step with one job: user + system time of this process alone
  (Hypothesis, the state machine, the invariants, the executor's bookkeeping), not of
  the fork server or the workers: faultlab's own cost per step;
* the bare fork floor: ``os.fork()`` + ``os._exit`` + ``os.waitpid()`` from this
  process before it explores (small, as the fork server is), the least a step that is
  a real process can cost.

It prints one table and whether ``--jobs 2`` reaches 1.5x the steps/s of ``--jobs 1``
(issue 11's target on 2 cores). Exit status 0 when it does, 1 when not, 2 on bad
options.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if importlib.util.find_spec("faultlab") is None:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from faultlab import __version__  # noqa: E402
from faultlab.process import spawner  # noqa: E402
from faultlab.search import Plan, Totals, run_jobs, run_stream  # noqa: E402
from faultlab.system import load_system  # noqa: E402

TARGET_SPEEDUP = 1.5
ROUND_EXAMPLES = 20


def fork_floor_ms(count: int = 200) -> float:
    """Median milliseconds of a bare fork + exit + wait."""
    samples = []
    for _ in range(count):
        began = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        samples.append((time.perf_counter() - began) * 1000)
    return statistics.median(samples)


def one_job(seconds: float, seed: int) -> tuple[float, float]:
    """steps/s and parent CPU ms per step with one job in this process."""
    system = load_system("reference")
    plan = Plan("reference", True, seed, ROUND_EXAMPLES, 10, True, False, "fork",
                duration=seconds)
    with spawner("fork") as runner:
        before = resource.getrusage(resource.RUSAGE_SELF)
        began = time.monotonic()
        result, _ = run_stream(system, runner, plan, 0)
        wall = time.monotonic() - began
        after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    steps = max(result.totals.steps, 1)
    return result.totals.steps / wall, cpu / steps * 1000


def two_jobs(seconds: float, seed: int) -> float:
    plan = Plan("reference", True, seed, ROUND_EXAMPLES, 10, True, False, "fork",
                duration=seconds, jobs=2)
    began = time.monotonic()
    results = run_jobs(plan)
    wall = time.monotonic() - began
    totals = Totals()
    for result in results:
        totals.steps += result.totals.steps
    return totals.steps / wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="exploration time per measurement (default 10)")
    parser.add_argument("--repeat", type=int, default=2,
                        help="measurements per mode, alternated (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    if args.seconds <= 0 or args.repeat < 1:
        parser.error("--seconds must be > 0 and --repeat >= 1")
    floor = fork_floor_ms()  # before exploring: a small process, as the fork server is
    single: list[float] = []
    cpu: list[float] = []
    double: list[float] = []
    for index in range(args.repeat):
        order = ("1", "2") if index % 2 == 0 else ("2", "1")
        for mode in order:
            if mode == "1":
                rate, per_step = one_job(args.seconds, args.seed + index)
                single.append(rate)
                cpu.append(per_step)
            else:
                double.append(two_jobs(args.seconds, args.seed + index))
            print(f"bench: jobs {mode} measured ({index + 1}/{args.repeat})", file=sys.stderr,
                  flush=True)
    one, two, parent = statistics.median(single), statistics.median(double), statistics.median(cpu)
    speedup = two / one if one else 0.0
    print(f"faultlab {__version__}, Python {platform.python_version()}, {platform.platform()}, "
          f"{os.cpu_count()} CPUs; {args.repeat} x {args.seconds:g} s per mode, alternated")
    rows = [
        ["steps/s, --jobs 1", f"{one:.1f}"],
        ["steps/s, --jobs 2", f"{two:.1f}"],
        ["--jobs 2 / --jobs 1", f"{speedup:.2f}x"],
        ["parent CPU per step, --jobs 1 (ms)", f"{parent:.2f}"],
        ["bare fork + wait floor (ms)", f"{floor:.3f}"],
        ["parent CPU per step / fork floor", f"{parent / floor:.1f}x"],
    ]
    print(tabulate(rows, headers=["median", "value"], tablefmt="github"))
    holds = speedup >= TARGET_SPEEDUP
    print(f"\n{'HOLDS' if holds else 'MISSED'}: --jobs 2 >= {TARGET_SPEEDUP}x the steps/s of "
          f"--jobs 1 ({two:.1f} / {one:.1f} = {speedup:.2f}x)")
    if args.output is not None:
        figures: dict[str, Any] = {
            "jobs_1_steps_per_second": single, "jobs_2_steps_per_second": double,
            "parent_cpu_ms_per_step": cpu, "fork_floor_ms": floor, "speedup": speedup,
        }
        args.output.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
