"""A cache's statistics (``stats()``, ``shmcache stat``): the totals of its meta segment and the
sum of every process's row of counters, read without the lock (each word one aligned store:
statistics, not a snapshot of one state)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Protocol

import numpy as np

from . import claims, stall
from .generation import COUNTER_NAMES, DEAD_GEN, HITS, MISSES, REJECTED, MetaLayout
from .registry import MAX_SLOTS
from .view import CacheView

__all__ = ["STAT_KEYS", "cache_stats", "uncached_stats", "Measured"]

STAT_KEYS = ("session", "name", "items_mem", "items_disk", "bytes_mem", "bytes_disk",
             "bytes_disk_raw", "avg_item_bytes", "hits", "misses", "rejected", "capacity_bytes")


class Measured(Protocol):
    """What the statistics read of a cache (a CacheStore has it)."""

    session: str
    name: str
    meta_path: Path

    @property
    def view(self) -> CacheView: ...

    @property
    def claims(self) -> claims.Claims: ...

    @property
    def capacity_bytes(self) -> int: ...

    def shm_bytes(self) -> int: ...


def cache_stats(store: Measured) -> dict:
    """The statistics of ``store``'s current generation (CacheStore.stats)."""
    gen = store.view.refresh()
    meta = gen.meta.buf
    items_mem, bytes_mem, committed = struct.unpack_from("QQQ", meta, MetaLayout.ITEMS_MEM)
    items_disk, bytes_disk, bytes_disk_raw = struct.unpack_from("QQQ", meta, MetaLayout.ITEMS_DISK)
    counters = np.ndarray((MAX_SLOTS, len(COUNTER_NAMES)), np.uint64, meta, MetaLayout.COUNTERS).sum(axis=0)
    items = items_mem + items_disk
    return {
        "session": store.session, "name": store.name,
        "items_mem": items_mem, "items_disk": items_disk,
        "bytes_mem": bytes_mem, "bytes_disk": bytes_disk, "bytes_disk_raw": bytes_disk_raw,
        "avg_item_bytes": (bytes_mem + bytes_disk_raw) // items if items else 0,
        **{name: int(n) for name, n in zip(COUNTER_NAMES, counters)},
        **claims.read_counts(store.claims.path),  # computed, claim_waits, claim_timeouts (NOTE [claims])
        "capacity_bytes": store.capacity_bytes, "committed_bytes": committed,
        "shm_bytes": store.shm_bytes() if gen.gen != DEAD_GEN else 0,  # not the cache made again
        # the training loops' waits for batches, per rank (NOTE [stall counts])
        **stall.stats_keys(stall.stall_path(store.meta_path)),
    }


def uncached_stats(session: str, name: str, counters: list[int], computed: int = 0) -> dict:
    """The statistics of an UncachedStore: its process's ``counters`` (hits, misses, rejected)
    and the values it computed."""
    st = dict.fromkeys(STAT_KEYS, 0)
    st.update(session=session, name=name, hits=counters[HITS], misses=counters[MISSES],
              rejected=counters[REJECTED], corrupt=0, computed=computed, claim_waits=0,
              claim_timeouts=0, committed_bytes=0, shm_bytes=0, uncached=True,
              stall_waits=0, stall_seconds=0.0, loop_seconds=0.0, stall_share=0.0, ranks={})
    return st
