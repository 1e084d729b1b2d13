"""The encoder's two fast paths, attacked: a list of numbers stored as one array (``codec._numbers``,
NOTE [record format]) and a plain CPU tensor taken apart in one numpy() view
(``data.tensors._tensor_to_parts``). Whatever they take must come back exactly (the same Python
types, values, dtypes, shapes); whatever they refuse must fall back to the general way and still
round-trip - never an error, never a blow-up.
"""

from __future__ import annotations

import enum
import itertools
import math
import os
import struct
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch

import shmcache.data.dataset  # noqa: F401  (registers torch tensors with the codec)
from shmcache.cache import codec


def record_roundtrip(value):
    enc = codec.encode(value)
    n = enc.record_len(0, True)
    buf = bytearray(n)
    assert enc.write(memoryview(buf), codec.INLINE, b"") == n
    return codec.decode(buf, enc.layout)


def _exact(x):
    """``x`` as a comparable tree of (type, value): nan by its bits, -0.0 apart from 0.0."""
    if isinstance(x, (list, tuple)):
        return (type(x), [_exact(v) for v in x])
    if type(x) is float:
        return (float, struct.pack("<d", x))
    return (type(x), x)


def _nested(leaf, depth):
    value = leaf
    for _ in range(depth):
        value = [value, value]  # shared rows (as [[0] * 16] * 2 makes them): rectangular, no cycle
    return value


class Colour(enum.IntEnum):
    RED = 1


class MyFloat(float):
    pass


class MyList(list):
    pass


@pytest.mark.parametrize("value", [
    [True] + [1] * 19, [1] * 19 + [False], [Colour.RED] * 20, [1] * 19 + [Colour.RED],
    [1.0] * 19 + [MyFloat(2.5)], [2**63 - 1, -(2**63)] * 8, [2**63] + [0] * 15, [-(2**63) - 1] + [0] * 15,
    [2**64 - 1] * 16, [1] * 19 + [1.0], [math.nan, -0.0, math.inf, -math.inf, 5e-324] * 4,
    [[1] * 16, MyList([1] * 16)], [MyList([1] * 16), [1] * 16], MyList(range(20)), [[MyList([1] * 4)] * 4] * 2,
    [np.float64(1.0)] * 20, [1] * 19 + [np.int64(2)], [(1, 2)] * 20, [[1, 2]] * 8 + [(1, 2)],
    [[[1] * 4] * 4, [[1] * 4] * 3], [[[1] * 4, [1] * 3]] * 4, [[[]] * 3] * 4, [[1] * 16, 1], [1, [1] * 16],
    _nested([1] * 16, 6), _nested([0.5] * 16, 3),
], ids=lambda v: repr(v)[:40])
def test_a_list_of_numbers_comes_back_with_the_same_types_and_values(value):
    got = record_roundtrip(value)
    assert _exact(got) == _exact(value)


def test_a_list_nested_deeper_than_numpy_has_dimensions_round_trips():
    """A rectangular nesting of 70 levels (numpy arrays have at most 64 dimensions, 32 before numpy
    2): encode raised numpy's ValueError instead of keeping a node per item."""
    value = [1] * 16
    for _ in range(70):
        value = [value]
    value = [value, value]
    got = record_roundtrip(value)
    assert _exact(got) == _exact(value)


_CYCLE = r"""
import os, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from shmcache.cache import codec
x = []
x.append(x)
x.append(x)
a, b = [], []
a += [b, b]
b += [a, a]
for value in (x, a):
    enc = codec.encode(value)  # nothing but pickle stores a cycle (issue: RecursionError -> pickle)
    buf = bytearray(enc.record_len(0, True))
    enc.write(memoryview(buf), codec.INLINE, b"")
    got = codec.decode(buf, enc.layout)
    assert type(got) is list and len(got) == 2, got
print("ok")
"""


def test_a_list_that_holds_itself_is_pickled_not_flattened_forever():
    """``x = [x, x]``: each level of the flattening was twice the one before (2**27 items, then a
    MemoryError or the machine's memory) where the node-per-item walk meets a RecursionError and
    pickles it. Run in a child bounded in memory and time, so that a regression fails, not hangs."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _CYCLE], capture_output=True, text=True, timeout=60, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-2000:]


_SHARED = r"""
import pickle, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
from shmcache.cache import codec

def same(a, b, memo):
    # a == b of the same types, each pair of containers compared once (== walks a shared one per place)
    if type(a) is not type(b):
        return False
    if type(a) in (list, tuple, dict):
        if (id(a), id(b)) in memo:
            return True
        memo.add((id(a), id(b)))
        if type(a) is dict:
            return list(a) == list(b) and all(same(a[k], b[k], memo) for k in a)
        return len(a) == len(b) and all(same(x, y, memo) for x, y in zip(a, b))
    return a == b

