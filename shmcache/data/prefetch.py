"""Pinned-memory prefetch ring: batches from any iterable, on the device before the step needs them.

    ring = PrefetchRing(loader, device="cuda", depth=2)          # any iterable of batches
    ring = PrefetchRing.from_cache(cache, key_batches, "cuda")   # gathered from shared memory
    for batch in ring:                                           # same structure, tensors on device
        loss = step(batch)

A background thread fills a fixed ring of ``depth`` slots. Each slot owns, per tensor leaf of the
batch, a host buffer (pinned when the device is CUDA) and a device buffer, allocated on the first
batch and reused for every later one: the source batch is copied into the slot's pinned buffer
(or, with :meth:`PrefetchRing.from_cache`, gathered straight into it by
``cache.get_batch(keys, out=...)``: shared memory -> pinned -> device, one host copy), and the
host-to-device copy is issued with ``non_blocking=True`` on a side stream. The consumer's stream
waits for that copy on the GPU; the training loop's host thread never waits for a copy. See
NOTE [ring slot reuse].

Batches are nested ``dict`` / ``list`` / ``tuple`` / namedtuple structures. Tensor and numeric numpy
leaves go through the slots (numpy arrays come out as torch tensors); every other leaf (python
scalars, strings, None) is passed through unchanged. Feed host batches: a tensor already on the
GPU is copied through the slot's pinned buffer like any other (a round trip, correct but slow).

Lifetime - the one rule to know: a yielded batch is a view into its slot's buffers, and it stays
valid until the consumer asks for the next batch (on CUDA: GPU work enqueued on the then-current
stream before that request is also safe). The same holds on CPU, so code tested on CPU keeps its
meaning on a GPU. ``clone()`` what you keep longer (e.g. for logging).

Shapes: buffers are flat byte arrays sized for the largest batch a slot has seen. A shorter batch
(the short last batch) uses narrowed views, with no allocation. A larger one grows that slot's
buffer once (``buffer_allocations`` counts it) and the slot keeps the larger size from then on.

Device: ``None`` is the current CUDA device when CUDA is available, else the CPU. On the CPU the
ring works the same way (same order, same values, same lifetime rule), without pinning or streams;
the thread still overlaps producing the next batch with the step.

Errors: an exception in the producer (the source, ``cache.get_batch``, a copy) is raised in the
consumer as :class:`~shmcache.errors.PrefetchError` at the batch where it happened, after every
earlier batch was yielded, chained from the original. A consumer that waits more than ``timeout_s``
for one batch gets :class:`~shmcache.errors.PrefetchStall`.

Shutdown: the producer stops and is joined on ``close()``, on exhaustion, when the consumer stops
early (``break``, dropping the iterator, garbage collection) and on leaving a ``with`` block.
Iterating again starts a new pass over the source with the same buffers (one pass at a time: a new
pass ends the previous one).
"""

from __future__ import annotations

import contextlib
import itertools
import math
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..base.trees import flatten, rebuild
from ..errors import InvalidArgument, PrefetchError, PrefetchStall
from . import stall
from .tensors import torch_dtype

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["PrefetchRing"]

