"""The vectorised gather (gather.py) by each of its copies: small records through the per-thread
scratch, large fields by np.take in units, odd-sized fields by a loop or a fancy index, and the
planned batch that warm batches take (a fancy index per field, a row loop for large ones). Every
one must give the items' exact bytes, write nothing outside ``out=``, and recycle large outputs."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from shmcache import ShmDatasetCache
from shmcache.cache import gather

pytestmark = pytest.mark.usefixtures("row_copy")  # each test with both row copies (conftest)

# (image shape, keys): 3 KB records (scratch), 12 KB ones past SCRATCH_BYTES (units of 256 bytes),
# an odd size whose unit is under MIN_UNIT (a fancy index), fields past LOOP_BYTES (a row loop)
SHAPES = [((32, 32, 3), 256), ((64, 64, 3), 256), ((1001,), 300), ((5, 4099), 120), ((96, 96, 3), 100)]
IDS = ["3KB-scratch", "12KB-units", "odd-fancy", "odd-loop", "27KB-loop"]


def _item(i: int, shape: tuple) -> tuple:
    return np.random.default_rng(i).integers(0, 256, shape, dtype=np.uint8), i * 7


@pytest.fixture(params=list(zip(SHAPES, IDS)), ids=IDS)
def filled(request, monkeypatch):
    (shape, n) = request.param[0]
    if request.param[1] == "odd-fancy":  # a batch this small would go through the scratch
        monkeypatch.setattr(gather, "SCRATCH_BYTES", 0)
    cache = ShmDatasetCache(session="gather", name=request.param[1], size=64)
    for i in range(n):
        cache.put(i, _item(i, shape))
    yield cache, shape, n
    cache.close()


def test_every_path_gathers_the_items_bytes(filled):
    cache, shape, n = filled
    keys = np.random.default_rng(1).permutation(n)[:n - 3]
    for _ in range(3):  # the long way, then the planned batch (gather_planned) twice
        img, lab = cache.get_batch(keys)
        for j, k in enumerate(keys.tolist()):
            assert np.array_equal(img[j].numpy(), _item(k, shape)[0]), k
        assert lab.tolist() == [k * 7 for k in keys.tolist()]


def test_out_is_filled_exactly_and_nothing_around_it_is_written(filled):
    """np.take(mode="clip") with out=: the keys were checked, so clip never clips, and only the
    bytes of out are written - here out lies inside a larger buffer whose guard bytes must stay."""
    cache, shape, n = filled
    keys = np.arange(n)[::-1].copy()
    size = n * int(np.prod(shape))
    guard = 4096
    backing = torch.full((guard + size + guard,), 0xAB, dtype=torch.uint8)
    labels = torch.full((n + 2,), -5, dtype=torch.int64)
    out = (backing[guard:guard + size].view(n, *shape), labels[1:n + 1])
    for _ in range(3):  # the long way, then the planned batch (gather_planned) twice
        out[0].zero_()
        assert cache.get_batch(keys, out=out) is out
        assert (backing[:guard] == 0xAB).all() and (backing[guard + size:] == 0xAB).all()
        assert labels[0] == -5 and labels[-1] == -5
        for j, k in enumerate(keys.tolist()):
            assert np.array_equal(out[0][j].numpy(), _item(k, shape)[0]), k
        assert out[1].tolist() == [k * 7 for k in keys.tolist()]


def test_a_dropped_large_batch_is_gathered_into_again_as_a_training_loop_holds_it():
    """``for keys in batches: batch = cache.get_batch(keys)`` holds the previous batch until the
    next one is assigned: two output buffers take turns, never a fresh one per batch."""
    cache = ShmDatasetCache(session="gather", name="recycle", size=64)
    try:
        for i in range(300):
            cache.put(i, (np.full((96, 96, 3), i % 250, np.uint8), i))  # 256 x 27 KB: above MIN_BYTES
        seen = set()
        batch = None
        for start in range(8):
            batch = cache.get_batch(list(range(start, start + 256)))
            seen.add(batch[0].data_ptr())
            assert int(batch[0][0, 0, 0, 0]) == start
        assert len(seen) == 2, seen
        del batch
    finally:
        cache.close()


def test_threads_gathering_small_batches_at_once_each_get_their_own_items():
    """The scratch small batches go through is per thread (a DataLoader's pin-memory thread gathers
    next to the main thread)."""
    cache = ShmDatasetCache(session="gather", name="threads", size=64)
    try:
        for i in range(512):
            cache.put(i, (np.full(3000, i % 251, np.uint8), i))
        errors = []

        def work(offset):
            try:
                for r in range(200):
                    keys = np.arange(offset, offset + 200) if r % 2 else np.arange(offset + 200, offset, -1)
                    img, lab = cache.get_batch(keys)
                    assert torch.equal(lab, torch.from_numpy(keys))
                    assert torch.equal(img[:, 0], torch.from_numpy(keys % 251).to(torch.uint8))
            except BaseException as exc:  # noqa: BLE001 - reported by the main thread
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(o,)) for o in (0, 256)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
    finally:
        cache.close()


def test_gather_rows_reads_only_the_field_of_each_row():
    """gather_rows: rows of 4160 bytes with a field of 1024 or 4096 (units of 64 bytes: a fancy
    index), rows of 8192 with a field of 2048 or 8 (one unit a row: one take), of 12544 with one of
    12288 (48 units of 256 a row), of 20000 with one of 16384 at 3000 (a row loop)."""
    for chunk, offset, nbytes in ((4160, 64, 1024), (4160, 64, 4096), (8192, 512, 2048), (8192, 8, 8),
                                  (12544, 64, 12288), (20000, 3000, 16384)):
        rows = np.random.default_rng(chunk + offset).integers(0, 256, (40, chunk), dtype=np.uint8)
        chunks = np.array([39, 0, 17, 39, 5], np.intp)
        dst = np.zeros((len(chunks), nbytes), np.uint8)
        gather.gather_rows(rows, offset, chunks, dst)
        assert np.array_equal(dst, rows[chunks, offset:offset + nbytes]), (chunk, offset, nbytes)


def test_out_tensors_that_require_grad_are_filled_through_a_detached_view():
    cache = ShmDatasetCache(session="gather", name="grad", size=16)
    try:
        for i in range(8):
            cache.put(i, (np.full(5, i, np.float32), i))
        out = (torch.zeros((8, 5), requires_grad=True), torch.zeros(8, dtype=torch.int64))
        assert cache.get_batch(list(range(8))[::-1], out=out) is out
        assert out[0][:, 0].tolist() == [7.0, 6.0, 5.0, 4.0, 3.0, 2.0, 1.0, 0.0] and out[0].requires_grad
        with pytest.raises(Exception, match="CPU memory"):
            cache.get_batch(list(range(8)), out=(torch.zeros((8, 5), device="meta"), out[1]))
    finally:
        cache.close()


@pytest.mark.parametrize("scratch", [True, False], ids=["scratch", "per-field"])
def test_empty_and_bfloat16_fields_gather_by_either_path(scratch, monkeypatch):
    if not scratch:
        monkeypatch.setattr(gather, "SCRATCH_BYTES", 0)
    cache = ShmDatasetCache(session="gather", name="kinds", size=16)
    try:
        for i in range(6):
            cache.put(i, {"empty": np.zeros((0, 3), np.float32), "bf": torch.full((4,), float(i), dtype=torch.bfloat16),
                          "k": i})
        for _ in range(3):  # the long way, then the planned batch (gather_planned) twice
            got = cache.get_batch([5, 0, 3])
            assert got["empty"].shape == (3, 0, 3) and got["bf"].dtype == torch.bfloat16
            assert got["bf"][:, 0].tolist() == [5.0, 0.0, 3.0] and got["k"].tolist() == [5, 0, 3]
            out = {"empty": torch.zeros((3, 0, 3)), "bf": torch.zeros((3, 4), dtype=torch.bfloat16),
                   "k": torch.zeros(3, dtype=torch.int64)}
            assert cache.get_batch([1, 2, 4], out=out) is out
            assert out["bf"][:, 3].tolist() == [1.0, 2.0, 4.0] and out["k"].tolist() == [1, 2, 4]
    finally:
        cache.close()
