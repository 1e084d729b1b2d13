"""Hostile or damaged segments (issue 8): damage written straight into a live cache's shared memory
must surface as CorruptSegment naming the damaged segment and a fix that works - never a wrong
value, a raw builtin exception or a hang - and ``shmcache gc`` (the real CLI) must then leave a
cache that stores and returns right values.

Each test damages the segments through the store's own mappings (the same bytes another process
maps from /dev/shm), reads through a second handle (as another process would), then runs
``python -m shmcache.cli.main gc`` in a child process.
"""

from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from shmcache import ShmDatasetCache
from shmcache.cache.generation import INTENT, MetaLayout
from shmcache.cache.index import INLINE24, INT_KEY, READY, key_bytes
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import CorruptSegment

S, C, N = "dmg", "c", 40
_Q = struct.Struct("Q")


def value(i: int):
    return (np.full((4, 8), i % 251, np.uint8), i)


def same(a, b) -> bool:
    return np.array_equal(a[0], b[0]) and a[1] == b[1]


@pytest.fixture
def writer():
    """A cache holding keys 0..N-1 and "s0".."s9" (its generation is what the tests damage)."""
    s = CacheStore(S, C, capacity_bytes=16 << 20)
    for i in range(N):
        assert s.put(i, value(i))
    for i in range(10):
        assert s.put(f"s{i}", value(i))
    yield s
    s.close()


def reader() -> CacheStore:
    return CacheStore(S, C, create=False)


def entry(g, pos: int) -> np.ndarray:
    return g.index.words[pos]  # a writable view of the shared entry (w0, w1, w2)


def pos_of(g, key) -> int:
    return reader().view.find(g, key).pos


def assert_corrupt(exc: pytest.ExceptionInfo, segment: str) -> None:
    msg = str(exc.value)
    assert segment in msg, msg
    assert "shmcache gc" in msg, msg


def gc(*extra: str) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "shmcache.cli", "gc", *extra], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def assert_works_after_gc(dropped: bool = True) -> None:
    proc = gc("--json")
    report = json.loads(proc.stdout)
    if dropped:
        assert [d["cache"] for d in report["dropped_caches"]] == [f"{S}/{C}"], report
        assert report["dropped_caches"][0]["reason"]
    s = CacheStore(S, C)
    try:
        for i in range(N):
            got = s.lookup(i)
            assert got is MISSING or same(got, value(i))
            assert s.put(i, value(i))
            assert same(s.lookup(i), value(i))
        for i in range(N, N + 200):  # new chunks of the damaged class: none overwrites a live one
            assert s.put(i, value(i))
        for i in range(N + 200):
            assert same(s.lookup(i), value(i))
        assert s.put("s1", value(1)) and same(s.lookup("s1"), value(1))
        assert len(s) == N + 200 + (1 if dropped else 10)
    finally:
        s.close()


# --- index entries that point where no record is ----------------------------------------------


def _past_committed(g, e):
    e[2] = (int(e[2]) >> 48 << 48) | (g.classes.get(int(e[2]) >> 48)[2] + 3)


def _committed_never_handed_out(g, e):
    # a chunk that is committed (fallocated) but above the class's bump: nothing was ever written
    # there, so it read as a record of zeros (was: a wrong value, since only `committed` was checked)
    cls = int(e[2]) >> 48
    _, bump, committed = g.classes.get(cls)
    assert bump + 3 < committed, "the test needs committed chunks above the bump"
    e[2] = (cls << 48) | (bump + 3)


def _far_chunk(g, e):
    e[2] = (int(e[2]) >> 48 << 48) | (1 << 40)


def _unknown_class(g, e):
    e[2] = (7 << 48) | (int(e[2]) & ((1 << 48) - 1))


def _class_beyond_table(g, e):
    e[2] = (5000 << 48) | (int(e[2]) & ((1 << 48) - 1))


def _huge_length(g, e):
    e[0] = (int(e[0]) & 0xFFFFFFFF) | (1 << 31 << 32)


def _layout_beyond_table(g, e):
    e[0] = (int(e[0]) & ~(INLINE24 << 8)) | (100 << 8)


DAMAGE = [_past_committed, _committed_never_handed_out, _far_chunk, _unknown_class, _class_beyond_table, _huge_length,
          _layout_beyond_table]