# NOTE [ring slot reuse]
#
# The ring has `depth` slots; batch i lives in slot k = i % depth. A slot owns, per tensor leaf, a
# host buffer (pinned on CUDA) and a device buffer, reused for every batch, plus two CUDA events:
#   copy_done      recorded by the producer on its side stream after the slot's H2D copies;
#   consumer_done  recorded by the consumer on its current stream when it moves past the batch;
# and a host-side state FREE -> FILLED(i) -> HELD -> FREE, guarded by the ring's condition variable.
#
# Producer (background thread), for batch i:
#   1. waits (host) until slot k is FREE: the consumer has asked for batch i-depth+1, so it has
#      finished *enqueueing* its work on batch i-depth, the slot's previous batch;
#   2. waits (host, polling copy_done) until the previous H2D copy out of slot k's pinned buffers
#      has finished: the DMA engine reads pinned memory asynchronously, so only now may the host
#      write it;
#   3. copies (or gathers, via cache.get_batch(out=...)) batch i into the pinned buffers;
#   4. on the side stream: wait_event(consumer_done), then the non_blocking H2D copies into the
#      device buffers, then records copy_done. The GPU therefore starts overwriting the device
#      buffers only after every kernel the consumer enqueued on batch i-depth has run;
#   5. marks slot k FILLED(i) and notifies.
# Consumer, for batch i: waits (host) for FILLED(i) - for the producer to have *enqueued* the copy,
# never for the copy itself -, makes its current stream wait_event(copy_done) (on the GPU), marks
# the slot HELD and yields views of the device buffers. When it asks for batch i+1 it records
# consumer_done on its current stream and only then marks slot k FREE (so step 1 happens-after
# that record).
#
# Why that is safe: pinned buffers are rewritten only after copy_done (2); device buffers are
# rewritten only by side-stream work ordered after consumer_done (4), which follows every kernel
# the consumer enqueued on the batch on its stream; the consumer's kernels run after the copy
# (copy_done). Only (2) blocks a host thread, and it is the producer's, not the training loop's.
#
# record_stream: buffers are reused, never freed, while a pass runs, so reuse needs no
# record_stream; the events above order it. But a device buffer does go back to the caching
# allocator when its slot grows or the ring closes, while consumer kernels may still read it (or
# the consumer still holds a view of it). The allocator would then hand that memory to the next
# allocation on the side stream without waiting for the consumer's stream. So every device buffer
# handed to the consumer is marked with record_stream(consumer stream): the allocator delays reuse
# until the consumer's work is done.
#
# Passes and close: a new pass (iter() again) or close() first stops and joins the producer, then
# records consumer_done on the stopping thread's current stream for the HELD slot and marks every
# slot FREE, so a batch still held when the pass stopped is protected like any other. Stopping
# because of a stall does not join (the producer is stuck inside the source); the next pass
# refuses to start until it is gone.
#
# The lifetime rule in the module docstring is this protocol seen from the user: once the consumer
# asks for batch i+1, slot k may be refilled.

_POLL_S = 0.05  # a blocked wait re-checks the stop flag this often (a stop also notifies at once)
_EVENT_POLL_S = 0.0002  # producer's poll of copy_done (usually long finished by the time it looks)
_JOIN_TIMEOUT_S = 10.0  # how long stopping waits for a producer that is inside the source
_MAX_CACHED_VIEWS = 256  # per slot; views are cached so a steady shape costs no view ops
_ALIGN_BYTES = 64  # buffer sizes round up to cache lines (aligned copies are faster)
_THREAD_NAME = "shmcache-prefetch"

_FREE, _FILLED, _HELD = "free", "filled", "held"


# -- leaves that travel through the slots --------------------------------------------------------
# A batch is the spec of its containers and a list of leaves (base.trees.flatten): the ring swaps
# the leaves (source tensor -> slot view) and rebuilds the same structure.


def _is_slot_leaf(leaf: Any) -> bool:
    """True for the leaves the ring copies to the device; anything else is passed through."""
    if isinstance(leaf, torch.Tensor):
        return leaf.layout == torch.strided
    return isinstance(leaf, np.ndarray) and torch_dtype(leaf.dtype) is not None


def _dtype_and_shape(leaf: torch.Tensor | np.ndarray) -> tuple[torch.dtype, tuple[int, ...]]:
    if isinstance(leaf, np.ndarray):
        dtype = torch_dtype(leaf.dtype)
        assert dtype is not None  # _is_slot_leaf admitted it
        return dtype, leaf.shape
    return leaf.dtype, tuple(leaf.shape)


def _copy_leaf(destination: torch.Tensor, leaf: torch.Tensor | np.ndarray) -> None:
    if isinstance(leaf, np.ndarray):
        # np.copyto, not torch.from_numpy: from_numpy warns on read-only arrays (e.g. memory maps)
        np.copyto(destination.numpy(), leaf, casting="no")
    else:
        destination.copy_(leaf)


# -- the slots -----------------------------------------------------------------------------------


