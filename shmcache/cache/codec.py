"""Encode samples as a small header plus raw buffers; decode them without pickle.

NOTE [record format]
    A record is what one cache entry's bytes hold, in shared memory or in a spill file::

        0   u32 layout id (INLINE: the layout bytes are stored in the record itself)
        4   u32 key length (keys other than ints; 0 for int keys)
        8   u32 inline layout length (0 unless INLINE)
        12  u32 reserved
        16  fixed-size scalars, 8 bytes each (int64, float64, bool, None takes none)
        ..  variable-length leaves (str, bytes, pickled objects), then arrays, each 64-byte aligned
        ..  the inline layout bytes, if any, then the key bytes - last, so that offsets of the data
            never depend on the key or on where the layout lives.

    The *layout* is the structure of the sample with every leaf's kind, dtype, shape, length and
    offset: a marshal'd nested tuple. Samples of one fixed structure (an image and a label) share
    one layout, so each process compiles a decoder for it once, and a batch of them can be gathered
    field by field with one vectorised copy (store.CacheStore.gather_ints). Layouts are interned per cache in a
    shared table; the record carries only the id. Everything starts 64-byte aligned: the chunk does,
    and arrays sit at 64-byte offsets inside it. A layout nests at most MAX_NESTING containers: its
    decoders recurse a level at a time, so a value nested deeper is pickled whole (the unpickler
    keeps its own stack): any reader's stack decodes what any writer's stored.

    A layout from outside this user's shared memory (a tier, a snapshot) is data from a stranger:
    ``check_layout`` walks it (marshal builds plain values, it never runs code) and refuses any
    node the encoder does not write, offsets beyond the record, object or structured dtypes
    (``np.ndarray(buffer=...)`` would build Python objects out of bytes; the decoders refuse them
    too, wherever the layout came from), and reports pickled leaves (NOTE [record
    authentication] decides who may unpickle them). It refuses what decode would
    refuse, so a record it passes decodes (an import stores nothing else): extension tags no
    handler is registered or named for, extension metas the handler's own ``check`` refuses
    (torch dtypes and image modes by name: nothing is imported for them), leaves inside the
    header, zero-size dtypes; ``tiered_store.untrusted_problem`` also checks that str leaves are
    UTF-8. A layout from outside has at most MAX_LAYOUT_BYTES and MAX_LAYOUT_NODES, which bound
    the work of one decode. marshal trusts the counts it
    reads and shares objects by back-reference, so before ``marshal.loads`` the bytes are scanned
    (only tuple, list, str, int, None and bools; no count beyond the bytes that follow), and the
    walk visits at most one node per byte of the layout: a 5-byte tuple of 2**31 items or 563
    bytes naming 2**40 nodes are refused in time and memory linear in the layout's bytes.

    Layouts carry no version: a new kind of node gets a tag of its own, so records without it read
    as before, and a reader that does not know it refuses the record (check_layout: "not one the
    encoder writes"; a decoder: "written by another shmcache version") - never a guess.

    A list of numbers (issue 31), at least MIN_NUMBERS of them: a list whose items are all Python
    ints (not bools) or all floats, or a rectangular nesting of such lists, is a node ``("l",
    dtype, shape, offset)`` stored as an array - ints in the narrowest of uint8 ... int64 that holds
    them all, floats as float64 - and decoded with ``tolist()``: the same nested lists of the same
    Python numbers, at the numbers' own size (a row of 3,072 pixel ints took 71 KB as one node per
    number). Anything else (mixed types, ragged nesting, ints beyond 64 bits, empty lists, nestings
    deeper than 32 levels) keeps a node per item (a list that holds itself: pickled whole). Such a leaf is not
    gathered as a column (``default_collate`` transposes lists): a batch of them goes item by item.
    One container in many places (``v = [v, v]`` thirty times: the same row twice at each level,
    a few objects that pickle stores once) would be written out at each place: 2**30 rows. The
    encoder writes a shared container again at each place while those writes come to at most
    MAX_LAYOUT_NODES items (a list of numbers counting one per MIN_NUMBERS) and a list of numbers
    at most MAX_LAYOUT_NUMBERS numbers (``[[0] * 16] * 16`` stays an array); past that it stops
    and pickles the value whole, as it does a list that holds itself. (It tells a container met
    before by its id, tracked only in a value past MAX_LAYOUT_NODES items - walked again then,
    tracking from the start: a sample's few containers cost no lookup.)
    A layout from outside holds at most MAX_LAYOUT_NUMBERS numbers in such lists: each becomes a
    Python object when decoded.

    A namedtuple (issue 30) is a node ``("N", qualname, field names, children)``: its class is
    never looked up by the names a record carries (no import, no attribute of a module): decoding
    returns the class this process registered under that (qualname, fields) - every namedtuple
    this process encoded (but the classes made here for records: a stranger's records never fill
    the registry), and those a wrapped dataset carries to its DataLoader workers - else a
    plain ``collections.namedtuple`` of those fields made here (names checked first: identifiers,
    bounded in length and count; a layout from outside names at most MAX_LAYOUT_NAMED classes).

Torch tensors and PIL images are registered extensions (see :func:`register_type`), so this module
never imports torch: their handlers (shmcache.data.tensors, shmcache.data.images) load lazily, the first time a
process encodes such a value or decodes a record that holds one - and only then.
"""

from __future__ import annotations

import collections
import copy
import functools
import hashlib
import keyword
import marshal
import pickle
import re
import struct
from collections.abc import Callable, Sequence
from itertools import chain
from typing import Any, NamedTuple

import numpy as np

from ..base import settings, trees
from ..errors import EncodeError

try:
    from . import _codec
except ImportError:  # no C compiler at install, or a source checkout never built
    _codec = None
_why = settings.native_unavailable(_codec is not None, "the compiled pack")
PACK_NATIVE = not _why  # encode_many packs a batch's flat values in C (_codec.c; see _native_spec)


def pack_unavailable_reason() -> str:
    """Why the compiled pack is not used, and what to do ('' when it is used)."""
    return _why


__all__ = ["Encoded", "encode", "encode_many", "decode", "decoder_for", "register_type", "register_namedtuple",
           "registered_namedtuples", "RECORD_HEADER", "MIN_RECORD_BYTES", "RecordHeader",
           "record_header", "record_key", "inline_layout", "LayoutCheck", "check_layout",
           "INLINE", "ALIGN", "NUMBERS", "MIN_NUMBERS", "Leaf", "MAX_DECODERS", "cached_decoders",
           "clear_decoders", "MAX_LAYOUT_BYTES", "MAX_LAYOUT_NODES", "MAX_LAYOUT_NAMED", "MAX_LAYOUT_NUMBERS",
           "TORCH_METAS", "PIL_PIXEL_BYTES", "torch_check", "pil_check"]

INLINE = 0xFFFFFFFF
ALIGN = 64
RECORD_HEADER = struct.Struct("<IIII")
MIN_RECORD_BYTES = RECORD_HEADER.size  # the shortest record: its header alone (16)
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_U64 = struct.Struct("<Q")

# Leaf and node tags inside a layout.
_INT, _FLOAT, _BOOL, _NONE, _STR, _BYTES, _PICKLE, _ARRAY, _EXT = "ifbnsypae"
_NPSCALAR = "g"  # a numpy scalar (np.float32(1.5)): stored like a 0-d array, returned as a scalar
_TUPLE, _LIST, _DICT = "TLD"
_NAMED = "N"  # a namedtuple: (N, qualname, field names, children); NOTE [record format]
NUMBERS = _NUMBERS = "l"  # a (nested) list of Python ints or floats, stored as an array: (l, dtype, shape, offset)
MIN_NUMBERS = 16  # a list of fewer numbers keeps a node per number (a pair, a short box)
# containers nested deeper than this: the value is pickled whole (``_TooDeep``). Its layout's
# decoder and checks recurse a level at a time, so a bound the encoder's stack set would fail to
# decode from a deeper stack; 64 levels leave any caller hundreds of frames (a sample nests a few)
MAX_NESTING = 64

# Extension types (torch.Tensor): tag -> (type, to_parts, from_parts)
_EXT_TO: dict[type, tuple[str, Callable]] = {}
_EXT_FROM: dict[str, Callable] = {}
_EXT_BASES: dict[type, tuple[str, Callable]] = {}  # registered with subclasses=True
_LAZY: dict[str, Callable] = {}  # tag -> a loader that registers it (imports its package)
_LAZY_MODULES: dict[str, str] = {}  # top-level package of the type -> tag

# namedtuple classes by (qualname, fields): those this process registered (encoded, or carried by a
# wrapped dataset) and those it made for records of classes it never saw (NOTE [record format])
MAX_NAMED_TYPES = 1024
_NAMED_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}
_MADE_TYPES: dict[tuple[str, tuple[str, ...]], type] = {}
_QUALNAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.<>]{0,199}")
_FIELD = re.compile(r"[A-Za-z][A-Za-z0-9_]{0,63}")
_MAX_FIELDS = 1024


def _named_fields(tp: type) -> tuple[str, tuple[str, ...]] | None:
    """``(qualname, fields)`` of a namedtuple class the codec stores as a container; None for any
    other type (and for namedtuples whose names are not plain identifiers: pickled)."""
    fields = getattr(tp, "_fields", None)
    name = getattr(tp, "__qualname__", None)
    if not (issubclass(tp, tuple) and type(fields) is tuple and type(name) is str
            and callable(getattr(tp, "_make", None))):
        return None
    if _named_problem(name, fields) is not None:
        return None
    return name, fields


