"""MindSpore's dataset-sink mode for PyTorch: many training steps per host synchronisation.

    results = sink_loop(step_fn, PrefetchRing(loader, "cuda"), epochs=10, sink_size=100,
                        callbacks=[LossMonitor(), TimeMonitor()])

``step_fn(batch)`` runs one training step and returns the loss as a (device) tensor. Inside a sink
the loop never synchronises the host with the device: it only keeps each step's loss tensor. At the
end of the sink it stacks them on the device and copies them to the host in one transfer, then
calls every callback once with a :class:`SinkResult`.

Sinks and epochs, as in MindSpore's ``model.train(..., dataset_sink_mode=True, sink_size=...)``:

- ``sink_size=-1``: one sink per epoch over the whole of ``batches``, re-iterated every epoch
  (``batches`` must be re-iterable: a list, a DataLoader, a :class:`~shmcache.PrefetchRing`).
- ``sink_size>0``: every epoch is exactly ``sink_size`` steps. The data is traversed endlessly
  (re-iterated whenever it runs out) and each epoch continues where the previous one stopped, so
  ``epochs * sink_size`` steps see the data in one continuous, wrapping order.

Non-finite losses: each result carries ``nonfinite_step``, the global step of the sink's first
non-finite loss (or None). After the callbacks have seen that result (so monitors log it),
``sink_loop`` raises ``FloatingPointError`` naming the step, unless ``raise_on_nonfinite=False``;
the results so far are attached to the error as ``.results``.

CUDA graphs (``graph=True``): the first ``graph_warmup_steps`` steps run eagerly on a side stream
(they are real steps on real batches, as PyTorch's capture recipe requires, e.g. to create optimizer
state), the next step is captured with ``torch.cuda.graph`` on a static copy of its batch, and every
later step copies its batch into those static inputs and replays the graph. The requirements are
CUDA graphs' own: every batch has the captured shapes and dtypes (use ``drop_last=True``), tensors
are already on the GPU (feed a ``PrefetchRing``), ``step_fn`` does no host synchronisation and keeps
its tensors (e.g. ``zero_grad(set_to_none=True)`` inside it is fine; ``.item()`` is not), and
non-tensor leaves of a batch are frozen at their captured values. ``graph=True`` without CUDA raises
:class:`~shmcache.errors.InvalidArgument`; there is no silent eager fallback.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable, Generator, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..base.trees import flatten, rebuild
from ..errors import InvalidArgument
from . import stall

__all__ = ["LossMonitor", "SinkResult", "TimeMonitor", "sink_loop"]

StepFn = Callable[[Any], Any]
Callback = Callable[["SinkResult"], Any]


@dataclass(frozen=True)
class SinkResult:
    """What one sink did. Steps are counted from 1 across the whole run (``global_step``)."""

    epoch: int  # 1-based
    global_step: int  # steps done in the run once this sink finished
    steps: int  # steps in this sink
    loss: float  # the sink's last loss
    loss_mean: float  # mean loss over the sink's steps
    wall_s: float  # wall time of the sink, including its one host transfer
    nonfinite_step: int | None = None  # global step of the sink's first nan/inf loss, or None


def sink_loop(
    step_fn: StepFn,
    batches: Iterable[Any],
    *,
    epochs: int,
    sink_size: int = -1,
    callbacks: Callback | Sequence[Callback] = (),
    graph: bool = False,
    graph_warmup_steps: int = 3,
    raise_on_nonfinite: bool = True,
) -> list[SinkResult]:
    """Train ``epochs`` sinks of ``step_fn`` over ``batches``, with one host sync per sink.

    Returns one :class:`SinkResult` per sink (per epoch). See the module docstring for
    ``sink_size``, non-finite losses and ``graph``.
    """
    callback_list = _check_arguments(
        step_fn, epochs, sink_size, callbacks, graph, graph_warmup_steps
    )
    step = _GraphedStep(step_fn, graph_warmup_steps) if graph else step_fn
    if not stall.measured(batches):  # a DataLoader over a wrapped dataset: count its waits
        counts = stall.counts_for(batches)
        batches = batches if counts is None else stall.Timed(batches, counts)
    endless = _endless(batches) if sink_size > 0 else None
    results: list[SinkResult] = []
    try:
        for epoch in range(1, epochs + 1):
            if endless is not None:
                sink_batches: Iterator[Any] = itertools.islice(endless, sink_size)
            else:
                sink_batches = _one_pass(batches, epoch)
            done = results[-1].global_step if results else 0
            try:
                result = _run_sink(step, sink_batches, epoch, done)
            finally:
                _close(sink_batches)  # a failing step must not leave a pass (and its ring) running
            results.append(result)
            for callback in callback_list:
                callback(result)
            if raise_on_nonfinite and result.nonfinite_step is not None:
                raise _nonfinite_error(result, results)
    finally:
        if endless is not None:
            endless.close()  # stops a PrefetchRing's producer, a DataLoader's workers, now
    return results


# -- one sink ------------------------------------------------------------------------------------


def _run_sink(step: StepFn, batches: Iterator[Any], epoch: int, steps_before: int) -> SinkResult:
    """Run the sink's steps, keeping losses on the device; one transfer at the end."""
    start = time.perf_counter()
    losses: list[torch.Tensor] = []
    for batch in batches:
        losses.append(_as_loss(step(batch), steps_before + len(losses) + 1))
    if not losses:  # _one_pass and _endless raise first; this guards an exhausted islice
        raise InvalidArgument(f"epoch {epoch} got no batch; pass a non-empty, re-iterable batches")
    host_losses = torch.stack(losses).cpu()  # the sink's one host synchronisation
    values = host_losses.tolist()
    wall_s = time.perf_counter() - start
    return SinkResult(
        epoch=epoch,
        global_step=steps_before + len(values),
        steps=len(values),
        loss=values[-1],
        loss_mean=math.fsum(values) / len(values),
        wall_s=wall_s,
        nonfinite_step=_first_nonfinite_step(values, steps_before),
    )