class _Slot:
    """One ring position: reusable host/device buffers (a flat byte buffer per leaf) and events."""

    def __init__(self, cuda: bool) -> None:
        self.state = _FREE
        self.index = -1  # the batch it holds when FILLED or HELD
        self.batch: Any = None
        self.host: dict[int, torch.Tensor] = {}  # leaf position -> flat uint8 buffer
        self.device: dict[int, torch.Tensor] = {}
        self.views: dict[tuple[str, int, torch.dtype, tuple[int, ...]], torch.Tensor] = {}
        self.device_leaves: list[torch.Tensor] = []  # what the consumer gets, for record_stream
        self.copy_done = torch.cuda.Event() if cuda else None
        self.consumer_done = torch.cuda.Event() if cuda else None


class _Staged:
    """A batch whose array leaves now sit in a slot's host buffers (positions in ``in_slot``)."""

    def __init__(self, spec: Any) -> None:
        self.spec = spec
        self.leaves: list[Any] = []
        self.in_slot: set[int] = set()


class _Pass:
    """One traversal of the source: its producer thread and how it ended."""

    def __init__(self) -> None:
        self.stopped = False
        self.end: int | None = None  # index of the first batch that will never come
        self.error: BaseException | None = None  # why it never comes (None: the source ran out)
        self.thread: threading.Thread | None = None


class _RingIterator:
    """What ``iter(ring)`` returns; dropping it (``break``, ``del``, GC) stops the producer."""

    def __init__(self, ring: PrefetchRing, pass_: _Pass) -> None:
        self._ring = ring
        self._pass = pass_
        counts = ring._stall_counts()
        self._stall = None if counts is None else stall.counts.Pass(counts)  # NOTE [stall counts]
        self._index = 0
        self._held: _Slot | None = None
        self._closed = False

    def __iter__(self) -> _RingIterator:
        return self

    def __next__(self) -> Any:
        if self._held is not None:
            self._ring._release(self._pass, self._held)
            self._held = None
        asked = self._stall.ask() if self._stall is not None else 0
        try:
            slot = self._ring._wait_filled(self._pass, self._index)
        except PrefetchStall:
            if self._stall is not None:
                self._stall.got(asked, batch=False)
            # Joining would wait out the stall. The producer leaves by itself once the source
            # returns; ring.close() or the next pass joins it.
            self._closed = True
            self._ring._stop_pass(self._pass, join=False)
            raise
        except BaseException:
            if self._stall is not None:
                self._stall.got(asked, batch=False)
            self.close()
            raise
        if self._stall is not None:
            self._stall.got(asked, batch=slot is not None)
        if slot is None:
            self.close()
            raise StopIteration
        self._index += 1
        self._held = slot
        return self._ring._hand_over(slot)

    def close(self) -> None:
        """Stop this pass's producer and join it (idempotent)."""
        self._held = None
        if not self._closed:
            self._closed = True
            self._ring._stop_pass(self._pass, join=True)

    def __del__(self) -> None:
        self.close()


