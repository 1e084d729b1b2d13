"""The miss path's cost with the remote tier, in CPU, robust on a shared machine: what one process
spends per miss (its main thread, its writer thread, the Redis server) reading ``photos`` it has
never seen through ``get_batch`` of 64, against the uncached source and a node-local cache, and the
cost of a single ``ds[i]`` miss (a free 3 KiB source) with and without leases (NOTE [remote leases]).

    python benchmarks/bench_remote_miss.py              # ~1 minute on 2 cores
    python benchmarks/bench_remote_miss.py --items 150  # quicker

On a node whose cores are all busy with ranks (this 2-core machine with 4 ranks: bench_remote.py),
the first epoch's speed follows the CPU a miss costs in all: ``remote/uncached`` here predicts it
better than wall times, which swing ~3x as other work comes and goes. Each mode runs alternately,
``--repeats`` times; the table shows medians.
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
from _common import environment, environment_line, median, print_table, start_redis  # noqa: E402
from peers._workloads import make_workload  # noqa: E402

BATCH = 64


def _redis_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def photos_misses(url: str, server_pid: int, n: int, repeats: int, flush) -> dict:
    """Per miss (ms): main-thread CPU, all threads' CPU (writer included, until its queue is
    written), Redis's CPU, wall - for uncached, local, remote."""
    import torch
    from torch.utils.data import default_collate

    from shmcache import ShmDatasetCache
    from shmcache.cache.registry import SessionRegistry

    torch.set_num_threads(1)
    src = make_workload("photos", n).source()
    out: dict = {}
    for rep in range(repeats):
        for mode in ("uncached", "local", "remote"):
            flush()
            cache = None
            if mode == "uncached":
                read = lambda keys: default_collate([src[i] for i in keys])  # noqa: E731
            else:
                cache = ShmDatasetCache(session=f"miss-{mode}-{rep}", remote=url if mode == "remote" else "")
                read = cache.wrap(src).get_batch
            idx = np.random.default_rng(rep).permutation(n)
            c0, m0, r0, t0 = time.process_time(), time.thread_time(), _redis_cpu_s(server_pid), time.perf_counter()
            for lo in range(0, n, BATCH):
                read(idx[lo:lo + BATCH].tolist())
            m1, t1 = time.thread_time(), time.perf_counter()
            if mode == "remote":
                cache.store.behind[0].flush(60)  # the writer's work counts
            c1, r1 = time.process_time(), _redis_cpu_s(server_pid)
            out.setdefault(mode, []).append(((m1 - m0) / n * 1e3, (c1 - c0) / n * 1e3, (r1 - r0) / n * 1e3,
                                             (t1 - t0) / n * 1e3))
            if cache is not None:
                cache.close()
                SessionRegistry().destroy(cache.session, force=True)
    return out


class _Free:
    """A source that costs nothing: 3 KiB arrays made once."""

    def __init__(self, n: int):
        self.values = [np.full(384, i, np.int64) for i in range(n)]

    def __len__(self) -> int:
        return len(self.values)

    def __getitem__(self, i: int):
        return self.values[i]


def single_misses(url: str, n: int, repeats: int, flush) -> dict:
    """Wall µs per ``ds[i]`` miss of a free source: no remote, remote without leases, with."""
    from shmcache import ShmDatasetCache
    from shmcache.cache.registry import SessionRegistry

    src = _Free(n)
    out: dict = {}
    for rep in range(repeats):
        for mode in ("no remote", "remote, no leases", "remote + leases"):
            flush()
            # the baseline: a zero claim timeout takes no lease (NOTE [remote leases]); the node's
            # own claims are taken all the same (uncontended: never waited on)
            os.environ["SHMCACHE_CLAIM_TIMEOUT_S"] = "0" if mode == "remote, no leases" else "10"
            cache = ShmDatasetCache(session=f"single-{len(mode)}-{rep}", remote="" if mode == "no remote" else url)
            ds = cache.wrap(src)
            t0 = time.perf_counter()
            for i in range(n):
                ds[i]
            out.setdefault(mode, []).append((time.perf_counter() - t0) / n * 1e6)
            cache.close()
            SessionRegistry().destroy(cache.session, force=True)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--items", type=int, default=300, help="photos read once per mode (default 300)")
    p.add_argument("--single", type=int, default=3000, help="single ds[i] misses per mode (default 3000)")
    p.add_argument("--repeats", type=int, default=3, help="alternating rounds (default 3)")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis-server not found: apt-get install -y redis-server", file=sys.stderr)
        return 2
    base = Path(tempfile.mkdtemp(prefix="shmcache-bench-miss-"))
    os.environ["SHMCACHE_DIR"] = str(base / "ns")
    server, url, port, password = start_redis(base)
    import redis

    client = redis.Redis(port=port, password=password)
    try:
        print(environment_line(environment()))
        photos = photos_misses(url, server.pid, args.items, args.repeats, client.flushall)
        rows = []
        uncached_total = median([m[1] + m[2] for m in photos["uncached"]])
        for mode, runs in photos.items():
            total = median([m[1] + m[2] for m in runs])
            rows.append([mode, f"{median([m[0] for m in runs]):.3f}",
                         f"{median([m[1] - m[0] for m in runs]):.3f}", f"{median([m[2] for m in runs]):.3f}",
                         f"{total:.3f}", f"{uncached_total / total:.2f}×", f"{median([m[3] for m in runs]):.3f}"])
        print_table(["photos, get_batch of 64", "main thread ms/miss", "other threads", "redis",
                     "CPU in all", "uncached / this", "wall ms/miss"], rows)
        single = single_misses(url, args.single, args.repeats, client.flushall)
        base_us = median(single["remote, no leases"])
        print_table(["ds[i] miss, free 3 KiB source", "µs/miss (median)", "vs remote without leases"],
                    [[mode, f"{median(v):.1f}", f"{median(v) / base_us:.2f}×"] for mode, v in single.items()])
    finally:
        client.close()
        server.kill()
        server.wait()
        shutil.rmtree(base, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
