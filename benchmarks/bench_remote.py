"""Several nodes, one cache: the Redis remote tier against node-local caches, the uncached source
and Bagua's pattern on the same Redis, simulated on this machine.

    python benchmarks/bench_remote.py            # ~5-10 minutes on 2 cores
    python benchmarks/bench_remote.py --quick    # ~1-2 minutes
    python benchmarks/bench_remote.py --workloads photos --nodes 2 --items 400   # the first epoch

A node is a namespace of its own (``$SHMCACHE_DIR``: its own shared memory) with 2 processes
(ranks); the job's ranks are forked from this process (torch already imported), each with its
node's namespace. One ``redis-server`` on 127.0.0.1 (a password, ``--save '' --appendonly no``)
serves every job. Workloads (benchmarks/peers/_workloads.py): ``cifar`` (3 KB random images),
``imagenet`` (150 KB random images), ``photos`` (JPEG decode + crop + resize to 224x224, the
decode-heavy pipeline). Each rank reads its ``DistributedSampler``-style shard of a permutation
drawn per epoch over all ranks, in collated batches of 64 as a DataLoader's (``ds.get_batch``:
the vectorised gather when the batch is in shared memory, else one batched round trip to Redis
for its misses; the uncached source and Bagua's reads go through ``default_collate``); ranks wait
for each other between epochs.

Rows, for 2 and 4 nodes:

- ``calls/item (wrap)``: transform calls of the whole job over epochs 1-3, per dataset item, and
  in brackets the part that is the samples each rank's ``wrap()`` reads to fingerprint the
  dataset (a few per process, whatever the size): with the remote tier (target <= 1.05),
  node-local caches only (each node computes what it has not seen), uncached (3.0).
- ``epoch N items/s``: the job's items per second in epoch N: the items over the span from the
  first rank's start to the last rank's end (CLOCK_MONOTONIC is system-wide).
- ``warm``: an epoch after every node holds the whole dataset (``warmup()``, which reads what is
  missing from Redis), against Bagua's pattern on the same Redis (one ``GET`` + ``pickle.loads``
  per sample, every epoch; target >= 10x); the median of 3 epochs each.
- ``other node``: a fresh node (2 ranks) reading the whole dataset that other nodes computed (from
  Redis) against the same node computing it from the source (target >= 5x on ``photos``).
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import pickle
import queue
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (  # noqa: E402
    environment,
    environment_line,
    fmt_rate,
    median,
    print_table,
    start_redis,
)
from peers._workloads import make_workload  # noqa: E402

BATCH = 64
EPOCHS = 3
REPEATS = 3  # warm epochs (shmcache and Bagua's pattern): the median of 3
PROCS_PER_NODE = 2


class Counted:
    """The workload's source; counts its computations in this process (``_calls``: a private
    number, which the fingerprint leaves out, so every rank names the same cache)."""

    def __init__(self, source):
        self.source = source
        self._calls = 0

    @property
    def calls(self) -> int:
        return self._calls

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, i: int):
        self._calls += 1
        return self.source[i]


def shard(n: int, epoch: int, rank: int, world: int) -> np.ndarray:
    """DistributedSampler(shuffle=True, seed=0): a permutation per epoch, every world-th index."""
    return np.random.default_rng((0, epoch)).permutation(n)[rank::world]


# --- one rank (a forked child) ------------------------------------------------------------------
# Every timed pass returns its (start, end) on CLOCK_MONOTONIC, which is system-wide: the job's
# rate is the items over the span from the first start to the last end (ranks outnumber cores, so
# a rank's own time would leave out the time it waited for a core).

def _pass(read, idx: np.ndarray) -> tuple[float, float]:
    t0 = time.monotonic()
    for lo in range(0, len(idx), BATCH):
        read(idx[lo:lo + BATCH].tolist())
    return t0, time.monotonic()


def rank_main(args: tuple, barrier, results) -> None:
    (mode, workload, node_dir, rank, world, url, warm) = args
    os.environ["SHMCACHE_DIR"] = node_dir
    import torch
    from torch.utils.data import default_collate

    torch.set_num_threads(1)
    from shmcache import ShmDatasetCache

    src = Counted(workload.source())
    n = len(src)
    compute = lambda keys: default_collate([src[i] for i in keys])  # noqa: E731 - the uncached source
    cache = ds = None
    read = compute
    if mode != "uncached":
        cache = ShmDatasetCache(session="bench", remote=url if mode == "remote" else "")
        ds = cache.wrap(src)
        read = ds.get_batch  # collated, as a DataLoader's batch: one round trip to Redis for its misses
    wrap_calls = src.calls  # the samples wrap() reads to fingerprint the dataset
    spans, warm_spans = [], []
    if warm is None:  # one pass over the whole dataset, split over the node's ranks (other_node)
        barrier.wait()
        spans.append(_pass(read, np.arange(n)[rank::world]))
    else:
        for epoch in range(EPOCHS):
            barrier.wait()
            spans.append(_pass(read, shard(n, epoch, rank, world)))
            if mode == "remote":
                cache.store.behind[0].flush(60)  # the next epoch's readers find it in Redis
    calls = src.calls
    if warm:
        cache.warmup(ds, progress=False)  # the rest of the dataset, from Redis
        for r in range(REPEATS):
            barrier.wait()
            warm_spans.append(_pass(read, shard(n, EPOCHS + r, rank, world)))
    if cache is not None:
        cache.close()
    results.put((rank, calls, wrap_calls, spans, warm_spans))


def bagua_rank(args: tuple, barrier, results) -> None:
    """Bagua's CachedDataset reads: one GET + pickle.loads per sample, every epoch."""
    (n, port, password, rank, world) = args
    import redis
    import torch
    from torch.utils.data import default_collate

    torch.set_num_threads(1)  # as every rank: more threads than cores would slow the collate
    client = redis.Redis(port=port, password=password)
    read = lambda keys: default_collate([pickle.loads(client.get(b"bagua:%d" % i)) for i in keys])  # noqa: E731
    spans = []
    for r in range(REPEATS):
        barrier.wait()
        spans.append(_pass(read, shard(n, EPOCHS + r, rank, world)))
    client.close()
    results.put((rank, 0, 0, [], spans))


