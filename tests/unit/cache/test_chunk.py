"""A publish group of put_records (PublishGroup, NOTE [publish order] "A publish group"): keys twice
in one call and keys whose entries collide with the group's own, an exception in the middle of a
group, and the repair's checks - a group intent a writer can leave is undone or finished, an impossible one
is CorruptSegment that moves nothing, and gc drops the generation (the crash tests kill real
writers: tests/crash/test_crash_chunk.py)."""

from __future__ import annotations

import json
import sys
import tracemalloc

import numpy as np
import pytest

from shmcache.base.shm import Segment
from shmcache.cache import codec
from shmcache.cache.generation import GROUP_RECORDS, Intent, MetaLayout
from shmcache.cache.index import key_bytes
from shmcache.cache.publish_group import PublishGroup
from shmcache.cache.store import MISSING, CacheStore
from shmcache.cache.writer import encoded_from_portable
from shmcache.errors import CorruptSegment
from shmcache.tiers.tiered_store import portable_record


def _value(k):
    n = k if isinstance(k, int) else sum(k.encode())
    return np.full(50 + (n % 7) * 100, n, np.int64)


def _recs(keys):
    return [(k, portable_record(codec.encode(_value(k)), k)) for k in keys]


@pytest.fixture
def store():
    s = CacheStore("chunk", "c", capacity_bytes=32 << 20)
    yield s
    s.destroy()


def _bumps(g) -> dict:
    """Each size class's bump (classes made but never handed out: left out)."""
    return {c: g.classes.get(c)[1] for c in g.classes.used_classes() if g.classes.get(c)[1]}


def test_keys_twice_and_colliding_entries_are_stored_once(store):
    keys = [f"s{i}" for i in range(300)] + list(range(450))  # str keys hash onto int keys' homes
    keys += keys[::7]  # and some again, in the same call
    assert store.put_records(_recs(keys)) == [True] * len(keys)
    unique = list(dict.fromkeys(keys))
    assert len(store) == len(unique) == store.stats()["items_mem"]
    assert all(np.array_equal(store.lookup(k), _value(k)) for k in unique)
    g = store.view.refresh()
    assert g.group_phase() == 0 and g.index.capacity > 1024  # grown once, mid-call


def test_an_exception_in_the_middle_of_a_group_undoes_it(store, monkeypatch):
    store.put_records(_recs(range(5)))
    g = store.view.refresh()
    before = _bumps(g)
    real, calls = codec.Encoded.write, [0]

    def write(self, *a, **k):
        calls[0] += 1
        if calls[0] == 7:
            raise KeyboardInterrupt
        return real(self, *a, **k)

    monkeypatch.setattr(codec.Encoded, "write", write)
    with pytest.raises(KeyboardInterrupt):
        store.put_records(_recs(range(100, 120)))
    monkeypatch.undo()
    assert g.group_phase() == 0 and _bumps(g) == before  # six records copied, none kept
    assert all(store.lookup(k) is MISSING for k in range(100, 120)) and len(store) == 5
    assert store.put_records(_recs(range(100, 120))) == [True] * 20
    assert all(np.array_equal(store.lookup(k), _value(k)) for k in range(100, 120))


def _half_done(store, keys):
    """A group of ``keys`` allocated, copied and staged, not published: a writer killed before
    its first fence. Returns (generation, bumps before, the PublishGroup)."""
    g = store.view.refresh()
    before = _bumps(g)
    chunk = PublishGroup()
    with store.locked():
        for key, rec in _recs(keys):
            w1, kb = key_bytes(key)
            assert store.writer.put_locked(g, key, w1, kb, encoded_from_portable(rec, key, store.view), chunk)
    assert g.group_phase() == 1 and len(chunk) == len(keys) < GROUP_RECORDS
    return g, before, chunk


def _publishing(g, chunk) -> None:
    """... and killed after it (phase 2, nothing published yet)."""
    items, total, _ = g.mem_totals()
    g.group_publishing(items + len(chunk), total + chunk.bytes, g.table_items() + len(chunk))


def test_a_group_before_its_fence_is_undone_and_after_it_finished(store):
    store.put_records(_recs(range(5)))
    g, before, _ = _half_done(store, range(10, 14))
    assert all(store.lookup(k) is MISSING for k in range(10, 14))
    report = {}
    assert store.collect_garbage(report)[0] == 4 and "dropped" not in report  # 4 chunks given back
    assert g.group_phase() == 0 and _bumps(g) == before and len(store) == 5

    g, before, chunk = _half_done(store, range(10, 14))
    _publishing(g, chunk)
    assert store.put(99, _value(99))  # the next writer finishes it on its way in
    assert g.group_phase() == 0 and len(store) == 10
    assert all(np.array_equal(store.lookup(k), _value(k)) for k in [*range(10, 14), 99])


