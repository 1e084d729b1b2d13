"""The identity of a wrapped dataset: what names its cache when the user gives no name.

NOTE [fingerprint]
    Two datasets must never share a cache silently, and one dataset must find the same cache from
    every process and every run. So the fingerprint hashes what defines the data and nothing that
    lives only in one process:

    - the dataset's type and length;
    - its plain-data attributes (file lists, label arrays): numbers, str, bytes, arrays, tensors
      (any dtype) and lists, tuples, dicts and sets of them. Other objects (file handles, database
      environments, locks) are skipped: their state differs from process to process. Private
      attributes count too (``self._items``), except plain numbers: ``self._pid``, ``self._rank``
      or a call counter would give every process its own cache;
    - the transform by what it does: a function's code, constants, defaults and the plain data it
      closes over; a callable object's type and attributes (a Compose and the transforms in it);
    - the encoded probe samples (items 0, n/2 and n-1), except the bytes of pickled leaves, whose
      pickles of sets and dicts follow the string hash seed of the process (only their type and
      length count).

    It stays a heuristic: two datasets that differ only in state it skips, and agree on the probe
    samples, still look the same. ``verify=`` (recompute a share of the hits) catches that.
"""

from __future__ import annotations

import functools
import hashlib
import marshal
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from . import codec

__all__ = ["fingerprint", "length_or_none"]

_DIGEST_LIMIT = 256 << 20  # bytes of array data hashed at most (then: dtypes and shapes only)
_MAX_DEPTH = 6
_MAX_ITEMS = 100_000  # elements of one container hashed at most


def fingerprint(dataset: Any, transform: Callable | None, samples: Sequence[codec.Encoded]) -> str:
    """A 16-hex-digit identity of ``dataset`` under ``transform``; see NOTE [fingerprint]."""
    h = hashlib.blake2b(digest_size=8)
    tp = type(dataset)
    h.update(f"{tp.__module__}.{tp.__qualname__}|{length_or_none(dataset)}".encode())
    digest = _Digest(h)
    attrs = getattr(dataset, "__dict__", None)
    if isinstance(attrs, dict):
        digest.data({k: v for k, v in attrs.items()
                     if not (isinstance(k, str) and k.startswith("_") and _is_number(v))})
    if transform is not None:
        h.update(b"|transform")
        digest.function(transform)
    for enc in samples:  # already encoded (wrap() stores them too)
        h.update(enc.layout)
        h.update(enc.scalars)
        pickled = codec.pickled_offsets(enc.layout)
        for offset, piece in enc.pieces:
            view = memoryview(piece).cast("B")
            h.update(f"pickle{len(view)}".encode() if offset in pickled else view)
    return h.hexdigest()


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float, complex, np.number, np.bool_))


def _key_repr(k: Any) -> str:
    """A repr that is the same in every process (an object's default repr holds its address)."""
    if isinstance(k, (str, bytes, int, float, bool, complex, type(None))):
        return repr(k)
    if isinstance(k, tuple):
        return "(" + ",".join(map(_key_repr, k)) + ")"
    return type(k).__qualname__


def length_or_none(ds: Any) -> int | None:
    try:
        return len(ds)
    except TypeError:
        return None


