"""The identity of a wrapped dataset: what names its cache when the user gives no name.

NOTE [fingerprint]
    Two datasets must never share a cache silently, and one dataset must find the same cache from
    every process and every run. So the fingerprint hashes what defines the data and nothing that
    lives only in one process:

    - the dataset's type, by a name that is the same in every process and every checkout: the
      last part of its module's name and its qualname (a script run as ``__main__`` counts as the
      module it is imported as: the stem of its file), never a path; and the source text of its
      class and of the bases defined in the same module (``inspect.getsource``; the methods' code
      when there is no file to read), so an edit of ``__getitem__`` is another dataset, while a
      copy of the code at another path, or on another machine, is the same one;
    - its length;
    - not its epoch: the attributes ``epoch`` and ``_epoch`` of a dataset whose class has
      ``set_epoch`` (a run resumed in a later epoch reads the same data);
    - its plain-data attributes (file lists, label arrays): numbers, str, bytes, arrays, tensors
      (any dtype) and lists, tuples, dicts and sets of them, hashed completely (an edit anywhere in
      a 1.28M-item list of paths changes the name): homogeneous runs of numbers, str and bytes in
      bulk, as one buffer each, arrays by their bytes (a file-backed ``np.memmap`` by its file:
      path, offset, size and modification time, so a 100 GB image file is not read). Python
      objects in attributes (a wrapped dataset, a Subset's source) count by type and attributes,
      the same way; objects without a ``__dict__`` (file handles, database environments, locks)
      are skipped: their state differs from process to process, and so are fsspec filesystems
      and dicts of them (their tokens hash the process id). Private attributes count too
      (``self._items``), except plain numbers: ``self._pid``, ``self._rank`` or a call counter
      would give every process its own cache;
    - the transform by what it does: a function's code, constants, defaults and the plain data it
      closes over; a callable object's type and attributes (a Compose and the transforms in it);
    - the encoded probe samples (items 0, n/2 and n-1), except the bytes of pickled leaves, whose
      pickles of sets and dicts follow the string hash seed of the process (only their type and
      length count).

    The same digest of a function names an unnamed cache used through ``get(key, fn)``
    (``function_fingerprint``): a bound method counts its object, a closure the objects it closes
    over (``lambda k: self.dataset[k]`` counts ``self.dataset``'s attributes).

    Functions and the types of objects count by the same path-free names (a transform defined in
    the warm-up script is the same function when the training script imports it). The package
    above the module does not count (``pkg.warm`` is ``warm``, so a script run from inside a
    package and the import from outside agree): two classes of one name in modules of one last
    name are told apart by their source, attributes and samples only.

    So two datasets differ (each gets its own cache, and a snapshot of one is refused by the other
    with CacheMismatch) by: another class name, or the same class in a module of another name; any
    edit of the class's source text, comments inside it included, or of a base class defined in
    the same module (bases from other modules do not count); another length, attribute value or
    memmapped file (its path, size and modification time); another transform - its code,
    defaults and the data it closes over, code compared as CPython bytecode, so the same
    transform under another Python minor version is another one (``snapshot_options={'force':
    True}`` reads a snapshot across versions); other probe samples. A change of this rule renames
    every cache: caches made before are computed once more under their new names (a snapshot
    exported before still serves ``wrap(None)``, which takes its identity from the manifest).

    It stays a heuristic: two datasets that differ only in state it skips, and agree on the probe
    samples, still look the same; so does data nested deeper than ``_MAX_DEPTH`` levels.
    ``verify=`` (recompute a share of the hits) catches that, and ``verify_sample`` (a share of the
    cached items, at once) catches files edited under unchanged paths too.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import marshal
import operator
import os
import sys
import types
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from ..cache import codec

__all__ = ["fingerprint", "function_fingerprint", "given_fingerprint", "length_or_none"]

_MAX_DEPTH = 6
_CHUNK = 1 << 16  # items of a list hashed in one bulk step (bounds the temporary arrays)
_CRC_FROM = 16 << 20  # arrays this large are hashed by crc32 per chunk (3x blake2b's speed here)
_CRC_CHUNK = 64 << 20
_ROW_MAX = 16  # tuples up to this length, in a list of them, are hashed column by column
_EPOCH_ATTRS = ("epoch", "_epoch")  # not hashed where the dataset's class has set_epoch
_COMPOSE_MAX = 256  # a list attribute this short is checked for callables (Compose([...]))


def fingerprint(dataset: Any, transform: Callable | None, samples: Sequence[codec.Encoded]) -> str:
    """A 16-hex-digit identity of ``dataset`` under ``transform``; see NOTE [fingerprint]."""
    h = hashlib.blake2b(digest_size=8)
    tp = type(dataset)
    h.update(f"{type_name(tp)}|{length_or_none(dataset)}".encode())
    digest = _Digest(h)
    digest.class_source(tp)
    attrs = getattr(dataset, "__dict__", None)
    if isinstance(attrs, dict):
        # a dataset's epoch (set_epoch's: HF's stream keeps it in a tensor) is where a pass is, not
        # what it holds: a run resumed at epoch 2 must find the cache its epoch-0 warm-up made
        epoch = _EPOCH_ATTRS if callable(getattr(type(dataset), "set_epoch", None)) else ()
        digest.data({k: v for k, v in attrs.items()
                     if not (isinstance(k, str) and k.startswith("_") and _is_number(v)) and k not in epoch})
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


def given_fingerprint(dataset: Any, given: str) -> str:
    """The identity of a dataset whose contents the caller names (``wrap(ds, fingerprint=...)``):
    its type (as NOTE [fingerprint] names it) and the caller's name, nothing read."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"given|{type_name(type(dataset))}|".encode())
    h.update(given.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def function_fingerprint(fn: Callable) -> str:
    """A 16-hex-digit identity of what ``fn`` computes (code, closure, bound object); the same in
    every process that defines ``fn`` alike. Names an unnamed cache used through ``get``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(b"get|")
    _Digest(h).function(fn)
    return h.hexdigest()


def type_name(tp: type) -> str:
    """A class's name as every process and every checkout sees it (NOTE [fingerprint]): the last
    part of its module's name and its qualname. A class defined by a script run as ``__main__`` is
    named after the module the script is imported as (the stem of its file; ``python -m pkg.mod``:
    ``mod``), so the warm-up script and the training script that imports from it agree."""
    return f"{_module_name(getattr(tp, '__module__', None))}.{getattr(tp, '__qualname__', tp.__name__)}"


def _module_name(module: str | None) -> str:
    module = module or ""
    if module == "__main__":
        main = sys.modules.get("__main__")
        spec = getattr(main, "__spec__", None)
        if spec is not None and getattr(spec, "name", None):
            module = spec.name
        elif isinstance(getattr(main, "__file__", None), str):
            module = os.path.splitext(os.path.basename(main.__file__))[0]
    return module.rpartition(".")[2]


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
    """Feeds plain data and callables into one hash."""

    def __init__(self, h):
        self.h = h
        self._seen: set[int] = set()  # objects and functions already entered: cycles end here

    def data(self, value: Any, depth: int = 0) -> None:
        """Plain data reachable from ``value``, completely; see NOTE [fingerprint]."""
        h = self.h
        if depth > _MAX_DEPTH:
            return
        if isinstance(value, str):
            h.update(f"s{len(value)}:".encode())
            h.update(value.encode("utf-8", "surrogatepass"))
        elif isinstance(value, bytes):
            h.update(f"y{len(value)}:".encode())
            h.update(value)
        elif isinstance(value, (int, float, bool, complex, type(None))):
            h.update(repr(value).encode())
        elif isinstance(value, np.generic):
            h.update(repr(value.item() if value.dtype.kind != "O" else type(value)).encode()[:1 << 16])
        elif isinstance(value, np.ndarray):
            self._array(value, depth)
        elif isinstance(value, torch.Tensor):
            self._tensor(value)
        elif _filesystems(value):  # process state (fsspec's tokens hash the pid), not data
            h.update(b"filesystems")
        elif isinstance(value, dict):
            h.update(f"{{{len(value)}".encode())
            keys = _sorted_keys(value)
            plain = len(set(map(type, keys))) == 1 and type(keys[0]) in (str, int)
            self._items(keys if plain else [_key_repr(k) for k in keys], depth)
            self._items([value[k] for k in keys], depth)
        elif isinstance(value, (list, tuple)):
            h.update(f"[{len(value)}".encode())
            self._items(value, depth)
        elif isinstance(value, (set, frozenset)):  # no order of its own: sorted by repr
            h.update(f"({len(value)}".encode())
            self._items(sorted(map(_key_repr, value)), depth)
        elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(
                value, (types.ModuleType, type)) and not callable(value):
            if id(value) not in self._seen:  # an object (a wrapped dataset): type and attributes
                self._seen.add(id(value))
                self._object(value, depth + 1, data_only=True)

    def _items(self, items: Sequence, depth: int) -> None:
        """Every item of a list or tuple, in bulk where a run of items is homogeneous."""
        for lo in range(0, len(items), _CHUNK):
            chunk = items[lo:lo + _CHUNK]
            if not self._column(chunk, depth):
                for v in chunk:
                    self.data(v, depth + 1)

    def _column(self, items: Sequence, depth: int) -> bool:
        """Hash ``items`` as one buffer if they are all ints, floats, bools, str or bytes (or
        tuples of one length: column by column); False if not (the caller hashes each item)."""
        h = self.h
        kinds = set(map(type, items))
        if len(kinds) != 1:
            return False
        tp = kinds.pop()
        if tp is int:
            try:
                arr = np.array(items, np.int64)
            except OverflowError:
                return False
            h.update(b"I")
            h.update(arr)
        elif tp is float:
            h.update(b"F")
            h.update(np.array(items, np.float64))
        elif tp is bool:
            h.update(b"B")
            h.update(np.array(items, np.bool_))
        elif tp is str or tp is bytes:
            joined = ("\0" if tp is str else b"\0").join(items)
            if tp is str:
                joined = joined.encode("utf-8", "surrogatepass")
            h.update(b"S" if tp is str else b"Y")
            if b"\0" in joined:  # a separator inside an item: the lengths tell the items apart
                h.update(np.fromiter(map(len, items), np.int64, len(items)))
            h.update(joined)
        elif tp in (tuple, list) and depth < _MAX_DEPTH and len(items) > 1 \
                and len(items[0]) <= _ROW_MAX and len(set(map(len, items))) == 1:
            # many short rows of one length ((path, label) pairs): one column at a time
            h.update(f"{'T' if tp is tuple else 'L'}{len(items[0])}".encode())
            for j in range(len(items[0])):
                col = list(map(operator.itemgetter(j), items))  # (zip(*items) is slower)
                if not self._column(col, depth + 1):
                    for v in col:
                        self.data(v, depth + 2)
        else:
            return False
        return True

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
            h.update(f"{_module_name(fn.__module__)}.{fn.__qualname__}".encode())
            self.code(fn.__code__)
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

    def _object(self, obj: Any, depth: int, data_only: bool = False) -> None:
        """Type and attributes of ``obj``: a callable's all of them, a data object's (a dataset
        inside a dataset) without private numbers, as for the dataset (NOTE [fingerprint])."""
        self.h.update(type_name(type(obj)).encode())
        if isinstance(obj, (types.BuiltinFunctionType, type)):
            self.h.update(getattr(obj, "__qualname__", "").encode())
            return
        attrs = getattr(obj, "__dict__", None)
        if not isinstance(attrs, dict):
            return
        for k in _sorted_keys(attrs):
            v = attrs[k]
            if data_only and isinstance(k, str) and k.startswith("_") and _is_number(v):
                continue  # self._pid, self._calls: per-process state (NOTE [fingerprint])
            self.h.update(_key_repr(k).encode())
            if isinstance(v, (list, tuple)) and len(v) <= _COMPOSE_MAX and any(map(callable, v)):
                self.h.update(f"[{len(v)}".encode())  # Compose(transforms=[...])
                for x in v:
                    if callable(x):
                        self.function(x, depth + 1)
                    else:
                        self.data(x, depth + 1)
            elif callable(v) and not isinstance(v, type):
                self.function(v, depth + 1)
            else:
                self.data(v, depth + 1)

    def class_source(self, tp: type) -> None:
        """The source text of the dataset's class and of its bases defined in the same module
        (NOTE [fingerprint])."""
        self.h.update(_class_source_digest(tp))

    def code(self, code: types.CodeType) -> None:
        """Digest a function's code: its bytecode, the names it uses and its constants."""
        self.h.update(code.co_code)
        self.h.update(repr(code.co_names).encode())
        for const in code.co_consts:
            if isinstance(const, types.CodeType):  # a nested function or comprehension
                self.code(const)
            else:
                self.h.update(_const_bytes(const))

    def _array(self, arr: np.ndarray, depth: int = 0) -> None:
        h = self.h
        h.update(f"{arr.dtype}{arr.shape}".encode())
        if arr.dtype.hasobject:  # an object array (pandas .values of str): its items
            self._items(arr.ravel().tolist(), depth)
            return
        source = _mapped_file(arr)
        if source is not None:  # a file-backed array: the file's identity, not its bytes
            h.update(source)
            return
        flat = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        if flat.nbytes < _CRC_FROM:
            h.update(flat)
            return
        for lo in range(0, flat.nbytes, _CRC_CHUNK):
            h.update(zlib.crc32(flat[lo:lo + _CRC_CHUNK]).to_bytes(4, "little"))

    def _tensor(self, t: torch.Tensor) -> None:
        self.h.update(f"{t.dtype}{tuple(t.shape)}{t.layout}".encode())
        try:
            parts = codec.to_parts(t)  # any dtype as raw bytes (bfloat16 and float8 included)
        except Exception:  # noqa: BLE001 - a tensor the codec cannot take apart: dtype and shape only
            return
        if parts is not None:
            self._array(parts[2])


def _class_source_digest(tp: type) -> bytes:
    """A digest of the source text of ``tp`` and of its bases defined in the same module: not of
    its file's path, which differs from checkout to checkout. A class whose source cannot be read
    (defined by ``exec``) counts by its methods' code."""
    try:
        return _class_source_digest_cached(tp)
    except TypeError:  # an unhashable class (a metaclass's __eq__ without __hash__)
        return _class_source_digest_cached.__wrapped__(tp)


@functools.lru_cache(maxsize=256)  # inspect.getsource parses the module: ~20 ms for torch's
def _class_source_digest_cached(tp: type) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for cls in tp.__mro__:
        if cls is object or getattr(cls, "__module__", None) != tp.__module__:
            continue
        h.update(f"|class {cls.__qualname__}".encode())
        try:
            h.update(inspect.getsource(cls).encode("utf-8", "surrogatepass"))
            continue
        except Exception:  # noqa: BLE001 - no file to read it from (OSError), or one inspect cannot parse
            pass
        code = _Digest(h)
        for name in sorted(k for k in vars(cls) if isinstance(k, str)):
            attr = vars(cls)[name]
            fn = attr.__func__ if isinstance(attr, (staticmethod, classmethod)) else attr
            if isinstance(fn, property):
                fn = fn.fget
            if isinstance(fn, types.FunctionType):
                h.update(name.encode())
                code.code(fn.__code__)
    return h.digest()


def _filesystems(value: Any) -> bool:
    """Whether ``value`` is an fsspec filesystem, or a dict of them (fsspec's instance cache,
    which Hugging Face's IterableDataset keeps as an attribute for its DataLoader workers): its
    tokens, the cache's keys and an attribute of each instance, hash the process id, so hashed they
    would name another cache in every process (NOTE [fingerprint]: process state is skipped)."""
    fsspec = sys.modules.get("fsspec")  # not imported: none of its objects exist
    base = getattr(fsspec, "AbstractFileSystem", None)
    if base is None:
        return False
    if isinstance(value, dict):
        return bool(value) and all(isinstance(v, base) for v in value.values())
    return isinstance(value, base)


def _sorted_keys(d: dict) -> list:
    """The keys of ``d`` in an order that is the same in every process (str or int keys: their
    own order, fast; mixed keys: by a process-independent repr)."""
    kinds = set(map(type, d))
    if len(kinds) == 1 and kinds <= {str, int}:
        return sorted(d)
    return sorted(d, key=_key_repr)


def _mapped_file(arr: np.ndarray) -> bytes | None:
    """Path, offset, size and modification time of the file a ``np.memmap`` maps (None for an
    array in memory): an edit of the file changes its modification time."""
    if not isinstance(arr, np.memmap) or not getattr(arr, "filename", None):
        return None
    base = arr
    while isinstance(getattr(base, "base", None), np.ndarray):
        base = base.base
    try:
        st = os.stat(arr.filename)
    except OSError:
        return None
    start = arr.__array_interface__["data"][0] - base.__array_interface__["data"][0]
    return (f"memmap:{arr.filename}:{arr.offset}+{start}:{arr.strides}:{st.st_size}:"
            f"{st.st_mtime_ns}").encode("utf-8", "surrogatepass")


def _const_bytes(const: Any) -> bytes:
    if isinstance(const, frozenset):  # `x in {"a", "b"}`: before 3.11 marshal follows the hash seed
        return ("{" + ",".join(sorted(map(_key_repr, const))) + "}").encode("utf-8", "surrogatepass")
    if isinstance(const, tuple):
        return b"(" + b",".join(map(_const_bytes, const)) + b")"
    try:
        return marshal.dumps(const)
    except ValueError:  # not marshallable (rare): its type is what we know
        return type(const).__name__.encode()
