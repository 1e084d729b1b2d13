"""The codec: every supported value round-trips bit for bit, through a bare record buffer and through
the store (interned and inline layouts, copy=True and copy=False); unstorable values are refused
with an EncodeError that names where they sit.
"""

from __future__ import annotations

import math
import pickle
import subprocess
import sys
from collections import OrderedDict, namedtuple
from pathlib import Path

import numpy as np
import pytest
import torch

import shmcache.data.dataset  # noqa: F401  (registers torch tensors with the codec)
from shmcache.cache import codec
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import EncodeError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _workers import assert_same  # noqa: E402

Point = namedtuple("Point", "x y")


def record_roundtrip(value, key: bytes = b""):
    """Encode into a fresh record (layout stored inline) and decode from a private buffer."""
    enc = codec.encode(value)
    n = enc.record_len(len(key), True)
    buf = bytearray(n + 7)  # slack after the record: decoding must not depend on the buffer's end
    assert enc.write(memoryview(buf), codec.INLINE, key) == n
    return codec.decode(buf, enc.layout)


@pytest.fixture
def store():
    s = CacheStore("codec", "values", capacity_bytes=64 << 20)
    yield s
    s.close()


def store_roundtrip(store, value, key=0):
    assert store.put(key, value)
    got_copy = store.lookup(key, copy=True)
    got_view = store.lookup(key, copy=False)
    return got_copy, got_view


# --- values ------------------------------------------------------------------------------------

_rng = np.random.default_rng(7)


def _random_array(dtype, shape) -> np.ndarray:
    dt = np.dtype(dtype)
    n = int(np.prod(shape, dtype=np.int64))
    if dt.kind == "b":
        return (_rng.integers(0, 2, n) == 1).reshape(shape)
    raw = _rng.integers(0, 256, n * dt.itemsize, dtype=np.uint8).tobytes()
    arr = np.frombuffer(raw, dt).reshape(shape).copy()
    if dt.kind in "fc":  # NaN payloads survive too, but keep a few NaNs of each sign around
        arr.reshape(-1)[:1] = np.nan
    return arr


NUMPY_DTYPES = [
    "?", "i1", "u1", "<i2", "<u2", "<i4", "<u4", "<i8", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16",
    "<f16" if np.dtype(np.longdouble).itemsize == 16 else "<f8", "<M8[ns]", "<m8[s]", "<U5", "|S3",
    "|V4", ">i2", ">u4", ">i8", ">f4", ">f8", ">c16", ">M8[us]", ">U3",
]


@pytest.mark.parametrize("dtype", NUMPY_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (7,), (3, 0, 2), (2, 3, 5)], ids=str)
def test_numpy_every_dtype_and_shape_roundtrips(dtype, shape):
    arr = _random_array(dtype, shape)
    assert_same(record_roundtrip(arr), arr)


def test_numpy_zero_dim_arrays_keep_their_shape():
    """``np.array(5)`` has shape (); it must not come back as shape (1,) (np.ascontiguousarray
    promotes 0-d arrays to 1-d)."""
    wrong = []
    for dtype in NUMPY_DTYPES:
        arr = _random_array(dtype, ())
        got = record_roundtrip(arr)
        if got.shape != () or got.tobytes() != arr.tobytes() or got.dtype.str != arr.dtype.str:
            wrong.append(f"{dtype}: shape {got.shape}")
    assert not wrong, f"0-d arrays changed: {wrong}"


@pytest.mark.parametrize("make", [
    lambda a: a[::2],
    lambda a: a[:, ::-1],
    lambda a: a.T,
    lambda a: np.asfortranarray(a),
    lambda a: a[1:, 2:],
    lambda a: np.broadcast_to(a[:1], (5, 6)),
    lambda a: a.view(">i4").byteswap(),  # big-endian, non-native layout in memory
], ids=["step", "reversed", "transposed", "fortran", "offset", "broadcast", "big-endian"])
def test_numpy_non_contiguous_views_roundtrip(make):
    base = np.arange(30, dtype=np.int32).reshape(5, 6)
    arr = make(base)
    got = record_roundtrip(arr)
    assert_same(got, np.ascontiguousarray(arr))
    assert got.flags.c_contiguous


def test_numpy_array_payload_is_64_byte_aligned_in_the_record():
    enc = codec.encode((1, "abc", np.zeros(3, np.uint8), np.ones(5, np.float32)))
    offsets = [off for off, piece in enc.pieces if isinstance(piece, np.ndarray)]
    assert offsets and all(off % 64 == 0 for off in offsets)


@pytest.mark.parametrize("dtype", [
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int16,
    torch.int32, torch.int64, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2,
], ids=str)
@pytest.mark.parametrize("shape", [(), (0,), (5,), (2, 3, 4)], ids=str)
def test_torch_every_dtype_and_shape_roundtrips(dtype, shape):
    n = int(np.prod(shape, dtype=np.int64))
    if dtype is torch.bool:
        t = torch.from_numpy(_rng.integers(0, 2, n) == 1).reshape(shape)
    else:
        itemsize = torch.empty((), dtype=dtype).element_size()
        raw = torch.from_numpy(_rng.integers(0, 256, n * itemsize, dtype=np.uint8))
        t = raw.view(dtype).reshape(shape) if n else torch.empty(shape, dtype=dtype)
    assert_same(record_roundtrip(t), t)


@pytest.mark.parametrize("make", [
    lambda t: t.T,
    lambda t: t[:, ::2],
    lambda t: t[1:],
    lambda t: t.expand(4, 3, 6)[1],
    lambda t: t.reshape(1, 3, 3, 2).contiguous(memory_format=torch.channels_last),
    lambda t: t.clone().requires_grad_(True),
    lambda t: (t * 2).requires_grad_(True) * 1.0,  # non-leaf with a graph
    lambda t: torch.nn.Parameter(t.clone()),
], ids=["transposed", "step", "offset", "expanded", "channels-last", "requires-grad",
        "non-leaf", "parameter"])
