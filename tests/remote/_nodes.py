"""A dataset that counts its computations across processes, and a simulated node of a job.

``Counted`` appends one line per computed item to a file opened with O_APPEND (one write() per
line: lines of several processes never interleave), so a test counts the transform's calls of
every node. ``python _nodes.py ...`` runs one node: its own ``$SHMCACHE_DIR`` (its shared
memory), the job's Redis, an epoch over its shard, a barrier with the other nodes, then an epoch
over another node's shard (half item by item, half as batches), checking every value.

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np


def expected(i: int):
    rng = np.random.default_rng(i)
    return rng.integers(0, 255, (16, 16, 3), dtype=np.uint8), i % 10


class Counted:
    """Item i is ``expected(i)``; each computation appends ``i`` to ``calls`` (if given)."""

    def __init__(self, n: int, calls: str | None = None):
        self.n, self.calls = n, calls

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.calls:
            fd = os.open(self.calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
            try:
                os.write(fd, b"%d\n" % i)
            finally:
                os.close(fd)
        return expected(i)


def calls_of(path) -> list[int]:
    try:
        with open(path) as f:
            return [int(line) for line in f]
    except FileNotFoundError:
        return []


def same(got, i: int) -> bool:
    img, label = expected(i)
    got_img, got_label = got
    return np.array_equal(np.asarray(got_img), img) and int(got_label) == label


def _barrier(d: str, name: str, n: int, timeout_s: float = 60) -> None:
    open(os.path.join(d, f"{name}.{os.getpid()}"), "w").close()
    deadline = time.monotonic() + timeout_s
    while len([f for f in os.listdir(d) if f.startswith(name + ".")]) < n:
        if time.monotonic() > deadline:
            raise TimeoutError(f"barrier {name}: not every node arrived")
        time.sleep(0.02)


def node(url: str, rank: int, nnodes: int, n: int, calls: str, barrier: str) -> dict:
    from shmcache import ShmDatasetCache
    from shmcache.cache.registry import SessionRegistry

    cache = ShmDatasetCache(session="job", remote=url)
    ds = cache.wrap(Counted(n, calls))
    wrong = [i for i in range(rank, n, nnodes) if not same(ds[i], i)]  # epoch 1: my shard
    cache.store.behind[0].flush(30)  # what I computed is in Redis before the others look
    _barrier(barrier, "e1", nnodes)
    other = list(range((rank + 1) % nnodes, n, nnodes))  # epoch 2: another node's shard
    half = len(other) // 2
    wrong += [i for i in other[:half] if not same(ds[i], i)]
    for lo in range(half, len(other), 16):
        keys = other[lo:lo + 16]
        batch = ds.__getitems__(keys)
        wrong += [k for k, v in zip(keys, batch) if not same(v, k)]
    stats = cache.stats()
    cache.close()
    SessionRegistry().destroy("job", force=True)
    return {"wrong": wrong, "stats": stats}


if __name__ == "__main__":
    url, rank, nnodes, n, calls, barrier = sys.argv[1:7]
    print(json.dumps(node(url, int(rank), int(nnodes), int(n), calls, barrier)))
