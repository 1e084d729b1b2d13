"""Cache a decode-heavy dataset in shared memory and compare epoch times.

    python examples/cache_photos.py [--items 2000] [--session demo] [--keep]

Epoch 1 decodes every JPEG crop (and stores it); epoch 2 reads the cache. Run it twice with
``--keep``: the second run finds the cache left by the first (another process, same session) and
every read is a hit. At the end it prints ``shmcache stat`` for the session.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datasets import PhotoCrops  # noqa: E402

from shmcache import ShmDatasetCache  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402


def epoch(ds, order) -> float:
    t0 = time.perf_counter()
    for i in order:
        ds[i]
    return time.perf_counter() - t0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=2000)
    p.add_argument("--session", default="demo")
    p.add_argument("--keep", action="store_true", help="keep the session for the next run")
    args = p.parse_args()

    source = PhotoCrops(args.items, size=64)
    order = np.random.default_rng(0).permutation(args.items).tolist()
    uncached = epoch(source, order[: max(1, args.items // 10)]) * 10  # a tenth, scaled: it is slow
    with ShmDatasetCache(session=args.session, size=256) as cache:
        ds = cache.wrap(source)
        first = epoch(ds, order)
        second = epoch(ds, np.random.default_rng(1).permutation(args.items).tolist())
        st = cache.stats()
    print(f"uncached epoch (decode every item): {uncached:7.2f} s")
    print(f"epoch 1 through the cache:          {first:7.2f} s   (fills what is missing)")
    print(f"epoch 2 through the cache:          {second:7.2f} s   ({uncached / second:.0f}x faster than uncached)")
    print(f"items cached: {st['items_mem']}, hits {st['hits']}, misses {st['misses']}\n")
    if not os.environ.get("CACHE_SH_PRINTS_STAT"):  # launch/cache.sh prints it after us
        subprocess.run([sys.executable, "-m", "shmcache", "stat", args.session], check=False)
    if not args.keep:
        SessionRegistry().destroy(args.session, force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
