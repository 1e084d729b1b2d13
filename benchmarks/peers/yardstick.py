"""The memcpy yardstick: the same bytes in one flat file on /dev/shm, read with plain numpy.

Not a cache anyone would ship (no keys, no variable sizes, no crash safety) but the ceiling a
shared-memory cache can approach: every reader maps the file and copies

- ``memcpy``: its shard's share of the items as one contiguous bulk copy (``np.copyto``);
- ``gather``: its shard's items in random order, in batches of 256, with one ``np.take`` per batch
  into a preallocated buffer (plus the labels): what a perfect batch gather would cost.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np

from . import _runner
from ._base import Memory, Peer, ReadPath
from ._workloads import Workload

__all__ = ["Yardstick", "open_reader"]


class Yardstick(Peer):
    name = "memcpy yardstick"
    module = __name__
    paths = (ReadPath("memcpy", "bulk np.copyto of the shard", True, chunked=False),
             ReadPath("gather", "np.take ×256, random order", True))

    def __init__(self) -> None:
        self.path: str | None = None
        self.workload: Workload | None = None

    def version(self) -> str:
        return f"numpy {np.__version__}"

    def fill(self, workload: Workload) -> None:
        self.workload = workload
        fd, self.path = tempfile.mkstemp(prefix="shmcache-compare-yardstick-", dir="/dev/shm")
        os.close(fd)
        src = workload.source()
        images = np.lib.format.open_memmap(self.path, mode="w+", dtype=np.uint8,
                                           shape=(workload.n_items, *workload.shape))
        labels = np.empty(workload.n_items, dtype=np.int64)
        for i in range(workload.n_items):
            images[i], labels[i] = src[i]
        images.flush()
        np.save(self.path + ".labels.npy", labels)
        del images

    def spec(self) -> dict:
        return {"path": self.path}

    def memory(self) -> Memory:
        size = os.stat(self.path).st_blocks * 512 if self.path else None
        return Memory(size, "shm")

    def close(self) -> None:
        for p in (self.path, self.path and self.path + ".labels.npy"):
            if p and os.path.exists(p):
                os.unlink(p)
        self.path = None


class _Reader:
    def __init__(self, spec: dict, path: str, rank: int, world: int):
        self.images = np.load(spec["path"], mmap_mode="r")
        self.labels = np.load(spec["path"] + ".labels.npy")
        self.path, self.rank = path, rank
        shard = -(-len(self.images) // world)
        size = shard if path == "memcpy" else _runner.CHUNK
        self.out = np.ones((size, *self.images.shape[1:]), dtype=np.uint8)  # touched: no faults timed
        self.out_labels = np.ones(size, dtype=np.int64)
        self.images[:].sum(dtype=np.uint64)  # fault the mapping in once, as a warm cache would be

    def epoch(self, indices: np.ndarray) -> list[float]:
        if self.path == "memcpy":
            return _runner.timed_chunks(self._bulk, indices, size=len(indices))
        return _runner.timed_chunks(self._gather, indices)

    def _bulk(self, indices: np.ndarray) -> None:
        n = len(indices)
        start = min(self.rank * n, len(self.images) - n)
        np.copyto(self.out[:n], self.images[start : start + n])
        np.copyto(self.out_labels[:n], self.labels[start : start + n])

    def _gather(self, indices: np.ndarray) -> None:
        n = len(indices)
        # mode="clip": with the default mode="raise" numpy buffers ``out`` (a second copy, ~5× slower)
        np.take(self.images, indices, axis=0, out=self.out[:n], mode="clip")
        np.take(self.labels, indices, out=self.out_labels[:n], mode="clip")

    def sample(self, i: int):
        return self.images[i], self.labels[i]

    def close(self) -> None:
        del self.images


def open_reader(spec: dict, path: str, rank: int, world: int, port: int) -> _Reader:
    return _Reader(spec, path, rank, world)