def _named_problem(name: Any, fields: Any) -> str | None:
    """Why ``(name, fields)`` is not a namedtuple node the encoder writes (None: it is one)."""
    if type(name) is not str or not _QUALNAME.fullmatch(name):
        return f"namedtuple name {str(name)[:40]!r} is not a qualified name"
    if type(fields) is not tuple or len(fields) > _MAX_FIELDS or len(set(fields)) != len(fields):
        return "namedtuple fields are not a tuple of distinct names"
    for f in fields:
        if type(f) is not str or not _FIELD.fullmatch(f) or keyword.iskeyword(f):
            return f"namedtuple field {str(f)[:40]!r} is not an identifier"
    return None


def register_namedtuple(tp: type) -> None:
    """Decode records of namedtuples named like ``tp`` (qualname and fields) as ``tp`` in this
    process (the encoder registers every namedtuple it stores; a wrapped dataset registers those
    it met in its DataLoader workers). Never from a record: NOTE [record format]."""
    key = _named_fields(tp)
    # a class made here for a record (_named_type) is never registered: a stranger's records would
    # then fill the registry (a value of one stored again) and evict the user's own classes
    if key is None or _NAMED_TYPES.get(key) is tp or vars(tp).get("_shmcache_made"):
        return
    if len(_NAMED_TYPES) >= MAX_NAMED_TYPES:
        _NAMED_TYPES.pop(next(iter(_NAMED_TYPES)), None)
    _NAMED_TYPES[key] = tp
    if _MADE_TYPES.pop(key, None) is not None:
        clear_decoders()  # decoders compiled with the stand-in class: compile them again


def registered_namedtuples() -> list[type]:
    """The namedtuple classes this process decodes by (see register_namedtuple)."""
    return list(_NAMED_TYPES.values())


def _named_type(name: str, fields: tuple[str, ...]) -> type:
    """The class of a namedtuple node: registered here, else made here from its (checked) names."""
    key = (name, fields)
    tp = _NAMED_TYPES.get(key) or _MADE_TYPES.get(key)
    if tp is None:
        problem = _named_problem(name, fields)
        if problem is not None:
            raise EncodeError(f"a layout's {problem}: the record is damaged or forged")
        short = name.rpartition(".")[2]
        base = collections.namedtuple(short if short.isidentifier() else "namedtuple", fields)
        # pickled (to a DataLoader's main process) by its names, made or found again there
        tp = type(base.__name__, (base,), {"__slots__": (), "_shmcache_made": True, "__reduce__": lambda self: (
            _remade, (name, fields, tuple(self)))})
        tp.__qualname__ = name
        if len(_MADE_TYPES) >= MAX_NAMED_TYPES:
            _MADE_TYPES.pop(next(iter(_MADE_TYPES)), None)
        _MADE_TYPES[key] = tp
    return tp


def _remade(name: str, fields: tuple[str, ...], values: tuple) -> tuple:
    """Unpickling a namedtuple of a class made by the codec: the class of these names here."""
    return tuple.__new__(_named_type(name, fields), values)


_EXT_CHECK: dict[str, Callable[[str, tuple], str | None]] = {}  # tag -> check of a leaf's meta and shape
_CHECKED: dict[bytes, Any] = {}  # layout (or its digest) -> its LayoutCheck (check_layout)


def register_type(tp: type, tag: str, to_parts: Callable, from_parts: Callable, *,
                  subclasses: bool = False, check: Callable[[str, tuple], str | None] | None = None) -> None:
    """Teach the codec a type: ``to_parts(x) -> (meta: str, shape: tuple, uint8 ndarray)`` (None:
    pickle this one) and ``from_parts(meta, shape, uint8 ndarray) -> x``; ``meta`` ends with
    ``":<itemsize>"``. With ``subclasses``, subclasses of ``tp`` are handled too (PIL's
    JpegImageFile is an Image.Image). ``check(meta, shape)``: why a leaf of a record from outside
    cannot be what ``to_parts`` writes (None: it can); it runs before ``from_parts`` is ever
    called for such a leaf, and must import nothing (check_layout)."""
    _EXT_TO[tp] = (tag, to_parts)
    _EXT_FROM[tag] = from_parts
    if check is not None:
        _EXT_CHECK[tag] = check
    if subclasses:
        _EXT_BASES[tp] = (tag, to_parts)
    _CHECKED.clear()  # a layout refused for naming this tag is judged again


def register_lazy(tag: str, package: str, loader: Callable[[], None], *,
                  check: Callable[[str, tuple], str | None] | None = None) -> None:
    """Register the type of ``tag`` only when needed: ``loader()`` (which imports ``package`` and
    calls register_type) runs the first time a value whose type comes from ``package`` is
    encoded, or a record holding a ``tag`` value is decoded. Optional packages (Pillow) are
    thus never imported by shmcache for users who do not use them. ``check``: as for
    register_type, known before the package is imported."""
    _LAZY[tag] = loader
    _LAZY_MODULES[package] = tag
    if check is not None:
        _EXT_CHECK[tag] = check
    _CHECKED.clear()


def _builtin(module: str) -> Callable[[], None]:
    def load() -> None:
        import importlib

        importlib.import_module(module).register()
    return load


# The metas the torch layer writes: ``str(dtype)`` less "torch.", then ":<itemsize>"
# (``data.tensors``). Checked here, by name, before anything is imported for a leaf from outside:
# torch resolves an unknown attribute by importing a submodule of that name (a meta naming
# "_inductor" imported 315 modules before it was refused). ``test_hostile_layouts``
# checks that every dtype of the installed torch is here.
TORCH_METAS = frozenset(
    f"{name}:{size}" for size, names in (
        (1, "bool uint8 int8 qint8 quint8 quint4x2 quint2x4 float8_e4m3fn float8_e5m2 float8_e4m3fnuz "
            "float8_e5m2fnuz float8_e8m0fnu float4_e2m1fn_x2 bits8 bits1x8 bits2x4 bits4x2 "
            "uint1 uint2 uint3 uint4 uint5 uint6 uint7 int1 int2 int3 int4 int5 int6 int7"),
        (2, "int16 uint16 float16 bfloat16 bits16"),
        (4, "int32 uint32 float32 qint32 complex32"),
        (8, "int64 uint64 float64 complex64"),
        (16, "complex128"))
    for name in names.split())
# The modes the PIL layer writes (``data.images``: those whose raw bytes round-trip) -> bytes per
# pixel ("1": 1 bit, rows padded to a byte).
PIL_PIXEL_BYTES = {"1": 0, "L": 1, "LA": 2, "La": 2, "I": 4, "I;16": 2, "I;16B": 2, "I;16L": 2, "F": 4,
                   "RGB": 3, "RGBA": 4, "RGBa": 4, "RGBX": 4, "CMYK": 4, "YCbCr": 3, "LAB": 3, "HSV": 3}
_IMAGE_META = re.compile(r"([A-Za-z0-9;]{1,8})\|([0-9]{1,9})x([0-9]{1,9}):1")


def torch_check(meta: str, shape: tuple) -> str | None:
    return None if meta in TORCH_METAS else f"a tensor leaf names dtype {meta[:40]!r}, not one torch writes"


def pil_check(meta: str, shape: tuple) -> str | None:
    found = _IMAGE_META.fullmatch(meta)
    if found is None or found[1] not in PIL_PIXEL_BYTES or len(shape) != 1:
        return f"an image leaf of meta {meta[:40]!r} and shape {shape!r} is not what the encoder writes"
    mode, width, height = found[1], int(found[2]), int(found[3])
    row = (width + 7) // 8 if mode == "1" else PIL_PIXEL_BYTES[mode] * width
    if row * height != shape[0]:
        return f"an image leaf of {shape[0]} bytes says it is a {width}x{height} {mode} image"
    return None


# The handlers of the torch layer, named here (not imported: they live above this layer) so that
# any process that meets one of their records - the command line, an import, a DataLoader worker
# that never imported torch itself - loads it then, and only then (issue 17).
for _tag, _package, _module, _check in (("torch", "torch", "shmcache.data.tensors", torch_check),
                                        ("pil", "PIL", "shmcache.data.images", pil_check)):
    register_lazy(_tag, _package, _builtin(_module), check=_check)


def _load(tag: str) -> None:
    loader = _LAZY.get(tag)
    if loader is None:
        return
    try:
        loader()
    except ImportError as exc:
        raise EncodeError(f"a cached value holds a {tag!r} object, but its handler cannot be loaded "
                          f"here ({exc}); install what it needs in this environment") from None
    _LAZY.pop(tag, None)


def _handler(tag: str) -> Callable:
    """The ``from_parts`` of ``tag``, loading a lazily registered handler first."""
    from_parts = _EXT_FROM.get(tag)
    if from_parts is None:
        _load(tag)
        from_parts = _EXT_FROM.get(tag)
        if from_parts is None:
            raise EncodeError(f"a cached value holds a {tag!r} object, but no handler of that type is "
                              f"registered in this process; import the module that registers it "
                              f"(shmcache.cache.codec.register_type or register_lazy) before reading")
    return from_parts


