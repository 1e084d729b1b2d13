"""What the batch miss path costs over the source's own time (issue 26: at most 10 µs per miss).

A free source (a ready 3 KB array, so the source's own time is a list append), one process,
claims on. Each round fills a fresh cache of ``--n`` items by each path, alternating which goes
first; reported per path: the median over rounds of µs per item, and that minus the source's own
time (the same items gathered into a private list in the same round):

* ``warmup()``: the whole dataset, a batch of misses at a time (claimed, computed, stored a chunk
  at a time: NOTE [claims]);
* ``get_batch(keys)`` of the wrapped dataset, batches of 256 misses (misses computed by it);
* ``__getitems__`` of the wrapped dataset, batches of 256: what a DataLoader worker calls;
* ``ds[i]`` one by one, and one ``put`` per item (the per-item admission the batch paths replaced),
  for comparison.

    PYTHONPATH=$PWD python benchmarks/bench_miss_path.py [--rounds 5] [--n 20000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import FreeSource as Free  # noqa: E402
from _common import environment, environment_line, median, private_namespace  # noqa: E402

PATHS = ("warmup", "get_batch", "__getitems__", "ds[i]", "put per item")


def _fill(path: str, cache, ds, n: int) -> None:
    batches = [list(range(lo, min(n, lo + 256))) for lo in range(0, n, 256)]
    if path == "warmup":
        cache.warmup(ds, progress=False)
    elif path == "get_batch":
        for keys in batches:
            ds.get_batch(keys)
    elif path == "__getitems__":
        for keys in batches:
            ds.__getitems__(keys)
    elif path == "ds[i]":
        for i in range(n):
            ds[i]
    else:
        src = ds.dataset
        for i in range(n):
            cache.put(i, src[i])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--n", type=int, default=20000)
    args = ap.parse_args()
    private_namespace("bench-miss-")
    from shmcache import ShmDatasetCache

    n = args.n
    size = max(16, 6 * n * 4096 >> 20)
    times: dict = {p: [] for p in (*PATHS, "source")}
    for r in range(args.rounds):
        order = PATHS if r % 2 == 0 else PATHS[::-1]
        for path in order:
            cache = ShmDatasetCache(session="bench-miss", name=f"r{r}-{PATHS.index(path)}", size=size)
            src = Free(n)
            ds = cache.wrap(src, fingerprint=f"free-{r}-{path}")
            t = time.perf_counter()
            _fill(path, cache, ds, n)
            times[path].append((time.perf_counter() - t) / n * 1e6)
            assert len(cache) >= n - 1, (path, len(cache))
            cache.store.destroy()
            cache.close()
        t = time.perf_counter()
        got = [src[i] for i in range(n)]
        times["source"].append((time.perf_counter() - t) / n * 1e6)
        del got
    print(environment_line(environment()))
    print(f"filling a cold cache of {n} items of 3 KB from a free source, {args.rounds} rounds "
          f"(median µs per item)")
    base = median(times["source"])
    print(f"{'path':<16}{'µs/item':>10}{'over source':>13}")
    for path in PATHS:
        t = median(times[path])
        print(f"{path:<16}{t:>10.2f}{t - base:>13.2f}")
    print(f"{'source alone':<16}{base:>10.2f}")


if __name__ == "__main__":
    main()
