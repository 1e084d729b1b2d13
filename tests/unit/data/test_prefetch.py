"""PrefetchRing on the CPU: order and values, fixed buffers, lifetime, errors, stalls and shutdown.

The CUDA paths (pinned buffers, side stream, events) are in tests/gpu/test_gpu_paths.py.
"""

from __future__ import annotations

import collections
import gc
import threading
import time

import numpy as np
import pytest
import torch

from shmcache.data.prefetch import PrefetchRing
from shmcache.errors import InvalidArgument, PrefetchError, PrefetchStall

DEVICE = "cpu"  # explicit: the same tests must not silently move to a GPU when one is present


def _prefetch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("shmcache-prefetch")]


def _wait_for_threads(select, timeout_s: float = 5.0) -> list[threading.Thread]:
    """The threads ``select()`` returns once they are gone, or after ``timeout_s``, those still alive."""
    deadline = time.monotonic() + timeout_s
    while select() and time.monotonic() < deadline:
        time.sleep(0.01)
    return select()


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    before = set(threading.enumerate())
    yield
    gc.collect()  # an iterator dropped inside a reference cycle stops its producer here
    assert not _wait_for_threads(_prefetch_threads), "a prefetch producer thread outlived its test"
    # Other threads get the same grace: a DataLoader's queues stop their feeder threads on close()
    # but do not join them, so one may still be finishing when the test returns.
    extra = _wait_for_threads(lambda: [t for t in threading.enumerate() if t not in before])
    assert not extra, f"threads outlived their test: {extra}"


def _numbered(count: int, width: int = 4) -> list[tuple[torch.Tensor, int]]:
    """Batch i is (a tensor full of i, i): its values say where it came from."""
    return [(torch.full((width,), i, dtype=torch.int64), i) for i in range(count)]


# -- order, values, buffers ----------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_yields_every_batch_in_order_with_the_source_values(depth):
    source = _numbered(3000)
    seen = []
    for tensor, number in PrefetchRing(source, device=DEVICE, depth=depth):
        assert torch.equal(tensor, source[number][0])
        seen.append(number)
    assert seen == list(range(3000))


def test_slot_buffers_are_allocated_once_and_reused():
    depth = 3
    ring = PrefetchRing(_numbered(600), device=DEVICE, depth=depth)
    pointers_after_warmup = set()
    allocations_after_warmup = None
    for index, (tensor, _) in enumerate(ring):
        if index == depth:
            allocations_after_warmup = ring.buffer_allocations
        if index >= depth:
            pointers_after_warmup.add(tensor.data_ptr())
    assert allocations_after_warmup == depth  # one leaf x depth slots, nothing since
    assert ring.buffer_allocations == depth
    assert len(pointers_after_warmup) == depth  # every batch lands in one of the ring's slots


def test_second_pass_reuses_the_same_buffers():
    source = _numbered(50)
    ring = PrefetchRing(source, device=DEVICE, depth=2)
    first = [number for _, number in ring]
    allocations = ring.buffer_allocations
    second = [(tensor.clone(), number) for tensor, number in ring]
    assert first == list(range(50)) == [number for _, number in second]
    assert all(torch.equal(tensor, source[n][0]) for tensor, n in second)
    assert ring.buffer_allocations == allocations


def test_short_last_batch_is_a_narrowed_view_without_allocation():
    source = [torch.arange(8 * 3).reshape(8, 3) + 100 * i for i in range(5)]
    source.append(torch.arange(3 * 3).reshape(3, 3) + 500)
    ring = PrefetchRing(source, device=DEVICE, depth=2)
    out = [batch.clone() for batch in ring]
    assert [tuple(b.shape) for b in out] == [(8, 3)] * 5 + [(3, 3)]
    assert all(torch.equal(got, want) for got, want in zip(out, source, strict=True))
    assert ring.buffer_allocations == 2


def test_larger_batch_grows_its_slot_once_then_reuses_it():
    small, large = torch.ones(4), torch.ones(64)  # 16 B vs 256 B: past the 64 B rounding
    source = [small * i for i in range(4)] + [large * i for i in range(4, 10)]
    ring = PrefetchRing(source, device=DEVICE, depth=2)
    out = [batch.clone() for batch in ring]
    assert all(torch.equal(got, want) for got, want in zip(out, source, strict=True))
    assert ring.buffer_allocations == 2 + 2  # each slot grew once for the larger shape


