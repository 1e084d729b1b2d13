"""What the job's secret costs (issue 16): the MAC (HMAC-SHA256) on snapshot and remote records,
as same-run ratios with a secret vs without.

    python benchmarks/bench_mac.py            # ~1 minute on 2 cores
    python benchmarks/bench_mac.py --quick    # ~20 s

Rows:

- ``snapshot import``: ``import_snapshot`` of one cache's snapshot (``cifar``-like 3 KiB random
  items, and ``imagenet``-like 147 KiB random items) exported with a secret and without, each
  imported into a fresh session; items/s and MiB/s, the median of ``--repeats`` imports, taken
  alternately so the machine's load falls on both alike.
- ``remote batch read``: ``RedisTier.get_many`` of batches of 256 keys (one GETRANGE pipeline round trip,
  every record checked) from a local ``redis-server``, values written with a secret and without
  (target >= 0.8x); median over the batches of ``--repeats`` passes.
- ``local hit``: ``cache.get(key)`` from shared memory, a cache made with a secret vs without: the
  MAC is never on that path (same code), so the ratio is 1 within noise.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    environment,
    environment_line,
    median,
    print_table,
    start_redis,
)

SECRET = secrets.token_hex(32)  # what `--remote spawn` makes per job
BATCH = 256


def _items(kind: str, n: int) -> list:
    rng = np.random.default_rng(0)
    shape = (32, 32, 3) if kind == "cifar" else (224, 224, 3)
    return [(rng.integers(0, 256, shape, dtype=np.uint8), i) for i in range(n)]


def bench_import(base: Path, kind: str, n: int, repeats: int) -> list:
    from shmcache import ShmDatasetCache
    from shmcache.base.namespace import namespace
    from shmcache.cache.registry import SessionRegistry
    from shmcache.snapshot.load import import_snapshot

    cache = ShmDatasetCache(session="bench-src", name=kind, secret="")
    for i, item in enumerate(_items(kind, n)):
        cache.put(i, item)
    snaps = {}
    for label, secret in (("without", ""), ("with", SECRET)):
        snaps[label] = base / f"{kind}-{label}"
        ShmDatasetCache(session="bench-src", name=kind, secret=secret).export(snaps[label])
    cache.close()
    registry = SessionRegistry(namespace())
    times: dict = {"without": [], "with": []}
    nbytes = 0
    for r in range(repeats):
        for label, secret in (("without", ""), ("with", SECRET)):
            t = time.perf_counter()
            report = import_snapshot(snaps[label], session=f"bench-dst-{r}-{label}", secret=secret)
            times[label].append(time.perf_counter() - t)
            assert report.complete, str(report)
            nbytes = report.bytes
            registry.destroy(f"bench-dst-{r}-{label}", force=True)
    registry.destroy("bench-src", force=True)
    a, b = median(times["without"]), median(times["with"])
    return [f"snapshot import ({kind}, {n} items)", f"{n / a:,.0f}/s ({nbytes / a / 2**20:,.0f} MiB/s)",
            f"{n / b:,.0f}/s ({nbytes / b / 2**20:,.0f} MiB/s)", f"{a / b:.2f}x"]


def bench_remote(url: str, kind: str, n: int, repeats: int) -> list:
    from shmcache.cache import codec
    from shmcache.tiers.remote import RedisTier
    from shmcache.tiers.tiered_store import portable_key, portable_record

    recs = [(portable_key(i), portable_record(codec.encode(item), i)) for i, item in enumerate(_items(kind, n))]
    tiers = {"without": RedisTier(url, f"bench-{kind}-plain"),
             "with": RedisTier(url, f"bench-{kind}-mac", secret=SECRET.encode())}
    for tier in tiers.values():
        for j in range(0, n, 512):
            tier.offer(recs[j:j + 512])
            assert tier.flush(60)
    keys = [k for k, _ in recs]
    batch = min(BATCH, n)
    times: dict = {"without": [], "with": []}
    for _ in range(repeats):
        for j in range(0, n - batch + 1, batch):
            for label, tier in tiers.items():  # alternately, batch by batch: the load falls on both
                t = time.perf_counter()
                got = tier.get_many(keys[j:j + batch])
                times[label].append(time.perf_counter() - t)
                assert all(g is not None for g in got)
    for tier in tiers.values():
        assert tier.counters()["forged"] == 0
        tier.close()
    a, b = median(times["without"]), median(times["with"])
    return [f"remote batch read ({kind}, {batch} keys)", f"{batch / a:,.0f} items/s", f"{batch / b:,.0f} items/s",
            f"{a / b:.2f}x"]


def bench_hit(n_reads: int, repeats: int) -> list:
    from shmcache import ShmDatasetCache
    from shmcache.base.namespace import namespace
    from shmcache.cache.registry import SessionRegistry

    item = _items("cifar", 1)[0]
    caches = {label: ShmDatasetCache(session=f"bench-hit-{label}", name="c", secret=s)
              for label, s in (("without", ""), ("with", SECRET))}
    for c in caches.values():
        for i in range(64):
            c.put(i, item)
    times: dict = {"without": [], "with": []}
    for _ in range(repeats * 10):  # short passes, alternately: the load falls on both
        for label, c in caches.items():
            t = time.perf_counter()
            for i in range(n_reads // 10):
                c.get(i & 63)
            times[label].append(time.perf_counter() - t)
    for c in caches.values():
        c.close()
    registry = SessionRegistry(namespace())
    for label in caches:
        registry.destroy(f"bench-hit-{label}", force=True)
    a, b = median(times["without"]), median(times["with"])
    n = n_reads // 10
    return ["local hit (shared memory, 3 KiB item)", f"{n / a:,.0f}/s", f"{n / b:,.0f}/s", f"{a / b:.2f}x"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer items: ~20 s")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis-server not found: apt-get install -y redis-server", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="shmcache-bench-mac-"))
    os.environ["SHMCACHE_DIR"] = str(base / "ns")
    os.environ.pop("SHMCACHE_SECRET", None)
    server, url, port, password = start_redis(base)
    try:
        print(environment_line(environment()))
        small, large = (2000, 100) if args.quick else (20000, 1000)
        rows = [bench_import(base, "cifar", small, args.repeats),
                bench_import(base, "imagenet", large, args.repeats),
                bench_remote(url, "cifar", small, args.repeats),
                bench_remote(url, "imagenet", large, args.repeats),
                bench_hit(20000 if args.quick else 200000, args.repeats)]
        print_table(["what", "without a secret", "with a secret", "with / without (throughput)"], rows)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(base, ignore_errors=True)
    return 0



if __name__ == "__main__":
    sys.exit(main())
