"""shmcache, used the way its README says: wrap the dataset, warm up, read.

The parent opens ``ShmDatasetCache(session=..., name=..., size=MB)`` in a private namespace
(``$SHMCACHE_DIR`` is a temporary folder set by ``compare.py``), wraps the source dataset and fills
it with ``cache.warmup(ds, progress=False)``. Each reader process opens the same cache by session
and name (as another training process would), wraps the same source, and reads

- ``getitem``: ``ds[i]`` item by item, in random order (default ``copy=True``: private copies);
- ``batch``: ``cache.get_batch(keys)`` for batches of 256 random keys: a collated
  ``(images, labels)`` tuple of stacked tensors, gathered without a Python loop per item;
- ``batch_out``: the same into one preallocated ``(images, labels)`` pair reused for every batch
  (``get_batch(keys, out=...)``, what a PrefetchRing slot does). A fresh batch of more than 32 MiB
  (ImageNet-sized: 256 × 147 KiB) is above glibc's largest mmap threshold, so every allocating path
  pays fresh page faults per batch; reused buffers do not.

Memory is what the cache's segments really occupy on /dev/shm (allocated pages). At the end the
parent closes the cache and destroys the session.
"""

from __future__ import annotations

import os

import numpy as np

from . import _runner
from ._base import Memory, Peer, ReadPath

__all__ = ["ShmCache", "open_reader"]


class ShmCache(Peer):
    name = "shmcache"
    module = __name__
    paths = (ReadPath("getitem", "ds[i] per item", False), ReadPath("batch", "get_batch ×256", True),
             ReadPath("batch_out", "get_batch ×256, out= reused buffers", True))

    def __init__(self) -> None:
        self.cache = None
        self.session = f"bench-{os.getpid()}"
        self.cache_name = ""
        self.size_mb = 0
        self.workload = None

    def skip_reason(self) -> str | None:
        try:
            from shmcache import ShmDatasetCache  # noqa: F401
        except Exception as e:  # noqa: BLE001 - anything: the package is not usable yet
            return f"not available yet (from shmcache import ShmDatasetCache: {type(e).__name__}: {e})"
        return None

    def version(self) -> str:
        import shmcache

        return f"{getattr(shmcache, '__version__', '?')} ({_git_state(os.path.dirname(shmcache.__file__))})"

    def fill(self, workload) -> None:
        from shmcache import ShmDatasetCache

        self.workload = workload
        self.cache_name = f"compare-{workload.name}-{workload.n_items}"
        self.size_mb = int(workload.payload_bytes * 1.25) // (1 << 20) + 64
        self.cache = ShmDatasetCache(session=self.session, name=self.cache_name, size=self.size_mb)
        ds = self.cache.wrap(workload.source())
        self.cache.warmup(ds, progress=False)

    def spec(self) -> dict:
        return {"session": self.session, "name": self.cache_name, "size_mb": self.size_mb,
                "workload": self.workload}

    def memory(self) -> Memory:
        st = self.cache.stats()
        shm = st.get("shm_bytes")
        if shm is None:
            shm = _segment_bytes(self.session)
        note = (f"bytes_mem {st['bytes_mem'] >> 20} MiB, {st['items_mem']} items, "
                f"capacity {st['capacity_bytes'] >> 20} MiB")
        return Memory(shm, "shm", note)

    def stats(self) -> dict:
        return self.cache.stats() if self.cache is not None else {}

    def close(self) -> None:
        from shmcache.cache.registry import SessionRegistry

        if self.cache is not None:
            self.cache.close()
            self.cache = None
            SessionRegistry().destroy(self.session, force=True)


def _git_state(package_dir: str) -> str:
    """``git <commit>`` of the measured package, ``+dirty`` when its files differ from it (read-only
    git commands: ``diff-index`` does not even refresh the index)."""
    import subprocess

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", "-C", package_dir, *args], capture_output=True, text=True)

    head = git("rev-parse", "--short", "HEAD")
    if head.returncode != 0:
        return "not a git checkout"
    dirty = git("diff-index", "--quiet", "HEAD", "--", ".").returncode != 0
    return f"git {head.stdout.strip()}{'+dirty' if dirty else ''}"


def _segment_bytes(session: str) -> int:
    from shmcache.base.namespace import namespace
    from shmcache.cache.registry import SessionRegistry

    ns, prefix = namespace(), SessionRegistry().segment_prefix(session)
    return sum(os.stat(ns.shm_path(n)).st_blocks * 512 for n in ns.owned_segments() if n.startswith(prefix))


class _Reader:
    def __init__(self, spec: dict, path: str):
        from shmcache import ShmDatasetCache

        self.cache = ShmDatasetCache(session=spec["session"], name=spec["name"], size=spec["size_mb"])
        self.ds = self.cache.wrap(spec["workload"].source())
        self.path = path
        self.out = _batch_buffers(spec["workload"]) if path == "batch_out" else None

    def epoch(self, indices: np.ndarray) -> list[float]:
        read = {"getitem": self._getitem, "batch": self._batch, "batch_out": self._batch_out}[self.path]
        return _runner.timed_chunks(read, indices)

    def _getitem(self, indices: np.ndarray) -> None:
        ds = self.ds
        for i in indices:
            ds[int(i)]

    def _batch(self, indices: np.ndarray) -> None:
        self.cache.get_batch(indices.tolist())

    def _batch_out(self, indices: np.ndarray) -> None:
        n = len(indices)
        self.cache.get_batch(indices.tolist(), out=(self.out[0][:n], self.out[1][:n]))

    def sample(self, i: int):
        if self.path == "getitem":
            return self.ds[i]
        return self.cache.get_batch([i])

    def close(self) -> None:
        self.cache.close()


def _batch_buffers(workload):
    """One (images, labels) pair of CHUNK items, touched once (a prefetch slot allocated up front)."""
    import torch

    return (torch.ones((_runner.CHUNK, *workload.shape), dtype=torch.uint8),
            torch.ones(_runner.CHUNK, dtype=torch.int64))


def open_reader(spec: dict, path: str, rank: int, world: int, port: int) -> _Reader:
    return _Reader(spec, path)
