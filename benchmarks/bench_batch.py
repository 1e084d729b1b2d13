"""The batch path at the memory's limit (issues 20 and 27): each shmcache row against its numpy
yardstick, measured in the same run, interleaved, best of rounds, reported as ratios.

    python benchmarks/bench_batch.py            # ~2 minutes on 2 loaded cores
    python benchmarks/bench_batch.py --quick    # ~20 s, smaller sets, fewer rounds
    python benchmarks/bench_batch.py --quick --against /tmp/base --runs 3
        # before / after: this script run alternately with another checkout's shmcache
        # (PYTHONPATH=/tmp/base) and with this one's, each ratio's median over the runs side by side
    python benchmarks/bench_batch.py --against-numpy-copy --runs 3
        # the same, without the compiled parts (SHMCACHE_NATIVE=0: numpy's copies, the Python hit) against
        # them (base.rowcopy, cache.hit)

Items ``(uint8 HWC image, int label)``: 3 KB (32x32x3, 50,000 of them) and 150 KB (224x224x3,
2,000), random batches of 256 from a list of batches cycled through (so no batch is cache-warm
from its previous call). Every round times a block of calls of every row, one row after the other;
a row's number is its best round (time per call), so load from other users - this machine has 2
cores shared with others - hits every row alike and the least-disturbed round counts.

Rows (yardsticks first, in-process private memory, which gets transparent huge pages):

* ``np.take`` of both fields into a fresh array, and with ``out=`` / ``mode="clip"`` into a
  preallocated one (clip: numpy buffers ``take(out=)`` in the default mode);
* the same ``take(out=)`` from a ``MAP_SHARED`` copy of the images: 4 KiB pages like ``/dev/shm``,
  which has no huge pages here - the bound for any gather out of shared memory on this machine;
* 150 KB: a bulk copy of as many bytes from a contiguous block of an array larger than the CPU
  caches into a preallocated buffer;
* ``arr[i].copy()`` of one 3 KB item (the yardstick of ``ds[i]``);
* shmcache: ``get_batch(keys)`` held until the next call returns, as ``for ...: batch = ...`` does
  (large outputs are recycled: the row also reports how many distinct buffers it saw),
  ``get_batch(keys, out=)``, ``ds[i]``, and ``PrefetchRing.from_cache`` on the CPU (the ring's path
  into its slot buffers, unpinned without CUDA) against a bare ``get_batch(out=)`` loop over the
  same key batches;
* a loop that drops each batch before the next (issue 27): ``get_batch(keys)`` not held, against
  a bulk copy into a new array, also dropped (both pay for fresh memory, or recycle it);
* the Python and C calls one warm ``get_batch`` makes (``sys.setprofile``; numpy's own count apart;
  operators and indexing are not calls to the profiler, so the numpy count is a floor).

Prints the load average before and after, and a table; ``--json`` writes the numbers.
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, environment_line, print_table  # noqa: E402

from shmcache import PrefetchRing, ShmDatasetCache  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402

BATCH = 256


class Items(torch.utils.data.Dataset):
    """Item i: row i of ``images`` and the label i % 10."""

    def __init__(self, images: np.ndarray):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], i % 10


def best_of(rows: dict, rounds: int, block_s: float = 0.002, clock=time.thread_time) -> dict:
    """Interleaved rounds: each round runs a block of calls of every row in turn, each row's block
    about ``block_s`` long (so a preemption is as likely in every row's block); a row's time is its
    best block's time per call, by ``clock``: this thread's CPU time by default, which a
    preemption by another user's process does not inflate (wall time does, on a loaded machine)."""
    calls = {}
    for name, fn in rows.items():  # warm (first touch of pages, lazy attach, decoders), then size the block
        fn()
        t0 = time.perf_counter()
        fn()
        calls[name] = max(1, round(block_s / max(time.perf_counter() - t0, 1e-7)))
    best = dict.fromkeys(rows, float("inf"))
    for _ in range(rounds):
        for name, fn in rows.items():
            t0 = clock()
            for _ in range(calls[name]):
                fn()
            best[name] = min(best[name], (clock() - t0) / calls[name])
    return best


def loadavg() -> str:
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def measure(label: str, n: int, shape: tuple, rounds: int) -> dict:
    rng = np.random.default_rng(0)
    images = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
    labels = np.arange(n, dtype=np.int64) % 10
    key_list = [rng.choice(n, BATCH, replace=False) for _ in range(max(8, min(64, 4 * n // BATCH)))]
    keys = itertools.cycle(key_list)
    shared = np.ndarray(images.shape, np.uint8, mmap.mmap(-1, images.nbytes))
    shared[...] = images
    y_img, y_lab = np.empty((BATCH, *shape), np.uint8), np.empty(BATCH, np.int64)
    starts = itertools.cycle(range(0, n - BATCH, 97))
    singles = itertools.cycle(rng.integers(0, n, 997).tolist())

    session = f"bench-batch-{os.getpid()}"
    cache = ShmDatasetCache(session=session, size=int(n * images[0].nbytes * 1.3 / 2**20) + 16)
    try:
        ds = cache.wrap(Items(images))
        cache.warmup(ds, progress=False)
        out = (torch.empty((BATCH, *shape), dtype=torch.uint8), torch.empty(BATCH, dtype=torch.int64))
        held = [None]
        ptrs: set = set()

        def get_batch():
            held[0] = cache.get_batch(next(keys))  # the previous batch is dropped only now
            ptrs.add(held[0][0].data_ptr())

        rows = {
            "np.take, new arrays": lambda: (np.take(images, k := next(keys), axis=0), np.take(labels, k)),
            "np.take(out=, mode=clip)": lambda: (np.take(images, k := next(keys), axis=0, out=y_img, mode="clip"),
                                                 np.take(labels, k, out=y_lab, mode="clip")),
            "np.take(out=) from MAP_SHARED": lambda: (np.take(shared, k := next(keys), axis=0, out=y_img, mode="clip"),
                                                      np.take(labels, k, out=y_lab, mode="clip")),
            "bulk copy": lambda: (np.copyto(y_img, images[(s := next(starts)):s + BATCH]),
                                  np.copyto(y_lab, labels[s:s + BATCH])),
            "bulk copy, new arrays (dropped)": lambda: (images[(s := next(starts)):s + BATCH].copy(),
                                                        labels[s:s + BATCH].copy()),
            "get_batch": get_batch,
            "get_batch (dropped)": lambda: cache.get_batch(next(keys)),
            "get_batch(out=)": lambda: cache.get_batch(next(keys), out=out),
        }
        best = best_of(rows, rounds)
        single = best_of({"arr[i].copy()": lambda: images[next(singles)].copy(),
                          "ds[i]": lambda: ds[next(singles)]}, rounds * 4)
        best.update(single)
        best["distinct get_batch buffers"] = len(ptrs)

        # the ring against a bare loop over the same key batches: whole passes, interleaved
        # one ring, a pass per call: its slot buffers are allocated once, as over a training run's epochs
        with PrefetchRing.from_cache(cache, key_list, device="cpu", depth=2) as ring:
            passes = {"bare get_batch(out=) loop": lambda: [cache.get_batch(k, out=out) for k in key_list],
                      "PrefetchRing.from_cache (CPU)": lambda: [b for b in ring]}
            ring_cpu = best_of(passes, rounds, clock=time.process_time)  # both threads
            ring_wall = best_of(passes, max(3, rounds // 3), clock=time.perf_counter)
        best.update({k: v / len(key_list) for k, v in ring_cpu.items()})
        best.update({k + " (wall)": v / len(key_list) for k, v in ring_wall.items()})
        best.update({k + " (wall)": v for k, v in best_of(rows, max(3, rounds // 3), clock=time.perf_counter).items()})
        calls = {"get_batch": count_calls(lambda: cache.get_batch(key_list[0])),
                 "get_batch(out=)": count_calls(lambda: cache.get_batch(key_list[0], out=out)),
                 "ds[i]": count_calls(lambda: ds[3])}
    finally:
        held[0] = None
        cache.close()
        SessionRegistry().destroy(session, force=True)
    best["label"] = label
    best["calls"] = calls
    return best


def count_calls(fn) -> dict:
    """The Python functions and C functions (numpy's apart) one warm call of ``fn`` calls."""
    fn()
    seen = collections.Counter()

    def profile(frame, event, arg):
        if event == "call":
            seen["python"] += 1
        elif event == "c_call":
            seen["C"] += 1
            owner = getattr(arg, "__self__", None)
            if "numpy" in (getattr(arg, "__module__", None) or type(owner).__module__ or ""):
                seen["numpy"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    seen["python"] -= 1  # fn itself
    return dict(seen)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sets, few rounds")
    p.add_argument("--json", help="write the numbers here")
    p.add_argument("--against", metavar="TREE", help="another checkout (its root): run this script alternately "
                   "with its shmcache and with this one's, and print each ratio of both side by side")
    p.add_argument("--against-numpy-copy", action="store_true",
                   help="the same, against this checkout with SHMCACHE_NATIVE=0 (numpy's copies and the Python "
                        "hit, not the compiled row copy and hit)")
    p.add_argument("--runs", type=int, default=3, help="with --against: runs of each (default 3)")
    args = p.parse_args(argv)
    if args.against or args.against_numpy_copy:
        return against(args)
    made = None
    if "SHMCACHE_DIR" not in os.environ:  # a namespace of its own, removed at the end
        made = os.environ["SHMCACHE_DIR"] = tempfile.mkdtemp(prefix="shmcache-bench-")
    try:
        return run(args)
    finally:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)


def run(args) -> int:
    print(environment_line(environment()))
    print(f"load average before: {loadavg()}")
    if args.quick:
        small = measure("3 KB", 10000, (32, 32, 3), 10)
        large = measure("150 KB", 600, (224, 224, 3), 5)
    else:
        small = measure("3 KB", 50000, (32, 32, 3), 60)
        large = measure("150 KB", 2000, (224, 224, 3), 25)
    print(f"load average after: {loadavg()}")
    rows = []
    for r in (small, large):
        for name, v in r.items():
            if name in ("label", "distinct get_batch buffers", "calls"):
                continue
            unit = 1e6
            rows.append((r["label"], name, f"{v * unit:.1f} us"))
    print_table(("items", "row", "best CPU (or wall) time per call"), rows)
    targets = ratios(small, large)
    out_rows = []
    for name, value, target in targets:
        out_rows.append((name, f"{value:.2f}", verdict(value, target)))
    print_table(("ratio (speed / yardstick's speed unless said)", "value", "target"), out_rows)
    print(f"150 KB get_batch used {large['distinct get_batch buffers']} distinct output buffers "
          f"(recycled once the caller dropped a batch); 3 KB batches are below BatchBuffers.MIN_BYTES")
    for r in (small, large):
        print(f"{r['label']}: calls of one warm call (Python functions / C functions, of them numpy's): " + "; ".join(
            f"{name} {c.get('python', 0)} / {c.get('C', 0)}, {c.get('numpy', 0)}" for name, c in r["calls"].items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"3 KB": small, "150 KB": large,
                                               "ratios": {name: value for name, value, _ in targets}}, indent=1))
    return 0


def ratios(s: dict, b: dict) -> list[tuple[str, float, float | None]]:
    """``(name, value, target)``: speed over the yardstick's speed unless the name says otherwise; a
    negative target is an upper bound (of a time ratio)."""
    return [
        # issue 27
        ("3 KB get_batch(out=) / np.take(out=, clip) from MAP_SHARED (same 4 KiB pages)",
         s["np.take(out=) from MAP_SHARED"] / s["get_batch(out=)"], 0.8),
        ("150 KB get_batch, each batch dropped / bulk copy into a new array, dropped",
         b["bulk copy, new arrays (dropped)"] / b["get_batch (dropped)"], 0.85),
        ("3 KB ds[i] time / arr[i].copy() time (lower is better)", s["ds[i]"] / s["arr[i].copy()"], -2.0),
        # issue 20
        ("3 KB get_batch / np.take, new arrays", s["np.take, new arrays"] / s["get_batch"], 0.8),
        ("3 KB get_batch(out=) / np.take(out=, clip)", s["np.take(out=, mode=clip)"] / s["get_batch(out=)"], 0.8),
        ("3 KB get_batch(out=) speed / get_batch speed", s["get_batch"] / s["get_batch(out=)"], 1.0),
        ("3 KB get_batch, each batch dropped / bulk copy into a new array, dropped",
         s["bulk copy, new arrays (dropped)"] / s["get_batch (dropped)"], None),
        ("150 KB get_batch (held until the next) / bulk copy", b["bulk copy"] / b["get_batch"], 0.9),
        ("150 KB get_batch(out=) / bulk copy", b["bulk copy"] / b["get_batch(out=)"], 0.9),
        ("150 KB get_batch(out=) / np.take(out=, clip) from MAP_SHARED (same 4 KiB pages)",
         b["np.take(out=) from MAP_SHARED"] / b["get_batch(out=)"], None),
        ("150 KB get_batch(out=) / np.take(out=, clip)", b["np.take(out=, mode=clip)"] / b["get_batch(out=)"], None),
        ("150 KB get_batch(out=) speed / get_batch speed", b["get_batch"] / b["get_batch(out=)"], 1.0),
        ("3 KB PrefetchRing (CPU device) / bare get_batch(out=) loop, end to end (wall)",
         s["bare get_batch(out=) loop (wall)"] / s["PrefetchRing.from_cache (CPU) (wall)"], 0.8),
        ("150 KB PrefetchRing (CPU device) / bare get_batch(out=) loop, end to end (wall)",
         b["bare get_batch(out=) loop (wall)"] / b["PrefetchRing.from_cache (CPU) (wall)"], 0.8),
        ("3 KB PrefetchRing / bare loop, CPU time of both threads", s["bare get_batch(out=) loop"]
         / s["PrefetchRing.from_cache (CPU)"], None),
        ("150 KB PrefetchRing / bare loop, CPU time of both threads", b["bare get_batch(out=) loop"]
         / b["PrefetchRing.from_cache (CPU)"], None),
        ("3 KB get_batch(out=) / np.take(out=, clip), wall time", s["np.take(out=, mode=clip) (wall)"]
         / s["get_batch(out=) (wall)"], None),
        ("150 KB get_batch(out=) / bulk copy, wall time", b["bulk copy (wall)"] / b["get_batch(out=) (wall)"], None),
    ]


def verdict(value: float, target: float | None) -> str:
    if target is None:
        return ""
    if target < 0:
        return f"<= {-target:g} " + ("met" if value <= -target else "MISSED")
    return f">= {target:g} " + ("met" if value >= target else "MISSED")


def against(args) -> int:
    """Run this script alternately with ``args.against``'s shmcache (or this checkout's with
    SHMCACHE_NATIVE=0) and this checkout's (PYTHONPATH), ``args.runs`` times each, and print each
    ratio's median over the runs of both."""
    here = str(Path(__file__).resolve().parents[1])
    before = here if args.against_numpy_copy else str(Path(args.against).resolve())
    trees = {"before": before, "now": here}
    extra = {"before": {"SHMCACHE_NATIVE": "0"} if args.against_numpy_copy else {}, "now": {}}
    got: dict[str, list[dict]] = {name: [] for name in trees}
    print(environment_line(environment()))
    with tempfile.TemporaryDirectory(prefix="bench-batch-") as tmp:
        for run in range(args.runs):
            for name, tree in (trees.items() if run % 2 == 0 else reversed(list(trees.items()))):
                path = os.path.join(tmp, f"{name}-{run}.json")
                # the tree ahead of the caller's own path (which may hold the dependencies)
                pythonpath = os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p)
                env = dict(os.environ, PYTHONPATH=pythonpath, **extra[name])
                cmd = [sys.executable, __file__, "--json", path] + (["--quick"] if args.quick else [])
                subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL, cwd=tree)
                got[name].append(json.loads(Path(path).read_text()))
    rows = []
    for name, _, target in ratios(got["now"][0]["3 KB"], got["now"][0]["150 KB"]):
        before = statistics.median(r["ratios"][name] for r in got["before"])
        now = statistics.median(r["ratios"][name] for r in got["now"])
        rows.append((name, f"{before:.2f}", f"{now:.2f}", verdict(now, target)))
    print(f"{args.runs} runs of each, alternating; medians of each run's same-run ratio")
    label = "SHMCACHE_NATIVE=0" if args.against_numpy_copy else trees["before"]
    print_table(("ratio (speed / yardstick's speed unless said)", f"before ({label})", "now", "target"),
                rows)
    for name in trees:
        for size in ("3 KB", "150 KB"):
            c = got[name][0][size]["calls"]
            print(f"{name}, {size}: calls of one warm call (Python / C, of them numpy's): " + "; ".join(
                f"{k} {v.get('python', 0)} / {v.get('C', 0)}, {v.get('numpy', 0)}" for k, v in c.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
