"""The compiled pack (cache._codec, issue 31): a cold batch's samples of a flat shape packed into its
layout in C, the same Encoded as ``codec.encode`` gives, byte for byte, for every kind of leaf;
what the C cannot view as bytes goes to Python; off with ``SHMCACHE_NATIVE=0``, and built wherever
CI can build it. (test_codec's encode_many tests run it too: 1,800 generated batches of hostile
leaves, compared with ``encode``.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from test_codec import _same_encoded as _same  # this folder's codec tests: the one comparison

from shmcache.cache import codec

native = pytest.mark.skipif(not codec.PACK_NATIVE, reason=f"the compiled pack: {codec.pack_unavailable_reason()}")




@pytest.fixture
def packed(monkeypatch):
    """The answers of each call of the compiled pack (Encoded, None or NotImplemented), in order."""
    from shmcache.cache import _codec

    real, answers = _codec.pack, []

    def spy(value, spec):
        answers.append(real(value, spec))
        return answers[-1]

    monkeypatch.setattr(_codec, "pack", spy)
    return answers


def _hf_rows(n: int, torch_rows: bool = False) -> list:
    """Rows as Hugging Face datasets' numpy format gives them (a numpy scalar label, an array, a
    numpy str), or its torch format (tensors and a str)."""
    if torch_rows:
        import torch

        return [{"label": torch.tensor(i), "img": torch.full((4, 4, 3), i), "text": f"row {i}"} for i in range(n)]
    return [{"label": np.int64(i), "img": np.full((4, 4, 3), i), "text": np.str_(f"row {i}")} for i in range(n)]


@native
@pytest.mark.parametrize("torch_rows", [False, True])
def test_a_batch_after_its_first_value_is_packed_in_c_as_encode_gives_it(packed, torch_rows):
    rows = _hf_rows(12, torch_rows)  # "row 10": a second shape, walked once
    many = codec.encode_many(rows, ["row"] * len(rows))
    assert all(_same(enc, codec.encode(value)) for value, enc in zip(rows, many))
    assert sum(isinstance(a, codec.Encoded) for a in packed) == 10  # the values after each shape's first


@native
def test_without_the_compiled_pack_the_same_batch_is_packed_in_python(packed, monkeypatch):
    monkeypatch.setattr(codec, "PACK_NATIVE", False)  # a shape made now carries no spec
    rows = _hf_rows(10)
    many = codec.encode_many(rows, ["row"] * len(rows))
    assert packed == [] and all(_same(enc, codec.encode(value)) for value, enc in zip(rows, many))


@native
@pytest.mark.parametrize("later", [
    lambda i: (np.arange(24.).reshape(4, 6) + i)[:, ::2],  # strided
    lambda i: np.asfortranarray(np.arange(12.).reshape(3, 4) + i),  # Fortran order
    lambda i: np.zeros((0, 3)),  # no bytes
    lambda i: np.arange(3).astype("M8[s]") + i,  # a dtype without a buffer
])
def test_an_array_the_c_cannot_view_as_bytes_is_converted_in_python(packed, later):
    first = np.ascontiguousarray(later(0))
    rows = [{"x": first, "n": 1}] + [{"x": later(i), "n": i} for i in range(1, 4)]
    many = codec.encode_many(rows, ["row"] * 4)
    assert all(_same(enc, codec.encode(value)) for value, enc in zip(rows, many))
    assert packed and all(a is NotImplemented for a in packed)


@native
@pytest.mark.parametrize("other", [
    {"x": np.zeros(3), "n": True},  # a bool where an int was
    {"x": np.zeros(3), "n": 2**63},  # past 64 bits
    {"x": np.zeros(3, np.float32), "n": 1},  # another dtype
    {"x": np.zeros(4), "n": 1},  # another shape
    {"x": np.zeros(3).view(np.ndarray), "n": 1.0},  # a float where an int was
    {"n": 1, "x": np.zeros(3)},  # the keys in another order
    {"x": np.zeros(3)},  # fewer keys
    {"x": np.zeros(3), "n": 1, "m": 2},  # more keys
])
def test_a_value_of_another_shape_is_not_packed_into_this_one(packed, other):
    first = {"x": np.ones(3), "n": 5}
    many = codec.encode_many([first, other], ["first", "other"])
    assert _same(many[1], codec.encode(other))
    assert packed[0] is None  # the C's answer: not this shape (encode walked it)


@native
def test_a_handler_that_raises_raises_out_of_the_batch_as_in_python(monkeypatch):
    class Blob:
        def __init__(self, raw: bytes, bad: bool = False):
            self.raw, self.bad = raw, bad

    def to_parts(b):
        if b.bad:
            raise RuntimeError("the handler failed")
        return "u8:1", (len(b.raw),), np.frombuffer(b.raw, np.uint8)

    codec.register_type(Blob, "test-pack-blob", to_parts, lambda meta, shape, raw: Blob(raw.tobytes()))
    try:
        for flag in (True, False):
            monkeypatch.setattr(codec, "PACK_NATIVE", flag)
            with pytest.raises(RuntimeError, match="the handler failed"):
                codec.encode_many([{"b": Blob(b"ab")}, {"b": Blob(b"cd", bad=True)}], ["r"] * 2)
    finally:
        codec._EXT_FROM.pop("test-pack-blob", None)
        codec._EXT_TO.pop(Blob, None)


@native
def test_a_handler_runs_once_a_value_when_an_array_beside_it_goes_to_python(packed):
    """A registered type's handler is user code, often costly (a tensor copied off its device) and
    not always pure: the C must not call it for a value whose later array it then hands to Python
    (NotImplemented), which converts every later leaf again and so calls the handler a second time."""
    calls = []

    class Blob:
        def __init__(self, raw: bytes):
            self.raw = raw

    def to_parts(b):
        calls.append(b.raw)
        return "u8:1", (len(b.raw),), np.frombuffer(b.raw, np.uint8)

    codec.register_type(Blob, "test-pack-once", to_parts, lambda meta, shape, raw: Blob(raw.tobytes()))
    try:
        rows = [{"b": Blob(b"ab"), "a": np.arange(4)}, {"b": Blob(b"cd"), "a": np.arange(8)[::2]}]  # strided
        many = codec.encode_many(rows, ["r"] * 2)
        assert calls.count(b"cd") == 1, calls  # as _encode_like alone calls it
        assert packed == [NotImplemented]  # the C could not view the strided array: Python packed it
        assert _same(many[1], codec.encode(rows[1]))
    finally:
        codec._EXT_FROM.pop("test-pack-once", None)
        codec._EXT_TO.pop(Blob, None)


@native
def test_a_handler_that_empties_the_sample_it_converts_leaves_the_pack_sound():
    """A registered type's handler is user code: one that clears the dict being packed (its leaves
    then have no other owner) must not leave the C reading freed leaves (ASan, below)."""
    done = subprocess.run([sys.executable, "-c", _EMPTIED, "compiled"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


# the sanitizer runs and the handler test: a ``_codec`` given as argv[1] (an ASan build), else ours
_SETUP = """
import importlib.util, sys
import numpy as np
from shmcache.cache import codec
if sys.argv[1] != "compiled":
    spec = importlib.util.spec_from_file_location("_codec", sys.argv[1])
    codec._codec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(codec._codec)
