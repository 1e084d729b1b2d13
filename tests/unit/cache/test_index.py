"""The shared index: which keys are the same key, which are not, growth of the table while other
store objects keep reading, the vectorised int lookup agreeing with the scalar one, and the entry's
bit layout (defined in index.py; every copy inlined on a hot path matches it).
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import re
import unicodedata
from pathlib import Path

import numpy as np
import pytest

import shmcache
import shmcache.cache.index as index_mod
from shmcache.cache import codec
from shmcache.cache.generation import RootLayout
from shmcache.cache.index import (
    FLAG_BITS,
    INLINE24,
    INT_KEY,
    LOCATION_MASK,
    MAX_RECORD,
    READY,
    SPILLED,
    TableView,
    entry_chunk,
    entry_class,
    entry_layout,
    entry_length,
    key_bytes,
    key_hash,
    location_word,
    state_word,
)
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import InvalidKey

INT_EDGES = [0, 1, -1, 2, 1023, 1024, 1025, 2**31, -(2**31), 2**32 + 5, 2**62, 2**63 - 1, -(2**63),
             -(2**63) + 1]


@pytest.fixture
def store():
    s = CacheStore("idx", "keys", capacity_bytes=32 << 20)
    yield s
    s.close()


# --- key identity -----------------------------------------------------------------------------


def test_int_keys_including_extremes_are_distinct_and_found(store):
    for k in INT_EDGES:
        assert store.put(k, ("int", k))
    for k in INT_EDGES:
        assert store.lookup(k) == ("int", k), k
    assert len(store) == len(INT_EDGES)
    assert store.lookup(3) is MISSING and store.lookup(-2) is MISSING


def test_numpy_integer_keys_are_the_same_key_as_python_ints(store):
    store.put(np.int64(-5), "a")
    store.put(7, "b")
    assert store.lookup(-5) == "a"
    assert store.lookup(np.uint16(7)) == "b" and store.lookup(np.int32(7)) == "b"
    assert len(store) == 2


def test_int_keys_beyond_64_bits_are_refused(store):
    for k in (2**63, -(2**63) - 1, 10**30):
        with pytest.raises(InvalidKey, match="64 bits"):
            store.put(k, 1)
        with pytest.raises(InvalidKey):
            store.lookup(k)
    assert len(store) == 0


@pytest.mark.parametrize("key", [1.0, True, False, None, (1, 2), [1], np.float32(1), np.bool_(True),
                                 bytearray(b"a"), 1j])
def test_keys_of_other_types_are_refused_naming_the_type(store, key):
    with pytest.raises(InvalidKey, match=type(key).__name__):  # also a TypeError, a ShmcacheError
        store.put(key, 1)
    with pytest.raises(TypeError, match=type(key).__name__):
        store.lookup(key)
    assert len(store) == 0


def test_str_and_bytes_of_the_same_text_are_different_keys(store):
    pairs = [("a", b"a"), ("", b""), ("héllo", "héllo".encode()), ("97", b"97")]
    for s, _ in pairs:
        store.put(s, ("str", s))
    for _, b in pairs:
        assert store.lookup(b) is MISSING, b
        store.put(b, ("bytes", b))
    for s, b in pairs:
        assert store.lookup(s) == ("str", s)
        assert store.lookup(b) == ("bytes", b)
    assert store.lookup(97) is MISSING  # and the int is a third key
    assert len(store) == 2 * len(pairs)


def test_unicode_normal_forms_and_surrogates_are_distinct_keys(store):
    nfc, nfd = unicodedata.normalize("NFC", "é"), unicodedata.normalize("NFD", "é")
    keys = [nfc, nfd, "\ud800", "\udc00", "\ud800\udc00", "𐀀", "a\x00", "a"]
    for i, k in enumerate(keys):
        store.put(k, i)
    assert [store.lookup(k) for k in keys] == list(range(len(keys)))


def test_int_key_equal_to_a_string_hash_is_another_key(store):
    """An int key stores itself in the word where str keys store their hash: the INT_KEY flag
    keeps them apart."""
    w1, _ = key_bytes("collide")
    as_int = w1 - (1 << 64) if w1 >= 1 << 63 else w1
    store.put("collide", "the string")
    assert store.lookup(as_int) is MISSING
    store.put(as_int, "the int")
    assert store.lookup("collide") == "the string"
    assert store.lookup(as_int) == "the int"


def test_hash_collisions_between_str_and_bytes_keys_are_resolved(store, monkeypatch):
    """Every str/bytes key hashing to the same word: the store must compare the whole key, not a
    suffix of the record (``"ab"`` and ``b"zsab"`` share their last key bytes)."""
    monkeypatch.setattr(index_mod, "key_hash", lambda kb: 12345)
    store.put(b"zsab", "bytes zsab")
    assert store.lookup("ab") is MISSING, "a different key with the same hash matched"
    store.put("ab", "str ab")
    store.put("b", "str b")
    store.put(b"ab", "bytes ab")
    assert store.lookup("ab") == "str ab"
    assert store.lookup("b") == "str b"
    assert store.lookup(b"ab") == "bytes ab"
    assert store.lookup(b"zsab") == "bytes zsab"
    assert len(store) == 4


def test_key_hash_is_stable():
    """Hashes live in shared memory across processes and runs: they must not depend on
    PYTHONHASHSEED (blake2b, not hash())."""
    assert key_hash(b"sabc") == int.from_bytes(
        __import__("hashlib").blake2b(b"sabc", digest_size=8).digest(), "little")
    assert key_bytes("abc") == (key_hash(b"sabc"), b"sabc")
    assert key_bytes(b"abc") == (key_hash(b"babc"), b"babc")
    assert key_bytes(-1) == ((1 << 64) - 1, b"")


# --- the table itself ---------------------------------------------------------------------------


def _table(capacity: int) -> TableView:
    buf = bytearray(TableView.bytes_for(capacity))
    TableView.init(buf, capacity)
    return TableView(buf)


def _insert(t: TableView, key: int) -> None:
    w1 = key & ((1 << 64) - 1)
    pos, w0, _ = t.find(w1, True)
    assert w0 == 0
    t.publish(pos, READY | INT_KEY | (64 << 32), w1, key * 3 & ((1 << 48) - 1))


def test_lookup_ints_agrees_with_find_including_collisions_and_wraparound():
    t = _table(256)
    rng = np.random.default_rng(3)
    keys = list(range(0, 100, 3)) + [255, 256, 257, -1, -256] + rng.integers(-2**62, 2**62, 60).tolist()
    for k in keys:
        _insert(t, k)
    probe = np.array(keys + [1, 4, 258, -2, 2**61 + 1], dtype=np.int64)
    w0, w2 = t.lookup_ints(probe)
    for k, a, b in zip(probe.tolist(), w0.tolist(), w2.tolist()):
        _, f0, f2 = t.find(k & ((1 << 64) - 1), True)
        assert (a, b) == (f0, f2), k
        assert (a != 0) == (k in keys), k
        if a:
            assert b == k * 3 & ((1 << 48) - 1)
    assert len(list(t.entries())) == len(keys)


def test_lookup_ints_on_dataset_indices_with_one_missing():
    t = _table(1024)
    for k in range(500):
        if k != 250:
            _insert(t, k)
    w0, _ = t.lookup_ints(np.arange(500, dtype=np.int64))
    assert (w0 != 0).sum() == 499 and w0[250] == 0


def test_entry_words_are_native_8_byte_aligned():
    t = _table(1024)
    assert t.words.ctypes.data % 8 == 0
    assert TableView.bytes_for(1024) == 128 + 1024 * 24


# --- growth ------------------------------------------------------------------------------------


def test_growth_keeps_every_key_and_readers_holding_old_store_objects_keep_reading(shm_namespace):
    writer = CacheStore("idx", "grow", capacity_bytes=64 << 20)
    reader = CacheStore("idx", "grow")  # opened before any growth: maps table version 1
    first = reader.view.refresh().index.capacity
    ints = list(range(-50, 2500)) + [2**63 - 1 - i for i in range(50)]
    strs = [f"key-{i}" for i in range(600)]
    for i, k in enumerate(ints):
        writer.put(k, k * 2)
        if i % 500 == 0:  # the reader keeps up while the table grows under it
            assert reader.lookup(k) == k * 2
            assert reader.lookup(ints[i // 2]) == ints[i // 2] * 2
    for k in strs:
        writer.put(k, k.upper())
    assert writer.view.refresh().index.capacity >= 4 * first, "the table never grew"
    for k in ints:
        assert reader.lookup(k) == k * 2, k
    for k in strs:
        assert reader.lookup(k) == k.upper(), k
    w0, _ = reader.view.refresh().index.lookup_ints(np.array(ints, dtype=np.int64))
    assert (w0 != 0).all()
    assert len(reader) == len(ints) + len(strs)
    late = CacheStore("idx", "grow")  # opened after growth
    assert late.lookup(2**63 - 1) == (2**63 - 1) * 2
    tables = [n for n in shm_namespace.owned_segments() if n.rsplit("+", 1)[1].startswith("t")]
    assert len(tables) == 1, f"old table versions left behind: {tables}"
    for s in (writer, reader, late):
        s.close()


def test_a_growth_places_every_entry_on_its_probe_path_with_no_empty_entry_before_it(shm_namespace):
    # str and bytes keys first (hashed homes, colliding and wrapping around the table's end), then
    # ints past the capacity and dataset indices: several growths, each rebuilding all at once
    s = CacheStore("idx", "rehash", capacity_bytes=64 << 20)
    first = s.view.refresh().index.capacity
    keys = [f"s{i}" for i in range(first // 2)] + [f"b{i}".encode() for i in range(first // 4)]
    keys += [2**40 + 7 * i for i in range(first)] + list(range(3 * first))
    for k in keys:
        s.put(k, repr(k))
    index = s.view.refresh().index
    assert index.capacity >= 4 * first, "the table never grew"
    words = index.words
    live = np.flatnonzero(words[:, 0] & np.uint64(READY))
    assert len(live) == len(keys)
    home = index.homes(words[live, 1]).astype(np.int64)
    for pos, h in zip(live.tolist(), home.tolist()):  # find stops at the first EMPTY entry on the path
        path = np.arange(h, h + ((pos - h) % index.capacity) + 1) % index.capacity
        assert (words[path, 0] != 0).all(), f"an EMPTY entry between home {h} and entry {pos}"
    for k in keys:
        assert s.lookup(k) == repr(k), k
    s.close()


_GROWTH_READER = r"""
import os, sys, time
from shmcache.cache.store import MISSING, CacheStore
stop, ready = sys.argv[1], sys.argv[2]
keys = [f"s{i}" for i in range(300)] + [b"b%d" % i for i in range(300)] + [2**40 + 7 * i for i in range(300)]
s = CacheStore("idx", "live", create=False)
passes = missed = wrong = 0
caps = set()
deadline = time.monotonic() + 120  # bounded: the writer stops it long before
open(ready, "w").close()
while time.monotonic() < deadline and not (os.path.exists(stop) and passes >= 2):
    caps.add(s.view.refresh().index.capacity)
    for k in keys:
        got = s.lookup(k)
        missed += got is MISSING
        wrong += got is not MISSING and got != repr(k)
    passes += 1
