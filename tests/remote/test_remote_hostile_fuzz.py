"""The Redis leg of the hostile-record fuzz (issue 24, item 2): real records of a real cache,
mutated (tests/integration/_hostile_records.py), planted in a real redis-server under the cache's
keys with the tier's checksum recomputed, as anyone with the Redis password could (no job secret
in force). On main an extension tag no handler has raised EncodeError from ``ds[i]``,
``get_batch`` and a DataLoader on every read of that key. Now: no exception reaches the reader,
a value served is the source's or what the record itself decodes to, and every record that does
not decode is a counted miss (``tier_undecodable``, ``tier_pickle_refused`` or ``remote_corrupt``)."""

from __future__ import annotations

import os
import random
import sys

import pytest
import redis
import torch
import zstandard
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "integration"))
from _hostile_records import equal, mutate  # noqa: E402
from test_snapshot import N, Source, _filled  # noqa: E402

from shmcache import ShmDatasetCache  # noqa: E402
from shmcache.tiers import assembly  # noqa: E402
from shmcache.tiers.records import pack_record  # noqa: E402
from shmcache.tiers.tiered_store import decode_portable, portable_key  # noqa: E402

_UNSET = object()


def _own(rec: bytes):
    try:
        return decode_portable(bytearray(rec), trusted=False)
    except ValueError:
        return _UNSET


def _fuzz(redis_server, seed: int) -> None:
    src_cache, _ = _filled(session=f"src{seed}")
    recs = dict(src_cache.store.portable_records())
    src_cache.close()
    host, port = redis_server.addr.split(":")
    client = redis.Redis(host=host, port=int(port), password=redis_server.password)
    rng = random.Random(seed)
    cctx = zstandard.ZstdCompressor()
    hostile, own = {}, {}
    for i in range(1, N - 1, 2):  # (wrap() computes the last item itself: its fingerprint)
        kind, rec = mutate(recs[portable_key(i)], rng)
        hostile[i], own[i] = rec, (kind, _own(rec))
    src = Source()

    for how in ("ds[i]", "get_batch", "DataLoader"):
        client.flushall()
        cache = ShmDatasetCache(session=f"s{seed}{how[:2]}", remote=redis_server.url)
        try:
            ds = cache.wrap(Source())
            prefix = assembly.tiers_of(cache.store)[0].prefix
            for i, rec in hostile.items():  # what anyone with the password can write
                rkey = prefix + portable_key(i)
                client.set(rkey, b"".join(pack_record(rkey, rec, cctx)))
            if how == "ds[i]":
                got = [ds[i] for i in range(N)]
                wrong = [(i, own[i][0]) for i in range(N) if not equal(got[i], src[i]) and
                         not (i in own and own[i][1] is not _UNSET and equal(got[i], own[i][1]))]
                assert not wrong, wrong
                st = cache.stats()
                refused = sum(1 for _, v in own.values() if v is _UNSET)
                counted = st["tier_undecodable"] + st["tier_pickle_refused"] + st["remote_corrupt"]
                assert counted >= refused, (st, refused)
                continue
            # only records that do not decode stay hostile here: every batch is the source's
            keep = [i for i in range(N) if i not in own or own[i][1] is _UNSET]
            if how == "get_batch":
                batches = [ds.get_batch(keep[j:j + 8]) for j in range(0, len(keep), 8)]
            else:
                batches = list(DataLoader(torch.utils.data.Subset(ds, keep), batch_size=8, shuffle=False))
            assert torch.equal(torch.cat([b[0] for b in batches]), torch.stack([src[i][0] for i in keep])), how
            assert torch.cat([torch.as_tensor(b[1]) for b in batches]).tolist() == keep, how
        finally:
            cache.close()
    client.flushall()


def test_hostile_values_in_redis_are_counted_misses(redis_server, monkeypatch):
    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    _fuzz(redis_server, 24)


@pytest.mark.slow
def test_hostile_values_in_redis_fuzz_many_seeds(redis_server, monkeypatch):
    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    for seed in range(200, 240):
        _fuzz(redis_server, seed)


@pytest.mark.parametrize("max_mb,values", [("1", 0), ("3", 1)])
def test_a_value_past_max_item_mb_is_a_corrupt_miss_never_decoded(redis_server, monkeypatch, max_mb, values):
    """Without the job's secret a Redis value may decode to at most $SHMCACHE_MAX_ITEM_MB (256 MiB
    by default), not the cache's cap (80% of RAM): a 2 MiB value is refused unread under 1 MiB."""
    from shmcache.tiers.remote import RedisTier

    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    monkeypatch.setenv("SHMCACHE_MAX_ITEM_MB", max_mb)
    tier = RedisTier(redis_server.url, "c")
    try:
        rkey = tier.prefix + portable_key(1)
        host, port = redis_server.addr.split(":")
        redis.Redis(host=host, port=int(port), password=redis_server.password).set(
            rkey, b"".join(pack_record(rkey, bytes(2 << 20), zstandard.ZstdCompressor())))
        got = tier.get_many([portable_key(1)])
        assert sum(v is not None for v in got) == values and tier.counters()["corrupt"] == 1 - values
    finally:
        tier.close()
    signed = RedisTier(redis_server.url, "c", secret=b"s")
    try:
        assert signed.max_item_bytes > 1 << 31  # authenticated: the job's own values, only the cap bounds them
    finally:
        signed.close()


def test_a_batch_reads_no_more_of_a_strangers_values_than_max_item_mb_allows(redis_server, monkeypatch):
    """A stranger who can write the Redis (no secret) puts 32 MiB of junk under each of 4 keys; a
    batch of them under a 1 MiB bound read all 128 MiB into the reader's memory (4 keys of 256
    MiB each under the default bound: +1,280 MiB; Redis allows 512 MB a value). Now each value is
    read only as far as the largest acceptable record (GETRANGE), and the rest of the batch's
    values are still read: a right record beside them is a hit."""
    from shmcache.tiers.remote import RedisTier

    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    monkeypatch.setenv("SHMCACHE_MAX_ITEM_MB", "1")
    tier = RedisTier(redis_server.url, "c")
    try:
        host, port = redis_server.addr.split(":")
        stranger = redis.Redis(host=host, port=int(port), password=redis_server.password)
        keys = [portable_key(i) for i in range(4)]
        for k in keys:
            stranger.set(tier.prefix + k, bytes(32 << 20))
        assert tier.get_many(keys) == [None] * 4
        assert tier.counters()["bytes_read"] <= 4 * (2 << 20), tier.counters()
        assert tier.counters()["corrupt"] == 4, tier.counters()  # cut short: each a counted miss
        right = os.urandom(1 << 20)  # 1 MiB, stored raw: the largest record the bound allows
        stranger.set(tier.prefix + keys[0], b"".join(pack_record(tier.prefix + keys[0], right,
                                                                 zstandard.ZstdCompressor(level=-5))))
        stranger.set(tier.prefix + keys[1], b"")  # an empty value is no record: a miss
        stranger.delete(tier.prefix + keys[2])
        stranger.rpush(tier.prefix + keys[2], b"x")  # another type: a miss, as MGET made it, not a fault
        assert tier.get_many([*keys[:3], portable_key(99)]) == [bytearray(right), None, None, None]
        assert tier.counters()["errors"] == 0, tier.counters()
    finally:
        tier.close()
        host, port = redis_server.addr.split(":")
        redis.Redis(host=host, port=int(port), password=redis_server.password).delete(
            *[tier.prefix + portable_key(i) for i in range(4)])
