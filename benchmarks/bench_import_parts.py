"""Where a snapshot import's time goes (issue 20): the import against its parts, measured on the
same records in the same run, interleaved, best of rounds.

    python benchmarks/bench_import_parts.py            # ~1 minute on 2 loaded cores
    python benchmarks/bench_import_parts.py --quick

Parts, each over every record of one snapshot (photo crops 224x224x3, as bench_snapshot.py):

* zstd alone: one ZstdDecompressor over every compressed frame into new bytes (a copy for raw
  records) - "zstd's own decompression";
* fresh tmpfs pages: fallocate and first touch of as many bytes of a new /dev/shm file (the page
  faults and the kernel's zeroing, nothing copied);
* copy into touched pages: a memcpy of the decompressed records into that file again;
* zstd + copy into fresh /dev/shm pages: the floor of any import into shared memory on one core;
* the import itself (``ShmDatasetCache.from_snapshot``, a new session each round).

The import's time less the floor is what shmcache adds (reading the files, index inserts, checks).
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_snapshot as snap  # noqa: E402
from _common import environment, environment_line, print_table, private_namespace  # noqa: E402


def _shm_file(total: int):
    path = f"/dev/shm/shmcache-bench-{os.getpid()}-parts"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    os.unlink(path)  # gone when fd closes
    os.ftruncate(fd, total)
    return fd


def fresh_pages(total: int) -> float:
    fd = _shm_file(total)
    try:
        with mmap.mmap(fd, total) as m:
            t0 = time.perf_counter()
            os.posix_fallocate(fd, 0, total)
            for off in range(0, total, mmap.PAGESIZE):  # the first touch of every page
                m[off] = 1
            return time.perf_counter() - t0
    finally:
        os.close(fd)


def copy_touched(raw: list[bytes], total: int) -> float:
    fd = _shm_file(total)
    try:
        with mmap.mmap(fd, total) as m:
            view = memoryview(m)
            os.posix_fallocate(fd, 0, total)
            view[:] = b"\0" * total  # touched: only the copy is timed below
            t0 = time.perf_counter()
            off = 0
            for data in raw:
                view[off:off + len(data)] = data
                off += len(data)
            t = time.perf_counter() - t0
            view.release()
            return t
    finally:
        os.close(fd)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    private_namespace("shmcache-bench-")
    print(environment_line(environment()))
    rounds = 3 if args.quick else 7
    with tempfile.TemporaryDirectory(prefix="shmcache-parts-", dir="/tmp") as tmp_name:
        dest = Path(tmp_name) / "snap"
        snap.make_snapshot(snap.PhotoCrops(200 if args.quick else 800, size=224), dest)
        frames = snap.stored_frames(dest)
        dctx = zstandard.ZstdDecompressor()
        raw = [dctx.decompress(s, max_output_size=n) if c else bytes(s) for c, s, n in frames]
        total = sum(len(r) for r in raw)
        on_disk = sum(f.stat().st_size for f in snap.segment_files(dest))
        parts = {
            "zstd alone (zstd's own decompression)": lambda: snap.zstd_alone(frames),
            "fresh tmpfs pages: fallocate + first touch": lambda: fresh_pages(total),
            "memcpy into touched /dev/shm pages": lambda: copy_touched(raw, total),
            "zstd + copy into fresh /dev/shm pages (floor)": lambda: snap.zstd_into_fresh_shm(frames),
        }

        def import_round() -> float:
            t, cache = snap.import_once(dest)
            assert cache.last_import.complete, cache.last_import
            snap._destroy(cache)
            return t
        parts["import (ShmDatasetCache.from_snapshot)"] = import_round
        best = dict.fromkeys(parts, float("inf"))
        with open("/proc/loadavg") as f:
            print("load average before:", " ".join(f.read().split()[:3]))
        for _ in range(rounds):  # interleaved: every part sees the same machine
            for name, fn in parts.items():
                best[name] = min(best[name], fn())
        with open("/proc/loadavg") as f:
            print("load average after:", " ".join(f.read().split()[:3]))
    zstd = best["zstd alone (zstd's own decompression)"]
    imp = best["import (ShmDatasetCache.from_snapshot)"]
    rows = [(name, f"{t * 1e3:.1f} ms", f"{on_disk / 2**20 / t:,.0f}", f"{t / imp:.2f}", f"{zstd / t:.2f}")
            for name, t in best.items()]
    rows.append(("import less the floor (what shmcache adds)",
                 f"{(imp - best['zstd + copy into fresh /dev/shm pages (floor)']) * 1e3:.1f} ms", "", "", ""))
    print(f"\nphoto crops: {len(frames)} records, {on_disk / 2**20:.1f} MiB stored, {total / 2**20:.1f} MiB raw; "
          f"best of {rounds} interleaved rounds")
    print_table(("part", "time", "MiB/s of snapshot", "share of import", "zstd alone / part (speed)"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
