"""sink_loop on the CPU: sink/epoch counts, continuation across epochs, equality with an eager loop,
no host read of a loss inside a sink, non-finite losses, arguments and monitors.

The CUDA paths (graph=True, one device sync per sink) are in tests/gpu/test_gpu_paths.py.
"""

from __future__ import annotations

import math
import threading
from typing import ClassVar

import pytest
import torch

from shmcache.data.prefetch import PrefetchRing
from shmcache.data.sink import LossMonitor, SinkResult, TimeMonitor, sink_loop
from shmcache.errors import InvalidArgument


class Recorder:
    """A step_fn that records which batch ids it saw and returns a loss tensor."""

    def __init__(self, losses=None):
        self.ids: list[int] = []
        self._losses = losses  # global step (1-based) -> loss; default: the batch id

    def __call__(self, batch):
        self.ids.append(int(batch["id"]))
        step = len(self.ids)
        value = self._losses.get(step, 1.0) if self._losses is not None else float(batch["id"])
        return torch.tensor(value)


def _batches(count):
    return [{"id": i, "x": torch.full((2,), float(i))} for i in range(count)]


# -- sinks and epochs ----------------------------------------------------------------------------


def test_sink_size_minus_one_runs_one_sink_per_epoch_over_the_whole_data():
    step, seen = Recorder(), []
    results = sink_loop(step, _batches(10), epochs=3, callbacks=[seen.append])
    assert seen == results and len(results) == 3  # one callback call per sink, one sink per epoch
    assert [r.epoch for r in results] == [1, 2, 3]
    assert [r.steps for r in results] == [10, 10, 10]
    assert [r.global_step for r in results] == [10, 20, 30]
    assert step.ids == list(range(10)) * 3
    assert results[0].loss == 9.0 and results[0].loss_mean == 4.5
    assert all(isinstance(r, SinkResult) and r.wall_s >= 0 for r in results)


def test_sink_size_continues_across_epochs_and_wraps_around_the_data():
    class CountingIterable:  # re-iterable; counts how often the loop restarted the data
        def __init__(self, items):
            self.items, self.passes = items, 0

        def __iter__(self):
            self.passes += 1
            return iter(self.items)

    data = CountingIterable(_batches(10))
    step = Recorder()
    monitor = LossMonitor(print_fn=lambda line: None)  # a lone callable, not in a list
    results = sink_loop(step, data, epochs=6, sink_size=4, callbacks=monitor)
    assert step.ids == [i % 10 for i in range(24)]  # one continuous order, wrapping twice
    assert [r.steps for r in results] == [4] * 6
    assert [r.global_step for r in results] == [4, 8, 12, 16, 20, 24]
    assert [r.loss for r in results] == [3.0, 7.0, 1.0, 5.0, 9.0, 3.0]  # last batch id of each sink
    assert data.passes == 3


def test_sink_size_larger_than_the_data_wraps_inside_one_sink():
    step = Recorder()
    results = sink_loop(step, _batches(3), epochs=2, sink_size=7)
    assert step.ids == [0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1]
    assert [r.global_step for r in results] == [7, 14]


def test_a_prefetch_ring_feeds_the_sink_and_is_stopped_afterwards():
    ring = PrefetchRing(_batches(10), device="cpu", depth=2)
    step = Recorder()
    sink_loop(step, ring, epochs=3, sink_size=4)
    assert step.ids == [i % 10 for i in range(12)]
    assert not [t for t in threading.enumerate() if t.name.startswith("shmcache-prefetch")]


def test_a_failing_step_propagates_and_stops_the_feeding_ring():
    def step_fn(batch):
        if batch["id"] == 5:
            raise RuntimeError("CUDA out of memory (pretend)")
        return torch.tensor(0.0)

    for sink_size in (-1, 3):
        ring = PrefetchRing(_batches(10), device="cpu", depth=2)
        with pytest.raises(RuntimeError, match="pretend"):
            sink_loop(step_fn, ring, epochs=2, sink_size=sink_size)
        # the traceback still references the loop's frames; the ring's producer must be gone anyway
        assert not [t for t in threading.enumerate() if t.name.startswith("shmcache-prefetch")]


# -- same training as an eager loop --------------------------------------------------------------


def _linear_setup():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    generator = torch.Generator().manual_seed(1)
    data = [
        (torch.randn(8, 4, generator=generator), torch.randn(8, 1, generator=generator))
        for _ in range(6)
    ]

    def step_fn(batch):
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return model, data, step_fn


@pytest.mark.parametrize("sink_size", [-1, 4])
def test_final_loss_and_weights_equal_an_eager_per_step_loop(sink_size):
    epochs = 5
    model, data, step_fn = _linear_setup()
    steps = epochs * (len(data) if sink_size == -1 else sink_size)
    eager_losses = [step_fn(data[i % len(data)]).item() for i in range(steps)]
    eager_weight, eager_bias = model.weight.detach().clone(), model.bias.detach().clone()

    model, data, step_fn = _linear_setup()
    results = sink_loop(step_fn, data, epochs=epochs, sink_size=sink_size)
    assert results[-1].global_step == steps
    assert results[-1].loss == eager_losses[-1]  # float32 -> float: the same number, exactly
    first_sink = eager_losses[: results[0].steps]
    assert results[0].loss_mean == pytest.approx(sum(first_sink) / len(first_sink), rel=1e-12)
    assert torch.equal(model.weight, eager_weight) and torch.equal(model.bias, eager_bias)


# -- no host synchronisation inside a sink -------------------------------------------------------


