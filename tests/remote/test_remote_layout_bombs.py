"""A value planted in a shared Redis by anyone with its password (no secret in force) whose
inline layout names 2**40 nodes in 563 bytes (marshal back-references): the reader's layout check
walked it forever, so a training process that read that key hung. Now it is a refused record, a
miss computed from the source (the layout check itself: tests/unit/cache/test_layout_bombs.py)."""

from __future__ import annotations

import marshal

import numpy as np
import pytest
import redis
import zstandard

from shmcache import ShmDatasetCache
from shmcache.base.namespace import namespace
from shmcache.cache import codec
from shmcache.cache.registry import SessionRegistry
from shmcache.tiers.records import pack_record
from shmcache.tiers.tiered_store import portable_key


def _shared_tree(levels: int) -> bytes:
    node = ("n",)
    for _ in range(levels):
        node = ("T", (node, node))
    return marshal.dumps(node, 4)


@pytest.mark.timeout(30)  # it hung
def test_a_layout_of_shared_nodes_in_redis_is_a_miss_not_a_hang(redis_server, tmp_path, monkeypatch):
    monkeypatch.setenv("SHMCACHE_DIR", str(tmp_path / "ns"))
    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    layout, kb = _shared_tree(40), b""
    rec = codec.RECORD_HEADER.pack(codec.INLINE, len(kb), len(layout), 0) + bytes(48) + layout + kb
    rkey = b"shmcache:c:" + portable_key(7)
    host, port = redis_server.addr.split(":")
    client = redis.Redis(host=host, port=int(port), password=redis_server.password)
    client.set(rkey, b"".join(pack_record(rkey, rec, zstandard.ZstdCompressor())))
    cache = ShmDatasetCache(session="s", name="c", remote=redis_server.url)
    try:
        got = cache.get(7, lambda k: np.arange(3))
        assert np.array_equal(got, np.arange(3))
        st = cache.stats()
        assert st["tier_undecodable"] == 1 and st["tier_admitted"] == 0
    finally:
        cache.close()
        SessionRegistry(namespace(tmp_path / "ns")).destroy("s", force=True)
