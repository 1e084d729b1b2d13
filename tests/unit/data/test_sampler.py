"""``NodeAffineSampler``: DistributedSampler's contract, plus a fixed part of the data per node.

The properties, swept over dataset sizes (0 to a few thousand), 1-8 nodes, 1-4 processes per node,
``drop_last`` and ``shuffle`` both ways, and several epochs:

- every rank gets ``len(sampler)`` indices, the same number as DistributedSampler would give it;
- the nodes' parts are disjoint, their union is the dataset, and a part does not change with the
  epoch, the seed or ``shuffle``; every rank reads only its node's part (so from epoch 2 every read
  is a hit of the node's cache), and a node's padding repeats its own samples;
- complete: without ``drop_last`` each node reads all of its part every epoch; with it, the ranks
  read distinct samples and each node drops fewer than ``nproc_per_node + 1``;
- deterministic per (seed, epoch); ``set_epoch`` and the seed change the order;
- on one node it *is* DistributedSampler (same indices, same order).

The job on several nodes, with real processes and caches: tests/integration/test_node_affine.py.
"""

from __future__ import annotations

import math
import pickle
import random
from collections import Counter
from datetime import timedelta

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from shmcache import InvalidArgument, NodeAffineSampler, ShmDatasetCache

ENV = ("WORLD_SIZE", "RANK", "LOCAL_WORLD_SIZE", "LOCAL_RANK")


@pytest.fixture(autouse=True)
def no_launcher_environment(monkeypatch):
    for name in ENV:
        monkeypatch.delenv(name, raising=False)


def _job(n, nodes, nproc, epoch=0, **kw):
    """The indices of every rank of a job: {rank: [indices]} (and the samplers)."""
    samplers = [NodeAffineSampler(range(n), nodes * nproc, r, nproc_per_node=nproc, **kw)
                for r in range(nodes * nproc)]
    for s in samplers:
        s.set_epoch(epoch)
    return [list(s) for s in samplers], samplers


def _configs():
    """Every small case (n < 20, all layouts) and a seeded random sweep of larger ones."""
    out = [(n, nodes, nproc, dl, sh) for n in (0, 1, 2, 3, 5, 8, 13) for nodes in (1, 2, 3, 8)
           for nproc in (1, 2, 4) for dl in (False, True) for sh in (True,)]
    rng = random.Random(11)
    for _ in range(60):
        out.append((rng.choice([rng.randint(14, 300), rng.randint(300, 4000)]), rng.randint(1, 8),
                    rng.randint(1, 4), rng.random() < 0.5, rng.random() < 0.8))
    out += [(4000, 8, 4, False, True), (4001, 8, 4, True, True), (4095, 7, 3, False, False)]
    return out


@pytest.mark.parametrize("n,nodes,nproc,drop_last,shuffle", _configs())
def test_properties(n, nodes, nproc, drop_last, shuffle):
    reads = {}
    for epoch in (0, 1, 7):
        indices, samplers = _job(n, nodes, nproc, epoch, drop_last=drop_last, shuffle=shuffle, seed=5)
        reads[epoch] = indices
        want_len = len(DistributedSampler(range(n), nodes * nproc, 0, drop_last=drop_last))
        assert {len(s) for s in samplers} == {want_len}  # DistributedSampler's count, every rank
        assert [len(i) for i in indices] == [want_len] * len(indices)
        assert all(s.total_size == want_len * nodes * nproc for s in samplers)
        parts = [set(samplers[k * nproc].node_part) for k in range(nodes)]
        assert sum(len(p) for p in parts) == n and set().union(*parts) == set(range(n))  # disjoint, complete
        assert all(samplers[r].node_part == samplers[r - r % nproc].node_part for r in range(len(samplers)))
        for k, part in enumerate(parts):
            node = [i for r in range(k * nproc, (k + 1) * nproc) for i in indices[r]]
            if part:
                assert set(node) <= part, f"node {k} reads outside its part"
            if drop_last:
                assert len(set(node)) == len(node) and len(part) - len(node) <= nproc
            else:
                assert set(node) == part or not part  # all of it, padded with its own samples
                counts = Counter(node).values()
                assert max(counts, default=0) - min(counts, default=0) <= 1  # padding is spread evenly
        if drop_last:
            flat = [i for r in indices for i in r]
            assert len(flat) == len(set(flat))
    again, _ = _job(n, nodes, nproc, 7, drop_last=drop_last, shuffle=shuffle, seed=5)
    assert again == reads[7]  # deterministic per (seed, epoch): another instance, the same order
    for k in range(nodes):  # stable per node: the same samples every epoch (all of its part
        # without drop_last; with it, the same part less a few dropped that change with the order)
        node = [{i for r in range(k * nproc, (k + 1) * nproc) for i in reads[e][r]} for e in reads]
        if not drop_last:
            assert node[0] == node[1] == node[2]
    if shuffle and n // nodes >= 8 * nproc:  # enough to shuffle: the order changes with the epoch
        assert reads[0] != reads[1] != reads[7]
        other_seed, _ = _job(n, nodes, nproc, 7, drop_last=drop_last, shuffle=shuffle, seed=6)
        assert other_seed != reads[7]
    if not shuffle:  # each node in order, dealt out round-robin
        for r, idx in enumerate(reads[0]):
            k, j = divmod(r, nproc)
            part = list(range(k, n, nodes))
            assert idx[: len(part[j::nproc])] == part[j::nproc][: len(idx)]


