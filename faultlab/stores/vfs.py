"""A recording SQLite VFS that makes a power cut possible, not just a process death.

Why this exists: faultlab's crashes are SIGKILLs. The kernel's page cache
belongs to the machine, not to the process, so everything a killed process
wrote is still readable afterwards whether it was synced or not. A store
configured to lose data on power failure (``synchronous=NORMAL`` in WAL mode,
``synchronous=OFF``) therefore passes every crash check. To model the loss of
unsynced writes, the process that uses SQLite records, as it goes, every change
SQLite makes to its files and every sync; after the processes are dead,
:func:`power_image` rebuilds the files as a power cut of the machine could have
left them.

How: :func:`install` registers, as the process's default, a VFS that wraps the
default ``"unix"`` VFS. Python's :mod:`sqlite3` links the same
``libsqlite3.so.0`` that :mod:`ctypes` loads, so every later
:func:`sqlite3.connect` in the process goes through it (install checks this).
For the files that hold durable state (main database, rollback journal, WAL,
super-journal) the wrapper interposes its own ``sqlite3_io_methods`` and
delegates every method to the real file, embedded in the wrapper's file struct.
Before a write, a truncate or a delete reaches the real VFS, it appends an undo
record to ``<log_directory>/vfs.log``: the range, the bytes that were there and
the old size. After a sync returns, it appends a sync marker. Each record is a
single unbuffered ``os.write`` on an ``O_APPEND`` descriptor, so the log is
exact whenever the process is SIGKILLed (the page cache survives that) and the
records of several processes sharing one log never interleave. A SIGKILL can
cut short the record being written at that instant (Linux stops a large write
at a page boundary when a fatal signal is pending); that record's change never
reached the file (the record is written first), and other processes may append
after the stump, so every record carries a CRC-32 and a reader skips a damaged
stump to the next valid record.

What a rebuild models: the machine loses power at the instant of the last
record. Every change covered by a later sync of its file survives; the others
("unsynced", per file, in the order they were made) survive according to a
*choice*, plain JSON data so a trace can store it and Hypothesis can draw it:

``{"kind": "drop_all"}``
    None of the unsynced changes reached the disk.
``{"kind": "prefix", "keep": n}``
    The first ``n`` unsynced changes of every file reached the disk, in order
    (a write-back that was under way, in order, when the power went).
``{"kind": "torn", "keep": n, "sector": 512}``
    The first ``n`` reached the disk and, of change ``n`` when it is a write,
    only its first sector-aligned part: the bytes up to the first multiple of
    ``sector`` after its offset (``"sectors": k`` keeps up to the ``k``-th
    boundary). A write that fits in that part is kept whole: a sector is
    atomic. A torn write that extended the file extends it only as far as the
    part kept.
``{"kind": "reorder", "drop": i}``
    Every unsynced change except the ``i``-th of each file reached the disk
    (the device or the write-back reordered writes and the one left out was
    still in flight).

Deletes and creations of journal files are changes too (the directory entry is
file-system metadata): an unlink that SQLite did not follow with a directory
sync can be undone by a power cut, bringing the journal back. They become
durable when SQLite syncs the directory: after a delete with ``syncDir`` set,
and at the first sync of a journal or WAL opened with ``SQLITE_OPEN_CREATE``
(which is when the unix VFS fsyncs the directory). A sync of a file also makes
every earlier change to that path durable, its creation included.

What it does not model: a drive's own volatile write cache (a sync is taken as
durable the moment it returns, as with a drive that honours flushes);
file-system metadata other than the creation and deletion of SQLite's files
(ordering of size updates against data: a write that extended a file and is
kept extends it, one that is dropped does not; rename; inode allocation); the
kernel writing dirty pages back on its own before the power cut (use
``prefix``/``reorder`` to draw some of them, or :func:`settle` to declare all
of them written); damage outside the range being written (SQLite's
powersafe-overwrite assumption is taken as true); the ``-shm`` file, which is
memory-mapped and not durable state: after a power cut SQLite rebuilds it from
the WAL, so a rebuild deletes it. Temporary files, in-memory databases and
files opened read-only are not recorded (they hold no durable state or cannot
change). Connections opened before :func:`install` do not go through the VFS.

What it shows (tests/test_power_vfs.py, 50 commits, a power cut after the
last): WAL + FULL or EXTRA loses none; WAL + NORMAL and OFF lose all 50 (the
WAL is synced only at checkpoints); a rollback journal loses exactly the last
commit when its commit point is not synced, as pager.c says: DELETE + FULL or
NORMAL (the unlink gets a directory sync only with EXTRA), TRUNCATE + NORMAL;
DELETE + EXTRA, TRUNCATE + FULL and PERSIST + FULL or NORMAL lose none. Torn
and reordered writes never corrupt a WAL database (frames are checksummed);
with a rollback journal and OFF some outcomes are corrupt, which
:func:`opens_cleanly` reports.

Limits. Each file's unsynced changes are chosen independently (the same ``n``
or ``i`` applies to each file's own list); no order between files is imposed
beyond their syncs. With several processes sharing a file, a record is logged
before its write reaches the file and a sync marker after the sync returns, so
a sync racing another process's write may be credited with that write: the
model can then keep a change a real power cut might lose, never the other way
round; a process killed between a sync returning and its marker loses the
credit, but SQLite had not acknowledged that commit yet. The log grows with
every change (old bytes of every overwrite; appends cost only their header)
until :func:`power_image` or :func:`settle` clears it. :func:`power_image`
rebuilds files at their recorded absolute paths: move nothing in between, or move the
log with them and :func:`relocate` it.

Only the standard library is used. The module imports nothing from faultlab so
that it can be loaded early in a worker process.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import fcntl
import gc
import hashlib
import os
import sqlite3
import struct
import sys
import threading
import zlib
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faultlab.stores.power_choice import Choice, parse_choice

__all__ = [
    "LOG_NAME",
    "PowerImageError",
    "RecorderBusy",
    "VfsError",
    "choices",
    "install",
    "installed_directory",
    "keep_wal_on_close",
    "opens_cleanly",
    "power_image",
    "relocate",
    "settle",
    "summary",
    "uninstall",
    "unsynced_digest",
]

#: The log file inside a log directory.
LOG_NAME = "vfs.log"
#: A file every recording process holds a shared ``flock`` on, so that
#: :func:`power_image` can refuse to rebuild files a live process still writes.
LOCK_NAME = "vfs.lock"
#: Where faultlab tells a worker of a trace with power steps to record: the log directory.
#: Set in every worker's environment, a system's own programs included.
LOG_VARIABLE = "FAULTLAB_POWER_LOG"
#: The name the wrapping VFS is registered under.
VFS_NAME = b"faultlab-power"


class VfsError(RuntimeError):
    """The recording VFS cannot be installed or used as asked."""


class RecorderBusy(VfsError):
    """A live process still records into the log directory; a rebuild now would race it."""


class PowerImageError(VfsError):
    """The files on disk do not match the log (changed outside the recording VFS)."""


# --- SQLite constants (sqlite3.h) -------------------------------------------------------------

_SQLITE_OK = 0
_SQLITE_IOERR = 10
_SQLITE_IOERR_SHORT_READ = _SQLITE_IOERR | (2 << 8)
_SQLITE_IOERR_WRITE = _SQLITE_IOERR | (3 << 8)
_SQLITE_IOERR_TRUNCATE = _SQLITE_IOERR | (6 << 8)
_SQLITE_IOERR_DELETE = _SQLITE_IOERR | (10 << 8)
_SQLITE_IOERR_CLOSE = _SQLITE_IOERR | (16 << 8)
_SQLITE_CANTOPEN = 14

_OPEN_READONLY = 0x00000001
_OPEN_CREATE = 0x00000004
_OPEN_DELETEONCLOSE = 0x00000008
_OPEN_MAIN_DB = 0x00000100
_OPEN_MAIN_JOURNAL = 0x00000800
_OPEN_SUPER_JOURNAL = 0x00004000
_OPEN_WAL = 0x00080000
#: The file types that hold durable state: the only ones recorded.
_RECORDED_TYPES = _OPEN_MAIN_DB | _OPEN_MAIN_JOURNAL | _OPEN_SUPER_JOURNAL | _OPEN_WAL
#: Opened with SQLITE_OPEN_CREATE, these get a directory fsync at their first sync (os_unix.c).
_DIRSYNC_TYPES = _OPEN_MAIN_JOURNAL | _OPEN_SUPER_JOURNAL | _OPEN_WAL

_FCNTL_SIZE_HINT = 5

# --- ctypes prototypes ------------------------------------------------------------------------

_int = ctypes.c_int
_i64 = ctypes.c_int64
_ptr = ctypes.c_void_p

_X_OPEN = ctypes.CFUNCTYPE(_int, _ptr, _ptr, _ptr, _int, _ptr)
_X_DELETE = ctypes.CFUNCTYPE(_int, _ptr, _ptr, _int)
_X_CLOSE = ctypes.CFUNCTYPE(_int, _ptr)
_X_READ = ctypes.CFUNCTYPE(_int, _ptr, _ptr, _int, _i64)
_X_WRITE = ctypes.CFUNCTYPE(_int, _ptr, _ptr, _int, _i64)
_X_TRUNCATE = ctypes.CFUNCTYPE(_int, _ptr, _i64)
_X_SYNC = ctypes.CFUNCTYPE(_int, _ptr, _int)
_X_FILE_SIZE = ctypes.CFUNCTYPE(_int, _ptr, _ptr)
_X_LOCK = ctypes.CFUNCTYPE(_int, _ptr, _int)
_X_UNLOCK = ctypes.CFUNCTYPE(_int, _ptr, _int)
_X_CHECK_RESERVED_LOCK = ctypes.CFUNCTYPE(_int, _ptr, _ptr)
_X_FILE_CONTROL = ctypes.CFUNCTYPE(_int, _ptr, _int, _ptr)
_X_SECTOR_SIZE = ctypes.CFUNCTYPE(_int, _ptr)
_X_DEVICE_CHARACTERISTICS = ctypes.CFUNCTYPE(_int, _ptr)
_X_SHM_MAP = ctypes.CFUNCTYPE(_int, _ptr, _int, _int, _int, _ptr)
_X_SHM_LOCK = ctypes.CFUNCTYPE(_int, _ptr, _int, _int, _int)
_X_SHM_BARRIER = ctypes.CFUNCTYPE(None, _ptr)
_X_SHM_UNMAP = ctypes.CFUNCTYPE(_int, _ptr, _int)
_X_FETCH = ctypes.CFUNCTYPE(_int, _ptr, _i64, _int, _ptr)
_X_UNFETCH = ctypes.CFUNCTYPE(_int, _ptr, _i64, _ptr)

#: sqlite3_io_methods after iVersion, in order, with the version that introduced each.
_IO_FIELDS: tuple[tuple[str, Any, int], ...] = (
    ("xClose", _X_CLOSE, 1),
    ("xRead", _X_READ, 1),
    ("xWrite", _X_WRITE, 1),
    ("xTruncate", _X_TRUNCATE, 1),
    ("xSync", _X_SYNC, 1),
    ("xFileSize", _X_FILE_SIZE, 1),
    ("xLock", _X_LOCK, 1),
    ("xUnlock", _X_UNLOCK, 1),
    ("xCheckReservedLock", _X_CHECK_RESERVED_LOCK, 1),
    ("xFileControl", _X_FILE_CONTROL, 1),
    ("xSectorSize", _X_SECTOR_SIZE, 1),
    ("xDeviceCharacteristics", _X_DEVICE_CHARACTERISTICS, 1),
    ("xShmMap", _X_SHM_MAP, 2),
    ("xShmLock", _X_SHM_LOCK, 2),
    ("xShmBarrier", _X_SHM_BARRIER, 2),
    ("xShmUnmap", _X_SHM_UNMAP, 2),
    ("xFetch", _X_FETCH, 3),
    ("xUnfetch", _X_UNFETCH, 3),
)


class _IoMethods(ctypes.Structure):
    """struct sqlite3_io_methods, version 3, function pointers as raw addresses."""

    _fields_ = [("iVersion", _int)] + [(name, _ptr) for name, _, _ in _IO_FIELDS]


class _Vfs(ctypes.Structure):
    """struct sqlite3_vfs, version 3, function pointers as raw addresses."""

    _fields_ = [
        ("iVersion", _int),
        ("szOsFile", _int),
        ("mxPathname", _int),
        ("pNext", _ptr),
        ("zName", _ptr),
        ("pAppData", _ptr),
        ("xOpen", _ptr),
        ("xDelete", _ptr),
        ("xAccess", _ptr),
        ("xFullPathname", _ptr),
        ("xDlOpen", _ptr),
        ("xDlError", _ptr),
        ("xDlSym", _ptr),
        ("xDlClose", _ptr),
        ("xRandomness", _ptr),
        ("xSleep", _ptr),
        ("xCurrentTime", _ptr),
        ("xGetLastError", _ptr),
        ("xCurrentTimeInt64", _ptr),
        ("xSetSystemCall", _ptr),
        ("xGetSystemCall", _ptr),
        ("xNextSystemCall", _ptr),
    ]


#: The wrapper's sqlite3_file: {pMethods, handle number, the real file...}. The real file
#: starts 16 bytes in (8-byte aligned like any struct SQLite allocates).
_REAL_OFFSET = 16

# --- log records ------------------------------------------------------------------------------

#: magic, kind, flag, path length, a, b, c, body length, CRC-32 of the rest of the header,
#: the path and the body; then the path, then the body.
_HEADER = struct.Struct("<2sBBHqqqQI")
_UNCHECKED = struct.Struct("<2sBBHqqqQ")
_MAGIC = b"FV"
_WRITE = 1  # a=offset, b=length, c=old size, body=old bytes (the part below the old size)
_RESIZE = 2  # a=requested size, c=old size, body=the bytes cut off (from a to c)
_SYNC = 3  # the path's changes so far are durable
_DELETE = 4  # flag=syncDir, c=old size, body=the content deleted
_CREATE = 5  # the path did not exist before this open created it
_DIRSYNC = 6  # path=a directory: creations and deletions in it so far are durable
_KINDS = {_WRITE, _RESIZE, _SYNC, _DELETE, _CREATE, _DIRSYNC}
_CHANGES = {_WRITE, _RESIZE, _DELETE, _CREATE}


@dataclass
class _Recorder:
    """Where this process records: the log directory and the descriptors held open on it."""

    directory: str
    log_fd: int
    lock_fd: int

    def append(self, kind: int, path: bytes, a: int = 0, b: int = 0, c: int = 0,
               body: bytes = b"", flag: int = 0) -> None:
        """Append one record with one write: atomic against other appenders, unbuffered."""
        fields = _UNCHECKED.pack(_MAGIC, kind, flag, len(path), a, b, c, len(body))
        crc = zlib.crc32(body, zlib.crc32(path, zlib.crc32(fields)))
        record = fields + struct.pack("<I", crc) + path + body
        view = memoryview(record)
        while view:
            written = os.write(self.log_fd, view)
            view = view[written:]


class _RealMethods:
    """The real file's io_methods as callable ctypes functions (None past its version)."""

    def __init__(self, address: int) -> None:
        version = _int.from_address(address).value
        table = _IoMethods.from_address(address)
        self.version = min(version, 3)
        self.functions: dict[str, Any] = {}
        for name, prototype, since in _IO_FIELDS:
            pointer = getattr(table, name) if since <= self.version else None
            self.functions[name] = prototype(pointer) if pointer else None
        self.close = self.functions["xClose"]
        self.read = self.functions["xRead"]
        self.write = self.functions["xWrite"]
        self.truncate = self.functions["xTruncate"]
        self.sync = self.functions["xSync"]
        self.file_size = self.functions["xFileSize"]
        self.lock = self.functions["xLock"]
        self.unlock = self.functions["xUnlock"]
        self.check_reserved_lock = self.functions["xCheckReservedLock"]
        self.file_control = self.functions["xFileControl"]
        self.sector_size = self.functions["xSectorSize"]
        self.device_characteristics = self.functions["xDeviceCharacteristics"]
        self.shm_map = self.functions["xShmMap"]
        self.shm_lock = self.functions["xShmLock"]
        self.shm_barrier = self.functions["xShmBarrier"]
        self.shm_unmap = self.functions["xShmUnmap"]
        self.fetch = self.functions["xFetch"]
        self.unfetch = self.functions["xUnfetch"]


