"""Torch tensors as a codec type: stored as their raw bytes, returned as tensors (no pickle).

The codec names this module (it never imports it): a process that encodes a tensor, or decodes a
record that holds one, loads it then - the command line, an import of a snapshot, a DataLoader
worker - so no process imports torch unless a value needs it. ``shmcache.data.dataset`` registers it
when it is imported.

Also the torch side of a gathered batch: a column of a leaf as a tensor (``column_tensor``) and the
torch dtype of a numpy dtype (``torch_dtype``).
"""

from __future__ import annotations

import numpy as np
import torch

from ..cache import codec

__all__ = ["TAG", "register", "column_tensor", "torch_dtype"]

TAG = "torch"


# dtypes whose tensors numpy() takes as they are: a tensor of one of these in the common case
# (CPU, contiguous, no grad, no conj/neg bit: a dataset's sample) skips the general way below
_FAST_METAS = {dtype: f"{str(dtype).removeprefix('torch.')}:{dtype.itemsize}" for dtype in (
    torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128, torch.bool,
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)}


def _tensor_to_parts(t: torch.Tensor):
    meta = _FAST_METAS.get(t.dtype)
    if meta is not None:
        # numpy() refuses what the general way below must handle (a tensor off the CPU, with grad,
        # a conjugate or negative bit, not strided, nested; more dimensions than numpy takes): one
        # call asks all of that at once, a batch's encoding asks it of every tensor (issue 31)
        try:
            arr = t.numpy()
        except (RuntimeError, TypeError, ValueError):
            arr = None
        if arr is not None and arr.flags.c_contiguous and arr.size:
            # the array itself: the codec takes any C-contiguous buffer as its bytes (a flat
            # uint8 view of it cost two numpy calls a tensor, 0.3 us)
            return meta, arr.shape, arr
    if t.layout != torch.strided or t.is_quantized or t.is_nested or t.is_meta:
        return None  # pickled instead
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    t = t.resolve_conj().resolve_neg().contiguous()
    if not t.numel():
        return f"{str(t.dtype).removeprefix('torch.')}:{t.element_size()}", tuple(t.shape), np.empty(0, np.uint8)
    flat = t.reshape(-1)
    if flat.stride(0) != 1:  # one element: contiguous() keeps any stride, and view(uint8) needs 1
        flat = flat.as_strided((1,), (1,))
    raw = flat.view(torch.uint8).numpy()
    return f"{str(t.dtype).removeprefix('torch.')}:{t.element_size()}", tuple(t.shape), raw


_DTYPES: dict[str, torch.dtype] = {}  # a leaf's meta -> its dtype, checked once per meta


def _dtype_of(meta: str) -> torch.dtype:
    """The dtype a leaf's meta names, checked the first time that meta is seen (a layout from a
    tier or a snapshot names anything); after that a dict lookup on every decode (the hit path)."""
    dtype = _DTYPES.get(meta)
    if dtype is not None:
        return dtype
    if meta not in codec.TORCH_METAS:  # by name first: getattr(torch, "_inductor") imports it
        raise ValueError(f"a tensor leaf names dtype {meta[:40]!r}, not one torch writes")
    name, _, size = meta.partition(":")
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"a tensor leaf names dtype {meta!r}, not a torch dtype")
    if size != str(dtype.itemsize):  # ":0" made torch.empty(shape) of 0 bytes
        raise ValueError(f"a tensor leaf names dtype {meta!r}, whose elements are {dtype.itemsize} bytes: "
                         f"the record is damaged or forged")
    if len(_DTYPES) < 256:  # metas that pass are torch's dtypes: a handful, bounded anyway
        _DTYPES[meta] = dtype
    return dtype


def _tensor_from_parts(meta: str, shape: tuple, raw: np.ndarray) -> torch.Tensor:
    dtype = _dtype_of(meta)
    if raw.size == 0:
        return torch.empty(shape, dtype=dtype)
    # A read-only buffer is a zero-copy read (copy=False) of shared memory. torch has no read-only
    # tensors, and one in-place op on a view would change the cache for every process: tensors
    # are always copied (numpy arrays stay zero-copy, read-only).
    flat = torch.from_numpy(raw if raw.flags.writeable else raw.copy())
    return flat.view(dtype).reshape(shape)


def register() -> None:
    """Register tensors (and parameters) with the codec; the codec's lazy loader calls it."""
    codec.register_type(torch.Tensor, TAG, _tensor_to_parts, _tensor_from_parts, check=codec.torch_check)
    codec.register_type(torch.nn.Parameter, TAG, _tensor_to_parts, _tensor_from_parts, check=codec.torch_check)


def column_tensor(column, leaf: codec.Leaf):
    """A gathered column of ``leaf`` (an array of n rows) as a tensor; a list (str, bytes, pickled
    values) or None stays as it is."""
    if column is None or isinstance(column, list):
        return column
    if leaf.tag == "e":
        from_parts = codec.ext_from_parts(leaf.ext)
        return from_parts(leaf.meta, (len(column), *leaf.shape), column.reshape(-1))
    return torch.from_numpy(column)


_TORCH_DTYPES: dict[np.dtype, torch.dtype | None] = {}


def torch_dtype(dtype: np.dtype) -> torch.dtype | None:
    """The torch dtype of arrays of numpy ``dtype``, or None where torch has none (object, str,
    byte order); asked once per dtype."""
    if dtype not in _TORCH_DTYPES:
        try:
            _TORCH_DTYPES[dtype] = torch.from_numpy(np.empty(0, dtype)).dtype
        except (TypeError, ValueError):
            _TORCH_DTYPES[dtype] = None
    return _TORCH_DTYPES[dtype]