def test_torch_views_and_autograd_tensors_roundtrip_values(make):
    t = make(torch.arange(18, dtype=torch.float32).reshape(3, 6))
    got = record_roundtrip(t)
    assert isinstance(got, torch.Tensor)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t.detach())
    assert got.grad_fn is None, "a cached sample must not drag an autograd graph along"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.complex64])
@pytest.mark.parametrize("make", [
    lambda t: t[::2][:1],                       # size 1, stride 2: contiguous() keeps the stride
    lambda t: t.reshape(2, 4)[:1, ::2][:, :1],  # size-1 dims with odd strides
    lambda t: t[:1].expand(5),                  # stride 0
    lambda t: t[:1].reshape(1, 1).expand(1, 3)[:, :1],
    lambda t: t[::2][:0],                       # zero-size with a stride
    lambda t: t.reshape(2, 4)[:, ::3][:1],
    lambda t: t.reshape(8, 1)[::4],             # trailing size-1 dim
], ids=["size1-step", "size1-dims", "expanded", "expanded-size1", "zero-size", "2d-step", "trailing-1"])
def test_tensors_with_odd_strides_and_size_one_dims_roundtrip(make, dtype):
    t = make(torch.arange(8).to(dtype))
    got = record_roundtrip(t)
    assert got.dtype == t.dtype and got.shape == t.shape
    assert torch.equal(got, t)