@pytest.mark.parametrize("key", [5, "s3"])
@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_is_corrupt_segment_then_gc_fixes_it(writer, key, damage):
    g = writer.view.refresh()
    damage(g, entry(g, pos_of(g, key)))
    r = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            r.lookup(key)
        assert_corrupt(exc, g.table.name)
        with pytest.raises(CorruptSegment) as exc:
            r.lookup_batch([key])
        assert_corrupt(exc, g.table.name)
        assert same(r.lookup(6), value(6))  # the other entries still read right
    finally:
        r.close()
    assert_works_after_gc()


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_warm_reader_meets_a_damaged_entry_with_corrupt_segment(writer, damage, hit_path):
    """The same damage under a reader that has read the key's class and layout already: its hot
    path (the compiled one, or Python's) is where the entry is followed, and it must go the long
    way, which names the damage."""
    r = reader()
    try:
        assert same(r.lookup(5), value(5)) and same(r.lookup(6), value(6))  # warm: mapped, plan-free
        g = writer.view.refresh()
        damage(g, entry(g, 5))
        with pytest.raises(CorruptSegment) as exc:
            r.lookup(5)
        assert_corrupt(exc, g.table.name)
        assert same(r.lookup(6), value(6))
    finally:
        r.close()


@pytest.mark.parametrize("damage", DAMAGE)
def test_a_damaged_entry_in_a_batch_is_corrupt_segment(writer, damage):
    g = writer.view.refresh()
    damage(g, entry(g, 5))
    cache = ShmDatasetCache(session=S, name=C)
    try:
        with pytest.raises(CorruptSegment) as exc:  # vectorised, or its per-item fallback
            cache.get_batch(list(range(N)))
        assert_corrupt(exc, g.table.name)
    finally:
        cache.close()
    assert_works_after_gc()


def test_a_damaged_first_entry_of_a_batch_is_corrupt_segment(writer):
    g = writer.view.refresh()
    _layout_beyond_table(g, entry(g, 0))
    r = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            r.batch_layout(np.arange(0, N, dtype=np.int64))
        assert_corrupt(exc, g.table.name)
    finally:
        r.close()


# --- layouts and records --------------------------------------------------------------------------


def test_a_garbage_layout_is_corrupt_segment(writer):
    g = writer.view.refresh()
    off = MetaLayout.LAYOUTS  # layout 0: the one every key of the writer shares
    g.meta.buf[off + 4:off + 40] = b"\xa7" * 36
    r = reader()
    try:
        for read in (lambda: r.lookup(5), lambda: r.gather_ints(np.arange(N, dtype=np.int64))):
            with pytest.raises(CorruptSegment) as exc:
                read()
            assert_corrupt(exc, g.meta.name)
    finally:
        r.close()
    assert_works_after_gc()


def test_a_layout_length_beyond_its_slot_is_corrupt_segment(writer):
    g = writer.view.refresh()
    struct.pack_into("I", g.meta.buf, MetaLayout.LAYOUTS, 1 << 30)
    r = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            r.lookup(5)
        assert_corrupt(exc, g.meta.name)
    finally:
        r.close()
    assert_works_after_gc()


def _record(g, store: CacheStore, key) -> memoryview:
    w0, w2, *_ = store.view.find(g, key)
    seg, _, chunk = store.view.class_data(g, w2 >> 48)[:3]
    start = 4096 + (w2 & ((1 << 48) - 1)) * chunk
    return memoryview(seg.buf)[start:start + (w0 >> 32)]


def test_damaged_record_bytes_are_corrupt_segment_naming_the_key(writer):
    inline = {f"field_{i:03d}": i for i in range(80)}  # a layout too long to share: stored inline
    assert writer.put("inline", inline)
    assert writer.put("pickled", {1, 2, 3})
    g = writer.view.refresh()
    rec = _record(g, writer, "inline")
    struct.pack_into("<I", rec, 8, 1 << 20)  # its inline layout length
    rec = _record(g, writer, "pickled")
    rec[16:rec.nbytes - 8] = b"\xff" * (rec.nbytes - 24)  # the pickle bytes
    r = reader()
    try:
        for key in ("inline", "pickled"):
            with pytest.raises(CorruptSegment) as exc:
                r.lookup(key)
            msg = str(exc.value)  # gc checks metadata, not every record's bytes: the fix is a clear
            assert repr(key) in msg and writer.view.segment_name(f"g{g.gen}", "c") in msg and "cache.clear()" in msg
        r.clear()
        assert r.put("inline", inline) and r.lookup("inline") == inline
        assert r.put("pickled", {1, 2, 3}) and r.lookup("pickled") == {1, 2, 3}
    finally:
        r.close()


# --- the intent record ------------------------------------------------------------------------------


def _intent(g, **change) -> None:
    fields = dict(zip(("phase", "pos", "cls", "old_bump", "items", "total", "raw", "table_items"),
                      INTENT.unpack_from(g.meta.buf, MetaLayout.INTENT)))
    fields.update(change)
    INTENT.pack_into(g.meta.buf, MetaLayout.INTENT, *fields.values())


