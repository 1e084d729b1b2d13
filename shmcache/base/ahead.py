"""Pages backed ahead of the commit that will need them, on a thread of their own (issue 31).

A cold batch's records go into fresh pages: ``Segment.commit`` (one ``posix_fallocate`` of the
run's chunks), then one ``pwritev``. Allocating the pages costs about as much as copying the bytes
into them, on the thread that computes the next batch. ``submit`` hands the range the next run
will commit to a worker thread of this process (``_ahead.c``: a plain pthread, no GIL, no Python
object), which backs it while the caller computes; ``Segment.commit`` asks ``backed`` and backs
only what lies past a range backed already. Where the kernel can (``MADV_POPULATE_WRITE``,
Linux 5.14), the thread also maps the backed range with every page present and writable, and
``copy_into`` copies a run's records through that mapping (``Segment.write_at``: a memcpy, about
a third of a pwritev's time, the page-table work done on that thread with the allocation). A hint
only: a request replaced by a newer one, failed (a full /dev/shm) or not done yet leaves the
commit to back the range itself, and the write to pwrite it, as without it. Built at install
where a C compiler is present; without it, or with ``SHMCACHE_NATIVE=0``, ``NATIVE`` is False
and every commit backs its own range.
"""

from __future__ import annotations

import os

from . import settings

__all__ = ["NATIVE", "backed", "copy_into", "mapping_unavailable_reason", "outcome", "release", "submit",
           "unavailable_reason"]

try:
    from . import _ahead
except ImportError:  # no C compiler at install, or a source checkout never built
    _ahead = None
_why = settings.native_unavailable(_ahead is not None, "pages backed ahead")
NATIVE = not _why


def _kernel_release() -> tuple[int, int]:
    try:
        major, minor = os.uname().release.split("-")[0].split(".")[:2]
        return int(major), int(minor)
    except ValueError:  # not numbers: say it can, the thread finds out on its first try
        return (99, 0)


# MADV_POPULATE_WRITE came in Linux 5.14: before it, the thread backs pages but maps none present
_MAP_WHY = "" if _kernel_release() >= (5, 14) else \
    f"mapping pages present (MADV_POPULATE_WRITE) needs Linux 5.14; this is {os.uname().release}"
# Segment.write_at copies into a range backed ahead through the thread's mapping of it (copy_into);
# a benchmark's baseline turns it off (benchmarks/bench_cold_epoch.py, ``pw x``): pwritev, as before
COPY_MAPPED = NATIVE and not _MAP_WHY


def unavailable_reason() -> str:
    """Why pages are not backed ahead, and what to do ('' when they are)."""
    return _why


def mapping_unavailable_reason() -> str:
    """Why a run's records are pwritten into pages backed ahead rather than copied through the
    thread's mapping of them ('' where they are copied: built, on, and a kernel that can)."""
    return _why or _MAP_WHY


def submit(fd: int, offset: int, length: int) -> int:
    """Back ``[offset, offset + length)`` of ``fd``'s file on the worker thread (a duplicate of
    ``fd``: the caller may close its own at once); the request's number, for ``backed``. OSError
    if the descriptor cannot be duplicated or the thread started. Only where ``NATIVE``."""
    return _ahead.submit(fd, offset, length)


def outcome(request: int) -> int | None:
    """None while request ``request`` waits or runs (or after a newer one replaced it, or once
    it is among the oldest, forgotten); then 0 if it backed its whole range, else the errno of
    the call that failed."""
    return _ahead.result(request)


def backed(request: int) -> bool:
    """Whether request ``request`` has backed its whole range."""
    return _ahead.result(request) == 0


def copy_into(request: int, offset: int, buffers: list, end: int) -> bool:
    """Copy ``buffers`` (one after the other) to file offset ``offset`` through the mapping the
    thread made for ``request``: True if it has one and the bytes lie inside the request's range,
    else False and nothing copied (the caller pwrites them). ValueError, nothing copied, if they
    would end past ``end``. Only where ``NATIVE``."""
    return _ahead.copy_into(request, offset, buffers, end)


def release() -> None:
    """This process unlinked a file (a cache destroyed, cleared, collected): the thread's
    mapping, which keeps its whole file's pages for as long as it exists, is unmapped now, and the
    mapping of a request under way is not kept. The next run in a range backed ahead is pwritten."""
    if _ahead is not None:
        _ahead.release()