class PrefetchRing:
    """Iterate ``source`` with each batch copied to ``device`` ahead of use through a ring of slots.

    ``depth`` slots (2 = double buffering) bound both the look-ahead and the memory: ``depth`` host
    and device copies of one batch. ``timeout_s`` bounds how long the consumer waits for one batch
    before :class:`~shmcache.errors.PrefetchStall`. See the module docstring for the lifetime rule.
    """

    counts_own_waits = True  # its consumer's waits count as the loop's stalls (stall.measured)

    def __init__(
        self,
        source: Iterable[Any],
        device: torch.device | str | int | None = None,
        depth: int = 2,
        timeout_s: float = 60.0,
    ) -> None:
        _check_depth_and_timeout(depth, timeout_s)
        # a timed(loader) given to the ring: the ring counts the loop's waits itself (its
        # producer's waits are no stall of the loop)
        self._source = source.batches if isinstance(source, stall.Timed) else source
        self._device = _resolve_device(device)
        self._cuda = self._device.type == "cuda"
        self._depth = depth
        self._timeout_s = float(timeout_s)
        self._cache: Any = None  # set by from_cache: then source holds key batches
        self._gather_fn: Callable[[Any], Any] | None = None
        self._layout: tuple[Any, list[tuple[torch.dtype, tuple[int, ...]]]] | None = None
        self._gatherable = True  # False once the layout turned out to hold non-tensor leaves
        self._cond = threading.Condition()
        self._slots: list[_Slot] = []
        self._active: _Pass | None = None
        self._allocations = 0
        self._side_stream = torch.cuda.Stream(self._device) if self._cuda else None
        self._stall: Any = False  # the stall counts the consumer's waits go to (False: not looked up)

    @classmethod
    def from_cache(
        cls,
        cache: Any,
        key_batches: Iterable[Sequence[Any]],
        device: torch.device | str | int | None = None,
        depth: int = 2,
        timeout_s: float = 60.0,
        *,
        fn: Callable[[Any], Any] | None = None,
    ) -> PrefetchRing:
        """Gather each batch of keys from ``cache`` straight into the slot's pinned buffers.

        ``cache.get_batch(keys, fn=fn)`` is called once without ``out`` to learn the layout (leaf
        dtypes and per-sample shapes), then with ``out=`` the slot's pinned buffers shaped for
        ``len(keys)`` samples (narrowed views for a short last batch), which it fills and returns.
        The samples must therefore share one layout. If the first batch holds non-tensor leaves,
        every batch is fetched without ``out`` and copied into the slot instead (two host copies).
        """
        if not callable(getattr(cache, "get_batch", None)):
            raise InvalidArgument(
                f"cache must have a get_batch(keys, fn=None, out=None) method; got "
                f"{type(cache).__name__}. Pass a ShmDatasetCache, or use PrefetchRing(batches) "
                f"for any iterable of batches"
            )
        ring = cls(key_batches, device=device, depth=depth, timeout_s=timeout_s)
        ring._cache = cache
        ring._gather_fn = fn
        return ring

    @property
    def device(self) -> torch.device:
        """Where the yielded batches live."""
        return self._device

    @property
    def depth(self) -> int:
        return self._depth

    @property
    def buffer_allocations(self) -> int:
        """Slot buffers allocated so far (host and device); flat once each slot saw its largest."""
        return self._allocations

    def __len__(self) -> int:
        return len(self._source)  # type: ignore[arg-type]  # TypeError when the source has no len

    def _stall_counts(self) -> Any:
        """Where the consumer's waits count (NOTE [stall counts]): the cache of from_cache, else
        the one behind the source (a DataLoader over a wrapped dataset); None: not counted."""
        if self._stall is False:
            self._stall = stall.counts_for(self._cache if self._cache is not None else self._source)
        return self._stall

    def __iter__(self) -> Iterator[Any]:
        # iter() here, not in the thread: a DataLoader starts its workers from the caller's thread
        source_iterator = iter(self._source)
        pass_ = self._start_pass(source_iterator)
        return _RingIterator(self, pass_)

    def close(self) -> None:
        """Stop and join the producer, release the buffers. Idempotent; iterating again restarts."""
        if self._active is not None:
            self._stop_pass(self._active, join=True)
        with self._cond:
            if self._active is None:  # a producer stuck in the source keeps its slots meanwhile
                self._slots = []
                self._layout = None

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_active", None) is not None:  # __init__ may have failed half way
            self.close()

    # -- pass lifecycle (consumer side) ----------------------------------------------------------

    def _start_pass(self, source_iterator: Iterator[Any]) -> _Pass:
        previous = self._active
        if previous is not None:
            self._stop_pass(previous, join=True)
        if self._active is not None:  # still there: its producer did not leave the source in time
            raise PrefetchStall(
                f"the previous pass's prefetch producer is still inside the source after "
                f"{_JOIN_TIMEOUT_S:g} s; a new pass would share its slots. Wait for the source to "
                f"return, or create a new PrefetchRing"
            )
        if not self._slots:
            self._slots = [_Slot(self._cuda) for _ in range(self._depth)]
        pass_ = _Pass()
        pass_.thread = threading.Thread(
            target=self._produce, args=(pass_, source_iterator), name=_THREAD_NAME, daemon=True
        )
        self._active = pass_
        pass_.thread.start()
        return pass_

    def _stop_pass(self, pass_: _Pass, *, join: bool) -> None:
        """Tell the producer to stop; with ``join``, wait for it and free the slots."""
        with self._cond:
            pass_.stopped = True
            self._cond.notify_all()
        thread = pass_.thread
        if not join or thread is None or thread is threading.current_thread():
            return
        thread.join(_JOIN_TIMEOUT_S)
        if thread.is_alive():
            return  # stuck inside the source; _start_pass refuses to reuse the slots meanwhile
        with self._cond:
            if self._active is pass_:
                self._reset_slots()
                self._active = None

    def _reset_slots(self) -> None:
        """After a pass: every slot FREE, ordered after the stopping thread's work (see NOTE)."""
        for slot in self._slots:
            if self._cuda and slot.state == _HELD:
                self._record_consumer_done(slot)
            slot.state, slot.index, slot.batch, slot.device_leaves = _FREE, -1, None, []

    # -- consumer side of NOTE [ring slot reuse] -------------------------------------------------

    def _wait_filled(self, pass_: _Pass, index: int) -> _Slot | None:
        """The slot holding batch ``index``, or None at the end; a producer error is raised here."""
        deadline = time.monotonic() + self._timeout_s
        with self._cond:
            while True:
                if pass_.stopped:  # checked first: a closed ring has no slots
                    return None
                slot = self._slots[index % self._depth]
                if slot.state == _FILLED and slot.index == index:
                    slot.state = _HELD
                    return slot
                if pass_.end is not None and index >= pass_.end:
                    if pass_.error is not None:
                        raise _producer_error(pass_.error, index) from pass_.error
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PrefetchStall(
                        f"prefetch producer made no progress for {self._timeout_s:g} s while the "
                        f"consumer waited for batch {index}; the source (or cache.get_batch) is "
                        f"stuck or slower than that: fix the source, or pass a larger timeout_s"
                    )
                self._cond.wait(min(remaining, _POLL_S))

    def _hand_over(self, slot: _Slot) -> Any:
        if self._cuda:
            assert slot.copy_done is not None  # CUDA slots have their events
            stream = torch.cuda.current_stream(self._device)
            stream.wait_event(slot.copy_done)  # on the GPU: the host does not wait for the copy
            for buffer in slot.device_leaves:
                buffer.record_stream(stream)  # see NOTE [ring slot reuse], "record_stream"
        return slot.batch

    def _release(self, pass_: _Pass, slot: _Slot) -> None:
        """The consumer moved past ``slot``'s batch: it may be refilled (NOTE [ring slot reuse])."""
        with self._cond:
            if pass_.stopped or slot.state != _HELD:
                return  # the pass is over; _reset_slots orders the slot for the next one
            if self._cuda:
                self._record_consumer_done(slot)
            slot.state = _FREE
            self._cond.notify_all()

    def _record_consumer_done(self, slot: _Slot) -> None:
        """Mark the end of the consumer's work on the slot's batch, on the stream that does it."""
        assert slot.consumer_done is not None  # CUDA slots have their events
        slot.consumer_done.record(torch.cuda.current_stream(self._device))

    # -- producer side ---------------------------------------------------------------------------

    def _produce(self, pass_: _Pass, source_iterator: Iterator[Any]) -> None:
        index = 0
        try:
            with torch.no_grad(), self._device_context():
                for index in itertools.count():
                    try:
                        item = next(source_iterator)
                    except StopIteration:
                        self._finish(pass_, index, None)
                        return
                    slot = self._claim(pass_, index)
                    if slot is None:
                        return
                    self._fill(pass_, slot, item)
                    if not self._publish(pass_, slot, index):
                        return
        except BaseException as exc:  # noqa: BLE001  # carried to the consumer, raised at its batch
            self._finish(pass_, index, exc)
        finally:
            _close_iterator(source_iterator)

    def _device_context(self) -> Any:
        return torch.cuda.device(self._device) if self._cuda else contextlib.nullcontext()

    def _claim(self, pass_: _Pass, index: int) -> _Slot | None:
        """Wait until the slot for batch ``index`` is FREE (step 1); None when the pass stopped."""
        slot = self._slots[index % self._depth]
        with self._cond:
            while not pass_.stopped and slot.state != _FREE:
                self._cond.wait(_POLL_S)
            return None if pass_.stopped else slot

    def _publish(self, pass_: _Pass, slot: _Slot, index: int) -> bool:
        with self._cond:
            if pass_.stopped:
                return False
            slot.state, slot.index = _FILLED, index
            self._cond.notify_all()
            return True

    def _finish(self, pass_: _Pass, end: int, error: BaseException | None) -> None:
        with self._cond:
            pass_.end, pass_.error = end, error
            self._cond.notify_all()

    def _fill(self, pass_: _Pass, slot: _Slot, item: Any) -> None:
        """Steps 2-4 of NOTE [ring slot reuse]: ``item`` into host, then device buffers."""
        if self._cuda and not self._wait_copy_done(pass_, slot):
            return
        staged = self._gather(slot, item) if self._cache is not None else self._stage(slot, item)
        leaves = self._upload(slot, staged) if self._cuda else staged.leaves
        slot.batch = rebuild(staged.spec, iter(leaves))

    def _wait_copy_done(self, pass_: _Pass, slot: _Slot) -> bool:
        """Step 2: the previous H2D copy out of the pinned buffers is done (False: pass stopped)."""
        assert slot.copy_done is not None  # CUDA slots have their events
        while not slot.copy_done.query():
            if pass_.stopped:
                return False
            time.sleep(_EVENT_POLL_S)
        return True

    def _stage(self, slot: _Slot, batch: Any) -> _Staged:
        """Copy a batch's array leaves into the slot's host buffers; pass other leaves through."""
        leaves: list[Any] = []
        staged = _Staged(flatten(batch, leaves))
        for position, leaf in enumerate(leaves):
            if _is_slot_leaf(leaf):
                dtype, shape = _dtype_and_shape(leaf)
                view = self._view(slot, "host", position, dtype, shape)
                _copy_leaf(view, leaf)
                staged.in_slot.add(position)
                leaf = view
            staged.leaves.append(leaf)
        return staged

    def _gather(self, slot: _Slot, keys: Sequence[Any]) -> _Staged:
        """from_cache: ``cache.get_batch`` fills the slot's host buffers itself (one host copy)."""
        if self._layout is None or not self._gatherable:
            batch = self._cache.get_batch(keys, fn=self._gather_fn)
            if self._layout is None:
                self._learn_layout(batch, len(keys))
            return self._stage(slot, batch)
        spec, leaf_layouts = self._layout
        views = [
            self._view(slot, "host", position, dtype, (len(keys), *sample_shape))
            for position, (dtype, sample_shape) in enumerate(leaf_layouts)
        ]
        out = rebuild(spec, iter(views))
        returned = self._cache.get_batch(keys, fn=self._gather_fn, out=out)
        if returned is not out:  # the contract says it returns out; copy if a cache returns its own
            return self._stage(slot, returned)
        staged = _Staged(spec)
        staged.leaves, staged.in_slot = views, set(range(len(views)))
        return staged

    def _learn_layout(self, batch: Any, batch_size: int) -> None:
        leaves: list[Any] = []
        spec = flatten(batch, leaves)
        self._gatherable = all(
            isinstance(leaf, torch.Tensor) and leaf.dim() > 0 and leaf.shape[0] == batch_size
            for leaf in leaves
        )
        if not self._gatherable:
            self._layout = (spec, [])
            return
        self._layout = (spec, [(leaf.dtype, tuple(leaf.shape[1:])) for leaf in leaves])

    def _upload(self, slot: _Slot, staged: _Staged) -> list[Any]:
        """Step 4: the H2D copies on the side stream, after the consumer's last use of the slot."""
        side = self._side_stream
        assert side is not None and slot.copy_done is not None and slot.consumer_done is not None
        leaves: list[Any] = []
        device_leaves = []
        with torch.cuda.stream(side):  # device buffers are allocated on (and belong to) this stream
            side.wait_event(slot.consumer_done)
            for position, leaf in enumerate(staged.leaves):
                if position in staged.in_slot:
                    view = self._view(slot, "device", position, leaf.dtype, tuple(leaf.shape))
                    view.copy_(leaf, non_blocking=True)
                    device_leaves.append(view)
                    leaf = view
                leaves.append(leaf)
            slot.copy_done.record(side)
        slot.device_leaves = device_leaves
        return leaves

    def _view(
        self, slot: _Slot, kind: str, position: int, dtype: torch.dtype, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """A ``shape``/``dtype`` view of one leaf's flat buffer in the slot; grows a short one."""
        key = (kind, position, dtype, shape)
        view = slot.views.get(key)
        if view is not None:
            return view
        if len(slot.views) > _MAX_CACHED_VIEWS:  # shapes that vary per batch: don't hoard views
            slot.views.clear()
        buffers = slot.host if kind == "host" else slot.device
        nbytes = math.prod(shape) * dtype.itemsize
        if position not in buffers or buffers[position].numel() < nbytes:
            buffers[position] = self._allocate(kind, nbytes)
            slot.views = {k: v for k, v in slot.views.items() if k[:2] != (kind, position)}
        view = buffers[position][:nbytes].view(dtype).view(shape)
        slot.views[key] = view
        return view

    def _allocate(self, kind: str, nbytes: int) -> torch.Tensor:
        capacity = max(_ALIGN_BYTES, -(-nbytes // _ALIGN_BYTES) * _ALIGN_BYTES)
        self._allocations += 1
        if kind == "device":
            return torch.empty(capacity, dtype=torch.uint8, device=self._device)
        return torch.empty(capacity, dtype=torch.uint8, pin_memory=self._cuda)


# -- helpers -------------------------------------------------------------------------------------


def _close_iterator(iterator: Iterator[Any]) -> None:
    """Run a generator's ``finally`` now, in the producer, rather than whenever GC finds it."""
    close = getattr(iterator, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # noqa: BLE001, S110  # the pass is over; its outcome is already recorded
            pass


def _producer_error(error: BaseException, index: int) -> PrefetchError:
    return PrefetchError(
        f"prefetch producer failed at batch {index}: {type(error).__name__}: {error} "
        f"(the batches before it were delivered; the cause is chained below)"
    )


def _check_depth_and_timeout(depth: int, timeout_s: float) -> None:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 1:
        raise InvalidArgument(
            f"depth must be an int >= 1 (the number of ring slots; 2 = double buffering); "
            f"got {depth!r}"
        )
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
        raise InvalidArgument(
            f"timeout_s must be a number of seconds > 0 (how long to wait for one batch); "
            f"got {timeout_s!r}"
        )


def _resolve_device(device: torch.device | str | int | None) -> torch.device:
    """None: the current CUDA device if there is one, else the CPU. CUDA asked for must exist."""
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    if isinstance(device, int) and not isinstance(device, bool):
        device = f"cuda:{device}"
    try:
        resolved = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InvalidArgument(
            f"device must be None, 'cpu', 'cuda', 'cuda:N' or a torch.device; got {device!r} "
            f"({exc})"
        ) from exc
    if resolved.type == "cpu":
        return resolved
    if resolved.type != "cuda":
        raise InvalidArgument(
            f"PrefetchRing supports the CPU and CUDA devices; got {resolved}. Pass device='cuda', "
            f"'cpu', or None (CUDA when available)"
        )
    if not torch.cuda.is_available():
        raise InvalidArgument(
            f"device={device!r} but CUDA is not available here; pass device=None (CUDA when "
            f"available, else CPU) or device='cpu'"
        )
    index = resolved.index if resolved.index is not None else torch.cuda.current_device()
    return torch.device("cuda", index)
