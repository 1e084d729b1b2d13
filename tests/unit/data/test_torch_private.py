"""The two things shmcache takes from torch's private ``torch.utils.data._utils``
(shmcache.data.torch_private): where a torch moves them, these fail loudly - the code itself
would quietly lose the collated-batch fast path (NOTE [collated batch])."""

import sys

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from shmcache.data import torch_private
from shmcache.data.collate import Collated


class _Callers(Dataset):
    """Records the code object of whoever calls its __getitems__."""

    def __init__(self):
        self.callers = []

    def __len__(self):
        return 4

    def __getitem__(self, i):
        return torch.tensor([i])

    def __getitems__(self, indices):
        self.callers.append(sys._getframe(1).f_code)
        return [torch.tensor([i]) for i in indices]


def test_the_dataloader_calls_getitems_from_the_fetch_code_shmcache_looks_for():
    assert torch_private.fetcher_class() is not None, "torch moved its map-style fetcher"
    assert torch_private.FETCH_CODE is not None
    ds = _Callers()
    batches = list(DataLoader(ds, batch_size=2))
    assert [b.tolist() for b in batches] == [[[0], [1]], [[2], [3]]]
    assert ds.callers and all(code is torch_private.FETCH_CODE for code in ds.callers)


def test_default_collate_looks_up_the_collated_marker_in_the_map_shmcache_registers_it_in():
    assert Collated in torch_private.default_collate_fn_map
    batch = {"x": torch.arange(6).reshape(3, 2)}
    assert default_collate([Collated(batch)] * 3) is batch