def _damage(g, chunk, which):
    pos = next(iter(chunk.positions))
    ci = g.group_intent()
    if which == "phase":
        g.meta.words[MetaLayout.GROUP >> 3] = 7
    elif which == "bump_moved_before_the_fence":
        cls = ci.classes[0][0]
        g.classes.set_bump(cls, g.classes.get(cls)[1] + 1)
    elif which == "entry_ready_before_the_fence":
        g.index.ready(pos, ci.records[0][2])
    elif which == "staged_outside_its_chunks":
        _publishing(g, chunk)
        cls, old = ci.classes[0]  # the first record's class
        g.index.stage(ci.records[0][0], 0, cls << 48 | (old + GROUP_RECORDS))
    elif which == "totals":
        _publishing(g, chunk)
        g.meta.words[(MetaLayout.GROUP >> 3) + 3] = 1 << 50
    elif which == "both_intents":
        g.begin(Intent(1, pos, ci.classes[0][0], 0, 0, 0, 0, 0))


@pytest.mark.parametrize("which", ["phase", "bump_moved_before_the_fence", "entry_ready_before_the_fence",
                                   "staged_outside_its_chunks", "totals", "both_intents"])
def test_an_impossible_group_intent_moves_nothing_and_gc_drops_the_cache(store, which):
    store.put_records(_recs(range(5)))
    g, _, chunk = _half_done(store, range(10, 14))
    _damage(g, chunk, which)
    bumps = _bumps(g)
    with pytest.raises(CorruptSegment, match="group intent record .* is impossible") as exc:
        store.put(99, _value(99))
    assert "shmcache gc" in str(exc.value)
    assert _bumps(g) == bumps  # nothing given back, nothing handed out
    assert all(np.array_equal(store.lookup(k), _value(k)) for k in range(5))
    report = {}
    store.collect_garbage(report)
    assert "impossible" in report["dropped"]
    assert len(store) == 0 and store.put(99, _value(99)) and np.array_equal(store.lookup(99), _value(99))


# --- runs: int keys of one size class, admitted with numpy over the run (CacheWriter.put_many)


def _row(k):
    """A dataset row: one layout and length for every k (a run)."""
    return {"img": np.full((16, 16, 3), k % 251, np.int64), "label": k, "name": f"r{k % 10}"}


def _sent_buffers(monkeypatch) -> list:
    """The buffers of each Segment.write_at call (a list per call): what the pwritev read from
    (a run, or a large record put on its own, took one)."""
    real, sent = Segment.write_at, []

    def write_at(self, offset, buffers):
        sent.append(list(buffers))
        return real(self, offset, sent[-1])

    monkeypatch.setattr(Segment, "write_at", write_at)
    return sent


def _nbytes(buffers: list) -> int:
    """The bytes one write_at call wrote."""
    return sum(memoryview(b).nbytes for b in buffers)


def test_a_run_of_one_layout_reads_back_right(store, monkeypatch):
    runs = _sent_buffers(monkeypatch)
    keys = list(range(200)) + [2**40 + k for k in range(20)] + [-5 - k for k in range(20)]  # hashed homes too
    items = [(k, codec.encode(_row(k))) for k in keys]
    assert store.put_many(items) == [True] * len(keys)
    assert len(store) == len(keys) == store.stats()["items_mem"]
    # runs (a hashed key whose home another key of the run takes goes one at a time)
    assert runs and sum(map(_nbytes, runs)) >= 200 * codec.encode(_row(0)).body_len
    for k in keys:
        got = store.lookup(k)
        assert np.array_equal(got["img"], _row(k)["img"]) and got["label"] == k and got["name"] == _row(k)["name"]
    g = store.view.refresh()
    assert g.group_phase() == 0 and g.intent().phase == 0
    # stored once: a second put of the same run finds every key present
    assert store.put_many(items) == [True] * len(keys) and len(store) == len(keys)


