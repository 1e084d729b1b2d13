"""CUDA paths of PrefetchRing and sink_loop: pinned slots, side-stream copies, events, CUDA graphs.

Skipped without CUDA (capability probe). On a GPU machine: ``pytest tests/gpu -m gpu -q``.
"""

from __future__ import annotations

import itertools
import threading
import time
import warnings

import pytest
import torch
import torch.nn.functional as F

from shmcache.data.prefetch import PrefetchRing
from shmcache.data.sink import sink_loop
from shmcache.errors import InvalidArgument, PrefetchError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (capability probe)"),
]

# torch.cuda._sleep spins for a number of GPU clock cycles; ~1-2 GHz makes this 0.25-0.5 s.
_LONG_GPU_SLEEP_CYCLES = 500_000_000


@pytest.fixture(autouse=True)
def no_thread_left_behind():
    before = set(threading.enumerate())
    yield
    deadline = time.monotonic() + 5.0
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before, "a thread outlived its test"
    torch.cuda.synchronize()


# -- PrefetchRing --------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [1, 2, 3])
def test_ring_yields_source_values_in_order_from_fixed_buffers(depth):
    source = [(torch.full((64,), i, dtype=torch.int64), i) for i in range(2000)]
    ring = PrefetchRing(source, device="cuda", depth=depth)
    copies, pointers = [], set()
    for index, (tensor, number) in enumerate(ring):
        assert tensor.is_cuda and number == index
        copies.append(tensor.clone())  # on the current stream, ordered after the slot's copy
        if index >= depth:
            pointers.add(tensor.data_ptr())
    assert torch.equal(torch.stack(copies).cpu(), torch.stack([t for t, _ in source]))
    assert len(pointers) == depth
    assert ring.buffer_allocations == 2 * depth  # one pinned + one device buffer per slot


def test_ring_does_not_overwrite_a_batch_the_gpu_is_still_reading():
    # Each batch is read only after a GPU sleep. Without the consumer_done event the producer's
    # next copy into the slot (and, behind it, its next pinned write) would land first.
    count, width = 200, 1 << 16
    source = [torch.full((width,), float(i)) for i in range(count)]
    sums = []
    for batch in PrefetchRing(source, device="cuda", depth=2):
        torch.cuda._sleep(1_000_000)
        sums.append(batch.sum())
    assert torch.stack(sums).tolist() == [float(i * width) for i in range(count)]


def test_ring_hands_over_batches_while_the_gpu_is_busy():
    source = [torch.full((1024,), float(i)) for i in range(6)]
    iterator = iter(PrefetchRing(source, device="cuda", depth=2))
    next(iterator)
    torch.cuda.synchronize()
    torch.cuda._sleep(_LONG_GPU_SLEEP_CYCLES)  # the current stream is busy from here
    started = time.perf_counter()
    second, third = next(iterator), next(iterator)
    elapsed = time.perf_counter() - started
    gpu_still_busy = not torch.cuda.current_stream().query()
    assert gpu_still_busy and elapsed < 0.1, "next() waited for the GPU instead of the event"
    assert third.tolist() == [2.0] * 1024  # correct once the stream gets there
    assert second.data_ptr() != third.data_ptr()
    iterator.close()


class PinnedCheckingCache:
    """get_batch(keys, fn=None, out=None) on samples {"x": float32 (5,) full of k, "y": k}."""

    def __init__(self) -> None:
        self.out_pinned: list[bool] = []
        self.out_sizes: list[int] = []

    def get_batch(self, keys, fn=None, out=None):
        x = torch.stack([torch.full((5,), float(k)) for k in keys])
        y = torch.tensor(list(keys))
        if out is None:
            return {"x": x, "y": y}
        self.out_pinned.append(out["x"].is_pinned() and out["y"].is_pinned())
        self.out_sizes.append(out["x"].shape[0])
        out["x"].copy_(x)
        out["y"].copy_(y)
        return out


