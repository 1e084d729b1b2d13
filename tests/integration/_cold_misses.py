"""Datasets and processes of tests/integration/test_cold_misses.py, importable by the processes
those tests start (found through ``sys.path``, as _workers and _claims are).

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

# set in a holder process only (the dataset itself stays the same object everywhere: one fingerprint)
ENV_HOLD = "ADV_HOLD_KEYS"  # comma-separated keys whose computation blocks
ENV_READY = "ADV_HOLD_READY"  # a file made once the blocking computation began (its claims held)
ENV_GATES = "ADV_GATES"  # a directory: key k's computation makes ready-k there, then waits for go-k


def _hold(indices) -> None:
    """Block (a slow sample, a stopped process) if $ADV_HOLD_KEYS names one of ``indices``."""
    hold = {int(k) for k in os.environ.get(ENV_HOLD, "").split(",") if k}
    if hold & {int(i) for i in indices}:
        Path(os.environ[ENV_READY]).touch()
        time.sleep(120)  # killed by the test long before


class Fresh(Dataset):
    """``n`` samples, sample ``i`` an array of ``i``s, each a new array; a batch blocks as ``_hold`` says."""

    def __init__(self, n: int = 64):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):  # (wrap()'s probes read by index: they never block)
        return np.full(8, int(i), np.int64)

    def __getitems__(self, indices):
        _hold(indices)
        return [np.full(8, int(i), np.int64) for i in indices]


class Gated(Dataset):
    """``Fresh``'s samples; in a process whose $ADV_GATES names a directory, computing key ``k`` (not
    one of wrap()'s probes) makes ``ready-k`` there and waits for ``go-k`` (a test lets it go, key
    by key). ``calls`` lists the keys this object computed (probes left out)."""

    def __init__(self, n: int = 64):
        self.n = n
        self.calls: list[int] = []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices):
        gates = os.environ.get(ENV_GATES)
        for i in map(int, indices):
            if i in (0, self.n // 2, self.n - 1):  # wrap()'s probes: never wait
                continue
            self.calls.append(i)
            if gates:
                Path(gates, f"ready-{i}").touch()
                deadline = time.monotonic() + 120  # killed by the test long before
                while not Path(gates, f"go-{i}").exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
        return [np.full(8, int(i), np.int64) for i in indices]


class Rows(Dataset):
    """``n`` samples of ``width`` float32s, sample ``i`` all ``i``; a batch is made as one tensor and
    handed out as its rows (views of one storage, as ``list(batch)`` or ``batch.unbind(0)`` give);
    a batch blocks as ``_hold`` says."""

    def __init__(self, n: int = 64, width: int = 1 << 20):
        self.n, self.width = n, width

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((self.width,), float(i))

    def __getitems__(self, indices):
        _hold(indices)
        batch = torch.tensor([float(i) for i in indices])[:, None].expand(len(indices), self.width).contiguous()
        return list(batch)


class ReusedBuffer(Dataset):
    """A batch loader that reads each batch into one preallocated buffer and returns its rows
    (views, no allocation per batch), as fast loaders do: valid until its next ``__getitems__``
    call - which torch's fetcher never makes before it has collated the batch. Row ``i`` holds
    ``i`` in every element. In a process whose $ADV_HOLD_KEYS names a key of a batch, the
    computation blocks (holding that batch's claims) after making $ADV_HOLD_READY."""

    def __init__(self, n: int = 64):
        self.n = n
        self.buf = np.zeros((64, 8), np.int64)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(8, int(i), np.int64)

    def __getitems__(self, indices):
        _hold(indices)
        for row, i in enumerate(indices):
            self.buf[row] = i
        return [self.buf[row] for row in range(len(indices))]
