"""Spilling end to end: more data than memory, several processes, damaged and vanished spill files,
two handles of one spilling cache, an index that cannot grow.

Workers are plain interpreters using the store layer (no torch import: they start fast).
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _spill_samples import sample

from shmcache import ShmDatasetCache
from shmcache.base.shm import Segment
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import ItemTooLarge, SharedMemoryFull, SpillError
from shmcache.tiers.spill import tier as spilling

ITEMS = 400


WORKER = r"""
import json, sys
import numpy as np
sys.path.insert(0, {tests!r})
from _spill_samples import sample
from shmcache.cache.store import CacheStore, MISSING
from shmcache.tiers.spill import tier as spilling
session, name, spill_dir, keys = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
store = CacheStore(session, name, capacity_bytes=4 << 20)
spilling.attach(store, spill_dir)
bad = 0
for k in keys:
    v = store.lookup(k)
    if v is MISSING:
        v = sample(k)
        store.put(k, v)
    ref = sample(k)
    if not (np.array_equal(v[0], ref[0]) and v[1] == ref[1]):
        bad += 1
print(json.dumps({{"bad": bad}}))
store.close()
"""


def run_workers(tmp_path, session, name, spill_dir, key_lists):
    script = WORKER.format(tests=str(Path(__file__).parent))
    procs = [subprocess.Popen([sys.executable, "-c", script, session, name, str(spill_dir), json.dumps(keys)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for keys in key_lists]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_four_processes_cache_a_dataset_four_times_larger_than_memory_once(tmp_path):
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    keys = np.random.default_rng(0).permutation(ITEMS)
    shards = [keys[r::4].tolist() for r in range(4)]
    outs = run_workers(tmp_path, "big", "ds", spill_dir, shards)  # epoch 1: disjoint shards
    assert all(o["bad"] == 0 for o in outs)

    store = CacheStore("big", "ds", create=False)
    spilling.attach(store, spill_dir)
    st = store.stats()
    assert st["items_mem"] + st["items_disk"] == ITEMS, st  # each item cached exactly once
    assert st["items_disk"] > ITEMS // 2, "most of it had to spill"
    assert st["shm_bytes"] <= (4 << 20) + 64 * 1024
    assert st["bytes_disk"] < st["bytes_disk_raw"], "token-like data compresses"
    before = st["misses"]

    reshuffled = [keys[(r + 1) % 4::4].tolist() for r in range(4)]
    outs = run_workers(tmp_path, "big", "ds", spill_dir, reshuffled)  # epoch 2: other shards
    assert all(o["bad"] == 0 for o in outs)
    st2 = store.stats()
    assert st2["misses"] == before, "epoch 2 has no misses"
    assert st2["items_mem"] + st2["items_disk"] == ITEMS
    store.close()


def _spilled_store(tmp_path, n=60):
    store = CacheStore("dmg", "ds", capacity_bytes=1 << 20)
    (tmp_path / "spill").mkdir(exist_ok=True)
    spilling.attach(store, tmp_path / "spill")
    for i in range(n):
        assert store.put(i, sample(i))
    assert store.stats()["items_disk"] > n // 2
    return store


def _spill_files(tmp_path) -> list[Path]:
    return sorted((tmp_path / "spill").rglob("*.spill"))


def test_flipped_bits_in_spill_files_are_misses_then_replaced(tmp_path, caplog):
    store = _spilled_store(tmp_path)
    files = _spill_files(tmp_path)
    assert files
    raw = bytearray(files[0].read_bytes())
    for pos in range(100, len(raw), 997):  # damage many records, everywhere
        raw[pos] ^= 0x5A
    files[0].write_bytes(raw)

    wrong = 0
    misses_seen = 0
    for i in range(60):
        v = store.lookup(i)
        if v is MISSING:
            misses_seen += 1
            v = sample(i)
            assert store.put(i, v)  # replaces the corrupt record
        wrong += not np.array_equal(v[0], sample(i)[0])
    assert wrong == 0
    assert misses_seen > 0
    assert store.stats()["corrupt"] == misses_seen
    lines = [r.getMessage() for r in caplog.records if "corrupt spill record" in r.getMessage()]
    assert lines
    # one line per damaged file and condition (checksum, header, ...), not one per record
    assert len(lines) == len({(m.split(" at offset")[0], m.split(": ", 1)[1].split(";")[0]) for m in lines})
    assert len(lines) < misses_seen, f"{len(lines)} log lines for {misses_seen} damaged records of one file"
    for i in range(60):  # after the replacement every item reads back from the cache
        v = store.lookup(i)
        assert v is not MISSING and np.array_equal(v[0], sample(i)[0])
    store.close()


def test_truncated_spill_file_is_a_miss_not_an_exception(tmp_path):
    store = _spilled_store(tmp_path)
    for f in _spill_files(tmp_path):
        os.truncate(f, f.stat().st_size // 2)
    for i in range(60):
        v = store.lookup(i)
        if v is not MISSING:
            assert np.array_equal(v[0], sample(i)[0])
    assert store.stats()["corrupt"] > 0
    store.close()


def test_spill_dir_deleted_under_a_live_cache_degrades_to_misses(tmp_path):
    store = _spilled_store(tmp_path)
    import shutil

    shutil.rmtree(tmp_path / "spill")
    got = [store.lookup(i) for i in range(60)]
    assert any(v is MISSING for v in got)
    assert all(v is MISSING or np.array_equal(v[0], sample(i)[0]) for i, v in enumerate(got))
    store.close()


def test_disk_full_while_spilling_stops_spilling_and_keeps_serving(tmp_path, monkeypatch, caplog):
    store = CacheStore("full", "ds", capacity_bytes=1 << 20)
    (tmp_path / "spill").mkdir()
    spilling.attach(store, tmp_path / "spill")
    import errno

    real = os.pwritev
    calls = {"n": 0}

    def failing(fd, bufs, offset, *a):  # the disk's files only: shared memory has room
        if os.readlink(f"/proc/self/fd/{fd}").startswith(str(tmp_path)):
            calls["n"] += 1
            if calls["n"] > 5:
                raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset, *a)

    monkeypatch.setattr(os, "pwritev", failing)
    stored = [store.put(i, sample(i)) for i in range(60)]
    assert not all(stored), "some items were refused once the disk was full"
    st = store.stats()
    assert st["rejected"] > 0
    assert any("stops spilling" in r.getMessage() for r in caplog.records)
    for i in range(60):  # what was stored reads back; the rest are clean misses
        v = store.lookup(i)
        assert v is MISSING or np.array_equal(v[0], sample(i)[0])
    store.close()


def test_item_larger_than_memory_goes_to_disk_when_spilling(tmp_path):
    """ItemTooLarge is for caches that cannot spill: a spill file takes an item of any size."""
    big = np.arange(3 << 20, dtype=np.uint32).view(np.uint8)[: 5 << 20]  # 5 MiB, cap 1 MiB
    with ShmDatasetCache(session="big", name="spills", size=1, spilling=True, spill_dir=tmp_path) as cache:
        assert cache.put(0, big) is True
        assert cache.get(1, lambda k: big[::-1].copy())[0] == big[-1]  # computed, stored, returned
        assert cache.stats()["items_disk"] == 2
        assert np.array_equal(cache[0], big) and np.array_equal(cache[1], big[::-1])
    with ShmDatasetCache(session="big", name="nospill", size=1) as cache:
        with pytest.raises(ItemTooLarge, match="size="):
            cache.put(0, big)


def test_clear_and_destroy_delete_spill_files(tmp_path):
    store = _spilled_store(tmp_path)
    assert _spill_files(tmp_path)
    store.clear()
    assert store.stats()["items_disk"] == 0
    assert not any(f.stat().st_size > 64 for f in _spill_files(tmp_path))
    for i in range(60):
        store.put(i, sample(i))
    path = Path(store.read_meta()["spill_path"])
    store.close()
    from shmcache.cache.registry import SessionRegistry

    SessionRegistry().destroy("dmg", force=True)
    assert not path.exists()


def test_spilling_without_a_dir_names_both_ways():
    with pytest.raises(SpillError, match=r"spill_dir=.*SHMCACHE_SPILL_DIR"):
        ShmDatasetCache(spilling=True)


def test_spill_dir_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpillError, match=str(f)):
        ShmDatasetCache(spilling=True, spill_dir=f)


def test_unwritable_spill_dir_is_refused(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    os.chmod(ro, 0o500)
    try:
        if os.access(ro, os.W_OK) and os.geteuid() == 0:
            pytest.skip("running as root: mode bits do not stop writes (spill.py tests a read-only mount)")
        with pytest.raises(SpillError, match="ro"):
            ShmDatasetCache(spilling=True, spill_dir=ro)
    finally:
        os.chmod(ro, 0o700)


def test_spill_dir_from_the_environment_and_the_session(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMCACHE_SPILL_DIR", str(tmp_path / "env"))
    (tmp_path / "env").mkdir()
    (tmp_path / "sess").mkdir()
    c = ShmDatasetCache(session="e", name="x", size=1, spilling=True)
    for i in range(40):
        c.put(i, sample(i))
    assert c.stats()["items_disk"] > 0
    assert any((tmp_path / "env").rglob("*.spill"))
    c.close()

    from shmcache.cache.registry import SessionRegistry

    monkeypatch.delenv("SHMCACHE_SPILL_DIR")
    SessionRegistry().create("withdir", spill_dir=tmp_path / "sess")
    c = ShmDatasetCache(session="withdir", name="x", size=1, spilling=True)
    for i in range(40):
        c.put(i, sample(i))
    assert any((tmp_path / "sess").rglob("*.spill"))
    c.close()


KILLER = r"""
import sys
sys.path.insert(0, {tests!r})
from _spill_samples import sample
from shmcache.cache.store import CacheStore
from shmcache.tiers.spill import tier as spilling
store = CacheStore("kill", "ds", capacity_bytes=1 << 20)
spilling.attach(store, sys.argv[1])
for k in range(int(sys.argv[2]), 200):
    store.put(k, sample(k))
