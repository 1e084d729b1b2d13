"""Spill files: items that do not fit in shared memory, in self-checking files on disk.

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
location in its index entry. The record format is ``records``' and the crash protocol is
``recovery``'s (NOTE [spill records]).
"""

from __future__ import annotations

import errno
import logging
import os
import re
import secrets
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import zstandard

from ...base.locks import close_in_forked_children
from ...base.namespace import make_private_dir
from ...errors import InvalidArgument, NotOwner, SpillError
from ..records import (
    FILE_HEADER_BYTES,
    FLAG_ZSTD,
    MAX_KEY_BYTES,
    RECORD_HEAD,
    RECORD_HEADER_BYTES,
    Buffer,
    RecordHead,
    body_check,
    encode_payload,
    head_problem,
    pack_head,
    padding,
    record_bytes,
)
from .recovery import (
    RecoverReport,
    flock_wait,
    preadv_all,
    pwritev_all,
    read_record_head,
    recover_file,
    take_over,
    truncate_quietly,
    write_error,
    write_file_header,
)

log = logging.getLogger("shmcache")

MAX_FILE_IDS = 1 << 16  # spill files a location can name: its file_id (the writer's slot) has 16 bits
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


class SpillLoc(NamedTuple):
    """Where a record lives: what the store keeps in the item's index entry."""

    file_id: int
    offset: int
    stored_len: int
    raw_len: int

    @property
    def compressed(self) -> bool:
        return self.stored_len < self.raw_len


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
    if not isinstance(slot, int) or isinstance(slot, bool) or not 0 <= slot < MAX_FILE_IDS:
        raise InvalidArgument(
            f"spill slot must be an int in [0, {MAX_FILE_IDS}), got {slot!r}; pass the process's liveness slot"
        )
    return slot


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


# filesystems that are views of the kernel: a spill file there cannot be created (or means nothing)
_VIRTUAL_FS = frozenset({"proc", "sysfs", "devpts", "cgroup", "cgroup2", "debugfs", "tracefs", "securityfs",
                         "configfs", "bpf", "pstore", "fusectl", "binfmt_misc", "efivarfs", "mqueue", "autofs",
                         "nsfs", "rpc_pipefs"})


def _filesystem(p: Path) -> str | None:
    """The type of the filesystem ``p`` is on (the longest mount point above it), or None."""
    best, kind = "", None
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                fields = line.split()
                if len(fields) < 3:
                    continue
                mount = fields[1].replace("\\040", " ")
                inside = str(p) == mount or str(p).startswith(mount.rstrip("/") + "/")
                if inside and len(mount) >= len(best):
                    best, kind = mount, fields[2]
    except OSError:
        return None
    return kind


def _probe_writable(p: Path) -> None:
    probe = p / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        fs = _filesystem(p)
        if fs in _VIRTUAL_FS:
            what = f"is on {fs}, a filesystem of the kernel that holds no files of ours"
        elif exc.errno == errno.EROFS:
            what = f"is not writable: it is on a read-only filesystem ({fs or 'of unknown type'})"
        elif exc.errno in (errno.EACCES, errno.EPERM):
            raise SpillError(
                f"spill_dir {p} is not writable: {exc.strerror}; fix its permissions (chmod u+rwx), or "
                f"pass a writable spill_dir (or set $SHMCACHE_SPILL_DIR)"
            ) from None
        else:
            what = f"cannot hold files: creating one there failed ({exc.strerror})"
        raise SpillError(f"spill_dir {p} {what}; pass a directory on a writable disk as spill_dir "
                         f"(or set $SHMCACHE_SPILL_DIR)") from None
    os.close(fd)
    os.unlink(probe)


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
        flags, stored = encode_payload(raw, self._cctx())
        head = pack_head(flags, key, len(raw), stored)
        writer = self._writer(slot)
        size = record_bytes(len(key), len(stored))
        with writer.lock:
            offset = writer.end
            try:
                pwritev_all(writer.fd, [head, key, bytes(padding(len(key))), stored, bytes(padding(len(stored)))],
                            offset)
            except OSError as exc:
                truncate_quietly(writer.fd, offset)  # drop the partial record: the file stays valid
                raise write_error(exc, writer.path) from None
            writer.end = offset + size
        self._count("records")
        self._count("bytes_disk", len(stored))
        self._count("bytes_disk_raw", len(raw))
        return SpillLoc(slot, offset, len(stored), len(raw))

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
            raise write_error(exc, path) from None
        try:
            flock_wait(fd, path, slot, self.lock_timeout_s)
            end = take_over(fd, path)
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
               stale: Callable[[], bool] | None = None) -> RecordHead | None:
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
            if recover_file(self.file_path(file_id), verify, report):
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


def _load_record(fd: int | None, offset: int, key: bytes, body: Buffer) -> tuple[RecordHead | None, str | None]:
    """One preadv of header, key and stored bytes, then every check: (header, None) or (None, why)."""
    if fd is None:
        return None, "its spill file is missing"
    if offset < FILE_HEADER_BYTES:
        return None, "the location points into the file header"
    head_buf = bytearray(RECORD_HEADER_BYTES + len(key) + padding(len(key)))
    try:
        complete = preadv_all(fd, [head_buf, body], offset)
    except OSError as exc:
        return None, f"read failed: {exc.strerror}"
    if not complete:
        return None, "the record is cut short (file truncated, or a bad location)"
    head = RecordHead._make(RECORD_HEAD.unpack_from(head_buf))
    problem = head_problem(head, head_buf, key, len(body))
    if problem is None and body_check(body) != head.body_check:
        problem = "the stored bytes fail their checksum"
    return (head, None) if problem is None else (None, problem)


def _holds_other_key(fd: int, offset: int, key: bytes) -> bool:
    """True if an intact record for another key starts at ``offset``: a stale location, not damage."""
    try:
        found = read_record_head(fd, offset, os.fstat(fd).st_size)
    except OSError:
        return False
    return found is not None and found[1] != key


def _close_writer(writer: _Writer) -> None:
    try:
        write_file_header(writer.fd, clean_end=writer.end)  # lets the next owner skip the scan
    except OSError:
        pass  # clean_end stays 0: the next owner scans, which is only slower
    os.close(writer.fd)