def test_nested_dict_tuple_namedtuple_numpy_and_python_scalars():
    Pair = collections.namedtuple("Pair", "left right")
    source = [
        {
            "image": torch.full((2, 2), float(i)),
            "meta": (np.arange(3, dtype=np.int32) + i, i, f"name-{i}", None),
            "pair": Pair(torch.tensor([i]), [1.5, torch.tensor(i, dtype=torch.uint8)]),
            "ordered": collections.OrderedDict(b=torch.tensor([True]), a=np.float64(i)),
        }
        for i in range(20)
    ]
    for i, batch in enumerate(PrefetchRing(source, device=DEVICE, depth=2)):
        assert torch.equal(batch["image"], source[i]["image"])
        array, number, name, nothing = batch["meta"]
        assert isinstance(array, torch.Tensor) and array.dtype == torch.int32  # numpy -> tensor
        assert array.tolist() == [i, i + 1, i + 2]
        assert (number, name, nothing) == (i, f"name-{i}", None)  # passed through unchanged
        assert type(batch["pair"]) is Pair and batch["pair"].left.item() == i
        assert batch["pair"].right[0] == 1.5 and batch["pair"].right[1].item() == i
        assert type(batch["ordered"]) is collections.OrderedDict
        assert list(batch["ordered"]) == ["b", "a"] and batch["ordered"]["a"] == i


def test_read_only_numpy_source_arrays_are_copied_without_warnings():
    array = np.arange(6.0)
    array.setflags(write=False)  # torch.from_numpy would warn; filterwarnings=error turns it fatal
    (out,) = list(PrefetchRing([array], device=DEVICE))
    assert out.tolist() == array.tolist()


def test_len_follows_the_source():
    assert len(PrefetchRing(_numbered(7), device=DEVICE)) == 7
    with pytest.raises(TypeError):
        len(PrefetchRing((b for b in _numbered(3)), device=DEVICE))


# -- lifetime ------------------------------------------------------------------------------------


def test_held_batch_is_not_overwritten_while_the_producer_runs_ahead():
    source = _numbered(60, width=256)
    for tensor, number in PrefetchRing(source, device=DEVICE, depth=2):
        snapshot = tensor.clone()
        time.sleep(0.002)  # a slow step: the producer fills every other slot meanwhile
        assert torch.equal(tensor, snapshot) and torch.equal(tensor, source[number][0])


def test_yielded_batch_is_a_view_into_the_slot_valid_until_the_next_request():
    # The documented lifetime: with one slot, batch 1 lands where batch 0 was, so a batch the
    # consumer wants to keep past its next request must be cloned.
    iterator = iter(PrefetchRing(_numbered(3), device=DEVICE, depth=1))
    first, _ = next(iterator)
    kept = first.clone()
    second, _ = next(iterator)
    assert second.data_ptr() == first.data_ptr()
    assert kept.tolist() == [0] * 4 and second.tolist() == [1] * 4
    iterator.close()


# -- errors and stalls ---------------------------------------------------------------------------


def _failing_at(index: int):
    for i in range(index):
        yield torch.tensor([i])
    raise ValueError("disk on fire")


def test_producer_error_surfaces_at_its_batch_after_the_earlier_ones():
    got = []
    with pytest.raises(PrefetchError, match=r"batch 7\b.*disk on fire") as caught:
        for batch in PrefetchRing(_failing_at(7), device=DEVICE, depth=3):
            got.append(batch.item())
    assert got == list(range(7))
    assert isinstance(caught.value.__cause__, ValueError)


def test_error_while_copying_a_batch_names_that_batch():
    # A meta tensor has no data: copying it into the slot fails inside the producer, not the source.
    source = [torch.zeros(2), torch.zeros(2), torch.empty(2, device="meta"), torch.zeros(2)]
    got = []
    with pytest.raises(PrefetchError, match="batch 2") as caught:
        for batch in PrefetchRing(source, device=DEVICE):
            got.append(batch.tolist())
    assert got == [[0.0, 0.0]] * 2 and caught.value.__cause__ is not None


