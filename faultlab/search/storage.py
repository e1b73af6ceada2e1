"""Where Hypothesis keeps its files during a faultlab run: not in the user's directory.

Hypothesis writes ``.hypothesis/`` into the current directory (its example
database, and caches such as the Unicode character map the text strategies
build), and it would appear wherever a user typed ``faultlab explore``.
faultlab needs none of it there: its machines run with ``database=None``
(:func:`faultlab.search.machine.machine_settings`; a finding is kept as a corpus
file, not as a Hypothesis example). So a run gives Hypothesis a private directory,
named after the pid as every run directory is (``faultlab-hypothesis-<pid>-XXXX``
under the temporary directory), and removes it at the end. A user who wants
Hypothesis's directory somewhere asks for it with ``HYPOTHESIS_STORAGE_DIRECTORY``,
which is honoured.

One thing is kept between runs: the Unicode character map (``unicode_data/``, a
few kilobytes that depend only on the interpreter's Unicode version), which
costs about 0.2 s of CPU to build, in every run and every job process that draws
text. It lives in faultlab's own cache directory (``$XDG_CACHE_HOME/faultlab`` or
``~/.cache/faultlab``), is copied into each private directory and, when a run
built one the cache lacked, copied back; any failure there only costs the
rebuild.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

#: Hypothesis's own variable for its directory; set, it is the user's choice.
VARIABLE = "HYPOTHESIS_STORAGE_DIRECTORY"
#: The part of Hypothesis's directory worth keeping between runs (see the module's text).
KEPT = "unicode_data"


def cache_directory() -> Path:
    """faultlab's own cache: ``$XDG_CACHE_HOME/faultlab``, else ``~/.cache/faultlab``."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "faultlab" / "hypothesis"


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
    try:
        _copy_new(cache_directory() / KEPT, Path(directory) / KEPT)
        os.environ[VARIABLE] = directory
        _tell_hypothesis(directory)
        yield directory
    finally:
        os.environ.pop(VARIABLE, None)
        _tell_hypothesis(None)
        _copy_new(Path(directory) / KEPT, cache_directory() / KEPT)
        shutil.rmtree(directory, ignore_errors=True)


def _copy_new(source: Path, target: Path) -> None:
    """Copy every file under ``source`` that ``target`` lacks, each made whole under a
    temporary name and then renamed (a reader never sees half a file; two runs copying at
    once both succeed). Best effort: a cache that cannot be read or written is rebuilt."""
    try:
        files = [path for path in source.rglob("*") if path.is_file()]
        for path in files:
            destination = target / path.relative_to(source)
            if destination.exists():
                continue
            destination.parent.mkdir(parents=True, exist_ok=True)
            descriptor, partial = tempfile.mkstemp(dir=destination.parent, prefix=".partial-")
            try:
                with os.fdopen(descriptor, "wb") as out:
                    out.write(path.read_bytes())
                os.replace(partial, destination)
            except BaseException:
                os.unlink(partial)
                raise
    except OSError:
        pass


def _tell_hypothesis(directory: str | None) -> None:
    """Set (or, with None, forget) the directory of an already imported Hypothesis."""
    configuration = sys.modules.get("hypothesis.configuration")
    setter = getattr(configuration, "set_hypothesis_home_dir", None)
    if callable(setter):
        setter(directory)
