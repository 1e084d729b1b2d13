"""Spill segments: items that do not fit in shared memory, in self-checking files on disk.

A :class:`SpillStore` owns one directory (one per cache). Every process appends to its own file,
``<slot>.spill``, where ``slot`` is the caller's liveness slot (a small int no other live process
holds); any process reads any file. Items are compressed with zstd at a low level and stored raw
when that does not save at least 5%, so incompressible items cost no decompression::

    store = SpillStore(spill_dir / "c")             # makes the folder c (0700) in an existing dir
    loc = store.append(slot, key, payload)          # -> SpillLoc(file_id, offset, stored_len, raw_len)
    data = store.read(loc, key)                     # a bytearray, or None: a miss, never wrong data
    ok = store.read_into(loc, key, out)             # straight into a caller buffer of raw_len bytes
    store.recover()                                 # repair the files of writers that died (gc)

This module knows nothing of torch or of the shared-memory index; the store keeps the returned
location in its index entry. The record format and the crash protocol are in NOTE [spill records].
"""

from __future__ import annotations

import errno
import fcntl
import functools
import logging
import os
import re
import secrets
import shutil
import struct
import sys
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Union

import numpy as np
import zstandard

from .config import make_private_dir
from .errors import InvalidArgument, LockTimeout, NotOwner, SpillError
from .locks import close_in_forked_children, flock_within

__all__ = [
    "SpillStore",
    "SpillLoc",
    "SpillFull",
    "RecoverReport",
    "check_spill_dir",
    "MAX_SLOTS",
    "MAX_KEY_BYTES",
    "FILE_HEADER_BYTES",
    "RECORD_HEADER_BYTES",
]

log = logging.getLogger("shmcache")

# NOTE [spill records]
#
# Layout. A spill directory holds one append-only file per writer slot, ``<slot>.spill``; a
# location's file_id is the slot. Everything is little-endian. A file is a 32-byte file header
# followed by records, each starting 8-byte aligned:
#
#     file header                              record = header | key | pad | stored | pad
#      0  8s  magic b"SHMCSPL\0"                 0  4s  magic b"SpRc"
#      8  H   format version (1)                 4  B   record version (1)
#     10  H   record alignment (8)               5  B   flags: codec, 0 raw / 1 zstd frame
#     12  I   reserved (0)                       6  H   key length
#     16  Q   clean_end (see Repair), or 0        8  Q   raw length (what a read returns)
#     24  I   crc32 of bytes 0..24              16  Q   stored length (== raw length if raw)
#     28  4x  padding                           24  I   body check of the stored bytes
#                                               28  I   head check: crc32(bytes 0..28 + key)
#
# pad: zeros up to the next multiple of 8. A zstd record is one frame with its content size; it
# is used only when it is smaller than raw/1.05, so "stored < raw" <=> compressed.
#
# Why 8-byte alignment, not 64: the header unpacks aligned and the stored bytes start on a word,
# so the body check reads them as uint64 without numpy's slow unaligned path. Payloads leave the
# page cache through the kernel's copy, which ran at the same speed here for file offsets 0, 8,
# 16, 40 and 64 mod 64 (unlike user-space copies, docs/design.md §11); 64 would cost ~60 bytes a
# record for nothing.
#
# Why the body check is not a plain crc32: zlib.crc32 runs at ~4-5 GiB/s on this machine, slower
# than a page-cache read, so it would cap reads of raw records at well under half the disk limit.
# Stored bytes under 8 KiB use crc32; longer ones use crc32 over the uint64 wrapping sums of each
# 4 KiB block (the last one partial), then over the last <8 bytes: one numpy pass, ~25-50 GiB/s.
# That still catches every single-bit flip, every corruption inside one 8-byte word, and
# reordered, zeroed or misdirected blocks (a miss has 2^-32 odds, as with crc32); it is weaker
# than crc32 only against compensating flips inside one block. Truncation is caught by the
# lengths before any checksum.
#
# Writing. The owner of a slot holds an exclusive flock on its file from its first append until
# close(); the kernel drops it when the owner dies, however it dies. Only the lock holder changes
# the file. An append is one pwritev of the whole record at the file's valid end; append returns
# the location only after the write completed, and the store publishes the location in its index
# only after append returned. So every location a reader can find points at a complete record,
# and a writer killed mid-append leaves only an invalid tail after the last complete record: a
# header cut short, or a record that runs past the end of the file (the kernel grows a file only
# by the bytes a write actually copied). A write that fails (ENOSPC, EIO) truncates its partial
# record at once and raises SpillFull / SpillError, so the file stays valid while its writer
# lives on and the store stops spilling.
#
# Repair. Whoever takes a file's lock next - the slot's next owner on its first append, or
# recover() (gc), which skips files whose lock is held, i.e. whose writer is alive - walks the
# record headers from the start and truncates the file after the last valid one. A clean close()
# stores the valid end in the file header (clean_end); the next owner trusts it only if it equals
# the file size, and zeroes it before its first append, so only files of writers that died are
# scanned. Records appended by a writer that died after append returned but before its index
# entry was published are valid but unreferenced: dead bytes until the cache is cleared.
#
# Reading takes no lock and trusts nothing: it re-checks magic, head check, key, lengths and body
# check, and turns any failure into a miss - counted, logged once per file and condition, never
# returned, never a zstd exception. A location that outlived its record (a stale index entry)
# reads another key or garbage, and is a miss too; it is counted as key_mismatches, not logged,
# when the record there is intact, when its file is gone (a clear() or destroy deleted it under
# the reader), or when the caller's ``stale`` says the location was dropped meanwhile.
# A reader keeps one descriptor per file; after a miss it checks whether the path now names
# another inode (the directory was destroyed and re-created) and, if so, re-opens and retries once.
# Durability across power loss is not a goal: the index lives in shared memory, which does not
# survive a reboot either.
#
# Scope: one SpillStore object per directory and process is enough; it is thread-safe (appends
# to one slot serialise on a per-slot lock; reads share nothing but descriptors) and fork-aware.

