"""A cold epoch against the DataLoader's own batched fetch, for any map-style dataset with
``__getitems__`` (issue 31): where the cache's miss path costs what, by the source's cost an item
and the item's size.

The source: ``__getitems__(indices)`` gives ``{"x": a row of a ready uint8 array, "y": int}`` per
index, each item a copy of its row, after spinning the item's cost in Python (``--costs``, us an
item: the GIL held, as a decoding or transforming dataset holds it). Read by ``DataLoader(ds,
batch_size=64, shuffle=True, num_workers=W)`` unwrapped, then wrapped in a fresh cache (its cold
epoch), in the same round, rounds alternating; reported per (size, cost): the medians, the cold
epoch as a ratio of the unwrapped one (1.00: as fast; > 0.9: the issue's target), and what the
cache adds an item, ``(cold - plain) / items``. That column is the miss path's own cost: a
source slower by ``cost`` an item keeps it, so the ratio reaches 0.9 where ``cost`` is about nine
times it. ``own x``: the cold epoch with no pages backed ahead (each batch's commit backs its own
pages in line, as without the compiled ``base.ahead``), the baseline of that part; ``pw x``: pages
backed ahead, but each batch's records pwritten into them rather than copied through the mapping
that thread made (``ahead.copy_into``), the baseline of that. ``kernel x``:
the unwrapped epoch over one that only adds the kernel's part of admitting each item's record into
fresh shared memory, in line (``KernelOnly``): the most a shared-memory cache's cold epoch can
reach there when all of that runs on the loader's thread.

    PYTHONPATH=$PWD python benchmarks/bench_cold_epoch.py [--n 5000] [--rounds 3]
        [--costs 0 20 100 400] [--sizes 3072 24576] [--workers 0]
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KernelOnly, environment, environment_line, median, private_namespace  # noqa: E402
from _common import shuffled_epoch as _epoch  # noqa: E402


class Source:
    """A map-style dataset with ``__getitems__`` whose items cost ``cost_us`` each (a Python spin)."""

    def __init__(self, n: int, size: int, cost_us: float):
        self.rows = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
        self.cost = cost_us / 1e6

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list) -> list:
        until = time.perf_counter() + self.cost * len(indices)
        while time.perf_counter() < until:  # the dataset's own work, GIL held
            pass
        return [{"x": self.rows[i].copy(), "y": int(i)} for i in indices]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=5000, help="items in the dataset")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--costs", type=float, nargs="+", default=[0, 20, 100, 400], help="us an item")
    ap.add_argument("--sizes", type=int, nargs="+", default=[3072, 24576], help="bytes an item")
    ap.add_argument("--workers", type=int, nargs="+", default=[0])
    args = ap.parse_args()
    private_namespace("bench-cold-")
    from shmcache import ShmDatasetCache

    print(environment_line(environment()))
    print(f"{args.n} items, DataLoader(batch_size=64, shuffle=True); median of {args.rounds} rounds; "
          f"cold x: the unwrapped epoch's time over the cold one's; added: (cold - plain) / items")
    print(f"{'size':>7}{'cost us':>9}{'workers':>8}{'plain s':>9}{'cold s':>8}{'cold x':>8}{'added us':>10}"
          f"{'own x':>7}{'pw x':>6}{'kernel x':>9}")
    runs = itertools.count(1)
    for size in args.sizes:
        for cost in args.costs:
            src = Source(args.n, size, cost)
            for workers in args.workers:
                plain, cold, own, pw, kernel, record = [], [], [], [], [], 0
                for r in range(args.rounds):  # which goes first alternates (the kernel's needs a record's size)
                    order = ("plain", "cold", "own", "pw", "kernel") if r % 2 == 0 else \
                        ("pw", "own", "cold", "kernel", "plain")
                    for what in order:
                        if what == "plain":
                            plain.append(_epoch(src, workers))
                        elif what in ("cold", "own", "pw"):
                            took, record = _cold_epoch(ShmDatasetCache, src, workers, next(runs),
                                                       ahead=what != "own", mapped=what == "cold")
                            {"cold": cold, "own": own, "pw": pw}[what].append(took)
                        else:
                            only = KernelOnly(src, record)
                            kernel.append(_epoch(only, workers))
                            only.close()
                p, c, k = median(plain), median(cold), median(kernel)
                print(f"{size:>7}{cost:>9g}{workers:>8}{p:>9.3f}{c:>8.3f}{p / c:>8.2f}"
                      f"{(c - p) / args.n * 1e6:>10.1f}{p / median(own):>7.2f}{p / median(pw):>6.2f}{p / k:>9.2f}")


def _cold_epoch(cache_type, src: Source, workers: int, run: int, ahead: bool = True,
                mapped: bool = True) -> tuple[float, int]:
    """One epoch of ``src`` wrapped in a fresh cache, which is destroyed after, and the bytes of an
    item's record there; ``ahead=False``: with no pages backed ahead (the forked workers inherit it);
    ``mapped=False``: the records pwritten into pages backed ahead, not copied through its mapping."""
    from shmcache.base import ahead as pages_ahead

    cache = cache_type(session="bench-cold", name=f"c{run}", size=2048)
    was, was_mapped = pages_ahead.NATIVE, pages_ahead.COPY_MAPPED
    pages_ahead.NATIVE, pages_ahead.COPY_MAPPED = was and ahead, was_mapped and mapped
    try:
        took = _epoch(cache.wrap(src, fingerprint=f"cold-{run}"), workers)
        st = cache.stats()
        return took, round(st["bytes_mem"] / max(1, st["items_mem"]))
    finally:
        pages_ahead.NATIVE, pages_ahead.COPY_MAPPED = was, was_mapped
        cache.store.destroy()
        cache.close()


if __name__ == "__main__":
    main()
