"""Exploration throughput: steps/s with one job and with two, against the physical floor.

    python bench/explore.py [--seconds S] [--repeat N] [--seed S] [--output FILE]

In one run, alternating three modes (``--jobs 1``, ``--jobs 2``, ``--jobs 2 --no-pin``,
each first in turn) so machine noise hits them alike, it explores the reference for
``--seconds`` each time (``explore --duration``, rounds of 20 examples) and measures:

* steps/s while exploring, with ``--jobs 1`` (in this process) and ``--jobs 2`` (two
  job processes, each with its own fork server, each pinned to one CPU as ``explore``
  does): steps over the time from the first
  stream's start to the last one's end (each job stamps its stream with the machine's
  monotonic clock), so interpreter and fork-server start-up, which a long run pays once,
  is left out of both alike; ``--jobs 2 / --jobs 1`` is the median of the ratios of
  adjacent measurements, the figure the 1.5x target is judged on;
* the same end to end, start-up included (what a run of ``--seconds`` gives), and the
  start-up itself;
* CPU per step of every process with one job (this process, the fork server and every
  worker, reaped), and how many cores one job keeps busy (that CPU over the exploring
  time): with ``B`` cores busy, two jobs on 2 cores can gain at most ``2 / B``. One job
  already keeps more than one core busy (the fork server forks the next worker and a
  dispatcher's service runs while this process judges the last step). On a virtual
  machine the CPU time may include time the hypervisor gave to others, so ``2 / B`` is
  a rough bound, not a limit a measurement cannot pass;
* the same for two jobs (every process of the run, start-up included, over the whole
  run's time): how much of the machine two jobs use, and whether a step costs more CPU
  when two jobs share the cores;
* the same three figures for two jobs left to the scheduler (``--no-pin``), which
  shows what pinning each job to its own CPU gains (see ``faultlab/process/affinity.py``);
* the parent's CPU per step with one job: user + system time of this process alone
  (Hypothesis, the state machine, the invariants, the executor's bookkeeping);
* the bare fork floor: ``os.fork()`` + ``os._exit`` + ``os.waitpid()`` from this
  process before it explores, the least a step that is a real process can cost;
* how fork-bound work scales on this machine: loops of bare fork + exit + wait, two at
  once against one (alternated with the explorations, 2 s each). About half of a step's
  CPU is the kernel's (fork, copy-on-write faults, exit), and that part may scale worse
  than plain computation does on a virtual machine's cores.

Exit status 0 when ``--jobs 2`` reaches 1.5x, 1 when not, 2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# this checkout's faultlab, never an installed copy (a tox environment holds a wheel of
# whatever was built when it was made): a benchmark measures the code beside it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from faultlab import __version__  # noqa: E402
from faultlab.process.spawn import spawner  # noqa: E402
from faultlab.search.rounds import Plan, run_jobs, run_stream  # noqa: E402
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


def fork_loops_rate(loops: int, seconds: float = 2.0) -> float:
    """Bare fork + exit + wait iterations per second of ``loops`` processes at once."""
    read, write = os.pipe()
    pids = []
    for _ in range(loops):
        pid = os.fork()
        if pid == 0:  # a loop: fork a child that exits at once, wait for it, again
            count, ends = 0, time.monotonic() + seconds
            while time.monotonic() < ends:
                child = os.fork()
                if child == 0:
                    os._exit(0)
                os.waitpid(child, 0)
                count += 1
            os.write(write, f"{count}\n".encode())
            os._exit(0)
        pids.append(pid)
    os.close(write)
    for pid in pids:
        os.waitpid(pid, 0)
    with os.fdopen(read, "rb") as counts:
        return sum(int(n) for n in counts.read().split()) / seconds


@dataclass
class Measurement:
    """One exploration: steps, the exploring window and the whole run's wall time."""

    steps: int
    window: float  # seconds from the first stream's start to the last one's end
    wall: float  # seconds of the whole run, start-up included
    parent_cpu: float = 0.0  # seconds of this process's CPU (one job only)
    all_cpu: float = 0.0  # seconds of CPU of every process of the run (one job only)

    @property
    def rate(self) -> float:
        return self.steps / self.window if self.window else 0.0

    @property
    def end_to_end(self) -> float:
        return self.steps / self.wall if self.wall else 0.0