def test_torch_conjugate_view_roundtrips():
    """``x.conj()`` is a lazy view (conj bit); the codec must store the conjugated values."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    got = record_roundtrip(x.conj())
    assert torch.equal(got, torch.tensor([1 - 2j, 3 + 4j], dtype=torch.complex64))


def test_torch_negative_view_roundtrips():
    """``x.conj().imag`` is a lazy negative view (neg bit); the codec must store the negated values."""
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    neg = x.conj().imag
    assert neg.is_neg()
    got = record_roundtrip(neg)
    assert torch.equal(got, torch.tensor([-2.0, 4.0]))


@pytest.mark.filterwarnings("ignore:Sparse invariant checks")  # torch's own, on unpickling
def test_torch_sparse_tensor_roundtrips_through_pickle():
    t = torch.sparse_coo_tensor([[0, 2], [1, 0]], [3.0, 4.0], (3, 3))
    got = record_roundtrip(t)
    assert got.is_sparse and torch.equal(got.to_dense(), t.to_dense())


PY_VALUES = {
    "ints": [0, 1, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 10**100, -(10**100)],
    "floats": [0.0, -0.0, 1.5, math.inf, -math.inf, math.nan, -math.nan, 5e-324, sys.float_info.max],
    "bools": [True, False],
    "none": None,
    "strs": ["", "héllo", "日本語", "🎉 emoji", "\ud800 lone surrogate \udfff", "nul\x00inside",
             "x" * 100000],
    "bytes": [b"", b"\x00\xff" * 1000, bytes(range(256))],
}


@pytest.mark.parametrize("name", list(PY_VALUES))
def test_python_scalars_roundtrip(name):
    value = PY_VALUES[name]
    assert_same(record_roundtrip(value), value)


def test_float_nan_payload_bits_survive():
    weird = struct_unpack_d(b"\x01\x00\x00\x00\x00\x00\xf8\x7f")  # a quiet NaN with a payload
    assert_same(record_roundtrip(weird), weird)


def struct_unpack_d(raw: bytes) -> float:
    import struct

    return struct.unpack("<d", raw)[0]


def test_numpy_scalars_keep_their_type():
    """``dataset[i]`` returning ``np.int64(3)`` must not come back from the cache as a Python int
    (``label.item()``, ``label.dtype`` would break between the first and the second epoch)."""
    for value in (np.int64(3), np.float64(0.25), np.bool_(True), np.float32(1.5), np.int32(-4),
                  np.uint8(200)):
        got = record_roundtrip(value)
        assert type(got) is type(value), f"{type(value).__name__} came back as {type(got).__name__}"
        assert got == value


def test_nested_containers_roundtrip():
    value = {
        "image": np.arange(12, dtype=np.uint8).reshape(3, 4),
        "meta": {"id": 7, "name": "sample-7", 3: [1.5, None, True], "empty": {}},
        "pair": (torch.ones(2, dtype=torch.bfloat16), [b"raw", ("deep", ((),))]),
        "list": [[], (), [np.float64, 1]],  # a type object goes through pickle
        "two": [1, 2],
        "one": (np.zeros(0, np.int16),),
    }
    assert_same(record_roundtrip(value), value)


def test_deep_nesting_roundtrips():
    value: object = 0
    for i in range(200):
        value = [value, i] if i % 2 else (value,)
    assert_same(record_roundtrip(value), value)


def _nested(levels: int, leaf: object = 7) -> list:
    value: object = leaf
    for _ in range(levels):
        value = [value]
    return value


def _with_frames_left(frames: int, fn):
    """``fn()`` called where only about ``frames`` more Python frames fit under the recursion limit."""
    depth = 0
    f = sys._getframe()
    while f is not None:
        depth, f = depth + 1, f.f_back

    def down(n: int):
        return fn() if n <= 0 else down(n - 1)

    return down(sys.getrecursionlimit() - depth - frames)


def test_nesting_past_max_nesting_is_pickled_whole_and_decodes_from_any_stack():
    """A layout's decoder recurses a level at a time: past MAX_NESTING containers the value is
    pickled whole (the unpickler keeps its own stack), whatever room the encoder's stack had - a
    nesting stored natively because the writer's stack could walk it failed to decode from a
    deeper one (a DataLoader under a training framework), read as damage."""
    native, past, far = _nested(codec.MAX_NESTING), _nested(codec.MAX_NESTING + 1), _nested(300)
    assert not codec.encode(native).pickled
    assert codec.encode(past).pickled == (f"list nested deeper than {codec.MAX_NESTING} containers",)
    assert codec.encode(far).pickled
    for value in (native, past, far):  # each read back with ~200 frames left: 2 a level would not fit 300
        enc = codec.encode(value)
        buf = bytearray(enc.record_len(0, True))
        enc.write(memoryview(buf), codec.INLINE, b"")
        assert _with_frames_left(200, lambda b=buf, e=enc: codec.decode(b, e.layout)) == value


def test_dict_key_order_and_non_string_keys_roundtrip():
    value = {"b": 1, "a": 2, 10: 3, -1: 4}
    got = record_roundtrip(value)
    assert list(got.items()) == list(value.items())
    odd = {(1, 2): "tuple key", 1.5: "float key", True: "bool key"}  # pickled as a whole
    assert_same(record_roundtrip(odd), odd)


def test_a_namedtuple_is_a_container_not_a_pickle():
    value = Point(1, np.arange(3))  # issue 30: stored field by field, returned as Point
    assert codec.encode(value).pickled == ()
    got = record_roundtrip(value)
    assert type(got) is Point and got.x == 1 and np.array_equal(got.y, value.y)


@pytest.mark.parametrize("value", [
    OrderedDict(b=1, a=2), bytearray(b"abc"), frozenset({1, 2}),
    {1, 2, 3}, complex(1, -2), range(3, 9, 2), np.ma.masked_array([1, 2], mask=[0, 1]),
    np.array([(1, 2.0)], dtype=[("a", "<i4"), ("b", "<f8")]), np.array([1, "x", None], dtype=object),
], ids=["ordereddict", "bytearray", "frozenset", "set", "complex", "range",
        "masked", "structured", "object-array"])
def test_other_picklable_values_roundtrip_with_their_type(value):
    got = record_roundtrip(value)
    assert type(got) is type(value)
    if isinstance(value, np.ma.MaskedArray):  # its pickle is not byte-stable; compare the parts
        assert np.array_equal(got.data, value.data) and np.array_equal(got.mask, value.mask)
    else:
        assert pickle.dumps(got, protocol=5) == pickle.dumps(value, protocol=5)


# --- refused values ----------------------------------------------------------------------------


def test_unpicklable_value_raises_encode_error_naming_the_path():
    value = {"image": np.zeros(3), "hooks": [1, lambda: 0]}
    with pytest.raises(EncodeError) as info:
        codec.encode(value, "sample 12")
    msg = str(info.value)
    assert "sample 12['hooks'][1]" in msg and "function" in msg
    assert isinstance(info.value, TypeError)


def test_unpicklable_value_through_the_store_names_the_key(store):
    with pytest.raises(EncodeError, match=r"key 'k-9'.*\[0\]"):
        store.put("k-9", (memoryview(b"abc"), 1))
    with pytest.raises(EncodeError, match=r"key 41"):
        store.put(41, {"lock": __import__("threading").Lock()})
    assert store.lookup("k-9") is MISSING and store.lookup(41) is MISSING
    assert store.stats()["items_mem"] == 0


def test_encode_error_pickles():
    err = EncodeError("cannot store x")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is EncodeError and str(again) == "cannot store x"


# --- through the store: copy semantics ----------------------------------------------------------


STORE_VALUES = [
    np.arange(24, dtype=">f8").reshape(2, 3, 4),
    (np.arange(5, dtype=np.int16), 3, "label"),
    {"x": torch.arange(6, dtype=torch.bfloat16).reshape(2, 3), "y": torch.tensor(1 + 1j)},
    [None, True, 2**70, b"bytes", -0.0],
    "just a string",
    np.zeros((0, 4), np.float32),
    torch.zeros((), dtype=torch.int64),
]


@pytest.mark.parametrize("i", range(len(STORE_VALUES)))
def test_store_roundtrip_copy_and_view(store, i):
    value = STORE_VALUES[i]
    got_copy, got_view = store_roundtrip(store, value, key=i)
    assert_same(got_copy, value)
    assert_same(got_view, value)


def test_copy_true_returns_private_writable_arrays(store):
    value = (np.arange(100, dtype=np.int64), {"t": torch.arange(4, dtype=torch.float32)})
    store.put(1, value)
    arr, d = store.lookup(1, copy=True)
    assert arr.flags.writeable
    arr[:] = -1
    d["t"].fill_(99.0)
    again_arr, again_d = store.lookup(1, copy=True)
    assert np.array_equal(again_arr, np.arange(100))
    assert torch.equal(again_d["t"], torch.arange(4, dtype=torch.float32))
    other = CacheStore("codec", "values")  # and another mapping of the cache agrees
    try:
        assert np.array_equal(other.lookup(1)[0], np.arange(100))
    finally:
        other.close()


def test_copy_false_returns_read_only_numpy_views(store):
    store.put(2, {"a": np.arange(10, dtype=np.float32), "b": [np.ones((2, 2), np.uint8)]})
    got = store.lookup(2, copy=False)
    for arr in (got["a"], got["b"][0]):
        assert not arr.flags.writeable
        with pytest.raises(ValueError):
            arr[0] = 5
    assert np.array_equal(store.lookup(2)["a"], np.arange(10, dtype=np.float32))


_VIEW_SCRIPT = r"""
import sys
import numpy as np
from shmcache.cache.store import CacheStore