@dataclass
class _Handle:
    """One open recorded file: the real file inside the wrapper, its methods, its path."""

    real: int
    methods: _RealMethods
    path: bytes
    dirsync: bool


# Everything below is referenced from module globals forever: SQLite holds raw pointers to
# the structs and callbacks, and a garbage-collected callback would be a jump into freed memory.
_KEEP: list[object] = []
_HANDLES: dict[int, _Handle] = {}
_REAL_METHODS: dict[int, _RealMethods] = {}
_WRAPPER_METHODS: dict[int, _IoMethods] = {}
_INSTALL_LOCK = threading.Lock()
_state: dict[str, Any] = {
    "library": None,  # ctypes.CDLL of libsqlite3
    "real_vfs": None,  # address of the "unix" VFS
    "real_open": None,
    "real_delete": None,
    "vfs": None,  # our _Vfs struct
    "recorder": None,  # _Recorder or None
    "probe": None,  # a path xOpen passes through unrecorded (install's self-check)
    "opens": 0,  # xOpen calls seen, for install's self-check
    "handles": 0,
    "at_exit": False,  # _close_connections_at_exit registered in this process
}


def _recorder() -> _Recorder | None:
    recorder: _Recorder | None = _state["recorder"]
    return recorder


def _handle(file: int | None) -> _Handle:
    if file is None:
        raise VfsError("SQLite passed a NULL sqlite3_file")
    return _HANDLES[file]


