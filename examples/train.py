"""Train a small CNN with DDP through one shared cache: ShmDatasetCache -> PrefetchRing -> sink_loop.

    python -m shmcache.launch --nproc 2 examples/train.py            # shmcache's launcher
    torchrun --standalone --nproc-per-node 2 examples/train.py       # unchanged under torchrun
    python examples/train.py                                         # one process

Two tasks, one after the other:

* photos: crops of two photographs, JPEG-decoded and resized on every uncached access (the work a
  cache removes); each rank reads its shard of a reshuffled order every epoch. Epoch 1 fills the
  cache (every crop decoded once, by one of the ranks), epoch 2 reads it.
* digits: 1,797 real handwritten digits, trained to a test accuracy worth the name.

Each epoch is one sink (``sink_loop``: no host synchronisation inside it); rank 0 prints the epoch
time, the share of it spent waiting for data, the mean loss and the cache's hits and misses.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.nn  # noqa: F401  before init_process_group: see teardown() below
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
from datasets import Digits, PhotoCrops  # noqa: E402

from shmcache import PrefetchRing, ShmDatasetCache, sink_loop  # noqa: E402

TASKS = {"photos": (3, 2), "digits": (1, 10)}  # input channels, classes


class SmallCNN(nn.Module):
    def __init__(self, in_channels: int, classes: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(4)
        self.fc = nn.Linear(32 * 16, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.conv1(x))
        x = self.pool(F.relu(self.conv2(x)))
        return self.fc(x.flatten(1))


class ShardedKeyBatches:
    """Batches of dataset indices for this rank; a new shuffle on every pass (every epoch)."""

    def __init__(self, indices: np.ndarray, batch_size: int, rank: int, world: int, seed: int = 0):
        self.indices, self.batch_size, self.rank, self.world = indices, batch_size, rank, world
        self.epoch, self.seed = 0, seed
        self.per_rank = len(indices) // world  # equal step counts on every rank (DDP needs it)

    def __len__(self) -> int:
        return -(-self.per_rank // self.batch_size)

    def __iter__(self):
        self.epoch += 1
        order = np.random.default_rng(self.seed + self.epoch).permutation(self.indices)
        mine = order[self.rank::self.world][: self.per_rank]
        for lo in range(0, len(mine), self.batch_size):
            yield mine[lo:lo + self.batch_size]


class WaitTimer:
    """Wraps the batch iterable and adds up the time the training loop waits for data."""

    def __init__(self, batches):
        self.batches, self.waited = batches, 0.0

    def __iter__(self):
        it = iter(self.batches)
        while True:
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            finally:
                self.waited += time.perf_counter() - t0
            yield batch


def setup() -> tuple[int, int, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo", init_method="env://")
    torch.manual_seed(0)
    return rank, world, device


def teardown() -> None:
    """Destroy the process group so that it is really gone, its threads (gloo's, the TCPStore's)
    joined here, while the interpreter is whole. DistributedDataParallel imports
    torch.distributed.nn.functional, whose functions take ``group=group.WORLD`` as a default
    evaluated at import: imported after init_process_group, they hold the process group for good,
    and it was destroyed only while Python finalized its modules, after the script had ended (one
    run in 13 under load died there of SIGABRT, "terminate called without an active exception",
    after a successful training). Imported before (above), the defaults hold None; the DDP wrappers
    are garbage by now, collected here, so destroy_process_group() drops the last reference."""
    gc.collect()  # the DDP wrappers (reference cycles) of the tasks trained
    dist.barrier()
    dist.destroy_process_group()


def train(task: str, cache: ShmDatasetCache, source, train_idx, epochs: int, args, rank: int,
          world: int, device: torch.device, prepare) -> nn.Module:
    ds = cache.wrap(source)
    channels, classes = TASKS[task]
    model = SmallCNN(channels, classes).to(device)
    if world > 1:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    keys = ShardedKeyBatches(train_idx, args.batch_size, rank, world)
    ring = PrefetchRing.from_cache(ds, keys, device=device, depth=args.depth)
    timer = WaitTimer(ring)

    def step(batch):
        x, y = batch
        loss = F.cross_entropy(model(prepare(x)), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.detach()

    def report(result):
        st = cache.stats()
        if rank == 0:
            print(f"[{task}] epoch {result.epoch:2d}  {result.wall_s:6.2f} s  data wait "
                  f"{100 * timer.waited / max(result.wall_s, 1e-9):4.0f}%  loss {result.loss_mean:.4f}"
                  f"  cache: {st['items_mem']} items, {st['hits']} hits, {st['misses']} misses",
                  flush=True)
        timer.waited = 0.0

    with ring:
        sink_loop(step, timer, epochs=epochs, sink_size=args.sink_size, callbacks=[report])
    return model.module if world > 1 else model


@torch.no_grad()
def accuracy(model: nn.Module, source, idx, device, prepare) -> float:
    model.eval()
    xs = torch.stack([source[int(i)][0] for i in idx]).to(device)
    ys = torch.tensor([source[int(i)][1] for i in idx], device=device)
    return (model(prepare(xs)).argmax(1) == ys).float().mean().item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tasks", default="photos,digits", help="comma-separated: photos, digits")
    p.add_argument("--photos", type=int, default=1024, help="number of photo crops")
    p.add_argument("--photo-epochs", type=int, default=2)
    p.add_argument("--digit-epochs", type=int, default=15)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--sink-size", type=int, default=-1, help="steps per sink; -1: one sink per epoch")
    p.add_argument("--depth", type=int, default=2, help="prefetch ring depth")
    p.add_argument("--lr", type=float, default=1e-2)
    args = p.parse_args()
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    unknown = sorted(set(tasks) - {"photos", "digits"})
    if unknown or not tasks:  # before any process trains: a typo must not end in a job that did nothing
        p.error(f"--tasks {args.tasks!r}: {'unknown task ' + ', '.join(unknown) if unknown else 'no task'}; "
                f"give photos, digits or photos,digits")
    rank, world, device = setup()
    if rank == 0:
        print(f"{world} process(es) on {device}, session {os.environ.get('SHMCACHE_SESSION', 'default')!r}")

    if "photos" in tasks:
        photos = PhotoCrops(args.photos, size=32)
        to_float = lambda x: x.permute(0, 3, 1, 2).float().div_(255)  # noqa: E731
        train("photos", ShmDatasetCache(), photos, np.arange(len(photos)), args.photo_epochs,
              args, rank, world, device, to_float)
    if "digits" in tasks:
        digits = Digits()
        split = np.random.default_rng(0).permutation(len(digits))
        test_idx, train_idx = split[:297], split[297:]
        model = train("digits", ShmDatasetCache(), digits, train_idx, args.digit_epochs,
                      args, rank, world, device, lambda x: x)
        if rank == 0:
            print(f"[digits] test accuracy {100 * accuracy(model, digits, test_idx, device, lambda x: x):.1f}% "
                  f"on {len(test_idx)} held-out digits")
    if world > 1:
        teardown()
    if rank == 0 and not os.environ.get("CACHE_SH_PRINTS_STAT"):  # launch/cache.sh prints it after us
        session = os.environ.get("SHMCACHE_SESSION", "default")
        subprocess.run([sys.executable, "-m", "shmcache", "stat", session], check=False)
        print(f"\nThe cache stays for the next run (it will read it). Drop it: shmcache destroy {session}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
