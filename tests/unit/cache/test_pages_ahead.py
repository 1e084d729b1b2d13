"""A cold batch's next pages, backed ahead (Admission.commit_ahead, Segment.commit_ahead): the next
batch's commit then backs nothing itself, and what is backed ahead stays within the cache's cap
up to the batch that fills it. The thread itself: tests/unit/base/test_ahead.py."""

from __future__ import annotations

import time

import numpy as np
import pytest

from shmcache.base import ahead, shm
from shmcache.cache import codec
from shmcache.cache.allocator import DATA_OFF
from shmcache.cache.store import CacheStore

pytestmark = pytest.mark.skipif(not ahead.NATIVE,  # not built, or SHMCACHE_NATIVE=0
                                reason=f"pages backed ahead: {ahead.unavailable_reason()}")
MiB = 1 << 20
ITEM = 24 << 10  # a 24 KB record: Hugging Face's rows in benchmarks/bench_hf.py


def _batch(first: int, n: int = 64, item: int = ITEM) -> list:
    return [(k, codec.encode(np.full(item // 8, k, np.int64))) for k in range(first, first + n)]


class _Asked:
    """Every range asked ahead (the thread's request numbers), waited for on demand."""

    def __init__(self, monkeypatch):
        self.requests: list[int] = []
        real = shm.ahead.submit

        def submit(fd, offset, length):
            request = real(fd, offset, length)
            self.requests.append(request)
            return request

        monkeypatch.setattr(shm.ahead, "submit", submit)

    def settle(self) -> None:
        deadline = time.monotonic() + 20
        while any(ahead.outcome(r) is None for r in self.requests[-1:]) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert all(ahead.outcome(r) is not None for r in self.requests[-1:]), "the worker did not finish in 20 s"


def _fallocate_calls(monkeypatch) -> list:
    """Every posix_fallocate a commit makes in this process, as it makes it."""
    calls: list = []
    real = shm._fallocate
    monkeypatch.setattr(shm, "_fallocate", lambda *a: (calls.append(a), real(*a)))
    return calls


def test_the_next_cold_batch_backs_no_pages_itself(monkeypatch):
    asked = _Asked(monkeypatch)
    calls = _fallocate_calls(monkeypatch)
    store = CacheStore("ahead", "next", capacity_bytes=64 * MiB)
    try:
        assert store.put_many(_batch(0)) == [True] * 64
        assert len(asked.requests) == 1, "a run's class asks for the next run's chunks"
        asked.settle()
        before = len(calls)
        assert store.put_many(_batch(64)) == [True] * 64
        assert len(calls) == before, "the second batch's chunks were backed ahead: its commit makes no call"
        assert all(np.array_equal(store.lookup(k), np.full(ITEM // 8, k, np.int64)) for k in range(128))
    finally:
        store.destroy()


def test_pages_backed_ahead_stay_within_the_cap_up_to_the_full_cache(monkeypatch):
    """A sized cache filled by cold batches of two size classes (a segment each, each as large as
    the cap: only the cap itself bounds their sum): after each batch (its ahead request done),
    the pages of its data segments are never past its cap. The batch before the cache fills
    leaves its class's range asked for and never taken (the review's case: 9.4 MiB of pages in a
    cache of size=8 MiB when those chunks counted for nothing)."""
    asked = _Asked(monkeypatch)
    store = CacheStore("ahead", "cap", capacity_bytes=8 * MiB)
    try:
        empty = store.shm_bytes()
        first, full = 0, False
        while not full:
            for item in (ITEM, 2 * ITEM):
                done = store.put_many(_batch(first, item=item))
                first += 64
                asked.settle()
                data = store.shm_bytes() - empty - 2 * DATA_OFF  # each class segment's header pages
                assert data <= store.capacity_bytes, f"{data} bytes of records' pages, past the cap"
                full = full or not all(done)
        assert store.stats()["rejected"] > 0 and first < 64 * 40
    finally:
        store.destroy()


def test_a_batch_longer_than_the_one_before_does_not_stop_the_asking(monkeypatch):
    """A run longer than the last one (wrap()'s three probes stored first make the first cold batch
    61 records, the next 64; an epoch's short last batch) commits past the range asked for it, from
    the same start: that is no other writer's commit, so it must not pause the asking for
    AHEAD_PAUSE batches - the third batch's pages are backed ahead as the second's were (measured
    through ShmDatasetCache.wrap: the first 17 cold batches backed every page themselves)."""
    asked = _Asked(monkeypatch)
    calls = _fallocate_calls(monkeypatch)
    store = CacheStore("ahead", "longer", capacity_bytes=64 * MiB)
    try:
        assert store.put_many(_batch(0, 61)) == [True] * 61
        asked.settle()
        assert store.put_many(_batch(61)) == [True] * 64  # 3 chunks past the 61 asked ahead
        asked.settle()
        before = len(calls)
        assert store.put_many(_batch(125)) == [True] * 64
        assert len(calls) == before, "the third batch's chunks were not asked ahead (a pause after the longer run)"
        assert all(np.array_equal(store.lookup(k), np.full(ITEM // 8, k, np.int64)) for k in range(189))
    finally:
        store.destroy()