s.close()
print(passes, missed, wrong, len(caps))
"""


def test_a_reader_in_another_process_misses_no_key_while_the_table_grows(shm_namespace, tmp_path):
    # str, bytes and hashed int keys, then enough more keys for several growths (each placing all
    # entries at once): the reader, reading the first keys all along, never misses one nor reads a
    # wrong value, and sees the table at more than one size while it reads
    import subprocess
    import sys
    import time

    s = CacheStore("idx", "live", capacity_bytes=64 << 20)
    first = [f"s{i}" for i in range(300)] + [b"b%d" % i for i in range(300)] + [2**40 + 7 * i for i in range(300)]
    for k in first:
        s.put(k, repr(k))
    script, stop, ready = tmp_path / "reader.py", tmp_path / "stop", tmp_path / "ready"
    script.write_text(_GROWTH_READER)
    proc = subprocess.Popen([sys.executable, str(script), str(stop), str(ready)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 60
        while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        start = s.view.refresh().index.capacity
        for i in range(12000):
            s.put(f"more-{i}" if i % 2 else 2**41 + i, i)
        assert s.view.refresh().index.capacity >= 8 * start, "the table never grew"
        stop.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    passes, missed, wrong, sizes = map(int, out.split())
    assert (missed, wrong) == (0, 0), out
    assert sizes >= 2, f"the reader never read during a growth: {out}"
    for k in first:
        assert s.lookup(k) == repr(k), k
    s.close()


def test_a_growth_keeps_spilled_entries_where_find_reaches_them(tmp_path):
    # a 1 MiB cache that spills: most entries carry SPILLED when the table grows (three times)
    from shmcache import ShmDatasetCache

    (tmp_path / "spill").mkdir()
    c = ShmDatasetCache(session="grow-spilled", name="c", size=1, spilling=True, spill_dir=tmp_path / "spill")
    keys = [f"s{i}" for i in range(500)] + [b"b%d" % i for i in range(300)] + [2**40 + 7 * i for i in range(300)]
    keys += list(range(2000))
    first = c.store.view.refresh().index.capacity
    for i, k in enumerate(keys):
        c.put(k, np.full(3000, i % 251, np.uint8))
    index = c.store.view.refresh().index
    spilled = (index.words[:, 0] & np.uint64(SPILLED)) != 0
    assert index.capacity >= 8 * first and spilled.sum() > len(keys) // 2, (index.capacity, spilled.sum())
    for i, k in enumerate(keys):
        got = c.get(k, lambda k: None)
        assert got is not None and got.shape == (3000,) and (got == i % 251).all(), k
    c.close()


def test_table_hint_sizes_the_table_so_dataset_indices_never_grow_it():
    s = CacheStore("idx", "hinted", capacity_bytes=64 << 20, table_hint=5000)
    cap = s.view.refresh().index.capacity
    for k in range(5000):
        s.put(k, k)
    assert s.view.refresh().index.capacity == cap
    assert s.view.refresh().version == 1
    s.close()


def test_the_entry_accessors_read_what_the_store_wrote(store):
    """index.entry_* and codec.record_* name the bits the store writes (one definition each)."""
    from shmcache.cache import codec
    from shmcache.cache.index import (
        INLINE24,
        SPILLED,
        entry_chunk,
        entry_class,
        entry_layout,
        entry_length,
        location_word,
        state_word,
    )

    value = np.arange(100, dtype=np.int32)
    assert store.put("k", value) and store.put(7, value)
    g = store.view.refresh()
    found = store.view.find(g, "k")
    rec = store.view.record(g, found.w0, found.w2, found.w1, found.kb)
    assert entry_length(found.w0) == len(rec) and entry_layout(found.w0) not in (INLINE24,)
    assert entry_class(found.w2) in g.classes.used_classes()
    assert entry_chunk(found.w2) < g.classes.get(entry_class(found.w2))[1]  # handed out
    head = codec.record_header(rec)
    assert head.layout_id == entry_layout(found.w0) and head.key_len == len(found.kb) == 2
    assert bytes(codec.record_key(rec)) == found.kb == b"sk"
    other = store.view.find(g, 7)
    assert other.w0 == state_word(READY | INT_KEY, entry_layout(other.w0), entry_length(other.w0))
    assert other.w2 == location_word(entry_class(other.w2), entry_chunk(other.w2))
    assert not other.w0 & SPILLED and entry_length(state_word(SPILLED, INLINE24, (1 << 32) - 1)) == (1 << 32) - 1


# --- the entry's layout: index.py defines it; every copy inlined elsewhere must match ----------

# (module, function, expression as written there, what it must compute from the words w0 and w2).
# The hot paths inline index's accessors as literals (a call or a global less per item); a new
# inlined copy, or a change to one, must be listed here (test_no_other_inlined_copies).
INLINED = [
    ("shmcache.cache.view", "CacheView.lookup", "w0 & 7 == READY | INT_KEY",
     lambda w0, w2: w0 & (READY | INT_KEY | SPILLED) == READY | INT_KEY),
    ("shmcache.cache.view", "CacheView.lookup", "w2 >> 48", lambda w0, w2: entry_class(w2)),
    ("shmcache.cache.view", "CacheView.lookup", "(w0 >> 8) & INLINE24", lambda w0, w2: entry_layout(w0)),
    ("shmcache.cache.view", "CacheView.lookup", "w2 & LOCATION_MASK", lambda w0, w2: entry_chunk(w2)),
    ("shmcache.cache.view", "CacheView.lookup", "w0 >> 32", lambda w0, w2: entry_length(w0)),
    ("shmcache.cache.view", "CacheView.record", "w2 >> 48", lambda w0, w2: entry_class(w2)),
    ("shmcache.cache.view", "CacheView.record", "w2 & LOCATION_MASK", lambda w0, w2: entry_chunk(w2)),
    ("shmcache.cache.view", "CacheView.record", "w0 >> 32", lambda w0, w2: entry_length(w0)),
]
FLAGS = range(8)  # every combination of READY, INT_KEY, SPILLED
LAYOUT_EDGES = [0, 1, 127, INLINE24 - 1, INLINE24]
LENGTH_EDGES = [0, 16, 4096, MAX_RECORD - 1, MAX_RECORD]
CLASS_EDGES = [0, 1, 255, 0xFFFE, 0xFFFF]
CHUNK_EDGES = [0, 1, 1 << 32, LOCATION_MASK - 1, LOCATION_MASK]


def _source(module: str, qualname: str) -> str:
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return inspect.getsource(obj)


def _words():
    for flags, lid, n, cls, chunk in itertools.product(FLAGS, LAYOUT_EDGES, LENGTH_EDGES, CLASS_EDGES, CHUNK_EDGES):
        yield state_word(flags, lid, n), location_word(cls, chunk)


def test_the_accessors_take_back_what_the_packers_pack():
    for flags, lid, n, cls, chunk in itertools.product(FLAGS, LAYOUT_EDGES, LENGTH_EDGES, CLASS_EDGES, CHUNK_EDGES):
        w0, w2 = state_word(flags, lid, n), location_word(cls, chunk)
        assert w0 < 1 << 64 and w2 < 1 << 64
        assert (w0 & FLAG_BITS, entry_layout(w0), entry_length(w0)) == (flags, lid, n)
        assert (entry_class(w2), entry_chunk(w2)) == (cls, chunk)


@pytest.mark.parametrize("module, function, expr, means", INLINED, ids=lambda v: v if isinstance(v, str) else "")
def test_every_inlined_copy_of_the_entry_layout_matches_index(module, function, expr, means):
    assert expr in _source(module, function), f"{module}.{function} no longer has {expr!r}: update INLINED"
    names = {"READY": READY, "INT_KEY": INT_KEY, "SPILLED": SPILLED, "INLINE24": INLINE24,
             "LOCATION_MASK": LOCATION_MASK}
    for w0, w2 in _words():
        assert eval(expr, {**names, "w0": w0, "w2": w2}) == means(w0, w2), (expr, hex(w0), hex(w2))


def test_the_vectorised_accessors_match_the_scalar_ones():
    """gather and repair use index's accessors over arrays of words (uint64 in, uint64 out)."""
    words = list(_words())
    w0 = np.array([w for w, _ in words], np.uint64)
    w2 = np.array([w for _, w in words], np.uint64)
    for accessor, arr, col in ((entry_layout, w0, 0), (entry_length, w0, 0), (entry_class, w2, 1),
                               (entry_chunk, w2, 1)):
        got = accessor(arr)
        assert got.dtype == np.uint64
        assert got.tolist() == [accessor(w[col]) for w in words]