def _size(path: bytes) -> int:
    return os.stat(path).st_size


def _read_real(handle: _Handle, offset: int, length: int) -> bytes:
    """Read through the real file (never a second descriptor: closing one would drop the
    process's POSIX locks on the database, see os_unix.c)."""
    if length <= 0:
        return b""
    buffer = ctypes.create_string_buffer(length)
    rc = handle.methods.read(handle.real, buffer, length, offset)
    if rc not in (_SQLITE_OK, _SQLITE_IOERR_SHORT_READ):
        raise VfsError(f"reading {handle.path!r} to record it failed: SQLite code {rc}")
    return buffer.raw


# --- the VFS's own methods ---------------------------------------------------------------------


def _x_open(vfs: int | None, name: int | None, file: int | None, flags: int,
            out_flags: int | None) -> int:
    try:
        if file is None:
            return _SQLITE_CANTOPEN
        real_vfs = _state["real_vfs"]
        real_open = _state["real_open"]
        _state["opens"] += 1
        path = ctypes.string_at(name) if name else b""
        recorded = (bool(path) and flags & _RECORDED_TYPES != 0
                    and not flags & (_OPEN_DELETEONCLOSE | _OPEN_READONLY)
                    and path != _state["probe"])
        if not recorded:
            # The real file takes the wrapper's place: SQLite then calls the real methods
            # directly and this file costs nothing.
            rc: int = real_open(real_vfs, name, file, flags, out_flags)
            return rc
        existed = os.path.exists(path)
        ctypes.c_void_p.from_address(file).value = None
        real = file + _REAL_OFFSET
        rc = real_open(real_vfs, name, real, flags, out_flags)
        if rc != _SQLITE_OK:
            return rc
        methods_address = ctypes.c_void_p.from_address(real).value
        if not methods_address:
            return rc
        methods = _REAL_METHODS.get(methods_address)
        if methods is None:
            methods = _REAL_METHODS[methods_address] = _RealMethods(methods_address)
        wrapper = _wrapper_methods(methods.version)
        _state["handles"] += 1
        ctypes.c_int64.from_address(file + 8).value = _state["handles"]
        _HANDLES[file] = _Handle(
            real=real, methods=methods, path=path,
            dirsync=bool(flags & _OPEN_CREATE) and bool(flags & _DIRSYNC_TYPES))
        ctypes.c_void_p.from_address(file).value = ctypes.addressof(wrapper)
        recorder = _recorder()
        if recorder is not None and not existed:
            recorder.append(_CREATE, path)
        return _SQLITE_OK
    except BaseException:  # noqa: BLE001 - an exception must not cross into C
        return _SQLITE_CANTOPEN


