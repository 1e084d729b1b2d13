"""Rows copied out of a strided source in one pass: the batch gather's copy (issue 27).

A column of a batch is ``nbytes`` at ``offset`` within rows ``rows[i]`` of a class segment's
chunks (``stride`` bytes each). numpy has no such gather into a given buffer: ``np.take`` first
copies a source that is not C-contiguous whole, and a fancy index makes a temporary that a second
copy moves into the destination. The compiled loop (``_rowcopy.c``: a memcpy per row, bounds
checked before the first byte moves, without the GIL) copies each row once, straight into the
destination. It is built at install where a C compiler is present; without it, or with
``SHMCACHE_NATIVE=0``, ``NATIVE`` is False and the callers (``cache.gather``) take numpy's ways,
which give the same bytes.

``write_all`` is the writer's loop: a run of records pwritten from their buffers, each buffer taken
once (``shm.Segment.write_at``).

The same module compares a batch's table entries with what the caller expects in one pass
(``match``): the warm batch's checks (``cache.gather.planned_chunks``), one call where numpy
needs eight.
"""

from __future__ import annotations

from . import settings

__all__ = ["NATIVE", "gather", "match", "unavailable_reason", "write_all"]

try:
    from . import _rowcopy
except ImportError:  # no C compiler at install, or a source checkout never built
    _rowcopy = None
_why = settings.native_unavailable(_rowcopy is not None, "the one-pass copy")
NATIVE = not _why


def unavailable_reason() -> str:
    """Why the compiled row copy is not used, and what to do ('' when it is used)."""
    return _why


def gather(src, offset: int, stride: int, nbytes: int, rows, dst) -> None:
    """Row ``i`` of ``dst`` (C-contiguous, writable, at least ``len(rows) * nbytes`` bytes) =
    ``nbytes`` of ``src`` (a contiguous buffer) from ``offset + rows[i] * stride``, for each
    ``i``; ``rows``: a 1-D intp array (any stride). IndexError, with nothing copied, for a row
    whose bytes end past ``src``; ValueError for a ``dst`` that overlaps ``src`` or ``rows``. Only
    where ``NATIVE``."""
    _rowcopy.gather(src, offset, stride, nbytes, rows, dst)


def match(words, keys, first: int, base: int, limit: int, chunks) -> bool:
    """True if, for each ``i``, row ``keys[i]`` of ``words`` (an aligned, C-contiguous ``(rows,
    3)`` uint64 array) is ``(first, keys[i], base + c)`` with ``0 <= c < limit``; then
    ``chunks[i] = c`` (``chunks``: a C-contiguous intp array of at least ``len(keys)``). False at
    the first key that is negative, past the rows or whose words differ (``chunks`` then holds
    what came before it). Word 0 of each row is loaded first, with acquire order. ``first``,
    ``base`` and ``limit`` are below 2**64. Only where ``NATIVE``."""
    return _rowcopy.match(words, keys, first, base, limit, chunks)


def write_all(fd: int, offset: int, buffers, end: int) -> int:
    """pwritev of every one of ``buffers`` (contiguous bytes-like objects, one after the other) at
    ``offset`` of ``fd``, going on after a short write; the bytes written. ValueError, with nothing
    written, where they would end past ``end``; OSError as pwritev's. Only where ``NATIVE``."""
    return _rowcopy.write_all(fd, offset, buffers, end)