def _cpu(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def one_job(seconds: float, seed: int) -> Measurement:
    """One job in this process; its fork server's and workers' CPU is counted once the
    fork server is reaped (it reaps the workers)."""
    system = load_system("reference")
    plan = Plan("reference", True, seed, ROUND_EXAMPLES, 10, True, False, "fork",
                duration=seconds)
    began = time.monotonic()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    with spawner("fork") as runner:
        result, _ = run_stream(system, runner, plan, 0)
        parent = _cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(own)
    wall = time.monotonic() - began
    everything = (_cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(own)
                  + _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu(children))
    return Measurement(result.totals.steps, result.ended - result.began, wall, parent,
                       everything)


def two_jobs(seconds: float, seed: int, pin: bool = True) -> Measurement:
    """Two job processes, pinned one CPU each (as ``explore --jobs 2``) or not (as with
    ``--no-pin``); their CPU (with their fork servers' and workers', which each job reaps)
    is counted once they are joined, with this process's own."""
    plan = Plan("reference", True, seed, ROUND_EXAMPLES, 10, True, False, "fork",
                duration=seconds, jobs=2, pin=pin)
    began = time.monotonic()
    own = resource.getrusage(resource.RUSAGE_SELF)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    results = run_jobs(plan)
    wall = time.monotonic() - began
    everything = (_cpu(resource.getrusage(resource.RUSAGE_SELF)) - _cpu(own)
                  + _cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - _cpu(children))
    steps = sum(result.totals.steps for result in results)
    window = max(r.ended for r in results) - min(r.began for r in results)
    return Measurement(steps, window, wall, all_cpu=everything)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="exploration time per measurement (default 10)")
    parser.add_argument("--repeat", type=int, default=5,
                        help="measurements per mode, alternated (default 5: the host's "
                             "speed drifts by a fifth within a run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    if args.seconds <= 0 or args.repeat < 1:
        parser.error("--seconds must be > 0 and --repeat >= 1")
    floor = fork_floor_ms()  # before exploring: a small process, as the fork server is
    single: list[Measurement] = []
    double: list[Measurement] = []
    unpinned: list[Measurement] = []
    fork_scaling: list[float] = []
    modes = ["1", "2", "2 --no-pin"]
    for index in range(args.repeat):
        first = index % len(modes)  # each mode first in turn
        for mode in modes[first:] + modes[:first]:
            if mode == "1":
                single.append(one_job(args.seconds, args.seed + index))
            elif mode == "2":
                double.append(two_jobs(args.seconds, args.seed + index))
            else:
                unpinned.append(two_jobs(args.seconds, args.seed + index, pin=False))
            print(f"bench: jobs {mode} measured ({index + 1}/{args.repeat})", file=sys.stderr,
                  flush=True)
        fork_scaling.append(fork_loops_rate(2) / fork_loops_rate(1))
    median = statistics.median
    one, two = median(m.rate for m in single), median(m.rate for m in double)
    speedup = median(b.rate / a.rate for a, b in zip(single, double, strict=True))
    free = median(m.rate for m in unpinned)
    free_speedup = median(b.rate / a.rate for a, b in zip(single, unpinned, strict=True))
    end_to_end = median(b.end_to_end / a.end_to_end for a, b in zip(single, double, strict=True))
    parent = median(m.parent_cpu / m.steps * 1000 for m in single)
    every = median(m.all_cpu / m.steps * 1000 for m in single)
    busy = median(m.all_cpu / m.window for m in single)
    # two jobs: their whole run's CPU (start-up included) over the whole run's time
    every_two = median(m.all_cpu / m.steps * 1000 for m in double)
    busy_two = median(m.all_cpu / m.wall for m in double)
    every_free = median(m.all_cpu / m.steps * 1000 for m in unpinned)
    busy_free = median(m.all_cpu / m.wall for m in unpinned)
    cores = os.cpu_count() or 1
    print(f"faultlab {__version__}, Python {platform.python_version()}, {platform.platform()}, "
          f"{cores} CPUs; {args.repeat} x {args.seconds:g} s per mode, alternated")
    rows = [
        ["steps/s exploring, --jobs 1", f"{one:.1f}"],
        ["steps/s exploring, --jobs 2", f"{two:.1f}"],
        ["--jobs 2 / --jobs 1, exploring", f"{speedup:.2f}x"],
        ["--jobs 2 / --jobs 1, ratio of the medians above", f"{two / one:.2f}x"],
        ["steps/s end to end, --jobs 1", f"{median(m.end_to_end for m in single):.1f}"],
        ["steps/s end to end, --jobs 2", f"{median(m.end_to_end for m in double):.1f}"],
        ["--jobs 2 / --jobs 1, end to end", f"{end_to_end:.2f}x"],
        ["start-up, --jobs 1 (s)", f"{median(m.wall - m.window for m in single):.2f}"],
        ["start-up, --jobs 2 (s)", f"{median(m.wall - m.window for m in double):.2f}"],
        ["CPU per step, all processes, --jobs 1 (ms)", f"{every:.2f}"],
        ["cores busy, --jobs 1", f"{busy:.2f}"],
        [f"{cores} cores / cores busy", f"{cores / busy:.2f}x"],
        ["CPU per step, all processes, --jobs 2 (ms)", f"{every_two:.2f}"],
        ["cores busy, --jobs 2 (whole run)", f"{busy_two:.2f}"],
        ["steps/s exploring, --jobs 2 --no-pin", f"{free:.1f}"],
        ["--jobs 2 --no-pin / --jobs 1, exploring", f"{free_speedup:.2f}x"],
        ["CPU per step, all processes, --jobs 2 --no-pin (ms)", f"{every_free:.2f}"],
        ["cores busy, --jobs 2 --no-pin (whole run)", f"{busy_free:.2f}"],
        ["parent CPU per step, --jobs 1 (ms)", f"{parent:.2f}"],
        ["bare fork + wait floor (ms)", f"{floor:.3f}"],
        ["parent CPU per step / fork floor", f"{parent / floor:.1f}x"],
        ["bare fork loops, 2 at once / 1", f"{median(fork_scaling):.2f}x"],
    ]
    print(tabulate(rows, headers=["median", "value"], tablefmt="github"))
    holds = speedup >= TARGET_SPEEDUP
    print(f"\n{'HOLDS' if holds else 'MISSED'}: --jobs 2 >= {TARGET_SPEEDUP}x the steps/s of "
          f"--jobs 1 while exploring ({two:.1f} / {one:.1f}; median of paired ratios "
          f"{speedup:.2f}x)")
    if args.output is not None:
        figures: dict[str, Any] = {
            "jobs_1": [vars(m) for m in single], "jobs_2": [vars(m) for m in double],
            "jobs_2_no_pin": [vars(m) for m in unpinned], "speedup_no_pin": free_speedup,
            "fork_floor_ms": floor, "speedup": speedup, "speedup_end_to_end": end_to_end,
            "cpu_ms_per_step": every, "cores_busy_one_job": busy,
            "cpu_ms_per_step_two_jobs": every_two, "cores_busy_two_jobs": busy_two,
            "fork_loops_2_over_1": fork_scaling,
        }
        args.output.write_text(json.dumps(figures, indent=2) + "\n")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