assert codec.PACK_NATIVE
def same(a, b):
    raw = lambda p: bytes(memoryview(p).cast("B"))
    return (a.layout, a.body_len, bytes(a.scalars), [(o, raw(p)) for o, p in a.pieces]) == \\
        (b.layout, b.body_len, bytes(b.scalars), [(o, raw(p)) for o, p in b.pieces])
"""

_EMPTIED = _SETUP + """
class Blob:
    def __init__(self, raw):
        self.raw = raw
holder = {}
def to_parts(b):
    d = holder.get("d")
    if d is not None:
        holder.clear()
        d.clear()  # the sample's leaves lose their only other owner
    return "u8:1", (len(b.raw),), np.frombuffer(b.raw, np.uint8)
codec.register_type(Blob, "test-pack-emptied", to_parts, lambda meta, shape, raw: Blob(raw.tobytes()))
memo = []
codec.encode_many([{"s": "x" * 50, "b": Blob(b"ab"), "a": np.ones(1000)}], ["r"], memo)
for i in range(200):
    d = {"s": "y" * 50, "b": Blob(bytes([i % 256, 1])), "a": np.full(1000, float(i))}
    want = codec.encode(dict(d))
    holder["d"] = d
    enc, = codec.encode_many([d], ["r"], memo)
    assert same(enc, want), i
