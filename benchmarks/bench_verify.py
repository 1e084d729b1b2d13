"""What the stale-file checks cost on a dataset of 1M file paths read lazily (issue 25, item 6).

Reproduce (the numbers in README.md came from exactly this):

    cd /work/main && .venv/bin/python benchmarks/bench_verify.py              # 1M files, a few minutes
    cd /work/main && .venv/bin/python benchmarks/bench_verify.py --items 100000

It writes N files of 16 bytes into a temporary folder ($TMPDIR, not /dev/shm), and
wraps a dataset that holds their paths and reads an item's file in ``__getitem__`` (the most common
kind). Then, in turn, repeated:

  wrap()            a fresh ShmDatasetCache wraps the dataset: the fingerprint hashes the 1M paths
  wrap() + stat     the same, plus os.stat of every path (size and mtime) - what putting the files'
                    size and modification time into the fingerprint would add to every wrap()

and prints the median of each and their ratio, measured in the same run. Last it fills the cache
and times ``cache.verify_sample(ds, fraction=0.01)`` (10,000 items read again and compared) once.

Results (1M files; 16 idle cores, ext4, page cache warm; the same steps run from one script, the
1% recheck as verify_sample does it - a lookup, a recompute and same_sample per item):

    files written 12.2 s
    wrap() median 0.145 s; wrap() + stat of every path median 1.863 s; ratio 12.85 (5 runs each, in turn)
    warmup of 1M 55.1 s
    recompute + compare of 1% (10,000 items) 0.208 s; stale 0

On the shared 2-core machine (load ~11), with --items 20000: wrap() 0.059 s, + stat 0.39 s (6.7x).
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

sys.path.insert(0, str(Path(__file__).parent))
from _common import environment, environment_line, fmt_ratio, fmt_s, median  # noqa: E402

from shmcache import ShmDatasetCache  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402


class Files:
    """A dataset of file paths whose items are read lazily."""

    def __init__(self, paths: list[str]):
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> np.ndarray:
        with open(self.paths[i], "rb") as f:
            return np.frombuffer(f.read(), np.uint8).copy()


def time_wrap(ds: Files, with_stat: bool) -> float:
    t0 = time.perf_counter()
    cache = ShmDatasetCache(session="bench-verify")
    cache.wrap(ds)
    if with_stat:
        stats = np.fromiter((s.st_size ^ s.st_mtime_ns for s in map(os.stat, ds.paths)), np.int64, len(ds.paths))
        stats.tobytes()  # what a fingerprint would hash
    took = time.perf_counter() - t0
    cache.close()
    return took


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--items", type=int, default=1_000_000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print(environment_line(environment()))
    folder = Path(tempfile.mkdtemp(prefix="bench-verify-"))  # $TMPDIR: a disk, not /dev/shm
    try:
        t0 = time.perf_counter()
        paths = []
        for i in range(args.items):
            sub = folder / f"{i // 10000:03d}"
            if i % 10000 == 0:
                sub.mkdir()
            path = f"{sub}/{i}.bin"
            with open(path, "wb") as f:
                f.write(i.to_bytes(16, "little"))
            paths.append(path)
        print(f"{args.items} files written in {fmt_s(time.perf_counter() - t0)} s")
        ds = Files(paths)
        plain, stat = [], []
        time_wrap(ds, False)  # the first wrap makes the cache; the timed ones find it
        for _ in range(args.repeats):
            plain.append(time_wrap(ds, False))
            stat.append(time_wrap(ds, True))
        print(f"wrap():         median {fmt_s(median(plain))} s of {args.repeats}")
        print(
            f"wrap() + stat:  median {fmt_s(median(stat))} s of {args.repeats}  "
            f"({fmt_ratio(median(stat) / median(plain))} of wrap() alone)"
        )
        cache = ShmDatasetCache(session="bench-verify")
        wrapped = cache.wrap(ds)
        t0 = time.perf_counter()
        cache.warmup(wrapped, progress=False)
        print(f"warmup of {args.items} items: {fmt_s(time.perf_counter() - t0)} s")
        t0 = time.perf_counter()
        report = cache.verify_sample(wrapped, fraction=0.01, progress=False)
        print(f"verify_sample(fraction=0.01): {report.checked} items in {fmt_s(time.perf_counter() - t0)} s")
        cache.close()
    finally:
        SessionRegistry().destroy("bench-verify", force=True)
        shutil.rmtree(folder, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
