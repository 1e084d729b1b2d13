"""Slab allocator: size classes, one data segment per class, chunks handed out in O(1).

A record of ``n`` bytes goes to the smallest size class that holds it. Up to 4 KiB the classes are
every multiple of 64 bytes (a record gets a chunk of its exact size rounded up to 64 bytes); above,
32 classes per doubling, so a chunk wastes under 1/32 of its size (a 150 KB image: 0.6%). Each
class owns one data segment where chunk ``k`` starts at ``DATA_OFF + k * chunk_size``: that fixed
stride is what lets a batch of one field be gathered with one vectorised copy.

A class segment is sized to the cache's capacity with ftruncate (sparse: free) and committed with
posix_fallocate 64 KiB (or one chunk, if larger) at a time as chunks are handed out (NOTE [segment
lifecycle]): shared memory used tracks the payload, not the segment size.

All allocator state lives in the cache's meta segment (generation.MetaLayout) and is changed only
under the cache's lock; the store's intent record makes each allocation undoable if its writer dies
(NOTE [publish order]). No chunk is ever freed except by undoing its allocation, so
the state of a class is its chunk size, a bump index and the number of chunks committed.
"""

from __future__ import annotations

import struct

from ..base.shm import word_view

__all__ = ["size_class", "MAX_CLASSES", "DATA_OFF", "ClassTable", "commit_step_chunks"]

MAX_CLASSES = 1024
# data starts 4 KiB into a class segment: the header sits alone in the first 4 KiB. An offset, not a
# page size: on a kernel with 64 KiB pages (aarch64) the header shares its page with the first
# chunks, which is harmless (commits are byte ranges: posix_fallocate rounds to pages itself)
DATA_OFF = 4096
_U64x4 = struct.Struct("QQQQ")  # chunk_size, bump (next unused chunk), committed chunks, reserved
_U64 = struct.Struct("Q")


def size_class(nbytes: int) -> tuple[int, int]:
    """``(class id, chunk size)`` for a record of ``nbytes`` bytes."""
    units = max(1, -(-nbytes // 64))
    if units <= 64:
        return units, units * 64
    e = (units - 1).bit_length() - 1  # units in (2**e, 2**(e+1)]
    step = 1 << (e - 5)
    k = -(-units // step)  # 33..64
    cls = 64 + (e - 6) * 32 + (k - 32)
    if cls >= MAX_CLASSES:
        raise OverflowError(f"a record of {nbytes} bytes is beyond the largest size class")
    return cls, k * step * 64


def commit_step_chunks(chunk_size: int) -> int:
    """How many chunks to commit at a time: 64 KiB worth (at least one). Small enough that the
    slack at the end of a class is negligible, large enough that small records don't pay a
    posix_fallocate call each."""
    return max(1, (64 << 10) // chunk_size)


class ClassTable:
    """The per-class allocator records inside the meta segment (one 32-byte record per class):
    chunk size, bump, committed chunks, reserved chunks (``reserved``)."""

    def __init__(self, buf, offset: int):
        self.buf = buf
        self.offset = offset
        self._words = word_view(buf)  # bump and committed are read lock-free: one store each

    def _off(self, cls: int) -> int:
        return self.offset + 32 * cls

    def get(self, cls: int) -> tuple[int, int, int]:
        """``(chunk size, bump, committed chunks)``; chunk size 0 means the class is unused. The
        bump is loaded first, on its own: a writer commits, fences, then moves the bump
        (admission.Admission.commit), so a reader that sees a bump sees the committed count it needs (``bump <=
        committed``, NOTE [publish order]); one unpack of all three may load them in any order."""
        w = self._off(cls) >> 3
        words = self._words
        bump = words[w + 1]
        return words[w], bump, words[w + 2]

    def chunk_size(self, cls: int) -> int:
        return _U64.unpack_from(self.buf, self._off(cls))[0]

    def create(self, cls: int, chunk_size: int) -> None:
        w = self._off(cls) >> 3
        self._words[w + 1] = self._words[w + 2] = self._words[w + 3] = 0
        self._words[w] = chunk_size  # last: the class is in use from here on

    def set_bump(self, cls: int, bump: int) -> None:
        """Chunks below ``bump`` are handed out. A rollback restores the previous value, which is
        why no free list is needed: no chunk is ever freed except by undoing its allocation."""
        self._words[(self._off(cls) >> 3) + 1] = bump

    def set_committed(self, cls: int, committed: int) -> None:
        self._words[(self._off(cls) >> 3) + 2] = committed

    def reserved(self, cls: int) -> int:
        """Chunks counted in the meta's committed total for pages asked ahead
        (Admission.commit_ahead): those past ``committed`` are the next commit's without room
        asked again. Writers only, under the lock; 0 in a record written before it existed."""
        return self._words[(self._off(cls) >> 3) + 3]

    def set_reserved(self, cls: int, chunks: int) -> None:
        self._words[(self._off(cls) >> 3) + 3] = chunks

    def used_classes(self) -> list[int]:
        return [c for c in range(1, MAX_CLASSES) if self.chunk_size(c)]