def test_the_inlined_constants_are_the_layouts():
    """The hot path's other literals: the root's epoch word at 64, a record header of 16 bytes."""
    assert RootLayout.EPOCH == 64 and "self.root.buf, 64)" in _source("shmcache.cache.view", "CacheView.lookup")
    assert codec.RECORD_HEADER.size == 16 and "16 <= n" in _source("shmcache.cache.view", "CacheView.record")


def test_no_other_inlined_copies():
    """Shifts and masks of the entry's words appear only in index.py and in the copies listed in
    INLINED (root.py's shifts are the epoch word's, which it defines; generation.py's the group
    intent's words)."""
    pattern = re.compile(r">>\s*(np\.uint64\()?(8|32|48)\b"  # the layout id, length, class
                         r"|&\s*(np\.uint64\()?(3|7|0x[fF]8)\b"  # the state bits
                         r"|&\s*(LOCATION_MASK|INLINE24)\b")  # the chunk, the layout id
    listed = {(module, expr) for module, _, expr, _ in INLINED}
    pkg = Path(shmcache.__file__).parent
    stray = []
    for path in sorted(pkg.rglob("*.py")):
        module = "shmcache." + ".".join(path.relative_to(pkg).with_suffix("").parts)
        if module in ("shmcache.cache.index", "shmcache.cache.generation", "shmcache.cache.root"):
            continue
        for i, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if pattern.search(code) and not any(m == module and expr in code for m, expr in listed):
                stray.append(f"{path.relative_to(pkg)}:{i}: {line.strip()}")
    assert not stray, "the entry's layout inlined outside index.py, not in INLINED: " + "; ".join(stray)