class SpiedLoss(torch.Tensor):
    """A loss tensor that logs every read that would synchronise a device with the host."""

    log: ClassVar[list[str]] = []
    READS: ClassVar[set[str]] = {
        "item",
        "tolist",
        "cpu",
        "numpy",
        "__float__",
        "__bool__",
        "__format__",
        "__repr__",
    }

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in cls.READS:
            cls.log.append(f"read:{name}")
        return super().__torch_function__(func, types, args, kwargs or {})


def test_losses_are_read_only_at_the_sink_boundary():
    SpiedLoss.log = []

    def step_fn(batch):
        SpiedLoss.log.append("step")
        return torch.tensor(float(batch["id"])).as_subclass(SpiedLoss)

    def mark_boundary(result):
        SpiedLoss.log.append("callback")

    sink_loop(step_fn, _batches(5), epochs=3, sink_size=4, callbacks=mark_boundary)
    sinks = "|".join(SpiedLoss.log).split("callback")[:-1]
    assert len(sinks) == 3
    for sink in sinks:
        events = [e for e in sink.split("|") if e]
        last_step = max(i for i, e in enumerate(events) if e == "step")
        assert events.count("step") == 4
        reads = [i for i, e in enumerate(events) if e.startswith("read:")]
        assert reads and min(reads) > last_step, f"a loss was read inside the sink: {events}"
        assert events.count("read:cpu") == 1, f"one transfer per sink, got {events}"


# -- non-finite losses ---------------------------------------------------------------------------


def test_non_finite_loss_raises_at_the_sink_boundary_naming_its_step():
    step = Recorder(losses={7: math.nan, 9: math.inf})
    seen = []
    with pytest.raises(FloatingPointError, match="global step 7") as caught:
        sink_loop(step, _batches(10), epochs=4, sink_size=5, callbacks=seen.append)
    assert len(step.ids) == 10  # the sink ran to its end; nothing after it
    assert [r.nonfinite_step for r in seen] == [None, 7]  # callbacks saw the failing sink first
    assert caught.value.results == seen
    assert math.isnan(seen[1].loss_mean)


def test_non_finite_loss_can_be_reported_without_stopping():
    step = Recorder(losses={3: math.inf})
    results = sink_loop(step, _batches(4), epochs=3, raise_on_nonfinite=False)
    assert [r.nonfinite_step for r in results] == [3, None, None]
    assert results[0].loss == 1.0 and math.isinf(results[0].loss_mean)


# -- monitors ------------------------------------------------------------------------------------


def test_loss_and_time_monitors_print_one_line_per_sink():
    lines: list[str] = []
    sink_loop(
        Recorder(losses={6: math.nan}),
        _batches(3),
        epochs=2,
        callbacks=[LossMonitor(print_fn=lines.append), TimeMonitor(print_fn=lines.append)],
        raise_on_nonfinite=False,
    )
    assert len(lines) == 4
    assert lines[0].startswith("epoch: 1 step: 3, loss is 1 ")
    assert "non-finite" not in lines[0]
    assert lines[1].startswith("epoch: 1 sink time: ") and "per step time: " in lines[1]
    assert lines[2].startswith("epoch: 2 step: 6, loss is nan")
    assert "non-finite loss first at step 6" in lines[2]


# -- arguments and data --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, named",
    [
        ({"sink_size": 0}, "sink_size"),
        ({"sink_size": -2}, "sink_size"),
        ({"sink_size": 2.5}, "sink_size"),
        ({"epochs": 0}, "epochs"),
        ({"epochs": True}, "epochs"),
        ({"callbacks": [print, 3]}, r"callbacks\[1\]"),
        ({"callbacks": 3}, "callbacks"),
        ({"graph": "yes"}, "graph"),
        ({"graph_warmup_steps": 0}, "graph_warmup_steps"),
    ],
)
def test_invalid_arguments_name_the_argument(kwargs, named):
    with pytest.raises(InvalidArgument, match=named):
        sink_loop(Recorder(), _batches(2), **{"epochs": 1, **kwargs})


def test_step_fn_must_be_callable_and_return_a_scalar_loss():
    with pytest.raises(InvalidArgument, match="step_fn must be callable"):
        sink_loop("not a function", _batches(2), epochs=1)
    with pytest.raises(InvalidArgument, match=r"scalar loss.*global step 1.*\(2,\)"):
        sink_loop(lambda batch: torch.ones(2), _batches(2), epochs=1)
    with pytest.raises(InvalidArgument, match="NoneType"):
        sink_loop(lambda batch: None, _batches(2), epochs=1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_graph_without_cuda_is_refused_with_the_fix():
    with pytest.raises(InvalidArgument, match="graph=False"):
        sink_loop(Recorder(), _batches(2), epochs=1, graph=True)


@pytest.mark.parametrize("sink_size", [-1, 3])
def test_empty_batches_are_an_error(sink_size):
    with pytest.raises(InvalidArgument, match="no batch"):
        sink_loop(Recorder(), [], epochs=1, sink_size=sink_size)


def test_one_shot_iterator_exhausted_in_a_later_epoch_is_named():
    with pytest.raises(InvalidArgument, match="epoch 2.*one-shot iterator"):
        sink_loop(Recorder(), iter(_batches(3)), epochs=2)
    step = Recorder()
    with pytest.raises(InvalidArgument, match="one-shot iterator"):
        sink_loop(step, (b for b in _batches(3)), epochs=2, sink_size=2)
    assert step.ids == [0, 1, 2]  # it ran out after the first traversal, inside epoch 2
