"""Where Hypothesis keeps its files during a faultlab run: not in the user's directory.

Hypothesis writes ``.hypothesis/`` into the current directory (its example
database, and caches such as the Unicode character map the text strategies
build), and it would appear wherever a user typed ``faultlab explore``.
faultlab needs none of it there: its machines run with ``database=None``
(:func:`faultlab.search.machine.machine_settings`; a finding is kept as a corpus
file, not as a Hypothesis example), and the caches are rebuilt in a fraction of
a second. So a run gives Hypothesis a private directory, named after the pid as
every run directory is (``faultlab-hypothesis-<pid>-XXXX`` under the temporary
directory), and removes it at the end. A user who wants Hypothesis's directory
somewhere asks for it with ``HYPOTHESIS_STORAGE_DIRECTORY``, which is honoured.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager

#: Hypothesis's own variable for its directory; set, it is the user's choice.
VARIABLE = "HYPOTHESIS_STORAGE_DIRECTORY"


@contextmanager
def private_storage() -> Iterator[str | None]:
    """Point Hypothesis at a fresh directory of this run for the ``with`` body (yielded;
    None when the user chose one with :data:`VARIABLE`), and remove it afterwards.

    The variable reaches every process the run starts (job processes, exec-mode
    workers); a Hypothesis already imported here is told directly, since it reads the
    variable only once.
    """
    if os.environ.get(VARIABLE):
        yield None
        return
    directory = tempfile.mkdtemp(prefix=f"faultlab-hypothesis-{os.getpid()}-")
    os.environ[VARIABLE] = directory
    _tell_hypothesis(directory)
    try:
        yield directory
    finally:
        os.environ.pop(VARIABLE, None)
        _tell_hypothesis(None)
        shutil.rmtree(directory, ignore_errors=True)


def _tell_hypothesis(directory: str | None) -> None:
    """Set (or, with None, forget) the directory of an already imported Hypothesis."""
    configuration = sys.modules.get("hypothesis.configuration")
    setter = getattr(configuration, "set_hypothesis_home_dir", None)
    if callable(setter):
        setter(directory)
