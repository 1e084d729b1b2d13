"""The tier seam (shmcache.tiers.tiered_store, NOTE [tiers]): portable keys and records, and TieredStore reading
shared memory first, then each tier in order, admitting hits and offering what is computed.

The tier here is a real implementation of the Protocol that keeps its records in a dict of this
process (the remote and snapshot tiers have their own tests with real servers and files)."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from shmcache.cache import codec
from shmcache.cache.store import MISSING, CacheStore
from shmcache.tiers.tiered_store import Tier, TieredStore, decode_portable, portable_key, portable_record


class DictTier:
    name = "dict"
    COUNTERS = ("records",)
    read_only = False
    leases = False  # a tier of one process: nothing to lease (NOTE [remote leases])
    authenticated = False
    max_batch_bytes = 1 << 30

    def __init__(self, fail: str = ""):
        self.records: dict[bytes, bytes] = {}
        self.calls: list[tuple[str, int]] = []
        self.fail = fail

    def get(self, key):
        self.calls.append(("get", 1))
        if self.fail == "get":
            raise ConnectionError("down")
        return self.records.get(key)

    def get_many(self, keys):
        self.calls.append(("get_many", len(keys)))
        if self.fail == "get":
            raise ConnectionError("down")
        return [self.records.get(k) for k in keys]

    def offer(self, items):
        self.calls.append(("offer", len(items)))
        self.records.update(items)

    def bind(self, name, fingerprint):
        self.calls.append(("bind", 0))

    def counters(self):
        return {"records": len(self.records)}

    def totals(self):
        return self.counters()

    def close(self):
        self.calls.append(("close", 0))


@pytest.fixture
def local():
    s = CacheStore("tiers", "main", capacity_bytes=32 << 20)
    s.bind_fingerprint("fp")
    yield s
    s.close()


def sample(i: int) -> dict:
    return {"x": np.full(64, i, np.float32), "label": i, "name": f"item-{i}"}


def same(a, b) -> bool:
    return np.array_equal(a["x"], b["x"]) and a["label"] == b["label"] and a["name"] == b["name"]


def test_dict_tier_satisfies_the_protocol():
    assert isinstance(DictTier(), Tier)


@pytest.mark.parametrize("key", [0, 7, 2**40, -3, "a", "é/ü", b"a", b"\x00" * 300])
def test_portable_records_round_trip_without_any_layout_table(key):
    enc = codec.encode(sample(5))
    rec = portable_record(enc, key)
    assert same(decode_portable(bytearray(rec)), sample(5))
    assert portable_key(key) != portable_key(str(key) if not isinstance(key, str) else key.encode())


@pytest.mark.parametrize("bad", [b"", b"\x00" * 8, b"\xff" * 64])
def test_bytes_that_are_not_a_portable_record_raise_value_error(bad):
    with pytest.raises(ValueError):
        decode_portable(bad)


def test_a_record_cut_short_raises_value_error():
    rec = portable_record(codec.encode(sample(1)), 1)
    with pytest.raises(ValueError):
        decode_portable(rec[: len(rec) // 2])


def test_a_tier_hit_is_admitted_and_returned_and_the_next_read_is_local(local):
    tier = DictTier()
    tier.records[portable_key(3)] = portable_record(codec.encode(sample(3)), 3)
    store = TieredStore(local, [tier])
    assert same(store.lookup(3), sample(3))
    assert local.contains(3)  # admitted into shared memory
    tier.calls.clear()
    assert same(store.lookup(3), sample(3))
    assert tier.calls == []  # shared memory answered
    assert store.lookup(4) is MISSING


def test_len_of_a_store_with_tiers_is_what_this_node_holds(local):
    """len(cache) of a cache with a snapshot or remote tier raised TypeError (TieredStore had no
    __len__); it is what the node holds, as contains() is."""
    tier = DictTier()
    tier.records[portable_key(3)] = portable_record(codec.encode(sample(3)), 3)
    store = TieredStore(local, [tier])
    local.put(1, sample(1))
    assert len(store) == 1
    store.lookup(3)  # admitted
    assert len(store) == 2


def test_a_batch_asks_each_tier_once_for_its_misses(local):
    first, second = DictTier(), DictTier()
    for i in (1, 2):
        first.records[portable_key(i)] = portable_record(codec.encode(sample(i)), i)
    second.records[portable_key(3)] = portable_record(codec.encode(sample(3)), 3)
    store = TieredStore(local, [first, second])
    local.put(0, sample(0))
    values, missing = store.lookup_batch([0, 1, 2, 3, 4])
    assert missing == [4]
    assert all(same(values[i], sample(i)) for i in range(4))
    assert first.calls == [("get_many", 4)] and second.calls == [("get_many", 2)]


def test_what_is_computed_is_offered_to_every_tier(local):
    first, second = DictTier(), DictTier()
    store = TieredStore(local, [first, second])
    assert store.put("k", sample(9))
    for tier in (first, second):
        assert same(decode_portable(bytearray(tier.records[portable_key("k")])), sample(9))


def test_a_tier_that_raises_costs_a_miss_and_one_log_line(local, caplog):
    store = TieredStore(local, [DictTier(fail="get")])
    with caplog.at_level(logging.WARNING, "shmcache"):
        assert store.lookup(1) is MISSING
        assert store.lookup_batch([1, 2])[1] == [0, 1]
        assert store.lookup(2) is MISSING
    lines = [r for r in caplog.records if "dict tier failed" in r.getMessage()]
    assert len(lines) == 2  # once for get, once for get_many


def test_a_record_that_does_not_decode_is_a_miss_counted(local, caplog):
    tier = DictTier()
    tier.records[portable_key(1)] = b"\xff" * 80
    store = TieredStore(local, [tier])
    with caplog.at_level(logging.WARNING, "shmcache"):
        assert store.lookup(1) is MISSING
    assert store.stats()["tier_undecodable"] == 1 and not local.contains(1)


def test_stats_and_close_reach_every_tier(local):
    tier = DictTier()
    store = TieredStore(local, [tier])
    store.put(1, sample(1))
    assert store.stats()["tiers"] == {"dict": {"records": 1}}
    store.close()
    assert tier.calls[-1] == ("close", 0)


@pytest.mark.parametrize("key", [0, 7, -1, -(1 << 63), (1 << 63) - 1, "", "a", "é\udcff", b"", b"a\x00"])
def test_key_of_portable_inverts_portable_key(key):
    from shmcache.tiers.tiered_store import key_of_portable

    back = key_of_portable(portable_key(key))
    assert back == key and type(back) is type(key)


@pytest.mark.parametrize("bad", [b"", b"1234567", b"\x00" * 8 + b"xabc", b"\x00" * 8 + b"sabc"])
def test_key_of_portable_refuses_bytes_that_are_no_portable_key(bad):
    from shmcache.tiers.tiered_store import key_of_portable

    with pytest.raises(ValueError):
        key_of_portable(bad)


def test_the_assembly_orders_binds_and_offers_writes_only_to_writable_tiers(local):
    from shmcache.tiers import assembly

    remote, snapshot, other = DictTier(), DictTier(), DictTier()
    remote.name, snapshot.name, other.name = "remote", "snapshot", "other"
    snapshot.read_only = True
    store = assembly.assemble(local, [other, remote], name="main", fingerprint="fp")
    assert assembly.assemble(store, [snapshot], name="main", fingerprint="fp") is store
    assert [t.name for t in assembly.tiers_of(store)] == ["snapshot", "remote", "other"]  # ORDER
    assert all(("bind", 0) in t.calls for t in (remote, snapshot, other))
    assembly.bind(store, "main", "fp2")  # the dataset became known later: every tier learns it
    assert all(t.calls.count(("bind", 0)) == 2 for t in (remote, snapshot, other))
    store.put(1, sample(1))
    assert not snapshot.records and remote.records and other.records  # a read-only tier takes nothing
    assert assembly.tiers_of(local) == [] and assembly.stats(store)["tiers"]["remote"] == {"records": 1}
    assert not hasattr(store, "collect_garbage")  # no silent forwarding to the local store
    store.close()


def test_a_batch_s_tier_hits_go_in_together_each_checked_the_too_large_served_and_said_once(caplog):
    """lookup_batch admits a tier's hits of a batch with one put_records call (one lock hold): a
    record that does not decode is still a counted miss, never admitted; one that can never fit
    in the cache is served from the tier, said once, and the others of the batch still go in."""
    small = CacheStore("tiers", "small", capacity_bytes=4 << 20)
    small.bind_fingerprint("fp")
    try:
        tier = DictTier()
        for i in range(6):
            tier.records[portable_key(i)] = portable_record(codec.encode(sample(i)), i)
        tier.records[portable_key(6)] = b"\xff" * 80  # not a record
        for i in (7, 8):  # 8 MiB each: never fits in 4 MiB
            tier.records[portable_key(i)] = portable_record(codec.encode({"x": np.zeros(2 << 20, np.float32)}), i)
        store = TieredStore(small, [tier])
        with caplog.at_level(logging.WARNING, "shmcache"):
            values, missing = store.lookup_batch(list(range(10)))
        assert missing == [6, 9]
        assert all(same(values[i], sample(i)) for i in range(6))
        assert values[7]["x"].shape == (2 << 20,) and values[8]["x"].shape == (2 << 20,)
        assert all(small.contains(i) for i in range(6)) and not any(small.contains(i) for i in (6, 7, 8))
        st = store.stats()
        assert st["tier_admitted"] == 6 and st["tier_undecodable"] == 1
        assert sum("can never fit" in r.getMessage() for r in caplog.records) == 1
    finally:
        small.close()


def test_every_tier_counts_file_is_one_the_registry_drops_with_its_cache():
    """The registry drops a cache's counts files by name (it cannot import the tiers above it):
    a tier whose counts file it does not know would carry its counts into a cache made again."""
    from shmcache.cache.registry import CACHE_COUNT_FILES
    from shmcache.tiers.counts import COUNTERS

    assert set(COUNTERS) <= set(CACHE_COUNT_FILES)
