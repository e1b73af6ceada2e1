"""Examples until found per concurrency mutant, uniform scheduler beside PCT, in one run.

    python bench/scheduler.py [--examples N] [--seeds 0,1,2] [--schedulers uniform,pct]
                              [--mutants a,b]

For each SQLite concurrency mutant (the registry's two-lane mutants,
:mod:`faultlab.system.builtin.registry`) and each seed, runs ``explore --concurrency 2`` once per
scheduler with a budget of ``--examples`` examples (a run stops at its first failure, so
a small budget keeps the CPU modest) and prints a table: per mutant, the examples until
found for each seed and their median (a miss counts as the budget plus one, shown
``>N``), the shrunk lengths, and the minimal length of the mutant's committed corpus file
(``corpus/MUTANT-*.json``). A last row gives the median over all mutants and the ratio of
the medians. Exit 0 when every found trace shrank to its corpus file's length, 1
otherwise, 2 on bad options.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

# this checkout's faultlab, never an installed copy (a tox environment holds a wheel of
# whatever was built when it was made): a benchmark measures the code beside it
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tabulate import tabulate  # noqa: E402

from faultlab import __version__  # noqa: E402
from faultlab.process.spawn import spawner  # noqa: E402
from faultlab.search.explore import HYPOTHESIS_VERSION, explore  # noqa: E402
from faultlab.search.schedules import SCHEDULERS  # noqa: E402
from faultlab.system import load_system  # noqa: E402
from faultlab.system.builtin import registry  # noqa: E402

CORPUS = Path(__file__).resolve().parent.parent / "corpus"


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {text}")
    return value


def _names(text: str) -> list[str]:
    return [name for name in text.split(",") if name]


def corpus_length(name: str) -> int | None:
    """The steps of the mutant's committed corpus file (its minimal trace), if any."""
    for path in sorted(CORPUS.glob(f"{name}-*.json")):
        document = json.loads(path.read_text())
        if document.get("system") == name and "concurrency" in document:
            return len(document["steps"])
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=_positive, default=40, metavar="N",
                        help="budget per exploration (default 40; each stops when it finds)")
    parser.add_argument("--seeds", type=lambda t: [int(s) for s in _names(t)],
                        default=[0, 1, 2], metavar="S,S", help="seeds (default 0,1,2)")
    parser.add_argument("--schedulers", type=_names, default=["uniform", "pct"],
                        metavar="A,B", help="schedulers compared (default uniform,pct)")
    parser.add_argument("--mutants", type=_names, default=None, metavar="A,B",
                        help="only these mutants (default every concurrency mutant)")
    args = parser.parse_args(argv)
    names = registry.names(lanes=2, postgres=False)
    unknown = [n for n in (args.mutants or []) if n not in names] + [
        s for s in args.schedulers if s not in SCHEDULERS]
    if unknown or not args.seeds:
        parser.error(f"unknown: {', '.join(unknown)}" if unknown else "no seeds")
    mutants = args.mutants or names
    print(f"faultlab {__version__}, Python {platform.python_version()}, Hypothesis "
          f"{HYPOTHESIS_VERSION}, {platform.platform()}, {os.cpu_count()} CPUs; "
          f"--concurrency 2, budget {args.examples} examples of 10 steps, seeds "
          f"{','.join(map(str, args.seeds))}", flush=True)
    miss = args.examples + 1
    medians: dict[str, list[float]] = {s: [] for s in args.schedulers}
    rows, shrunk_ok = [], True
    started = time.monotonic()
    for name in mutants:
        minimal = corpus_length(name)
        row: list[object] = [name]
        lengths: list[str] = []
        for scheduler in args.schedulers:
            found, shrunk, missed = [], [], []
            for seed in args.seeds:
                with spawner("fork") as runner:
                    result = explore(load_system(name), runner, concurrency=2,
                                     examples=args.examples, seed_value=seed,
                                     scheduler=scheduler)
                until = result.recorder.first_failure_examples
                # Hypothesis may run an example or two past the budget: a finding there
                # counts as found, with its own number
                found.append(until if result.trace is not None and until is not None
                             else miss)
                missed.append(result.trace is None)
                shrunk.append(result.shrunk_steps)
                shrunk_ok &= result.shrunk_steps in (None, minimal)
            median = statistics.median(found)
            medians[scheduler].append(median)
            row.append(" ".join(f">{args.examples}" if m else str(f)
                                for f, m in zip(found, missed, strict=True)))
            row.append(median)
            lengths.append(" ".join("-" if s is None else str(s) for s in shrunk))
            print(f"  {name} {scheduler}: {found} shrunk {shrunk}", file=sys.stderr, flush=True)
        rows.append([*row, *lengths, "-" if minimal is None else minimal])
    overall = [statistics.median(medians[s]) for s in args.schedulers]
    total: list[object] = ["median over mutants"]
    for value in overall:
        total += ["", value]
    rows.append([*total, *([""] * len(args.schedulers)), ""])
    headers = ["mutant"]
    for s in args.schedulers:
        headers += [f"{s} examples (per seed)", f"{s} median"]
    headers += [f"{s} shrunk" for s in args.schedulers] + ["corpus length"]
    print(tabulate(rows, headers=headers, tablefmt="github"))
    if len(overall) >= 2 and overall[1]:
        print(f"{args.schedulers[0]}/{args.schedulers[1]} median examples until found: "
              f"{overall[0] / overall[1]:.1f}x (a miss counts as {miss}); "
              f"{time.monotonic() - started:.0f} s")
    return 0 if shrunk_ok else 1


if __name__ == "__main__":
    sys.exit(main())
