"""Helpers shared by the unit and integration tests of the core: toy datasets that pickle by value
and can be imported by DataLoader workers under fork, spawn and forkserver (this module is found
through ``sys.path``, which spawn and forkserver children inherit from the parent), worker
functions for ``multiprocessing``, and a bit-for-bit comparison of samples.

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import subprocess
import sys
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))

# --- bit-for-bit comparison ------------------------------------------------------------------------


def assert_same(got, want, path: str = "value") -> None:
    """``got`` equals ``want`` bit for bit, with the same types, dtypes, shapes and container kinds."""
    assert type(got) is type(want), f"{path}: type {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, np.ndarray):
        assert got.dtype == want.dtype and got.dtype.str == want.dtype.str, \
            f"{path}: dtype {got.dtype.str} != {want.dtype.str}"
        assert got.shape == want.shape, f"{path}: shape {got.shape} != {want.shape}"
        assert np.ascontiguousarray(got).tobytes() == np.ascontiguousarray(want).tobytes(), \
            f"{path}: array bytes differ"
        return
    if type(want).__module__.startswith("torch"):
        import torch

        if isinstance(want, torch.Tensor):
            assert got.dtype == want.dtype, f"{path}: dtype {got.dtype} != {want.dtype}"
            assert tuple(got.shape) == tuple(want.shape), \
                f"{path}: shape {tuple(got.shape)} != {tuple(want.shape)}"
            assert _tensor_bytes(got) == _tensor_bytes(want), f"{path}: tensor bytes differ"
            return
    if isinstance(want, float):
        assert struct.pack("<d", got) == struct.pack("<d", want), f"{path}: {got!r} != {want!r} (bits)"
        return
    if isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        for k in want:
            assert_same(got[k], want[k], f"{path}[{k!r}]")
        return
    if isinstance(want, (tuple, list)):
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_same(g, w, f"{path}[{i}]")
        return
    assert got == want, f"{path}: {got!r} != {want!r}"


def _tensor_bytes(t) -> bytes:
    import torch

    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.numel() == 0:
        return b""
    return bytes(t.view(torch.uint8).numpy())


# --- deterministic toy data -------------------------------------------------------------------------

_BASE: dict[int, np.ndarray] = {}


def _base(seed: int) -> np.ndarray:
    block = _BASE.get(seed)
    if block is None:
        block = _BASE[seed] = np.random.default_rng(seed).integers(0, 256, 1 << 20, dtype=np.uint8)
    return block


def fixed_sample(i: int, nbytes: int = 3072, seed: int = 0) -> tuple[np.ndarray, int]:
    """Sample ``i``: ``nbytes`` of uint8 (unique per i: the index is written into the first bytes)
    and an int label."""
    base = _base(seed)
    off = (i * 7919) % (len(base) - nbytes)
    arr = base[off:off + nbytes].copy()
    arr[:8] = np.frombuffer(struct.pack("<q", i), np.uint8)[:min(8, nbytes)]
    return arr, (i * 7) % 1000 + seed


def var_len(i: int, lo: int, hi: int, seed: int) -> int:
    return lo + (i * 2654435761 + seed) % (hi - lo)


def var_sample(i: int, lo: int = 1000, hi: int = 8000, seed: int = 0) -> tuple[np.ndarray, int]:
    arr, label = fixed_sample(i, var_len(i, lo, hi, seed), seed)
    return arr, label


class FixedDataset:
    """A map-style dataset of ``n`` samples of ``nbytes`` uint8 plus an int label (picklable).

    ``calls`` counts reads of the source in this process (each process has its own copy)."""

    def __init__(self, n: int, nbytes: int = 3072, seed: int = 0):
        self.n, self.nbytes, self.seed = n, nbytes, seed
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls += 1
        return fixed_sample(int(i), self.nbytes, self.seed)


class VarDataset(FixedDataset):
    """Like FixedDataset, but sample ``i`` holds ``lo..hi`` bytes (variable size)."""

    def __init__(self, n: int, lo: int = 1000, hi: int = 8000, seed: int = 0):
        super().__init__(n, 0, seed)
        self.lo, self.hi = lo, hi

    def __getitem__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(i)
        self.calls += 1
        return var_sample(int(i), self.lo, self.hi, self.seed)

    def payload_bytes(self) -> int:
        return sum(var_len(i, self.lo, self.hi, self.seed) + 8 for i in range(self.n))


class TorchDataset:
    """A map-style dataset of dicts of torch tensors (image float32, mask bool, label int)."""

    def __init__(self, n: int, seed: int = 0):
        self.n, self.seed = n, seed

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import torch

        if not 0 <= i < self.n:
            raise IndexError(i)
        arr, label = fixed_sample(int(i), 3 * 8 * 8 * 4, self.seed)
        image = torch.from_numpy(arr.view(np.float32).reshape(3, 8, 8).copy())
        image = torch.nan_to_num(image)  # random bits: keep the values comparable
        return {"image": image, "mask": torch.from_numpy(arr[:16] > 127), "label": label}


def value_for_key(key) -> object:
    """The 'source' value of a key in the get(key, fn) tests: varies in size and structure."""
    if isinstance(key, int):
        n = 16 + (key * 37) % 400
        arr, label = fixed_sample(key, n, 1)
        return {"data": arr, "key": key, "half": key / 2}
    data = key.encode() if isinstance(key, str) else bytes(key)
    return (data * 3, len(data), math.pi)


# --- worker functions (multiprocessing targets; results go back through a queue) ---------------


def _report(queue, fn, *args) -> None:
    try:
        queue.put(("ok", fn(*args)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent, with its traceback
        queue.put(("error", traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


def shard_worker(queue, barrier, rank, world, n, kinds, seed) -> None:
    _report(queue, lambda: [_shard_worker(barrier, rank, world, n, kind, seed) for kind in kinds])


def _shard_worker(barrier, rank, world, n, kind, seed):
    """Epoch 1: read shard ``rank``; epoch 2: a reshuffled shard; every value checked bit for bit."""
    from shmcache import ShmDatasetCache

    src = FixedDataset(n, 3072, seed) if kind == "fixed" else VarDataset(n, seed=seed)
    cache = ShmDatasetCache(session="shards", size=256)  # name=None: from the fingerprint
    ds = cache.wrap(src)
    barrier.wait(timeout=60)
    calls_before = src.calls
    mine = np.arange(rank, n, world)
    for lo in range(0, len(mine), 256):
        idx = mine[lo:lo + 256].tolist()
        for i, value in zip(idx, ds.__getitems__(idx)):
            assert_same(value, _expected(kind, i, seed), f"epoch 1 sample {i}")
    epoch1_calls = src.calls - calls_before
    barrier.wait(timeout=60)
    perm = np.random.default_rng(1234).permutation(n)
    theirs = perm[rank::world]
    calls_before = src.calls
    for lo in range(0, len(theirs), 256):
        idx = theirs[lo:lo + 256].tolist()
        for i, value in zip(idx, ds.__getitems__(idx)):
            assert_same(value, _expected(kind, i, seed), f"epoch 2 sample {i}")
    epoch2_calls = src.calls - calls_before
    barrier.wait(timeout=60)
    stats = cache.stats() if rank == 0 else None
    barrier.wait(timeout=60)
    cache.close()
    return {"kind": kind, "rank": rank, "epoch1_calls": epoch1_calls, "epoch2_calls": epoch2_calls,
            "epoch2_reads": len(theirs), "stats": stats, "name": cache.name}


def _expected(kind, i, seed):
    return fixed_sample(i, 3072, seed) if kind == "fixed" else var_sample(i, seed=seed)


def random_get_worker(queue, barrier, rank, keys, ops, name) -> None:
    _report(queue, _random_get_worker, barrier, rank, keys, ops, name)


def _random_get_worker(barrier, rank, keys, ops, name):
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="overlap", name=name, size=64)
    rng = np.random.default_rng(rank)
    computed = []
    barrier.wait(timeout=60)

    def fn(k):
        computed.append(k)
        return value_for_key(k)

    for j in rng.integers(0, len(keys), ops):
        key = keys[j]
        assert_same(cache.get(key, fn), value_for_key(key), f"key {key!r}")
    barrier.wait(timeout=60)
    cache.close()
    return {"rank": rank, "computed": len(computed)}


def hold_slot_until_stdin_closes(session: str) -> None:
    """Subprocess body: attach to ``session`` (a liveness slot), say so, wait for stdin to close."""
    from shmcache.cache import process_slot
    from shmcache.cache.registry import SessionRegistry

    registry = SessionRegistry()
    registry.ensure(session)
    process_slot.slot(registry, session)
    print("attached", flush=True)
    sys.stdin.read()


@contextlib.contextmanager
def process_attached_to(session: str):
    """A subprocess attached to ``session`` (it holds a liveness slot) until the block ends."""
    code = (f"import sys; sys.path.insert(0, {HERE!r}); import _workers; "
            f"_workers.hold_slot_until_stdin_closes({session!r})")
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout.readline().strip() == "attached"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
