"""DataLoader workers under fork, spawn and forkserver read a wrapped dataset: every value equals the
source, the second epoch is served entirely from the cache (counted across the workers), and
nothing warns - neither in the parent (filterwarnings = error) nor on the workers' stderr.

Two multiprocessing helpers outlive a test when started inside it: the resource tracker (spawn and
forkserver queues register their semaphores with it) and the fork server. The conftest fails a test
that leaves a child process behind, so the tracker is started before the first test, and each
forkserver test runs its own fork server, stopped at the end - which also gives the workers the
test's environment ($SHMCACHE_DIR): forkserver children inherit the server's, not the parent's.
"""

from __future__ import annotations

import re
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from _workers import HERE, FixedDataset, TorchDataset, assert_same, fixed_sample
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, RandomSampler, get_worker_info

from shmcache import ShmDatasetCache

N = 384
NBYTES = 256
BATCH = 32
START_METHODS = ["fork", "spawn", "forkserver"]


@pytest.fixture
def start_method(request, shm_namespace):
    method = request.param
    if method == "forkserver":
        from multiprocessing import forkserver

        server = forkserver._forkserver
        server._stop()  # a server started earlier carries an earlier environment
        preload = server._preload_modules
        server._preload_modules = ["torch", "shmcache.data.dataset"]  # import torch once, not per worker
        yield method
        server._stop()
        server._preload_modules = preload
    else:
        yield method


def _check_batch(images: torch.Tensor, labels: torch.Tensor, seen: list) -> None:
    """Each row carries its own index in its first 8 bytes: check it against the source."""
    assert images.dtype == torch.uint8 and images.shape[1:] == (NBYTES,)
    assert labels.dtype == torch.int64
    rows = images.numpy()
    for row, label in zip(rows, labels.tolist()):
        i = struct.unpack("<q", row[:8].tobytes())[0]
        arr, want_label = fixed_sample(i, NBYTES)
        assert np.array_equal(row, arr), f"sample {i}: bytes differ"
        assert label == want_label, f"sample {i}: label {label} != {want_label}"
        seen.append(i)


def _no_worker_noise(capfd) -> None:
    _, err = capfd.readouterr()
    noise = [ln for ln in err.splitlines()
             if re.search(r"warn|leaked|traceback|error|resource_tracker", ln, re.I)]
    assert not noise, "workers wrote to stderr:\n" + "\n".join(noise[:20])


@pytest.mark.parametrize("start_method", START_METHODS, indirect=True)
def test_workers_read_the_source_once_then_only_the_cache(start_method, capfd):
    src = FixedDataset(N, NBYTES)
    cache = ShmDatasetCache(session="loader", size=64)
    ds = cache.wrap(src)
    # spawn workers import torch (~2 s each on this machine): keep them for both epochs; fork and
    # forkserver workers are new processes in each epoch and re-attach by name every time
    loader = DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=2,
                        multiprocessing_context=start_method,
                        persistent_workers=start_method == "spawn",
                        generator=torch.Generator().manual_seed(0))
    seen: list[int] = []
    for images, labels in loader:
        _check_batch(images, labels, seen)
    assert sorted(seen) == list(range(N))
    st = cache.stats()
    assert st["items_mem"] == N
    assert st["misses"] == N - 3 and st["hits"] == 3  # wrap() stored its 3 probes itself
    seen.clear()
    for images, labels in loader:
        _check_batch(images, labels, seen)
    assert sorted(seen) == list(range(N))
    st2 = cache.stats()
    assert st2["hits"] - st["hits"] == N, "the second epoch was not served entirely from the cache"
    assert st2["misses"] == st["misses"]
    assert st2["items_mem"] == N
    assert src.calls == 4, "the parent's source was read beyond wrap()'s probes"
    del loader
    cache.close()
    _no_worker_noise(capfd)


@pytest.mark.parametrize("start_method", ["fork", "forkserver"], indirect=True)
def test_batch_sampler_with_batch_size_none(start_method, capfd):
    """DataLoader(ds, sampler=BatchSampler(...), batch_size=None): ds[list] in the workers, the
    vectorised gather path, no collation in the DataLoader."""
    src = FixedDataset(N, NBYTES, seed=3)
    cache = ShmDatasetCache(session="loader", size=64)
    ds = cache.wrap(src)
    sampler = BatchSampler(RandomSampler(ds, generator=torch.Generator().manual_seed(1)),
                           batch_size=BATCH, drop_last=False)
    loader = DataLoader(ds, sampler=sampler, batch_size=None, num_workers=2,
                        multiprocessing_context=start_method)
    for epoch in range(2):
        seen: list[int] = []
        for images, labels in loader:
            rows = images.numpy()
            for row, label in zip(rows, labels.tolist()):
                i = struct.unpack("<q", row[:8].tobytes())[0]
                arr, want = fixed_sample(i, NBYTES, 3)
                assert np.array_equal(row, arr) and label == want, f"epoch {epoch} sample {i}"
                seen.append(i)
        assert sorted(seen) == list(range(N)), f"epoch {epoch}"
        if epoch == 0:
            first = cache.stats()
    st = cache.stats()
    assert st["items_mem"] == N
    assert st["hits"] - first["hits"] == N and st["misses"] == first["misses"]
    cache.close()
    _no_worker_noise(capfd)


