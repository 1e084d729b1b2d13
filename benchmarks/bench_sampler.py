"""Several nodes, one cache each: DistributedSampler vs NodeAffineSampler, epochs 1-3.

    python benchmarks/bench_sampler.py            # ~2 minutes on 2 cores
    python benchmarks/bench_sampler.py --quick    # the synthetic dataset only

2 and 4 simulated nodes x 2 processes on this machine: each node is one
``python -m shmcache.launch --nnodes N --node-rank K --nproc 2`` with a namespace of its own
(``$SHMCACHE_DIR``), as separate machines each have their own ``/dev/shm``; the ranks join one gloo
group over loopback (barriers between epochs, as DDP would sync) and read a cached dataset through a
``DataLoader`` with ``DistributedSampler(shuffle=True)`` or ``NodeAffineSampler`` (set up from the
launcher's environment). Two datasets: synthetic 3 KB samples (4,096) and decode-heavy photo crops
(512: a JPEG decode, crop and resize on every uncached access).

Reported per epoch: the hit rate of the node caches during the epoch (all nodes together), next to
1-(1-1/N)^(e-1), the chance that a DistributedSampler shard lands on a node that read the sample
before; items cached per node (mean, as a share of the dataset); transform calls (samples computed
from the source) of the whole job in the epoch; and the epoch's wall time (slowest rank: indicative
only on a shared machine, where 2N processes share the cores).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXAMPLES = HERE.parent / "examples"
NPROC, EPOCHS = 2, 3
DATASETS = {"synthetic 3 KB": ("synthetic", 4096), "photo crops 64x64": ("photos", 512)}


# --- the worker: one rank of the job (this script, run by the launcher with --worker) --------------


def _dataset(kind: str, n: int):
    import numpy as np
    from torch.utils.data import Dataset

    class Synthetic(Dataset):
        def __len__(self):
            return n

        def __getitem__(self, i):
            return np.random.default_rng(i).integers(0, 256, 3072, dtype=np.uint8), i % 10

    if kind == "synthetic":
        return Synthetic()
    sys.path.insert(0, str(EXAMPLES))
    from datasets import PhotoCrops

    return PhotoCrops(n, size=64)


class Counted:
    """The transform under the cache, counting its calls (the samples computed from the source)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, sample):
        self.calls += 1
        return sample


def worker(out: str, kind: str, n: int, sampler_kind: str) -> None:
    from datetime import timedelta

    import torch.distributed as dist
    from torch.utils.data import DataLoader
    from torch.utils.data.distributed import DistributedSampler

    from shmcache import NodeAffineSampler, ShmDatasetCache

    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=300))
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    counted = Counted()
    cache = ShmDatasetCache()
    ds = cache.wrap(_dataset(kind, n), transform=counted)
    counted.calls = 0  # wrap() computes a few samples to name the cache: count the epochs only
    sampler = NodeAffineSampler(ds) if sampler_kind == "node_affine" else DistributedSampler(ds, shuffle=True)
    loader = DataLoader(ds, batch_size=32, sampler=sampler, collate_fn=list)
    epochs = []
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        calls = counted.calls
        dist.barrier()
        t0 = time.perf_counter()
        for _ in loader:
            pass
        wall = time.perf_counter() - t0
        dist.barrier()  # every rank finished the epoch
        stats = cache.stats() if local_rank == 0 else {}
        dist.barrier()  # stats read before anyone starts the next epoch
        epochs.append({"calls": counted.calls - calls, "wall_s": wall, "hits": stats.get("hits"),
                       "misses": stats.get("misses"), "items_mem": stats.get("items_mem")})
    cache.close()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump({"rank": rank, "local_rank": local_rank, "epochs": epochs}, f)