def _unregistered(tp: type) -> tuple[str, Callable] | None:
    """The handler of a type not registered itself: a lazily registered one, or a subclass of a
    type registered with subclasses=True (then remembered for the exact type)."""
    package = (getattr(tp, "__module__", None) or "").split(".", 1)[0]
    if package in _LAZY_MODULES:
        _load(_LAZY_MODULES[package])
    ext = _EXT_TO.get(tp)
    if ext is None:
        for base, handler in _EXT_BASES.items():
            if issubclass(tp, base):
                ext = _EXT_TO[tp] = handler
                break
    return ext


class RecordHeader(NamedTuple):
    """The first 16 bytes of a record (NOTE [record format]; the fourth word is reserved)."""

    layout_id: int  # the layout's id in the cache's meta segment, or INLINE
    key_len: int  # the key bytes at the record's end
    layout_len: int  # the inline layout before the key (INLINE only)


def record_header(buf) -> RecordHeader:
    """The header of the record in ``buf`` (struct.error if ``buf`` is shorter than one)."""
    return RecordHeader(*RECORD_HEADER.unpack_from(buf, 0)[:3])


def record_key(buf):
    """The key bytes stored at the end of the record in ``buf`` (a slice of it)."""
    return buf[len(buf) - RECORD_HEADER.unpack_from(buf, 0)[1]:]


def inline_layout(buf) -> bytes:
    """The layout carried by a record whose layout id is INLINE; ValueError when its lengths do
    not fit the record (damaged, or not such a record)."""
    head = record_header(buf)
    end = len(buf) - head.key_len
    if not RECORD_HEADER.size <= end - head.layout_len < end:
        raise ValueError(f"an inline layout of {head.layout_len} bytes and a key of {head.key_len} "
                         f"in a record of {len(buf)} bytes")
    return bytes(buf[end - head.layout_len:end])


class Encoded:
    """A value ready to be written: its layout bytes, body length and the pieces to copy."""

    # _codec.c's pack makes one without __init__ and sets each slot by name: a slot added here
    # must be set there too
    __slots__ = ("layout", "body_len", "scalars", "pieces", "pickled")

    def __init__(self, layout: bytes, body_len: int, scalars: bytes, pieces: list,
                 pickled: tuple = ()):
        self.layout = layout
        self.body_len = body_len  # header + scalars + variable leaves + arrays, padded
        self.scalars = scalars  # packed at offset 16
        self.pieces = pieces  # [(offset, buffer)] for variable leaves and arrays
        self.pickled = pickled  # names of the types stored with pickle (slow): the torch layer warns

    def record_len(self, key_len: int, inline: bool) -> int:
        return self.body_len + (len(self.layout) if inline else 0) + key_len

    def buffers(self, layout_id: int, key: bytes) -> list:
        """The bytes ``write`` puts into a record, as buffers one after the other from its start,
        the gaps between them as zeros: for one ``pwritev`` (``Segment.write_at``), which copies
        into the segment's pages without the page fault a first store through a mapping takes on
        each page."""
        extra = self.layout if layout_id == INLINE else b""
        # the scalars a buffer of their own: a portable record's are its whole body, a view of it
        # (writer.encoded_from_portable), which header + scalars would copy
        out: list = [RECORD_HEADER.pack(layout_id, len(key), len(extra), 0), self.scalars]
        end = RECORD_HEADER.size + len(self.scalars)
        for off, piece in self.pieces:
            if off > end:
                out.append(bytes(off - end))
            mv = memoryview(piece).cast("B")
            out.append(mv)
            end = off + mv.nbytes
        if self.body_len > end:
            out.append(bytes(self.body_len - end))
        out.append(extra)
        out.append(key)
        return out

    def write(self, dst: memoryview, layout_id: int, key: bytes) -> int:
        """Write the whole record into ``dst`` (at least ``record_len`` bytes); return its length."""
        inline = layout_id == INLINE
        extra = self.layout if inline else b""
        RECORD_HEADER.pack_into(dst, 0, layout_id, len(key), len(extra), 0)
        n = len(self.scalars)
        dst[16:16 + n] = self.scalars
        for off, piece in self.pieces:
            mv = memoryview(piece).cast("B")
            dst[off:off + mv.nbytes] = mv
        end = self.body_len
        if extra:
            dst[end:end + len(extra)] = extra
            end += len(extra)
        dst[end:end + len(key)] = key
        return end + len(key)


class _Repeated(Exception):
    """The value holds one container in so many places that writing it out at each would take
    more than MAX_LAYOUT_NODES items, or a list of numbers more than MAX_LAYOUT_NUMBERS (NOTE
    [record format]): ``encode`` pickles it whole, which stores each object once."""


class _TooDeep(Exception):
    """The value nests containers deeper than MAX_NESTING: ``encode`` pickles it whole, which any
    stack reads back (the unpickler keeps its own stack; a layout's decoder recurses a level at a
    time, so a nesting the encoder's stack could walk failed to decode from a deeper one)."""


class _Untracked(Exception):
    """A walk went past _UNTRACKED items without tracking its containers: ``encode`` walks the
    value again, tracking them (a sample's few containers cost nothing more)."""


_UNTRACKED = 1 << 16  # items walked before containers are tracked: MAX_LAYOUT_NODES (defined below)


class _Builder:
    def __init__(self):
        self.scalars: list[tuple[str, Any]] = []
        self.var: list[tuple[int, bytes]] = []  # (index in var list, bytes) -> offsets fixed later
        self.arrays: list[np.ndarray] = []
        self.pickled: list[str] = []
        # the items walked (a list of numbers: one per MIN_NUMBERS of them); past ``untracked``,
        # each container's (``track``); those walked again because a container was met before
        self.walked, self.untracked, self.again = 0, _UNTRACKED, 0
        self.under: dict[int, int] | None = None  # tracked: items under each container, by id
        self.depth = 0  # containers around the node walked now (MAX_NESTING)

    def tracked(self) -> _Builder:
        """This builder, tracking every container from the first (for a walk again)."""
        self.untracked, self.under = -1, {}
        return self

    def track(self, x: Any) -> None:
        """Container ``x`` is walked past the untracked items: _Untracked if untracked (walk again,
        tracked); _Repeated if ``x`` was met before and such walks again come to more than
        MAX_LAYOUT_NODES items."""
        if self.under is None:
            raise _Untracked
        again = self.under.get(id(x))
        if again is not None:
            self.again += again
            if self.again > MAX_LAYOUT_NODES:
                raise _Repeated

    def enter(self) -> None:
        """A container's children are walked next: one level deeper (an exception leaves the
        count as it is: the value is walked again by a new builder, or pickled)."""
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise _TooDeep

    def node(self, x: Any, path: str) -> tuple:
        tp = type(x)
        if tp is int:
            if -(1 << 63) <= x < (1 << 63):
                self.scalars.append((_INT, x))
                return (_INT, len(self.scalars) - 1)
            return self.pickle_node(x, path)
        if tp is float:
            self.scalars.append((_FLOAT, x))
            return (_FLOAT, len(self.scalars) - 1)
        if tp is bool:
            self.scalars.append((_BOOL, x))
            return (_BOOL, len(self.scalars) - 1)
        if isinstance(x, np.generic) and not x.dtype.hasobject and x.dtype.fields is None and x.dtype.itemsize:
            self.arrays.append(np.ascontiguousarray(x).reshape(-1).view(np.uint8))
            return (_NPSCALAR, x.dtype.str, (), len(self.arrays) - 1)
        if (tp is np.str_ or tp is np.bytes_) and not x.dtype.itemsize:
            # an empty one (a Hugging Face numpy-format text cell) has a dtype of no bytes (<U0,
            # |S0), which no record holds: stored as one NUL character of its kind, which numpy
            # drops when it reads the scalar back - np.str_('') again, of dtype <U0
            one = np.zeros(1, x.dtype.str[:-1] + "1")
            self.arrays.append(one.view(np.uint8))
            return (_NPSCALAR, one.dtype.str, (), len(self.arrays) - 1)
        if x is None:
            return (_NONE,)
        if tp is str:
            b = x.encode("utf-8", "surrogatepass")
            self.var.append((len(self.var), b))
            return (_STR, len(self.var) - 1, len(b))
        if tp is bytes:
            self.var.append((len(self.var), x))
            return (_BYTES, len(self.var) - 1, len(x))
        if tp is tuple:
            start = self.walked  # (a container: counted, as below)
            self.walked = start + len(x)
            if self.walked > self.untracked:
                self.track(x)
            self.enter()
            node = (_TUPLE, tuple(self.node(v, f"{path}[{i}]") for i, v in enumerate(x)))
            self.depth -= 1
            if self.under is not None:
                self.under[id(x)] = self.walked - start
            return node
        if tp is list:
            start = self.walked  # items walked, under each container too: to bound those
            self.walked = start + len(x)  # walked again (_Repeated; tracked past _UNTRACKED)
            if self.walked > self.untracked:
                self.track(x)
            arr = _numbers(x) if len(x) > 1 else None
            if arr is not None:
                self.arrays.append(arr.reshape(-1).view(np.uint8))
                self.walked += arr.size // MIN_NUMBERS  # (its repeats are bounded in _numbers)
                node = (_NUMBERS, arr.dtype.str, tuple(arr.shape), len(self.arrays) - 1)
            else:
                self.enter()
                node = (_LIST, tuple(self.node(v, f"{path}[{i}]") for i, v in enumerate(x)))
                self.depth -= 1
            if self.under is not None:
                self.under[id(x)] = self.walked - start
            return node
        if isinstance(x, tuple) and (named := _named_fields(tp)) is not None \
                and len(x) == len(named[1]) and not getattr(x, "__dict__", None):
            register_namedtuple(tp)
            start = self.walked
            self.walked = start + len(x)
            if self.walked > self.untracked:
                self.track(x)
            self.enter()
            node = (_NAMED, *named, tuple(self.node(v, f"{path}.{f}") for f, v in zip(named[1], x)))
            self.depth -= 1
            if self.under is not None:
                self.under[id(x)] = self.walked - start
            return node
        if tp is dict and all(type(k) in (str, int) for k in x):
            start = self.walked
            self.walked = start + len(x)
            if self.walked > self.untracked:
                self.track(x)
            self.enter()
            node = (_DICT, tuple((k, self.node(v, f"{path}[{k!r}]")) for k, v in x.items()))
            self.depth -= 1
            if self.under is not None:
                self.under[id(x)] = self.walked - start
            return node
        if (tp is np.ndarray or tp is np.memmap) and not x.dtype.hasobject and x.dtype.fields is None:
            # a memmap (np.load(..., mmap_mode="r")[i]) is an array of a file's bytes: stored as
            # one, and read back as a plain ndarray (a copy of its values; no file behind it).
            # (ascontiguousarray would turn a 0-d array into shape (1,))
            arr = x if tp is np.ndarray else x.view(np.ndarray)
            arr = arr if arr.flags.c_contiguous else np.ascontiguousarray(arr)
            self.arrays.append(arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8))
            return (_ARRAY, arr.dtype.str, tuple(arr.shape), len(self.arrays) - 1)
        ext = _EXT_TO.get(tp)
        if ext is None:
            ext = _unregistered(tp)
        if ext is not None:
            tag, to_parts = ext
            parts = to_parts(x)
            if parts is not None:
                meta, shape, raw = parts
                self.arrays.append(raw)
                return (_EXT, tag, meta, tuple(shape), len(self.arrays) - 1)
        return self.pickle_node(x, path)

    def pickle_node(self, x: Any, path: str) -> tuple:
        try:
            b = pickle.dumps(x, protocol=5)
        except Exception as exc:
            raise EncodeError(
                f"cannot store {path or 'the value'} of type {type(x).__name__}: it is neither an "
                f"array, tensor, number, str, bytes or container of them, nor picklable ({exc}); "
                f"return plain arrays/tensors from the dataset or transform"
            ) from None
        self.var.append((len(self.var), b))
        name = _unsupported(x)
        if name not in self.pickled:
            self.pickled.append(name)
        return (_PICKLE, len(self.var) - 1, len(b))