def _x_delete(vfs: int | None, name: int | None, sync_dir: int) -> int:
    try:
        real_delete = _state["real_delete"]
        recorder = _recorder()
        path = ctypes.string_at(name) if name else b""
        if recorder is not None and path and os.path.isfile(path):
            # Opening the file to read it is safe here: SQLite deletes journals and WALs,
            # on which it holds no POSIX locks.
            with open(path, "rb") as handle:
                content = handle.read()
            recorder.append(_DELETE, path, c=len(content), body=content, flag=1 if sync_dir else 0)
        rc: int = real_delete(_state["real_vfs"], name, sync_dir)
        if rc == _SQLITE_OK and sync_dir and recorder is not None and path:
            recorder.append(_DIRSYNC, os.path.dirname(path))
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR_DELETE


# --- the io_methods of a recorded file ---------------------------------------------------------


def _x_close(file: int | None) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.close(handle.real)
        if file is not None:
            del _HANDLES[file]
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR_CLOSE


def _x_read(file: int | None, buffer: int | None, amount: int, offset: int) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.read(handle.real, buffer, amount, offset)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_write(file: int | None, buffer: int | None, amount: int, offset: int) -> int:
    try:
        handle = _handle(file)
        recorder = _recorder()
        if recorder is not None:
            old_size = _size(handle.path)
            old = _read_real(handle, offset, min(amount, old_size - offset))
            recorder.append(_WRITE, handle.path, a=offset, b=amount, c=old_size, body=old)
        rc: int = handle.methods.write(handle.real, buffer, amount, offset)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR_WRITE


def _x_truncate(file: int | None, size: int) -> int:
    try:
        handle = _handle(file)
        recorder = _recorder()
        if recorder is not None:
            old_size = _size(handle.path)
            if size != old_size:  # SQLite often truncates to the size a file already has
                cut = _read_real(handle, size, old_size - size)
                recorder.append(_RESIZE, handle.path, a=size, c=old_size, body=cut)
        rc: int = handle.methods.truncate(handle.real, size)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR_TRUNCATE


def _x_sync(file: int | None, flags: int) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.sync(handle.real, flags)
        recorder = _recorder()
        if rc == _SQLITE_OK and recorder is not None:
            recorder.append(_SYNC, handle.path)
            if handle.dirsync:
                recorder.append(_DIRSYNC, os.path.dirname(handle.path))
        if rc == _SQLITE_OK:
            handle.dirsync = False
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_file_size(file: int | None, size: int | None) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.file_size(handle.real, size)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_lock(file: int | None, level: int) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.lock(handle.real, level)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_unlock(file: int | None, level: int) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.unlock(handle.real, level)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_check_reserved_lock(file: int | None, out: int | None) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.check_reserved_lock(handle.real, out)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_file_control(file: int | None, op: int, argument: int | None) -> int:
    try:
        handle = _handle(file)
        recorder = _recorder()
        if op == _FCNTL_SIZE_HINT and recorder is not None and argument:
            # The unix VFS may grow the file here (chunk size, mmap) without xWrite or
            # xTruncate; a growth that happened is recorded as a resize.
            old_size = _size(handle.path)
            rc: int = handle.methods.file_control(handle.real, op, argument)
            if _size(handle.path) != old_size:
                recorder.append(_RESIZE, handle.path, a=_size(handle.path), c=old_size)
            return rc
        rc = handle.methods.file_control(handle.real, op, argument)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_sector_size(file: int | None) -> int:
    try:
        handle = _handle(file)
        size: int = handle.methods.sector_size(handle.real)
        return size
    except BaseException:  # noqa: BLE001
        return 4096


def _x_device_characteristics(file: int | None) -> int:
    try:
        handle = _handle(file)
        flags: int = handle.methods.device_characteristics(handle.real)
        return flags
    except BaseException:  # noqa: BLE001
        return 0


def _x_shm_map(file: int | None, page: int, page_size: int, extend: int,
               out: int | None) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.shm_map(handle.real, page, page_size, extend, out)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_shm_lock(file: int | None, offset: int, count: int, flags: int) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.shm_lock(handle.real, offset, count, flags)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_shm_barrier(file: int | None) -> None:
    try:
        handle = _handle(file)
        handle.methods.shm_barrier(handle.real)
    except BaseException:  # noqa: BLE001, S110 - a barrier has no way to report an error
        pass


def _x_shm_unmap(file: int | None, delete: int) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.shm_unmap(handle.real, delete)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_fetch(file: int | None, offset: int, amount: int, out: int | None) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.fetch(handle.real, offset, amount, out)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


def _x_unfetch(file: int | None, offset: int, pointer: int | None) -> int:
    try:
        handle = _handle(file)
        rc: int = handle.methods.unfetch(handle.real, offset, pointer)
        return rc
    except BaseException:  # noqa: BLE001
        return _SQLITE_IOERR


_IO_CALLBACKS: dict[str, Any] = {
    "xClose": _X_CLOSE(_x_close),
    "xRead": _X_READ(_x_read),
    "xWrite": _X_WRITE(_x_write),
    "xTruncate": _X_TRUNCATE(_x_truncate),
    "xSync": _X_SYNC(_x_sync),
    "xFileSize": _X_FILE_SIZE(_x_file_size),
    "xLock": _X_LOCK(_x_lock),
    "xUnlock": _X_UNLOCK(_x_unlock),
    "xCheckReservedLock": _X_CHECK_RESERVED_LOCK(_x_check_reserved_lock),
    "xFileControl": _X_FILE_CONTROL(_x_file_control),
    "xSectorSize": _X_SECTOR_SIZE(_x_sector_size),
    "xDeviceCharacteristics": _X_DEVICE_CHARACTERISTICS(_x_device_characteristics),
    "xShmMap": _X_SHM_MAP(_x_shm_map),
    "xShmLock": _X_SHM_LOCK(_x_shm_lock),
    "xShmBarrier": _X_SHM_BARRIER(_x_shm_barrier),
    "xShmUnmap": _X_SHM_UNMAP(_x_shm_unmap),
    "xFetch": _X_FETCH(_x_fetch),
    "xUnfetch": _X_UNFETCH(_x_unfetch),
}
_VFS_CALLBACKS: dict[str, Any] = {"xOpen": _X_OPEN(_x_open), "xDelete": _X_DELETE(_x_delete)}
_KEEP.extend(_IO_CALLBACKS.values())
_KEEP.extend(_VFS_CALLBACKS.values())
# At interpreter exit (Python 3.12 and later in particular) the module's globals are cleared
# and unreferenced objects freed while a connection of the program may still be open: one
# more reference, never dropped, keeps the callbacks and structs SQLite points to alive until
# the process is gone, so a late call fails cleanly instead of jumping into freed memory.
for _pinned in (_KEEP, _HANDLES, _REAL_METHODS, _WRAPPER_METHODS, _state):
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(_pinned))
del _pinned


