"""``lookup_batch`` of int keys (the batch path a DataLoader takes with a custom ``collate_fn``, or
for items of several sizes or layouts: ``__getitems__``, ``get_batch``'s long way), against the
same keys looked up one by one with ``lookup`` in the same round: reported as that ratio, the
median over rounds, for a warm batch, a cold one and a half warm one (batches of 256 from a cache
of 4,096 items of 50 sizes).

    PYTHONPATH=$PWD python benchmarks/bench_lookup_batch.py [--rounds 15]
    PYTHONPATH=/tmp/base python benchmarks/bench_lookup_batch.py   # another checkout: compare the ratios
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import environment, environment_line, median, print_table  # noqa: E402

N, BATCH = 4096, 256


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args(argv)
    os.environ["SHMCACHE_DIR"] = where = tempfile.mkdtemp(prefix="bench-lookup-batch-")
    import shmcache
    from shmcache.cache.store import CacheStore

    print(environment_line(environment({"shmcache": os.path.dirname(shmcache.__file__)})))
    store = CacheStore("bench", "lookup-batch", capacity_bytes=256 << 20)
    try:
        for i in range(N):
            store.put(i, np.zeros(100 + (i % 50) * 37, np.uint8))
        rng = np.random.default_rng(0)
        cases = {
            "warm": rng.integers(0, N, BATCH).tolist(),
            "cold": list(range(10**6, 10**6 + BATCH)),
            "half warm": [k if j % 2 else k + 10**6 for j, k in enumerate(rng.integers(0, N, BATCH).tolist())],
        }
        rows = []
        for label, keys in cases.items():
            ratios = []
            for r in range(args.rounds):
                calls = [lambda ks=keys: store.lookup_batch(ks), lambda ks=keys: [store.lookup(k) for k in ks]]
                took = [0.0, 0.0]
                for i in (0, 1) if r % 2 else (1, 0):  # alternate which goes first
                    t0 = time.perf_counter()
                    for _ in range(20):
                        calls[i]()
                    took[i] = time.perf_counter() - t0
                ratios.append(took[0] / took[1])
            rows.append([label, f"{median(ratios):.2f}x"])
        print_table(["batch of 256", "lookup_batch / lookup() one by one"], rows)
    finally:
        store.destroy()
        shutil.rmtree(where, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