def run_ranks(target, arglist: list) -> list:
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(len(arglist))
    results = ctx.Queue()
    procs = [ctx.Process(target=target, args=(a, barrier, results)) for a in arglist]
    for p in procs:
        p.start()
    out = []
    try:
        while len(out) < len(procs):
            try:
                out.append(results.get(timeout=1.0))
            except queue.Empty:
                if any(p.exitcode not in (None, 0) for p in procs):  # a rank died: stop the job
                    raise RuntimeError("a rank failed (its traceback is above)") from None
    finally:
        for p in procs:
            if p.exitcode is None and len(out) < len(procs):
                p.kill()
    for p in procs:
        p.join(60)
        if p.exitcode != 0:
            raise RuntimeError(f"a rank failed (exit code {p.exitcode})")
    return out


def _rate(n: int, spans: list[tuple[float, float]]) -> float:
    return n / (max(e for _, e in spans) - min(s for s, _ in spans))


def _rates(n: int, out: list, field: int, count: int) -> list[float]:
    """Items/s of each of ``count`` passes of the job (ranks' spans of pass k together)."""
    return [_rate(n, [o[field][k] for o in out]) for k in range(count)]


def job(mode: str, workload, nodes: int, base: Path, url: str, warm: bool = False) -> dict:
    """One job of ``nodes`` x 2 ranks; returns calls per item, epoch items/s, warm items/s."""
    world = nodes * PROCS_PER_NODE
    dirs = [str(base / f"{mode}-{nodes}-{secrets.token_hex(3)}-node{k}") for k in range(nodes)]
    out = run_ranks(rank_main, [(mode, workload, dirs[r // PROCS_PER_NODE], r, world, url, warm)
                                for r in range(world)])
    _destroy(dirs)
    n = workload.n_items
    return {"calls": sum(o[1] for o in out) / n, "wrap_calls": sum(o[2] for o in out) / n,
            "epochs": _rates(n, out, 3, EPOCHS),
            "warm": median(_rates(n, out, 4, REPEATS)) if warm else None}


def _destroy(dirs: list[str]) -> None:
    from shmcache.base.namespace import namespace
    from shmcache.cache.registry import SessionRegistry

    for d in dirs:
        reg = SessionRegistry(namespace(d))
        for info in reg.list():
            reg.destroy(info.name, force=True)


def bagua(workload, nodes: int, port: int, password: str) -> float:
    import redis

    client = redis.Redis(port=port, password=password)
    src, batch = workload.source(), {}
    for i in range(workload.n_items):  # filled as Bagua's writer does (MSET of 20), not timed
        batch[b"bagua:%d" % i] = pickle.dumps(src[i], protocol=5)
        if len(batch) == 20:
            client.mset(batch)
            batch = {}
    if batch:
        client.mset(batch)
    client.close()
    world = nodes * PROCS_PER_NODE
    out = run_ranks(bagua_rank, [(workload.n_items, port, password, r, world) for r in range(world)])
    return median(_rates(workload.n_items, out, 4, REPEATS))


def other_node(workload, base: Path, url: str) -> tuple[float, float]:
    """A fresh node (2 ranks) reading the whole dataset from Redis vs computing it (items/s)."""
    rates = []
    for mode in ("remote", "uncached"):
        d = str(base / f"fresh-{mode}-{secrets.token_hex(3)}")
        out = run_ranks(rank_main, [(mode, workload, d, r, PROCS_PER_NODE, url, None)
                                    for r in range(PROCS_PER_NODE)])
        _destroy([d])
        rates.append(_rates(workload.n_items, out, 3, 1)[0])
    return rates[0], rates[1]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small datasets: a minute or two")
    p.add_argument("--nodes", default="2,4", help="node counts to simulate (default 2,4)")
    p.add_argument("--items", type=int, default=0, help="items of each workload (default: by --quick)")
    p.add_argument("--workloads", default="cifar,imagenet,photos",
                   help="which workloads, comma-separated (default all: cifar,imagenet,photos)")
    args = p.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis-server not found: apt-get install -y redis-server", file=sys.stderr)
        return 2
    sizes = {"cifar": 1024 if args.quick else 8192, "imagenet": 96 if args.quick else 1024,
             "photos": 96 if args.quick else 1024}
    if args.items:
        sizes = dict.fromkeys(sizes, args.items)
    base = Path(tempfile.mkdtemp(prefix="shmcache-bench-remote-"))
    server, url, port, password = start_redis(base)
    try:
        print(environment_line(environment({"redis": subprocess.run(
            ["redis-server", "--version"], capture_output=True, text=True).stdout.split()[2]})))
        rows = []
        for name, n in sizes.items():
            if name not in args.workloads.split(","):
                continue
            workload = make_workload(name, n)
            for nodes in [int(x) for x in args.nodes.split(",")]:
                _flushall(port, password)
                remote = job("remote", workload, nodes, base, url, warm=True)
                fresh, computed = other_node(workload, base, url)
                local = job("local", workload, nodes, base, url)
                uncached = job("uncached", workload, nodes, base, url)
                bag = bagua(workload, nodes, port, password)
                for label, r in (("remote", remote), ("node-local", local), ("uncached", uncached)):
                    rows.append([name, str(n), str(nodes), label,
                                 f"{r['calls']:.3f} ({r['wrap_calls']:.3f})",
                                 *[fmt_rate(x) for x in r["epochs"]],
                                 fmt_rate(r["warm"]) if r["warm"] else "", "", ""])
                rows[-3][9] = f"{_ratio(remote['warm'] / bag)} Bagua"
                rows[-3][10] = f"{fmt_rate(fresh)} = {_ratio(fresh / computed)} source"
                rows.append([name, str(n), str(nodes), "Bagua (GET+pickle)", "", "", "", "",
                             fmt_rate(bag), "", f"source: {fmt_rate(computed)}"])
                _print(rows[-4:])
        print()
        print_table(["workload", "items", "nodes", "mode", "calls/item (wrap)", "epoch 1 items/s", "epoch 2",
                     "epoch 3", "warm items/s", "warm vs", "other node (epoch 2)"], rows)
    finally:
        server.kill()
        server.wait()
        shutil.rmtree(base, ignore_errors=True)
    return 0


def _ratio(x: float) -> str:
    return f"{x:.3g}×"


def _print(rows: list) -> None:
    for r in rows:
        print("  ".join(r), flush=True)



def _flushall(port: int, password: str) -> None:
    import redis

    redis.Redis(port=port, password=password).flushall()


if __name__ == "__main__":
    sys.exit(main())