class ShardedStream(IterableDataset):
    """Shards itself across DataLoader workers with get_worker_info(), as the docs advise."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        info = get_worker_info()
        start, step = (info.id, info.num_workers) if info is not None else (0, 1)
        return iter(range(start, self.n, step))


@pytest.mark.parametrize("start_method", ["fork"], indirect=True)
def test_a_sharded_stream_through_forked_workers_yields_each_item_once_per_epoch(start_method, capfd):
    """wrap() of an unnamed stream reads its first items in the main process and keeps them for
    that process's first pass; forked workers inherit them but must open their own (sharded)
    iterators."""
    cache = ShmDatasetCache(session="loader", size=16)
    it = cache.wrap(ShardedStream(64))
    loader = DataLoader(it, batch_size=None, num_workers=2, multiprocessing_context=start_method)
    for epoch in range(2):
        assert sorted(int(x) for x in loader) == list(range(64)), f"epoch {epoch}"
    assert sorted(int(x) for x in it) == list(range(64))  # the main process: its own stream
    cache.close()
    _no_worker_noise(capfd)


@pytest.mark.parametrize("start_method", ["forkserver"], indirect=True)
def test_torch_samples_through_workers(start_method, capfd):
    """dict samples of tensors (float32, bool, int) through workers and default_collate."""
    src = TorchDataset(64)
    cache = ShmDatasetCache(session="loader", size=16)
    ds = cache.wrap(src)
    loader = DataLoader(ds, batch_size=16, num_workers=2, multiprocessing_context=start_method)
    for epoch in range(2):
        start = 0
        for batch in loader:
            n = len(batch["label"])
            want = torch.utils.data.default_collate([src[i] for i in range(start, start + n)])
            assert set(batch) == {"image", "mask", "label"}
            for k in batch:
                assert batch[k].dtype == want[k].dtype and torch.equal(batch[k], want[k]), \
                    f"epoch {epoch} field {k}"
            start += n
        assert start == 64
    st = cache.stats()
    assert st["items_mem"] == 64 and st["hits"] == 3 + 64 and st["misses"] == 61
    del loader
    cache.close()
    _no_worker_noise(capfd)


_SCRIPT = textwrap.dedent(r"""
    import sys, warnings
    sys.path.insert(0, {here!r})
    warnings.simplefilter("error")
    import torch
    from torch.utils.data import DataLoader
    from shmcache import ShmDatasetCache
    from _workers import FixedDataset

    if __name__ == "__main__":
        import multiprocessing
        multiprocessing.set_forkserver_preload(["torch", "shmcache.data.dataset"])
        cache = ShmDatasetCache(session="script", size=32)
        ds = cache.wrap(FixedDataset(256, 128))
        for _ in range(2):
            for _ in DataLoader(ds, batch_size=32, num_workers=2, multiprocessing_context="forkserver"):
                pass
        st = cache.stats()
        cache.close()
        print("STATS", st["items_mem"], st["hits"], st["misses"], flush=True)
""")


# CPython's resource tracker sometimes finds one of multiprocessing's own semaphores (the
# DataLoader's queues, "/mp-...") unlinked already when it cleans up at exit, and warns
# (python/cpython#114062). It is not a leak, and not ours: shmcache makes no such semaphores.
_CPYTHON_SEMAPHORE_RACE = re.compile(
    r"Traceback \(most recent call last\):\n(?:  .*\n)+FileNotFoundError: \[Errno 2\] No such file or "
    r"directory\n\nDuring handling of the above exception, another exception occurred:\n\n"
    r"Traceback \(most recent call last\):\n(?:  .*\n)+UserWarning: resource_tracker: '/mp-\w+': "
    r"\[Errno 2\] No such file or directory\n")


def test_a_whole_program_exits_without_leak_warnings(tmp_path):
    """The resource tracker reports leaked semaphores or shared memory only when the program exits:
    run one to its end and read its stderr."""
    script = tmp_path / "prog.py"
    script.write_text(_SCRIPT.format(here=HERE))
    proc = subprocess.run([sys.executable, "-W", "error", str(script)], capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "STATS 256 259 253" in proc.stdout, proc.stdout  # 3 probe hits + 256, 253 misses
    stderr = _CPYTHON_SEMAPHORE_RACE.sub("", proc.stderr)
    assert stderr == "", stderr[-3000:]


@pytest.mark.parametrize("start_method", ["fork", "spawn"], indirect=True)
def test_workers_batches_equal_default_collate_of_the_source(start_method, capfd):
    """DataLoader(ds, batch_size=B, num_workers=2) over a half-warm then warm cache: workers
    compute the misses, and send a warm batch as its keys for the main process to gather
    (NOTE [collated batch]); the batches equal plain default_collate's of the source, structure
    and dtypes included. A custom collate_fn in the workers still gets the samples."""
    from _samples import Samples

    order = [3, 5, 3, 0, 39, 12, 7, 7, 21, 30, 1, 2, 8, 8, 8, 19, 25, 26]
    src = Samples("nested")
    cache = ShmDatasetCache(session="loader", size=16)
    ds = cache.wrap(src)
    for i in range(0, len(src), 2):  # half warm: the first pass mixes hits and misses
        ds[i]
    want = list(DataLoader(src, batch_size=4, sampler=order))
    loader = DataLoader(ds, batch_size=4, sampler=order, num_workers=2,
                        multiprocessing_context=start_method, persistent_workers=True)
    for _ in range(2):
        got = list(loader)
        assert_same(got, want)
    # warm batches cross the queue as their keys and are gathered here, in private memory
    assert not any(b["b"]["c"].is_shared() for b in got), "a warm batch was copied through shared memory"
    st = cache.stats()
    got = list(loader)
    assert cache.stats()["hits"] - st["hits"] == len(order) and cache.stats()["misses"] == st["misses"]
    custom = DataLoader(ds, batch_size=4, sampler=order, num_workers=2, collate_fn=_as_samples,
                        multiprocessing_context=start_method)
    assert_same([s for b in custom for s in b], [src[i] for i in order])
    del loader, custom
    cache.close()
    _no_worker_noise(capfd)


def _as_samples(batch):
    assert type(batch) is list
    return batch
