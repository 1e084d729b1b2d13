"""``NodeAffineSampler``: ``DistributedSampler`` with each node reading a fixed part of the dataset.

    sampler = NodeAffineSampler(ds)              # WORLD_SIZE, RANK, LOCAL_WORLD_SIZE as torchrun sets them
    loader = DataLoader(ds, batch_size=256, sampler=sampler)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        ...

Why: a cache in shared memory is per node. With ``DistributedSampler(shuffle=True)`` on N nodes a
sample lands on a random node every epoch, so a node-local cache, however large, hits with
probability 1-(1-1/N)^(e-1) in epoch e (on 8 nodes: 12.5% in epoch 2, 41% in epoch 5, 70% in
epoch 10) and every node ends up decoding - and holding - the whole dataset.

What: node ``k`` (``rank // nproc_per_node``) owns a fixed part of the dataset, the indices
``k, k + nodes, k + 2 * nodes, ...`` - the same every epoch, whatever the seed or ``shuffle``
(strided, not contiguous: datasets sorted by class, like ``ImageFolder``, still give every node every
class). Every epoch the node's part is shuffled with a generator seeded by ``seed + epoch``,
identically on every rank of the node, and dealt out to the node's ranks like ``DistributedSampler``
deals the whole dataset. So from epoch 2 on every read is a hit of the node's cache, and each node
caches (and decodes) 1/N of the data.

The price: each node shuffles only within its own part. Every rank still sees a fresh random order
every epoch, but a node never sees the samples of another node, so the global order is not a uniform
shuffle of the whole dataset. Most training does not notice; a model that is sensitive to it should
keep ``DistributedSampler`` and share the caches over the network instead.

On one node (or with ``nproc_per_node == num_replicas``) the indices are exactly those of
``DistributedSampler`` with the same arguments.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data.distributed import DistributedSampler

from ..base import settings
from ..errors import InvalidArgument

__all__ = ["NodeAffineSampler"]


def _int_arg(value: Any, what: str, low: int | None, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or (
            low is not None and value < low):
        kind = "an int" if low is None else f"an int >= {low}"
        raise InvalidArgument(f"NodeAffineSampler: {what} must be {kind}, got "
                              f"{type(value).__name__} {value!r}; {fix}")
    return int(value)


def _env_int(name: str) -> int | None:
    raw = settings.get(name)
    if raw is None or not raw.strip():
        return None
    try:
        return int(raw)
    except ValueError:
        raise InvalidArgument(f"NodeAffineSampler: ${name}={raw!r} is not an int; the launcher "
                              f"(torchrun, python -m shmcache.launch) sets it to a number, or "
                              f"pass the argument explicitly") from None


def _world() -> tuple[int | None, int | None, str]:
    """(world size, rank, where they came from): the process group if one is initialised (as
    DistributedSampler does), else the environment the launcher sets, else (None, None)."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank(), "the process group"
    return _env_int(settings.ENV_WORLD_SIZE), _env_int(settings.ENV_RANK), "$WORLD_SIZE/$RANK"


