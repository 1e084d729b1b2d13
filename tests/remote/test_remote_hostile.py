"""Hostile values in a shared Redis (issue 16, item 4): a value planted under a cache's key that is
a decompression bomb costs no more than the cache's cap, and a batch of them does not multiply
it; each is a counted corrupt miss. A real redis-server; real 1 GiB bombs (32 KB of zstd)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import redis

_BATCH = """
import json, resource, sys
import redis
sys.path.insert(0, sys.argv[2])
from test_snapshot_hostile import _bombs
from shmcache.tiers.remote import RedisTier
from shmcache.cache.store import CacheStore
from shmcache.tiers.tiered_store import TieredStore, portable_key
tier = RedisTier(sys.argv[1], "c")
store = CacheStore("s", "c", capacity_bytes=64 << 20)
TieredStore(store, [tier])  # lowers the tier's batch budget to the cache's cap
client = redis.Redis.from_url(sys.argv[1])
keys = [portable_key(i) for i in range(8)]
for pkey, parts in _bombs([tier.prefix + k for k in keys]):
    client.set(pkey, b"".join(parts))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
got = tier.get_many(keys)
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
print(json.dumps({"grew_mib": grew, "values": sum(v is not None for v in got), "corrupt": tier.counters()["corrupt"]}))
tier.close()
store.destroy()
"""


def test_a_batch_of_bombs_planted_in_redis_is_corrupt_misses_in_bounded_memory(redis_server):
    """Anyone who can write to the Redis planted 1 GiB bombs (and an 18-byte frame claiming
    64 GiB) under a cache's keys: a batch read decoded them all (GiBs each, MemoryError for the
    claim, failing the whole batch). Now each is a corrupt miss and memory stays bounded."""
    integration = os.path.join(os.path.dirname(os.path.dirname(__file__)), "integration")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([integration, os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", _BATCH, redis_server.url, integration], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["values"] == 0 and out["corrupt"] == 8, out
    assert out["grew_mib"] < 256, out
    redis.Redis.from_url(redis_server.url).flushall()
