"""Progress on long runs: a bar with the budget, rate and ETA on a terminal, plain lines
otherwise.

A bar is drawn by tqdm (the ``progress`` extra) when stderr is a terminal; a log file,
a pipe or a CI job gets one plain line a second instead, so captured output stays
readable and stable. Nothing here decides what a run does: it only shows counters.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

#: Seconds between plain progress lines.
LINE_INTERVAL = 1.0


def _tqdm() -> Any:
    """tqdm's bar class, without its monitor thread: faultlab may fork workers from this
    process (where the lanes' helper cannot watch its children), and a fork from a process
    with another thread may deadlock the child (a lock that thread held is never released
    there; Python 3.12 warns of it)."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    tqdm.monitor_interval = 0
    return tqdm


class Progress:
    """Shows examples done against the budget (or seconds against ``--duration``).

    ``line`` formats the plain line; the bar shows the same counters as its postfix.
    """

    def __init__(self, *, examples: int, duration: float | None, label: str,
                 quiet: bool = False, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.quiet = quiet
        self.label = label
        self.duration = duration
        self.examples = examples
        self._last = 0.0
        self._bar: Any = None
        tqdm = _tqdm()
        if not quiet and tqdm is not None and _is_terminal(self.stream):
            total = duration if duration is not None else examples
            self._bar = tqdm(total=total, unit="s" if duration is not None else " examples",
                             desc=label, file=self.stream, dynamic_ncols=True, leave=False,
                             bar_format="{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt}"
                                        " [{elapsed}<{remaining}{postfix}]")

    @property
    def drawing(self) -> bool:
        """True while a terminal bar is shown (plain lines are not printed then)."""
        return self._bar is not None

    def update(self, *, examples: int, seconds: float, line: str, postfix: str) -> None:
        """New counters: move the bar, or print ``line`` at most once a second."""
        if self.quiet:
            return
        if self._bar is not None:
            done = min(seconds, self.duration) if self.duration is not None else examples
            self._bar.n = round(done, 1) if self.duration is not None else done
            self._bar.set_postfix_str(postfix, refresh=False)
            self._bar.refresh()
            return
        now = time.monotonic()
        if now - self._last >= LINE_INTERVAL:
            self._last = now
            print(line, file=self.stream, flush=True)

    def write(self, line: str) -> None:
        """A message that must not be drawn over by the bar."""
        if self._bar is not None:
            self._bar.write(line, file=self.stream)
        else:
            self.stream.write(line + "\n")  # one write: a signal right after it must not
            self.stream.flush()  # leave the line unfinished

    def close(self) -> None:
        """Remove the bar (the summary follows it)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _is_terminal(stream: TextIO) -> bool:
    """A terminal with a width (a pseudo-terminal of zero columns cannot show a bar)."""
    try:
        return stream.isatty() and os.get_terminal_size(stream.fileno()).columns > 0
    except (AttributeError, ValueError, OSError):
        return False