# Subclassing DistributedSampler is for the frameworks that test isinstance(sampler,
# DistributedSampler) before they wrap or replace a user's sampler (Lightning's
# use_distributed_sampler); every attribute and method it has is set or overridden here, so its
# __init__ - which insists on an initialised process group - is not called.
class NodeAffineSampler(DistributedSampler):
    """``DistributedSampler`` whose nodes each read a fixed part of the dataset, shuffled within it.

    Args:
        dataset: a map-style dataset (``len()`` is all that is used).
        num_replicas: the number of processes (all nodes). None: the process group's world size if
            one is initialised, else ``$WORLD_SIZE``, else 1.
        rank: this process's rank in ``[0, num_replicas)``. None: the process group's rank, else
            ``$RANK``, else 0.
        shuffle: shuffle each node's part every epoch (True), or read it in order.
        seed: the shuffle's seed; the same on every process.
        drop_last: drop the tail of each node's part so every rank gets the same number of samples
            (True), or pad each node's part with its own samples (False, as DistributedSampler pads).
        nproc_per_node: processes per node; ranks ``k * nproc_per_node ...`` to
            ``(k + 1) * nproc_per_node - 1`` are node ``k`` (the layout of torchrun and of
            ``python -m shmcache.launch``). None: ``$LOCAL_WORLD_SIZE``, else 1 (then every process
            owns its own part, which is still a part of its node).
    """

    def __init__(self, dataset: Sized, num_replicas: int | None = None, rank: int | None = None,
                 shuffle: bool = True, seed: int = 0, drop_last: bool = False, *,
                 nproc_per_node: int | None = None) -> None:
        try:
            n = len(dataset)
        except TypeError:
            raise InvalidArgument(f"NodeAffineSampler needs a dataset with a len(), got "
                                  f"{type(dataset).__name__}; an IterableDataset shards itself "
                                  f"and takes no sampler") from None
        world, group_rank, source = _world()
        from_env = rank is None and nproc_per_node is None
        world_fix = ("pass the number of processes" if num_replicas is not None
                     else f"it is the number of processes, read from {source}")
        rank_fix = ("pass this process's rank" if rank is not None
                    else f"it is this process's rank, read from {source}")
        if num_replicas is None:
            num_replicas = 1 if world is None else world
        if rank is None:
            if group_rank is None and num_replicas > 1:
                raise InvalidArgument(f"NodeAffineSampler: num_replicas={num_replicas} but no rank: "
                                      f"neither a process group nor $RANK is set; pass rank=, or "
                                      f"start the processes with torchrun or python -m shmcache.launch")
            rank = 0 if group_rank is None else group_rank
        self.num_replicas = _int_arg(num_replicas, "num_replicas", 1, world_fix)
        self.rank = _int_arg(rank, "rank", 0, rank_fix)
        if self.rank >= self.num_replicas:
            raise InvalidArgument(f"NodeAffineSampler: rank={self.rank} is not below "
                                  f"num_replicas={self.num_replicas}; ranks are 0 to "
                                  f"{self.num_replicas - 1}")
        self.nproc_per_node = self._nproc_per_node(nproc_per_node)
        if not isinstance(shuffle, bool):
            raise InvalidArgument(f"NodeAffineSampler: shuffle must be True or False, got {shuffle!r}")
        if not isinstance(drop_last, bool):
            raise InvalidArgument(f"NodeAffineSampler: drop_last must be True or False, got "
                                  f"{drop_last!r}")
        self.seed = _int_arg(seed, "seed", None, "give the same int on every process")
        self.dataset = dataset
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.num_nodes = self.num_replicas // self.nproc_per_node
        self.node_rank, self.local_rank = divmod(self.rank, self.nproc_per_node)
        if from_env:
            self._check_layout()
        self._len = n
        # DistributedSampler's counts, so every rank of every node takes the same number of steps:
        # ceil(n / R) with padding, floor(n / R) with drop_last. Each node can serve them from its
        # own part: P * ceil(n / R) >= ceil(n / nodes) >= its part, and P * floor(n / R) <=
        # floor(n / nodes) <= its part.
        self.num_samples = (n // self.num_replicas if drop_last
                            else math.ceil(n / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas

    def _nproc_per_node(self, nproc_per_node: int | None) -> int:
        where = "nproc_per_node"
        if nproc_per_node is None:
            nproc_per_node = _env_int(settings.ENV_LOCAL_WORLD_SIZE)
            where = "$LOCAL_WORLD_SIZE"
            if nproc_per_node is None:
                return 1
        p = _int_arg(nproc_per_node, where, 1, "it is the number of processes on each node")
        if self.num_replicas % p:
            raise InvalidArgument(
                f"NodeAffineSampler: num_replicas={self.num_replicas} processes do not make whole "
                f"nodes of {where}={p}; every node must run the same number of processes (pass "
                f"nproc_per_node= to match the launcher's --nproc-per-node)")
        return p

    def _check_layout(self) -> None:
        """Node k must be ranks k*P .. k*P+P-1 (torchrun's layout). Under a launcher that numbers
        ranks otherwise (Slurm's cyclic distribution) the processes of one machine would read the
        parts of several nodes: every sample still read, but each machine's cache would fill with
        several parts and miss as with DistributedSampler."""
        local = _env_int(settings.ENV_LOCAL_RANK)
        if local is not None and local != self.local_rank:
            raise InvalidArgument(
                f"NodeAffineSampler: rank {self.rank} with {self.nproc_per_node} processes per node "
                f"should be local rank {self.local_rank}, but $LOCAL_RANK={local}: the ranks of a "
                f"node are not consecutive; start them in blocks (torchrun, python -m shmcache.launch, "
                f"srun --distribution=block), or pass rank= and nproc_per_node= such that "
                f"rank // nproc_per_node is the node")

    @property
    def node_part(self) -> range:
        """The indices this node owns, every epoch: ``range(node_rank, len(dataset), num_nodes)``."""
        return range(self.node_rank, self._len, self.num_nodes)

    def __iter__(self) -> Iterator[int]:
        part = np.arange(self.node_rank, self._len, self.num_nodes, dtype=np.int64)
        if self.shuffle:
            # One stream, seeded like DistributedSampler's, gives node 0's permutation first, then
            # node 1's...: on one node this is DistributedSampler's order, and nodes whose parts have
            # the same size still get unrelated orders.
            stream = torch.Generator()
            stream.manual_seed(self.seed + self.epoch)
            for k in range(self.node_rank + 1):
                perm = torch.randperm(len(range(k, self._len, self.num_nodes)), generator=stream)
            part = part[perm.numpy()]
        size = self.num_samples * self.nproc_per_node  # what this node deals out to its ranks
        if len(part) >= size:
            part = part[:size]  # drop_last (or nothing to pad)
        elif len(part):
            part = np.resize(part, size)  # pad cyclically with the node's own samples, as
            # DistributedSampler pads with the first samples of its order
        else:
            # fewer samples than nodes: this node owns none, and borrows from the others (the only
            # case where it reads outside its part)
            part = np.resize(np.arange(self.node_rank % self._len, self._len, dtype=np.int64), size)
        return iter(part[self.local_rank::self.nproc_per_node].tolist())

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Call before each epoch: the order of each node's part changes with the epoch (the part
        does not)."""
        self.epoch = _int_arg(epoch, "epoch", 0, "pass the epoch number (0, 1, 2, ...)")

    def __repr__(self) -> str:
        return (f"NodeAffineSampler(len(dataset)={self._len}, num_replicas={self.num_replicas}, "
                f"rank={self.rank}, nproc_per_node={self.nproc_per_node}, node {self.node_rank} of "
                f"{self.num_nodes}, shuffle={self.shuffle}, seed={self.seed}, "
                f"drop_last={self.drop_last}, epoch={self.epoch})")
