"""A hit and a batch at millions of items against the same at ten thousand, on a huge-page tmpfs (issue 27).

    sudo python benchmarks/bench_scale.py                 # 3,000,000 items (9.4 GB): ~3 minutes
    sudo python benchmarks/bench_scale.py --items 300000  # quicker

As root, the script runs itself again in a private mount namespace (``unshare -m``) with a tmpfs
``huge=within_size`` mounted for it (nothing of the machine's changes). Two caches in a session
whose memory directory is that mount: a small one of 10,000 items and a large one of ``--items``
(default 3,000,000), items ``(uint8 32x32x3 image, int label)``, 3 KB. The rows, timed in
interleaved rounds (a block of calls of one, then of the other, the order alternating, so load
from other users hits both alike):

* ``ds[i]`` of a random key (a single hit of a wrapped dataset);
* ``get_batch`` of 256 random keys, each batch held until the next call returns;
* ``np.take`` of 256 random rows out of a private array of the same number of rows (numpy asks
  for transparent huge pages on it), the machine's own cost of going from the small set to the
  large one (up to 9.4 GB more RAM: skipped with ``--no-private``).

Reported: each row's median time per call, and the large cache's time over the small one's, round
by round, its median. Target: a hit and a batch at 3M items within 1.2x of 10k items.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, environment_line, in_huge_tmpfs, inside_mount  # noqa: E402

BATCH, SMALL = 256, 10_000
PATTERNS = 997  # distinct 3 KB patterns the items are made from (item k: pattern k % PATTERNS, its key in front)


class Items:
    """Item k: a 32x32x3 uint8 image (pattern ``k % PATTERNS``, the key's 8 bytes in front) and k % 10;
    ``__getitems__`` so a warm-up computes a batch in one call."""

    def __init__(self, n: int, patterns: np.ndarray):
        self.n, self.patterns = n, patterns

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k: int):
        img = self.patterns[k % PATTERNS].copy()
        img.reshape(-1)[:8] = np.frombuffer(np.int64(k).tobytes(), np.uint8)
        return img, k % 10

    def __getitems__(self, keys: list) -> list:
        return [self[k] for k in keys]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--items", type=int, default=3_000_000)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--no-private", action="store_true", help="skip the private-array yardstick (its RAM)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mount = inside_mount(argv)
    if mount is None:
        args = _parser().parse_args(argv)  # checked here, before the namespace: --help and typos say so at once
        size = f"{int((args.items + SMALL) * 3200 * 1.3) // 2**30 + 2}g"
        return in_huge_tmpfs(str(Path(__file__).resolve()), argv, size)
    args = _parser().parse_args(argv)
    os.environ["SHMCACHE_DIR"] = tempfile.mkdtemp(prefix="shmcache-bench-ns-")  # a namespace of its own
    os.environ.pop("SHMCACHE_MEMORY_DIR", None)
    from shmcache import ShmDatasetCache
    from shmcache.base import memdir
    from shmcache.cache.registry import SessionRegistry

    print(environment_line(environment()))
    patterns = np.random.default_rng(0).integers(0, 256, (PATTERNS, 32, 32, 3), dtype=np.uint8)
    sizes = {"10k": SMALL, "large": args.items}
    caches = {}
    try:
        for label, n in sizes.items():
            mb = int(n * 3200 * 1.3) >> 20
            caches[label] = ShmDatasetCache(session="bench-scale", name=label, size=mb + 16, memory_dir=mount)
        return _run(args, caches, sizes, patterns, memdir.backing(SessionRegistry().segment_dir("bench-scale")))
    finally:
        for cache in caches.values():
            cache.close()
        if SessionRegistry().exists("bench-scale"):
            SessionRegistry().destroy("bench-scale", force=True)
        shutil.rmtree(os.environ["SHMCACHE_DIR"], ignore_errors=True)


def _run(args, caches: dict, sizes: dict, patterns: np.ndarray, backing) -> int:
    rng = np.random.default_rng(1)
    ds = {}
    for label, cache in caches.items():
        t0 = time.perf_counter()
        ds[label] = cache.wrap(Items(sizes[label], patterns), label=f"scale-{label}")
        cache.warmup(ds[label], progress=label != "10k")
        print(f"{label}: {sizes[label]:,} items warmed in {time.perf_counter() - t0:.0f} s")
    for label, d in ds.items():  # the right bytes came back (the key in front of each image)
        for k in rng.integers(0, sizes[label], 100).tolist():
            assert int(np.frombuffer(d[k][0].reshape(-1)[:8].tobytes(), np.int64)[0]) == k, (label, k)
    singles = {label: rng.integers(0, n, 4096).tolist() for label, n in sizes.items()}
    batches = {label: [rng.choice(n, BATCH, replace=False) for _ in range(256)] for label, n in sizes.items()}
    held = [None]

    def hit(label: str):
        d, keys = ds[label], singles[label]
        return lambda j: d[keys[j % len(keys)]]

    def batch(label: str):
        cache, keys = caches[label], batches[label]

        def call(j):
            held[0] = cache.get_batch(keys[j % len(keys)])
        return call

    rows = {f"ds[i], {label}": hit(label) for label in sizes}
    rows.update({f"get_batch, {label}": batch(label) for label in sizes})
    if not args.no_private:
        out = np.empty((BATCH, 3072), np.uint8)
        for label, n in sizes.items():
            private = np.empty((n, 3072), np.uint8)  # numpy asks for huge pages on arrays this large
            for lo in range(0, n, 65536):  # filled (every page touched), in pieces
                private[lo:lo + 65536] = patterns.reshape(PATTERNS, 3072)[np.arange(lo, min(n, lo + 65536)) % PATTERNS]
            rows[f"np.take private (THP), {label}"] = (
                lambda j, a=private, keys=batches[label]: np.take(a, keys[j % len(keys)], axis=0, out=out, mode="clip"))
    calls = {name: 4096 if name.startswith("ds[i]") else 64 for name in rows}
    for name, fn in rows.items():  # warm: every page mapped in this process
        for j in range(calls[name]):
            fn(j)
    times: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            fn, n = rows[name], calls[name]
            t0 = time.perf_counter()
            for j in range(n):
                fn(r * n + j)
            times[name].append((time.perf_counter() - t0) / n)
    held[0] = None
    print(f"memory: {backing.describe()}")
    print(f"{sizes['large']:,} items ({sizes['large'] * 3072 / 2**30:.1f} GiB) against {SMALL:,}, "
          f"{args.rounds} interleaved rounds (median time per call)")
    for name, t in times.items():
        print(f"  {name:34s} {float(np.median(t)) * 1e6:9.2f} us")
    for what, target in (("ds[i]", 1.2), ("get_batch", 1.2), ("np.take private (THP)", None)):
        if f"{what}, large" not in times:
            continue
        ratio = float(np.median([a / b for a, b in zip(times[f"{what}, large"], times[f"{what}, 10k"])]))
        verdict = "" if target is None else f" (target <= {target}x: {'met' if ratio <= target else 'MISSED'})"
        print(f"{what}: {sizes['large']:,} items take {ratio:.2f}x the time of {SMALL:,}{verdict}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
