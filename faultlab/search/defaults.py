"""Default budgets of the searches, in one place.

The command line reads them to print ``--help`` without importing the search
engines (Hypothesis is a slow import, and an exec-mode worker parses the same
command line); the engines and the zoo read them too, so a default is stated once.
"""

from __future__ import annotations

#: explore: examples Hypothesis must complete, steps per example, seed.
EXAMPLES = 100
STEPS = 10
SEED = 0
#: enumerate: operation ids per trace and crashes per trace.
OPERATIONS = 2
CRASHES = 1
#: suite: examples of its exploration phase; a state machine used as a pytest TestCase.
SUITE_EXAMPLES = 50
TESTCASE_EXAMPLES = 50


def max_steps(operations: int, crashes: int) -> int:
    """enumerate's steps per trace: every operation accepted and dispatched, each crash, and
    one more step."""
    return 2 * operations + crashes + 1

#: How ``explore --concurrency N`` draws the lane that moves (``--scheduler``; see
#: :mod:`faultlab.search.schedules`), and the default: the one that measured better on the
#: concurrency mutants (``bench/scheduler.py``).
SCHEDULERS = ("uniform", "pct", "swarm")
SCHEDULER = "uniform"
