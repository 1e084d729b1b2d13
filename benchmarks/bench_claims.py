"""What a claim costs an uncontended single miss (NOTE [claims], issue 26: at most 1.1x today's).

One process, two caches of one session, claims on in one and off in the other (as
``SHMCACHE_CLAIMS=0`` makes them), alternating every 100 misses (and which goes first). A round is
``--n`` misses of new int keys through ``cache.get(key, fn)`` (lookup, claim, re-check, compute, put, release) with
a free source (a ready 3 KB array), and the same through ``ds[i]`` of a wrapped dataset. Reported:
the median over every 100 misses of the µs per miss, and the ratio on/off (> 1 is slower); and the claim
alone, one OFD lock and unlock (``Claims.take`` + ``release``), in µs.

    PYTHONPATH=$PWD python benchmarks/bench_claims.py [--rounds 9] [--n 2000]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import FreeSource as Free  # noqa: E402
from _common import environment, environment_line, median, private_namespace  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--n", type=int, default=2000)
    args = ap.parse_args()
    private_namespace("bench-claims-")
    from shmcache import ShmDatasetCache

    total = args.n * args.rounds + 8
    item = Free(total).item
    caches, datasets = {}, {}
    for mode in ("on", "off"):
        c = ShmDatasetCache(session="bench-claims", name=f"get-{mode}", size=4 * total * 4096 >> 20)
        c.store.claims.on = mode == "on"
        caches[mode] = c
        w = ShmDatasetCache(session="bench-claims", name=f"ds-{mode}", size=4 * total * 4096 >> 20)
        datasets[mode] = w.wrap(Free(total))
        w.store.claims.on = mode == "on"
    times: dict = {(path, m): [] for path in ("get", "ds") for m in ("on", "off")}
    fn = lambda k: item  # noqa: E731
    chunk = 100  # the modes alternate every 100 misses: a shared machine's load drifts slower
    for r in range(args.rounds):
        for lo in range(8 + r * args.n, 8 + (r + 1) * args.n, chunk):  # new keys: misses (wrap() stored 3)
            keys = range(lo, lo + chunk)
            for mode in ("on", "off") if (lo // chunk) % 2 else ("off", "on"):
                c, ds = caches[mode], datasets[mode]
                t = time.perf_counter()
                for k in keys:
                    c.get(k, fn)
                times[("get", mode)].append((time.perf_counter() - t) / chunk * 1e6)
                t = time.perf_counter()
                for k in keys:
                    ds[k]
                times[("ds", mode)].append((time.perf_counter() - t) / chunk * 1e6)
    claims = caches["on"].store.claims
    claims._ready()
    lock = []
    for _ in range(args.rounds):
        t = time.perf_counter()
        for b in range(args.n):
            claims.take(b)
            claims.release(b)
        lock.append((time.perf_counter() - t) / args.n * 1e6)
    print(environment_line(environment()))
    print(f"uncontended single misses, {args.n} per round, {args.rounds} rounds (median of 100-miss runs, µs per miss)")
    print(f"{'path':<22}{'claims on':>11}{'claims off':>12}{'on/off':>9}")
    for path, label in (("get", "cache.get(key, fn)"), ("ds", "ds[i] (wrapped)")):
        on, off = median(times[(path, "on")]), median(times[(path, "off")])
        print(f"{label:<22}{on:>11.2f}{off:>12.2f}{on / off:>9.3f}")
    print(f"one claim alone (OFD lock + unlock): {median(lock):.2f} µs")
    for c in caches.values():
        c.store.destroy()
        c.close()
    for ds in datasets.values():
        ds.cache.store.destroy()
        ds.cache.close()


if __name__ == "__main__":
    main()
