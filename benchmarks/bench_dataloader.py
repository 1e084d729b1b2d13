"""The DataLoader path users write, over a warm cache, against in-RAM baselines in the same run.

    python benchmarks/bench_dataloader.py            # ~2 minutes on 2 cores
    python benchmarks/bench_dataloader.py --quick    # a few seconds

Items ``(uint8 HWC image, int label)``: 3 KB (32x32x3) and 150 KB (224x224x3). Every loader row is
``DataLoader(ds, batch_size=256, shuffle=True, num_workers=W)`` over: the cached dataset (warm), a
``TensorDataset`` of the same arrays in RAM, and the uncached in-RAM source (a map-style dataset
returning ``(x[i], int(y[i]))``); workers are persistent and the first pass is not measured. Direct
rows: the cache's batch path (``ds.get_batch(idx)``, random idx), ``np.take`` of the same random rows
from an in-RAM array, a bulk copy of as many bytes from a contiguous block of an array larger than
the CPU caches into a preallocated buffer, and single items: ``ds[i]``, ``cache.get(i)`` against
``arr[i].copy()``. Each row: items/s from the median time of a batch (of 1000 calls for single
gets), its p90, the median over passes of a whole pass's items/s, and ratios (of the median-based
rates) against the baselines of the same item size. Passes of all rows are
interleaved, so load drift on a shared machine hits every row of a ratio alike (the order within a
round is explained in ``measure_size``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    environment,
    environment_line,
    fmt_rate,
    fmt_ratio,
    fmt_s,
    median,
    p90,
    print_table,
    private_namespace,
)

from shmcache import ShmDatasetCache  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402

BATCH = 256


class InRam(Dataset):
    """The uncached source: arrays in RAM, one sample per call."""

    def __init__(self, x: np.ndarray, y: np.ndarray):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], int(self.y[i])


def passes(runs: dict, repeats: int) -> dict:
    """Items/s of each pass and the time of every batch (s) of each row; ``runs[name]()`` yields
    batch sizes. Passes are interleaved (row A, row B, ..., then again): on a shared machine the
    load drifts, and every row of a ratio should see the same drift."""
    out = {name: ([], []) for name in runs}
    for run in runs.values():
        for _ in run():  # warm: page faults, worker start-up, first mappings
            pass
    for _ in range(repeats):
        for name, run in runs.items():
            rates, times = out[name]
            n, t0 = 0, time.perf_counter()
            last = t0
            for size in run():
                now = time.perf_counter()
                times.append(now - last)
                last = now
                n += size
            rates.append(n / (time.perf_counter() - t0))
    return out


def loader_pass(loader):
    def run():
        for x, _ in loader:
            yield len(x)
    return run


def batches_pass(fn, n_items: int, nb: int, rng):
    def run():
        for _ in range(nb):
            fn(rng.integers(0, n_items, BATCH))
            yield BATCH
    return run


def bulk_pass(big: np.ndarray, dst: np.ndarray, nb: int, rng):
    rows = len(dst)

    def run():
        for _ in range(nb):
            lo = int(rng.integers(0, len(big) - rows))
            np.copyto(dst, big[lo:lo + rows])
            yield rows
    return run


def single_pass(get, n_items: int, calls: int, rng):
    def run():
        idx = rng.integers(0, n_items, calls).tolist()
        for lo in range(0, calls, 1000):  # one "batch" = 1000 calls (per-call time = t / 1000)
            for i in idx[lo:lo + 1000]:
                get(i)
            yield 1000
    return run


def measure_size(label: str, shape: tuple, n: int, repeats: int, workers: bool, session: str) -> list:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    y = rng.integers(0, 1000, n).astype(np.int64)
    source = InRam(x, y)
    tensors = TensorDataset(torch.from_numpy(x), torch.from_numpy(y))
    cache = ShmDatasetCache(session=session, name=f"bench{label}", size=(x.nbytes * 2 >> 20) + 64)
    ds = cache.wrap(source)
    cache.warmup(ds, progress=False)
    nb = max(4, n // BATCH)
    item = x[0].nbytes
    # a block larger than the CPU caches, so the bulk copy reads memory, not cache
    big = np.random.default_rng(1).integers(0, 256, max(256 << 20, 4 * BATCH * item) // item * item,
                                            dtype=np.uint8).reshape(-1, item)
    dst = np.empty((BATCH, item), np.uint8)
    flat = x.reshape(n, -1)
    runs = {}

    def loader(ds_, w):
        return DataLoader(ds_, batch_size=BATCH, shuffle=True, num_workers=w, persistent_workers=w > 0)

    # Order within a round: the rows of each ratio side by side, the cache's rows before the
    # uncached loaders. A loader that collates a fresh batch each time (default_collate) leaves
    # this machine's copies 2-4x slower for a while after it - a plain np.take into a fixed
    # buffer shows it too - so whatever runs right after those rows pays for them.
    runs["bulk copy (memory, not cache)"] = bulk_pass(big, dst, nb, rng)
    runs["cache batch path ds.get_batch"] = batches_pass(ds.get_batch, n, nb, rng)
    runs["DataLoader cached nw=0"] = loader_pass(loader(ds, 0))
    if workers:
        runs["DataLoader cached nw=2"] = loader_pass(loader(ds, 2))
    # np.take returns a new array, as users call it (38 MB of fresh memory per 150 KB batch)
    runs["np.take, random rows in RAM"] = batches_pass(lambda i: np.take(flat, i, axis=0), n, nb, rng)
    runs["DataLoader TensorDataset nw=0"] = loader_pass(loader(tensors, 0))
    runs["DataLoader source nw=0"] = loader_pass(loader(source, 0))
    if workers:
        runs["DataLoader source nw=2"] = loader_pass(loader(source, 2))
        runs["DataLoader TensorDataset nw=2"] = loader_pass(loader(tensors, 2))
    if label == "3KB":
        calls = 20000 if n > 10000 else 5000
        runs["single arr[i].copy()"] = single_pass(lambda i: x[i].copy(), n, calls, rng)
        runs["single ds[i]"] = single_pass(ds.__getitem__, n, calls, rng)
        runs["single cache.get(i)"] = single_pass(cache.get, n, calls, rng)
    rows = passes(runs, repeats)
    runs.clear()  # the loaders' persistent workers exit with them
    cache.close()
    return rows


RATIOS = {  # row -> the baselines it is compared with (and the target)
    "cache batch path ds.get_batch": [("np.take, random rows in RAM", 0.5, "3KB"),
                                      ("bulk copy (memory, not cache)", 0.8, "150KB")],
    "DataLoader cached nw=0": [("cache batch path ds.get_batch", 0.7, None),
                               ("DataLoader TensorDataset nw=0", 1.0, None),
                               ("DataLoader source nw=0", None, None)],
    "DataLoader cached nw=2": [("DataLoader source nw=2", 1.0, None),
                               ("DataLoader TensorDataset nw=2", None, None)],
    "single ds[i]": [("single arr[i].copy()", 1 / 3, None)],
    "single cache.get(i)": [("single arr[i].copy()", 1 / 3, None)],
}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, 2 passes: a few seconds")
    p.add_argument("--no-workers", action="store_true", help="skip the num_workers=2 rows")
    args = p.parse_args(argv)
    private_namespace("shmcache-bench-")
    repeats = 2 if args.quick else 7
    sizes = [("3KB", (32, 32, 3), 2048 if args.quick else 20480),
             ("150KB", (224, 224, 3), 512 if args.quick else 1536)]
    session = f"bench-dataloader-{os.getpid()}"
    print(environment_line(environment({"batch": str(BATCH), "passes": str(repeats)})))
    try:
        for label, shape, n in sizes:
            rows = measure_size(label, shape, n, repeats, not args.no_workers, session)
            # rates from the median time of a batch (per 1000 calls for single gets): a median,
            # robust to the descheduled batches of a shared machine (a whole pass's rate is a mean)
            rate = {k: (1000 if k.startswith("single") else BATCH) / median(t) for k, (_, t) in rows.items()}
            table = []
            for name, (rates, times) in rows.items():
                per = "per 1000 calls" if name.startswith("single") else "per batch"
                ratios = []
                for base, target, only in RATIOS.get(name, []):
                    if base in rate and (only is None or only == label):
                        r = rate[name] / rate[base]
                        want = f" (target >= {target:.2g}: {'met' if r >= target else 'MISSED'})" \
                            if target is not None else ""
                        ratios.append(f"{fmt_ratio(r)} {base}{want}")
                table.append((name, fmt_rate(rate[name]), fmt_s(1e3 * median(times)),
                              fmt_s(1e3 * p90(times)), per, fmt_rate(median(rates)), "; ".join(ratios)))
            print(f"\n{label} items ({n} of them), batch {BATCH}, {repeats} passes; items/s and ratios "
                  f"from the median time of a batch")
            print_table(("row", "items/s", "median ms", "p90 ms", "time of", "pass items/s", "ratios"), table)
    finally:
        SessionRegistry().destroy(session, force=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
