"""Concurrent steps per second beside sequential ones, on the reference, in one run.

    python bench/lanes.py [--examples N] [--seed S]

Runs ``explore`` on the reference twice with the same seed and budget: once
sequentially (``--concurrency 1``, one worker per step, through the fork
server) and once with two lanes (``--concurrency 2``, workers forked by the
starter's helper process, :mod:`faultlab.process.starter`, and held at their
points). Prints examples, steps, processes,
seconds and steps/s for each, and the ratio. Both must come out clean: exit 1
otherwise, 2 on bad options. A concurrent step is one scheduling choice (start,
release, finish, kill, pause, resume, tick); some start no process at all, and
a lane blocked on another's lock costs up to a second.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
from pathlib import Path

# this checkout's faultlab, never an installed copy (a tox environment holds a wheel of
# whatever was built when it was made): a benchmark measures the code beside it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from faultlab import __version__  # noqa: E402
from faultlab.process.spawn import spawner  # noqa: E402
from faultlab.search.explore import HYPOTHESIS_VERSION, explore  # noqa: E402
from faultlab.system import load_system  # noqa: E402


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=_positive, default=100, metavar="N",
                        help="examples per exploration (default 100)")
    parser.add_argument("--seed", type=int, default=0, metavar="S", help="seed (default 0)")
    args = parser.parse_args(argv)
    system = load_system("reference")
    print(f"faultlab {__version__}, Python {platform.python_version()}, Hypothesis "
          f"{HYPOTHESIS_VERSION}, {platform.platform()}, {os.cpu_count()} CPUs; reference, "
          f"{args.examples} examples of 10 steps, seed {args.seed}", flush=True)
    with spawner("fork") as runner:
        sequential = explore(system, runner, examples=args.examples, seed_value=args.seed)
        concurrent = explore(system, runner, concurrency=2, examples=args.examples,
                             seed_value=args.seed)
    s, c = sequential.stats(), concurrent.stats()
    rows = [
        ["sequential (--concurrency 1)", s["examples"], s["steps"], s["processes"],
         s["seconds"], s["steps_per_second"], "clean" if not sequential.found else "FOUND"],
        ["concurrent (--concurrency 2)", c["examples"], c["steps"], c["processes"],
         c["seconds"], c["steps_per_second"], "clean" if concurrent.trace is None else "FOUND"],
    ]
    print(tabulate(rows, headers=["exploration", "examples", "steps", "processes", "seconds",
                                  "steps/s", "verdict"], tablefmt="github"))
    ratio = s["steps_per_second"] / c["steps_per_second"] if c["steps_per_second"] else 0.0
    print(f"sequential/concurrent steps/s: {ratio:.1f}x; concurrent lane-steps blocked on a "
          f"lock: {c['blocked_lane_steps']}")
    return 0 if not sequential.found and concurrent.trace is None else 1


if __name__ == "__main__":
    sys.exit(main())