def test_stalling_source_raises_prefetch_stall_within_the_timeout():
    def stalls_at_batch_2():
        yield torch.tensor([0])
        yield torch.tensor([1])
        time.sleep(0.8)  # stuck; the producer can only leave once this returns
        yield torch.tensor([2])

    ring = PrefetchRing(stalls_at_batch_2(), device=DEVICE, timeout_s=0.15)
    iterator = iter(ring)
    assert next(iterator).item() == 0 and next(iterator).item() == 1
    started = time.monotonic()
    with pytest.raises(PrefetchStall, match=r"0\.15 s.*batch 2"):
        next(iterator)
    assert time.monotonic() - started < 0.6  # raised at the timeout, not when the source returned
    ring.close()  # joins the producer once the source returns
    assert not _prefetch_threads()


# -- shutdown ------------------------------------------------------------------------------------


def test_break_after_k_batches_leaves_no_thread():
    ring = PrefetchRing(_numbered(1000), device=DEVICE, depth=3)
    for index, _ in enumerate(ring):
        if index == 10:
            break
    assert not _prefetch_threads()  # the dropped iterator joined its producer right away


def test_dropping_an_iterator_before_or_after_its_first_batch_stops_the_producer():
    ring = PrefetchRing(_numbered(1000), device=DEVICE)
    iterator = iter(ring)
    del iterator  # never advanced
    assert not _prefetch_threads()
    iterator = iter(ring)
    next(iterator)
    del iterator
    assert not _prefetch_threads()


def test_close_is_idempotent_and_ends_the_iteration():
    ring = PrefetchRing(_numbered(1000), device=DEVICE)
    iterator = iter(ring)
    next(iterator)
    ring.close()
    ring.close()
    assert not _prefetch_threads()
    with pytest.raises(StopIteration):
        next(iterator)
    assert [n for _, n in ring][:3] == [0, 1, 2]  # iterating again after close starts afresh
    ring.close()


def test_context_manager_joins_the_producer():
    with PrefetchRing(_numbered(1000), device=DEVICE) as ring:
        iterator = iter(ring)
        assert [next(iterator)[1] for _ in range(3)] == [0, 1, 2]
    assert not _prefetch_threads()


def test_a_new_pass_ends_the_previous_one():
    ring = PrefetchRing(_numbered(100), device=DEVICE)
    first = iter(ring)
    next(first)
    second = iter(ring)
    with pytest.raises(StopIteration):
        next(first)
    assert [n for _, n in second] == list(range(100))


def test_exhaustion_joins_the_producer():
    ring = PrefetchRing(_numbered(5), device=DEVICE)
    iterator = iter(ring)
    assert len(list(iterator)) == 5
    assert not _prefetch_threads()


def test_source_generator_is_closed_when_the_consumer_stops_early():
    closed = threading.Event()

    def source():
        try:
            for i in range(1000):
                yield torch.tensor([i])
        finally:
            closed.set()

    for index, _ in enumerate(PrefetchRing(source(), device=DEVICE)):
        if index == 3:
            break
    assert closed.is_set()


def test_dataloader_with_workers_is_shut_down_when_the_consumer_stops_early():
    # The autouse fixture in tests/conftest.py fails the test if a worker process outlives it.
    from torch.utils.data import DataLoader, TensorDataset

    dataset = TensorDataset(torch.arange(64).reshape(32, 2), torch.arange(32))
    loader = DataLoader(dataset, batch_size=4, num_workers=2)
    ring = PrefetchRing(loader, device=DEVICE)
    assert len(ring) == 8
    for index, (_features, labels) in enumerate(ring):
        assert labels.tolist() == list(range(4 * index, 4 * index + 4))
        if index == 2:
            break
    assert not _prefetch_threads()


# -- from_cache ----------------------------------------------------------------------------------