"""


@pytest.mark.parametrize("point", [pytest.param("spilled", marks=pytest.mark.slow), "mid_copy",
                                   pytest.param("locked", marks=pytest.mark.slow)])
def test_writers_killed_while_spilling_leave_no_torn_value(tmp_path, point):
    """A writer SIGKILLed with a spill record written but not published (or mid-way through a
    memory record, or holding the lock) - again and again: the next writers and gc go on; every
    published value is right; the totals count exactly the published items."""
    spill_dir = tmp_path / "spill"
    spill_dir.mkdir()
    script = KILLER.format(tests=str(Path(__file__).parent))
    start = 0
    for round_ in range(6):  # each SHMCACHE_CRASH_AFTER (0, 1, 2) twice, on what earlier rounds left
        env = {**os.environ, "SHMCACHE_CRASH_AT": point, "SHMCACHE_CRASH_AFTER": str(round_ % 3)}
        p = subprocess.run([sys.executable, "-c", script, str(spill_dir), str(start)], env=env,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode in (0, -9), p.stderr[-2000:]
        start += 7
    from shmcache.cli.main import main as cli

    assert cli(["gc"]) == 0
    store = CacheStore("kill", "ds", create=False)
    spilling.attach(store, spill_dir)
    present = 0
    for k in range(200):
        v = store.lookup(k, count=False)
        if v is not MISSING:
            present += 1
            assert np.array_equal(v[0], sample(k)[0]) and v[1] == k
    st = store.stats()
    assert st["items_mem"] + st["items_disk"] == present
    assert st["corrupt"] == 0
    assert store.collect_garbage()[0] == 0  # nothing left to repair
    store.close()


# --- issue 8 ------------------------------------------------------------------------------------


def test_spill_dir_that_does_not_exist_is_refused_not_created(tmp_path):
    typo = tmp_path / "scrath" / "spill"
    with pytest.raises(SpillError, match=rf"spill_dir {typo} does not exist; create it first \(mkdir -p {typo}\)"):
        ShmDatasetCache(spilling=True, spill_dir=typo)
    assert not (tmp_path / "scrath").exists()


def test_spill_dir_without_spilling_warns_once(tmp_path):
    with pytest.warns(UserWarning, match="spill_dir=.*no effect without spilling=True") as got:
        c = ShmDatasetCache(session="w", name="x", size=1, spill_dir=tmp_path)
    assert len(got) == 1
    c.close()


def test_spilling_goes_on_after_the_session_is_destroyed_and_made_again(tmp_path):
    from shmcache.cache.registry import SessionRegistry

    (tmp_path / "spill").mkdir()
    big = np.arange(3 << 20, dtype=np.uint8)  # larger than the whole cache: it can only spill

    def open_cache() -> CacheStore:
        store = CacheStore("again", "c", capacity_bytes=1 << 20)
        spilling.attach(store, tmp_path / "spill")
        return store

    first = open_cache()
    assert first.put(1, big) and first.stats()["items_disk"] == 1
    first.close()
    SessionRegistry().destroy("again")  # as `shmcache destroy again` would; the process lives on
    second = open_cache()
    assert second.put(2, big) and second.stats()["items_disk"] == 1
    assert second.contains(2)
    got = second.lookup(2)
    assert got is not MISSING and np.array_equal(got, big), "a put went into a deleted spill file"
    assert list((tmp_path / "spill").rglob("*.spill")), "the spill folder was not made again"
    second.close()


def test_a_read_racing_a_clear_is_a_quiet_miss(tmp_path, caplog):
    store = _spilled_store(tmp_path)
    other = CacheStore("dmg", "ds")  # a second handle: another reader, as in another process
    spilling.attach(other, tmp_path / "spill")
    g = other.view.refresh()
    spilled = [i for i in range(60) if other.view.find(g, i).w0 & 4]  # SPILLED entries of generation g
    assert spilled
    found = [other.view.find(g, i) for i in spilled]
    store.clear()  # deletes the spill files under the reader, which still holds generation g
    from shmcache.cache.view import CORRUPT_RECORD

    with caplog.at_level(logging.WARNING, logger="shmcache"):
        for w0, w2, _, kb, w1 in found:  # what a lookup that found its entry just before does next
            assert other.view.decode(g, w0, w2, True, w1, kb) is CORRUPT_RECORD  # a miss, never a wrong value
        for i in range(60, 120):  # new spill files at the old names, other records at the old offsets
            store.put(i, sample(i))
        assert store.stats()["items_disk"] > 0
        for w0, w2, _, kb, w1 in found:
            assert other.view.decode(g, w0, w2, True, w1, kb) is CORRUPT_RECORD
        assert not other.is_current(g.gen)  # so lookup counts such a failed read as a plain miss
        for i in spilled:
            assert other.lookup(i) is MISSING
    assert not [r for r in caplog.records if "corrupt" in r.getMessage()], caplog.text
    assert other.stats()["corrupt"] == 0
    other.close()
    store.close()


def test_a_full_index_that_cannot_grow_rejects_instead_of_hanging(monkeypatch, tmp_path):
    store = CacheStore("full", "c", capacity_bytes=64 << 20)
    from shmcache.tiers.spill import tier as spilling

    spilling.attach(store, tmp_path)
    real = Segment.create

    def no_room_for_tables(name, *a, **kw):
        if name.rsplit("+", 1)[-1].startswith("t"):  # a table segment (+g<gen>+t<version>)
            raise SharedMemoryFull("no room for the table (injected)")
        return real(name, *a, **kw)

    monkeypatch.setattr(Segment, "create", staticmethod(no_room_for_tables))
    t0 = time.monotonic()
    stored = [store.put(f"key-{i}", i) for i in range(1500)]
    assert time.monotonic() - t0 < 30
    assert not all(stored) and store.stats()["rejected"] > 0
    assert store.lookup("absent") is MISSING  # probing stops (it spun forever on a full table)
    store.close()


def test_two_handles_of_one_spilling_cache_in_one_process(tmp_path):
    a = ShmDatasetCache(session="sp2", name="c", size=1, spilling=True, spill_dir=tmp_path)
    b = ShmDatasetCache(session="sp2", name="c", size=1, spilling=True, spill_dir=tmp_path)
    t0 = time.monotonic()
    for i in range(30):
        (a if i % 2 else b).put(i, np.full(40_000, i, np.uint8))
    assert time.monotonic() - t0 < 5, "the handles waited on each other's spill file lock"
    assert a.stats()["items_disk"] > 0
    assert all(int(a.get(i)[0]) == i for i in range(30))
    a.close()
    b.close()


def test_clear_from_a_handle_that_does_not_spill_deletes_the_spill_files(tmp_path):
    a = ShmDatasetCache(session="sp3", name="c", size=1, spilling=True, spill_dir=tmp_path)
    for i in range(30):  # random bytes: stored raw, so the files hold every byte
        a.put(i, np.random.default_rng(i).integers(0, 256, 40_000, dtype=np.uint8))
    spilled = sum(f.stat().st_size for f in tmp_path.rglob("*.spill"))
    assert spilled > 100_000
    plain = ShmDatasetCache(session="sp3", name="c")
    plain.clear()
    assert sum(f.stat().st_size for f in tmp_path.rglob("*.spill")) < 1000
    value = np.random.default_rng(0).integers(0, 256, 40_000, dtype=np.uint8)
    for i in range(30):  # the spilling handle goes on after the clear
        a.put(i, value)
    assert np.array_equal(a.get(29), value)
    a.close()
    plain.close()
