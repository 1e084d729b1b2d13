"""The cold miss path of a wrapped map-style dataset as a user meets it: values computed on a
miss, encoded, stored, and read back warm - by a DataLoader (shuffled batches, workers) or from
another stack than the one that stored them. Whatever the cold epoch served, the warm one must
serve too: the same values, or the dataset's own again - never an error about the cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import _cold_misses as _cold
import pytest
from _cold_misses import ReusedBuffer
from _workers import HERE
from torch.utils.data import DataLoader, Dataset

from shmcache import ShmDatasetCache
from shmcache.cache import codec
from shmcache.errors import EncodeError


def _nested(depth: int) -> list:
    """``[[[...[depth]...]]]``: a list nested ``depth`` levels (a parse tree's worth of nesting)."""
    value: list = [depth]
    for _ in range(depth - 1):
        value = [value]
    return value


def _native_depth() -> int:
    """The deepest nesting ``codec.encode`` stores natively (not pickled) from this stack."""
    lo, hi = 16, sys.getrecursionlimit()
    while lo < hi:
        mid = (lo + hi + 1) // 2
        try:
            native = not codec.encode(_nested(mid)).pickled
        except EncodeError:  # too deep even to pickle
            native = False
        if not native:
            hi = mid - 1
        else:
            lo = mid
    return lo


class Trees(Dataset):
    """Samples nested ``depth`` levels deep, one a key."""

    def __init__(self, depth: int, n: int = 8):
        self.depth, self.n = depth, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return {"i": i, "tree": _nested(self.depth)}

    def __getitems__(self, indices):
        return [self[i] for i in indices]


def _deeper(frames: int, fn):
    """``fn()`` called ``frames`` Python frames further down (a training framework's stack)."""
    return fn() if frames <= 0 else _deeper(frames - 1, fn)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_deeply_nested_sample_stored_natively_is_read_back_from_a_deeper_stack(num_workers):
    """Defect: a sample nested a few hundred levels deep is encoded natively (a layout node per
    level) when the stack that stores it has room to walk it, but decoding it walks the layout
    recursively too (nested closures, two frames a level), so from a deeper stack - the DataLoader
    of a training loop a framework calls, a worker - the warm read hits the recursion limit, and
    the cache reports the record as damaged (CorruptSegment: "its bytes are damaged. Clear the
    cache"), which clearing cannot fix: the value is stored the same way again. The cold epoch
    served it; the warm one raises. A nesting past a fixed bound should be stored so that any
    stack reads it (pickle loads it without recursion), or a read that cannot decode it should
    compute it again, never call it damage."""
    depth = _native_depth() - 20  # stored natively from here, with room to spare
    cache = ShmDatasetCache(size=16)
    source = Trees(depth)
    ds = cache.wrap(source)
    for i in range(len(source)):  # a warm-up from a plain loop: every sample stored, as computed
        assert ds[i] == source[i]
    assert cache.stats()["items_mem"] == len(source)

    def warm_epoch():
        got, loader = [], iter(DataLoader(ds, batch_size=4, shuffle=True, num_workers=num_workers, collate_fn=list))
        try:
            for batch in loader:
                got.extend(batch)
        except Exception as exc:  # noqa: BLE001 - said below, short (the values are deep)
            return f"{type(exc).__name__}: {str(exc).splitlines()[-1][:400]}"
        finally:
            if num_workers:
                loader._shutdown_workers()  # the traceback would keep them alive past the test
        return got

    got = _deeper(60, warm_epoch)
    assert not isinstance(got, str), f"the warm epoch raised {got}"
    same = sorted(got, key=lambda s: s["i"]) == [source[i] for i in range(len(source))]
    assert same, "the warm epoch served other values than the dataset's"
    assert cache.stats()["corrupt"] == 0


_HOLDER = """
import sys
sys.path.insert(0, {here!r})
from _cold_misses import ReusedBuffer
from shmcache import ShmDatasetCache

ds = ShmDatasetCache(name="reused", size=16).wrap(ReusedBuffer())
ds.__getitems__({keys!r})  # blocks in the source, holding the claims of these keys
"""


def test_a_cold_batch_computed_in_two_calls_serves_each_sample_as_computed(tmp_path, monkeypatch):
    """Defect: a cold batch whose keys another process holds (claims: it computes them, here a
    slow or stopped holder) is computed in two calls of the dataset's ``__getitems__``: the keys
    this process claimed first, then - after the wait - the ones the holder left. Samples that
    the first call returned are served after the second call ran. torch's fetcher calls
    ``__getitems__`` once a batch and collates before the next call, so a source that returns
    views of one reused buffer (valid until its next call) is right under torch; through the
    cache, the first call's samples are overwritten by the second's before they are collated:
    the batch serves key 5's and 6's values at the positions of keys 10 and 11 (what was stored
    is right: it was encoded before the second call). The cache should serve what it stored (or
    a copy) for samples of an earlier call, or call the source once a batch."""
    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "0.5")  # the holder is waited for half a second
    ready = tmp_path / "holding"
    env = {**os.environ, _cold.ENV_HOLD: "5,6", _cold.ENV_READY: str(ready),
           "PYTHONPATH": os.pathsep.join(sys.path)}
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER.format(here=HERE, keys=[5, 6])], env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists():
            assert holder.poll() is None, f"the holder exited: {holder.communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "the holder never began computing keys 5 and 6"
            time.sleep(0.02)
        source = ReusedBuffer()
        ds = ShmDatasetCache(name="reused", size=16).wrap(source)
        order = [5, 6, 10, 11, 12, 13]
        batch = next(iter(DataLoader(ds, batch_size=len(order), sampler=order)))
        assert batch[:, 0].tolist() == order, "the cold batch served other samples than its keys'"
        assert [int(ds[i][0]) for i in order] == order  # what was stored
    finally:
        holder.kill()
        holder.communicate(timeout=30)
