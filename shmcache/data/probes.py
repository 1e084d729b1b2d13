"""wrap()'s probe reads of a map-style dataset: a few samples read to name its cache (NOTE
[fingerprint]) and to tell a random dataset from a deterministic one, each read within a bound.

A probe runs in a daemon thread, so a ``__getitem__`` that never returns in the main process (one
that waits at a barrier for its DataLoader workers) cannot hang ``wrap()``: past
``PROBE_TIMEOUT_S`` the read is abandoned (the thread stays blocked where the dataset holds it, and
never blocks the interpreter's exit) and ``wrap()`` raises ProbeTimeout naming ``fingerprint=``,
which skips the probes. A probe that raises does not fail ``wrap()``: the error belongs to the
read that the DataLoader makes (a cache miss computes the sample again and raises there, labelled).
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from ..cache import codec
from ..errors import EncodeError, ProbeTimeout

__all__ = ["Probe", "read_probes", "same_value", "PROBE_TIMEOUT_S"]

PROBE_TIMEOUT_S = 60.0  # one read of one sample: a dataset that takes longer names its cache itself


class Probe(NamedTuple):
    """One probe read: the sample (encoded), or the exception the dataset raised."""

    index: int
    value: Any
    encoded: codec.Encoded | None
    error: BaseException | None


def read_probes(
    dataset: Any, transform: Callable | None, indices: Sequence[int], timeout_s: float | None = None
) -> tuple[list[Probe], Probe | None]:
    """The probes of ``indices``, and a second read of the first one (None if that raised): each
    read bounded by ``timeout_s`` (PROBE_TIMEOUT_S by default)."""
    from .wrapped import compute_sample

    timeout_s = PROBE_TIMEOUT_S if timeout_s is None else timeout_s
    results: queue.Queue = queue.Queue()
    abandoned = threading.Event()
    reads = [*indices, *indices[:1]]

    def run() -> None:
        first_raised = False
        for n, i in enumerate(reads):
            if abandoned.is_set() or (n == len(indices) and first_raised):
                return  # (no second read of a sample that raised)
            try:
                results.put((compute_sample(dataset, transform, i), None))
            except Exception as exc:  # noqa: BLE001 - handed to the caller (who defers it)
                results.put((None, exc))
                first_raised = first_raised or n == 0

    threading.Thread(target=run, name=f"shmcache-probe-{type(dataset).__name__}", daemon=True).start()
    probes: list[Probe] = []
    again = None
    try:
        for n, i in enumerate(reads):
            if n == len(indices) and probes[0].error is not None:
                break
            try:
                value, error = results.get(timeout=timeout_s)
            except queue.Empty:
                raise ProbeTimeout(
                    f"wrap() read {type(dataset).__name__}[{i}] to name its cache (and to check that it "
                    f"is not random), and the read did not return in {timeout_s:g} s (a __getitem__ "
                    f"that waits for DataLoader workers, a barrier, a slow source?); the read is "
                    f"abandoned: give wrap(dataset, fingerprint='...') a name of its contents (a "
                    f"version, a hash of its file list) and wrap() reads no sample (name the cache "
                    f"with ShmDatasetCache(name=...))"
                ) from None
            if n == len(indices):
                again = Probe(i, value, None, error)
                continue
            encoded = None
            if error is None:
                try:
                    encoded = codec.encode(value)
                except EncodeError as exc:
                    raise EncodeError(f"sample {i} of {type(dataset).__name__}: {exc}") from None
            probes.append(Probe(i, value, encoded, error))
    finally:
        abandoned.set()
    return probes, again


def same_value(a: Any, b: Any) -> bool:
    """Whether two reads of one sample hold the same values: containers by their items, tensors
    and arrays by their bytes, anything else by ``==`` where it defines one, by its attributes
    where it does not; True where it cannot tell (the "random" diagnosis needs a difference)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (torch.Tensor, np.ndarray, np.generic)):
        return _same_bytes(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset, str, bytes, int, float, complex, type(None))):
        return a == b or (isinstance(a, float) and a != a and b != b)
    if type(a).__eq__ is object.__eq__:
        attrs_a, attrs_b = getattr(a, "__dict__", None), getattr(b, "__dict__", None)
        return same_value(attrs_a, attrs_b) if isinstance(attrs_a, dict) else True
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an __eq__ that cannot answer: no evidence of a difference
        return True


def _same_bytes(a: Any, b: Any) -> bool:
    from .wrapped import same_sample

    try:
        return same_sample(a, b)
    except EncodeError:
        return True
