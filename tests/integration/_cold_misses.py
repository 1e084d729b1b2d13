"""Datasets and processes of tests/integration/test_cold_misses.py, importable by the processes
those tests start (found through ``sys.path``, as _workers and _claims are).

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
from torch.utils.data import Dataset

# set in a holder process only (the dataset itself stays the same object everywhere: one fingerprint)
ENV_HOLD = "ADV_HOLD_KEYS"  # comma-separated keys whose computation blocks
ENV_READY = "ADV_HOLD_READY"  # a file made once the blocking computation began (its claims held)


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