def nest(leaf, depth, kinds):
    v = leaf
    for i in range(depth):
        kind = kinds[i % len(kinds)]
        v = [v, v] if kind == "list" else (v, v) if kind == "tuple" else {"a": v, 1: v}
    return v

row = [1, 2, 3]
cases = {
    "list": nest(row, 30, ["list"]),
    "list of 16 floats": nest([0.5] * 16, 30, ["list"]),
    "list of str": nest(["s"] * 16, 30, ["list"]),
    "tuple": nest(tuple(row), 30, ["tuple"]),
    "dict": nest(row, 30, ["dict"]),
    "mix": nest(row, 30, ["list", "dict", "tuple"]),
    "dict of lists": nest([1] * 16, 30, ["dict", "list"]),
    "wide": [[1.0] * 1000] * (1 << 20),
    "wide dict": dict.fromkeys(map(str, range(1 << 15)), [7] * 10000),
}
for name, value in cases.items():
    real = len(pickle.dumps(value, protocol=5)) + 4096  # the sharing kept, a record's header and layout
    enc = codec.encode(value)
    n = enc.record_len(0, True)
    assert n < real, (name, n, real)
    buf = bytearray(n)
    enc.write(memoryview(buf), codec.INLINE, b"")
    got = codec.decode(buf, enc.layout)
    assert same(got, value, set()), name
    many = codec.encode_many([value, value], [name, name])
    assert all(type(e) is codec.Encoded and e.record_len(0, True) < real for e in many), name