def _close_connections_at_exit() -> None:
    """Close the program's open connections while this module still works.

    A connection left open is otherwise closed while the interpreter tears its modules down,
    after this module's globals are gone: the writes SQLite makes at close (the WAL's
    checkpoint, the journal's deletion) would then go unrecorded, and the callbacks would
    fail. Closing at exit is what the teardown would do anyway (an open transaction rolls
    back), only earlier, while everything it writes is still recorded. Runs as an
    :mod:`atexit` handler, so after every handler registered later than :func:`install`.
    """
    for candidate in gc.get_objects():
        if isinstance(candidate, sqlite3.Connection):
            try:
                candidate.close()
            except Exception:  # noqa: BLE001 - a connection of another thread, or closed
                pass


def _wrapper_methods(version: int) -> _IoMethods:
    """The wrapper's io_methods with the real file's version: SQLite decides from iVersion
    whether WAL (shm) and mmap (fetch) are available, so it must be the real one's."""
    methods = _WRAPPER_METHODS.get(version)
    if methods is None:
        methods = _IoMethods()
        methods.iVersion = version
        for name, _, since in _IO_FIELDS:
            if since <= version:
                setattr(methods, name, ctypes.cast(_IO_CALLBACKS[name], _ptr).value)
        _WRAPPER_METHODS[version] = methods
        _KEEP.append(methods)
    return methods


def _library() -> ctypes.CDLL:
    """The libsqlite3 the :mod:`sqlite3` module runs on, loaded through ctypes once per
    process image.

    Opened through the module's own extension (a ``dlopen`` of a loaded library returns
    it, and its symbols resolve in it and in the libraries it links), so it is the very
    copy :mod:`sqlite3` uses, found without a search. Only when that finds no SQLite is
    the library searched for by name (``ctypes.util.find_library``, which runs
    ``ldconfig``: about 3 ms in a forked worker, which every recording worker paid when
    that was the only way).
    """
    library: ctypes.CDLL | None = _state["library"]
    if library is None:
        library = _linked_library()
        if library is None:
            name = ctypes.util.find_library("sqlite3")
            if name is None:
                raise VfsError("libsqlite3 not found: the recording VFS needs the shared "
                               "library")
            library = ctypes.CDLL(name)
        library.sqlite3_vfs_find.restype = _ptr
        library.sqlite3_vfs_find.argtypes = [ctypes.c_char_p]
        library.sqlite3_vfs_register.restype = _int
        library.sqlite3_vfs_register.argtypes = [_ptr, _int]
        library.sqlite3_libversion.restype = ctypes.c_char_p
        library.sqlite3_libversion.argtypes = []
        version = library.sqlite3_libversion().decode()
        if version != sqlite3.sqlite_version:
            raise VfsError(f"ctypes loaded SQLite {version} but the sqlite3 module uses "
                           f"{sqlite3.sqlite_version}: a VFS registered here would not apply")
        _state["library"] = library
    return library


def _linked_library() -> ctypes.CDLL | None:
    """SQLite as the :mod:`sqlite3` module's extension links it, or None (an interpreter
    with the extension built in, or a library that does not export SQLite's functions)."""
    path = getattr(sys.modules.get("_sqlite3"), "__file__", None)
    if not path:
        return None
    try:
        library = ctypes.CDLL(path)
        for function in ("sqlite3_libversion", "sqlite3_vfs_find", "sqlite3_vfs_register"):
            getattr(library, function)
    except (OSError, AttributeError):
        return None
    return library


def preload() -> None:
    """Load SQLite through ctypes and build the wrapping VFS, not registered, in a process
    whose forked children will record (the fork server, the lanes' helper): each child
    then registers it as it installs, with nothing to look up or build."""
    _build()


def _register() -> None:
    """Make our sqlite3_vfs (built once per process image) the default."""
    vfs = _build()
    if not _state["at_exit"]:
        atexit.register(_close_connections_at_exit)
        _state["at_exit"] = True
    rc = _library().sqlite3_vfs_register(ctypes.addressof(vfs), 1)
    if rc != _SQLITE_OK:
        raise VfsError(f"sqlite3_vfs_register failed: SQLite code {rc}")


def _build() -> _Vfs:
    """Our sqlite3_vfs, built from the real one once per process image."""
    library = _library()
    vfs: _Vfs | None = _state["vfs"]
    if vfs is None:
        real_address = library.sqlite3_vfs_find(b"unix")
        if not real_address:
            raise VfsError("SQLite has no 'unix' VFS to wrap")
        real = _Vfs.from_address(real_address)
        if real.iVersion < 1:
            raise VfsError(f"the 'unix' VFS has version {real.iVersion}")
        vfs = _Vfs()
        # Copy the fields the real version has (the methods we do not wrap are the real
        # ones, called with our sqlite3_vfs: the unix VFS reads only mxPathname and
        # pAppData from it, both copied), then override ours.
        version = min(real.iVersion, 3)
        copied = {1: _Vfs.xCurrentTimeInt64.offset, 2: _Vfs.xSetSystemCall.offset,
                  3: ctypes.sizeof(_Vfs)}[version]
        ctypes.memmove(ctypes.addressof(vfs), real_address, copied)
        vfs.iVersion = version
        vfs.szOsFile = real.szOsFile + _REAL_OFFSET
        vfs.pNext = None
        name = ctypes.create_string_buffer(VFS_NAME)
        _KEEP.append(name)
        vfs.zName = ctypes.addressof(name)
        vfs.xOpen = ctypes.cast(_VFS_CALLBACKS["xOpen"], _ptr).value
        vfs.xDelete = ctypes.cast(_VFS_CALLBACKS["xDelete"], _ptr).value
        _state["real_vfs"] = real_address
        _state["real_open"] = _X_OPEN(real.xOpen)
        _state["real_delete"] = _X_DELETE(real.xDelete)
        _state["vfs"] = vfs
        _KEEP.extend([vfs, _state["real_open"], _state["real_delete"]])
    return vfs


def _probe(directory: str) -> None:
    """Check that sqlite3.connect really goes through the VFS: if the sqlite3 module had its
    own copy of SQLite, nothing would be recorded and every power image would be vacuous."""
    probe = os.path.join(os.path.realpath(directory), f"probe-{os.getpid()}.db")
    before = _state["opens"]
    _state["probe"] = os.fsencode(probe)
    try:
        connection = sqlite3.connect(probe)
        try:
            connection.execute("PRAGMA user_version").fetchall()
        finally:
            connection.close()
    finally:
        _state["probe"] = None
        for leftover in (probe, probe + "-journal"):
            if os.path.exists(leftover):
                os.unlink(leftover)
    if _state["opens"] == before:
        raise VfsError("sqlite3.connect did not go through the registered VFS: the sqlite3 "
                       "module does not use the libsqlite3 that ctypes loads")