print("clean")
"""

_SANITIZED = _SETUP + """
import random
class Key(str):
    pass
def leaf(r):
    k = r.randrange(6)
    if k == 0:
        return r.choice([0, -1, 2**63 - 1, -2**63, 2**63, True, False, 1.5, -0.0, None, float("nan")])
    if k == 1:
        return r.choice(["", "a", "ab", "\\u00e9", "\\udc80", b"", b"ab", Key("a")])
    if k == 2:
        arr = np.zeros(r.choice([(), (3,), (2, 3), (0,), (1, 1)]),
                       dtype=r.choice(["<i4", ">i4", "<f2", "?", "<U2", "S3", ">f8", "M8[s]", "V4", "c16"]))
        return arr[:, ::2] if arr.ndim == 2 and r.random() < 0.5 else arr
    if k == 3:
        return r.choice([np.int64(3), np.int32(3), np.float32(1), np.bool_(True), np.str_("ab"), np.str_("abc"),
                         np.bytes_(b"x"), np.datetime64(1, "s"), np.float16(2), np.uint64(2**64 - 1)])
    return r.choice([1, "a", np.int64(1), 2.0])
def sample(r):
    if r.random() < 0.3:
        return leaf(r)
    return {r.choice(["a", "b", 1, 2, True, Key("a"), np.int64(1)]): leaf(r) for _ in range(r.randrange(1, 4))}
packed = 0
for seed in range(600):
    r = random.Random(seed)
    memo = []
    for b in range(3):
        batch = [sample(random.Random(r.choice([seed, seed + 1]))) if r.random() < 0.8 else sample(r)
                 for _ in range(5)]
        for value, enc in zip(batch, codec.encode_many(batch, ["s"] * 5, memo)):
            try:
                want = codec.encode(value, "s")
            except Exception:
                assert isinstance(enc, Exception), (seed, value)
                continue
            assert same(enc, want), (seed, value)
            packed += 1
# malformed specs are refused by name, never read past
for bad in [(), (None,) * 11, (None, (), b"a", (None,), b"", 0, (), codec.Encoded, np.ndarray, {})]:
    try:
        codec._codec.pack(1, bad)
    except TypeError:
        pass
print("clean" if packed > 1000 else f"only {packed}")
"""


@native
def test_the_c_is_clean_under_address_and_undefined_behaviour_sanitizers(sanitized):
    done = sanitized(Path(codec.__file__).with_name("_codec.c"), _SANITIZED)
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


@native
def test_the_handler_that_empties_its_sample_is_clean_under_the_sanitizers(sanitized):
    done = sanitized(Path(codec.__file__).with_name("_codec.c"), _EMPTIED)
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


def test_shmcache_native_0_turns_it_off_and_says_how_to_turn_it_on(compiled_part):
    compiled_part.turned_off_by_env("from shmcache.cache import codec; print(codec.PACK_NATIVE); "
                                    "print(codec.pack_unavailable_reason())", '"batch_encode": "python: ')


def test_ci_builds_it_where_a_compiler_and_pythons_headers_are_present(compiled_part):
    """As the row copy (test_rowcopy, whose unbuilt-install tests run this file too): a failed
    build would quietly leave every cold batch's encode in Python."""
    compiled_part.built_where_it_can(codec.PACK_NATIVE, codec.pack_unavailable_reason(),
                                     "the compiled pack was not built", "the install packs in Python")
