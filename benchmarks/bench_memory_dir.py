"""3 KB get_batch from a huge-page tmpfs against the same cache on /dev/shm (issue 27).

    sudo python benchmarks/bench_memory_dir.py            # ~1 minute on 2 loaded cores
    sudo python benchmarks/bench_memory_dir.py --quick    # ~20 s

As root, the script runs itself again in a private mount namespace (``unshare -m``) and mounts a
tmpfs ``huge=within_size`` there (nothing of the machine's changes). Two caches of the same items,
``(uint8 32x32x3 image, int label)`` (3 KB), 60,000 of them (184 MB: far beyond what a TLB of 4 KiB
pages reaches): one in a session on /dev/shm (4 KiB pages here), one in a session whose memory
directory is the huge-page tmpfs (``memory_dir=``). Random batches of 256 keys, from a list cycled
through, each batch held until the next call returns. Rounds interleave the two (a block of calls
of one, then of the other, the order alternating), so load from other users hits both alike; each
row's number is its median time per call over rounds, and the ratio is taken round by round, its
median reported. Also ``np.take`` of the same rows out of a MAP_SHARED file in each mount, the
memory's own bound. Target: huge-page tmpfs >= 1.3x /dev/shm.

Also ``get_batch(out=)`` on each mount against ``np.take(out=, mode="clip")`` of the same rows from
MAP_SHARED memory of the same mount (the same page size: target >= 0.8x) and, on the huge-page
mount, against the same ``np.take`` from private memory with transparent huge pages (>= 0.7x).
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, environment_line, in_huge_tmpfs, inside_mount  # noqa: E402

BATCH = 256


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    mount = inside_mount(argv)
    if mount is None:
        return in_huge_tmpfs(str(Path(__file__).resolve()), argv, "4g")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="fewer items and rounds (~20 s)")
    p.add_argument("--items", type=int, default=None)
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--json", metavar="PATH", help="write the numbers there")
    args = p.parse_args(argv)
    n = args.items or (30_000 if args.quick else 60_000)
    rounds = args.rounds or (7 if args.quick else 15)
    os.environ["SHMCACHE_DIR"] = tempfile.mkdtemp(prefix="shmcache-bench-ns-")  # a namespace of its own
    os.environ.pop("SHMCACHE_MEMORY_DIR", None)

    from shmcache import ShmDatasetCache
    from shmcache.cache.registry import SessionRegistry

    print(environment_line(environment()))
    rng = np.random.default_rng(0)
    images = rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8)
    mb = int(n * 3200 * 1.3) >> 20
    caches = {"/dev/shm": ShmDatasetCache(session="bench-shm", name="c", size=mb, memory_dir=""),
              "huge tmpfs": ShmDatasetCache(session="bench-huge", name="c", size=mb, memory_dir=mount)}
    try:
        return _run(args, n, rounds, mount, images, caches, rng)
    finally:  # /dev/shm outlives the namespace: its session goes whatever happened
        for cache in caches.values():
            cache.close()
        for session in ("bench-shm", "bench-huge"):
            if SessionRegistry().exists(session):
                SessionRegistry().destroy(session, force=True)
        shutil.rmtree(os.environ["SHMCACHE_DIR"], ignore_errors=True)


def _run(args, n: int, rounds: int, mount: str, images: np.ndarray, caches: dict, rng) -> int:
    from shmcache.base import memdir
    from shmcache.cache.registry import SessionRegistry

    for cache in caches.values():
        for k in range(n):
            cache.put(k, (images[k], k % 10))
    pages = {label: memdir.backing(SessionRegistry().segment_dir(c.session)).describe() for label, c in caches.items()}
    # the memory's own bound: the same rows, np.take out of a MAP_SHARED file on each mount
    raw = {}
    for label, where in (("/dev/shm", "/dev/shm"), ("huge tmpfs", mount)):
        path = os.path.join(where, f"bench-raw-{os.getpid()}")
        with open(path, "wb") as f:
            f.write(images.tobytes())
        fd = os.open(path, os.O_RDWR)
        m = mmap.mmap(fd, images.nbytes)
        os.close(fd)
        os.unlink(path)
        raw[label] = np.frombuffer(m, np.uint8).reshape(n, 3072)
    batches = [rng.choice(n, BATCH, replace=False) for _ in range(512)]
    out = np.empty((BATCH, 3072), np.uint8)
    private = images.reshape(n, 3072).copy()  # numpy asks for huge pages on arrays this large (THP madvise)
    outs = (np.empty((BATCH, 32, 32, 3), np.uint8), np.empty(BATCH, np.int64))

    def block(fn, calls: int = 64) -> float:
        t0 = time.perf_counter()
        for j in range(calls):
            fn(batches[j % len(batches)])
        return (time.perf_counter() - t0) / calls

    rows = {f"get_batch, {label}": (lambda keys, c=c: c.get_batch(keys)) for label, c in caches.items()}
    rows.update({f"np.take MAP_SHARED, {label}": (lambda keys, a=a: np.take(a, keys, axis=0, out=out, mode="clip"))
                 for label, a in raw.items()})
    rows.update({f"get_batch(out=), {label}": (lambda keys, c=c: c.get_batch(keys, out=outs))
                 for label, c in caches.items()})
    rows["np.take private (THP)"] = lambda keys: np.take(private, keys, axis=0, out=out, mode="clip")
    for fn in rows.values():  # warm: every page mapped in this process
        for keys in batches:
            fn(keys)
    times: dict[str, list[float]] = {name: [] for name in rows}
    names = list(rows)
    for r in range(rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            times[name].append(block(rows[name]))
    med = {name: float(np.median(t)) for name, t in times.items()}
    ratio = float(np.median([a / b for a, b in zip(times["get_batch, /dev/shm"], times["get_batch, huge tmpfs"])]))
    raw_ratio = float(np.median([a / b for a, b in zip(times["np.take MAP_SHARED, /dev/shm"],
                                                         times["np.take MAP_SHARED, huge tmpfs"])]))
    print(f"{n} items of 3 KB ({n * 3072 / 2**20:.0f} MiB), batches of {BATCH}, {rounds} interleaved rounds")
    for label, text in pages.items():
        print(f"  {label}: {text}")
    for name, t in med.items():
        print(f"  {name:34s} {t * 1e6:8.1f} us per batch (median of rounds)")
    print(f"get_batch, huge tmpfs vs /dev/shm: {ratio:.2f}x (target >= 1.3x)")
    print(f"np.take from MAP_SHARED, huge tmpfs vs /dev/shm: {raw_ratio:.2f}x")

    def same_round(yardstick: str, row: str) -> float:  # speed over the yardstick's, round by round
        return float(np.median([a / b for a, b in zip(times[yardstick], times[row])]))

    floors = {f"get_batch(out=) / np.take(out=) MAP_SHARED, {label}":
              (same_round(f"np.take MAP_SHARED, {label}", f"get_batch(out=), {label}"), 0.8) for label in caches}
    floors["get_batch(out=), huge tmpfs / np.take(out=) private (THP)"] = (
        same_round("np.take private (THP)", "get_batch(out=), huge tmpfs"), 0.7)
    for name, (value, target) in floors.items():
        print(f"{name}: {value:.2f}x (target >= {target}x: {'met' if value >= target else 'MISSED'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"items": n, "rounds": rounds, "median_s": med, "ratio": ratio,
                                               "raw_ratio": raw_ratio, "pages": pages,
                                               "floors": {k: v for k, (v, _) in floors.items()}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