def _bad_intents(g):
    cls = int(g.index.words[5, 2]) >> 48
    chunk, bump, _ = g.classes.get(cls)
    free = pos_of(g, 10_000)  # an EMPTY entry: what a writer that died before publishing leaves
    items = _Q.unpack_from(g.meta.buf, MetaLayout.ITEMS_MEM)[0] + 1
    total = _Q.unpack_from(g.meta.buf, MetaLayout.BYTES_MEM)[0] + 64
    table_items = _Q.unpack_from(g.meta.buf, MetaLayout.TABLE_ITEMS)[0] + 1
    ok = dict(phase=1, pos=free, cls=cls, old_bump=bump, items=items, total=total, raw=0,
              table_items=table_items)
    return {
        "bump_rewound": {**ok, "old_bump": 0},  # would hand out chunks 0.. again
        "bump_ahead": {**ok, "old_bump": bump + 50},
        "phase": {**ok, "phase": 7},
        "position": {**ok, "pos": 1 << 40},
        "class": {**ok, "cls": 900},
        "totals": {**ok, "items": 1 << 50},
        "published_phase_without_entry": {**ok, "phase": 2},
    }


@pytest.mark.parametrize("which", ["bump_rewound", "bump_ahead", "phase", "position", "class",
                                   "totals", "published_phase_without_entry"])
def test_an_impossible_intent_never_moves_the_bump_and_gc_drops_the_cache(writer, which):
    g = writer.view.refresh()
    cls = int(g.index.words[5, 2]) >> 48
    bump = g.classes.get(cls)[1]
    _intent(g, **_bad_intents(g)[which])
    w = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            w.put(N + 1, value(N + 1))
        assert_corrupt(exc, g.meta.name)
        assert "drop" in str(exc.value)
        assert g.classes.get(cls)[1] == bump  # nothing was allocated over live chunks
        for i in range(N):
            assert same(w.lookup(i), value(i))
    finally:
        w.close()
    assert_works_after_gc()


def test_a_possible_intent_is_still_repaired(writer):
    """The validation must not reject what a writer killed mid-way really leaves behind."""
    g = writer.view.refresh()
    cls = int(g.index.words[5, 2]) >> 48
    bump = g.classes.get(cls)[1]
    good = _bad_intents(g)["bump_rewound"]
    g.classes.set_bump(cls, bump + 1)  # killed after moving the bump, before publishing
    _intent(g, **{**good, "old_bump": bump})
    assert writer.put(N + 1, value(N + 1))
    assert g.classes.get(cls)[1] == bump + 1  # the dead writer's chunk went back, ours took it
    assert same(writer.lookup(N + 1), value(N + 1))
    assert_works_after_gc(dropped=False)


# --- a table with no EMPTY entry ------------------------------------------------------------------


def _fill_table(g) -> None:
    words = g.index.words
    free = words[:, 0] == 0
    words[free, 1] = np.uint64(1 << 62)  # a key nobody asks for
    words[free, 0] = np.uint64(READY | INT_KEY)


def test_a_table_with_no_empty_entry_is_corrupt_segment_not_a_hang():
    cache = ShmDatasetCache(session=S, name=C, size=16)
    try:
        for i in range(N):
            cache.put(i, value(i))
        g = cache.store.view.refresh()
        _fill_table(g)
        far = [1 << 40, 2 << 40, 3]  # beyond the capacity: hashed, probed
        with pytest.raises(CorruptSegment) as exc:
            cache.get_batch(far, fn=value)
        assert_corrupt(exc, g.table.name)
        with pytest.raises(CorruptSegment) as exc:
            cache.store.gather_ints(np.array(far, np.int64))
        assert_corrupt(exc, g.table.name)
        with pytest.raises(CorruptSegment) as exc:
            cache.get(1 << 40)
        assert_corrupt(exc, g.table.name)
    finally:
        cache.close()
    assert_works_after_gc()


def test_a_table_header_with_a_bad_capacity_is_corrupt_segment(writer):
    g = writer.view.refresh()
    _Q.pack_into(g.table.buf, 64, 3 << 40)  # no table of that many entries fits in the segment
    r = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            r.lookup(5)
        assert_corrupt(exc, g.table.name)
    finally:
        r.close()
    assert_works_after_gc()


# --- garbage in the meta counters -------------------------------------------------------------------


def test_garbage_layout_count_is_corrupt_segment_for_writers(writer):
    g = writer.view.refresh()
    _Q.pack_into(g.meta.buf, MetaLayout.N_LAYOUTS, 1 << 40)
    w = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            w.put("new-layout", {"a": 1.5, "b": "x"})
        assert_corrupt(exc, g.meta.name)
    finally:
        w.close()
    assert_works_after_gc()


