"""A record put on its own (``cache.put``), copied in through the mapping or with one pwritev
(``CacheWriter._insert``: ``PWRITE_MIN_BYTES``), on /dev/shm and on a huge-page tmpfs.

    sudo python benchmarks/bench_put_one.py            # ~15 s on 2 loaded cores
    sudo python benchmarks/bench_put_one.py --quick    # ~5 s

As root, the script runs itself again in a private mount namespace (``unshare -m``) and mounts a
tmpfs ``huge=within_size`` there (nothing of the machine's changes). For each mount and record size,
rounds alternate the two ways of copying - through the mapping (the writer's threshold set past
every record) and by pwritev (set to 0; on the huge mount forced, which the writer does not do) -
each round in a fresh cache, so every put copies into pages no store touched yet, as a cache
filling up does. Each row: the median time of a put, and the median over rounds of the round's
ratio pwritev / mapping (below 1: pwritev is faster).
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
from _common import environment, environment_line, in_huge_tmpfs, inside_mount, median  # noqa: E402

SIZES = (4 << 10, 24 << 10, 48 << 10, 150_000, 1 << 20)


def _round(mount: str | None, size: int, n: int, how: str, tag: str) -> float:
    """Seconds a put of one ``size``-byte record takes, ``n`` puts into a fresh cache, copied ``how``."""
    from shmcache import ShmDatasetCache
    from shmcache.base.shm import Segment
    from shmcache.cache import writer
    from shmcache.cache.registry import SessionRegistry

    writer.PWRITE_MIN_BYTES = 1 << 62 if how == "mapping" else 0
    base = Segment.__init__

    def init(self, *a, **k):  # pwritev forced on a huge mount too
        base(self, *a, **k)
        self.base_pages = self.base_pages or how == "pwritev"

    Segment.__init__ = init
    session = f"bench-put-one-{tag}-{os.getpid()}"
    try:
        c = ShmDatasetCache(session=session, name="c", size=max(64, 2 * n * size >> 20),
                            memory_dir=mount)
        values = [np.full(size, i % 251, np.uint8) for i in range(n + 1)]
        c.put(-1, values[-1])  # the segment made, the first commit done
        t0 = time.perf_counter()
        for i in range(n):
            c.put(i, values[i])
        dt = (time.perf_counter() - t0) / n
        c.close()
    finally:
        Segment.__init__ = base
        SessionRegistry().destroy(session, force=True)
    return dt


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mount = inside_mount(argv)
    if mount is None:
        return in_huge_tmpfs(str(Path(__file__).resolve()), argv, "1g")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer puts and rounds (~5 s)")
    args = p.parse_args(argv)
    ns = os.environ["SHMCACHE_DIR"] = tempfile.mkdtemp(prefix="shmcache-bench-ns-")  # a namespace of its own
    os.environ.pop("SHMCACHE_MEMORY_DIR", None)
    try:
        _table(mount, args.quick)
    finally:
        shutil.rmtree(ns, ignore_errors=True)
    return 0


def _table(mount: str, quick: bool) -> None:
    rounds = 3 if quick else 5
    print(environment_line(environment()))
    print("| memory | record | mapping | pwritev | pwritev / mapping |")
    print("|---|---:|---:|---:|---:|")
    for where, mnt in (("/dev/shm", None), ("tmpfs huge=within_size", mount)):
        for size in SIZES:
            n = max(20, min(200, (24 << 20) // size // 2 // (2 if quick else 1)))
            times: dict[str, list[float]] = {"mapping": [], "pwritev": []}
            ratios = []
            for r in range(rounds):
                order = ("mapping", "pwritev") if r % 2 == 0 else ("pwritev", "mapping")
                got = {how: _round(mnt, size, n, how, f"{how}-{r}") for how in order}
                for how, dt in got.items():
                    times[how].append(dt)
                ratios.append(got["pwritev"] / got["mapping"])
            print(f"| {where} | {size:,} B | {median(times['mapping']) * 1e6:.0f} us | "
                  f"{median(times['pwritev']) * 1e6:.0f} us | {median(ratios):.2f} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
