"""The self-checking record of spill files, and of every tier that keeps values outside shared
memory (remote, snapshot): magic, key, lengths, codec (raw or one zstd frame), checksums.

    parts = pack_record(key, payload, cctx)     # buffers to write one after another (8-aligned)
    data = unpack_record(buf, key, dctx)        # the payload, or None: a miss, never wrong data

Spill files (``SpillStore``) add a file header and the crash protocol; the record itself is here, so a
value that crosses a network or sits in a snapshot carries the same checks.
"""

from __future__ import annotations

import functools
import struct
import sys
import zlib
from typing import NamedTuple, Union

import numpy as np
import zstandard

from ..base import settings
from ..errors import InvalidArgument

__all__ = ["pack_record", "unpack_record", "record_problem", "RECORD_HEADER_BYTES", "FILE_HEADER_BYTES",
           "MAX_KEY_BYTES", "MAX_RAW_BYTES", "MAX_ITEM_MB", "max_item_bytes", "max_record_bytes", "ALIGN", "FLAG_ZSTD",
           "decompress_bounded", "RECORD_HEAD", "FILE_HEAD", "RecordHead", "KEY_LEN_AT", "HEAD_CHECK_AT",
           "padding", "record_bytes", "body_check", "head_check", "head_problem", "length_problem",
           "declared_key_len", "declared_key", "head_check_of", "encode_payload", "pack_head"]

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
# 16, 40 and 64 mod 64 (unlike user-space copies, which align to 64); 64 would cost ~60 bytes a
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
FILE_HEAD = struct.Struct("<8sHHIQI4x")
RECORD_HEAD = struct.Struct("<4sBBHQQII")
FILE_HEADER_BYTES = FILE_HEAD.size  # 32
RECORD_HEADER_BYTES = RECORD_HEAD.size  # 32
KEY_LEN_AT = struct.calcsize("<4sBB")  # 6: where the record header holds the key length ...
HEAD_CHECK_AT = RECORD_HEAD.size - 4  # 28: ... and the head check, its last field, which covers the
# record header up to itself, then the key
_U16 = struct.Struct("<H")
_U32 = struct.Struct("<I")
MAX_KEY_BYTES = (1 << 16) - 1
# The most bytes a record may claim (index.MAX_RECORD: no item larger is ever stored); a caller
# that knows a smaller bound (the cache's cap, what is left of a batch's) passes it as ``limit``.
MAX_RAW_BYTES = (1 << 32) - 1
# The most bytes one value from a source whose records are not authenticated (a Redis or snapshot
# without the job's secret, an import with wrap(None)) may decode to: a zstd frame is bounded by
# the length its record declares, and that length is the writer's choice - three records claiming
# a GiB each took 3.3 GiB in one batch when only the cache's cap bounded them. Authenticated
# records are the job's own: only the cap bounds them. $SHMCACHE_MAX_ITEM_MB changes it.
MAX_ITEM_MB = 256


def max_item_bytes() -> int:
    """The most bytes a value from an unauthenticated source may have here (MAX_ITEM_MB, or
    $SHMCACHE_MAX_ITEM_MB: a positive number of MiB)."""
    raw = settings.get(settings.ENV_MAX_ITEM_MB)
    if raw is None or not raw.strip():
        return MAX_ITEM_MB << 20
    try:
        mib = float(raw)
    except ValueError:
        mib = -1.0
    # (1e-9 is positive, yet a bound of 0 bytes: every value refused)
    if not 0 < mib <= MAX_RAW_BYTES >> 20 or int(mib * (1 << 20)) < 1:
        raise InvalidArgument(f"${settings.ENV_MAX_ITEM_MB}={raw!r}: the largest value from an unauthenticated "
                              f"source, in MiB, must be a positive number of at least a byte (0.5: 512 KiB) "
                              f"and at most {MAX_RAW_BYTES >> 20}; unset it for the default ({MAX_ITEM_MB})")
    return min(MAX_RAW_BYTES, int(mib * (1 << 20)))
_ONE_SHOT_BELOW = 1 << 20  # a frame that declares its exact size decodes in one call below this
_BLOCK_WORDS = 512  # body check: one uint64 sum per 4 KiB block ...
_CRC_BELOW = 8192  # ... for stored bytes this long; shorter ones are faster with plain crc32
_WORD = np.dtype("<u8")
Buffer = Union[bytes, bytearray, memoryview]  # noqa: UP007 - a runtime alias, also on 3.10


