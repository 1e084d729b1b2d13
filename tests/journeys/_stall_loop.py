"""A training loop of the stall tests, run as its own process: ``python _stall_loop.py MODE
SOURCE_SLEEP_S STEP_SLEEP_S`` reads a wrapped dataset of 32 items (each computed in SOURCE_SLEEP_S)
in batches of 4 and takes STEP_SLEEP_S per step; MODE says how the loop reads: ``timed`` (a
DataLoader through shmcache.timed), ``ring`` (PrefetchRing over the DataLoader), ``ring_cache``
(PrefetchRing.from_cache), ``sink`` (sink_loop over the DataLoader), ``plain`` (the DataLoader
alone: not counted). Prints the cache's stats() as JSON."""

from __future__ import annotations

import json
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import shmcache
from shmcache import PrefetchRing, ShmDatasetCache, sink_loop


class Slow(Dataset):
    def __init__(self, sleep_s: float):
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int):
        time.sleep(self.sleep_s)
        return torch.full((4,), float(i))

    def __repr__(self) -> str:
        return "Slow()"


def main() -> None:
    mode, source_s, step_s = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    cache = ShmDatasetCache(session="stall", name="data", size=16)
    ds = cache.wrap(Slow(source_s), fingerprint="slow-v1")
    loader = DataLoader(ds, batch_size=4)

    def step(batch):
        time.sleep(step_s)
        return batch.sum()

    if mode == "timed":
        for batch in shmcache.timed(loader):
            step(batch)
    elif mode == "ring":
        with PrefetchRing(loader, device="cpu") as ring:
            for batch in ring:
                step(batch)
    elif mode == "ring_cache":
        keys = [list(range(i, i + 4)) for i in range(0, 32, 4)]
        with PrefetchRing.from_cache(cache, keys, device="cpu", fn=ds.__getitem__) as ring:
            for batch in ring:
                step(batch)
    elif mode == "sink":
        sink_loop(step, loader, epochs=1)
    elif mode == "plain":
        for batch in loader:
            step(batch)
    print(json.dumps(cache.stats()))
    cache.close()


if __name__ == "__main__":
    main()
