"""get_batch with real caches: into out= tensors of another dtype (bfloat16 too; memory that is
not the CPU's refused), and on a cache too small for any item (each miss computed once)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shmcache import ShmDatasetCache
from shmcache.errors import InvalidArgument


def test_get_batch_into_tensors_of_another_dtype_converts():
    with ShmDatasetCache(session="rr", name="dt") as cache:
        for k in range(4):
            cache.put(k, (torch.full((3,), 100 + k, dtype=torch.int32), k))
        out = [torch.zeros((4, 3), dtype=torch.float32), torch.zeros(4, dtype=torch.int64)]
        got = cache.get_batch([0, 1, 2, 3], out=out)
        assert got is out
        assert out[0][:, 0].tolist() == [100.0, 101.0, 102.0, 103.0]


def test_get_batch_into_bfloat16_tensors_and_cuda_out_refused():
    with ShmDatasetCache(session="rr", name="bf") as cache:
        vals = [torch.randn(5).to(torch.bfloat16) for _ in range(3)]
        for k, v in enumerate(vals):
            cache.put(k, v)
        out = torch.empty((3, 5), dtype=torch.bfloat16)
        assert torch.equal(cache.get_batch([0, 1, 2], out=out), torch.stack(vals))
        meta = torch.empty((3, 5), dtype=torch.bfloat16, device="meta")
        with pytest.raises(InvalidArgument, match="CPU memory"):
            cache.get_batch([0, 1, 2], out=meta)


def test_a_full_cache_computes_each_miss_once():
    calls = []

    def fn(k):
        calls.append(k)
        return np.full(300_000, k % 250, np.uint8)  # 300 KB: a 1 MB cache holds none of them

    with ShmDatasetCache(session="rr", name="full", size=1) as cache:
        batch = cache.get_batch([1, 2, 3], fn=fn)
        assert sorted(calls) == [1, 2, 3]
        assert batch[:, 0].tolist() == [1, 2, 3]
        st = cache.stats()
        assert st["misses"] == 3 and st["hits"] == 0
        assert st["rejected"] == 3 - st["items_mem"] > 0


