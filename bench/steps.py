"""Sequential steps/s of this code against an earlier commit's, side by side in one run.

    python bench/steps.py [--against COMMIT] [--seconds S] [--repeat N] [--seed S]
                          [--concurrent-examples N] [--concurrent-repeat N]
                          [--wall-seconds S] [--wall-repeat N]

The earlier commit (default f402273, the baseline the 2x target is measured against)
is checked out into a temporary ``git worktree``, removed at the end. Each
measurement is a fresh interpreter (``python -c``) importing one tree's faultlab only,
exploring the reference sequentially for ``--seconds`` with one job (rounds of 20
examples, ``explore --duration``); the two trees alternate, each first in turn, with
the same seed in the same repetition, so machine noise hits both alike. It prints:

* steps/s while exploring (steps over the stream's own start and end stamps, so
  interpreter and fork-server start-up are left out) for each tree, and the median of
  the ratios of the two measurements taken in the same repetition (the figure judged;
  the ratio of the medians is printed too);
* CPU per step of every process (the parent, the fork servers, every worker and
  service, reaped), and of the parent alone; wall time per step, and how much of it
  the parent spent waiting for a worker's record (the rest is its own work, on the
  same chain);
* the physical floor: a bare ``os.fork()`` + ``os._exit`` + ``os.waitpid()`` of the same
  image (a process that imported what the fork server imports), as milliseconds and as
  the steps/s a step costing one bare fork would reach (the median of three
  alternated measurements per tree, 300 forks each);
* a worker's own floor: a hand-written accept (the reference's SQL with ``sqlite3`` and
  ``json`` only, none of faultlab's code) forked from that image onto a fresh store and
  waited for, 300 per measurement, and the steps/s a step costing one would reach;
  beside it the same accept run in the measuring process itself, no process of its own
  (what the process costs: the part no arrangement of forked workers can remove);
* steps/s and CPU per step of ``explore --concurrency 2`` on the reference (a budget of
  ``--concurrent-examples`` examples, seed S + repetition; steps over the exploration's
  own seconds) and the lane-steps blocked on a lock, per repetition;
* the same steps/s for a system on the virtual wall clock (``virtual_wall_clock``:
  tests/systems_for_tests.py's WallClockRetryOutbox), which the earlier code ran in exec
  mode, with the spawn mode each tree used (what libfaketime left in ``/dev/shm`` for the
  earlier tree's exec'd workers, named after their pids, is removed).

Exit status 0 when this code reaches 2x the earlier code's sequential steps/s on the
reference, 1 when not (the --concurrency 2 ratio is judged on its own line), 2 on bad
options. The machine may be shared: say so with the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_AGAINST = "f402273"
TARGET = 2.0
WALL_SYSTEM = "systems_for_tests:WallClockRetryOutbox"

#: One measurement, in a fresh interpreter that sees only one tree (argv: root, what, ...).
#: It knows both layouts: the earlier flat modules (faultlab.process, faultlab.search) and
#: the layered ones (faultlab.process.spawn, faultlab.search.rounds).
DRIVER = r'''
import json, os, resource, statistics, sys, time
root, what = sys.argv[1], sys.argv[2]
sys.path[:0] = [root, os.path.join(root, "tests")]
# Only what the fork server imports, here at the top: the floor is measured on that image
# (the search and Hypothesis, which the other measurements need, are imported below them).
try:
    from faultlab.run import worker
except ImportError:
    from faultlab import worker
from faultlab.system import load_system

def cpu(usage):
    return usage.ru_utime + usage.ru_stime

def usage():
    return resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)

if what == "floor":
    worker.preload()
    if "hypothesis" in sys.modules:  # not the fork server's image: the floor would be wrong
        sys.exit("the floor's image imported hypothesis, which no fork server does")
    samples = []
    own, children = usage()
    for _ in range(300):
        began = time.perf_counter()
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)
        samples.append((time.perf_counter() - began) * 1000)
    spent = (cpu(resource.getrusage(resource.RUSAGE_SELF)) - cpu(own)
             + cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - cpu(children))
    # A worker's own floor: a hand-written accept (the reference's SQL, sqlite3 and json
    # only, none of faultlab's code) forked from the same image, on a fresh store.
    import shutil, sqlite3, tempfile
    from pathlib import Path
    reference = load_system("reference")
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK | os.X_OK) else None  # as faultlab's
    store = tempfile.mkdtemp(prefix="faultlab-bench-floor-", dir=shm)
    try:
        reference.initialise(Path(store))
        caller = os.path.join(store, sys.modules[type(reference).__module__].CALLER)
        devnull = os.open(os.devnull, os.O_WRONLY)

        def accept(operation_id):
            connection = sqlite3.connect(caller, isolation_level=None, timeout=5)
            connection.execute("BEGIN IMMEDIATE")
            connection.execute("SELECT payload, state FROM operations WHERE id = ?",
                               (operation_id,)).fetchone()
            connection.execute("INSERT INTO operations (id, payload, state, result) "
                               "VALUES (?, '{}', 'pending', NULL)", (operation_id,))
            connection.execute("INSERT INTO outbox (operation_id, state) "
                               "VALUES (?, 'pending')", (operation_id,))
            connection.execute("COMMIT")
            connection.close()
            os.write(devnull, (json.dumps({"accepted": True, "operation_id": operation_id})
                               + "\n").encode())

        accepts = []
        for number in range(300):
            began = time.perf_counter()
            pid = os.fork()
            if pid == 0:
                accept(f"op-{number}")
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if status != 0:
                sys.exit(f"the hand-written accept exited with status {status}")
            accepts.append((time.perf_counter() - began) * 1000)
        # The same accept with no process of its own (what a worker serving many actions
        # would pay): the share of a forked accept that is the process itself.
        inline = []
        for number in range(300, 600):
            began = time.perf_counter()
            accept(f"op-{number}")
            inline.append((time.perf_counter() - began) * 1000)
        os.close(devnull)
    finally:
        shutil.rmtree(store)
    print(json.dumps({"ms": statistics.median(samples), "cpu_ms": spent * 1000 / 300,
                      "accept_ms": statistics.median(accepts),
                      "inline_ms": statistics.median(inline)}))
    sys.exit(0)

try:
    from faultlab.process.spawn import spawner
    from faultlab.search.rounds import Plan, run_stream
except ImportError:
    from faultlab.process import spawner
    from faultlab.search import Plan, run_stream

if what == "concurrent":
    examples, seed = int(sys.argv[3]), int(sys.argv[4])
    own, children = usage()
    try:
        from faultlab.search.schedules import explore_concurrent
    except ImportError:
        try:
            from faultlab.concurrent_explore import explore_concurrent
        except ImportError:  # one explore for every number of lanes
            explore_concurrent = None
    if explore_concurrent is not None:
        outcome = explore_concurrent(load_system("reference"), concurrency=2,
                                     examples=examples, seed_value=seed)
    else:
        from faultlab.search.explore import explore
        with spawner("fork") as runner:
            outcome = explore(load_system("reference"), runner, concurrency=2,
                              examples=examples, seed_value=seed)
    stats = outcome.stats()
    everything = (cpu(resource.getrusage(resource.RUSAGE_SELF)) - cpu(own)
                  + cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - cpu(children))
    print(json.dumps({"steps": stats["steps"], "window": stats["seconds"],
                      "all_cpu": everything, "blocked": stats["blocked_lane_steps"],
                      "found": outcome.trace is not None}))
    sys.exit(0)

seconds, seed, system_ref = float(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
system = load_system(system_ref)
# an earlier tree's Plan named sequential statement points statement_crashes
points = ("statement_crashes" if "statement_crashes" in Plan.__dataclass_fields__
          else "statement_points")
plan = Plan(system=system_ref, deduplication=True, seed=seed, examples=20, steps=10,
            hypothesis_shrink=False, spawn="fork", duration=seconds, **{points: True})
own, children = usage()
spawning = sys.modules[spawner.__module__]  # count the workers exec'd, not forked
real_exec, execs, exec_pids = spawning.exec_worker, [0], []
def counted_exec(*args, **kwargs):
    execs[0] += 1
    record = real_exec(*args, **kwargs)
    exec_pids.append(record.pid)
    return record
spawning.exec_worker = counted_exec
with spawner("fork") as runner:
    waited = [0.0]  # seconds this process spent in the spawner: asking for a worker's record
    real_run = runner.run
    def timed_run(spec):
        began = time.perf_counter()
        try:
            return real_run(spec)
        finally:
            waited[0] += time.perf_counter() - began
    runner.run = timed_run
    result, found = run_stream(system, runner, plan, 0)
    parent = cpu(resource.getrusage(resource.RUSAGE_SELF)) - cpu(own)
    processes = runner.processes
# An earlier tree gave no libfaketime'd worker faultlab's own shared area: libfaketime made
# its own, named after the worker's pid, and a SIGKILLed worker left it in /dev/shm. The
# exec'd workers were this run's: what they left goes.
for pid in exec_pids:
    for name in (f"faketime_shm_{pid}", f"sem.faketime_sem_{pid}"):
        try:
            os.unlink(os.path.join("/dev/shm", name))
        except FileNotFoundError:
            pass
modes = [mode for mode, used in (("fork", execs[0] < processes), ("exec", execs[0])) if used]
everything = parent + cpu(resource.getrusage(resource.RUSAGE_CHILDREN)) - cpu(children)
print(json.dumps({"steps": result.totals.steps, "window": result.ended - result.began,
                  "parent_cpu": parent, "all_cpu": everything, "modes": modes,
                  "waited": waited[0], "found": found is not None}))
'''


def measure(root: Path, *arguments: str) -> dict[str, Any]:
    """Run the driver on one tree; its JSON line."""
    done = subprocess.run(
        [sys.executable, "-c", DRIVER, str(root), *arguments], capture_output=True, text=True,
        cwd=tempfile.gettempdir(), env={**os.environ, "PYTHONPATH": ""}, check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"bench: {root} {' '.join(arguments)} failed:\n{done.stderr[-2000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    if result.get("found"):
        raise SystemExit(f"bench: {root} found a bug while measuring; figures meaningless")
    return result


def alternate(trees: dict[str, Path], repeat: int, arguments: Any) -> dict[str, list[Any]]:
    """``repeat`` measurements per tree, alternating which goes first."""
    names = list(trees)
    runs: dict[str, list[Any]] = {name: [] for name in names}
    for index in range(repeat):  # nothing when repeat is 0
        order = names if index % 2 == 0 else names[::-1]
        for name in order:
            runs[name].append(measure(trees[name], *arguments(index)))
            print(f"bench: {name} measured ({index + 1}/{repeat})", file=sys.stderr, flush=True)
    return runs


def rate(run: dict[str, Any]) -> float:
    return float(run["steps"] / run["window"]) if run["window"] else 0.0


def paired(label: str, runs: dict[str, list[Any]], digits: str) -> tuple[float, list[str]]:
    """The median of the ratios of measurements taken in the same repetition, and the
    table row of both trees' median steps/s with it."""
    this, previous = runs["this"], runs["previous"]
    ratio = statistics.median(rate(a) / rate(b) for a, b in zip(this, previous, strict=True))
    return ratio, [f"{label}: steps/s exploring", f"{statistics.median(map(rate, this)):.1f}",
                   f"{statistics.median(map(rate, previous)):.1f}", f"{ratio:{digits}}x"]