print("ok")
"""


def test_shared_rows_nested_deep_are_encoded_by_their_real_size():
    """``v = [v, v]`` thirty times over a row (the same list twice at each level: pickle stores it
    once) was flattened into 2**30 rows by the list-of-numbers path, and walked into 2**30 nodes
    by the general one (tuples, dicts, mixes): the process hung and took all memory. Such a value
    is pickled whole, as a list that holds itself is: its real size, the same values and types
    back. Run in a child bounded in memory and time, so that a regression fails, not hangs."""
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", _SHARED], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr[-2000:]


def test_one_row_in_a_million_places_is_found_shared_before_it_is_flattened(monkeypatch):
    """``v = [v, v]`` thirty levels over a row: its first path (v, v[0], ...) says it holds
    2**30 rows, so its levels are checked for a list met twice from the first one on. It was
    flattened level by level to 2**21 lists (0.7 s a value in C-level passes) first."""
    flattened = []

    class Chain:
        @staticmethod
        def from_iterable(level):
            flattened.append(len(level))
            return itertools.chain.from_iterable(level)

    monkeypatch.setattr(codec, "chain", Chain)
    value = [1, 2, 3]
    for _ in range(30):
        value = [value, value]
    assert codec.encode(value).pickled == ("list holding one container in many places",)
    assert sum(flattened) < 64, flattened[-3:]
    image = [[[k % 7] * 3 for k in range(32)] for _ in range(32)]  # rows of their own: one array
    assert codec.encode(image).pickled == () and 0 < sum(flattened) < 64 + 32 + 1024


def test_a_few_shared_rows_stay_on_the_fast_path():
    """``[[0] * 16] * 16`` (one row object, sixteen times) and a dict whose values are one list
    are small however shared: stored as before, one array per list of numbers, nothing pickled."""
    row = [1] * 16
    for value in ([row] * 16, _nested(row, 6), {"a": row, "b": row, "c": [row, row]}, [(), ()] * 8):
        enc = codec.encode(value)
        assert enc.pickled == (), value
        assert _exact(record_roundtrip(value)) == _exact(value) if type(value) is list else \
            record_roundtrip(value) == value


def test_lists_of_numbers_through_the_cache_a_wrapped_dataset_and_a_fresh_process():
    from shmcache import ShmDatasetCache

    samples = [
        {"ids": list(range(i, i + 20)), "emb": [(-1) ** k * k / 7 for k in range(16)] + [-0.0, math.nan],
         "flags": [True] * 20, "grid": [[k * i for k in range(4)] for _ in range(5)],
         "big": [2**63 - 1] * 16, "neg": [-(2**63)] * 16}
        for i in range(6)
    ]

    class Rows:
        def __len__(self):
            return len(samples)

        def __getitem__(self, i):
            return samples[i]

    cache = ShmDatasetCache(session="fastpaths", name="numbers", size=16)
    try:
        ds = cache.wrap(Rows(), fingerprint="rows-v1")
        for i, s in enumerate(samples):  # a miss (written), then a hit (read back)
            assert _exact(list(ds[i].items())) == _exact(list(s.items()))
            assert _exact(list(ds[i].items())) == _exact(list(s.items()))
        got = ds.__getitems__([5, 0, 3])
        assert [_exact(list(g.items())) for g in got] == [_exact(list(samples[i].items())) for i in (5, 0, 3)]
        cache.put("k", samples[2]["grid"])
        code = ("import math, struct, sys\n"
                "from shmcache import ShmDatasetCache\n"
                "c = ShmDatasetCache(session='fastpaths', name='numbers', size=16)\n"
                "g = c.get('k', lambda: sys.exit('a miss: the value written by the parent is gone'))\n"
                "print(repr(g), [type(v).__name__ for row in g for v in row] == ['int'] * 20)\n"
                "c.close()\n")
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert proc.stdout.strip() == f"{samples[2]['grid']!r} True"
    finally:
        cache.close()


# --- tensors -----------------------------------------------------------------------------------


def _bits(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format).copy_(t).reshape(-1).view(torch.uint8)


def _same_tensor(got, want):
    return (type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape
            and torch.equal(_bits(got), _bits(want.detach())))


class MyTensor(torch.Tensor):
    pass


def _read_only_numpy():
    a = np.arange(8, dtype=np.int16)
    a.flags.writeable = False
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the tensor is writable
        return torch.from_numpy(a)


def _inference(make):
    with torch.inference_mode():
        return make()


@pytest.mark.parametrize("make", [
    lambda: torch.arange(100, dtype=torch.float32)[3:19],  # a storage offset
    lambda: torch.arange(12.).as_strided((1, 12), (99, 1)),  # contiguous, with an odd size-1 stride
    lambda: torch.arange(12.).as_strided((12, 1), (1, 7)),
    lambda: torch.arange(12.).as_strided((1,), (5,), 3),  # one element, stride 5
    lambda: torch.arange(12.).as_strided((1, 1), (5, 9), 3),
    lambda: torch.tensor(3.5), lambda: torch.arange(5.)[2],  # 0-d, with and without an offset
    lambda: torch.tensor([True, False, True]), lambda: torch.tensor([1 + 2j, 3 - 4j]),
    lambda: torch.tensor([1.5, -0.0, math.nan], dtype=torch.float16),
    lambda: torch.arange(24.).reshape(1, 2, 3, 4).to(memory_format=torch.channels_last),
    lambda: torch.arange(12.).reshape(1, 1, 3, 4).to(memory_format=torch.channels_last),
    _read_only_numpy,
    lambda: torch.frombuffer(bytearray(13), dtype=torch.float32, offset=1, count=3),  # misaligned
    lambda: _inference(lambda: torch.arange(6.).reshape(2, 3)), lambda: _inference(lambda: torch.arange(6.)[1:]),
    lambda: torch.nn.Parameter(torch.ones(3), requires_grad=False),  # a parameter comes back a tensor
    lambda: torch.zeros([1] * 40 + [2]),
    lambda: torch.zeros([1] * 70 + [2]),  # more dimensions than numpy() takes: the general way
], ids=lambda f: "")
def test_a_cpu_tensor_comes_back_with_its_dtype_shape_and_values(make):
    t = make()
    assert _same_tensor(record_roundtrip(t), t)
    assert _same_tensor(record_roundtrip({"x": t})["x"], t)


def test_a_tensor_subclass_keeps_its_type():
    t = torch.arange(4.).as_subclass(MyTensor)
    got = record_roundtrip(t)
    assert type(got) is MyTensor and torch.equal(got.as_subclass(torch.Tensor), t.as_subclass(torch.Tensor))


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32, torch.float64, torch.complex64, torch.complex128,
                                   torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64])
def test_the_fast_way_writes_what_the_general_way_writes(dtype):
    """The same meta, shape and bytes (so the same layout: a batch of both kinds is gathered as one)
    for a contiguous tensor as for a strided view of the same values, which the general way takes."""
    from shmcache.data.tensors import _tensor_to_parts

    t = (torch.arange(24) % 7 - 3).to(dtype).reshape(2, 3, 4)
    strided = torch.stack([t, t], -1)[..., 0]
    assert t.is_contiguous() and not strided.is_contiguous()
    fast, general = _tensor_to_parts(t), _tensor_to_parts(strided)
    assert fast[:2] == general[:2] and bytes(fast[2]) == bytes(general[2])
    assert codec.encode({"x": t}).layout == codec.encode({"x": strided}).layout
