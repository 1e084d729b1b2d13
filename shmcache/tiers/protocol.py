"""The ``Tier`` protocol: what every tier behind a cache's shared memory answers (NOTE [tiers]).

The remote tier (``remote.RedisTier``) and the snapshot tier (``snapshot.tier.SnapshotTier``)
implement it explicitly; ``tiered_store.TieredStore`` reads and writes through it, and
``assembly`` orders, binds and counts the tiers of a cache through it - never by ``hasattr``.
(The spill files are a tier of the other kind, found through the store's index:
``cache.indexed_tier.IndexedTier``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar, Protocol, runtime_checkable

__all__ = ["Tier", "LeaseTier", "Buffer"]

Buffer = bytes | bytearray | memoryview


@runtime_checkable
class Tier(Protocol):
    """A place a cache's values can live behind its shared memory (NOTE [tiers]).

    Keys are *portable keys* (bytes, converted once by the seam), values *portable records*."""

    name: str  # "snapshot", "remote": its place in ``assembly.ORDER``, its stats keys' prefix
    # the names of its counters (``counters()``, its counts file: NOTE [tier counts]); stats()
    # and ``shmcache stat`` show each as ``<name>_<counter>``
    COUNTERS: ClassVar[tuple[str, ...]]
    # True: never offered anything (TieredStore.put skips packing the portable record for it)
    read_only: bool
    # the most bytes one batch's values may take in all (the assembly lowers it to the cache's cap)
    max_batch_bytes: int
    # True: a ``LeaseTier`` - a miss takes a lease here before computing (NOTE [remote leases])
    leases: bool

    @property
    def authenticated(self) -> bool:
        """Whether every record it returns carried the job's MAC (NOTE [record authentication]):
        then they are the job's own, else they are data and a pickled leaf is refused."""

    def bind(self, name: str | None, fingerprint: str | None) -> None:
        """The identity of the cache it serves: the cache's name and its dataset's fingerprint
        (None while unknown). Called when the tier is assembled and again when the dataset becomes
        known later; may raise (CacheMismatch: a snapshot of another dataset)."""

    def get(self, key: bytes) -> Buffer | None:
        """The portable record stored under the portable ``key``, or None (a miss, or a fault).
        A bytearray must be fresh, referenced by nothing else: the value decoded from it keeps it."""

    def get_many(self, keys: Sequence[bytes]) -> list[Buffer | None]:
        """``get`` for many keys in one batched round trip, in the order given."""

    def offer(self, items: Sequence[tuple[bytes, Buffer]]) -> None:
        """(portable key, portable record) pairs this process computed; the tier may store them
        now or later, or drop them (a read-only tier ignores them). Never blocks for long."""

    def counters(self) -> dict[str, int]:
        """What this process saw of the tier: hits, misses, errors, bytes read and written, ..."""

    def totals(self) -> dict:
        """``counters()`` summed over every process of the session (NOTE [tier counts]), with
        ``url``, the tier's URL (password masked)."""

    def close(self) -> None:
        """Finish pending writes (bounded in time) and release connections and files."""


@runtime_checkable
class LeaseTier(Tier, Protocol):
    """A tier shared by nodes in which a miss takes a lease before computing, so that nodes
    missing a key at once compute it once (NOTE [remote leases]; ``leases`` is True). Keys are
    portable keys; nothing here raises for the tier's own faults: a fault grants the lease."""

    def lease(self, keys: Sequence[bytes], ttl_s: float) -> list[bool]:
        """Take each key's lease for ``ttl_s`` seconds, in one round trip: True when it is ours
        (or the tier cannot say: compute), False when another holds it (wait: ``poll``)."""

    def poll(self, keys: Sequence[bytes], ttl_s: float) -> tuple[list[Buffer | None], list[bool]]:
        """For keys another holds the lease of: their records now (None: not yet), and whether
        each lease was free and is ours now (compute it); one round trip in all."""

    def waited(self, served: int, timed_out: int) -> None:
        """Count the keys served after a wait on another's lease, and the waits that timed out."""
