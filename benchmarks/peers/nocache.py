"""No cache: a plain ``torch.utils.data.DataLoader`` over the source dataset.

Every epoch generates (or JPEG-decodes, crops and resizes) every item again: batches of 256 from the
reader's shard in random order, ``num_workers=0`` (each reader process is one training process; with
workers the same CPU work moves to other processes of the same 2 cores).
"""

from __future__ import annotations

import time

import numpy as np

from ._base import Memory, Peer, ReadPath
from ._runner import CHUNK

__all__ = ["NoCache", "open_reader"]


class NoCache(Peer):
    name = "no cache"
    module = __name__
    paths = (ReadPath("dataloader", "DataLoader(bs=256, num_workers=0)", True),)

    def __init__(self) -> None:
        self.workload = None

    def version(self) -> str:
        import torch

        return f"torch {torch.__version__}"

    def fill(self, workload) -> None:
        """Nothing to fill; one pass over the source instead, the cost every other fill includes."""
        self.workload = workload
        src = workload.source()
        for i in range(workload.n_items):
            src[i]

    def spec(self) -> dict:
        return {"workload": self.workload}

    def memory(self) -> Memory:
        return Memory(0, "—", "nothing kept; fill column = one pass over the source")


class _Reader:
    def __init__(self, spec: dict):
        self.source = spec["workload"].source()

    def epoch(self, indices: np.ndarray) -> list[float]:
        from torch.utils.data import DataLoader

        loader = DataLoader(self.source, batch_size=CHUNK, sampler=indices.tolist(), num_workers=0)
        out, t = [], time.perf_counter()
        for _batch in loader:
            now = time.perf_counter()
            out.append(now - t)
            t = now
        return out

    def close(self) -> None:
        pass


def open_reader(spec: dict, path: str, rank: int, world: int, port: int) -> _Reader:
    return _Reader(spec)
