"""Worker: read a cached dataset through a sampler for a few epochs, one rank of a multi-node job.

Usage: node_affine_epochs.py OUTDIR N EPOCHS {node_affine,distributed}
  ->  OUTDIR/rank-<RANK>.json: per epoch, this node's cache hits and misses so far (local rank 0
      only, read between two barriers), the transform calls of this rank, the indices it read, and
      at the end which of the N keys this node's cache holds.

Started by ``python -m shmcache.launch --nnodes 2 --node-rank K`` with one ``$SHMCACHE_DIR`` per
"node": the sampler takes WORLD_SIZE and RANK from the process group and LOCAL_WORLD_SIZE from the
environment, as in a real job. Every value read is compared with the source.
"""

import json
import os
import sys
from datetime import timedelta

import numpy as np
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from shmcache import NodeAffineSampler, ShmDatasetCache


def source(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, 3072, dtype=np.uint8)  # a 3 KB sample


class Synthetic(Dataset):
    def __init__(self, n: int):
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        self.calls += 1
        return source(i)


def main() -> None:
    out, n, epochs, kind = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=60))
    rank, local_rank = dist.get_rank(), int(os.environ["LOCAL_RANK"])
    data = Synthetic(n)
    cache = ShmDatasetCache()
    ds = cache.wrap(data)
    data.calls = 0  # wrap() reads a few samples to name the cache: count the epochs' reads only
    sampler = NodeAffineSampler(ds) if kind == "node_affine" else DistributedSampler(ds)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, collate_fn=list)
    record = {"rank": rank, "len": len(sampler), "epochs": []}
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        read, calls = [], data.calls
        for batch, idx in zip(loader, _batches(list(sampler), 16)):
            for value, i in zip(batch, idx):
                assert np.array_equal(value, source(i)), f"rank {rank} epoch {epoch}: item {i} differs"
            read += idx
        dist.barrier()  # every rank of every node finished the epoch
        stats = cache.stats() if local_rank == 0 else None
        dist.barrier()  # the stats are read before any rank starts the next epoch
        record["epochs"].append({"read": read, "calls": data.calls - calls,
                                 "hits": stats and stats["hits"], "misses": stats and stats["misses"],
                                 "items_mem": stats and stats["items_mem"]})
    if local_rank == 0:
        record["cached"] = [i for i in range(n) if i in cache]
    cache.close()
    dist.barrier()
    dist.destroy_process_group()
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(record, f)


def _batches(indices, size):
    return [indices[i:i + size] for i in range(0, len(indices), size)]


if __name__ == "__main__":
    main()
