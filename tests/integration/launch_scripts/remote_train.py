"""A tiny training job over a counting dataset, behind the launcher's ``--remote``.

Usage: remote_train.py OUTDIR N

Every rank joins the job's gloo group (MASTER_ADDR/MASTER_PORT, as a training would), wraps a
dataset of N items whose every computation appends its index to OUTDIR/calls (O_APPEND: one
write per line, lines of all processes of all nodes never interleave), then:
    epoch 1  its own shard (rank::world_size): every item is computed once in the job;
             its values are flushed to Redis (the write-behind queue), then a barrier;
    epoch 2  every item, split over the ranks of its node (local_rank::local_world_size): each
             node reads the whole dataset, its own shard from shared memory, the other nodes'
             from Redis - nothing is computed again.
It checks every value against the source and writes OUTDIR/train-<RANK>.json: the indices it got
wrong, how many computations wrap() made here (it reads a few samples to fingerprint the
dataset), the cache's stats, and $SHMCACHE_REMOTE.
"""

import json
import os
import sys

import numpy as np
import torch.distributed as dist

from shmcache import ShmDatasetCache

LOCAL_CALLS = 0


def expected(i: int):
    return np.random.default_rng(i).integers(0, 255, (8, 8, 3), dtype=np.uint8), i % 10


class Counted:
    def __init__(self, n: int, calls: str):
        self.n, self.calls = n, calls

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        global LOCAL_CALLS
        LOCAL_CALLS += 1
        fd = os.open(self.calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, b"%d\n" % i)
        finally:
            os.close(fd)
        return expected(i)


def same(got, i: int) -> bool:
    img, label = expected(i)
    return np.array_equal(np.asarray(got[0]), img) and int(got[1]) == label


def main() -> None:
    out_dir, n = sys.argv[1], int(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    dist.init_process_group("gloo")
    cache = ShmDatasetCache(name="counted")  # remote=: $SHMCACHE_REMOTE, from the launcher
    ds = cache.wrap(Counted(n, os.path.join(out_dir, "calls")))
    in_wrap = LOCAL_CALLS
    wrong = [i for i in range(rank, n, world) if not same(ds[i], i)]
    for tier in getattr(cache.store, "behind", ()):
        tier.flush(30)  # epoch 1's values are in Redis before any node looks for them
    dist.barrier()
    wrong += [i for i in range(local_rank, n, local_world) if not same(ds[i], i)]
    dist.barrier()  # nobody closes (and no launcher stops its Redis) while others still read
    record = {"wrong": wrong, "calls_in_wrap": in_wrap, "stats": cache.stats(),
              "url": os.environ.get("SHMCACHE_REMOTE")}
    cache.close()
    dist.destroy_process_group()
    with open(os.path.join(out_dir, f"train-{rank}.json"), "w") as f:
        json.dump(record, f, default=str)


if __name__ == "__main__":
    main()