def test_garbage_item_counters_are_recounted_by_gc(writer):
    g = writer.view.refresh()
    for off in (MetaLayout.ITEMS_MEM, MetaLayout.BYTES_MEM, MetaLayout.TABLE_ITEMS,
                MetaLayout.COMMITTED):
        _Q.pack_into(g.meta.buf, off, (1 << 63) + 12345)
    proc = gc()
    assert "recounted" in proc.stdout, proc.stdout
    r = reader()
    try:
        assert len(r) == N + 10
        st = r.stats()
        assert st["bytes_mem"] < 1 << 20 and st["items_mem"] == N + 10
    finally:
        r.close()
    assert_works_after_gc(dropped=False)


def test_counters_at_their_limit_are_corrupt_segment_for_writers_and_gc_recounts_them(writer):
    g = writer.view.refresh()
    for off in (MetaLayout.ITEMS_MEM, MetaLayout.BYTES_MEM):
        _Q.pack_into(g.meta.buf, off, (1 << 64) - 1)  # + 1 no longer fits a word
    w = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            w.put(N + 1, value(N + 1))
        assert_corrupt(exc, g.meta.name)
    finally:
        w.close()
    assert "recounted" in gc().stdout
    assert_works_after_gc(dropped=False)


def test_a_segment_header_that_does_not_open_is_dropped_by_gc(writer):
    g = writer.view.refresh()
    g.meta.buf[0:8] = b"garbage!"  # its magic word
    with pytest.raises(CorruptSegment) as exc:
        reader()
    assert g.meta.name in str(exc.value)
    assert_works_after_gc()


def test_a_table_full_of_one_str_key_hash_is_corrupt_segment_not_a_hang(writer):
    g = writer.view.refresh()
    w0, w2, *_ = writer.view.find(g, "s3")
    words = g.index.words
    free = words[:, 0] == 0
    words[free, 1] = np.uint64(key_bytes("absent")[0])  # every entry: the hash of "absent"...
    words[free, 2] = np.uint64(w2)  # ...pointing at the record of "s3" (its key bytes differ)
    words[free, 0] = np.uint64(w0)
    r = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            r.lookup("absent")
        assert_corrupt(exc, g.table.name)
    finally:
        r.close()
    assert_works_after_gc()


def test_hit_counters_of_garbage_do_not_break_reads(writer):
    g = writer.view.refresh()
    start, end = MetaLayout.COUNTERS, MetaLayout.CLASSES
    g.meta.buf[start:end] = b"\xff" * (end - start)  # every process slot's hits, misses...
    code = ("from shmcache.cache.store import CacheStore; s = CacheStore('dmg', 'c', create=False); "
            "v = s.lookup(5); assert v[1] == 5, v; s.lookup(10_000); s.close()")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr


def test_damaged_pickled_bytes_in_a_vectorised_batch_are_corrupt_segment():
    cache = ShmDatasetCache(session=S, name=C, size=16)
    try:
        with pytest.warns(UserWarning, match="stored with pickle"):
            for i in range(N):
                cache.put(i, (np.full(4, i, np.uint8), {i}))  # a set: a pickled leaf, decoded per item
        g = cache.store.view.refresh()
        rec = _record(g, cache.store, 7)
        rec[16:24] = b"\xff" * 8  # the start of its pickle
        with pytest.raises(CorruptSegment) as exc:
            cache.get_batch(list(range(N)))
        assert g.meta.name.rsplit("+", 1)[0] in str(exc.value) and "cache.clear()" in str(exc.value)
        cache.clear()
        cache.put(7, (np.full(4, 7, np.uint8), {7}))
        assert cache.get(7)[1] == {7}
    finally:
        cache.close()


@pytest.mark.parametrize("value_", ["x" * 40, b"y" * 40])
def test_a_length_cut_short_is_corrupt_segment_not_a_truncated_value(writer, value_):
    assert writer.put(200, value_)
    g = writer.view.refresh()
    e = entry(g, 200)
    e[0] = (int(e[0]) & 0xFFFFFFFF) | (20 << 32)  # 20 of its 56 bytes
    r = reader()
    try:
        with pytest.raises(CorruptSegment) as exc:
            r.lookup(200)
        assert "200" in str(exc.value)
    finally:
        r.close()


def test_garbage_item_counters_make_len_corrupt_segment_not_overflow_error(writer):
    """len() of a cache whose item counter is garbage raised a raw OverflowError (a length beyond
    sys.maxsize); it is damage that gc recounts."""
    g = writer.view.refresh()
    _Q.pack_into(g.meta.buf, MetaLayout.ITEMS_MEM, (1 << 63) + 12345)
    cache = ShmDatasetCache(session=S, name=C)
    try:
        with pytest.raises(CorruptSegment) as exc:
            len(cache)
        assert_corrupt(exc, g.meta.name)
    finally:
        cache.close()
    assert "recounted" in gc().stdout
    assert_works_after_gc(dropped=False)