FILE_MAGIC = b"SHMCSPL\x00"
RECORD_MAGIC = b"SpRc"
FORMAT_VERSION = 1
RECORD_VERSION = 1
ALIGN = 8
FLAG_ZSTD = 1

_FILE_HDR = struct.Struct("<8sHHIQI4x")
_REC_HDR = struct.Struct("<4sBBHQQII")
FILE_HEADER_BYTES = _FILE_HDR.size  # 32
RECORD_HEADER_BYTES = _REC_HDR.size  # 32
_HEAD_CHECKED = 28  # the head check covers the record header up to itself, then the key

MAX_SLOTS = 1 << 16  # file_id fits 16 bits in the index entry
MAX_KEY_BYTES = (1 << 16) - 1
_BLOCK_WORDS = 512  # body check: one uint64 sum per 4 KiB block ...
_CRC_BELOW = 8192  # ... for stored bytes this long; shorter ones are faster with plain crc32
_WORD = np.dtype("<u8")
_SCAN_READ = 512  # bytes read per record header while scanning: header plus a typical key
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_FILE_RE = re.compile(r"(\d+)\.spill")
_MAX_LOGGED = 4096  # (file, condition) pairs remembered for log-once
_DIGITS = re.compile(r"\d+")
_COUNTERS = (
    "records",
    "bytes_disk",
    "bytes_disk_raw",
    "reads",
    "reads_decompressed",
    "corrupt_reads",
    "key_mismatches",
)

Buffer = Union[bytes, bytearray, memoryview]  # noqa: UP007 - a runtime alias, also on 3.10


class SpillFull(SpillError):
    """The spill disk is full (ENOSPC, EDQUOT, EFBIG): the store should stop spilling.

    The partial record was already truncated away; every earlier record is still readable.
    Any other write failure raises plain :class:`~shmcache.errors.SpillError`, so a store that
    catches ``SpillError`` degrades to memory-only on both.
    """


class SpillLoc(NamedTuple):
    """Where a record lives: what the store keeps in the item's index entry."""

    file_id: int
    offset: int
    stored_len: int
    raw_len: int

    @property
    def compressed(self) -> bool:
        return self.stored_len < self.raw_len


@dataclass
class RecoverReport:
    """What :meth:`SpillStore.recover` found; byte counts include headers and padding."""

    files: int = 0  # spill files examined
    live: int = 0  # skipped: a live writer holds their lock (they are valid by construction)
    foreign: int = 0  # not spill files (wrong magic or version): left alone, logged
    records: int = 0  # valid records in the files examined
    corrupt_records: int = 0  # records failing their body check (only with verify=True)
    bytes_valid: int = 0
    bytes_truncated: int = 0  # torn tails removed
    repaired: tuple[int, ...] = ()  # file ids that were truncated


class _Head(NamedTuple):
    magic: bytes
    version: int
    flags: int
    key_len: int
    raw_len: int
    stored_len: int
    body_check: int
    head_check: int


# --- small helpers ------------------------------------------------------------------------------


def _pad(n: int) -> int:
    return -n % ALIGN


def _record_bytes(key_len: int, stored_len: int) -> int:
    return RECORD_HEADER_BYTES + key_len + _pad(key_len) + stored_len + _pad(stored_len)


