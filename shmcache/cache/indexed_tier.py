"""What the store needs of an *indexed* tier: a place its records go when shared memory is full,
found again through the store's own shared index (NOTE [tiers]).

The store (``CacheStore``) decides what goes to such a tier and publishes where it went: it writes the
record through ``write``, which only stores it and answers its ``RecordLocation``; the store puts that
location into the index entry (NOTE [publish order]), with the same intent record and totals as
a record in memory. A reader of the entry hands the location back to ``read``. The tier never
touches the store, and the store never knows how the tier stores a record.

The spill files are the one indexed tier (``tiers.spill.tier.SpillTier``). Tiers *behind* the
store, asked by key rather than found through the index (remote, snapshot), are ``tiers.protocol.Tier``.
This module sits below the store so the store can name the protocol it calls.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol, runtime_checkable

__all__ = ["RecordLocation", "IndexedTier"]

Buffer = bytes | bytearray | memoryview


class RecordLocation(NamedTuple):
    """Where an indexed tier put a record: what the store writes into the record's index entry."""

    word: int  # the entry's location word (the spill tier: file id << 48 | offset)
    stored: int  # bytes as stored (the entry's length field: below 2**32)
    raw: int = 0  # bytes of the record before compression (the store's disk totals)


@runtime_checkable
class IndexedTier(Protocol):
    """A place for a cache's records behind its shared memory, found through its index.

    The key is the portable key (``index.tier_key``: the index word, then the key bytes), which
    the tier stores with the record and checks on every read. Faults are misses: ``write``
    answers None when it cannot store (and may stop accepting: ``accepting``), ``read`` answers
    None for a record that is gone, cut short, damaged or another key's.
    """

    name: str  # "spill": how logs and stats call it
    where: str  # for messages and the cache's metadata: the spill tier's folder
    accepting: bool  # False once it stopped taking writes (a full disk): the store stops asking

    def write(self, key: bytes, record: Buffer) -> RecordLocation | None:
        """Store ``record`` under ``key``; where it went, or None (not stored)."""

    def read(self, location: RecordLocation, key: bytes, stale: Callable[[], bool] | None = None) -> bytearray | None:
        """The record at ``location`` if it is ``key``'s and intact, else None. ``stale``, asked
        only after a failed read, says whether the location was dropped meanwhile (a clear()):
        then the miss is not damage."""

    def key_of(self, location: RecordLocation, w1: int) -> bytes | None:
        """The key bytes stored with the record at ``location`` (whose index word is ``w1``), or
        None: a walk over entries (a snapshot export) learns a str/bytes key of a spilled record."""

    def counters(self) -> dict[str, int]:
        """What this process saw of the tier (reads, misses, records and bytes written, ...)."""

    def clear(self) -> None:
        """Drop every record (the store made a new generation: no entry names them any more)."""

    def reopen(self) -> None:
        """Start afresh on what exists now (a clear() in another process replaced the records)."""

    def destroy(self) -> None:
        """Remove every record and the place itself (the cache is destroyed)."""

    def collect_garbage(self) -> None:
        """Repair what a writer that died left (``shmcache gc``)."""

    def close(self) -> None:
        """This handle is done with the tier."""
