"""A cache's root segment: where each of its words is, the tombstone, and the epoch word.

The root (one page) names, in its epoch word, the generation and table version in force
(``cache.generation`` has the rest of a generation's layout). Its own module, below both
``cache.generation`` and ``cache.registry``: registry.retire_root tombstones a root, a Generation
builds on the epoch word, and neither needs the other for it.
"""

from __future__ import annotations

__all__ = ["RootLayout", "NOTICE_WORDS", "DESTROYED", "epoch_of", "split_epoch"]


class RootLayout:
    """Byte offsets of the root's words (the root is one page; every word one aligned store). The
    one definition: the store's lookup inlines EPOCH as the constant 64 (checked by
    ``test_index``), registry.retire_root writes DESTROYED there."""

    EPOCH = 64  # generation << 32 | table version, or DESTROYED (registry.retire_root)
    CAPACITY = 72  # the cap in bytes (NOTE [memory limits])
    INCARNATION = 80  # a random word drawn when the root is made (NOTE [publish order], Opening)
    SIZING = 88  # how the cap was set: SIZED, AUTO or AUTO_NONE
    # a digest of the generation, cap, spilling and job at which a process said that the cache
    # stopped growing in memory (Admission.log_memory_full): the other processes of the job then do
    # not say it again; a later job, or one that spills, does. A hint only: two processes that say
    # it at the same moment both do. Zero in a root made before it.
    SAID_FULL = 96
    # the same for the dataset layer's notices said once per job (CacheStore.first_to_say), a word
    # each (NOTICE_WORDS): a sample stored with pickle, an item too large to cache. One word for
    # both made every process that met both (one sample pickled and too large) find the other's
    # mark and say both again. Notices of one kind but other texts (other pickled types) take
    # turns in their word, each then said again - a hint only, as SAID_FULL
    SAID_PICKLED = 104
    SAID_TOO_LARGE = 112
    SAID_REPLAYED = 120  # a stream replayed in another epoch's order (data.stream)


# the kinds of notice a store says once per job (Store.first_to_say) -> their root word
NOTICE_WORDS = {"pickled": RootLayout.SAID_PICKLED, "too large": RootLayout.SAID_TOO_LARGE,
                "replayed": RootLayout.SAID_REPLAYED}


# The root's tombstone: whoever removes a cache writes DESTROYED into its epoch word before
# unlinking anything, so every process that still maps the root - and compares that word on every
# lookup anyway - sees at once that its cache is gone (NOTE [publish order], Destroying).
DESTROYED = (1 << 64) - 1


def epoch_of(gen: int, version: int) -> int:
    """The epoch word that names generation ``gen`` and table version ``version``."""
    return (gen << 32) | version


def split_epoch(epoch: int) -> tuple[int, int]:
    """``(generation, table version)`` of an epoch word (DESTROYED: DEAD_GEN)."""
    return epoch >> 32, epoch & 0xFFFFFFFF
