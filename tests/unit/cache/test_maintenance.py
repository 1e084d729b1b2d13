"""gc's policy in the library (maintenance.collect_garbage): a report, not printing."""

from __future__ import annotations

import struct

import posix_ipc

from shmcache.cache.generation import MetaLayout
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import CacheStore
from shmcache.tiers.namespace_gc import GcResult, collect_garbage


def test_collect_garbage_reports_debris_recounts_and_keeps_live_caches(shm_namespace):
    store = CacheStore("gcs", "c", capacity_bytes=4 << 20, ns=shm_namespace)
    try:
        for i in range(3):
            store.put(i, i)
        struct.pack_into("Q", store.view.refresh().meta.buf, MetaLayout.ITEMS_MEM, 7)  # a counter gc must recount
        ghost = shm_namespace.segment_name("ghost", "c", "root")
        posix_ipc.SharedMemory(ghost, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
        result = collect_garbage(SessionRegistry(shm_namespace))
        assert isinstance(result, GcResult)
        assert ghost in result.registry.removed_segments and ghost not in shm_namespace.owned_segments()
        assert [d["cache"] for d in result.recounted] == ["gcs/c"] and not result.dropped and not result.skipped
        report = result.to_json()
        assert report["removed_segments"] == [ghost] and report["recounted_caches"] == result.recounted
        assert len(store) == 3 and store.lookup(2) == 2  # the live cache keeps its items
    finally:
        store.destroy()