@pytest.mark.parametrize("n", [0, 1, 2, 7, 64, 999, 1000, 1001])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("shuffle", [False, True])
def test_one_node_is_distributed_sampler(n, world, drop_last, shuffle):
    for rank in range(world):
        ours = NodeAffineSampler(range(n), world, rank, shuffle, 3, drop_last, nproc_per_node=world)
        theirs = DistributedSampler(range(n), world, rank, shuffle, 3, drop_last)
        for epoch in (0, 4):
            ours.set_epoch(epoch)
            theirs.set_epoch(epoch)
            assert list(ours) == list(theirs) and len(ours) == len(theirs)
            assert (ours.num_samples, ours.total_size) == (theirs.num_samples, theirs.total_size)


def test_nodes_with_parts_of_one_size_get_unrelated_orders():
    indices, _ = _job(1000, 2, 1, epoch=3)
    assert [i // 2 for i in indices[0]] != [i // 2 for i in indices[1]]


def test_padding_repeats_the_nodes_own_samples():
    """10 samples, 2 nodes x 4 processes: each rank reads 2, a node 8 from its 5: 3 repeated."""
    indices, samplers = _job(10, 2, 4, epoch=1)
    for k in range(2):
        node = [i for r in indices[4 * k:4 * k + 4] for i in r]
        assert len(node) == 8 and set(node) == set(range(k, 10, 2))


def test_fewer_samples_than_nodes():
    """The one case where a node reads outside its part: it has none (3 samples, 4 nodes)."""
    indices, samplers = _job(3, 4, 1)
    assert [len(s.node_part) for s in samplers] == [1, 1, 1, 0]
    assert indices[:3] == [[0], [1], [2]] and len(indices[3]) == 1 and 0 <= indices[3][0] < 3


def test_empty_dataset():
    for drop_last in (False, True):
        indices, samplers = _job(0, 2, 2, drop_last=drop_last)
        assert indices == [[]] * 4 and {len(s) for s in samplers} == {0}


# --- the interface ---------------------------------------------------------------------------------


def test_it_is_a_distributed_sampler():
    """Frameworks test isinstance(sampler, DistributedSampler) before they replace a user's sampler
    with their own (Lightning's use_distributed_sampler); it has DistributedSampler's attributes."""
    s = NodeAffineSampler(range(100), 8, 5, nproc_per_node=4)
    assert isinstance(s, DistributedSampler)
    assert (s.num_replicas, s.rank, s.shuffle, s.seed, s.drop_last, s.epoch) == (8, 5, True, 0, False, 0)
    assert (s.num_nodes, s.node_rank, s.local_rank, s.nproc_per_node) == (2, 1, 1, 4)
    assert s.node_part == range(1, 100, 2)
    assert "node 1 of 2" in repr(s)
    s.set_epoch(3)
    clone = pickle.loads(pickle.dumps(s))
    assert list(clone) == list(s) and clone.epoch == 3


def test_reads_the_launchers_environment(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    s = NodeAffineSampler(range(100))
    assert (s.num_replicas, s.rank, s.nproc_per_node, s.node_rank, s.local_rank) == (8, 5, 4, 1, 1)
    assert list(s) == list(NodeAffineSampler(range(100), 8, 5, nproc_per_node=4))


def test_alone_it_reads_everything(monkeypatch):
    s = NodeAffineSampler(range(10))  # no launcher, no process group: one process, all the data
    assert (s.num_replicas, s.rank, s.nproc_per_node) == (1, 0, 1)
    assert sorted(s) == list(range(10))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert NodeAffineSampler(range(10), 4, 3).nproc_per_node == 1  # every process a part of its own


def test_the_process_group_wins_over_the_environment(monkeypatch, tmp_path):
    """As DistributedSampler: world size and rank from an initialised process group (a one-rank
    gloo group through a file store); $LOCAL_WORLD_SIZE still says how many processes a node has."""
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1,
                            timeout=timedelta(seconds=30))
    try:
        s = NodeAffineSampler(range(10))
    finally:
        dist.destroy_process_group()
    assert (s.num_replicas, s.rank) == (1, 0)


@pytest.mark.parametrize("kwargs,env,words", [
    (dict(num_replicas=6, rank=0, nproc_per_node=4), {}, ["num_replicas=6", "nproc_per_node=4",
                                                          "same number of processes"]),
    (dict(num_replicas=6, rank=0), {"LOCAL_WORLD_SIZE": "4"}, ["$LOCAL_WORLD_SIZE=4", "num_replicas=6"]),
    (dict(num_replicas=4, rank=4), {}, ["rank=4", "num_replicas=4", "0 to 3"]),
    (dict(num_replicas=4, rank=-1), {}, ["rank", "-1", ">= 0"]),
    (dict(num_replicas=0, rank=0), {}, ["num_replicas", "0", ">= 1"]),
    (dict(num_replicas=4, rank=1, nproc_per_node=0), {}, ["nproc_per_node", ">= 1"]),
    (dict(num_replicas=4, rank=1, nproc_per_node=2.0), {}, ["nproc_per_node", "float"]),
    (dict(num_replicas="4", rank=1), {}, ["num_replicas", "str"]),
    (dict(num_replicas=4, rank=True), {}, ["rank", "bool"]),
    (dict(num_replicas=4, rank=1, seed=1.5), {}, ["seed", "1.5"]),
    (dict(num_replicas=4, rank=1, shuffle="yes"), {}, ["shuffle", "'yes'"]),
    (dict(num_replicas=4, rank=1, drop_last=None), {}, ["drop_last", "None"]),
    (dict(), {"WORLD_SIZE": "four", "RANK": "0"}, ["$WORLD_SIZE='four'", "not an int"]),
    (dict(), {"WORLD_SIZE": "4"}, ["num_replicas=4", "no rank", "$RANK", "torchrun"]),
    (dict(num_replicas=4), {}, ["num_replicas=4", "no rank", "rank="]),
    (dict(), {"WORLD_SIZE": "4", "RANK": "1", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"},
     ["rank 1", "local rank 1", "$LOCAL_RANK=0", "consecutive"]),
])
def test_bad_arguments_are_named(monkeypatch, kwargs, env, words):
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument) as info:
        NodeAffineSampler(range(10), **kwargs)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_dataset_and_epoch():
    with pytest.raises(InvalidArgument, match="len"):
        NodeAffineSampler(iter(range(3)), 1, 0)
    s = NodeAffineSampler(range(10), 1, 0)
    for bad in ("1", 1.0, -1, None):
        with pytest.raises(InvalidArgument, match="epoch"):
            s.set_epoch(bad)
    s.set_epoch(np.int64(2))
    assert s.epoch == 2 and type(s.epoch) is int


def test_explicit_rank_is_not_checked_against_local_rank(monkeypatch):
    """$LOCAL_RANK says where this process runs only when the rank came from the launcher too."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert NodeAffineSampler(range(10), 4, 1, nproc_per_node=2).local_rank == 1


# --- with a DataLoader and a cache ------------------------------------------------------------------


class Squares(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.calls = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.calls += 1
        return np.full(16, i * i, np.int64)


def test_data_loader_over_a_cache_hits_from_epoch_two():
    """One node of a 2-node job, its two ranks in this process: a DataLoader reads the sampler's
    indices in order; epoch 1 computes the node's part once, epochs 2 and 3 are all hits."""
    n = 301
    with ShmDatasetCache(session="node0") as cache:
        source = Squares(n)
        ds = cache.wrap(source)
        source.calls = 0
        samplers = [NodeAffineSampler(ds, 4, r, nproc_per_node=2, drop_last=False) for r in (0, 1)]
        loaders = [DataLoader(ds, batch_size=32, sampler=s) for s in samplers]
        part = set(range(0, n, 2))
        for epoch in range(3):
            before = cache.stats()
            seen = []
            for sampler, loader in zip(samplers, loaders):
                sampler.set_epoch(epoch)
                want = list(sampler)
                got = torch.cat([b[:, 0] for b in loader]).tolist()
                assert got == [i * i for i in want]  # the DataLoader follows the sampler's order
                seen += want
            assert set(seen) == part and len(seen) == 2 * math.ceil(n / 4)
            after = cache.stats()
            if epoch == 0:
                assert source.calls == after["misses"] - before["misses"] <= len(part)
            else:
                assert after["misses"] == before["misses"]  # from epoch 2: hits only
                assert after["hits"] - before["hits"] == len(seen)
        assert all((i in cache) == (i in part or i in (0, n // 2, n - 1)) for i in range(n))