_INT_DTYPES = tuple(np.dtype(t) for t in ("<u1", "<i1", "<u2", "<i2", "<u4", "<i4", "<i8"))


def _numbers(x: list) -> np.ndarray | None:
    """``x`` as a C-contiguous array when it is a list of at least MIN_NUMBERS Python ints (not
    bools) or floats, alone or in rectangular nested lists (NOTE [record format]); else None.
    Every check is a C-level pass (``set(map(...))``): a 32x32x3 image of ints took 350 us a row
    checked item by item in Python, more than reading it."""
    level, shape, firsts = x, [len(x)], {id(x)}
    # the numbers a rectangular nesting holds: the lengths along its first path multiplied. Past
    # MAX_LAYOUT_NUMBERS, every level is checked for a list met twice (below) from the first
    # one on: [v, v] thirty levels deep is found at once, not flattened to 2**21 lists first
    count, first, path = len(x), x, {id(x)}
    while count <= MAX_LAYOUT_NUMBERS and type(first[0]) is list and first[0] and len(path) < _MAX_DIMS \
            and id(first[0]) not in path:
        first = first[0]
        path.add(id(first))
        count *= len(first)
    many = count > MAX_LAYOUT_NUMBERS
    while type(level[0]) is list:  # a level of lists: every item a list of one length
        n = len(level[0])
        # a list that holds itself ([x, x]) made each level twice the last, until memory ran out:
        # the loop goes on only while level[0] is a list, so an endless one meets a first item
        # again (a rectangular nesting never has one list at two depths); numpy takes _MAX_DIMS
        if not n or len(shape) >= _MAX_DIMS or id(level[0]) in firsts or \
                set(map(type, level)) != _LIST_TYPE or set(map(len, level)) != {n}:
            return None
        # one row in many places ([v, v] thirty levels deep: 2**30 rows, a few in memory) is
        # pickled whole, past MAX_LAYOUT_NUMBERS numbers; distinct rows are as many as memory holds
        if (many or len(level) * n > MAX_LAYOUT_NUMBERS) and len(set(map(id, level))) < len(level):
            raise _Repeated
        firsts.add(id(level[0]))
        level = list(chain.from_iterable(level))
        shape.append(n)
    if len(level) < MIN_NUMBERS:
        return None
    kinds = set(map(type, level))
    if kinds == _INT_TYPE:
        try:
            arr = np.array(level, dtype=np.int64)
        except OverflowError:  # beyond 64 bits: a node per number, as before
            return None
        lo, hi = (int(arr.min()), int(arr.max()))
        dtype = next(d for d in _INT_DTYPES if np.iinfo(d).min <= lo and hi <= np.iinfo(d).max)
        arr = arr.astype(dtype)
    elif kinds == _FLOAT_TYPE:
        arr = np.array(level, dtype="<f8")
    else:
        return None
    return arr.reshape(shape)


_LIST_TYPE, _INT_TYPE, _FLOAT_TYPE = {list}, {int}, {float}
_MAX_DIMS = 32  # numpy's arrays have at most 32 dimensions (64 since numpy 2): deeper, a node per item


def _unsupported(x: Any) -> str:
    """What about ``x`` made it pickled, as a warning names it: its type, and for an array or a
    tensor (which are stored natively) the dtype or kind that is not."""
    name = f"{type(x).__module__}.{type(x).__qualname__}".removeprefix("builtins.")
    if isinstance(x, (np.ndarray, np.generic)):
        if x.dtype.hasobject:
            return f"{name} of dtype object"
        if x.dtype.fields is not None:
            return f"{name} of a structured dtype"
    if name == "torch.Tensor" or (type(x).__module__.startswith("torch") and hasattr(x, "is_nested")):
        for attr, kind in (("is_nested", "nested"), ("is_sparse", "sparse"), ("is_quantized", "quantized"),
                           ("is_meta", "on the meta device")):
            if getattr(x, attr, False):
                return f"{name} ({kind})"
        layout = getattr(x, "layout", None)
        if layout is not None and str(layout) != "torch.strided":
            return f"{name} ({str(layout).removeprefix('torch.')})"
    return name


def _place(node: tuple, scalar_off: list[int], var_off: list[int], arr_off: list[int]) -> tuple:
    """Replace list indices in ``node`` by absolute record offsets."""
    tag = node[0]
    if tag in (_INT, _FLOAT, _BOOL):
        return (tag, scalar_off[node[1]])
    if tag in (_STR, _BYTES, _PICKLE):
        return (tag, var_off[node[1]], node[2])
    if tag in (_ARRAY, _NPSCALAR, _NUMBERS):
        return (tag, node[1], node[2], arr_off[node[3]])
    if tag == _EXT:
        return (tag, node[1], node[2], node[3], arr_off[node[4]])
    if tag in (_TUPLE, _LIST):
        return (tag, tuple(_place(c, scalar_off, var_off, arr_off) for c in node[1]))
    if tag == _DICT:
        return (tag, tuple((k, _place(c, scalar_off, var_off, arr_off)) for k, c in node[1]))
    if tag == _NAMED:
        return (tag, node[1], node[2], tuple(_place(c, scalar_off, var_off, arr_off) for c in node[3]))
    return node


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def encode(value: Any, path: str = "") -> Encoded:
    """Encode ``value``; raises EncodeError (naming ``path``) if it cannot be stored."""
    b = _Builder()
    try:
        try:
            tree = b.node(value, path)
        except _Untracked:  # a large value: walked again, tracking its containers
            b = _Builder().tracked()
            tree = b.node(value, path)
    except (_TooDeep, RecursionError) as exc:  # nested deeper than MAX_NESTING (or this stack): pickled whole
        b = _Builder()
        tree = b.pickle_node(value, path)
        deep = f"{MAX_NESTING} containers" if isinstance(exc, _TooDeep) else "this stack walks"
        b.pickled = [f"{name} nested deeper than {deep}" for name in b.pickled]
    except _Repeated:  # written out at each place it holds a shared container: too large, pickled
        b = _Builder()  # whole (pickle stores each object once), named so in the pickled warning
        tree = b.pickle_node(value, path)
        b.pickled = [f"{name} holding one container in many places" for name in b.pickled]
    scalar_off = [16 + 8 * i for i in range(len(b.scalars))]
    pos = 16 + 8 * len(b.scalars)
    var_off = []
    pieces: list[tuple[int, Any]] = []
    for _, data in b.var:
        var_off.append(pos)
        pieces.append((pos, data))
        pos += len(data)
    arr_off = []
    for arr in b.arrays:
        pos = _align(pos)
        arr_off.append(pos)
        pieces.append((pos, arr))
        pos += arr.nbytes
    layout = marshal.dumps(_place(tree, scalar_off, var_off, arr_off), 4)
    scalars = b"".join(
        _I64.pack(v) if t == _INT else _F64.pack(v) if t == _FLOAT else _U64.pack(int(v))
        for t, v in b.scalars
    )
    return Encoded(layout, pos, scalars, pieces, tuple(b.pickled))