def install(log_directory: str | os.PathLike[str]) -> None:
    """Record every change SQLite makes to durable files in this process into log_directory.

    Registers the wrapping VFS as the default for every later sqlite3.connect in the process
    (and its forked children, which share the log). Idempotent for the same directory;
    another directory redirects the recording from now on. Raises VfsError when the VFS
    cannot take effect (no shared libsqlite3, or a different copy of SQLite in sqlite3).
    """
    directory = os.path.abspath(os.fspath(log_directory))
    with _INSTALL_LOCK:
        current = _recorder()
        if current is not None and current.directory == directory:
            _register()
            return
        os.makedirs(directory, exist_ok=True)
        log_fd = os.open(os.path.join(directory, LOG_NAME),
                         os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        lock_fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_SH)
            _register()
            _probe(directory)
        except BaseException:
            os.close(log_fd)
            os.close(lock_fd)
            raise
        _state["recorder"] = _Recorder(directory=directory, log_fd=log_fd, lock_fd=lock_fd)
        if current is not None:
            os.close(current.log_fd)
            os.close(current.lock_fd)


def record_power_loss() -> bool:
    """Record this process's SQLite writes when faultlab runs it for a trace with power steps.

    For a system's own program written in Python (a command-line system): faultlab's own
    workers record by themselves, a program of yours does not, and without a record a power
    cut of its stores cannot be modelled (faultlab then ends the run with exit status 3,
    rather than call it clean). Call it before the program opens a store::

        import faultlab
        faultlab.record_power_loss()

    Outside such a trace (the variable :data:`LOG_VARIABLE` unset) it does nothing and
    returns False; otherwise it installs the recording VFS (:func:`install`) and returns
    True. Child processes the program forks record with it; a program it executes must
    call this itself. Raises VfsError when this Python's sqlite3 cannot be recorded.
    """
    directory = os.environ.get(LOG_VARIABLE)
    if not directory:
        return False
    install(directory)
    return True


def uninstall() -> None:
    """Stop recording and make the real 'unix' VFS the default again.

    Files already open through the wrapper keep working (it still delegates), unrecorded.
    """
    with _INSTALL_LOCK:
        current = _recorder()
        _state["recorder"] = None
        if _state["vfs"] is not None:
            library = _library()
            library.sqlite3_vfs_register(_state["real_vfs"], 1)
        if current is not None:
            os.close(current.log_fd)
            os.close(current.lock_fd)


def installed_library() -> str | None:
    """The file SQLite was loaded from through ctypes in this process (None before)."""
    library: ctypes.CDLL | None = _state["library"]
    return None if library is None else str(library._name)


def installed_directory() -> str | None:
    """The log directory this process records into, or None."""
    current = _recorder()
    return None if current is None else current.directory


# --- reading a log ----------------------------------------------------------------------------


@dataclass(frozen=True)
class _Record:
    kind: int
    path: str
    a: int
    b: int
    c: int
    body: bytes
    flag: int


@dataclass
class _File:
    """One path's changes in log order; the first ``durable`` of them survive any power cut."""

    path: str
    events: list[_Record] = field(default_factory=list)
    durable: int = 0

    @property
    def unsynced(self) -> list[_Record]:
        return self.events[self.durable:]


@dataclass(frozen=True)
class _Log:
    records: list[_Record]
    size: int
    #: Bytes of records cut short by a kill (skipped: their changes never happened).
    damaged: int


def _parse(data: bytes, position: int) -> tuple[_Record, int] | None:
    """The valid record at position and where the next starts, or None."""
    if position + _HEADER.size > len(data):
        return None
    magic, kind, flag, path_length, a, b, c, body_length, crc = _HEADER.unpack_from(
        data, position)
    if magic != _MAGIC or kind not in _KINDS:
        return None
    start = position + _HEADER.size
    end = start + path_length + body_length
    if end > len(data):
        return None
    view = memoryview(data)
    fields = view[position:position + _UNCHECKED.size]
    if zlib.crc32(view[start:end], zlib.crc32(fields)) != crc:
        return None
    record = _Record(kind=kind, path=os.fsdecode(data[start:start + path_length]), a=a, b=b,
                     c=c, flag=flag, body=data[start + path_length:end])
    return record, end


def _read_log(directory: str) -> _Log:
    path = os.path.join(directory, LOG_NAME)
    try:
        with open(path, "rb") as handle:
            data = handle.read()
    except FileNotFoundError:
        return _Log(records=[], size=0, damaged=0)
    records: list[_Record] = []
    position = 0
    damaged = 0
    while position < len(data):
        parsed = _parse(data, position)
        if parsed is not None:
            records.append(parsed[0])
            position = parsed[1]
            continue
        # A stump left by a kill: resume at the next valid record (another process's).
        following = data.find(_MAGIC, position + 1)
        while following != -1 and _parse(data, following) is None:
            following = data.find(_MAGIC, following + 1)
        end = len(data) if following == -1 else following
        damaged += end - position
        position = end
    return _Log(records=records, size=len(data), damaged=damaged)


def _history(records: Sequence[_Record]) -> dict[str, _File]:
    """Group changes by path and find, per path, how many survive any power cut."""
    files: dict[str, _File] = {}
    for record in records:
        if record.kind in _CHANGES:
            files.setdefault(record.path, _File(record.path)).events.append(record)
        elif record.kind == _SYNC:
            known = files.get(record.path)
            if known is not None:
                known.durable = len(known.events)
        elif record.kind == _DIRSYNC:
            for known in files.values():
                if os.path.dirname(known.path) != record.path:
                    continue
                for index in range(len(known.events) - 1, known.durable - 1, -1):
                    if known.events[index].kind in (_DELETE, _CREATE):
                        known.durable = index + 1
                        break
    return files


# --- choices ----------------------------------------------------------------------------------


#: sqlite3_db_config's op that keeps the last connection's close from checkpointing a WAL.
_DBCONFIG_NO_CKPT_ON_CLOSE = 1006


