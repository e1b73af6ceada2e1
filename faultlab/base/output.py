"""Every file and directory faultlab writes goes through here.

The rules, checked before any work starts and again at the moment of writing:

* an existing path that is not a regular file (a FIFO, a device, a directory, a
  socket) is refused with one line (exit 2), never replaced;
* an existing regular file is replaced only when it is recognisably faultlab's own
  output of the same :class:`Kind` (its first bytes carry the writer's signature);
  anything else (another program's file, a trace, faultlab's output of another
  kind, an empty file) is refused with one line (exit 2): faultlab never replaces
  a file that is not its own output;
* a symbolic link is written *through*: its target is replaced, the link stays;
  a link to nothing is refused;
* the file is written to a temporary file beside its target and renamed over it,
  so no reader (and no interruption) ever sees half a file;
* the new file gets the mode an ordinary ``open(path, "w")`` would give it: the
  mode of the file it replaces, or ``0o666`` less the umask (``mkstemp`` alone
  would make it ``0o600``);
* whether a directory is writable is tried for real (a file created and removed
  at once): ``os.access`` says yes to root for ``/proc``, where nothing can be made.

A write that fails after the run (the disk filled, the directory vanished) is an
:class:`~faultlab.base.errors.ExecutionError`: exit 3, one line.
"""

from __future__ import annotations

import json
import os
import re
import stat
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from faultlab.base import interrupt
from faultlab.base.errors import ExecutionError, UsageError

_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


#: How much of an existing file is read to tell whether faultlab wrote it.
SIGNATURE_BYTES = 4096


@dataclass(frozen=True)
class Kind:
    """One kind of output file, and how to recognise faultlab's own earlier one.

    ``signatures`` are patterns matched at the very start of the file's first
    :data:`SIGNATURE_BYTES` bytes; the writer of the kind defines them beside what it
    writes, so the two cannot drift apart unnoticed (tests write, then write again)."""

    name: str
    signatures: tuple[re.Pattern[bytes], ...]

    def made(self, path: Path) -> bool:
        """Whether the file at ``path`` is faultlab's own output of this kind (OSError when
        it cannot be read)."""
        with open(path, "rb") as stream:
            start = stream.read(SIGNATURE_BYTES)
        return any(signature.match(start) for signature in self.signatures)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _parent(path: Path) -> Path:
    return path.parent if str(path.parent) else Path(".")


def _target(path: Path, option: str, error: type[Exception]) -> Path:
    """The file a write to ``path`` replaces: the path itself, or what its link points to."""
    try:
        if not path.is_symlink():
            return path
    except OSError as problem:
        raise error(f"{option} {path}: {problem.strerror or problem}") from None
    target = Path(os.path.realpath(path))
    if not target.exists():
        raise error(f"{option} {path}: a symbolic link to {target}, which does not exist")
    return target


def _probe(directory: Path) -> str | None:
    """Create and remove a file in ``directory``; the reason it cannot, or None."""
    try:
        handle, name = tempfile.mkstemp(prefix=".faultlab-probe-", dir=directory)
    except OSError as problem:
        return problem.strerror or str(problem)
    os.close(handle)
    os.unlink(name)
    return None


def check_output_file(path: Path, option: str, kind: Kind) -> None:
    """Refuse (UsageError) an output file faultlab could not write or must not replace: an
    existing file that is not faultlab's own output of ``kind`` is never replaced."""
    target = _target(path, option, UsageError)
    try:
        info = target.stat()
    except FileNotFoundError:
        info = None
    except OSError as problem:
        raise UsageError(f"{option} {path}: {problem.strerror or problem}") from None
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise UsageError(f"{option} {path}: exists and is {_kind(info.st_mode)}, not a "
                         "regular file; give a file path")
    parent = _parent(target)
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: directory {parent} does not exist")
    reason = _probe(parent)
    if reason is not None:
        raise UsageError(f"{option} {path}: cannot create a file in {parent}: {reason}")
    if info is not None and not os.access(target, os.W_OK):
        raise UsageError(f"{option} {path}: not writable")
    if info is not None:
        try:
            ours = kind.made(target)
        except OSError as problem:
            raise UsageError(f"{option} {path}: exists and cannot be read to tell whether it "
                             f"is {kind.name}: {problem.strerror or problem}; refusing to "
                             "replace it") from None
        if not ours:
            raise UsageError(f"{option} {path}: exists and is not {kind.name}; refusing to "
                             "replace it")


