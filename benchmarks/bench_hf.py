"""Cold and warm epochs over a Hugging Face ``datasets`` table, with and without the cache (issue 31).

A ``Dataset.from_dict`` of ``--rows`` rows (an int label, a 32x32x3 uint8 image as ``Array3D``, a
short string) in the ``numpy``, ``torch`` or ``python`` format, read by ``DataLoader(batch_size=64,
shuffle=True, num_workers=W)``: the unwrapped epoch (HF's own ``__getitems__``: one Arrow read per
batch), then a fresh cache's cold epoch and its warm epoch, in the same run; reported as ratios to
the unwrapped epoch (> 1: faster than no cache), the median of ``--rounds``, and the cache's bytes
per row against the row's payload. ``own x``: a cold epoch with no pages backed ahead (each batch's
commit backs its own pages in line, as without the compiled ``base.ahead``), the baseline of that
part; ``py x``: a cold epoch with the cold batch's compiled encode, probe and run write off (their
Python in their place, as with ``SHMCACHE_NATIVE=0``), the baseline of those; ``noput x``: a cold
epoch that does all of the miss path but the put (each batch's probes, claims and encode; nothing
stored, so every epoch is cold): the most a cold epoch can reach here while its put runs on the
loader's thread at all. Also the
DataLoader's own floor: the same rows, already made, served from a Python list by ``__getitems__``
(no work at all) - the most any cache can gain with that many workers (``floor x``: the unwrapped
epoch over that one). And per format, what admission costs a row in this
process: ``encode`` (``encode_many`` of a batch of 64 rows, best of 5) against the dataset's own
``__getitems__`` of the same rows; and what the kernel alone takes to admit a row's bytes
(``_write_floor``); and ``kernel x``: the unwrapped epoch over one that only adds the kernel's part
of admitting each row, in line (``KernelOnly``: the most a shared-memory cache's cold epoch can
reach here when the kernel's part all runs on the loader's thread; pages backed ahead on an idle
CPU take part of it off that thread).

    pip install datasets   # not a dependency of shmcache
    PYTHONPATH=$PWD python benchmarks/bench_hf.py [--rows 5000] [--rounds 3] [--formats numpy torch python]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import KernelOnly, environment, environment_line, median, private_namespace  # noqa: E402
from _common import shuffled_epoch as _epoch  # noqa: E402


def _table(rows: int):
    import datasets

    rng = np.random.default_rng(0)
    features = datasets.Features({"label": datasets.Value("int64"),
                                  "img": datasets.Array3D((32, 32, 3), "uint8"),
                                  "text": datasets.Value("string")})
    return datasets.Dataset.from_dict({
        "label": rng.integers(0, 10, rows).tolist(),
        "img": rng.integers(0, 256, (rows, 32, 32, 3), dtype=np.uint8),
        "text": [f"row {i}" for i in range(rows)],
    }, features=features)


def _encode_cost(hf, fmt: str) -> None:
    import timeit

    from shmcache import ShmDatasetCache

    keys = list(range(64))
    rows = hf.__getitems__(keys)
    pairs = list(zip(keys, rows))
    cache = ShmDatasetCache(session="bench-hf", name=f"encode-{fmt}", size=64)
    try:
        enc = min(timeit.repeat(lambda: cache.encode_many(pairs), number=20, repeat=5)) / 20 / 64
        fetch = min(timeit.repeat(lambda: hf.__getitems__(keys), number=5, repeat=5)) / 5 / 64
    finally:
        cache.store.destroy()
        cache.close()
    print(f"  {fmt}: encode {enc * 1e6:.1f} us a row, the dataset's __getitems__ {fetch * 1e6:.1f} us a row")


def _write_floor(row_bytes: int, rows: int = 2048) -> float:
    """Seconds a row that the kernel alone takes to admit ``row_bytes`` into shared memory, as the
    cache's writer does it (a batch of 64 rows: one ``posix_fallocate`` of fresh tmpfs pages, one
    ``pwritev``), best of 3, in a loop that does nothing else."""
    import tempfile

    pieces = [bytes(row_bytes)] * 64
    best = float("inf")
    for _ in range(3):
        fd, path = tempfile.mkstemp(dir="/dev/shm", prefix="bench-hf-floor-")
        os.unlink(path)
        try:
            os.ftruncate(fd, rows * row_bytes)
            t = time.perf_counter()
            for start in range(0, rows, 64):
                os.posix_fallocate(fd, start * row_bytes, 64 * row_bytes)
                os.pwritev(fd, pieces, start * row_bytes)
            best = min(best, (time.perf_counter() - t) / rows)
        finally:
            os.close(fd)
    return best


def _switches(which: str) -> list:
    """The (module, flag) switches of a compiled part, as ``SHMCACHE_NATIVE=0`` leaves them: ``own``
    the pages backed ahead (``base.ahead``); ``py`` the cold batch's compiled encode, probe and
    run write (``cache._codec``, ``cache._index``, ``rowcopy.write_all``)."""
    from shmcache.base import ahead, rowcopy
    from shmcache.cache import codec, index

    if which == "own":
        return [(ahead, "NATIVE")]
    return [(codec, "PACK_NATIVE"), (index, "PROBE_NATIVE"), (rowcopy, "NATIVE")]


def _cold_without(which: str, hf, fmt: str, workers: int, r: int) -> float:
    """A cold epoch with the compiled parts ``which`` names off (``_switches``): ``own x`` and
    ``py x``, each the baseline of its part in the same rounds; ``noput``: with the put of each
    batch's computed misses skipped (``noput x``)."""
    from shmcache import ShmDatasetCache

    if which == "noput":
        real = ShmDatasetCache.put_encoded
        ShmDatasetCache.put_encoded = lambda self, store, items: None  # the forked workers inherit it
        try:
            cache = ShmDatasetCache(session="bench-hf", name=f"{which}-{fmt}-{workers}-{r}", size=2048)
            try:
                return _epoch(cache.wrap(hf, fingerprint=f"hf-{which}-{fmt}-{workers}-{r}"), workers)
            finally:
                cache.store.destroy()
                cache.close()
        finally:
            ShmDatasetCache.put_encoded = real
    switches = _switches(which)
    was = [getattr(module, flag) for module, flag in switches]
    for module, flag in switches:  # before the cache: its encoder's shapes are made with it off
        setattr(module, flag, False)  # the forked workers inherit it
    cache = ShmDatasetCache(session="bench-hf", name=f"{which}-{fmt}-{workers}-{r}", size=2048)
    try:
        ds = cache.wrap(hf, fingerprint=f"hf-{which}-{fmt}-{workers}-{r}")
        return _epoch(ds, workers)
    finally:
        for (module, flag), value in zip(switches, was):
            setattr(module, flag, value)
        cache.store.destroy()
        cache.close()