a = CacheStore("codec", "views", capacity_bytes=16 << 20)
want = np.arange(1000, dtype=np.int64)
a.put(5, want)
view = a.lookup(5, copy=False)
if sys.argv[1] == "clear":  # another store object clears; this one then maps the new generation
    b = CacheStore("codec", "views")
    b.clear()
    b.put(5, np.full(1000, -7, np.int64))
    assert (a.lookup(5) == -7).all()
    b.close()
else:
    a.close()
print("equal" if np.array_equal(view, want) else "changed", flush=True)
"""


@pytest.mark.parametrize("how", ["close", "clear"])
def test_zero_copy_views_outlive_clear_and_close(how):
    """A view handed out with copy=False stays readable, with the same bytes, after its store is
    closed, or after another store object clears the cache and this one moves to the new
    generation (store.py: "old mappings stay valid for readers"). Run in a child: a dangling view
    is a segfault."""
    proc = subprocess.run([sys.executable, "-c", _VIEW_SCRIPT, how], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, f"exit {proc.returncode} (-11 = SIGSEGV): {proc.stderr[-2000:]}"
    assert proc.stdout.strip() == "equal"


def test_many_layouts_and_huge_layouts_roundtrip(store):
    """More distinct layouts than the shared layout table holds, and layouts too large for a slot,
    are stored inline in the record: they still round-trip."""
    values = {}
    for i in range(200):
        values[i] = {f"field_{i}": np.full(i % 7, i, np.int32), "n": i}
    values[1000] = {f"a_rather_long_field_name_{j}": j for j in range(120)}  # layout >> 512 bytes
    for k, v in values.items():
        assert store.put(k, v)
    for k, v in values.items():
        assert_same(store.lookup(k), v, f"key {k}")
        assert_same(store.lookup(k, copy=False), v, f"key {k} (view)")


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_decoder_cache_stays_bounded_for_variable_length_str_fields_and_clear_frees_it(store):
    """Every distinct str length is another layout (and so another compiled decoder); past the
    shared layout table they are inline, and 100k samples once grew the per-process cache to
    ~38k decoders (+87 MiB per process)."""
    codec.clear_decoders()
    for i in range(100_000):
        value = {"path": "p" * (i % 317), "caption": "c" * (i % 331), "label": i}
        assert store.put(i, value)
        if i % 7 == 0:
            assert store.lookup(i) == value
    assert store.lookup(99_999) == {"path": "p" * (99_999 % 317), "caption": "c" * (99_999 % 331),
                                    "label": 99_999}
    assert codec.cached_decoders() <= codec.MAX_DECODERS
    store.clear()
    assert codec.cached_decoders() == 0


# --- PIL images (shmcache/data/images.py) ---------------------------------------------------------------

_PIL_MODES = sorted(__import__("shmcache.data.images", fromlist=["MODES"]).MODES)


def _random_image(mode, size=(7, 5)):
    from PIL import Image

    n = len(Image.new(mode, size).tobytes())
    return Image.frombytes(mode, size, _rng.integers(0, 256, n, dtype=np.uint8).tobytes())


def _same_image(got, want):
    from PIL import Image

    assert isinstance(got, Image.Image), type(got)
    assert (got.mode, got.size) == (want.mode, want.size)
    assert got.tobytes() == want.tobytes()  # pixel for pixel (bytes: NaN pixels of mode F too)


@pytest.mark.parametrize("mode", _PIL_MODES)
def test_pil_images_of_every_claimed_mode_are_stored_as_pixels_not_pickles(store, mode):
    img = _random_image(mode)
    enc = codec.encode(img)
    assert enc.pickled == () and not codec.pickled_offsets(enc.layout)
    _same_image(record_roundtrip(img), img)
    for got in store_roundtrip(store, {"img": img, "label": 3}):
        _same_image(got["img"], img)
        assert got["label"] == 3


def test_pil_images_opened_from_files_and_empty_ones_roundtrip(tmp_path, store):
    from PIL import Image

    _random_image("RGB", (16, 9)).save(tmp_path / "x.png")
    opened = Image.open(tmp_path / "x.png")  # a PngImageFile: a subclass of Image.Image
    assert type(opened) is not Image.Image
    assert codec.encode(opened).pickled == ()
    _same_image(record_roundtrip(opened), opened.convert("RGB"))
    _same_image(store_roundtrip(store, Image.new("L", (0, 0)))[0], Image.new("L", (0, 0)))


@pytest.mark.parametrize("mode", ["P", "PA"])
def test_palette_images_fall_back_to_pickle_and_keep_their_palette(mode):
    img = _random_image(mode)
    img.putpalette(list(range(256)) * 3)
    enc = codec.encode(img)
    assert any(name.endswith("Image") for name in enc.pickled), enc.pickled
    got = record_roundtrip(img)
    _same_image(got, img)
    assert got.getpalette() == img.getpalette()


def test_a_process_that_never_imported_pil_decodes_pil_records(tmp_path):
    """The handler registers lazily; a DataLoader worker that only reads must still find it."""
    code = (
        "import sys\n"
        "import shmcache.data.dataset\n"
        "from shmcache.cache import codec\n"
        "assert 'PIL' not in sys.modules, 'importing shmcache imported PIL'\n"
        "layout, record = open(sys.argv[1], 'rb').read(), open(sys.argv[2], 'rb').read()\n"
        "got = codec.decode(bytearray(record), layout)\n"
        "print(type(got).__name__, got.mode, got.size, got.tobytes().hex())\n"
    )
    img = _random_image("RGB")
    enc = codec.encode(img)
    buf = bytearray(enc.record_len(0, True))
    enc.write(memoryview(buf), codec.INLINE, b"")
    (tmp_path / "layout").write_bytes(enc.layout)
    (tmp_path / "record").write_bytes(bytes(buf))
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path / "layout"), str(tmp_path / "record")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["Image", "RGB", "(7,", "5)", img.tobytes().hex()]


# --- handlers load where a record needs them (issue 17) -------------------------------------------


def test_a_layout_whose_handler_is_not_registered_compiles_and_fails_only_when_decoded():
    """gc and export need a layout's structure, never its handler: the decoder of a layout that
    names an unknown extension is made, and only decoding it raises, naming what is missing."""
    class Point:
        pass

    codec.register_type(Point, "test-point", lambda p: ("p:1", (1,), np.zeros(1, np.uint8)),
                        lambda meta, shape, raw: Point())
    enc = codec.encode((Point(), 3))
    buf = bytearray(enc.record_len(0, False))
    enc.write(memoryview(buf), 0, b"")
    del codec._EXT_FROM["test-point"], codec._EXT_TO[Point]
    fn = codec.decoder_for(enc.layout)  # no handler: nothing raises yet
    assert codec.leaves(enc.layout)[1][0].ext == "test-point"
    with pytest.raises(EncodeError, match="'test-point'.*no handler"):
        fn(buf)
    codec.register_type(Point, "test-point", lambda p: None, lambda meta, shape, raw: "loaded")
    try:
        assert fn(buf) == ("loaded", 3)  # registered later: the same decoder now decodes
    finally:
        del codec._EXT_FROM["test-point"], codec._EXT_TO[Point]
        codec.clear_decoders()


def test_the_tensor_handler_loads_in_a_process_that_never_imported_torch():
    code = ("import sys\n"
            "from shmcache.cache import codec\n"
            "assert 'torch' not in sys.modules\n"
            "import numpy as np\n"
            "layout = __import__('marshal').dumps(('e', 'torch', 'float32:4', (2,), 64), 4)\n"
            "fn = codec.decoder_for(layout)\n"
            "assert 'torch' not in sys.modules, 'made a decoder: torch imported'\n"
            "buf = bytearray(72); buf[64:72] = np.array([1.5, 2.5], np.float32).tobytes()\n"
            "t = fn(buf)\n"
            "assert type(t).__module__ == 'torch' and t.tolist() == [1.5, 2.5], t\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_check_locates_a_tensor_leaf_without_loading_torch():
    """An import checks a snapshot's records by decoding them; a tensor leaf is only located
    within its record when torch is not loaded, and a record too short for it still fails."""
    code = ("import sys, marshal\n"
            "from shmcache.cache import codec\n"
            "layout = marshal.dumps(('T', (('e', 'torch', 'float32:4', (2,), 64), ('i', 16))), 4)\n"
            "codec.check(bytearray(72), layout)\n"
            "try:\n"
            "    codec.check(bytearray(70), layout)\n"
            "    print('short record passed')\n"
            "except ValueError:\n"
            "    pass\n"
            "assert 'torch' not in sys.modules, 'check() imported torch'\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-2000:]


# --- lists of numbers (issue 31) ---------------------------------------------------------------


def _kinds(x):
    return [_kinds(v) for v in x] if isinstance(x, list) else type(x)


@pytest.mark.parametrize("value", [
    list(range(20)), [-5] * 30, [300] * 20, [70_000] * 20, [-(2**63)] * 16, [2**63 - 1] + [0] * 15,
    [float(i) / 3 for i in range(20)], [-0.0, math.inf, -math.inf] * 6,
    [[i, i + 1, i + 2] for i in range(10)],
    [[[(i * j + k) % 256 for k in range(3)] for j in range(32)] for i in range(32)],
    # not compact, kept node by node: mixed kinds, bools, beyond 64 bits, ragged, empty, short
    [1, 2.0] * 10, [True] * 20, [2**70] * 20, [[1, 2], [3]] * 10, [[]] * 20, list(range(5)), [],
    [[1, 2], 5] * 10, [np.int64(1)] * 20,
], ids=lambda v: repr(v)[:30])
def test_lists_of_numbers_come_back_as_the_same_lists_of_the_same_python_numbers(value, store):
    for got in (record_roundtrip(value), *store_roundtrip(store, value)):
        assert got == value and _kinds(got) == _kinds(value)


def test_a_python_format_image_row_takes_its_numbers_own_size():
    """Issue 31: a Hugging Face row in the python format (a 32x32x3 image as nested lists of ints)
    took 71 KB for 3 KB of pixels; within 1.5x of the numbers' own bytes now (uint8 here)."""
    row = {"label": 3, "img": [[[(i * 7 + j * 3 + k) % 256 for k in range(3)] for j in range(32)] for i in range(32)],
           "text": "a cat"}
    enc = codec.encode(row)
    assert enc.record_len(0, False) <= 1.5 * 32 * 32 * 3
    assert record_roundtrip(row) == row
    emb = {"emb": [(-1) ** i * i / 7 for i in range(512)]}  # floats: float64, their own 8 bytes
    assert codec.encode(emb).record_len(0, False) <= 1.5 * 8 * 512


