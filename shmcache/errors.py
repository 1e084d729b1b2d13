"""Every error shmcache raises.

Each leaf subclasses ``ShmcacheError`` and the builtin it refines, so callers can catch either
(``except MemoryError`` still catches ``ItemTooLarge``). ``CacheFull`` is the base of the errors
that mean the memory the cache lives in cannot take an item, ``ItemTooLarge`` and
``SharedMemoryFull``: ``except CacheFull`` catches both, and both are still a ``ShmcacheError`` and
a ``MemoryError`` through it. Messages say what happened, where, the value,
and how to fix it. Errors cross process boundaries (DataLoader workers, the launcher), so each one
pickles: they keep their message as the only constructor argument.
"""

from __future__ import annotations

__all__ = [
    "ShmcacheError",
    "InvalidArgument",
    "InvalidKey",
    "SessionNotFound",
    "SessionExists",
    "SessionInUse",
    "CacheNotFound",
    "CacheInUse",
    "CacheMismatch",
    "CacheFull",
    "ItemTooLarge",
    "SharedMemoryFull",
    "LockTimeout",
    "ProbeTimeout",
    "NotOwner",
    "CorruptSegment",
    "EncodeError",
    "SpillError",
    "SpillFull",
    "PrefetchError",
    "PrefetchStall",
    "LaunchError",
    "RendezvousTimeout",
    "SnapshotError",
    "RangeNotHonored",
    "ItemNotCached",
    "OrderingUnavailable",
]


class ShmcacheError(Exception):
    """Base class of every shmcache error."""

    def __reduce__(self):  # one-argument constructor: survives pickling across processes
        return (type(self), (str(self),))


class InvalidArgument(ShmcacheError, ValueError):
    """An argument has the wrong type or value; the message names it and the fix."""


class InvalidKey(InvalidArgument, TypeError):
    """A cache key that is not an int (64-bit), a str or bytes."""


class SessionNotFound(ShmcacheError, LookupError):
    """No session of that name exists in this namespace."""


class SessionInUse(ShmcacheError, RuntimeError):
    """The session has live processes attached (destroy it with force=True, or stop them)."""


class CacheInUse(ShmcacheError, RuntimeError):
    """The cache is open in a live process (drop it with force=True, or stop them)."""


class SessionExists(ShmcacheError, FileExistsError):
    """A session of that name already exists."""


class CacheNotFound(ShmcacheError, LookupError):
    """No cache of that name exists in the session."""


class CacheMismatch(ShmcacheError, ValueError):
    """A cache of that name exists but holds a different dataset (another fingerprint)."""


class CacheFull(ShmcacheError, MemoryError):
    """The cache's memory cannot take an item: the base of :class:`ItemTooLarge` and
    :class:`SharedMemoryFull`, never raised itself. A cache that reaches its cap in normal use
    raises nothing: ``put`` returns False (or spills) and the dataset serves the item uncached.
    A full spill disk is not one of these: :class:`SpillFull` is a disk error (an ``OSError``)
    that the spill tier catches, after which the store keeps going memory-only."""


class ItemTooLarge(CacheFull):
    """One item is larger than the whole cache can ever hold (a ``MemoryError`` via CacheFull).
    Raised by an explicit ``put``; a value the cache computes for its caller (``ds[i]``,
    ``get(key, fn)``, a batch) is served instead, counted as rejected and logged once."""


class SharedMemoryFull(CacheFull):
    """``/dev/shm`` itself has no room left (ENOSPC from posix_fallocate; a ``MemoryError`` via
    CacheFull)."""


class LockTimeout(ShmcacheError, TimeoutError):
    """A lock held by a live process was not released in time."""


class ProbeTimeout(ShmcacheError, TimeoutError):
    """``wrap()`` read a sample of the dataset to name its cache, and the read did not return in
    time (a ``__getitem__`` that waits for DataLoader workers, a barrier); the message names the
    dataset and ``fingerprint=``, which skips the reads."""


class NotOwner(ShmcacheError, PermissionError):
    """A shared-memory object or lock file belongs to another user."""


class CorruptSegment(ShmcacheError, RuntimeError):
    """A shared-memory segment's header is not one shmcache wrote (or is from another version)."""


class EncodeError(ShmcacheError, TypeError):
    """A value cannot be stored: not encodable and not picklable."""


class SpillError(ShmcacheError, OSError):
    """The spill directory is missing, not a directory or not writable."""


class SpillFull(SpillError):
    """The spill disk is full (ENOSPC, EDQUOT, EFBIG): the store should stop spilling.

    The partial record was already truncated away; every earlier record is still readable.
    Any other write failure raises plain :class:`SpillError`, so a store that catches
    ``SpillError`` degrades to memory-only on both.
    """


class PrefetchError(ShmcacheError, RuntimeError):
    """The prefetch producer failed; the message names the batch where it happened."""


class PrefetchStall(ShmcacheError, TimeoutError):
    """The prefetch producer made no progress within its timeout."""


class LaunchError(ShmcacheError, RuntimeError):
    """The launcher could not prepare what the job needs besides the session: a per-node Redis
    (``--remote spawn``) or the exchange of its endpoints; the message names the node and the fix."""


class RendezvousTimeout(LaunchError, TimeoutError):
    """Not every node joined the exchange of endpoints within ``--rdzv-timeout``; names the ranks."""
class SnapshotError(ShmcacheError, OSError):
    """A snapshot cannot be written or read: its destination exists, its disk is full, or it is
    truncated, damaged, incomplete or of another format version; the message names the file."""


class RangeNotHonored(SnapshotError):
    """The server behind a snapshot's URL answered a ranged read with something else (the whole
    file, or an encoded body): a snapshot is read in byte ranges, never downloaded whole."""


class ItemNotCached(ShmcacheError, KeyError):
    """A cache served without its source (``wrap(None)``) does not hold the item asked for."""

    def __str__(self) -> str:  # KeyError's own would print the message quoted, as a repr
        return str(self.args[0]) if self.args else ""


class OrderingUnavailable(ShmcacheError, OSError):
    """A weakly ordered machine (or ``SHMCACHE_ORDERING=membarrier``) without membarrier(2): the
    lock-free reads would be unsafe, so no cache is opened (``ordering.register``)."""