def _as_loss(loss: Any, global_step: int) -> torch.Tensor:
    """The step's loss as a float32 scalar tensor where it lives, without reading its value."""
    if isinstance(loss, torch.Tensor):
        if loss.numel() != 1:  # metadata only: no synchronisation
            raise InvalidArgument(
                f"step_fn must return a scalar loss; at global step {global_step} it returned a "
                f"tensor of shape {tuple(loss.shape)}. Reduce it (e.g. .mean()) inside step_fn"
            )
        return loss.detach().reshape(()).float()
    if isinstance(loss, (int, float)) and not isinstance(loss, bool):
        return torch.tensor(float(loss))  # already on the host: the step synchronised itself
    raise InvalidArgument(
        f"step_fn must return the loss as a tensor (or a number); at global step {global_step} it "
        f"returned {type(loss).__name__}. Return the loss tensor from step_fn"
    )


def _first_nonfinite_step(values: list[float], steps_before: int) -> int | None:
    for offset, value in enumerate(values, start=1):
        if not math.isfinite(value):
            return steps_before + offset
    return None


def _nonfinite_error(result: SinkResult, results: list[SinkResult]) -> FloatingPointError:
    error = FloatingPointError(
        f"loss became non-finite at global step {result.nonfinite_step} (epoch {result.epoch}); "
        f"training stopped at the end of that sink (global step {result.global_step}). Lower the "
        f"learning rate or check the data; pass raise_on_nonfinite=False to keep going"
    )
    error.results = list(results)  # type: ignore[attr-defined]  # what ran, for the caller
    return error


# -- data traversal ------------------------------------------------------------------------------


def _one_pass(batches: Iterable[Any], epoch: int) -> Iterator[Any]:
    """One traversal of ``batches`` (sink_size=-1); an empty one is an error, not an empty epoch."""
    iterator = iter(batches)
    try:
        count = 0
        for batch in iterator:
            count += 1
            yield batch
        if count == 0:
            raise _empty_batches_error(batches, epoch)
    finally:
        _close(iterator)


