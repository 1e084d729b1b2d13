"""The compiled batch probe (cache._index, issue 31): ``TableView.lookup_ints`` in one pass gives what
numpy's probe gives, entry for entry, for keys at home, past it, wrapped round the table's end,
absent, hashed or negative, and the same error for a table with no EMPTY entry; off with
``SHMCACHE_NATIVE=0``, and built wherever CI can build it."""

from __future__ import annotations

import random
import struct
from pathlib import Path

import numpy as np
import pytest

from shmcache.cache import index
from shmcache.cache.index import ENTRY_BYTES, INT_KEY, READY, SPILLED, TABLE_OFF, TableView
from shmcache.errors import CorruptSegment

native = pytest.mark.skipif(not index.PROBE_NATIVE, reason=f"the compiled batch probe: "
                                                           f"{index.probe_unavailable_reason()}")


def _table(capacity: int, keys: list[int], r: random.Random) -> TableView:
    """A table of ``capacity`` entries holding ``keys`` as int keys (each at the first EMPTY entry
    from its home, as a writer places it), with other entries' words that must not match: a str
    key's entry whose key word equals an int key's, spilled ones."""
    buf = bytearray(TABLE_OFF + capacity * ENTRY_BYTES)
    TableView.init(buf, capacity)
    t = TableView(buf, "test table")
    for n, key in enumerate(keys):
        pos = t.home(key & (2**64 - 1))
        while t.words[pos, 0]:
            pos = (pos + 1) & t.mask
        kind = r.choice([READY | INT_KEY, READY | INT_KEY | SPILLED, READY, 0x5])  # READY alone: a str key's
        t.words[pos] = (kind | (n + 1) << 8, key & (2**64 - 1), r.getrandbits(64))
    return t


def _both(t: TableView, keys: np.ndarray, monkeypatch) -> tuple:
    got = t.lookup_ints(keys)
    with monkeypatch.context() as m:
        m.setattr(index, "PROBE_NATIVE", False)
        want = t.lookup_ints(keys)
    return got, want


@native
@pytest.mark.parametrize("seed", range(60))
def test_the_compiled_probe_finds_what_numpys_finds(seed, monkeypatch):
    r = random.Random(seed)
    capacity = 1 << r.randrange(0, 11)
    stored = r.sample(range(-50, 3 * capacity + 50), min(capacity - 1, r.randrange(0, capacity) + 1)) \
        if capacity > 1 else []
    stored += [r.getrandbits(63) for _ in range(min(3, capacity - 1 - len(stored)))]
    t = _table(capacity, stored, r)
    asked = [r.choice(stored) if stored and r.random() < 0.6 else r.randrange(-60, 4 * capacity + 60)
             for _ in range(r.randrange(0, 130))]
    keys = np.array(asked, np.int64)
    if len(keys) > 2 and r.random() < 0.3:
        keys = keys[::2]  # a strided view
    (g0, g2), (w0, w2) = _both(t, keys, monkeypatch)
    assert g0.dtype == w0.dtype == np.uint64
    assert g0.tolist() == w0.tolist() and g2.tolist() == w2.tolist()


@native
@pytest.mark.parametrize("dtype", [np.uint64, np.int64, ">u8"])
def test_keys_at_an_odd_address_are_probed_as_numpy_probes_them(dtype, monkeypatch):
    """uint64 keys are taken as they are (astype(copy=False), ascontiguousarray): a view at an odd
    address of a byte buffer stays at it, and the C, which loads 8-byte words, refused it
    (TypeError) where numpy's probe answers."""
    r = random.Random(7)
    t = _table(16, [3, 9, 2**40], r)
    raw = bytearray(8 * 4 + 1)
    keys = np.frombuffer(raw, dtype, offset=1, count=4)
    keys[:] = [3, 9, 2**40, 5]
    (g0, g2), (w0, w2) = _both(t, keys, monkeypatch)
    assert g0.tolist() == w0.tolist() and g2.tolist() == w2.tolist()


@native
@pytest.mark.parametrize("capacity", [0, 1, 8])
def test_a_table_with_no_empty_entry_is_damage_both_ways(capacity, monkeypatch):
    buf = bytearray(TABLE_OFF + max(capacity, 1) * ENTRY_BYTES)
    TableView.init(buf, capacity or 1)
    if not capacity:  # a damaged header: 3, no power of two (the view takes no entries)
        struct.pack_into("Q", buf, 64, 3)
    t = TableView(buf, "test table")
    t.words[:] = (READY, 2**40, 0)  # every entry taken by a str key
    for flag in (True, False):
        monkeypatch.setattr(index, "PROBE_NATIVE", flag)
        with pytest.raises(CorruptSegment, match="damaged"):
            t.lookup_ints(np.array([5, 2**62], np.int64))
        w0, w2 = t.lookup_ints(np.zeros(0, np.int64))  # no key: nothing to probe
        assert len(w0) == len(w2) == 0


_SANITIZED = """
import importlib.util, random, sys
import numpy as np
spec = importlib.util.spec_from_file_location("_index", sys.argv[1])
ix = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ix)
FIB = 0x9E3779B97F4A7C15
r = random.Random(0)
for capacity in (1, 2, 16, 1024):
    shift = 64 - (capacity.bit_length() - 1)
    words = np.zeros((capacity, 3), np.uint64)
    for _ in range(capacity - 1):  # all but one entry taken: the longest probes
        pos = r.randrange(capacity)
        while words[pos, 0]:
            pos = (pos + 1) % capacity
        words[pos] = (3, r.getrandbits(64), 7)
    keys = np.array([r.getrandbits(64) for _ in range(200)] + [0, capacity - 1, capacity, 2**64 - 1], np.uint64)
    w0, w2 = np.empty(len(keys), np.uint64), np.empty(len(keys), np.uint64)
    assert ix.lookup_ints(words, keys, FIB, shift, 3, w0, w2)
    words[:, 0] = 1  # no EMPTY entry: every probe goes all round, refused
    assert not ix.lookup_ints(words, keys[:3], FIB, shift, 3, w0, w2)
for bad in (lambda w, k, o: (w[:, :2], k, o), lambda w, k, o: (w, k, o[:1]), lambda w, k, o: (w, k.astype(np.int32), o),
            lambda w, k, o: (w, k, w[0])):
    words, keys, out = np.zeros((4, 3), np.uint64), np.arange(3, dtype=np.uint64), np.zeros(3, np.uint64)
    try:
        ix.lookup_ints(*bad(words, keys, out)[:2], FIB, 62, 3, bad(words, keys, out)[2], out)
    except (TypeError, ValueError):
        pass
print("clean")
"""


@native
def test_the_c_is_clean_under_address_and_undefined_behaviour_sanitizers(sanitized):
    done = sanitized(Path(index.__file__).with_name("_index.c"), _SANITIZED)
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


def test_shmcache_native_0_turns_it_off_and_says_how_to_turn_it_on(compiled_part):
    compiled_part.turned_off_by_env("from shmcache.cache import index; print(index.PROBE_NATIVE); "
                                    "print(index.probe_unavailable_reason())", '"batch_probe": "numpy: ')


def test_ci_builds_it_where_a_compiler_and_pythons_headers_are_present(compiled_part):
    """As the row copy (test_rowcopy, whose unbuilt-install tests run this file too): a failed
    build would quietly leave every batch's probe on numpy's passes."""
    compiled_part.built_where_it_can(index.PROBE_NATIVE, index.probe_unavailable_reason(),
                                     "the compiled batch probe was not built", "the install probes with numpy")