class Ready:
    """The rows already made, served from a list (map-style, with ``__getitems__``): the floor."""

    def __init__(self, rows: list):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i: int):
        return self.rows[i]

    def __getitems__(self, keys: list) -> list:
        return [self.rows[i] for i in keys]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    ap.add_argument("--formats", nargs="+", default=["numpy", "torch", "python"])
    args = ap.parse_args()
    try:
        import datasets  # noqa: F401
    except ImportError:
        sys.exit("bench_hf.py needs Hugging Face datasets: pip install datasets")
    private_namespace("bench-hf-")
    from shmcache import ShmDatasetCache

    base = _table(args.rows)
    print(environment_line(environment()))
    print(f"{args.rows} rows (label, 32x32x3 uint8 image, str), DataLoader(batch_size=64, shuffle=True); "
          f"median of {args.rounds} rounds; ratios: the unwrapped epoch's time over the cached one's")
    print(f"{'format':<8}{'workers':>8}{'plain s':>9}{'cold s':>8}{'warm s':>8}{'cold x':>8}{'own x':>7}"
          f"{'py x':>6}{'noput x':>8}{'warm x':>8}{'floor x':>8}{'kernel x':>9}{'bytes/row':>11}")
    for fmt in args.formats:
        hf = base.with_format(fmt) if fmt != "python" else base
        ready = Ready([hf[i] for i in range(len(hf))])
        for workers in args.workers:
            plain, cold, own, py, noput, warm, floor, kernel, per_row = [], [], [], [], [], [], [], [], 0.0
            for r in range(args.rounds):
                plain.append(_epoch(hf, workers))
                floor.append(_epoch(ready, workers))
                own.append(_cold_without("own", hf, fmt, workers, r))
                py.append(_cold_without("py", hf, fmt, workers, r))
                noput.append(_cold_without("noput", hf, fmt, workers, r))
                cache = ShmDatasetCache(session="bench-hf", name=f"{fmt}-{workers}-{r}", size=2048)
                ds = cache.wrap(hf, fingerprint=f"hf-{fmt}-{workers}-{r}")
                cold.append(_epoch(ds, workers))
                warm.append(_epoch(ds, workers))
                st = cache.stats()
                per_row = st["bytes_mem"] / max(1, st["items_mem"])
                cache.store.destroy()
                cache.close()
                only = KernelOnly(hf, round(per_row))
                kernel.append(_epoch(only, workers))
                only.close()
            if workers == args.workers[0]:
                _encode_cost(hf, fmt)
            p, c, w, f, k = median(plain), median(cold), median(warm), median(floor), median(kernel)
            print(f"{fmt:<8}{workers:>8}{p:>9.2f}{c:>8.2f}{w:>8.2f}{p / c:>8.2f}{p / median(own):>7.2f}"
                  f"{p / median(py):>6.2f}{p / median(noput):>8.2f}{p / w:>8.2f}{p / f:>8.2f}{p / k:>9.2f}"
                  f"{per_row:>11.0f}")
            if workers == 0:
                write = _write_floor(round(per_row))
                print(f"  {fmt}: the kernel's part of admitting a row ({per_row:.0f} bytes into fresh tmpfs pages): "
                      f"{write * 1e6:.1f} us in a loop of its own ({p / (p + args.rows * write):.2f}x of the "
                      f"unwrapped epoch if that were all it cost); kernel x: the same inside the epoch")
    print(f"payload per row: {32 * 32 * 3} bytes of pixels + a label and a short string")


if __name__ == "__main__":
    main()
