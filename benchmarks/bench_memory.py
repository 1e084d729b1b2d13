"""Memory of 4 processes reading one dataset: one shared cache vs a cache in each process.

    python benchmarks/bench_memory.py            # ~30 s
    python benchmarks/bench_memory.py --quick

Four reader processes each touch every item of a 150 KB x N dataset, then report their
proportional set size (PSS, from /proc/<pid>/smaps_rollup: shared pages count 1/k in each of the
k processes that map them). shmcache: the items live once in /dev/shm and every process maps
them (read with ``copy=False``, so nothing is copied into the process). Baseline: each process
keeps its own in-process dict of the same items, the way a per-process cache does. Reported: the
sum of PSS over the four processes (minus what the same processes use with no data), as a ratio
to the payload. Target: shmcache <= 1.1x, where per-process caches use 4x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import private_namespace  # noqa: E402

from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import CacheStore

READER = r"""
import json, sys
import numpy as np
from shmcache.cache.store import CacheStore
mode, n, session = sys.argv[1], int(sys.argv[2]), sys.argv[3]
def item(i):
    return np.full((224, 224, 3), i % 251, np.uint8)
def pss():
    with open("/proc/self/smaps_rollup") as f:
        return sum(int(line.split()[1]) * 1024 for line in f if line.startswith("Pss:"))
base = pss()
keep = None
if mode == "shmcache":
    store = CacheStore(session, "mem", create=False)
    total = 0
    for i in range(n):
        total += int(store.lookup(i, copy=False).sum())  # touch every shared page, copy nothing
    keep = store
elif mode == "dict":
    keep = {i: item(i) for i in range(n)}
print("ready", flush=True)
sys.stdin.readline()  # measure only once every reader has mapped and touched everything
print(json.dumps({"pss": pss() - base}), flush=True)
sys.stdin.read()  # stay alive until every reader has measured: PSS shares pages among the living
"""


def run_readers(mode: str, n: int, session: str, procs: int = 4) -> list[int]:
    ps = [subprocess.Popen([sys.executable, "-c", READER, mode, str(n), session], stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    try:
        for p in ps:
            assert p.stdout.readline().strip() == "ready"
        for p in ps:  # all have touched everything: now each measures
            p.stdin.write("\n")
            p.stdin.flush()
        return [json.loads(p.stdout.readline())["pss"] for p in ps]
    finally:
        for p in ps:
            p.stdin.close()
            p.wait(timeout=120)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    private_namespace("shmcache-bench-")
    n = 200 if args.quick else 1000
    payload = n * 224 * 224 * 3
    session = f"bench-mem-{os.getpid()}"
    store = CacheStore(session, "mem", capacity_bytes=int(payload * 1.2) + (64 << 20))
    try:
        for i in range(n):
            store.put(i, np.full((224, 224, 3), i % 251, np.uint8))
        shm = store.stats()["shm_bytes"]
        store.close()  # the parent's mapping would take a share of every page's PSS
        rows = []
        for mode in ("shmcache", "dict"):
            pss = run_readers(mode, n, session)
            rows.append((mode, sum(pss), pss))
    finally:
        store.close()
        SessionRegistry().destroy(session, force=True)
    print(f"{n} items of 150 KB = {payload / 2**20:.0f} MiB payload; 4 reader processes; "
          f"shmcache's segments hold {shm / 2**20:.0f} MiB ({shm / payload:.3f}x)")
    print(f"{'readers':<10} {'sum of PSS':>12} {'x payload':>10}   per process")
    for mode, total, pss in rows:
        per = ", ".join(f"{x / 2**20:.0f}" for x in pss)
        label = "shmcache" if mode == "shmcache" else "dict each"
        print(f"{label:<10} {total / 2**20:>8.0f} MiB {total / payload:>10.2f}   {per} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