def test_a_batch_whose_str_field_varies_in_length_is_one_run(store, monkeypatch):
    # Hugging Face's rows: "row 9", "row 10", "row 100" - a layout each length, one size class:
    # one run, each record written from its own layout's offsets
    runs = _sent_buffers(monkeypatch)
    keys = [3, 9, 10, 42, 99, 100, 555, 999, 1000, 4321, 7, 64]
    rows = {k: {"label": k, "img": np.full((16, 16, 3), k % 251, np.int64), "text": f"row {k}"} for k in keys}
    items = [(k, codec.encode(rows[k])) for k in keys]
    assert len({enc.layout for _, enc in items}) == 4
    assert store.put_many(items) == [True] * len(keys)
    assert len(runs) == 1 and store.stats()["items_mem"] == len(keys)
    for k in keys:
        got = store.lookup(k)
        assert got["label"] == k and got["text"] == f"row {k}" and np.array_equal(got["img"], rows[k]["img"])
    assert store.put_many(items) == [True] * len(keys) and len(store) == len(keys)  # present: stored once


def test_a_group_mixing_layouts_keys_and_repeats_falls_back_one_at_a_time(store, monkeypatch):
    runs = _sent_buffers(monkeypatch)
    mixed = {k: (_row(k) if k % 3 else _value(k)) for k in range(120)}  # two layouts, one of them a run
    keys = list(mixed) + ["s1", b"b2", 7, 7, 12]  # str/bytes keys, repeats
    values = {**mixed, "s1": _row(1), b"b2": _row(2)}
    items = [(k, codec.encode(values[k])) for k in keys]
    store.put(30, _row(999))  # present already: the run leaves it as it is (stored once)
    out = store.put_many(items)
    assert out == [True] * len(items)
    assert len(store) == len(values) == store.stats()["items_mem"]
    for k, v in values.items():
        got = store.lookup(k)
        want = _row(999) if k == 30 else v
        if isinstance(want, dict):
            assert np.array_equal(got["img"], want["img"]) and got["label"] == want["label"], k
        else:
            assert np.array_equal(got, want), k
    assert store.view.refresh().group_phase() == 0
    assert len(runs) == 1  # the 80 rows: one run; the rest one at a time


