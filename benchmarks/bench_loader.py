"""Data-only training loop on the decode-heavy photo pipeline: cached vs uncached, in one run.

    python benchmarks/bench_loader.py            # ~1 minute on 2 cores
    python benchmarks/bench_loader.py --quick

Every row iterates batches of 64 photo crops (JPEG decode + crop + resize on every uncached access)
and runs a tiny step on each batch (``x.float().mean()``), measuring batches/s and the share of the
wall time the loop spends waiting for data. Rows: a standard ``DataLoader`` over the source
(num_workers 0 and 2), the same over the cached dataset (warm), the cache's vectorised batch path
through a DataLoader (``BatchSampler``, ``batch_size=None``), and ``PrefetchRing.from_cache`` (the
batch gathered straight into the ring's slot buffers, pinned when a GPU is present). The issue's
target: cached >= 20x uncached on this pipeline.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import print_table, private_namespace  # noqa: E402
from datasets import PhotoCrops  # noqa: E402

from shmcache import PrefetchRing, ShmDatasetCache  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402

BATCH = 64


def loop(batches) -> tuple[float, float, int]:
    """(wall s, data-wait s, batches) of one pass with a tiny step per batch."""
    waited, n = 0.0, 0
    t0 = time.perf_counter()
    it = iter(batches)
    while True:
        t = time.perf_counter()
        try:
            x, _ = next(it)
        except StopIteration:
            break
        waited += time.perf_counter() - t
        x.float().mean()
        n += 1
    return time.perf_counter() - t0, waited, n


def measure(make_batches, epochs: int) -> tuple[float, float]:
    """Median batches/s and data-wait share over ``epochs`` passes (a fresh iterable each)."""
    rates, shares = [], []
    for _ in range(epochs):
        wall, waited, n = loop(make_batches())
        rates.append(n / wall)
        shares.append(waited / wall)
    return float(np.median(rates)), float(np.median(shares))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    private_namespace("shmcache-bench-")
    n = 256 if args.quick else 1024
    epochs = 2 if args.quick else 3
    source = PhotoCrops(n, size=64)
    pin = torch.cuda.is_available()
    session = f"bench-loader-{os.getpid()}"
    cache = ShmDatasetCache(session=session, size=512)
    rows = []
    try:
        cached = cache.wrap(source)
        cache.warmup(cached, progress=False)
        order = lambda: BatchSampler(RandomSampler(range(n)), BATCH, drop_last=False)  # noqa: E731
        cases = [
            ("DataLoader, uncached, num_workers=0", False,
             lambda: DataLoader(source, BATCH, shuffle=True, num_workers=0)),
            ("DataLoader, uncached, num_workers=2", False,
             lambda: DataLoader(source, BATCH, shuffle=True, num_workers=2, pin_memory=pin)),
            ("DataLoader, cached, num_workers=0", True,
             lambda: DataLoader(cached, BATCH, shuffle=True, num_workers=0)),
            ("DataLoader, cached, num_workers=2", True,
             lambda: DataLoader(cached, BATCH, shuffle=True, num_workers=2, pin_memory=pin)),
            ("DataLoader, cached, batch path (BatchSampler)", True,
             lambda: DataLoader(cached, sampler=order(), batch_size=None, num_workers=0)),
            ("PrefetchRing.from_cache, depth 2", True,
             lambda: PrefetchRing.from_cache(cached, [list(b) for b in order()], depth=2)),
        ]
        results = [(name, is_cached, *measure(make, 1 if not is_cached else epochs))
                   for name, is_cached, make in cases]
    finally:
        cache.close()
        SessionRegistry().destroy(session, force=True)
    best_uncached = max(r[2] for r in results if not r[1])
    for name, _, rate, share in results:
        rows.append((name, f"{rate:,.1f}", f"{rate * BATCH:,.0f}", f"{100 * share:.0f}%",
                     f"{rate / best_uncached:.1f}x"))
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, cuda={torch.cuda.is_available()}; "
          f"{n} photo crops 64x64x3, batches of {BATCH}; medians of {epochs} epochs (uncached: 1)")
    print_table(("loop", "batches/s", "items/s", "data wait", "x best uncached"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
