"""The file-level protocol of spill files (NOTE [spill records]: Writing, Repair): taking over a
slot file, its header, scanning for the last valid record, truncating a torn tail; and the I/O
helpers that never leave a partial record behind."""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ...base.locks import flock_within
from ...errors import LockTimeout, SpillError, SpillFull
from ..records import (
    ALIGN,
    FILE_HEAD,
    FILE_HEADER_BYTES,
    FILE_MAGIC,
    FORMAT_VERSION,
    RECORD_HEAD,
    RECORD_HEADER_BYTES,
    RECORD_MAGIC,
    RECORD_VERSION,
    Buffer,
    RecordHead,
    body_check,
    head_check,
    length_problem,
    padding,
    record_bytes,
)

log = logging.getLogger("shmcache")

_SCAN_READ = 512  # bytes read per record header while scanning: header plus a typical key
_SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


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


def preadv_all(fd: int, bufs: list[Buffer], offset: int) -> bool:
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


def pwritev_all(fd: int, bufs: Iterable[Buffer], offset: int) -> None:
    """Write all of ``bufs`` at ``offset``; a short write (disk filling up) continues or raises."""
    views = [memoryview(b).cast("B") for b in bufs if len(b)]
    while views:
        n = os.pwritev(fd, views, offset)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        offset += n
        views = _advance(views, n)


def write_error(exc: OSError, path: Path) -> SpillError:
    if exc.errno in _SPACE_ERRNOS:
        return SpillFull(
            f"no space left for spill file {path} ({exc.strerror}); spilling stops and the cache "
            f"keeps serving from memory - free space there or pass a spill_dir on a larger disk"
        )
    return SpillError(
        f"cannot write spill file {path}: {exc.strerror} (errno {exc.errno}); spilling stops - "
        f"check that disk, or pass another spill_dir"
    )


def flock_wait(fd: int, path: Path, slot: int, timeout_s: float) -> None:
    """Take the slot file's lock; only gc (briefly) or a live owner of the same slot holds it."""
    flock_within(fd, timeout_s, lambda: LockTimeout(
        f"spill file {path} stayed locked for {timeout_s:.1f}s: another live process "
        f"writes slot {slot}; each process must append with its own liveness slot "
        f"(find the holder with `fuser {path}`)"
    ), first_sleep_s=1e-3)


def take_over(fd: int, path: Path) -> int:
    """Make a freshly locked slot file ready to append to; return its valid end."""
    size = os.fstat(fd).st_size
    try:
        if size < FILE_HEADER_BYTES:  # new, or its creator died writing the header: nothing to keep
            os.ftruncate(fd, 0)
            write_file_header(fd, clean_end=0)
            return FILE_HEADER_BYTES
        clean_end = _read_file_header(fd, path)
        end = size if clean_end == size else _scan(fd, size, verify=False)[0]
        if end < size:
            log.info("spill file %s: truncating a torn tail of %d bytes left by a writer that died", path, size - end)
            os.ftruncate(fd, end)
        write_file_header(fd, clean_end=0)  # until our close(), the end is not known to be clean
    except SpillError:  # not a spill file: an OSError too, but not a write failure
        raise
    except OSError as exc:
        raise write_error(exc, path) from None
    return end


def write_file_header(fd: int, clean_end: int) -> None:
    fields = (FILE_MAGIC, FORMAT_VERSION, ALIGN, 0, clean_end)
    crc = zlib.crc32(FILE_HEAD.pack(*fields, 0)[:24])
    pwritev_all(fd, [FILE_HEAD.pack(*fields, crc)], 0)


def _read_file_header(fd: int, path: Path) -> int:
    """The header's clean_end (0 when it cannot be trusted); SpillError if it is not a spill file."""
    head = os.pread(fd, FILE_HEADER_BYTES, 0)
    magic, version, align, _, clean_end, crc = FILE_HEAD.unpack(head)
    if magic != FILE_MAGIC or version != FORMAT_VERSION or align != ALIGN:
        raise SpillError(
            f"{path} is not a shmcache spill file of format {FORMAT_VERSION}; delete it (or the "
            f"whole spill directory) - its items are recomputed"
        )
    return clean_end if zlib.crc32(head[:24]) == crc else 0


def truncate_quietly(fd: int, size: int) -> None:
    try:
        os.ftruncate(fd, size)
    except OSError:
        pass  # the next append overwrites the tail at the same offset; a takeover scan drops it


def _scan(fd: int, size: int, verify: bool) -> tuple[int, int, int]:
    """Walk the records: (end of the last valid one, records, records failing the body check)."""
    pos, records, corrupt = FILE_HEADER_BYTES, 0, 0
    while True:
        found = read_record_head(fd, pos, size)
        if found is None:
            break
        head = found[0]
        end = pos + record_bytes(head.key_len, head.stored_len)
        if end > size:  # a record the writer did not finish
            break
        if verify and not _body_ok(fd, pos + RECORD_HEADER_BYTES + head.key_len + padding(head.key_len), head):
            corrupt += 1
        records += 1
        pos = end
    return pos, records, corrupt


def read_record_head(fd: int, pos: int, size: int) -> tuple[RecordHead, bytes] | None:
    """(header, key) of the record at ``pos`` if its header is complete and checks out, else None."""
    if pos + RECORD_HEADER_BYTES > size:
        return None
    buf = os.pread(fd, _SCAN_READ, pos)
    if len(buf) < RECORD_HEADER_BYTES:
        return None
    head = RecordHead._make(RECORD_HEAD.unpack_from(buf))
    if head.magic != RECORD_MAGIC or head.version != RECORD_VERSION:
        return None
    key_end = RECORD_HEADER_BYTES + head.key_len
    if len(buf) < key_end:
        buf += os.pread(fd, key_end - len(buf), pos + len(buf))
    key = buf[RECORD_HEADER_BYTES:key_end]
    if len(buf) < key_end or head_check(buf, key) != head.head_check or length_problem(head):
        return None
    return head, key


def _body_ok(fd: int, body_pos: int, head: RecordHead) -> bool:
    body = os.pread(fd, head.stored_len, body_pos)
    return len(body) == head.stored_len and body_check(body) == head.body_check


def recover_file(path: Path, verify: bool, report: RecoverReport) -> bool:
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