def check_output_directory(path: Path, option: str = "--corpus") -> None:
    """Refuse a directory faultlab could not write into (it is created when first needed)."""
    existing = path
    while not os.path.lexists(existing):
        parent = _parent(existing)
        if parent == existing:
            break
        existing = parent
    try:
        info = existing.stat()  # follows a link to a directory
    except OSError as problem:
        raise UsageError(f"{option} {path}: {existing}: {problem.strerror or problem}") from None
    if not stat.S_ISDIR(info.st_mode):
        what = "exists and is" if existing == path else f"{existing} is"
        raise UsageError(f"{option} {path}: {what} {_kind(info.st_mode)}, not a directory")
    reason = _probe(existing)
    if reason is not None:
        raise UsageError(f"{option} {path}: cannot create files in {existing}: {reason}")


def check_new_directory(path: Path, option: str = "--directory") -> None:
    """Refuse a directory to create that exists (even as a dangling link) or cannot be made."""
    if os.path.lexists(path):
        raise UsageError(f"{option} {path}: already exists; give a path that does not exist")
    parent = _parent(path)
    if not parent.is_dir():
        raise UsageError(f"{option} {path}: parent directory {parent} does not exist")
    reason = _probe(parent)
    if reason is not None:
        raise UsageError(f"{option} {path}: parent directory {parent} is not writable: {reason}")


def _mode_for(target: Path) -> int:
    try:
        return stat.S_IMODE(target.stat().st_mode)  # replacing a file keeps its mode
    except OSError:
        mask = os.umask(0o022)
        os.umask(mask)
        return 0o666 & ~mask


def write_text(path: Path, text: str, *, final: bool = False, kind: Kind | None = None) -> None:
    """Write ``text`` to ``path`` atomically, through a symbolic link, honouring the umask.

    ``final`` marks the run's result: once the file is renamed into place a signal no
    longer turns the run into an interrupted one (the result was committed). A signal
    that arrives before the rename removes the temporary file and stops the run.
    ``kind``: an existing file is replaced only when it is faultlab's own output of that
    kind (checked before the run by :func:`check_output_file`, and again here: a file
    that appeared meanwhile is left alone).
    """
    _write(path, lambda stream: stream.write(text), final=final, kind=kind)


def write_json(path: Path, data: Any, *, final: bool = False, kind: Kind | None = None) -> None:
    """:func:`write_text` of ``data`` as indented JSON with a final newline, serialised
    straight into the temporary file."""

    def fill(stream: IO[str]) -> None:
        json.dump(data, stream, indent=2)
        stream.write("\n")

    _write(path, fill, final=final, kind=kind)


def _write(path: Path, fill: Callable[[IO[str]], object], *, final: bool,
           kind: Kind | None) -> None:
    target = _target(path, str(path), ExecutionError)
    if target.exists() and not target.is_file():
        raise ExecutionError(f"{path}: became {_kind(target.stat().st_mode)}; not replaced")
    if kind is not None and target.exists():
        try:
            ours = kind.made(target)
        except OSError as problem:
            raise ExecutionError(f"cannot read {path}: {problem.strerror or problem}; "
                                 "not replaced") from None
        if not ours:
            raise ExecutionError(f"{path}: became a file that is not {kind.name}; not replaced")
    with interrupt.deferred():
        temporary: str | None = None
        try:
            handle, temporary = tempfile.mkstemp(prefix=f".{target.name}.",
                                                 dir=_parent(target))
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                os.fchmod(stream.fileno(), _mode_for(target))
                fill(stream)
                stream.flush()
                os.fsync(stream.fileno())
            interrupt.check()  # the last moment a signal can still stop the write
            os.replace(temporary, target)
            temporary = None
            if final:
                interrupt.finished()
        except OSError as problem:
            raise ExecutionError(f"cannot write {path}: {problem.strerror or problem}") from None
        finally:
            if temporary is not None:
                Path(temporary).unlink(missing_ok=True)