def test_a_list_of_numbers_node_from_outside_is_checked():
    """A layout naming a list of numbers of an object dtype, of no shape, or of more numbers than a
    decode may make Python objects of, is refused before decode."""
    import marshal

    for node in (("l", "|O", (4,), 64), ("l", "<U3", (4,), 64), ("l", "<i8", (), 64), ("l", "<i8", (2**40,), 64)):
        assert codec.check_layout(marshal.dumps(node, 4)).problem is not None, node
    ok = codec.check_layout(marshal.dumps(("l", "<i8", (4,), 64), 4))
    assert ok.problem is None and ok.needed == 64 + 32


def test_a_batch_of_samples_with_number_lists_is_collated_as_default_collate_does(store):
    """default_collate transposes lists: a list of numbers is never gathered as a column."""
    from torch.utils.data import default_collate

    from shmcache import ShmDatasetCache

    samples = [{"ids": [i, i + 1] * 10, "x": np.full(4, i, np.float32)} for i in range(8)]
    cache = ShmDatasetCache(session="codec", name="numbers", size=16)
    try:
        for i, s in enumerate(samples):
            cache.put(i, s)
        got = cache.get_batch(list(range(8)))
        want = default_collate(samples)
        assert len(got["ids"]) == len(want["ids"]) == 20
        assert all(torch.equal(a, b) for a, b in zip(got["ids"], want["ids"]))
        assert torch.equal(got["x"], want["x"])
    finally:
        cache.close()