def test_a_large_record_put_on_its_own_is_one_pwritev_and_reads_back(store, monkeypatch):
    from shmcache.cache.writer import PWRITE_MIN_BYTES

    writes = _sent_buffers(monkeypatch)
    big = {"img": np.arange(PWRITE_MIN_BYTES, dtype=np.uint8)[::-1].copy(), "name": "é" * 3, "n": 7}
    small = {"img": np.arange(PWRITE_MIN_BYTES // 4, dtype=np.uint8), "name": "a", "n": 8}
    for key, value in ((1, big), ("big", big), (b"\x00b", big), (2, small), ("small", small)):
        assert store.put(key, value)
    # the large records (an int key, a str and a bytes key after the body) with one pwritev each
    # (no page fault on each of their pages), the small ones through the mapping; all through
    # the mapping where /dev/shm has huge pages (tests/integration/test_memory_dir.py)
    base_pages = store.view.refresh().meta.base_pages
    assert len(writes) == (3 if base_pages else 0) and all(_nbytes(w) >= PWRITE_MIN_BYTES for w in writes)
    for key, value in ((1, big), ("big", big), (b"\x00b", big), (2, small), ("small", small)):
        got = store.lookup(key)
        assert np.array_equal(got["img"], value["img"]) and got["name"] == value["name"] and got["n"] == value["n"]


def test_a_large_portable_record_is_pwritten_from_its_own_bytes(store, monkeypatch):
    # put_records copies a portable record's bytes into shared memory once: the pwritev of a
    # large one (put on its own: a str key) reads its body where the caller holds it, no copy
    from shmcache.cache.writer import PWRITE_MIN_BYTES

    sent = _sent_buffers(monkeypatch)
    value = np.arange(PWRITE_MIN_BYTES, dtype=np.int32)
    record = portable_record(codec.encode(value), "big")
    assert store.put_records([("big", record)]) == [True]
    (bufs,) = sent
    mine = np.frombuffer(record, np.uint8)
    body = [b for b in bufs if np.shares_memory(np.frombuffer(b, np.uint8), mine)]
    assert sum(memoryview(b).nbytes for b in body) >= value.nbytes, [memoryview(b).nbytes for b in bufs]
    assert np.array_equal(store.lookup("big"), value)


def test_a_run_of_portable_records_is_pwritten_from_their_own_bytes(store, monkeypatch):
    # an import's or a tier's batch (int keys: a run): each record's body goes to the pwritev as
    # the caller holds it, not copied behind its header first
    sent = _sent_buffers(monkeypatch)
    values = {k: np.full(1000, k, np.int32) for k in range(12)}
    records = {k: portable_record(codec.encode(v), k) for k, v in values.items()}
    assert store.put_records(list(records.items())) == [True] * 12
    (bufs,) = sent
    for k, rec in records.items():
        mine = np.frombuffer(rec, np.uint8)
        assert any(memoryview(b).nbytes >= 4000 and np.shares_memory(np.frombuffer(b, np.uint8), mine)
                   for b in bufs), k
        assert np.array_equal(store.lookup(k), values[k])


def test_a_run_that_outgrows_the_table_and_the_group_is_stored(store):
    keys = list(range(5000, 5000 + 3 * GROUP_RECORDS + 5))  # several groups, past the table's first size
    items = [(k, codec.encode(_row(k))) for k in keys]
    assert store.put_many(items) == [True] * len(keys)
    assert all(store.lookup(k)["label"] == k for k in keys)
    assert store.stats()["items_mem"] == len(keys)


def test_an_exception_in_the_middle_of_a_run_undoes_its_group(store, monkeypatch):
    store.put_many([(k, codec.encode(_row(k))) for k in range(20)])
    g = store.view.refresh()
    before = _bumps(g)
    real, calls = Segment.write_at, [0]

    def write_at(self, offset, buffers):
        calls[0] += 1
        if calls[0] == 1:  # the run's records half written
            real(self, offset, buffers[:len(buffers) // 2])
            raise KeyboardInterrupt
        return real(self, offset, buffers)

    monkeypatch.setattr(Segment, "write_at", write_at)
    keys = list(range(100, 160))  # one run, one group
    with pytest.raises(KeyboardInterrupt):
        store.put_many([(k, codec.encode(_row(k))) for k in keys])
    monkeypatch.undo()
    assert g.group_phase() == 0 and _bumps(g) == before
    assert all(store.lookup(k) is MISSING for k in keys) and len(store) == 20
    assert store.put_many([(k, codec.encode(_row(k))) for k in keys]) == [True] * len(keys)
    assert all(store.lookup(k)["label"] == k for k in keys)


def test_a_key_in_two_runs_of_one_call_is_stored_once(store):
    # key 9 in a run of each layout (the entry after its home is free): the first value stays,
    # as one at a time
    other = [9, *range(100, 108)]
    items = [(k, codec.encode(_row(k))) for k in range(10)]
    items += [(k, codec.encode(np.full(40, k, np.int64))) for k in other]
    assert store.put_many(items) == [True] * len(items)
    assert len(store) == 18 == store.stats()["items_mem"] == len(list(store.view.refresh().index.entries()))
    assert all(store.lookup(k)["label"] == k for k in range(10))
    assert all(np.array_equal(store.lookup(k), np.full(40, k, np.int64)) for k in other[1:])


def test_numpy_integer_keys_go_as_a_run_and_read_as_their_ints(store, monkeypatch):
    runs = _sent_buffers(monkeypatch)
    keys = np.arange(300, 340, dtype=np.int64)
    assert store.put_many([(k, codec.encode(_row(int(k)))) for k in keys]) == [True] * len(keys)
    assert len(runs) == 1 and all(store.lookup(int(k))["label"] == k for k in keys)
    assert store.put_many([(int(k), codec.encode(_row(0))) for k in keys]) == [True] * len(keys)  # present
    assert len(store) == len(keys)


def test_a_key_put_before_its_run_keeps_its_first_value(store):
    # runs go before the items left one at a time: a key's later copy in a run must not take the
    # place of its first value (a short group of another layout, or a run that comes later), as
    # one at a time
    first = np.full(41, -1, np.int64)  # a layout of its own: one at a time
    items = [(5, codec.encode(first)), (np.array(7), codec.encode(first))]  # a 0-d array: key 7
    items += [(k, codec.encode(_row(k))) for k in range(10)]
    # key 300 first in a run of the value layout (second), then in a run of rows (first)
    items += [(300, codec.encode(np.full(40, 300, np.int64)))]
    items += [(k, codec.encode(_row(k))) for k in (300, *range(301, 310))]
    items += [(k, codec.encode(np.full(40, k, np.int64))) for k in range(400, 410)]
    assert store.put_many(items) == [True] * len(items)
    assert np.array_equal(store.lookup(5), first) and np.array_equal(store.lookup(7), first)
    assert np.array_equal(store.lookup(300), np.full(40, 300, np.int64))
    assert all(store.lookup(k)["label"] == k for k in (0, 1, 2, 3, 4, 6, 8, 9, *range(301, 310)))
    assert len(store) == 10 + 10 + 10 == store.stats()["items_mem"]


def test_a_run_of_records_from_a_tier_and_from_the_codec_reads_back_right(store):
    # one layout and length, two forms (put_many takes both): a portable record's body is one
    # piece, a codec's value its pieces; a run writes each record from its own, never the other's
    items = [(k, encoded_from_portable(portable_record(codec.encode(_row(k)), k), k, store.view)) for k in range(8)]
    items += [(k, codec.encode(_row(k))) for k in range(8, 20)]
    items += [(k, encoded_from_portable(portable_record(codec.encode(_row(k)), k), k, store.view))
              for k in range(20, 30)]
    assert store.put_many(items) == [True] * len(items)
    for k in range(30):
        got = store.lookup(k)
        assert np.array_equal(got["img"], _row(k)["img"]) and got["label"] == k and got["name"] == _row(k)["name"], k


# A run whose size class has no segment yet, on a /dev/shm that is full: the class's segment
# cannot be made (NoRoom, internal) - the run's records go one at a time, as put_locked's do:
# rejected, or spilled when spilling is on; put_many never raises NoRoom to its caller.
_FULL_SHM_RUN = r"""
import json, os, sys
import numpy as np
from shmcache.cache import codec
from shmcache.cache.store import CacheStore
from shmcache.tiers.spill.tier import attach
out, spill = sys.argv[1], sys.argv[2]
store = CacheStore("chunkfull", "c", capacity_bytes=64 << 20)
if spill != "-":
    os.mkdir(spill)
try:
    if spill != "-":
        attach(store, spill)
    assert store.put(-1, np.zeros(4, np.int64))  # a small class made while there is room
    st = os.statvfs("/dev/shm")
    with open("/dev/shm/filler", "wb") as f:  # every page the private tmpfs has left
        os.posix_fallocate(f.fileno(), 0, st.f_bavail * st.f_frsize)
    # one size class, a layout each str length: one run, in a class not made yet
    rows = {k: {"img": np.full(400, k, np.int64), "text": "t" * (k % 5 + 1)} for k in range(16)}
    try:
        stored = store.put_many([(k, codec.encode(v)) for k, v in rows.items()])
    except BaseException as exc:
        stored = f"{type(exc).__name__}: {exc}"
    right = [k for k, v in rows.items() if (got := store.lookup(k, count=False)) is not None
             and isinstance(got, dict) and np.array_equal(got["img"], v["img"]) and got["text"] == v["text"]]
    st = store.stats()
    result = {"stored": stored, "right": right, "items_disk": st["items_disk"], "rejected": st["rejected"]}
finally:
    if os.path.exists("/dev/shm/filler"):
        os.unlink("/dev/shm/filler")
    store.destroy()
with open(out, "w") as f:
    json.dump(result, f)
"""


@pytest.mark.parametrize("spilling", [False, True], ids=["rejected", "spilled"])
def test_a_run_whose_class_segment_cannot_be_made_goes_one_at_a_time(tmp_path, spilling, private_mounts):
    script, out = tmp_path / "full_shm_run.py", tmp_path / "out.json"
    script.write_text(_FULL_SHM_RUN)
    spill = str(tmp_path / "spill") if spilling else "-"
    proc = private_mounts(f"mount -t tmpfs -o size=8m tmpfs /dev/shm || exit 99; "
                          f"exec {sys.executable} {script} {out} {spill}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    if spilling:
        assert res["stored"] == [True] * 16 and res["items_disk"] == 16 and res["right"] == list(range(16)), res
    else:
        assert res["stored"] == [False] * 16 and res["rejected"] == 16 and res["right"] == [], res


def test_a_large_run_probes_in_memory_linear_in_its_keys(store):
    # an import's put_records holds up to 64 MiB of records: 100,000s of small ones, one run. Its
    # probe compared each key still on its way with every entry taken so far (a keys x taken
    # table of bools: 5.9 GB for 200,000 records into a fresh cache); now sorted (np.isin)
    n = 60_000
    items = [(k, codec.encode(np.full(4, k, np.int64))) for k in range(n)]
    tracemalloc.start()
    try:
        assert store.put_many(items) == [True] * n
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 150 << 20, f"{peak / 2**20:.0f} MiB at the peak of a put_many of {n} small records"
    assert store.stats()["items_mem"] == n and all(store.lookup(k)[0] == k for k in range(0, n, 997))
