"""Batches of ``get_batch``: keys as one int64 array, the vectorised gather, and ``out=`` trees.

``get_batch(keys, out=...)`` gathers a batch straight into the caller's buffers (pinned slots of
the prefetch ring, say): ``out`` is matched to the record's structure by key (``base.trees``), its
leaves viewed as numpy arrays over the same memory, and the store's gather writes into them; a
batch of another dtype or shape is gathered and then copied field by field, converting like
``copy_``. Keys: a sampler's list of ints, an integer array or tensor, becomes one int64 array in
one numpy pass, refusing what would silently read another item (floats, bools, uint64 above 2**63).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..base import trees
from ..cache.store_protocol import Store
from ..errors import InvalidArgument, InvalidKey
from .tensors import column_tensor

__all__ = ["gather", "copy_into", "as_int_keys", "integer_array", "as_int64", "plain_ints"]


# --- the vectorised gather ------------------------------------------------------------------------


def gather(store: Store, keys: np.ndarray, out: Any) -> Any:
    """The batch of int ``keys`` gathered by the vectorised path (into ``out`` when given, which is
    then returned); None when the batch is not all cached in memory with one layout."""
    arrays = None
    if out is not None:
        layout = store.batch_layout(keys)
        if layout is None:
            return None
        # out's leaves in the record's order: a dict out is matched by key, never by position
        arrays, dtypes, shapes = _out_leaves(trees.flatten_like(out, layout[0], _unlike))
        if not store.out_matches(layout, len(keys), arrays, dtypes, shapes):  # another dtype/shape:
            batch = gather(store, keys, None)                                 # convert, like copy_ does
            if batch is not None:
                copy_into(out, batch)
                return out
            return None
    got = store.gather_ints(keys, arrays)
    if got is None:
        return None
    spec, leaves, columns = got
    if out is not None:
        return out
    return trees.rebuild(spec, iter([column_tensor(c, leaf) for c, leaf in zip(columns, leaves)]), collated=True)


# --- out= trees -----------------------------------------------------------------------------------


def _out_leaves(leaves: list) -> tuple[list, list, list]:
    """``out``'s leaves as numpy arrays over the same memory (any dtype: through a uint8 view
    where numpy has no such dtype, e.g. bfloat16), with their torch dtype names and shapes."""
    arrays, dtypes, shapes = [], [], []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if not t.is_cpu:  # is_cpu, requires_grad: attributes, a microsecond less a leaf than .device, .detach()
                raise InvalidArgument(f"out= tensors must be in CPU memory (pinned is fine), got one on "
                                      f"{t.device}; gather on the host and copy, or use PrefetchRing")
            if t.requires_grad:
                t = t.detach()
            dtype = t.dtype
            if dtype is torch.bfloat16:
                arrays.append(t.view(torch.uint8).numpy())
                shapes.append(tuple(t.shape))
            else:
                arr = t.numpy()
                arrays.append(arr)
                shapes.append(arr.shape)  # the tensor's: numpy's own tuple, no torch.Size made
            dtypes.append(_TORCH_NAMES.get(dtype) or str(dtype).removeprefix("torch."))
        elif isinstance(t, np.ndarray):
            arrays.append(t)
            dtypes.append(None)
            shapes.append(t.shape)
        else:
            raise InvalidArgument(f"out= holds a {type(t).__name__}; give tensors or arrays shaped "
                                  f"like the batch")
    return arrays, dtypes, shapes


# torch dtype -> the name out_matches compares (str(dtype) less "torch."), looked up once per leaf
_TORCH_NAMES = {d: str(d).removeprefix("torch.") for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _described(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _unlike(path: str, out: Any, batch_has: str) -> InvalidArgument:
    """``out`` shaped unlike the batch at ``path``: InvalidArgument naming the place (a missing
    field would stay unfilled)."""
    return InvalidArgument(f"{path} is {_described(out)} where the batch has {batch_has}; give one "
                           f"buffer per field, shaped like the batch")


def copy_into(out: Any, batch: Any, path: str = "out") -> None:
    """Copy a collated ``batch`` into ``out``, field by field, converting dtypes like ``copy_``;
    InvalidArgument (nothing half-copied is returned) where the two are shaped differently."""
    if isinstance(out, (torch.Tensor, np.ndarray)):
        if not isinstance(batch, (torch.Tensor, np.ndarray)):
            raise _unlike(path, out, _described(batch))
        if tuple(batch.shape) != tuple(out.shape):
            raise InvalidArgument(f"{path} has shape {tuple(out.shape)} where the batch has "
                                  f"{tuple(batch.shape)}; size out= like the batch")
        if isinstance(out, torch.Tensor):
            out.copy_(torch.as_tensor(batch))
        else:
            out[...] = batch.numpy() if isinstance(batch, torch.Tensor) else batch
    elif isinstance(out, (tuple, list)):
        if not isinstance(batch, (tuple, list)) or len(batch) != len(out):
            raise _unlike(path, out, _described(batch))
        for i, (o, b) in enumerate(zip(out, batch)):
            copy_into(o, b, f"{path}[{i}]")
    elif isinstance(out, dict):
        if not isinstance(batch, dict) or set(batch) != set(out):
            raise _unlike(path, out, _described(batch))
        for k in out:
            copy_into(out[k], batch[k], f"{path}[{k!r}]")
    else:
        raise InvalidArgument(f"{path} is a {type(out).__name__}; give tensors or arrays shaped like the batch")


# --- keys -----------------------------------------------------------------------------------------


_INT64_MAX = np.iinfo(np.int64).max
_INT_ONLY = {int}


def integer_array(values: Any, what: str, error: type[Exception]) -> np.ndarray | None:
    """An ndarray or tensor of ``what`` as a 1-D integer numpy array (None for anything else, such
    as a list). Raises ``error`` naming the problem for bool, float or complex values and for
    arrays that are not 1-D: a float array silently truncated to ints would read other items."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            raise error(f"{what} must be integers, not a tensor of {values.dtype}")
        values = values.cpu().numpy()
    if not isinstance(values, np.ndarray):
        return None
    if values.dtype.kind not in "iu":
        raise error(f"{what} must be integers, not an array of {values.dtype}"
                    + ("; pass str keys as a list" if values.dtype.kind in "US" else ""))
    if values.ndim != 1:
        raise error(f"{what} must be a 1-D sequence, not an array of shape {tuple(values.shape)}")
    return values