class _Digest:
    """Feeds plain data and callables into one hash, with a budget for array bytes."""

    def __init__(self, h):
        self.h = h
        self.array_bytes = 0
        self._seen: set[int] = set()  # objects and functions already entered: cycles end here

    def data(self, value: Any, depth: int = 0) -> None:
        """Plain data reachable from ``value``; anything else is skipped (see NOTE [fingerprint])."""
        h = self.h
        if depth > _MAX_DEPTH:
            return
        if isinstance(value, (str, bytes, int, float, bool, complex, type(None))):
            h.update(repr(value).encode("utf-8", "surrogatepass")[:1 << 16])
        elif isinstance(value, np.generic):
            h.update(repr(value.item() if value.dtype.kind != "O" else type(value)).encode()[:1 << 16])
        elif isinstance(value, np.ndarray):
            self._array(value)
        elif isinstance(value, torch.Tensor):
            self._tensor(value)
        elif isinstance(value, dict):
            h.update(f"{{{len(value)}".encode())
            for k in sorted(value, key=_key_repr)[:_MAX_ITEMS]:
                h.update(_key_repr(k).encode("utf-8", "surrogatepass"))
                self.data(value[k], depth + 1)
        elif isinstance(value, (list, tuple)):
            h.update(f"[{len(value)}".encode())
            for v in value[:_MAX_ITEMS]:
                self.data(v, depth + 1)
        elif isinstance(value, (set, frozenset)):  # no order of its own: sorted by repr
            h.update(f"({len(value)}".encode())
            for r in sorted(map(_key_repr, value))[:_MAX_ITEMS]:
                h.update(r.encode("utf-8", "surrogatepass"))

    def function(self, fn: Any, depth: int = 0) -> None:
        """What ``fn`` does: code and the plain data it uses (see NOTE [fingerprint])."""
        h = self.h
        if depth > _MAX_DEPTH or id(fn) in self._seen:
            return
        self._seen.add(id(fn))
        if isinstance(fn, types.MethodType):
            self.function(fn.__func__, depth + 1)
            self._object(fn.__self__, depth + 1)
        elif isinstance(fn, types.FunctionType):
            h.update(f"{fn.__module__}.{fn.__qualname__}".encode())
            self._code(fn.__code__)
            self.data(fn.__defaults__, depth + 1)
            self.data(fn.__kwdefaults__, depth + 1)
            for cell in fn.__closure__ or ():
                try:
                    content = cell.cell_contents
                except ValueError:  # an empty cell (a name assigned later)
                    continue
                if callable(content) and not isinstance(content, type):
                    self.function(content, depth + 1)
                else:
                    self.data(content, depth + 1)
        elif isinstance(fn, functools.partial):
            h.update(b"partial")
            self.function(fn.func, depth + 1)
            self.data(fn.args, depth + 1)
            self.data(fn.keywords, depth + 1)
        else:  # a builtin, a class or a callable object (torchvision's Compose, Resize(...))
            self._object(fn, depth)

    def _object(self, obj: Any, depth: int) -> None:
        tp = type(obj)
        self.h.update(f"{tp.__module__}.{getattr(tp, '__qualname__', tp.__name__)}".encode())
        if isinstance(obj, (types.BuiltinFunctionType, type)):
            self.h.update(getattr(obj, "__qualname__", "").encode())
            return
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return
        for k in sorted(attrs, key=_key_repr)[:_MAX_ITEMS]:
            v = attrs[k]
            self.h.update(_key_repr(k).encode())
            if isinstance(v, (list, tuple)) and any(callable(x) for x in v[:_MAX_ITEMS]):
                self.h.update(f"[{len(v)}".encode())  # Compose(transforms=[...])
                for x in v[:_MAX_ITEMS]:
                    if callable(x):
                        self.function(x, depth + 1)
                    else:
                        self.data(x, depth + 1)
            elif callable(v) and not isinstance(v, type):
                self.function(v, depth + 1)
            else:
                self.data(v, depth + 1)

    def _code(self, code: types.CodeType) -> None:
        self.h.update(code.co_code)
        self.h.update(repr(code.co_names).encode())
        for const in code.co_consts:
            if isinstance(const, types.CodeType):  # a nested function or comprehension
                self._code(const)
            else:
                self.h.update(_const_bytes(const))

    def _array(self, arr: np.ndarray) -> None:
        self.h.update(f"{arr.dtype}{arr.shape}".encode())
        if not arr.dtype.hasobject and self.array_bytes + arr.nbytes <= _DIGEST_LIMIT:
            self.array_bytes += arr.nbytes
            self.h.update(np.ascontiguousarray(arr).reshape(-1).view(np.uint8))

    def _tensor(self, t: torch.Tensor) -> None:
        self.h.update(f"{t.dtype}{tuple(t.shape)}{t.layout}".encode())
        try:
            parts = codec.to_parts(t)  # any dtype as raw bytes (bfloat16 and float8 included)
        except Exception:  # noqa: BLE001 - a tensor the codec cannot take apart: dtype and shape only
            return
        if parts is not None:
            self._array(parts[2])


def _const_bytes(const: Any) -> bytes:
    if isinstance(const, frozenset):  # `x in {"a", "b"}`: before 3.11 marshal follows the hash seed
        return ("{" + ",".join(sorted(map(_key_repr, const))) + "}").encode("utf-8", "surrogatepass")
    if isinstance(const, tuple):
        return b"(" + b",".join(map(_const_bytes, const)) + b")"
    try:
        return marshal.dumps(const)
    except ValueError:  # not marshallable (rare): its type is what we know
        return type(const).__name__.encode()
