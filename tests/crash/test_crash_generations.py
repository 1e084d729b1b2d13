"""Crashes while a cache replaces whole segments: table growth and clear() (new generations).

A writer SIGKILLed after building a bigger table but before publishing it, or after publishing a
new generation but before unlinking the old one, leaves orphaned segments: the cache must go on
working, and ``collect_garbage()`` / ``shmcache gc`` must remove exactly those orphans. Lock-free
readers racing with these replacements get a value or a clean miss, never an exception.
"""

from __future__ import annotations

import json

import pytest
from _procs_util import Zygote, status_of, wait_for
from _shmcheck import cache_segments, check_store, gc_json, same_value, value_for

from shmcache.cache.index import MAX_LOAD, MIN_TABLE
from shmcache.cache.store import MISSING, CacheStore

S, C = "gens", "c"
CAP = 64 << 20
BEFORE_GROWTH = int(MIN_TABLE * MAX_LOAD)  # items a first table holds; the next put grows it


def _fill_to_growth(store: CacheStore) -> list[int]:
    keys = list(range(BEFORE_GROWTH))
    for k in keys:
        assert store.put(k, value_for(k))
    assert store.view.refresh().version == 1
    return keys


def _die_at_table_built(tmp_path, key: int) -> None:
    with Zygote(tmp_path / "z", crash_at="table_built") as z:
        status, _ = z.run("put", S, C, [key], CAP)
    assert status == -9, f"the writer should die after building the new table: {status_of(status)}"


def test_table_built_kill_leaves_a_working_cache_and_gc_removes_the_orphan(tmp_path, capsys):
    store = CacheStore(S, C, capacity_bytes=CAP)
    keys = _fill_to_growth(store)
    segments = cache_segments(store)
    _die_at_table_built(tmp_path, BEFORE_GROWTH)

    orphans = cache_segments(store) - segments
    assert orphans == {store.view.segment_name("g1", "t2")}, "the unpublished table is the only debris"
    assert store.view.refresh().version == 1, "the root still names the old table"
    assert store.lookup(BEFORE_GROWTH, count=False) is MISSING
    assert all(same_value(store.lookup(k, count=False), value_for(k)) for k in keys)

    result = gc_json(capsys)
    assert sorted(result["removed_segments"]) == sorted(orphans)
    assert cache_segments(store) == segments

    more = list(range(BEFORE_GROWTH, BEFORE_GROWTH + 300))  # grows the table for real this time
    with Zygote(tmp_path / "clean") as z:
        assert z.run("put", S, C, more, CAP)[0] == 0
    g = store.view.refresh()
    assert g.version == 2
    for k in keys + more:
        assert same_value(store.lookup(k, count=False), value_for(k)), k
    assert store.stats()["items_mem"] == len(keys) + len(more)


def test_table_built_kill_without_gc_next_writer_grows_anyway(tmp_path):
    store = CacheStore(S, C, capacity_bytes=CAP)
    keys = _fill_to_growth(store)
    _die_at_table_built(tmp_path, BEFORE_GROWTH)
    assert store.put(BEFORE_GROWTH, value_for(BEFORE_GROWTH))  # replaces the debris, publishes t2
    g = store.view.refresh()
    assert g.version == 2
    assert store.view.segment_name("g1", "t1") not in cache_segments(store)
    for k in keys + [BEFORE_GROWTH]:
        assert same_value(store.lookup(k, count=False), value_for(k)), k


def test_table_built_kill_does_not_inflate_committed_bytes(tmp_path, capsys):
    """The accounting must survive the crash too: committed_bytes is what the cap is checked
    against, so a phantom table left in it shrinks the cache for good."""
    store = CacheStore(S, C, capacity_bytes=CAP)
    keys = _fill_to_growth(store)
    _die_at_table_built(tmp_path, BEFORE_GROWTH)
    gc_json(capsys)
    assert store.put(BEFORE_GROWTH, value_for(BEFORE_GROWTH))
    assert check_store(store, keys + [BEFORE_GROWTH]) == []


def test_cleared_before_unlink_kill_leaves_a_working_cache_and_gc_removes_the_old_generation(
        tmp_path, capsys):
    store = CacheStore(S, C, capacity_bytes=CAP)
    keys = list(range(100))
    for k in keys:
        assert store.put(k, value_for(k))
    old_gen = cache_segments(store) - {store.view.segment_name("root")}
    with Zygote(tmp_path / "z", crash_at="cleared_before_unlink") as z:
        status, _ = z.run("clear", S, C, CAP)
    assert status == -9, status_of(status)

    assert old_gen <= cache_segments(store), "the old generation is still there (not unlinked)"
    assert store.view.refresh().gen == 2, "the new generation was published: the clear happened"
    assert all(store.lookup(k, count=False) is MISSING for k in keys)
    assert store.stats()["items_mem"] == 0

    with Zygote(tmp_path / "clean") as z:
        assert z.run("put", S, C, keys[:50], CAP)[0] == 0
    assert all(same_value(store.lookup(k, count=False), value_for(k)) for k in keys[:50])

    result = gc_json(capsys)
    assert sorted(result["removed_segments"]) == sorted(old_gen)
    assert check_store(store, keys) == []


def test_clear_after_a_clear_that_died_half_way(tmp_path):
    """A clear() SIGKILLed after making the next generation's meta segment, before publishing it:
    the next clear() must not trip over that debris (the user has not run `shmcache gc`)."""
    store = CacheStore(S, C, capacity_bytes=CAP)
    for k in range(20):
        assert store.put(k, value_for(k))
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_creating", S, C, CAP, "+g2+t1", "clear")
        assert status == -9, status_of(status)
        assert store.view.segment_name("g2", "meta") in cache_segments(store)
        assert store.view.refresh().gen == 1, "the dead clear() published nothing"
        status, res = z.run("clear", S, C, CAP)
    assert status == 0, f"clear() after a dead clear() failed: {res and res.get('exception')}"
    assert store.lookup(0, count=False) is MISSING
    assert store.put(1, value_for(1))
    assert check_store(store, list(range(20))) == []


@pytest.mark.parametrize("replacement", ["clear", "growth"])
def test_reader_preempted_before_a_lazy_attach_gets_a_value_or_a_miss(replacement, tmp_path):
    """Readers never lock: one that checked the epoch and found its entry, then lost the CPU before
    mapping the entry's data segment, must still get the value or a clean miss when it resumes -
    even if another process replaced the generation meanwhile."""
    store = CacheStore(S, C, capacity_bytes=CAP)
    key = 7
    assert store.put(key, value_for(key))
    paused, go = tmp_path / "paused", tmp_path / "go"
    with Zygote(tmp_path / "z") as z:
        reader, out = z.spawn("preempted_reader", S, C, CAP, key, str(paused), str(go))
        wait_for(paused.exists, 30, "the reader to reach its data-segment attach")
        if replacement == "clear":
            assert z.run("clear", S, C, CAP)[0] == 0
        else:
            assert z.run("put", S, C, list(range(100, 100 + 2 * BEFORE_GROWTH)), CAP)[0] == 0
            assert store.view.refresh().version >= 2
        go.touch()
        assert z.wait(reader, 30) == 0
    res = json.loads(out.read_text())
    assert "error" not in res, \
        f"a lock-free lookup raised instead of returning a value or a miss: {res['error']}"
    assert res.get("missing") or res.get("correct"), res