class RecordHead(NamedTuple):
    magic: bytes
    version: int
    flags: int
    key_len: int
    raw_len: int
    stored_len: int
    body_check: int
    head_check: int


def padding(n: int) -> int:
    return -n % ALIGN


def record_bytes(key_len: int, stored_len: int) -> int:
    return RECORD_HEADER_BYTES + key_len + padding(key_len) + stored_len + padding(stored_len)


def max_record_bytes(key_len: int, limit: int) -> int:
    """The most bytes an acceptable record of a ``key_len``-byte key whose payload has at most
    ``limit`` bytes can weigh: header, key, stored bytes, padding. The stored bytes never exceed
    the raw ones (zstd is kept only when it saves 5%, and a record claiming otherwise is refused:
    ``length_problem``), so zstd's worst-case expansion never enters; a longer value is no such
    record, and reading more of it is wasted."""
    return record_bytes(key_len, limit)


def body_check(data: Buffer) -> int:
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


def head_check(head: Buffer, key: Buffer) -> int:
    return zlib.crc32(key, zlib.crc32(memoryview(head)[:HEAD_CHECK_AT]))


def head_problem(head: RecordHead, head_buf: Buffer, key: bytes, stored_len: int | None) -> str | None:
    """Why a record header read for ``key`` is unusable, or None if it is fine."""
    if head.magic != RECORD_MAGIC or head.version != RECORD_VERSION:
        return "no record starts there (bad magic or version)"
    if head.key_len != len(key):
        return f"its key is {head.key_len} bytes, not {len(key)}"
    disk_key = bytes(head_buf[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + len(key)])
    if head_check(head_buf, disk_key) != head.head_check:
        return "its header fails its checksum"
    if disk_key != key:
        return "it holds another key"
    return length_problem(head, stored_len)


def length_problem(head: RecordHead, stored_len: int | None = None) -> str | None:
    if head.flags not in (0, FLAG_ZSTD):
        return f"unknown codec flags {head.flags:#x}"
    if stored_len is not None and head.stored_len != stored_len:
        return f"it stores {head.stored_len} bytes, not the {stored_len} of the location"
    compressed = bool(head.flags & FLAG_ZSTD)
    if (head.stored_len < head.raw_len) != compressed or head.stored_len > head.raw_len:
        return "its raw and stored lengths do not match its codec"
    return None


def encode_payload(payload: Buffer, cctx: zstandard.ZstdCompressor | None) -> tuple[int, Buffer]:
    """(flags, stored bytes): zstd if it saves at least 5%, else raw, so incompressible items cost
    no decompression; raw without a compressor (``cctx`` None: the writer chose not to try)."""
    if cctx is None or not len(payload):
        return 0, payload
    packed = cctx.compress(payload)
    if len(packed) * 105 < len(payload) * 100:
        return FLAG_ZSTD, packed
    return 0, payload


def pack_head(flags: int, key: bytes, raw_len: int, stored: Buffer) -> bytes:
    fields = (RECORD_MAGIC, RECORD_VERSION, flags, len(key), raw_len, len(stored), body_check(stored))
    head = RECORD_HEAD.pack(*fields, 0)
    return head[:HEAD_CHECK_AT] + _U32.pack(head_check(head, key))


def declared_key_len(buf: Buffer) -> int:
    """The key length a record's header (at the start of ``buf``) declares: not yet checked."""
    return _U16.unpack_from(buf, KEY_LEN_AT)[0]


def declared_key(buf: Buffer) -> bytes:
    """The key bytes of the record at the start of ``buf``, as its header declares them: not yet
    checked (fewer bytes if ``buf`` ends first; :func:`unpack_record` then refuses the record)."""
    return bytes(memoryview(buf)[RECORD_HEADER_BYTES:RECORD_HEADER_BYTES + declared_key_len(buf)])


def head_check_of(head: Buffer) -> int:
    """The head check a record's header (at the start of ``head``) carries."""
    return _U32.unpack_from(head, HEAD_CHECK_AT)[0]