def encode_many(values: Sequence, paths: Sequence[str], memo: list | None = None) -> list[Encoded | EncodeError]:
    """``encode`` of each of ``values`` (``paths[i]``: what the error of ``values[i]`` names, read
    only for a value no shape packs, which ``encode`` walks), where a value that cannot be
    encoded gives its EncodeError in its place. A batch of one dataset's samples mostly shares
    one shape: a flat one (a leaf, or a dict of leaves: numbers, str, bytes, None, arrays, numpy
    scalars, registered types such as tensors) is walked once with ``encode`` and the values after
    it are checked against it leaf by leaf and packed into the same layout - the same Encoded
    ``encode`` gives, byte for byte - at a fraction of its cost. ``memo``: a list the caller keeps
    between batches of one dataset, holding the shapes seen last (tried first, the latest match
    first); updated in place."""
    out: list = []
    # the latest first: a batch mixes a few (str lengths, dtypes)
    shapes: list[_Shape] = list(memo) if memo is not None else []
    flat = True
    for i, value in enumerate(values):
        for j, shape in enumerate(shapes):
            # compiled (None: not this shape), in Python where the C cannot view an array as
            # bytes (NotImplemented) or the shape has no spec
            enc = NotImplemented if shape.native is None else _codec.pack(value, shape.native)
            if enc is NotImplemented:
                enc = _encode_like(value, shape)
            if enc is not None:
                out.append(enc)
                if j:  # the shape that matched is tried first next (most of a batch shares one)
                    shapes = [shape, *shapes[:j], *shapes[j + 1:]]
                break
        else:
            try:
                enc = encode(value, paths[i])
            except EncodeError as exc:
                out.append(exc)
                continue
            out.append(enc)
            if flat:
                shape = _shape_of(value, enc)
                if shape is None:
                    flat = bool(shapes)  # deep values: not walked twice each (unless some were flat)
                else:
                    shapes = [shape, *shapes[:_SHAPES - 1]]
    if memo is not None:
        memo[:] = shapes  # one step (another thread's batch may race it: either list is sound)
    return out


_SHAPES = 4  # shapes a batch's encode_many keeps trying


class _Shape(NamedTuple):
    """A flat value's shape (``_shape_of``): what ``_encode_like`` checks a value against."""

    keys: tuple | None  # a dict's keys in order, or None for a single leaf
    key_types: tuple  # their types: 1.0, True and a str subclass equal 1 and "a" but encode otherwise
    leaves: tuple  # per leaf: (check, data): check says it is the same, data its bytes
    first: Encoded  # the layout and offsets of the value it was taken from (not its bytes)
    later: tuple  # the specs of the leaves _encode_like converts last (_LATER), in their order
    native: tuple | None  # what the compiled pack takes (_native_spec); None: _encode_like packs it


def _shape_of(value: Any, enc: Encoded) -> _Shape | None:
    """The shape of ``value`` (encoded as ``enc``) when it is flat and stored without pickle."""
    if enc.pickled:
        return None
    if type(value) is dict:
        if not all(type(k) in (str, int) for k in value):
            return None
        keys, leaves = tuple(value), value.values()
    else:
        keys, leaves = None, (value,)
    key_types = tuple(map(type, keys or ()))
    specs = []
    for x in leaves:
        spec = _leaf_spec(x)
        if spec is None:
            return None
        specs.append(spec)
    # the value's layout and offsets, none of its data: a memo kept between batches holds no sample
    first = Encoded(enc.layout, enc.body_len, b"", [(off, None) for off, _ in enc.pieces])
    return _Shape(keys, key_types, tuple(specs), first, tuple(spec for spec in specs if spec[0] in _LATER),
                  _native_spec(keys, key_types, specs, first))


def _native_spec(keys: tuple | None, key_types: tuple, specs: list, first: Encoded) -> tuple | None:
    """A flat shape as ``_codec.pack`` takes it (``_codec.c`` names the order), or None where
    ``_encode_like`` packs it: no compiled pack, or more leaves than it holds. The C makes
    _encode_like's checks in its order and builds the same Encoded; it knows no rule of the
    format: the layout, the pieces' offsets and what each leaf must match come from here."""
    if not PACK_NATIVE or len(specs) > _PACK_LEAVES or any(kind not in _PACKED for kind, _ in specs):
        return None
    return (keys, key_types, "".join(kind for kind, _ in specs).encode(), tuple(want for _, want in specs),
            first.layout, first.body_len, tuple(off for off, _ in first.pieces), Encoded, np.ndarray, _EXT_TO,
            np.memmap)


def _leaf_spec(x: Any) -> tuple | None:
    """``(kind, what must match)`` of a leaf the builder stores without pickle, or None."""
    tp = type(x)
    if tp is int:
        return (_INT, None) if -(1 << 63) <= x < (1 << 63) else None
    if tp is float:
        return (_FLOAT, None)
    if tp is bool:
        return (_BOOL, None)
    if x is None:
        return (_NONE, None)
    if tp is str:
        return (_STR, len(x.encode("utf-8", "surrogatepass")))
    if tp is bytes:
        return (_BYTES, len(x))
    if tp is np.ndarray or tp is np.memmap:  # (a memmap is stored as an array: _Builder.node)
        return None if x.dtype.hasobject or x.dtype.fields is not None else (_ARRAY, (x.dtype, x.shape))
    if isinstance(x, np.generic):
        return None if x.dtype.hasobject or x.dtype.fields is not None or not x.dtype.itemsize else \
            (_NPSCALAR, (tp, x.dtype))
    ext = _EXT_TO.get(tp)
    if ext is not None:
        parts = ext[1](x)
        if parts is not None:  # the handler too: a type registered again writes another layout
            return (_EXT, (tp, parts[0], tuple(parts[1]), memoryview(parts[2]).nbytes, ext))
    return None


def _encode_like(value: Any, shape: _Shape) -> Encoded | None:
    """``value`` packed into ``shape``'s layout when every leaf matches it (else None: encode it).
    Every leaf is checked before any array or registered type is converted (the costly steps): a
    batch whose str fields vary in length tries a few shapes a value, and most tries fail."""
    if shape.keys is None:
        leaves = (value,)
    # the keys' types first: then they are str and int, whose == is safe (a tensor's raises)
    elif type(value) is dict and tuple(map(type, value)) == shape.key_types and tuple(value) == shape.keys:
        leaves = value.values()
    else:
        return None
    scalars, var, later = [], [], []
    for x, (kind, want) in zip(leaves, shape.leaves):
        tp = type(x)
        if kind == _ARRAY:
            if (tp is not np.ndarray and tp is not np.memmap) or x.dtype != want[0] or x.shape != want[1]:
                return None
            later.append(x)
        elif kind == _INT:
            if tp is not int or not -(1 << 63) <= x < (1 << 63):
                return None
            scalars.append(_I64.pack(x))
        elif kind == _STR:
            if tp is not str:
                return None
            b = x.encode("utf-8", "surrogatepass")
            if len(b) != want:
                return None
            var.append(b)
        elif kind == _FLOAT:
            if tp is not float:
                return None
            scalars.append(_F64.pack(x))
        elif kind == _BOOL:
            if tp is not bool:
                return None
            scalars.append(_U64.pack(int(x)))
        elif kind == _NONE:
            if x is not None:
                return None
        elif kind == _BYTES:
            if tp is not bytes or len(x) != want:
                return None
            var.append(x)
        elif kind == _NPSCALAR:
            if tp is not want[0] or x.dtype != want[1]:
                return None
            later.append(x)
        else:  # _EXT
            if tp is not want[0] or _EXT_TO.get(tp) is not want[4]:
                return None
            later.append(x)
    arrays = []  # the leaves in ``later``, in their order, as the bytes the layout holds
    for x, (kind, want) in zip(later, shape.later):
        if kind == _ARRAY:
            arr = x if x.flags.c_contiguous else np.ascontiguousarray(x)
            arrays.append(arr.reshape(-1).view(np.uint8) if arr.size else np.empty(0, np.uint8))
        elif kind == _NPSCALAR:
            arrays.append(x.tobytes())  # its bytes, as the builder's 0-d array holds them: one C call
        else:
            parts = want[4][1](x)
            if parts is None or parts[0] != want[1] or tuple(parts[1]) != want[2] or \
                    memoryview(parts[2]).nbytes != want[3]:
                return None
            arrays.append(parts[2])
    first = shape.first
    pieces = [(off, data) for (off, _), data in zip(first.pieces, (*var, *arrays))]
    return Encoded(first.layout, first.body_len, b"".join(scalars), pieces)


_LATER = (_ARRAY, _NPSCALAR, _EXT)  # the leaves _encode_like converts after every check passed
_PACKED = (_INT, _FLOAT, _BOOL, _NONE, _STR, _BYTES, *_LATER)  # the leaves _codec.c packs: all
_PACK_LEAVES = 64  # its MAX_LEAVES


# --- decoding ------------------------------------------------------------------------------------