class FakeCache:
    """The ``get_batch(keys, fn=None, out=None)`` contract of ShmDatasetCache, on a dict of samples.

    Sample k is {"x": float32 (3,) full of k, "y": int64 label k, "pair": (uint8 (2, 2), k)};
    a batch is collated like default_collate. It records each call, so tests can check what the
    ring asked.
    """

    def __init__(self, count: int) -> None:
        self.samples = {
            k: {
                "x": torch.full((3,), float(k)),
                "y": torch.tensor(k),
                "pair": (torch.full((2, 2), k % 256, dtype=torch.uint8), torch.tensor(k * 10)),
            }
            for k in range(count)
        }
        self.calls: list[tuple[list[int], object]] = []

    def get_batch(self, keys, fn=None, out=None):
        self.calls.append((list(keys), out))
        items = [self.samples[k] for k in keys]
        collated = {
            "x": torch.stack([s["x"] for s in items]),
            "y": torch.stack([s["y"] for s in items]),
            "pair": tuple(torch.stack([s["pair"][j] for s in items]) for j in range(2)),
        }
        if out is None:
            return collated
        out["x"].copy_(collated["x"])  # the real cache gathers straight from shared memory here
        out["y"].copy_(collated["y"])
        for j in range(2):
            out["pair"][j].copy_(collated["pair"][j])
        return out


def test_from_cache_gathers_into_the_slot_buffers_including_a_short_last_batch():
    cache = FakeCache(18)
    key_batches = [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15], [16, 17]]
    ring = PrefetchRing.from_cache(cache, key_batches, device=DEVICE, depth=2)
    assert len(ring) == 5
    yielded = []
    for keys, batch in zip(key_batches, ring, strict=True):
        assert batch["x"].shape == (len(keys), 3)
        assert batch["x"][:, 0].tolist() == [float(k) for k in keys]
        assert batch["y"].tolist() == keys
        assert batch["pair"][0][:, 0, 0].tolist() == keys
        assert batch["pair"][1].tolist() == [k * 10 for k in keys]
        yielded.append(batch["x"].data_ptr())
    assert cache.calls[0][1] is None  # the first call learns the layout
    for keys, out in cache.calls[1:]:
        assert out is not None and out["x"].shape == (len(keys), 3)  # [:n] views for the last batch
        assert out["pair"][0].shape == (len(keys), 2, 2)
    # On the CPU the yielded tensors are the very buffers get_batch filled: one host copy in all.
    assert [out["x"].data_ptr() for _, out in cache.calls[1:]] == yielded[1:]
    assert ring.buffer_allocations == 2 * 4  # 2 slots x 4 leaves, the short batch allocated nothing


def test_from_cache_error_in_get_batch_surfaces_at_its_batch():
    class BrokenCache(FakeCache):
        def get_batch(self, keys, fn=None, out=None):
            if 5 in keys:
                raise KeyError("missing keys: [5]")
            return super().get_batch(keys, fn, out)

    ring = PrefetchRing.from_cache(BrokenCache(8), [[0, 1], [2, 3], [4, 5], [6, 7]], device=DEVICE)
    got = []
    with pytest.raises(PrefetchError, match="batch 2") as caught:
        for batch in ring:
            got.append(batch["y"].tolist())
    assert got == [[0, 1], [2, 3]] and isinstance(caught.value.__cause__, KeyError)


def test_from_cache_passes_fn_through_and_rejects_objects_without_get_batch():
    seen_fn = []

    class RecordingCache(FakeCache):
        def get_batch(self, keys, fn=None, out=None):
            seen_fn.append(fn)
            return super().get_batch(keys, fn, out)

    def compute(key):
        return key

    list(PrefetchRing.from_cache(RecordingCache(4), [[0, 1], [2, 3]], device=DEVICE, fn=compute))
    assert seen_fn == [compute, compute]
    with pytest.raises(InvalidArgument, match="get_batch"):
        PrefetchRing.from_cache(object(), [[0]], device=DEVICE)


# -- arguments -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"depth": 0}, "depth"),
        ({"depth": 1.5}, "depth"),
        ({"timeout_s": 0}, "timeout_s"),
        ({"device": "mps"}, "CPU and CUDA"),
        ({"device": "not-a-device"}, "device"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, named):
    with pytest.raises(InvalidArgument, match=named):
        PrefetchRing([], **{"device": DEVICE, **kwargs})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_requested_without_cuda_says_how_to_fall_back():
    with pytest.raises(InvalidArgument, match="device=None"):
        PrefetchRing([], device="cuda")
    assert PrefetchRing([], device=None).device == torch.device("cpu")