def as_int64(values: np.ndarray, out_of_range: Callable[[int], Exception]) -> np.ndarray:
    """``values`` as int64; a uint64 above 2**63-1 raises ``out_of_range(value)`` instead of
    wrapping around to a negative number (which would silently read another item)."""
    if values.dtype.kind == "u" and values.dtype.itemsize == 8 and values.size:
        big = values > _INT64_MAX
        if big.any():
            raise out_of_range(int(values[big][0]))
    return values.astype(np.int64, copy=False)


def as_int_keys(keys: Sequence) -> np.ndarray | None:
    """Cache keys as one int64 array for the vectorised path, or None for keys looked up one by
    one (str, bytes, mixed, or ints beyond 64 bits: those raise InvalidKey there)."""
    arr = integer_array(keys, "an array of cache keys", InvalidKey)
    if arr is not None:
        return as_int64(arr, lambda k: InvalidKey(
            f"int key {k} does not fit in a signed 64-bit integer; use a str key (str({k}))"))
    return plain_ints(keys)


def plain_ints(keys: Sequence) -> np.ndarray | None:
    """``keys`` as int64 if every one is a plain int that fits; else None."""
    try:
        if set(map(type, keys)) <= _INT_ONLY:  # in C: a generator here was a Python call per key
            return np.fromiter(keys, np.int64, len(keys))
    except (OverflowError, TypeError):
        return None
    return None