def _endless(batches: Iterable[Any]) -> Generator[Any, None, None]:
    """``batches`` traversed again and again (sink_size>0): each epoch goes on where one ended."""
    while True:
        yield from _one_pass(batches, None)


def _empty_batches_error(batches: Iterable[Any], epoch: int | None) -> InvalidArgument:
    where = f"in epoch {epoch}" if epoch is not None else "when traversed"
    hint = ""
    if isinstance(batches, Iterator):  # a one-shot iterator (generator): empty after its first pass
        hint = (
            "; batches is a one-shot iterator, exhausted after one pass: pass a re-iterable "
            "(a list, a DataLoader, a PrefetchRing)"
        )
    return InvalidArgument(f"batches yielded no batch {where}; pass a non-empty iterable{hint}")


def _close(iterator: Iterator[Any]) -> None:
    close = getattr(iterator, "close", None)  # generators, PrefetchRing iterators
    if callable(close):
        close()


# -- CUDA graphs ---------------------------------------------------------------------------------


class _GraphedStep:
    """``step_fn`` run eagerly for warm-up, then captured once and replayed on static inputs."""

    def __init__(self, step_fn: StepFn, warmup_steps: int) -> None:
        self._step_fn = step_fn
        self._warmup_left = warmup_steps
        self._graph: torch.cuda.CUDAGraph | None = None
        self._spec: Any = None
        self._static_leaves: list[Any] = []
        self._static_loss: torch.Tensor | None = None

    def __call__(self, batch: Any) -> torch.Tensor:
        leaves: list[Any] = []
        spec = flatten(batch, leaves)
        if self._graph is None:
            _check_on_cuda(leaves)
        if self._warmup_left > 0:
            self._warmup_left -= 1
            return self._eager_on_side_stream(batch)
        if self._graph is None:
            self._capture(spec, leaves)
        else:
            self._load(spec, leaves)
        assert self._graph is not None and self._static_loss is not None
        self._graph.replay()
        return self._static_loss.detach().clone()  # the next replay overwrites the static loss

    def _eager_on_side_stream(self, batch: Any) -> Any:
        # PyTorch's capture recipe: warm up on a side stream so lazily created state (optimizer
        # buffers, cuBLAS workspaces) is not born on the stream the capture will use.
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            loss = self._step_fn(batch)
        current.wait_stream(side)
        return loss

    def _capture(self, spec: Any, leaves: list[Any]) -> None:
        self._spec = spec
        self._static_leaves = [
            leaf.clone() if isinstance(leaf, torch.Tensor) else leaf for leaf in leaves
        ]
        static_batch = rebuild(spec, iter(self._static_leaves))
        graph = torch.cuda.CUDAGraph()
        # thread_local: a PrefetchRing's producer thread keeps querying events, copying and maybe
        # allocating pinned memory during the capture; under the default "global" mode any of those
        # in another thread invalidates the capture. The capture itself records, it does not run:
        # the replay that follows runs this step.
        with torch.cuda.graph(graph, capture_error_mode="thread_local"):
            loss = self._step_fn(static_batch)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise InvalidArgument(
                f"with graph=True, step_fn must return the loss as a scalar tensor; got "
                f"{type(loss).__name__}. Return the loss tensor (no .item()) from step_fn"
            )
        self._graph, self._static_loss = graph, loss

    def _load(self, spec: Any, leaves: list[Any]) -> None:
        """Copy a batch into the static inputs; its shapes must be the captured ones."""
        if spec != self._spec or len(leaves) != len(self._static_leaves):
            raise InvalidArgument(
                "graph=True replays a graph captured for one batch structure, and this batch's "
                "structure differs; feed batches of one structure, or pass graph=False"
            )
        for position, (static, leaf) in enumerate(zip(self._static_leaves, leaves, strict=True)):
            if not isinstance(static, torch.Tensor):
                continue  # frozen at capture (see the module docstring)
            if _describe(leaf) != _describe(static):
                raise InvalidArgument(
                    f"graph=True replays a graph captured for fixed shapes; leaf {position} of "
                    f"this batch is {_describe(leaf)} but the captured one is {_describe(static)}. "
                    f"Drop the short last batch (DataLoader(drop_last=True)) or pass graph=False"
                )
            static.copy_(leaf, non_blocking=True)