# Compiled decoders of this process, by layout. Bounded: a str's length is part of its layout, so
# samples with variable-length str fields make a new layout almost every time (37,929 decoders,
# +87 MiB, for 100k such samples). When full, the oldest entry goes (first in, first out: a hit
# pays no bookkeeping); a layout read again after that is compiled again (microseconds).
MAX_DECODERS = 1024
# ... and at most this many bytes of layouts: a tier's record brings a layout as large as itself,
# and a decoder holds about 16x its layout (a closure per leaf); 1024 decoders of 1 MiB layouts,
# read from a Redis anyone with its password writes, held 17 GiB. Usual layouts are 100s of bytes.
MAX_DECODER_BYTES = 8 << 20
_DECODERS: dict[tuple[bytes, bool], Callable] = {}
_decoder_bytes = 0  # the layouts' bytes in _DECODERS (threads may race it: it heals when emptied)


def _make_room(n: int) -> None:
    """Evict the oldest decoders until one more, of a layout of ``n`` bytes, fits both limits."""
    global _decoder_bytes
    while _DECODERS and (len(_DECODERS) >= MAX_DECODERS or _decoder_bytes + n > MAX_DECODER_BYTES):
        try:
            oldest = next(iter(_DECODERS))
            del _DECODERS[oldest]
        except (KeyError, RuntimeError, StopIteration):  # another thread changed it meanwhile
            continue
        _decoder_bytes -= len(oldest[0])
    if not _DECODERS:
        _decoder_bytes = 0


def decoder_for(layout: bytes, private: bool = False) -> Callable[[Any], Any]:
    """A compiled decoder for ``layout``: ``fn(record_buffer) -> value`` (cached per process).
    ``private``: for records copied into a bytearray of their own (arrays are made 4x faster)."""
    fn = _DECODERS.get((layout, private))
    if fn is None:
        node = marshal.loads(layout)
        tags = _ext_tags(node)
        if any(tag not in _EXT_FROM for tag in tags):
            return _deferred(layout, private, tags)
        fn = _compile_flat(node, private) or _compile(node, private)
        if len(layout) > MAX_DECODER_BYTES:
            return fn  # used once, not kept
        global _decoder_bytes
        _make_room(len(layout))
        _DECODERS[(layout, private)] = fn
        _decoder_bytes += len(layout)
    return fn


def _ext_tags(node: tuple) -> set[str]:
    """The extension tags a layout names (its structure only: no handler is needed)."""
    tag = node[0]
    if tag == _EXT:
        return {node[1]}
    if tag in (_TUPLE, _LIST):
        return set().union(*(_ext_tags(c) for c in node[1]))
    if tag == _DICT:
        return set().union(*(_ext_tags(c) for _, c in node[1]))
    if tag == _NAMED:
        return set().union(*(_ext_tags(c) for c in node[3]))
    return set()


def _deferred(layout: bytes, private: bool, tags: set[str]) -> Callable[[Any], Any]:
    """The decoder of a layout whose handlers this process has not loaded: they load on its first
    decode, not before. Checking, exporting or importing a cache needs its layouts, never its
    handlers: gc, stat and export of a cache of tensors never import torch (issue 17)."""
    fn = None

    def decode(buf):
        nonlocal fn
        if fn is None:
            for tag in tags:
                _handler(tag)  # loads it, or raises naming what is missing
            fn = decoder_for(layout, private)
        return fn(buf)
    return decode


def cached_decoders() -> int:
    """How many compiled decoders this process holds (at most ``MAX_DECODERS``)."""
    return len(_DECODERS)


def clear_decoders() -> None:
    """Forget every compiled decoder of this process (``clear()`` of a cache calls it)."""
    global _decoder_bytes
    _DECODERS.clear()
    _decoder_bytes = 0


def _compile_flat(node: tuple, private: bool) -> Callable | None:
    """The decoder of ``node`` as one generated function (a hit is dominated by Python calls: a
    closure per field costs one call each); None where a layout is too deep or large for that.
    Only ints go into the source text (int() of every offset); everything else is a constant."""
    consts: dict[str, Any] = {"_i64": _I64.unpack_from, "_f64": _F64.unpack_from, "_fb": np.frombuffer,
                              "_nd": np.ndarray, "_u8": np.dtype(np.uint8), "_loads": pickle.loads}
    sliced_end = 0  # where the str/bytes/pickled leaves end: slicing clamps a record cut short

    def sliced(n: tuple) -> str:
        nonlocal sliced_end
        start, end = int(n[1]), int(n[1]) + int(n[2])
        sliced_end = max(sliced_end, end)
        return f"buf[{start}:{end}]"

    def const(value: Any) -> str:
        name = f"_c{len(consts)}"
        consts[name] = value
        return name

    def expr(n: tuple) -> str:
        tag = n[0]
        if tag == _INT:
            return f"_i64(buf, {int(n[1])})[0]"
        if tag == _FLOAT:
            return f"_f64(buf, {int(n[1])})[0]"
        if tag == _BOOL:
            return f"(buf[{int(n[1])}] != 0)"
        if tag == _NONE:
            return "None"
        if tag == _STR:
            return f"bytes({sliced(n)}).decode('utf-8', 'surrogatepass')"
        if tag == _BYTES:
            return f"bytes({sliced(n)})"
        if tag == _PICKLE:
            return f"_loads({sliced(n)})"
        if tag == _ARRAY:
            dtype, shape = _plain_dtype(n[1]), tuple(n[2])
            count = int(np.prod(shape, dtype=np.int64))
            if private and count:
                return f"_nd({const(shape)}, {const(dtype)}, buf, {int(n[3])})"
            return f"_fb(buf, {const(dtype)}, {count}, {int(n[3])}).reshape({const(shape)})"
        if tag == _NPSCALAR:
            return f"_fb(buf, {const(_plain_dtype(n[1]))}, 1, {int(n[3])})[0]"
        if tag == _NUMBERS:
            dtype, shape = _plain_dtype(n[1]), tuple(n[2])
            count = int(np.prod(shape, dtype=np.int64))
            return f"_fb(buf, {const(dtype)}, {count}, {int(n[3])}).reshape({const(shape)}).tolist()"
        if tag == _EXT:
            from_parts = _handler(n[1])
            size = _ext_nbytes(n[2], n[3])
            off = int(n[4])
            raw = f"_nd(({size},), _u8, buf, {off})" if private and size else f"_fb(buf, _u8, {size}, {off})"
            return f"{const(from_parts)}({const(n[2])}, {const(tuple(n[3]))}, {raw})"
        if tag == _TUPLE:
            return "(" + "".join(expr(c) + ", " for c in n[1]) + ")"
        if tag == _LIST:
            return "[" + ", ".join(expr(c) for c in n[1]) + "]"
        if tag == _DICT:
            return "{" + ", ".join(f"{const(k)}: {expr(c)}" for k, c in n[1]) + "}"
        if tag == _NAMED:
            new = const(functools.partial(tuple.__new__, _named_type(n[1], n[2])))
            return f"{new}((" + "".join(expr(c) + ", " for c in n[3]) + "))"
        raise EncodeError(f"unknown layout tag {tag!r}: the cache was written by another shmcache version")

    try:
        body = expr(node)
        # the one check numpy and struct do not make for us: a record too short for its layout
        # (damage, issue 8) must raise, never decode a truncated str, bytes or pickle
        guard = (f"    if len(buf) < {sliced_end}:\n        raise ValueError('a record of %d bytes, its "
                 f"layout needs {sliced_end}' % len(buf))\n") if sliced_end else ""
        source = f"def decode(buf):\n{guard}    return {body}\n"
        if len(source) > 100_000:
            return None
        exec(compile(source, "<shmcache decoder>", "exec"), consts)  # noqa: S102 - our own text
    except (RecursionError, SyntaxError, MemoryError):
        return None
    return consts["decode"]