# --- encode_many: a batch of one flat shape packed into the first value's layout


def _same_encoded(a: codec.Encoded, b: codec.Encoded) -> bool:
    def raw(piece):
        return bytes(memoryview(piece).cast("B"))

    return (a.layout == b.layout and a.body_len == b.body_len and bytes(a.scalars) == bytes(b.scalars)
            and [off for off, _ in a.pieces] == [off for off, _ in b.pieces]
            and [raw(p) for _, p in a.pieces] == [raw(p) for _, p in b.pieces] and a.pickled == b.pickled)


def test_encode_many_gives_what_encode_gives_for_every_value():
    import torch

    rows = [{"label": np.int64(i), "img": np.full((4, 4, 3), i, np.uint8), "text": np.str_(f"row {i}")}
            for i in range(30)]  # "row 9" and "row 10": two shapes in one batch
    rows += [{"label": torch.tensor(i), "img": torch.full((2, 3), float(i)), "name": f"r{i}"} for i in range(5)]
    rows += [np.arange(6) + i for i in range(4)] + [np.arange(6).reshape(2, 3)[:, ::2] + i for i in range(3)]
    rows += [{"a": 1, "b": 2.5, "c": True, "d": None, "e": b"xy", "f": np.float32(i)} for i in range(4)]
    rows += [{"a": 2**70}, {"a": 1}, {"a": "é"}, {"a": "e"}, {"a": True}, {"a": 1.0}, {"b": 1}, [1, 2]]
    rows += [{"a": [[1, 2], [3, 4]] * 10}, {"a": [[1, 2], [3, 4]] * 10}]  # deep: encoded each
    many = codec.encode_many(rows, [f"row {i}" for i in range(len(rows))])
    assert len(many) == len(rows)
    for value, enc in zip(rows, many):
        assert _same_encoded(enc, codec.encode(value)), value
        n = enc.record_len(0, True)
        buf = bytearray(n)
        enc.write(memoryview(buf), codec.INLINE, b"")
        assert_same(codec.decode(buf, enc.layout), value)


@pytest.mark.parametrize("native", [True, False])
def test_rows_of_a_memmap_are_packed_as_arrays_and_decode_as_ndarrays(tmp_path, monkeypatch, native):
    """np.load(path, mmap_mode="r")[i] is an np.memmap: packed with a batch's shape like an
    ndarray (it went to encode one value at a time, 10x the cost, or was pickled), the same bytes,
    read back as a plain ndarray of its values."""
    monkeypatch.setattr(codec, "PACK_NATIVE", native and codec.PACK_NATIVE)
    np.save(tmp_path / "a.npy", np.arange(8 * 2 * 3, dtype=np.int16).reshape(8, 2, 3))
    rows = np.load(tmp_path / "a.npy", mmap_mode="r")
    values = [{"x": rows[i], "i": i} for i in range(8)] + [rows[:, 1], rows[2:4]]
    assert all(type(v["x"]) is np.memmap for v in values[:8])
    calls = []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda *a, **k: calls.append(1) or real(*a, **k))
    many = codec.encode_many(values, [""] * len(values))
    assert len(calls) <= 3, "each memmap row was encoded on its own, not packed with the batch's shape"
    for value, enc in zip(values, many):
        assert _same_encoded(enc, real(value)) and not enc.pickled
        buf = bytearray(enc.record_len(0, True))
        enc.write(memoryview(buf), codec.INLINE, b"")
        got = codec.decode(buf, enc.layout)
        if isinstance(value, dict):
            assert type(got["x"]) is np.ndarray and np.array_equal(got["x"], value["x"]) and got["i"] == value["i"]
        else:
            assert type(got) is np.ndarray and got.dtype == value.dtype and np.array_equal(got, value)


def test_encode_many_gives_a_value_that_cannot_be_encoded_its_error_in_its_place():
    rows = [{"x": np.zeros(3)}, {"x": lambda: 0}, {"x": np.ones(3)}]
    many = codec.encode_many(rows, ["first", "second", "third"])
    assert isinstance(many[1], EncodeError) and "second" in str(many[1])
    assert _same_encoded(many[0], codec.encode(rows[0])) and _same_encoded(many[2], codec.encode(rows[2]))


class _Key(str):
    """A str subclass: equal to its str, but encode pickles a dict keyed by it."""


def test_encode_many_keeps_a_dict_keyed_by_equal_keys_of_another_type_as_encode_does():
    # 1.0, True and np.int64(1) equal the key 1, _Key("a") equals "a": a dict keyed by them must
    # not be packed into the layout of one keyed by 1 or "a" (read back, its keys would change)
    for first, other in (({1: np.arange(3)}, {1.0: np.arange(3)}), ({1: 2}, {True: 3}),
                         ({1: 2.5}, {np.int64(1): 3.5}), ({"a": 1}, {_Key("a"): 2})):
        many = codec.encode_many([first, other], ["first", "other"])
        assert _same_encoded(many[1], codec.encode(other)), other
        enc = many[1]
        buf = bytearray(enc.record_len(0, True))
        enc.write(memoryview(buf), codec.INLINE, b"")
        got = codec.decode(buf, enc.layout)
        assert [type(k) for k in got] == [type(k) for k in other]


