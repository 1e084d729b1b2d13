"""A warm epoch read from spill files vs from shared memory vs the uncached source, in one run.

    python benchmarks/bench_spill_epoch.py            # ~1 minute on 2 cores
    python benchmarks/bench_spill_epoch.py --quick

Three realistic payloads, each cached twice through ``ShmDatasetCache``: once with room in
memory, once with a 1 MB cap and ``spilling=True`` (so nearly everything lives in zstd spill
files): decoded photo crops (JPEG decode + crop + resize on every uncached access), int64
token-like arrays, and incompressible random bytes. Reported per payload: items/s of a random-order
epoch of ``ds[i]`` from the source, from memory and from spill, the ratios, and the compression
ratio on disk. benchmarks/bench_spill.py measures the spill files alone against zstd's own speed.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from _common import print_table  # noqa: E402  (benchmarks/ is on sys.path: the script's folder)
from datasets import PhotoCrops  # noqa: E402

from shmcache import ShmDatasetCache  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        rng = np.random.default_rng(i)
        return rng.zipf(1.3, 4096).clip(0, 50_000).astype(np.int64), i  # 32 KB of token ids


class RandomBytes(Tokens):
    def __getitem__(self, i):
        return np.random.default_rng(i).integers(0, 256, 64 << 10, dtype=np.uint8), i


def epoch(ds, order) -> float:
    t0 = time.perf_counter()
    for i in order:
        ds[i]
    return time.perf_counter() - t0


def run(label: str, source, spill_dir: str, rows: list, repeats: int) -> None:
    n = len(source)
    order = np.random.default_rng(0).permutation(n).tolist()
    t_src = epoch(source, order[: max(1, n // 4)]) * 4
    results = {}
    for where, kw in (("memory", dict(size=1024)), ("spill", dict(size=1, spilling=True, spill_dir=spill_dir))):
        session = f"bse-{os.getpid()}-{where}"
        cache = ShmDatasetCache(session=session, **kw)
        try:
            ds = cache.wrap(source)
            cache.warmup(ds, progress=False)
            results[where] = float(np.median([epoch(ds, order) for _ in range(repeats)]))
            st = cache.stats()
        finally:
            cache.close()
            SessionRegistry().destroy(session, force=True)
        if where == "spill":
            ratio = st["bytes_disk_raw"] / max(1, st["bytes_disk"])
            on_disk = st["items_disk"] / n
    rows.append((label, f"{n}", f"{n / t_src:,.0f}", f"{n / results['memory']:,.0f}",
                 f"{n / results['spill']:,.0f}", f"{t_src / results['spill']:.1f}x",
                 f"{results['spill'] / results['memory']:.1f}x", f"{on_disk:.0%}", f"{ratio:.2f}"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    os.environ.setdefault("SHMCACHE_DIR", tempfile.mkdtemp(prefix="shmcache-bench-"))
    k = 4 if args.quick else 1
    rows: list = []
    with tempfile.TemporaryDirectory(prefix="shmcache-spill-") as spill_dir:
        run("photo crops 224x224x3", PhotoCrops(400 // k, size=224), spill_dir, rows, 3)
        run("int64 tokens (32 KB)", Tokens(4000 // k), spill_dir, rows, 3)
        run("random bytes (64 KB)", RandomBytes(2000 // k), spill_dir, rows, 3)
    print(f"torch {torch.__version__}, numpy {np.__version__}, {os.cpu_count()} CPUs; items/s of a "
          f"random-order epoch of ds[i], one process")
    headers = ("payload", "items", "source/s", "memory/s", "spill/s", "spill vs source",
               "spill cost vs memory", "on disk", "zstd ratio")
    print_table(headers, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