def keep_wal_on_close(connection: sqlite3.Connection) -> None:
    """Make closing ``connection`` leave a WAL as it is (no checkpoint, no delete).

    Why: the process that judges a run reads the stores with its own connections; when it
    closes the last one on a WAL database, SQLite checkpoints (and syncs) the WAL into the
    database, which would make durable exactly the unsynced commits a power cut must be
    able to lose. Python 3.11's sqlite3 has no ``setconfig``, so this reaches the
    connection's ``sqlite3*`` (the first field after the object header in CPython) and
    checks it names the same database before and after setting the flag. Raises VfsError
    when it cannot.
    """
    library = _library()
    handle = ctypes.c_void_p.from_address(id(connection) + object.__basicsize__).value
    library.sqlite3_db_filename.restype = ctypes.c_char_p
    library.sqlite3_db_filename.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    expected = connection.execute("PRAGMA database_list").fetchall()
    main = next((row[2] for row in expected if row[1] == "main"), None)
    if handle is None or main is None or library.sqlite3_db_filename(handle, b"main") \
            != os.fsencode(main):
        raise VfsError("cannot reach the sqlite3 handle of a Python connection")
    value = ctypes.c_int(-1)
    library.sqlite3_db_config.restype = ctypes.c_int
    status = library.sqlite3_db_config(ctypes.c_void_p(handle),
                                       ctypes.c_int(_DBCONFIG_NO_CKPT_ON_CLOSE),
                                       ctypes.c_int(1), ctypes.byref(value))
    if status != 0 or value.value != 1:
        raise VfsError(f"sqlite3_db_config(NO_CKPT_ON_CLOSE) failed: {status}")