def _check_on_cuda(leaves: list[Any]) -> None:
    for position, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor) and leaf.device.type != "cuda":
            raise InvalidArgument(
                f"graph=True needs batches on the GPU; leaf {position} is on {leaf.device}. Feed "
                f"PrefetchRing(batches, device='cuda') to sink_loop"
            )


def _describe(leaf: Any) -> str:
    if isinstance(leaf, torch.Tensor):
        return f"{leaf.dtype} {tuple(leaf.shape)}"
    return type(leaf).__name__


# -- arguments -----------------------------------------------------------------------------------


def _check_arguments(
    step_fn: Any,
    epochs: Any,
    sink_size: Any,
    callbacks: Any,
    graph: Any,
    graph_warmup_steps: Any,
) -> list[Callback]:
    if not callable(step_fn):
        raise InvalidArgument(
            f"step_fn must be callable: a function taking a batch and returning its loss tensor; "
            f"got {type(step_fn).__name__}"
        )
    if not _is_int(epochs) or epochs < 1:
        raise InvalidArgument(f"epochs must be an int >= 1 (the number of sinks); got {epochs!r}")
    if not _is_int(sink_size) or not (sink_size == -1 or sink_size > 0):
        raise InvalidArgument(
            f"sink_size must be -1 (one sink per epoch over the whole data) or a positive number "
            f"of steps per sink; got {sink_size!r}"
        )
    if not isinstance(graph, bool):
        raise InvalidArgument(f"graph must be True or False; got {graph!r}")
    if graph and not torch.cuda.is_available():
        raise InvalidArgument(
            "graph=True captures step_fn in a CUDA graph, but CUDA is not available here; "
            "pass graph=False (the eager sink runs anywhere)"
        )
    if not _is_int(graph_warmup_steps) or graph_warmup_steps < 1:
        raise InvalidArgument(
            f"graph_warmup_steps must be an int >= 1 (eager steps before capture); "
            f"got {graph_warmup_steps!r}"
        )
    return _check_callbacks(callbacks)


def _check_callbacks(callbacks: Any) -> list[Callback]:
    if callable(callbacks):  # one callback passed on its own
        return [callbacks]
    try:
        callback_list = list(callbacks)
    except TypeError:
        raise InvalidArgument(
            f"callbacks must be a callable or a sequence of callables; "
            f"got {type(callbacks).__name__}"
        ) from None
    for position, callback in enumerate(callback_list):
        if not callable(callback):
            raise InvalidArgument(
                f"callbacks[{position}] is not callable ({type(callback).__name__}); a callback "
                f"is any callable taking a SinkResult, e.g. LossMonitor()"
            )
    return callback_list


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


# -- callbacks -----------------------------------------------------------------------------------


class LossMonitor:
    """Prints the loss once per sink, in MindSpore's words: ``epoch: 1 step: 100, loss is 0.25``.

    A non-finite loss is printed with the global step where it first appeared.
    """

    def __init__(self, print_fn: Callable[[str], Any] = print) -> None:
        self._print = print_fn

    def __call__(self, result: SinkResult) -> None:
        line = (
            f"epoch: {result.epoch} step: {result.global_step}, loss is {result.loss:.6g} "
            f"(mean of {result.steps} steps {result.loss_mean:.6g})"
        )
        if result.nonfinite_step is not None:
            line += f"; non-finite loss first at step {result.nonfinite_step}"
        self._print(line)


class TimeMonitor:
    """Prints each sink's wall time and the time per step: ``epoch: 1 sink time: 812.0 ms, ...``."""

    def __init__(self, print_fn: Callable[[str], Any] = print) -> None:
        self._print = print_fn

    def __call__(self, result: SinkResult) -> None:
        per_step_ms = result.wall_s * 1e3 / result.steps
        self._print(
            f"epoch: {result.epoch} sink time: {result.wall_s * 1e3:.1f} ms, "
            f"per step time: {per_step_ms:.3f} ms"
        )