def _compile(node: tuple, private: bool = False, check: bool = False) -> Callable:
    """Turn a layout node into a closure ``fn(buf) -> value``.

    ``buf`` is the record as a buffer: a private bytearray (values come out writable and owned) or
    a read-only memoryview of shared memory (zero-copy, read-only arrays). ``private``: ``buf`` is
    always a bytearray nobody else holds, so arrays may be plain ``np.ndarray(buffer=buf)`` views
    (that keep only a reference to ``buf``, no buffer export: fine, as nobody resizes it).
    """
    tag = node[0]
    if tag == _INT:
        unpack, off = _I64.unpack_from, node[1]
        return lambda buf: unpack(buf, off)[0]
    if tag == _FLOAT:
        unpack, off = _F64.unpack_from, node[1]
        return lambda buf: unpack(buf, off)[0]
    if tag == _BOOL:
        off = node[1]
        return lambda buf: buf[off] != 0
    if tag == _NONE:
        return lambda buf: None
    if tag in (_STR, _BYTES) or (tag == _PICKLE and check):  # check: a pickle is located, never loaded
        # the one kind of leaf that a record too short for its layout (damage) would otherwise
        # truncate silently: slicing clamps, where numpy and struct raise
        off, n = node[1], node[2]
        text = tag == _STR

        def var_leaf(buf):
            b = bytes(buf[off:off + n])
            if len(b) != n:
                raise ValueError(f"a leaf of {n} bytes at offset {off} in a record of {len(buf)}")
            return b.decode("utf-8", "surrogatepass") if text else b
        return var_leaf
    if tag == _PICKLE:
        off, n = node[1], node[2]
        return lambda buf: pickle.loads(buf[off:off + n])
    if tag == _ARRAY:
        # frombuffer, not np.ndarray(buffer=...): it holds a buffer export on the mapping, so a
        # zero-copy view keeps the memory mapped (mmap.close() refuses) for as long as it lives
        dtype, shape, off = _plain_dtype(node[1]), node[2], node[3]
        count = int(np.prod(shape, dtype=np.int64))
        if private and count:
            ndarray = np.ndarray
            return lambda buf: ndarray(shape, dtype, buf, off)
        return lambda buf: np.frombuffer(buf, dtype, count, off).reshape(shape)
    if tag == _NPSCALAR:
        dtype, off = _plain_dtype(node[1]), node[3]
        return lambda buf: np.frombuffer(buf, dtype, 1, off)[0]
    if tag == _NUMBERS:
        dtype, shape, off = _plain_dtype(node[1]), node[2], node[3]
        count = int(np.prod(shape, dtype=np.int64))
        return lambda buf: np.frombuffer(buf, dtype, count, off).reshape(shape).tolist()
    if tag == _EXT:
        ext, meta, shape, off = node[1], node[2], node[3], node[4]
        # check: a handler not loaded is not loaded for it; the leaf's bytes are still located
        from_parts = (_EXT_FROM.get(ext) or _located) if check else _handler(ext)
        n = _ext_nbytes(meta, shape)
        if private and n:
            ndarray, u8, flat = np.ndarray, np.dtype(np.uint8), (n,)
            return lambda buf: from_parts(meta, shape, ndarray(flat, u8, buf, off))
        return lambda buf: from_parts(meta, shape, np.frombuffer(buf, np.uint8, n, off))
    if tag in (_TUPLE, _LIST):
        parts = [_compile(c, private, check) for c in node[1]]
        if len(parts) == 2:  # the common (sample, label) pair, without a comprehension
            a, b = parts
            if tag == _TUPLE:
                return lambda buf: (a(buf), b(buf))
            return lambda buf: [a(buf), b(buf)]
        if tag == _TUPLE:
            return lambda buf: tuple([p(buf) for p in parts])
        return lambda buf: [p(buf) for p in parts]
    if tag == _DICT:
        items = [(k, _compile(c, private, check)) for k, c in node[1]]
        return lambda buf: {k: p(buf) for k, p in items}
    if tag == _NAMED:
        # check: the class is not made for it (a plain tuple locates the leaves just as well)
        new = tuple if check else functools.partial(tuple.__new__, _named_type(node[1], node[2]))
        fields = [_compile(c, private, check) for c in node[3]]
        return lambda buf: new([p(buf) for p in fields])
    raise EncodeError(f"unknown layout tag {tag!r}: the cache was written by another shmcache version")


def _plain_dtype(spec: Any) -> np.dtype:
    """The dtype of an array leaf: only what the encoder writes (a plain dtype string, no object
    fields, no structure). An object dtype would build Python objects out of the record's bytes
    (np.ndarray(buffer=...) does that), so it is refused wherever a layout comes from."""
    if type(spec) is not str:
        raise EncodeError(f"a layout's dtype is {type(spec).__name__}, not a dtype string: the record is "
                          f"damaged or forged")
    try:
        dt = np.dtype(spec)
    except Exception:  # noqa: BLE001 - any string numpy refuses
        raise EncodeError(f"a layout names dtype {spec[:40]!r}, which numpy does not know: the record is "
                          f"damaged or forged") from None
    if dt.hasobject or dt.fields is not None or dt.subdtype is not None:
        raise EncodeError(f"a layout names dtype {spec[:40]!r}: object or structured arrays are never "
                          f"built from a record's bytes (the encoder never writes them)")
    if not dt.itemsize:  # numpy builds no array of them from bytes ("itemsize cannot be zero")
        raise EncodeError(f"a layout names dtype {spec[:40]!r}, of elements of no bytes: the record is "
                          f"damaged or forged")
    return dt


class LayoutCheck(NamedTuple):
    """What :func:`check_layout` found: ``problem`` (None: a layout the encoder could have
    written), ``pickled`` (it holds a pickled leaf), ``needed`` (the body bytes its leaves span),
    ``texts`` (the (offset, length) of its str leaves: the one kind whose bytes, not only its
    layout, decide whether it decodes - they must be UTF-8), ``unknown_tag`` (an extension tag no
    handler of this process is registered or named for: a record of a type the user registered
    in another process; it decodes only where that type is registered)."""

    problem: str | None
    pickled: bool
    needed: int
    texts: tuple = ()
    unknown_tag: str | None = None


# A layout from outside (check_layout) may have at most this many bytes and nodes: what one decode
# of it costs, in time and memory, is bounded by them (a 19.5 MB layout of 4 million nodes shared
# by reference cost 9.3 s and 1.3 GB per decode). A sample of more leaves than this is stored
# and read locally, but not taken from a tier or a snapshot (an import counts it damaged).
MAX_LAYOUT_BYTES = 1 << 20
MAX_LAYOUT_NODES = 1 << 16
# the numbers a layout from outside may hold in lists of numbers: each becomes a Python object
# (8 to 40 bytes) when decoded, so the bytes of a record alone would not bound a decode's memory
MAX_LAYOUT_NUMBERS = 1 << 22
# ... and at most this many namedtuple classes (distinct name and fields): a decode makes a class
# for each one this process has not registered (collections.namedtuple: about 0.5 ms each), and a
# 529 KB layout naming 20,000 of them cost 9.3 s on its first decode. A sample of many
# namedtuples is usually many of one class, which counts once.
MAX_LAYOUT_NAMED = 64


_META = re.compile(r"[A-Za-z0-9_.;,=|-]{1,64}:[0-9]{1,3}")
_TAG = re.compile(r"[A-Za-z0-9_]{1,32}")
_MAX_LEAF_BYTES = 1 << 62


_MARSHAL_FIXED = {ord(c): n for c, n in (("N", 0), ("T", 0), ("F", 0), ("i", 4), ("r", 4))}
_MARSHAL_SIZED = {ord(c): w for c, w in (("z", 1), ("Z", 1), ("a", 4), ("A", 4), ("u", 4), ("t", 4))}


def _marshal_bounded(data: bytes) -> None:
    """Refuse marshal bytes that are not plain tuples, lists, str, int, None and bools, or whose
    counts exceed the bytes that follow: marshal allocates a container of the count it reads
    before reading an item (a 5-byte tuple of 2**31 items is 16 GiB). Linear, allocates nothing."""
    pos, pending, end = 0, 1, len(data)
    while pending:
        if pos >= end:
            raise ValueError("the layout's bytes end early")
        code, pos, pending = data[pos] & 0x7F, pos + 1, pending - 1
        if code in _MARSHAL_FIXED:
            pos += _MARSHAL_FIXED[code]
            continue
        width = 1 if code in (0x29, 0x7A, 0x5A) else 4  # ")": a small tuple; "z", "Z": a short str
        if pos + width > end:
            raise ValueError("the layout's bytes end early")
        n = data[pos] if width == 1 else int.from_bytes(data[pos:pos + 4], "little", signed=code == 0x6C)
        pos += width
        if code in _MARSHAL_SIZED:  # str: n bytes
            pos += n
        elif code == 0x6C:  # "l": an int of |n| 15-bit digits
            pos += 2 * abs(n)
        elif code in (0x28, 0x29, 0x5B):  # "(", ")", "[": n objects of at least a byte each
            pending += n
        else:
            raise ValueError(f"marshal type {chr(code)!r} is not one the encoder writes")
        if pos + pending > end:
            raise ValueError("a count in the layout exceeds its bytes")