def _torn_part(record: _Record, sector: int, sectors: int) -> int:
    """How many leading bytes of a write lie before its sectors-th sector boundary."""
    boundary = (record.a // sector + sectors) * sector
    return min(record.b, boundary - record.a)


def _selection(choice: Choice, unsynced: Sequence[_Record]) -> tuple[set[int], tuple[int, int]
                                                                     | None]:
    """Which unsynced changes survive, and which write survives only in part (index, bytes)."""
    count = len(unsynced)
    if choice.kind == "drop_all":
        return set(), None
    if choice.kind == "prefix":
        return set(range(min(choice.count, count))), None
    if choice.kind == "reorder":
        return set(range(count)) - {choice.count}, None
    keep = set(range(min(choice.count, count)))
    if choice.count < count and unsynced[choice.count].kind == _WRITE:
        record = unsynced[choice.count]
        part = _torn_part(record, choice.sector, choice.sectors)
        if part >= record.b:
            keep.add(choice.count)
            return keep, None
        return keep, (choice.count, part)
    return keep, None


def choices(log_directory: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every choice that gives a distinct outcome for this log, for a search to draw from.

    drop_all first, then prefix 1..n (n = the most unsynced changes of any file; prefix n
    keeps everything, the outcome of a mere process crash), then the torn writes that
    really tear at 512-byte sectors, then the reorders that leave something out before a
    later change. Plain JSON data, in a stable order.
    """
    files = _history(_read_log(os.path.abspath(os.fspath(log_directory))).records)
    unsynced = [known.unsynced for known in files.values()]
    longest = max((len(changes) for changes in unsynced), default=0)
    found: list[dict[str, Any]] = [{"kind": "drop_all"}]
    found.extend({"kind": "prefix", "keep": n} for n in range(1, longest + 1))
    for n in range(longest):
        if any(n < len(changes) and changes[n].kind == _WRITE
               and _torn_part(changes[n], 512, 1) < changes[n].b for changes in unsynced):
            found.append({"kind": "torn", "keep": n, "sector": 512})
    for i in range(longest):
        if any(i + 1 < len(changes) and changes[i].kind in (_WRITE, _RESIZE)
               for changes in unsynced):
            found.append({"kind": "reorder", "drop": i})
    return found


def _encode(record: _Record) -> bytes:
    path = os.fsencode(record.path)
    fields = _UNCHECKED.pack(_MAGIC, record.kind, record.flag, len(path), record.a, record.b,
                             record.c, len(record.body))
    crc = zlib.crc32(record.body, zlib.crc32(path, zlib.crc32(fields)))
    return fields + struct.pack("<I", crc) + path + record.body


def _moved(path: str, roots: Sequence[tuple[str, str]]) -> str | None:
    for old, new in roots:
        if path == old:
            return new
        if path.startswith(old + os.sep):
            return new + path[len(old):]
    return None


def relocate(log_directory: str | os.PathLike[str], old_root: str | os.PathLike[str],
             new_root: str | os.PathLike[str]) -> None:
    """Rewrite a log copied with its files from ``old_root`` to ``new_root`` so that it
    names the copies (records hold absolute paths: a copied log would rebuild the originals).

    For a search that branches by copying a run directory, its files and their log
    together. No process may record into the log meanwhile. Damaged stumps are dropped
    (their changes never happened). Raises PowerImageError when a record names a path
    outside ``old_root``: such a log does not belong to the copied directory.
    """
    directory = os.path.abspath(os.fspath(log_directory))
    old = os.path.abspath(os.fspath(old_root))
    new = os.path.abspath(os.fspath(new_root))
    roots = [(old, new)]
    if os.path.realpath(old) != old:
        roots.append((os.path.realpath(old), os.path.realpath(new)))
    with _exclusive(directory):
        log = _read_log(directory)
        moved: list[bytes] = []
        for record in log.records:
            path = _moved(record.path, roots)
            if path is None:
                raise PowerImageError(f"{record.path} is recorded in {directory} but lies "
                                      f"outside {old}: the log cannot be moved with it")
            moved.append(_encode(_Record(kind=record.kind, path=path, a=record.a, b=record.b,
                                         c=record.c, body=record.body, flag=record.flag)))
        if log.size:
            with open(os.path.join(directory, LOG_NAME), "wb") as handle:
                handle.write(b"".join(moved))


def unsynced_digest(log_directory: str | os.PathLike[str],
                    root: str | os.PathLike[str]) -> str:
    """A digest of what a power cut now could lose: every file's unsynced changes, the
    files named relative to ``root`` (so a copied, relocated log digests alike).

    Two states whose files hold the same content but different unsynced changes behave
    differently under a power cut: a search that merges equal states must tell them apart.
    """
    base = os.path.abspath(os.fspath(root))
    real = os.path.realpath(base)
    parts: list[bytes] = []
    log = _read_log(os.path.abspath(os.fspath(log_directory)))
    for path, known in sorted(_history(log.records).items()):
        name = path
        for prefix in (base, real):
            if path.startswith(prefix + os.sep):
                name = path[len(prefix) + 1:]
                break
        for record in known.unsynced:
            parts.append(struct.pack("<BBqqqQ", record.kind, record.flag, record.a, record.b,
                                     record.c, len(record.body)) + os.fsencode(name)
                         + b"\0" + record.body)
    digest = hashlib.sha256()
    for part in parts:
        digest.update(struct.pack("<Q", len(part)) + part)
    return digest.hexdigest()


def summary(log_directory: str | os.PathLike[str]) -> dict[str, Any]:
    """How much is at stake: log bytes, records, damaged bytes (stumps skipped), and per file
    its changes, how many are durable, how many (and how many bytes of writes) a power cut
    now could lose; and how many choices there are."""
    log = _read_log(os.path.abspath(os.fspath(log_directory)))
    files = _history(log.records)
    described: dict[str, dict[str, int]] = {}
    for path, known in sorted(files.items()):
        unsynced = known.unsynced
        described[path] = {
            "changes": len(known.events),
            "durable": known.durable,
            "unsynced": len(unsynced),
            "unsynced_writes": sum(1 for record in unsynced if record.kind == _WRITE),
            "unsynced_bytes": sum(record.b for record in unsynced if record.kind == _WRITE),
        }
    return {"log_bytes": log.size, "records": len(log.records), "damaged_bytes": log.damaged,
            "files": described, "choices": len(choices(log_directory))}


# --- rebuilding -------------------------------------------------------------------------------


@contextmanager
def _exclusive(directory: str) -> Iterator[None]:
    """Hold the log directory exclusively: no live process may still be recording into it."""
    current = _recorder()
    if current is not None and current.directory == directory:
        raise RecorderBusy(f"this process records into {directory}: call uninstall() first")
    lock_fd = os.open(os.path.join(directory, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RecorderBusy(f"a live process still records into {directory}: kill it (and "
                               f"its children) and wait for it first") from None
        yield
    finally:
        os.close(lock_fd)


def _pread(path: str, offset: int, length: int) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _undo(record: _Record) -> object:
    """Undo one change to a file that is in the state right after it; return what redoing it
    needs (the new bytes of a write, the new size, whether a delete or create took effect)."""
    path = record.path
    if record.kind in (_WRITE, _RESIZE) and not os.path.isfile(path):
        raise PowerImageError(f"{path} is missing but the log has a change to it: the files "
                              "were changed outside the recording VFS")
    if record.kind == _WRITE:
        fd = os.open(path, os.O_RDWR)
        try:
            new = os.pread(fd, record.b, record.a)
            if record.body:
                os.pwrite(fd, record.body, record.a)
            if os.fstat(fd).st_size != record.c:
                os.ftruncate(fd, record.c)
        finally:
            os.close(fd)
        return new
    if record.kind == _RESIZE:
        new_size = os.stat(path).st_size
        fd = os.open(path, os.O_RDWR)
        try:
            os.ftruncate(fd, record.c)
            if record.body:
                os.pwrite(fd, record.body, record.a)
        finally:
            os.close(fd)
        return new_size
    if record.kind == _DELETE:
        deleted = not os.path.exists(path)
        with open(path, "wb") as handle:
            handle.write(record.body)
        return deleted
    created = os.path.exists(path)
    if created:
        os.unlink(path)
    return created


def _redo(record: _Record, captured: object, part: int | None) -> None:
    """Apply a change again, whole or (a torn write) its first ``part`` bytes."""
    path = record.path
    if record.kind == _WRITE and isinstance(captured, bytes):
        data = captured if part is None else captured[:part]
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.pwrite(fd, data, record.a)
        finally:
            os.close(fd)
    elif record.kind == _RESIZE and isinstance(captured, int):
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            os.ftruncate(fd, captured)
        finally:
            os.close(fd)
    elif record.kind == _DELETE and captured is True:
        if os.path.exists(path):
            os.unlink(path)
    elif record.kind == _CREATE and captured is True:
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o644))


def _rebuild(known: _File, choice: Choice) -> dict[str, int]:
    """Undo every unsynced change newest first, then redo the chosen ones oldest first."""
    unsynced = known.unsynced
    keep, torn = _selection(choice, unsynced)
    captured: list[object] = [None] * len(unsynced)
    for index in range(len(unsynced) - 1, -1, -1):
        captured[index] = _undo(unsynced[index])
    for index, record in enumerate(unsynced):
        if index in keep:
            _redo(record, captured[index], None)
        elif torn is not None and torn[0] == index:
            _redo(record, captured[index], torn[1])
    return {"unsynced": len(unsynced), "kept": len(keep), "torn_bytes": 0 if torn is None
            else torn[1]}


def _shm_path(path: str) -> str:
    for suffix in ("-wal", "-journal"):
        if path.endswith(suffix):
            return path[: -len(suffix)] + "-shm"
    return path + "-shm"


def power_image(log_directory: str | os.PathLike[str],
                choice: Mapping[str, Any]) -> dict[str, Any]:
    """Rebuild every recorded file as a power cut now would leave it, under ``choice``.

    Run it once the recording processes (and their children) are dead: it refuses with
    RecorderBusy while one still holds the log directory. Each file becomes its durable
    image plus the unsynced changes the choice keeps (see the module docstring for the
    kinds and what they model); -shm files beside recorded databases are deleted (SQLite
    rebuilds them); the log is cleared, so the rebuilt files are the durable state a new run
    starts from. Returns what was done: the choice; per file, its unsynced changes, how many
    were kept and the bytes kept of a torn write; and damaged_log_bytes, the stumps of
    records cut short by a kill that were skipped. Raises ValueError for a malformed
    choice, PowerImageError when a file the log changed is missing.
    """
    directory = os.path.abspath(os.fspath(log_directory))
    parsed = parse_choice(choice)
    with _exclusive(directory):
        log = _read_log(directory)
        files = _history(log.records)
        done = {path: _rebuild(known, parsed) for path, known in sorted(files.items())}
        for path in sorted({_shm_path(path) for path in files}):
            if os.path.exists(path):
                os.unlink(path)
        log_path = os.path.join(directory, LOG_NAME)
        if os.path.exists(log_path):
            os.truncate(log_path, 0)
    return {"choice": dict(choice), "files": done, "damaged_log_bytes": log.damaged}


def settle(log_directory: str | os.PathLike[str]) -> None:
    """Declare everything recorded so far durable (the kernel wrote it all back, or the
    machine shut down cleanly): clear the log, so a later power cut cannot lose it."""
    log_path = os.path.join(os.path.abspath(os.fspath(log_directory)), LOG_NAME)
    if os.path.exists(log_path):
        os.truncate(log_path, 0)


def opens_cleanly(path: str | os.PathLike[str]) -> str | None:
    """None if the database opens and passes PRAGMA integrity_check, else why not.

    Opening runs SQLite's recovery as the next process would (a hot journal is rolled back,
    a WAL is replayed), so the files may change. A missing file is an error, not a new
    empty database.
    """
    location = Path(os.path.abspath(os.fspath(path)))
    if not location.is_file():
        return f"{location}: missing"
    try:
        connection = sqlite3.connect(location.as_uri() + "?mode=rw", uri=True)
        try:
            rows = connection.execute("PRAGMA integrity_check").fetchall()
        finally:
            connection.close()
    except sqlite3.DatabaseError as error:
        return f"{type(error).__name__}: {error}"
    if rows != [("ok",)]:
        return "integrity_check: " + "; ".join(str(row[0]) for row in rows)
    return None