def test_from_cache_gathers_into_pinned_slots_with_a_short_last_batch():
    cache = PinnedCheckingCache()
    key_batches = [list(range(i, i + 8)) for i in range(0, 80, 8)] + [[80, 81, 82]]
    ring = PrefetchRing.from_cache(cache, key_batches, device="cuda", depth=3)
    for keys, batch in zip(key_batches, ring, strict=True):
        assert batch["x"].is_cuda and batch["x"].shape == (len(keys), 5)
        assert batch["y"].tolist() == keys
        assert batch["x"][:, 0].tolist() == [float(k) for k in keys]
    assert cache.out_pinned == [True] * (len(key_batches) - 1)
    assert cache.out_sizes[-1] == 3
    assert ring.buffer_allocations == 3 * 2 * 2  # slots x leaves x (pinned + device)


def test_producer_error_on_cuda_surfaces_at_its_batch():
    def source():
        for i in range(4):
            yield torch.full((8,), float(i))
        raise OSError("read failed")

    got = []
    with pytest.raises(PrefetchError, match="batch 4"):
        for batch in PrefetchRing(source(), device="cuda"):
            got.append(batch[0].item())
    assert got == [0.0, 1.0, 2.0, 3.0]


# -- sink_loop -----------------------------------------------------------------------------------


def _mlp_setup(on_gpu_data: bool = True):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    ).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(16, 32, generator=generator), torch.randn(16, 1, generator=generator))
        for _ in range(8)
    ]
    if on_gpu_data:
        data = [(x.cuda(), y.cuda()) for x, y in data]

    def step_fn(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)  # inside the step, as in PyTorch's capture recipe
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return model, data, step_fn


def _parameters(model):
    return [p.detach().clone() for p in model.parameters()]


def test_graph_sink_matches_the_eager_sink():
    model, data, step_fn = _mlp_setup()
    eager = sink_loop(step_fn, data, epochs=4, sink_size=5)
    eager_parameters = _parameters(model)

    model, data, step_fn = _mlp_setup()
    graphed = sink_loop(step_fn, data, epochs=4, sink_size=5, graph=True)
    assert [r.global_step for r in graphed] == [5, 10, 15, 20]
    for got, want in zip(graphed, eager, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-6)
        assert got.loss_mean == pytest.approx(want.loss_mean, rel=1e-5, abs=1e-6)
    for got, want in zip(_parameters(model), eager_parameters, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_graph_sink_fed_by_a_prefetch_ring_matches_the_eager_sink():
    model, data, step_fn = _mlp_setup()
    eager = sink_loop(step_fn, data, epochs=3)
    eager_parameters = _parameters(model)

    model, cpu_data, step_fn = _mlp_setup(on_gpu_data=False)
    ring = PrefetchRing(cpu_data, device="cuda", depth=2)
    graphed = sink_loop(step_fn, ring, epochs=3, graph=True)
    for got, want in zip(graphed, eager, strict=True):
        assert got.loss == pytest.approx(want.loss, rel=1e-5, abs=1e-6)
    for got, want in zip(_parameters(model), eager_parameters, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("graph", [False, True])
def test_sink_synchronises_the_host_once_per_sink(graph):
    # Every synchronising CUDA call warns in "warn" mode (from the ring's thread too). The first
    # sink may synchronise more (ring warm-up; graph warm-up and capture); every later sink once.
    _, cpu_data, step_fn = _mlp_setup(on_gpu_data=False)
    ring = PrefetchRing(cpu_data, device="cuda", depth=2)
    syncs_at_boundary: list[int] = []
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")

        def count_syncs(result):
            syncs_at_boundary.append(sum("synchroniz" in str(w.message).lower() for w in caught))

        torch.cuda.set_sync_debug_mode("warn")
        try:
            sink_loop(step_fn, ring, epochs=4, sink_size=10, graph=graph, callbacks=count_syncs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    per_sink = [later - earlier for earlier, later in itertools.pairwise(syncs_at_boundary)]
    assert per_sink == [1, 1, 1], [str(w.message) for w in caught]


def test_graph_rejects_a_batch_of_another_shape():
    _, data, step_fn = _mlp_setup()
    data = data[:4] + [(data[4][0][:3], data[4][1][:3])]  # warm-up 3, capture 1, then a short one
    with pytest.raises(InvalidArgument, match="drop_last"):
        sink_loop(step_fn, data, epochs=1, graph=True)


def test_graph_refuses_batches_on_the_cpu():
    _, cpu_data, step_fn = _mlp_setup(on_gpu_data=False)
    with pytest.raises(InvalidArgument, match="PrefetchRing"):
        sink_loop(step_fn, cpu_data, epochs=1, graph=True)