def _leaf(r):
    import torch

    kind = r.randrange(9)
    if kind == 0:
        return r.choice([0, -1, 2**63 - 1, -2**63, 2**63, True, False, 1.5, -0.0, None])
    if kind == 1:
        return r.choice(["", "a", "ab", "é", "\udc80", b"", b"ab", _Key("a")])
    if kind == 2:
        arr = np.zeros(r.choice([(), (3,), (2, 3), (0,)]),
                       dtype=r.choice(["<i4", ">i4", "<f2", "?", "<U2", "S3", ">f8", "M8[s]", "V4"]))
        return arr[:, ::2] if arr.ndim == 2 and r.random() < 0.5 else arr
    if kind == 3:
        return r.choice([np.int64(3), np.int32(3), np.float32(1), np.bool_(True), np.str_("ab"),
                         np.float16(2), np.uint64(2**64 - 1)])
    if kind == 4:
        t = torch.zeros(r.choice([(), (3,), (2, 3)]),
                        dtype=r.choice([torch.float32, torch.bool, torch.float16, torch.bfloat16, torch.uint8]))
        if t.dtype.is_floating_point and r.random() < 0.5:
            t.requires_grad_(True)
        return t.t() if t.ndim == 2 and r.random() < 0.5 else t
    if kind == 5:
        return r.choice([(1, 2), [1, 2, 3, 4, 5, 6, 7, 8], torch.nn.Parameter(torch.zeros(2))])
    return r.choice([1, "a", np.int64(1), 2.0])


def _sample(r):
    if r.random() < 0.3:
        return _leaf(r)
    return {r.choice(["a", "b", 1, 2, 1.0, True, _Key("a"), np.int64(1)]): _leaf(r) for _ in range(r.randrange(1, 4))}


def test_encode_many_gives_encodes_bytes_for_generated_batches():
    # batches of samples drawn from two generators of one seed each: mostly one shape, with the
    # leaves and keys that differ from it in type, dtype, byte order, length or contiguity
    import random

    for seed in range(1500):
        r = random.Random(seed)
        batch = [_sample(random.Random(r.choice([2 * seed, 2 * seed + 1]))) if r.random() < 0.7 else _sample(r)
                 for _ in range(6)]
        many = codec.encode_many(batch, ["sample"] * len(batch))
        for value, enc in zip(batch, many):
            try:
                want = codec.encode(value, "sample")
            except EncodeError as exc:
                assert isinstance(enc, EncodeError), (seed, value, exc)
                continue
            assert _same_encoded(enc, want), (seed, value)


def test_encode_many_with_a_memo_gives_encodes_bytes_across_batches():
    # one memo through ten batches in a row: the shapes kept from earlier batches (leaves of
    # other types, dtypes, lengths) must pack a value only where encode gives the same bytes
    import random

    for seed in range(300):
        memo: list = []
        for b in range(10):
            r = random.Random(seed * 10 + b)
            batch = [_sample(random.Random(r.choice([seed, seed + 1]))) if r.random() < 0.7 else _sample(r)
                     for _ in range(4)]
            many = codec.encode_many(batch, ["sample"] * len(batch), memo)
            assert len(memo) <= codec._SHAPES
            for value, enc in zip(batch, many):
                try:
                    want = codec.encode(value, "sample")
                except EncodeError:
                    assert isinstance(enc, EncodeError), (seed, b, value)
                    continue
                assert _same_encoded(enc, want), (seed, b, value)


def test_a_records_buffers_are_the_bytes_write_puts_there():
    # Encoded.buffers feeds one pwritev (a record put on its own, 32 KiB and more): the same bytes
    # as write() into a chunk of zeros, for every kind of value, inline layout or not, any key
    import random

    for seed in range(400):
        value = _sample(random.Random(seed))
        try:
            enc = codec.encode(value, "sample")
        except EncodeError:
            continue
        for layout_id, key in ((7, b""), (codec.INLINE, b""), (7, b"\x02key"), (codec.INLINE, b"k" * 9)):
            n = enc.record_len(len(key), layout_id == codec.INLINE)
            want = bytearray(n + 64)
            assert enc.write(memoryview(want), layout_id, key) == n
            got = b"".join(bytes(memoryview(b).cast("B")) for b in enc.buffers(layout_id, key))
            assert got == bytes(want[:n]), (seed, value, layout_id)


class _OnlyOnFailure:
    """A batch's paths that may be read for the value at ``bad`` alone."""

    def __init__(self, n: int, bad: int):
        self.n, self.bad = n, bad

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> str:
        assert i == self.bad, f"the path of value {i} was read, which encoded fine"
        return f"value {i}"


def test_encode_many_walks_no_value_whose_shape_the_memo_holds_and_reads_a_path_only_for_an_error(monkeypatch):
    rows = [{"label": np.int64(i), "img": np.full((4, 4, 3), i, np.uint8), "text": np.str_(f"row {i}")}
            for i in range(8, 12)]  # "row 9" and "row 10": two shapes
    walked = []
    real = codec.encode
    monkeypatch.setattr(codec, "encode", lambda value, path="value": walked.append(path) or real(value, path))
    memo: list = []
    first = codec.encode_many(rows, [f"row {i}" for i in range(4)], memo)
    assert len(walked) == 2 and len(memo) == 2  # one walk per shape
    walked.clear()
    again = codec.encode_many(rows[::-1] + [{"x": lambda: 0}], _OnlyOnFailure(5, 4), memo)
    assert walked == ["value 4"]  # only the value no shape holds, which then fails with its path
    assert isinstance(again[4], EncodeError) and "value 4" in str(again[4])
    for a, b in zip(first, again[3::-1]):
        assert _same_encoded(a, b)
    assert memo[0].leaves[2] == (codec._NPSCALAR, (np.str_, np.dtype("<U5")))  # the latest match first