def pack_record(key: bytes, payload: Buffer, cctx: zstandard.ZstdCompressor | None) -> list[Buffer]:
    """One record for ``payload`` under ``key``, as buffers to write back to back; their total is
    ``record_bytes(len(key), stored)``, a multiple of 8."""
    raw = memoryview(payload).cast("B") if not isinstance(payload, bytes) else payload
    flags, stored = encode_payload(raw, cctx)
    return [pack_head(flags, key, len(raw), stored), key, bytes(padding(len(key))), stored,
            bytes(padding(len(stored)))]


def record_problem(buf: Buffer, key: bytes) -> tuple[RecordHead | None, str | None]:
    """Check a whole record held in ``buf`` (starting at 0) against ``key``: (header, None) when it
    is intact, else (None, why)."""
    view = memoryview(buf).cast("B")
    if len(view) < RECORD_HEADER_BYTES + len(key):
        return None, f"it is cut short ({len(view)} bytes)"
    head = RecordHead._make(RECORD_HEAD.unpack_from(view))
    problem = head_problem(head, view, key, None)
    if problem is not None:
        return None, problem
    start = RECORD_HEADER_BYTES + len(key) + padding(len(key))
    if len(view) < start + head.stored_len:
        return None, f"it is cut short ({len(view)} bytes, the record needs {start + head.stored_len})"
    if body_check(view[start:start + head.stored_len]) != head.body_check:
        return None, "the stored bytes fail their checksum"
    return head, None


def unpack_record(buf: Buffer, key: bytes, dctx: zstandard.ZstdDecompressor, *,
                  copy: bool = True, limit: int = MAX_RAW_BYTES) -> tuple[Buffer | None, str | None]:
    """The payload of the record in ``buf``, or (None, why) if it is not an intact record of
    ``key``; never raises for bad bytes. ``copy``: a fresh bytearray (writable, the caller's own);
    else a raw record's payload is a view of ``buf`` and a zstd one the decompressed bytes (an
    import stores them straight into shared memory: no copy in between). ``limit``: the most
    bytes the payload may have; a record that claims more is refused before anything is
    allocated, and a zstd frame is never decoded past the record's own raw length (a 40 KB frame
    that expands to 1 GiB costs at most what the record declared, within ``limit``)."""
    head, why = record_problem(buf, key)
    if head is None:
        return None, why
    if head.raw_len > limit:
        return None, (f"it claims {head.raw_len} bytes, more than the {limit} a value may have here "
                      f"(hostile or damaged)")
    start = RECORD_HEADER_BYTES + len(key) + padding(len(key))
    stored = memoryview(buf).cast("B")[start:start + head.stored_len]
    if not head.flags & FLAG_ZSTD:
        return (bytearray(stored) if copy else stored), None
    out, why = decompress_bounded(dctx, stored, head.raw_len)
    if out is None:
        return None, why
    return (bytearray(out) if copy and not isinstance(out, bytearray) else out), None


def decompress_bounded(dctx: zstandard.ZstdDecompressor, stored: Buffer,
                       raw_len: int) -> tuple[Buffer | None, str | None]:
    """The one zstd frame ``stored`` decoded to exactly ``raw_len`` bytes, or (None, why); never
    more than ``raw_len`` bytes are allocated or decoded, whatever the frame claims or holds, and
    no zstd error or MemoryError escapes. A frame whose header declares exactly ``raw_len``
    decodes in one call when small (libzstd writes into a buffer of that size and fails on more);
    any other, and every large one, streams into one buffer of ``raw_len`` bytes and stops there."""
    try:
        declared = zstandard.frame_content_size(stored)
        if declared >= 0 and declared != raw_len:
            return None, f"its zstd frame declares {declared} bytes, the record {raw_len}"
        if declared == raw_len < _ONE_SHOT_BELOW:
            out: Buffer = dctx.decompress(stored)
            filled, more = len(out), False
        else:
            out = bytearray(raw_len)
            view, filled = memoryview(out), 0
            with dctx.stream_reader(stored, read_across_frames=False, closefd=False) as reader:
                while filled < raw_len:
                    n = reader.readinto(view[filled:])
                    if not n:
                        break
                    filled += n
                more = bool(reader.read(1))
            view.release()
    except zstandard.ZstdError as exc:
        return None, f"zstd cannot decode it: {exc}"
    except MemoryError:
        return None, f"its {raw_len} bytes cannot be allocated here"
    if filled != raw_len or more:
        return None, f"it decompresses to {'more than ' if more else ''}{filled} bytes, not {raw_len}"
    return out, None