def table(rows: list[list[str]], headers: list[str]) -> str:
    widths = [max(len(str(row[i])) for row in [headers, *rows]) for i in range(len(headers))]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = ["| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths, strict=True)) + " |"
            for row in rows]
    return "\n".join([line, rule, *body])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--against", default=DEFAULT_AGAINST,
                        help=f"the commit to compare with (default {DEFAULT_AGAINST})")
    parser.add_argument("--seconds", type=float, default=10.0,
                        help="exploration time per reference measurement (default 10)")
    parser.add_argument("--repeat", type=int, default=6,
                        help="reference measurements per tree, alternated (default 6)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--concurrent-examples", type=int, default=40,
                        help="examples per --concurrency 2 measurement (default 40)")
    parser.add_argument("--concurrent-repeat", type=int, default=4,
                        help="--concurrency 2 measurements per tree (default 4; 0: none)")
    parser.add_argument("--wall-seconds", type=float, default=15.0,
                        help="exploration time per virtual-wall-clock measurement (default 15)")
    parser.add_argument("--wall-repeat", type=int, default=2,
                        help="virtual-wall-clock measurements per tree (default 2; 0: none)")
    args = parser.parse_args()
    if args.seconds <= 0 or args.repeat < 1 or args.wall_seconds <= 0 or args.wall_repeat < 0 \
            or args.concurrent_examples < 1 or args.concurrent_repeat < 0:
        parser.error("--seconds and --wall-seconds must be > 0, --repeat and "
                     "--concurrent-examples >= 1, --wall-repeat and --concurrent-repeat >= 0")
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", args.against],
                            capture_output=True, text=True, check=False).stdout.strip()
    if not commit:
        parser.error(f"--against {args.against}: no such commit")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True, check=False).stdout.strip()
    began = time.monotonic()
    print("command: " + shlex.join(["python", "bench/steps.py", *sys.argv[1:]]), flush=True)
    with tempfile.TemporaryDirectory(prefix="faultlab-bench-") as scratch:
        previous = Path(scratch) / "previous"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", "--quiet",
                        str(previous), commit], check=True)
        try:
            trees = {"this": ROOT, "previous": previous}
            floored = alternate(trees, 3, lambda i: ("floor",))
            runs = alternate(trees, args.repeat, lambda i: (
                "explore", str(args.seconds), str(args.seed + i), "reference"))
            lanes = alternate(trees, args.concurrent_repeat, lambda i: (
                "concurrent", str(args.concurrent_examples), str(args.seed + i)))
            walls = alternate(trees, args.wall_repeat, lambda i: (
                "explore", str(args.wall_seconds), str(args.seed + i), WALL_SYSTEM))
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                            str(previous)], check=False)
    median = statistics.median
    floors = {name: {key: median(run[key] for run in floored[name])
                     for key in ("ms", "cpu_ms", "accept_ms", "inline_ms")} for name in trees}
    this, prev = runs["this"], runs["previous"]
    ratio = median(rate(a) / rate(b) for a, b in zip(this, prev, strict=True))

    def per_step(run: list[dict[str, Any]], key: str) -> str:
        return f"{median(r[key] / r['steps'] * 1000 for r in run):.2f}"

    print(f"faultlab at {head} plus the working tree ('this') against {commit} ('previous'); "
          f"Python {platform.python_version()}, {platform.platform()}, {os.cpu_count()} CPUs; "
          f"{args.repeat} x {args.seconds:g} s per tree, alternated; the machine may be "
          f"shared with other work")
    rows = [
        ["reference: steps/s exploring, one job", f"{median(map(rate, this)):.1f}",
         f"{median(map(rate, prev)):.1f}", f"{ratio:.2f}x"],
        ["reference: each repetition's steps/s",
         " ".join(f"{rate(r):.0f}" for r in this), " ".join(f"{rate(r):.0f}" for r in prev),
         " ".join(f"{rate(a) / rate(b):.2f}" for a, b in zip(this, prev, strict=True))],
        ["reference: CPU per step, all processes (ms)", per_step(this, "all_cpu"),
         per_step(prev, "all_cpu"), ""],
        ["reference: CPU per step, the parent (ms)", per_step(this, "parent_cpu"),
         per_step(prev, "parent_cpu"), ""],
        ["reference: wall time per step (ms)", per_step(this, "window"),
         per_step(prev, "window"), ""],
        ["  of it waiting for a worker's record (ms)", per_step(this, "waited"),
         per_step(prev, "waited"), ""],
        ["bare fork + wait of the fork server's image (ms)", f"{floors['this']['ms']:.3f}",
         f"{floors['previous']['ms']:.3f}", ""],
        ["  its CPU, parent and child (ms)", f"{floors['this']['cpu_ms']:.3f}",
         f"{floors['previous']['cpu_ms']:.3f}", ""],
        ["  steps/s if a step cost one bare fork", f"{1000 / floors['this']['ms']:.0f}",
         f"{1000 / floors['previous']['ms']:.0f}", ""],
        ["hand-written accept, forked from that image (ms)",
         f"{floors['this']['accept_ms']:.3f}", f"{floors['previous']['accept_ms']:.3f}", ""],
        ["  steps/s if a step cost one such accept",
         f"{1000 / floors['this']['accept_ms']:.0f}",
         f"{1000 / floors['previous']['accept_ms']:.0f}", ""],
        ["the same accept in this process, no fork (ms)",
         f"{floors['this']['inline_ms']:.3f}", f"{floors['previous']['inline_ms']:.3f}", ""],
    ]
    concurrent_ratio = None
    if args.concurrent_repeat:
        concurrent_ratio, rated = paired("--concurrency 2", lanes, ".2f")
        rows += [
            rated,
            ["--concurrency 2: each repetition's steps/s",
             " ".join(f"{rate(r):.0f}" for r in lanes["this"]),
             " ".join(f"{rate(r):.0f}" for r in lanes["previous"]),
             " ".join(f"{rate(a) / rate(b):.2f}" for a, b in
                      zip(lanes["this"], lanes["previous"], strict=True))],
            ["--concurrency 2: CPU per step, all processes (ms)",
             per_step(lanes["this"], "all_cpu"), per_step(lanes["previous"], "all_cpu"), ""],
            ["--concurrency 2: lane-steps blocked on a lock",
             " ".join(str(r["blocked"]) for r in lanes["this"]),
             " ".join(str(r["blocked"]) for r in lanes["previous"]), ""],
        ]
    if args.wall_repeat:
        rows += [
            paired("virtual wall clock", walls, ".1f")[1],
            ["virtual wall clock: spawn mode",
             "/".join(walls["this"][0]["modes"]), "/".join(walls["previous"][0]["modes"]), ""],
        ]
    print(table(rows, ["median", "this", "previous", "this / previous"]))
    holds = ratio >= TARGET
    print(f"\n{'HOLDS' if holds else 'MISSED'}: this code >= {TARGET}x the previous code's "
          f"sequential steps/s (median of paired ratios {ratio:.2f}x; ratio of the medians "
          f"{median(map(rate, this)) / median(map(rate, prev)):.2f}x)")
    if concurrent_ratio is not None:
        print(f"{'HOLDS' if concurrent_ratio >= TARGET else 'MISSED'}: this code >= "
              f"{TARGET}x the previous code's --concurrency 2 steps/s (median of paired "
              f"ratios {concurrent_ratio:.2f}x)")
    print(f"(measured in {time.monotonic() - began:.0f} s)")
    return 0 if holds else 1


if __name__ == "__main__":
    sys.exit(main())