def _body_check(data: Buffer) -> int:
    """Checksum of stored bytes (see NOTE [spill records] for why it is not plain crc32)."""
    n = len(data)
    if n < _CRC_BELOW:
        return zlib.crc32(data)
    words = np.frombuffer(data, dtype=_WORD, count=n // 8)
    sums = np.add.reduceat(words, _block_starts(len(words)))  # wraps mod 2**64
    if sys.byteorder != "little":  # pragma: no cover - the format is little-endian everywhere
        sums = sums.astype(_WORD)
    return zlib.crc32(memoryview(data)[len(words) * 8 :], zlib.crc32(sums.tobytes()))  # one word per 4 KiB: tiny


@functools.lru_cache(maxsize=256)
def _block_starts(n_words: int) -> np.ndarray:
    """Where each 4 KiB block starts, in words (cached: items of one dataset share a few sizes)."""
    starts = np.arange(0, n_words, _BLOCK_WORDS)
    starts.flags.writeable = False
    return starts


def _head_check(head: Buffer, key: Buffer) -> int:
    return zlib.crc32(key, zlib.crc32(memoryview(head)[:_HEAD_CHECKED]))


def _byte_view(obj: Buffer, what: str) -> memoryview:
    try:
        view = memoryview(obj)
    except TypeError:
        raise InvalidArgument(
            f"{what} must be bytes-like (bytes, bytearray, memoryview, a numpy array), got {type(obj).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgument(f"{what} must be C-contiguous; pass a contiguous copy (np.ascontiguousarray)")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def _as_key(key: Buffer) -> bytes:
    if not isinstance(key, (bytes, bytearray, memoryview)):
        raise InvalidArgument(f"spill key must be bytes, got {type(key).__name__} {key!r}; encode it first")
    key = bytes(key)
    if len(key) > MAX_KEY_BYTES:
        raise InvalidArgument(f"spill key is {len(key)} bytes; the limit is {MAX_KEY_BYTES}: hash long keys")
    return key


def _check_slot(slot: int) -> int:
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < MAX_SLOTS:
        raise InvalidArgument(
            f"spill slot must be an int in [0, {MAX_SLOTS}), got {slot!r}; pass the process's liveness slot"
        )
    return slot


def _advance(views: list[memoryview], n: int) -> list[memoryview]:
    """Drop the first ``n`` bytes of a scatter/gather list (after a short read or write)."""
    while n and views:
        if n >= len(views[0]):
            n -= len(views[0])
            views = views[1:]
        else:
            views = [views[0][n:], *views[1:]]
            n = 0
    return views


def _preadv_all(fd: int, bufs: list[Buffer], offset: int) -> bool:
    """Fill ``bufs`` from ``offset``; False if the file ends first."""
    want = sum(map(len, bufs))  # callers pass byte buffers (bytearray, or a view cast to "B")
    got = os.preadv(fd, bufs, offset)
    if got == want:  # the usual case: one syscall
        return True
    views = _advance([memoryview(b).cast("B") for b in bufs if len(b)], got)
    offset += got
    while views:
        n = os.preadv(fd, views, offset)
        if n == 0:
            return False
        offset += n
        views = _advance(views, n)
    return True


def _pwritev_all(fd: int, bufs: Iterable[Buffer], offset: int) -> None:
    """Write all of ``bufs`` at ``offset``; a short write (disk filling up) continues or raises."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        views = _advance(views, n)


def _write_error(exc: OSError, path: Path) -> SpillError:
    if exc.errno in _SPACE_ERRNOS:
        return SpillFull(
            f"no space left for spill file {path} ({exc.strerror}); spilling stops and the cache "
            f"keeps serving from memory - free space there or pass a spill_dir on a larger disk"
        )
    return SpillError(
        f"cannot write spill file {path}: {exc.strerror} (errno {exc.errno}); spilling stops - "
        f"check that disk, or pass another spill_dir"
    )


# --- the spill directory ------------------------------------------------------------------------


def check_spill_dir(path: str | os.PathLike) -> Path:
    """Return ``path`` as an absolute Path to an existing, writable directory.

    Raises SpillError naming the path and the fix when it does not exist (it is never created: a
    typo would silently fill another disk, the root one), is not a directory, or is not writable.
    Writability is probed by creating a file, because root passes every mode check but still
    cannot write to a read-only filesystem.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise InvalidArgument(f"spill_dir must be a path (str or os.PathLike), got {type(path).__name__} {path!r}")
    if not os.fspath(path).strip():  # Path("") is the current directory: never what was meant
        raise InvalidArgument(f"spill_dir is empty ({path!r}); give the directory for spill files")
    p = Path(path).expanduser().absolute()
    if not p.exists():
        raise SpillError(f"spill_dir {p} does not exist; create it first (mkdir -p {p}), or pass "
                         f"another spill_dir (or set $SHMCACHE_SPILL_DIR)")
    if not p.is_dir():
        raise SpillError(f"spill_dir {p} exists but is not a directory; remove it, or pass another spill_dir")
    _probe_writable(p)
    return p


def _make_folder(path: str | os.PathLike) -> tuple[Path, tuple[int, int]]:
    """Create (or verify) a store's own folder inside a spill directory that may be shared; return
    it and its identity (device, inode).

    The folder's name is predictable and its parent may be a 1777 scratch disk, so another user can
    plant a symlink or a directory of theirs there first: config.make_private_dir refuses both
    (NotOwner), never follows or chmods them, and never creates the parent."""
    p = Path(path).expanduser().absolute()
    check_spill_dir(p.parent)
    try:
        make_private_dir(p, "spill folder", "pass a spill_dir of your own (or one that only you can write)")
        st = os.lstat(p)
    except NotOwner:
        raise
    except OSError as exc:
        raise SpillError(f"cannot create spill folder {p}: {exc.strerror}; pass a writable spill_dir "
                         f"(or set $SHMCACHE_SPILL_DIR)") from None
    _probe_writable(p)
    return p, (st.st_dev, st.st_ino)


def _probe_writable(p: Path) -> None:
    probe = p / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise SpillError(
            f"spill_dir {p} is not writable: {exc.strerror}; fix its permissions (chmod u+rwx), or "
            f"pass a writable spill_dir (or set $SHMCACHE_SPILL_DIR)"
        ) from None
    os.close(fd)
    os.unlink(probe)


# --- the store ----------------------------------------------------------------------------------


class _Writer:
    """This process's append handle on one slot file; it holds the file's flock until closed."""

    def __init__(self, path: Path, fd: int, end: int):
        self.path = path
        self.fd = fd
        self.end = end  # where the next record goes: the end of the last valid one
        self.lock = threading.Lock()  # threads of one process append to a slot one at a time


class _Contexts(threading.local):
    """zstd contexts are not thread-safe: one pair per thread, made on first use."""

    cctx: zstandard.ZstdCompressor | None = None
    dctx: zstandard.ZstdDecompressor | None = None


class SpillStore:
    """Append-only spill files in ``path``, one per writer slot; see NOTE [spill records].

    Thread-safe; in a forked child it drops what it inherited at once (without touching the
    parent's locks: NOTE [lock files]) and re-opens lazily, so one object may be shared with
    DataLoader workers. It pickles as its path and settings.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        *,
        level: int = 1,
        create: bool = True,
        lock_timeout_s: float = 10.0,
    ):
        if not isinstance(level, int) or isinstance(level, bool) or not 1 <= level <= 22:
            raise InvalidArgument(f"zstd level must be an int in 1..22, got {level!r}; use 1-3 (reads are CPU-bound)")
        self.path, self.folder_id = _make_folder(path) if create else _existing_dir(path)
        self.level = level
        self.lock_timeout_s = lock_timeout_s
        self._closed = False
        self._reset_process_state()
        close_in_forked_children(self)

    def after_fork_in_child(self) -> None:
        self._forget_inherited()

    def _reset_process_state(self) -> None:
        self._writers: dict[int, _Writer] = {}
        self._readers: dict[int, int] = {}
        self._retired: list[int] = []  # reader descriptors of files replaced under us
        self._open_lock = threading.Lock()  # guards the two dicts while files are opened
        self._writer_open_lock = threading.Lock()  # may wait for a flock: kept off the read path
        self._ctx = _Contexts()
        self._logged: set[tuple[int, str]] = set()
        self._counts = dict.fromkeys(_COUNTERS, 0)

    def _own(self) -> None:
        """Every public method starts here: refuse a closed store (forks: after_fork_in_child)."""
        if self._closed:
            raise SpillError(f"the spill store at {self.path} is closed; open a new SpillStore")

    def _forget_inherited(self) -> None:
        """In a forked child: drop the parent's descriptors and locks (see NOTE [lock files])."""
        for fd in [w.fd for w in self._writers.values()] + [*self._readers.values(), *self._retired]:
            os.close(fd)  # no LOCK_UN: the parent's descriptor keeps its lock
        self._reset_process_state()

    def __reduce__(self):
        return (_reopen, (str(self.path), self.level, self.lock_timeout_s))

    def __repr__(self) -> str:
        return f"SpillStore({str(self.path)!r}, level={self.level})"

    @property
    def closed(self) -> bool:
        return self._closed

    def file_path(self, file_id: int) -> Path:
        return self.path / f"{file_id}.spill"

    # --- appending -------------------------------------------------------------------------

    def append(self, slot: int, key: Buffer, payload: Buffer) -> SpillLoc:
        """Store ``payload`` under ``key`` in ``slot``'s file; return where it went.

        ``slot`` must be owned by this process (its liveness slot). Raises SpillFull when the disk
        is full and SpillError on any other write failure; the file stays valid either way.
        """
        self._own()
        _check_slot(slot)
        key = _as_key(key)
        raw = _byte_view(payload, "spill payload")
        flags, stored = self._encode(raw)
        head = self._pack_head(flags, key, len(raw), stored)
        writer = self._writer(slot)
        size = _record_bytes(len(key), len(stored))
        with writer.lock:
            offset = writer.end
            try:
                _pwritev_all(writer.fd, [head, key, bytes(_pad(len(key))), stored, bytes(_pad(len(stored)))], offset)
            except OSError as exc:
                _truncate_quietly(writer.fd, offset)  # drop the partial record: the file stays valid
                raise _write_error(exc, writer.path) from None
            writer.end = offset + size
        self._count("records")
        self._count("bytes_disk", len(stored))
        self._count("bytes_disk_raw", len(raw))
        return SpillLoc(slot, offset, len(stored), len(raw))

    def _encode(self, raw: memoryview) -> tuple[int, Buffer]:
        """zstd if it saves at least 5%, else raw: incompressible items cost no decompression."""
        if not len(raw):
            return 0, raw
        packed = self._cctx().compress(raw)
        if len(packed) * 105 < len(raw) * 100:
            return FLAG_ZSTD, packed
        return 0, raw

    @staticmethod
    def _pack_head(flags: int, key: bytes, raw_len: int, stored: Buffer) -> bytes:
        fields = (RECORD_MAGIC, RECORD_VERSION, flags, len(key), raw_len, len(stored), _body_check(stored))
        head = _REC_HDR.pack(*fields, 0)
        return head[:_HEAD_CHECKED] + struct.pack("<I", _head_check(head, key))

    def _writer(self, slot: int) -> _Writer:
        writer = self._writers.get(slot)
        if writer is None:
            with self._writer_open_lock:
                writer = self._writers.get(slot)
                if writer is None:
                    writer = self._open_writer(slot)
                    with self._open_lock:
                        self._writers[slot] = writer
        return writer

    def _open_writer(self, slot: int) -> _Writer:
        path = self.file_path(slot)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise _write_error(exc, path) from None
        try:
            _flock_wait(fd, path, slot, self.lock_timeout_s)
            end = _take_over(fd, path)
        except BaseException:
            os.close(fd)  # also drops the flock, if we got it
            raise
        return _Writer(path, fd, end)

    # --- reading ---------------------------------------------------------------------------

    def read(self, loc: SpillLoc | tuple[int, int, int], key: Buffer,
             stale: Callable[[], bool] | None = None) -> bytearray | None:
        """The payload stored at ``loc`` under ``key``, or None (a miss) if anything is wrong.

        Returns a fresh, writable bytearray (``torch.frombuffer`` takes it without a warning):
        raw records are read straight into it, zstd records decompressed straight into it.
        ``stale``, asked only after a failed read, says whether the location has been dropped
        meanwhile (the cache was cleared under the reader): then the miss is not damage, so it
        is counted with key_mismatches and not logged.
        """
        self._own()
        file_id, offset, stored_len = _loc_fields(loc)
        key = _as_key(key)
        body = bytearray(stored_len)
        head = self._fetch(file_id, offset, key, body, stale)
        if head is None:
            return None
        if not head.flags & FLAG_ZSTD:
            return body
        out = bytearray(head.raw_len)
        return out if self._decompress_into(body, out, file_id, offset) else None

    def read_into(self, loc: SpillLoc | tuple[int, int, int], key: Buffer, out: Buffer) -> bool:
        """Read the payload into ``out`` (writable, exactly raw_len bytes); False on a miss.

        A raw record goes from the page cache into ``out`` with one preadv and no other copy.
        On False the contents of ``out`` are undefined.
        """
        self._own()
        file_id, offset, stored_len = _loc_fields(loc)
        key = _as_key(key)
        view = _byte_view(out, "out")
        if view.readonly:
            raise InvalidArgument("out must be a writable buffer (a bytearray, numpy array or tensor)")
        body: Buffer = view if len(view) == stored_len else bytearray(stored_len)
        head = self._fetch(file_id, offset, key, body)
        if head is None:
            return False
        if head.raw_len != len(view):
            self._miss(file_id, offset, f"holds {head.raw_len} bytes, not the {len(view)} of out", mismatch=True)
            return False
        if not head.flags & FLAG_ZSTD:
            return True  # it was read into out directly (raw_len == stored_len == len(out))
        return self._decompress_into(body, view, file_id, offset)

    def _fetch(self, file_id: int, offset: int, key: bytes, body: Buffer,
               stale: Callable[[], bool] | None = None) -> _Head | None:
        """Read header, key and stored bytes (into ``body``) and check them all; None on a miss."""
        self._count("reads")
        fd = self._reader_fd(file_id)
        head, why = _load_record(fd, offset, key, body)
        if why is not None and fd is not None and self._forget_if_replaced(file_id, fd):
            fd = self._reader_fd(file_id)  # the directory was re-created under us: read the new file
            head, why = _load_record(fd, offset, key, body)
        if why is None:
            return head
        # Not damage: the file is gone (deleted by a clear() or destroy under this reader), the
        # record there is another key's, or the caller knows the location was dropped meanwhile.
        gone = fd is None or (stale is not None and stale()) or _holds_other_key(fd, offset, key)
        self._miss(file_id, offset, why, mismatch=gone)
        return None

    def _decompress_into(self, src: Buffer, out: memoryview | bytearray, file_id: int, offset: int) -> bool:
        self._count("reads_decompressed")
        view = memoryview(out)
        filled = 0
        try:
            reader = self._dctx().stream_reader(src, read_size=max(len(src), 1))
            while filled < len(view):
                got = reader.readinto(view[filled:])
                if not got:
                    break
                filled += got
        except zstandard.ZstdError as exc:  # checksummed bytes that zstd rejects: still only a miss
            self._miss(file_id, offset, f"zstd cannot decode it: {exc}")
            return False
        if filled != len(view):
            self._miss(file_id, offset, f"it decompresses to {filled} bytes, not {len(view)}")
            return False
        return True

    def _reader_fd(self, file_id: int) -> int | None:
        fd = self._readers.get(file_id)
        if fd is None:
            with self._open_lock:
                fd = self._readers.get(file_id)
                if fd is None:
                    try:
                        fd = os.open(self.file_path(file_id), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                    except FileNotFoundError:
                        return None
                    self._readers[file_id] = fd
        return fd

    def _forget_if_replaced(self, file_id: int, fd: int) -> bool:
        """True (and the cached descriptor closed) if ``file_id``'s path is no longer our file."""
        try:
            replaced = os.stat(self.file_path(file_id)).st_ino != os.fstat(fd).st_ino
        except FileNotFoundError:
            replaced = True
        if replaced:
            with self._open_lock:
                if self._readers.get(file_id) == fd:
                    # Closed only by close(): another thread may be reading through it right now, and
                    # a closed number can be reused at once for another file.
                    self._retired.append(self._readers.pop(file_id))
        return replaced

    def _miss(self, file_id: int, offset: int, why: str, *, mismatch: bool = False) -> None:
        """Count a failed read; log it once per file and condition. Always returns None."""
        if mismatch:  # a stale location, not damage: counted, logged at debug level only
            self._count("key_mismatches")
            log.debug("spill record %s@%d is stale (%s): a miss", file_id, offset, why)
            return None
        self._count("corrupt_reads")
        # One damaged file fails every read of the records it holds: one line per file and
        # condition (the reason without its numbers), the rest only counted.
        where = (file_id, _DIGITS.sub("#", why))
        if where not in self._logged and len(self._logged) < _MAX_LOGGED:
            self._logged.add(where)
            log.warning(
                "corrupt spill record in %s at offset %d: %s; treated as a miss (the item is "
                "recomputed from the source). Further records of this file failing the same way "
                "are not logged, only counted (the cache's stats()['corrupt'])",
                self.file_path(file_id),
                offset,
                why,
            )
        return None

    # --- maintenance -----------------------------------------------------------------------

    def recover(self, slot: int | None = None, *, verify: bool = False) -> RecoverReport:
        """Scan the files of dead writers (or of ``slot``) and truncate their torn tails.

        Files whose writer is alive (its flock is held, by another process or by this store) are
        skipped: they are valid by construction. ``verify=True`` also checks every record's body
        (reads everything) and counts failures; they are not truncated, since later records are
        still good.
        """
        self._own()
        report = RecoverReport()
        repaired: list[int] = []
        for file_id in [_check_slot(slot)] if slot is not None else self.file_ids():
            if file_id in self._writers:
                report.files += 1
                report.live += 1
                continue
            if _recover_file(self.file_path(file_id), verify, report):
                repaired.append(file_id)
        report.repaired = tuple(repaired)
        return report

    def file_ids(self) -> list[int]:
        """The slot files that exist in the directory now."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for m in map(_FILE_RE.fullmatch, names) if m)

    def stats(self) -> dict[str, int]:
        """This process's counters, plus ``files`` and ``file_bytes`` of the whole directory.

        ``records``, ``bytes_disk`` (stored) and ``bytes_disk_raw`` count this process's appends;
        the store keeps the cross-process totals in shared memory from the returned SpillLocs.
        """
        sizes = []
        for file_id in self.file_ids():
            try:
                sizes.append(self.file_path(file_id).stat().st_size)
            except FileNotFoundError:
                pass
        return {**self._counts, "files": len(sizes), "file_bytes": sum(sizes)}

    def _count(self, name: str, delta: int = 1) -> None:
        self._counts[name] += delta  # not atomic across threads: a rare lost update in a statistic

    def close(self) -> None:
        """Release this process's slot files (recording their clean end) and read handles."""
        with self._open_lock:
            writers, readers = list(self._writers.values()), [*self._readers.values(), *self._retired]
            self._writers, self._readers, self._retired = {}, {}, []
        for writer in writers:
            with writer.lock:
                _close_writer(writer)
        for fd in readers:
            os.close(fd)
        self._closed = True

    def destroy(self) -> None:
        """Close, then delete the directory and every spill file in it."""
        self.close()
        try:
            shutil.rmtree(self.path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise SpillError(f"cannot delete spill directory {self.path}: {exc.strerror}; delete it by hand") from None

    def __enter__(self) -> SpillStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _cctx(self) -> zstandard.ZstdCompressor:
        ctx = self._ctx
        if ctx.cctx is None:
            # The frame carries its content size; no zstd checksum: the record's body check covers it.
            ctx.cctx = zstandard.ZstdCompressor(level=self.level, write_content_size=True, write_checksum=False)
        return ctx.cctx

    def _dctx(self) -> zstandard.ZstdDecompressor:
        ctx = self._ctx
        if ctx.dctx is None:
            ctx.dctx = zstandard.ZstdDecompressor()
        return ctx.dctx


def _reopen(path: str, level: int, lock_timeout_s: float) -> SpillStore:
    return SpillStore(path, level=level, create=False, lock_timeout_s=lock_timeout_s)


def _existing_dir(path: str | os.PathLike) -> tuple[Path, tuple[int, int]]:
    p = Path(path).expanduser().absolute()
    if not os.path.lexists(p):
        raise SpillError(f"no spill directory at {p}; create the store with create=True, or pass the right path")
    return _make_folder(p)  # verified as ours (never a planted symlink) like a new one


def _loc_fields(loc: SpillLoc | tuple[int, int, int]) -> tuple[int, int, int]:
    try:
        file_id, offset, stored_len = int(loc[0]), int(loc[1]), int(loc[2])
    except (TypeError, ValueError, IndexError):
        raise InvalidArgument(f"a spill location is (file_id, offset, stored_len[, raw_len]), got {loc!r}") from None
    if file_id < 0 or offset < 0 or stored_len < 0:
        raise InvalidArgument(f"a spill location has no negative fields, got {loc!r}")
    return file_id, offset, stored_len


def _head_problem(head: _Head, head_buf: bytearray, key: bytes, stored_len: int) -> str | None:
    """Why a record header read for ``key`` is unusable, or None if it is fine."""
    if head.magic != RECORD_MAGIC or head.version != RECORD_VERSION:
        return "no record starts there (bad magic or version)"
    if head.key_len != len(key):
        return f"its key is {head.key_len} bytes, not {len(key)}"
    disk_key = bytes(head_buf[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + len(key)])
    if _head_check(head_buf, disk_key) != head.head_check:
        return "its header fails its checksum"
    if disk_key != key:
        return "it holds another key"
    return _length_problem(head, stored_len)


def _load_record(fd: int | None, offset: int, key: bytes, body: Buffer) -> tuple[_Head | None, str | None]:
    """One preadv of header, key and stored bytes, then every check: (header, None) or (None, why)."""
    if fd is None:
        return None, "its spill file is missing"
    if offset < FILE_HEADER_BYTES:
        return None, "the location points into the file header"
    head_buf = bytearray(RECORD_HEADER_BYTES + len(key) + _pad(len(key)))
    try:
        complete = _preadv_all(fd, [head_buf, body], offset)
    except OSError as exc:
        return None, f"read failed: {exc.strerror}"
    if not complete:
        return None, "the record is cut short (file truncated, or a bad location)"
    head = _Head._make(_REC_HDR.unpack_from(head_buf))
    problem = _head_problem(head, head_buf, key, len(body))
    if problem is None and _body_check(body) != head.body_check:
        problem = "the stored bytes fail their checksum"
    return (head, None) if problem is None else (None, problem)


def _holds_other_key(fd: int, offset: int, key: bytes) -> bool:
    """True if an intact record for another key starts at ``offset``: a stale location, not damage."""
    try:
        found = _read_record_head(fd, offset, os.fstat(fd).st_size)
    except OSError:
        return False
    return found is not None and found[1] != key


def _length_problem(head: _Head, stored_len: int | None = None) -> str | None:
    if head.flags not in (0, FLAG_ZSTD):
        return f"unknown codec flags {head.flags:#x}"
    if stored_len is not None and head.stored_len != stored_len:
        return f"it stores {head.stored_len} bytes, not the {stored_len} of the location"
    compressed = bool(head.flags & FLAG_ZSTD)
    if (head.stored_len < head.raw_len) != compressed or head.stored_len > head.raw_len:
        return "its raw and stored lengths do not match its codec"
    return None


# --- file-level protocol (NOTE [spill records]: Writing, Repair) --------------------------------


def _flock_wait(fd: int, path: Path, slot: int, timeout_s: float) -> None:
    """Take the slot file's lock; only gc (briefly) or a live owner of the same slot holds it."""
    flock_within(fd, timeout_s, lambda: LockTimeout(
        f"spill file {path} stayed locked for {timeout_s:.1f}s: another live process "
        f"writes slot {slot}; each process must append with its own liveness slot "
        f"(find the holder with `fuser {path}`)"
    ), first_sleep_s=1e-3)


def _take_over(fd: int, path: Path) -> int:
    """Make a freshly locked slot file ready to append to; return its valid end."""
    size = os.fstat(fd).st_size
    try:
        if size < FILE_HEADER_BYTES:  # new, or its creator died writing the header: nothing to keep
            os.ftruncate(fd, 0)
            _write_file_header(fd, clean_end=0)
            return FILE_HEADER_BYTES
        clean_end = _read_file_header(fd, path)
        end = size if clean_end == size else _scan(fd, size, verify=False)[0]
        if end < size:
            log.info("spill file %s: truncating a torn tail of %d bytes left by a writer that died", path, size - end)
            os.ftruncate(fd, end)
        _write_file_header(fd, clean_end=0)  # until our close(), the end is not known to be clean
    except SpillError:  # not a spill file: an OSError too, but not a write failure
        raise
    except OSError as exc:
        raise _write_error(exc, path) from None
    return end


def _write_file_header(fd: int, clean_end: int) -> None:
    fields = (FILE_MAGIC, FORMAT_VERSION, ALIGN, 0, clean_end)
    crc = zlib.crc32(_FILE_HDR.pack(*fields, 0)[:24])
    _pwritev_all(fd, [_FILE_HDR.pack(*fields, crc)], 0)


def _read_file_header(fd: int, path: Path) -> int:
    """The header's clean_end (0 when it cannot be trusted); SpillError if it is not a spill file."""
    head = os.pread(fd, FILE_HEADER_BYTES, 0)
    magic, version, align, _, clean_end, crc = _FILE_HDR.unpack(head)
    if magic != FILE_MAGIC or version != FORMAT_VERSION or align != ALIGN:
        raise SpillError(
            f"{path} is not a shmcache spill file of format {FORMAT_VERSION}; delete it (or the "
            f"whole spill directory) - its items are recomputed"
        )
    return clean_end if zlib.crc32(head[:24]) == crc else 0


def _close_writer(writer: _Writer) -> None:
    try:
        _write_file_header(writer.fd, clean_end=writer.end)  # lets the next owner skip the scan
    except OSError:
        pass  # clean_end stays 0: the next owner scans, which is only slower
    os.close(writer.fd)


def _truncate_quietly(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass  # the next append overwrites the tail at the same offset; a takeover scan drops it


def _scan(fd: int, size: int, verify: bool) -> tuple[int, int, int]:
    """Walk the records: (end of the last valid one, records, records failing the body check)."""
    pos, records, corrupt = FILE_HEADER_BYTES, 0, 0
    while True:
        found = _read_record_head(fd, pos, size)
        if found is None:
            break
        head = found[0]
        end = pos + _record_bytes(head.key_len, head.stored_len)
        if end > size:  # a record the writer did not finish
            break
        if verify and not _body_ok(fd, pos + RECORD_HEADER_BYTES + head.key_len + _pad(head.key_len), head):
            corrupt += 1
        records += 1
        pos = end
    return pos, records, corrupt


def _read_record_head(fd: int, pos: int, size: int) -> tuple[_Head, bytes] | None:
    """(header, key) of the record at ``pos`` if its header is complete and checks out, else None."""
    if pos + RECORD_HEADER_BYTES > size:
        return None
    buf = os.pread(fd, _SCAN_READ, pos)
    if len(buf) < RECORD_HEADER_BYTES:
        return None
    head = _Head._make(_REC_HDR.unpack_from(buf))
    if head.magic != RECORD_MAGIC or head.version != RECORD_VERSION:
        return None
    key_end = RECORD_HEADER_BYTES + head.key_len
    if len(buf) < key_end:
        buf += os.pread(fd, key_end - len(buf), pos + len(buf))
    key = buf[RECORD_HEADER_BYTES:key_end]
    if len(buf) < key_end or _head_check(buf, key) != head.head_check or _length_problem(head):
        return None
    return head, key


def _body_ok(fd: int, body_pos: int, head: _Head) -> bool:
    body = os.pread(fd, head.stored_len, body_pos)
    return len(body) == head.stored_len and _body_check(body) == head.body_check


def _recover_file(path: Path, verify: bool, report: RecoverReport) -> bool:
    """Repair one slot file unless its writer is alive; True if a torn tail was cut off."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        report.files += 1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            report.live += 1
            return False
        return _repair_locked(fd, path, verify, report)
    finally:
        os.close(fd)  # drops the lock


def _repair_locked(fd: int, path: Path, verify: bool, report: RecoverReport) -> bool:
    size = os.fstat(fd).st_size
    if size < FILE_HEADER_BYTES:
        end = 0  # its creator died writing the header; the next owner writes a new one
    else:
        try:
            _read_file_header(fd, path)
        except SpillError as exc:
            report.foreign += 1
            log.warning("%s", exc)
            return False
        end, records, corrupt = _scan(fd, size, verify)
        report.records += records
        report.corrupt_records += corrupt
    report.bytes_valid += end
    if end == size:
        return False
    log.info("spill file %s: truncating a torn tail of %d bytes left by a writer that died", path, size - end)
    os.ftruncate(fd, end)
    report.bytes_truncated += size - end
    return True