def check_layout(layout: bytes) -> LayoutCheck:
    """Check a layout that came from outside this user's shared memory (a tier, a snapshot)
    without decoding a record and without unpickling anything: its structure, every leaf's kind,
    offsets, lengths, dtype and extension (NOTE [record authentication]). Cached per
    layout (bounded like the decoders)."""
    # keyed by the layout itself when small (usual), else by its digest: a tier's record may bring
    # a layout as large as itself, and a refused one would be kept whole (1024 x its size)
    ckey = layout if len(layout) <= 4096 else hashlib.blake2b(layout, digest_size=16).digest()
    found = _CHECKED.get(ckey)
    if found is not None:
        return found
    pickled = False
    needed = numbers = 0
    texts: list[tuple[int, int]] = []
    unknown: list[str] = []
    # nodes a layout of these bytes can hold: marshal's back-references let a few hundred bytes
    # name a tree of 2**40 nodes (one node twice, the second by reference); and at most
    # MAX_LAYOUT_NODES, whatever its bytes
    budget = min(len(layout), MAX_LAYOUT_NODES)
    named: set[tuple[str, tuple[str, ...]]] = set()  # the namedtuple classes it names

    def num(x: Any, what: str) -> int:
        if type(x) is not int or not 0 <= x < _MAX_LEAF_BYTES:
            raise ValueError(f"{what} {x!r} is not a byte count")
        return x

    def offset(x: Any) -> int:
        # a leaf in the record's header would read its lengths, which differ once the record is
        # stored with its layout interned: the encoder starts every leaf after the header
        if num(x, "an offset") < RECORD_HEADER.size:
            raise ValueError(f"a leaf at offset {x} lies in the record's header")
        return x

    def shape_of(x: Any) -> int:
        if type(x) is not tuple or len(x) > 64:
            raise ValueError(f"shape {x!r} is not a tuple of dimensions")
        count = 1
        for d in x:
            count *= num(d, "a dimension")
        return num(count, "an element count")

    def walk(node: Any, depth: int) -> None:
        nonlocal pickled, needed, budget, numbers
        budget -= 1
        if budget < 0:
            raise ValueError(f"it names more nodes than its bytes can hold (shared by reference), or more "
                             f"than {MAX_LAYOUT_NODES}")
        if depth > 200 or type(node) is not tuple or not node or type(node[0]) is not str:
            raise ValueError("it is not a layout tree")
        tag, n = node[0], len(node)
        if tag in (_TUPLE, _LIST) and n == 2 and type(node[1]) is tuple:
            for child in node[1]:
                walk(child, depth + 1)
        elif tag == _DICT and n == 2 and type(node[1]) is tuple:
            for item in node[1]:
                if type(item) is not tuple or len(item) != 2 or type(item[0]) not in (str, int):
                    raise ValueError("a dict entry is not a (str or int key, node) pair")
                walk(item[1], depth + 1)
        elif tag == _NAMED and n == 4 and type(node[3]) is tuple:
            problem = _named_problem(node[1], node[2])
            if problem is not None or len(node[2]) != len(node[3]):
                raise ValueError(problem or "a namedtuple's fields and children differ in number")
            named.add((node[1], node[2]))
            if len(named) > MAX_LAYOUT_NAMED:
                raise ValueError(f"it names more than {MAX_LAYOUT_NAMED} namedtuple classes (a class is made "
                                 f"for each when decoded)")
            budget -= len(node[2])
            for child in node[3]:
                walk(child, depth + 1)
        elif tag in (_INT, _FLOAT, _BOOL) and n == 2:
            needed = max(needed, offset(node[1]) + 8)
        elif tag == _NONE and n == 1:
            pass
        elif tag in (_STR, _BYTES, _PICKLE) and n == 3:
            needed = max(needed, offset(node[1]) + num(node[2], "a length"))
            pickled = pickled or tag == _PICKLE
            if tag == _STR:
                texts.append((node[1], node[2]))
        elif tag in (_ARRAY, _NPSCALAR, _NUMBERS) and n == 4:
            count = shape_of(node[2])
            if tag == _NUMBERS:
                if len(node[2]) == 0 or _plain_dtype(node[1]).kind not in "iuf":
                    raise ValueError(f"a list of numbers of dtype {node[1]!r}, shape {node[2]!r}")
                numbers += count
                if numbers > MAX_LAYOUT_NUMBERS:
                    raise ValueError(f"its lists hold more than {MAX_LAYOUT_NUMBERS} numbers (each a Python "
                                     f"object when decoded)")
            if tag == _NPSCALAR and node[2] != ():  # a batch would gather it as an array of that shape
                raise ValueError(f"a numpy scalar of shape {node[2]!r}, not ()")
            needed = max(needed, offset(node[3]) + count * _plain_dtype(node[1]).itemsize)
        elif tag == _EXT and n == 5:
            # the tag names a handler registered in this process (its own code, maybe not loaded
            # yet: a record of tensors is checked without importing torch); the leaf's meta is
            # checked by name by the handler's own check, before anything is imported for it
            if type(node[1]) is not str or not _TAG.fullmatch(node[1]):
                raise ValueError(f"extension tag {node[1]!r} is not one the encoder writes")
            if node[1] not in _EXT_FROM and node[1] not in _LAZY:
                unknown.append(node[1])
            if type(node[2]) is not str or not _META.fullmatch(node[2]):
                raise ValueError(f"extension meta {node[2]!r} is not what the encoder writes")
            shape_of(node[3])
            ext_check = _EXT_CHECK.get(node[1])
            why = ext_check(node[2], node[3]) if ext_check is not None else None
            if why is not None:
                raise ValueError(why)
            needed = max(needed, offset(node[4]) + _ext_nbytes(node[2], node[3]))
        else:
            raise ValueError(f"a node {tag!r} of {n} fields is not one the encoder writes")

    try:
        if len(layout) > MAX_LAYOUT_BYTES:
            raise ValueError(f"it has {len(layout)} bytes, more than the {MAX_LAYOUT_BYTES} a layout from "
                             f"outside may have")
        _marshal_bounded(layout)
        walk(marshal.loads(layout), 0)  # marshal builds plain values (never runs code)
        found = LayoutCheck(None, pickled, needed, tuple(texts), unknown[0] if unknown else None)
    except (ValueError, EOFError, TypeError, EncodeError, RecursionError, MemoryError) as exc:
        found = LayoutCheck(f"its layout is not one the encoder writes ({exc})", False, 0)
    if len(_CHECKED) >= MAX_DECODERS:
        _CHECKED.clear()
    _CHECKED[ckey] = found
    return found


def _ext_nbytes(meta: str, shape: tuple) -> int:
    itemsize = int(meta.rsplit(":", 1)[1])  # extension meta strings end with ":<itemsize>"
    return int(np.prod(shape, dtype=np.int64)) * itemsize


def _located(meta: str, shape: tuple, raw: np.ndarray) -> None:
    return None


def check(record: Any, layout: bytes) -> None:
    """Decode ``record`` by ``layout`` to check that they fit (the error numpy, struct or utf-8
    raise when not), without loading a handler and without unpickling: a pickled leaf, and an
    extension leaf whose handler this process has not loaded, are only located within the record
    (a record of tensors is checked without importing torch; an import checks a snapshot's records
    with tiered_store.untrusted_problem, which reads only the layout: check_layout)."""
    _compile(marshal.loads(layout), False, True)(record)


def decode(record: Any, layout: bytes) -> Any:
    """Decode one record (a buffer starting at the record header)."""
    return decoder_for(layout)(record)


def own_copy(value: Any) -> Any:
    """``value`` as the cache gives it back, in memory of its own: each array or tensor a copy of
    its own elements (of a view: not the whole buffer it views, as ``copy.deepcopy`` copies a
    tensor's storage), the rest rebuilt; what cannot be encoded, deep-copied. For a value kept
    past the moment its source may write over the buffer it lies in (claims: a batch computed in
    two calls)."""
    try:
        enc = encode(value)
    except EncodeError:
        return copy.deepcopy(value)
    buf = bytearray(enc.record_len(0, True))
    enc.write(memoryview(buf), INLINE, b"")
    return decode(buf, enc.layout)


# --- layout introspection for the vectorised batch path ----------------------------------------


class Leaf:
    """One leaf of a layout: where it sits in the record and how to view a column of them."""

    __slots__ = ("tag", "offset", "nbytes", "dtype", "shape", "meta", "ext")

    def __init__(self, tag, offset, nbytes, dtype=None, shape=(), meta=None, ext=None):
        self.tag, self.offset, self.nbytes = tag, offset, nbytes
        self.dtype, self.shape, self.meta, self.ext = dtype, shape, meta, ext


def leaves(layout: bytes) -> tuple[Any, list[Leaf]]:
    """The layout's structure as a spec of ``base.trees`` (what a batch of such records is rebuilt
    from) and its list of leaves, depth first."""
    out: list[Leaf] = []

    def walk(node):
        tag = node[0]
        if tag in (_TUPLE, _LIST):
            return ("tuple" if tag == _TUPLE else "list", None, tuple(walk(c) for c in node[1]))
        if tag == _DICT:
            keys = tuple(k for k, _ in node[1])
            return ("map", (dict, keys), tuple(walk(c) for _, c in node[1]))
        if tag == _NAMED:
            return ("namedtuple", _named_type(node[1], node[2]), tuple(walk(c) for c in node[3]))
        if tag == _INT:
            out.append(Leaf(tag, node[1], 8, np.dtype("<i8")))
        elif tag == _FLOAT:
            out.append(Leaf(tag, node[1], 8, np.dtype("<f8")))
        elif tag == _BOOL:
            out.append(Leaf(tag, node[1], 1, np.dtype("?")))
        elif tag in (_ARRAY, _NPSCALAR, _NUMBERS):
            dt = _plain_dtype(node[1])
            out.append(Leaf(_ARRAY if tag != _NUMBERS else tag, node[3],
                            int(np.prod(node[2], dtype=np.int64)) * dt.itemsize, dt, node[2]))
        elif tag == _EXT:
            out.append(Leaf(tag, node[4], _ext_nbytes(node[2], node[3]), None, node[3], node[2], node[1]))
        elif tag == _NONE:
            out.append(Leaf(tag, 0, 0))
        else:  # str, bytes, pickle: decoded per item
            out.append(Leaf(tag, node[1], node[2]))
        return trees.LEAF

    tree = walk(marshal.loads(layout))
    return tree, out


def ext_from_parts(tag: str) -> Callable:
    return _handler(tag)


def to_parts(x: Any) -> tuple | None:
    """``(meta, shape, uint8 ndarray)`` of a value of a registered type; None if it has none."""
    ext = _EXT_TO.get(type(x)) or _unregistered(type(x))
    return ext[1](x) if ext is not None else None


def pickled_offsets(layout: bytes) -> set[int]:
    """Record offsets of the pickled leaves of an encoded value (see ``Encoded.pieces``)."""
    found: set[int] = set()

    def walk(node: tuple) -> None:
        tag = node[0]
        if tag == _PICKLE:
            found.add(node[1])
        elif tag in (_TUPLE, _LIST):
            for child in node[1]:
                walk(child)
        elif tag == _DICT:
            for _, child in node[1]:
                walk(child)
        elif tag == _NAMED:
            for child in node[3]:
                walk(child)

    walk(marshal.loads(layout))
    return found


def leaf_decoder(leaf: Leaf) -> Callable:
    """Decoder of one str / bytes / pickle leaf, for records that are otherwise gathered as columns."""
    return _compile((leaf.tag, leaf.offset, leaf.nbytes))
