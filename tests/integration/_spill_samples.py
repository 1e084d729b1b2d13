"""The samples of test_spilling, in a module of their own: its worker processes import them
without test_spilling's own imports (torch, through ShmDatasetCache: 1.7 s a process)."""

from __future__ import annotations

import numpy as np

ITEM_BYTES = 40_000  # 400 items x 40 KB = 16 MB of payload for a 4 MB cache


def sample(i: int):
    """Deterministic, compressible-ish (token-like) data that encodes its key."""
    rng = np.random.default_rng(i)
    return rng.integers(0, 50, ITEM_BYTES // 8, dtype=np.int64), i
