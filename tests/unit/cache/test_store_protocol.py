"""The Store protocol (shmcache.cache.store_protocol): the surface the three stores share is declared
once, and each of them has every member of it - a store that loses one fails here, not in a
DataLoader worker."""

from __future__ import annotations

import inspect

import numpy as np
import pytest

from shmcache.cache.store import MISSING, CacheStore, UncachedStore
from shmcache.cache.store_protocol import LocalStore, Store
from shmcache.tiers.tiered_store import TieredStore


def _members(protocol: type) -> set[str]:
    return {name for klass in protocol.__mro__ if klass.__name__ in ("Store", "LocalStore")
            for name in vars(klass) if not name.startswith("_") or name == "__len__"}


@pytest.fixture
def local():
    s = CacheStore("proto", "main", capacity_bytes=8 << 20)
    yield s
    s.close()


def test_each_store_has_every_member_of_the_protocol(local):
    uncached = UncachedStore("proto", "none", OSError("no room"))
    tiered = TieredStore(local, [])
    for store in (local, uncached, tiered):
        missing = sorted(name for name in _members(Store) if not hasattr(store, name))
        assert not missing, f"{type(store).__name__} lacks {missing} of Store"
        assert isinstance(store, Store)
    for store in (local, tiered):
        assert isinstance(store, LocalStore)
    assert not isinstance(uncached, LocalStore)  # no metadata, lock or export of its own


def test_the_protocol_calls_work_alike_through_each_store(local):
    tiered = TieredStore(local, [])
    keys = np.arange(4, dtype=np.int64)
    for store in (local, tiered):
        assert store.lookup(1) is MISSING
        assert store.put(1, {"x": np.ones(3, np.float32)})
        assert store.contains(1) and len(store) == 1
        assert store.lookup_batch([1, 2], copy=True)[1] == [1]
        assert list(store.absent_ints(keys)) == [0, 2, 3]
        store.clear()
    uncached = UncachedStore("proto", "none", OSError("no room"))
    assert uncached.lookup(1) is MISSING and not uncached.put(1, 2) and len(uncached) == 0


def test_the_protocol_signatures_match_the_cache_stores():
    """A parameter renamed in CacheStore and not in the protocol (or back) is caught here."""
    for name in _members(Store) - {"session", "name", "uncached", "capacity_bytes", "spill", "claim_timeout_s"}:
        want = list(inspect.signature(getattr(Store, name)).parameters)
        got = list(inspect.signature(getattr(CacheStore, name)).parameters)
        if isinstance(inspect.getattr_static(CacheStore, name), staticmethod):
            want = want[1:]
        assert got == want, f"CacheStore.{name}{got} != Store.{name}{want}"