def test_encode_many_converts_no_tensor_of_a_value_that_fails_a_later_leaf(monkeypatch):
    """A value is checked leaf by leaf before any registered type (a tensor) is taken apart: a
    batch of str fields of several lengths tries a few shapes a value, and most tries fail."""
    rows = [{"t": torch.full((2,), float(i)), "s": "x" * (1 + i % 2)} for i in range(6)]
    tag, to_parts = codec._EXT_TO[torch.Tensor]
    calls = []
    monkeypatch.setitem(codec._EXT_TO, torch.Tensor, (tag, lambda t: calls.append(1) or to_parts(t)))
    memo: list = []
    codec.encode_many(rows[:2], ["r"] * 2, memo)  # two shapes: "x" and "xx"
    calls.clear()
    many = codec.encode_many(rows[2:], ["r"] * 4, memo)
    assert len(calls) == 4  # one per value: none for a shape whose str length differs
    for value, enc in zip(rows[2:], many):
        assert _same_encoded(enc, codec.encode(value))


def test_encode_many_compares_a_values_keys_with_a_kept_shapes_only_once_their_types_match():
    """A dict keyed by objects whose ``==`` does not give a bool (a tensor of two elements: its
    truth is ambiguous) is pickled by encode; a shape kept from an earlier batch of int keys must
    not compare those keys with its own first (the comparison raised)."""
    memo: list = []
    codec.encode_many([{0: 1}], ["first"], memo)
    value = {torch.tensor([0, 1]): 1}
    want = codec.encode(value, "next")
    enc, = codec.encode_many([value], ["next"], memo)
    assert _same_encoded(enc, want)


def test_encode_many_with_a_memo_follows_a_type_registered_again_between_batches():
    """register_type of a type already registered (another tag: a user's handler in place of the
    first) changes what encode writes; a shape kept from before must not pack a value into the
    old handler's layout."""
    class Blob:
        def __init__(self, raw: bytes):
            self.raw = raw

    def to_parts(b):
        return "u8:1", (len(b.raw),), np.frombuffer(b.raw, np.uint8)

    codec.register_type(Blob, "test-blob-1", to_parts, lambda meta, shape, raw: Blob(raw.tobytes()))
    try:
        memo: list = []
        codec.encode_many([Blob(b"ab")], ["first"], memo)
        codec.register_type(Blob, "test-blob-2", to_parts, lambda meta, shape, raw: Blob(raw.tobytes()))
        enc, = codec.encode_many([Blob(b"cd")], ["next"], memo)
        assert _same_encoded(enc, codec.encode(Blob(b"cd")))
    finally:
        for tag in ("test-blob-1", "test-blob-2"):
            codec._EXT_FROM.pop(tag, None)
        codec._EXT_TO.pop(Blob, None)


def test_a_cache_keeps_no_sample_for_encoding_and_pickles_none_of_its_shapes():
    import gc
    import weakref

    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="codec", name="memo", size=16)
    try:
        img = np.zeros((64, 64), np.uint8)
        gone = weakref.ref(img)
        items, _ = cache.encode_many([(0, {"img": img})])
        assert cache._shapes  # the shape kept for the next batch: not the sample (a video's GBs)
        del img, items
        gc.collect()
        assert gone() is None
        assert pickle.loads(pickle.dumps(cache))._shapes == []
    finally:
        cache.store.destroy()
        cache.close()


_SCALAR_KINDS = {  # numpy scalars of every kind, four of each (a batch after its first)
    "datetime64": [np.datetime64(i, "s") for i in range(3)] + [np.datetime64("NaT")],
    "timedelta64": [np.timedelta64(i, "ms") for i in range(4)],
    "complex": [np.complex128(i + 1j) for i in range(4)], "float16": [np.float16(i / 3) for i in range(4)],
    "bool_": [np.bool_(i % 2) for i in range(4)], "str_": [np.str_(f"ab{i}") for i in range(4)],
    "bytes_": [np.bytes_(b"ab%d" % i) for i in range(4)], "void": [np.void(b"\x01\x02" + bytes([i])) for i in range(4)],
    "longdouble": [np.longdouble(i) / 3 for i in range(4)],
    "big-endian": [np.array([i], ">i4")[0] for i in range(4)],
    "empty str_": [np.str_("") for _ in range(4)], "empty bytes_": [np.bytes_(b"") for _ in range(4)],
}


@pytest.mark.parametrize("kind", sorted(_SCALAR_KINDS))
def test_numpy_scalars_of_every_kind_come_back_from_a_batch_as_they_went_in(store, kind):
    # encode_many packs a numpy scalar leaf as its bytes; put_many then lookup gives the same
    # value of the same type and dtype (empty str_/bytes_ scalars: dtypes of no bytes included)
    rows = [{"x": v, "n": i} for i, v in enumerate(_SCALAR_KINDS[kind])] + list(_SCALAR_KINDS[kind])
    many = codec.encode_many(rows, [f"row {i}" for i in range(len(rows))])
    for value, enc in zip(rows, many):
        one = codec.encode(value)
        assert enc.layout == one.layout and enc.body_len == one.body_len, value
    assert store.put_many([(i, enc) for i, enc in enumerate(many)]) == [True] * len(rows)
    for i, value in enumerate(rows):
        got = store.lookup(i)
        want, have = (value["x"], got["x"]) if isinstance(value, dict) else (value, got)
        assert type(have) is type(want) and have.dtype == want.dtype, (value, got)
        assert have == want or (kind == "datetime64" and np.isnat(want) and np.isnat(have)), (value, got)