# --- the driver ------------------------------------------------------------------------------------


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_job(tmp: Path, nodes: int, kind: str, n: int, sampler_kind: str) -> list[dict]:
    """One job of ``nodes`` launchers; the ranks' records."""
    out = tmp / f"{kind}-{nodes}-{sampler_kind}"
    out.mkdir()
    port = str(_free_port())
    procs = []
    try:
        for k in range(nodes):
            env = dict(os.environ, SHMCACHE_DIR=str(out / f"node{k}"), TMPDIR=str(out))
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shmcache.launch", "--nnodes", str(nodes), "--node-rank", str(k),
                 "--nproc", str(NPROC), "--master-addr", "127.0.0.1", "--master-port", port,
                 "--session", "bench", "--destroy-session", __file__, "--worker", str(out), kind, str(n),
                 sampler_kind], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=900)
            if proc.returncode:
                raise SystemExit(f"a node of the {sampler_kind} job failed:\n{err[-3000:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # its workers follow (PR_SET_PDEATHSIG)
                proc.communicate()
    return [json.loads((out / f"rank-{r}.json").read_text()) for r in range(nodes * NPROC)]


def rows_for(label: str, nodes: int, n: int, by_sampler: dict[str, list[dict]]) -> list[tuple]:
    rows = []
    for epoch in range(EPOCHS):
        for name, records in by_sampler.items():
            leads = [r for r in records if r["local_rank"] == 0]  # one per node: its cache's stats
            hits = misses = 0
            for r in leads:
                now, before = r["epochs"][epoch], r["epochs"][epoch - 1] if epoch else {"hits": 0, "misses": 0}
                hits += now["hits"] - before["hits"]
                misses += now["misses"] - before["misses"]
            cached = sum(r["epochs"][epoch]["items_mem"] for r in leads) / nodes / n
            calls = sum(r["epochs"][epoch]["calls"] for r in records)
            wall = max(r["epochs"][epoch]["wall_s"] for r in records)
            analytic = 1 - (1 - 1 / nodes) ** epoch
            rows.append((label, f"{nodes}x{NPROC}", str(epoch + 1), name, f"{hits / max(1, hits + misses):.1%}",
                         f"{analytic:.1%}", f"{cached:.1%}", f"{calls:,}", f"{wall:.2f}"))
    return rows


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        out, kind, n, sampler_kind = argv[1:5]
        worker(out, kind, int(n), sampler_kind)
        return 0
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="the synthetic dataset only")
    args = p.parse_args(argv)
    sys.path.insert(0, str(HERE))
    from _common import environment, environment_line, print_table

    import shmcache

    print(environment_line(environment({"shmcache": shmcache.__version__})))
    datasets = dict(list(DATASETS.items())[:1]) if args.quick else DATASETS
    rows: list[tuple] = []
    totals: list[str] = []
    with tempfile.TemporaryDirectory(prefix="shmcache-bench-sampler-") as tmp:
        for label, (kind, n) in datasets.items():
            for nodes in (2, 4):
                by_sampler = {name: run_job(Path(tmp), nodes, kind, n, sampler_kind)
                              for name, sampler_kind in (("DistributedSampler", "distributed"),
                                                         ("NodeAffineSampler", "node_affine"))}
                rows += rows_for(f"{label} ({n:,})", nodes, n, by_sampler)
                calls = {name: sum(e["calls"] for r in recs for e in r["epochs"])
                         for name, recs in by_sampler.items()}
                d, a = calls["DistributedSampler"], calls["NodeAffineSampler"]
                totals.append(f"{label}, {nodes}x{NPROC}: transform calls in {EPOCHS} epochs: "
                              f"DistributedSampler {d:,}, NodeAffineSampler {a:,} ({d / max(1, a):.2f}x fewer)")
    print(f"{EPOCHS} epochs, batches of 32 through a DataLoader, caches wrapped with transform= (counted)")
    print_table(("dataset", "nodes x procs", "epoch", "sampler", "hit rate", "1-(1-1/N)^(e-1)",
                 "cached per node", "transform calls", "epoch s"), rows)
    print("\n".join(totals))
    return 0


if __name__ == "__main__":
    sys.exit(main())
