"""One ``torch.save`` file per sample, the way torch_xla's ``CachedDataset`` caches a dataset.

Sample i is saved as ``(torch.from_numpy(image), label)`` to ``<root>/<i // 1000>/<i>.pt`` (at most
1000 files per folder) and read back with ``torch.load(path, weights_only=True)`` (a tensor and an
int need nothing unsafe). Two roots: a temporary folder on ``/dev/shm`` (tmpfs: RAM) and one under
``/tmp`` on disk. The disk variant reads through a warm page cache (the files were just written and
the benchmark never drops caches machine-wide), so it measures the file-per-sample overhead of
open + unpickle, not the disk.
"""

from __future__ import annotations

import os
import shutil
import tempfile

import numpy as np

from . import _runner
from ._base import Memory, Peer, ReadPath

__all__ = ["TorchSave", "open_reader"]

FILES_PER_DIR = 1000


def _path(root: str, i: int) -> str:
    return f"{root}/{i // FILES_PER_DIR:05d}/{i}.pt"


class TorchSave(Peer):
    module = __name__
    paths = (ReadPath("load", "torch.load per item", False),)

    def __init__(self, where: str):
        assert where in ("shm", "disk"), where
        self.where = where
        self.name = f"torch.save files ({'/dev/shm' if where == 'shm' else 'disk'})"
        self.root: str | None = None

    def version(self) -> str:
        import torch

        return f"torch {torch.__version__}"

    def fill(self, workload) -> None:
        import torch

        parent = "/dev/shm" if self.where == "shm" else tempfile.gettempdir()
        self.root = tempfile.mkdtemp(prefix="shmcache-compare-torchsave-", dir=parent)
        src = workload.source()
        for i in range(workload.n_items):
            if i % FILES_PER_DIR == 0:
                os.makedirs(os.path.dirname(_path(self.root, i)))
            image, label = src[i]
            torch.save((torch.from_numpy(image), label), _path(self.root, i))

    def spec(self) -> dict:
        return {"root": self.root}

    def memory(self) -> Memory:
        from _common import allocated_bytes

        return Memory(allocated_bytes(self.root), self.where, "allocated blocks of the files")

    def close(self) -> None:
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


class _Reader:
    def __init__(self, spec: dict):
        self.root = spec["root"]

    def epoch(self, indices: np.ndarray) -> list[float]:
        return _runner.timed_chunks(self._load, indices)

    def _load(self, indices: np.ndarray) -> None:
        import torch

        for i in indices:
            torch.load(_path(self.root, int(i)), weights_only=True)

    def sample(self, i: int):
        import torch

        return torch.load(_path(self.root, i), weights_only=True)

    def close(self) -> None:
        pass


def open_reader(spec: dict, path: str, rank: int, world: int, port: int) -> _Reader:
    return _Reader(spec)
