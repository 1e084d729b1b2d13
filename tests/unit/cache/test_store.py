"""The cache store: statistics (the README's `stats()` keys, values exact, shared by processes),
the memory cap (stop admitting, items that can never fit), clear / destroy as other store objects
see them, stored-once semantics, the batch paths, and errors for unknown caches and bad names."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

from shmcache.cache import codec
from shmcache.cache.index import key_bytes
from shmcache.cache.store import MISSING, STAT_KEYS, CacheStore
from shmcache.errors import CacheMismatch, CacheNotFound, InvalidArgument, ItemTooLarge, SessionNotFound

DESIGN_STAT_KEYS = {"session", "name", "items_mem", "items_disk", "bytes_mem", "bytes_disk",
                    "bytes_disk_raw", "avg_item_bytes", "hits", "misses", "rejected",
                    "capacity_bytes"}


@pytest.fixture
def store():
    s = CacheStore("st", "main", capacity_bytes=32 << 20)
    yield s
    s.close()


def record_len(key, value) -> int:
    _, kb = key_bytes(key)
    return codec.encode(value).record_len(len(kb), False)


def _fork(fn) -> int:
    """Run ``fn`` in a forked child; return its exit code (0 when fn returned normally)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fn()
            code = 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


# --- statistics ----------------------------------------------------------------------------------


def test_stat_keys_are_exactly_the_designed_set(store):
    assert set(STAT_KEYS) == DESIGN_STAT_KEYS
    st = store.stats()
    assert DESIGN_STAT_KEYS <= set(st)
    assert st["session"] == "st" and st["name"] == "main"
    for k in DESIGN_STAT_KEYS - {"session", "name"}:
        assert type(st[k]) is int, (k, type(st[k]))


def test_stat_values_are_exact(store):
    values = {i: (np.full(i + 1, i, np.int16), f"label-{i}") for i in range(20)}
    values["str-key"] = {"x": 1.5}
    values[b"bytes-key"] = [None, b"\x00" * 300]
    for k, v in values.items():
        assert store.put(k, v)
    for k in list(values)[:15]:
        store.lookup(k)
    for k in ("absent", 12345, b"absent"):
        assert store.lookup(k) is MISSING
    store.lookup(0, count=False)
    store.contains(1)
    st = store.stats()
    total = sum(record_len(k, v) for k, v in values.items())
    assert st["items_mem"] == len(values) == len(store)
    assert st["bytes_mem"] == total
    assert st["avg_item_bytes"] == total // len(values)
    assert st["hits"] == 15 and st["misses"] == 3
    assert st["rejected"] == 0
    assert st["items_disk"] == st["bytes_disk"] == st["bytes_disk_raw"] == 0
    assert st["capacity_bytes"] == 32 << 20


def test_counters_are_shared_across_processes(store):
    store.put(1, "one")
    store.lookup(1)

    def child():
        for _ in range(7):
            assert store.lookup(1) == "one"
        for _ in range(3):
            assert store.lookup(2) is MISSING

    assert _fork(child) == 0
    assert _fork(child) == 0  # a later process (perhaps on the same slot) adds, never resets
    st = store.stats()
    assert st["hits"] == 1 + 14 and st["misses"] == 6
    other = CacheStore("st", "main")  # any store object sees the same totals
    assert other.stats()["hits"] == 15
    other.close()


def test_two_store_objects_in_one_process_count_every_lookup(store):
    """Two handles on one cache in one process (a wrapped dataset and a second ShmDatasetCache,
    say) must not overwrite each other's counts."""
    other = CacheStore("st", "main")
    store.put(1, 10)
    for _ in range(5):
        store.lookup(1)
    for _ in range(3):
        other.lookup(1)
    for _ in range(2):
        store.lookup(1)
    other.lookup(99)
    assert store.stats()["hits"] == 10
    assert store.stats()["misses"] == 1
    other.close()


# --- stored once -------------------------------------------------------------------------------


def test_put_of_a_present_key_keeps_the_first_value(store):
    assert store.put("k", "first")
    assert store.put("k", "second")  # "kept if present": True, and no second copy
    assert store.lookup("k") == "first"
    st = store.stats()
    assert st["items_mem"] == 1 and st["bytes_mem"] == record_len("k", "first")


# --- capacity ------------------------------------------------------------------------------------


def test_a_full_cache_stops_admitting_and_counts_rejections(shm_namespace):
    s = CacheStore("st", "tiny", capacity_bytes=1 << 20)
    item = np.zeros(1000, np.uint8)
    admitted = 0
    for k in range(2000):
        if s.put(k, item):
            admitted += 1
        else:
            break
    assert 100 < admitted < 1000, admitted
    for k in range(admitted, admitted + 50):
        assert s.put(k, item) is False
    st = s.stats()
    assert st["items_mem"] == admitted and st["rejected"] == 51
    assert s.lookup(admitted) is MISSING and (s.lookup(admitted - 1) == 0).all()
    assert st["committed_bytes"] <= 1 << 20
    assert st["shm_bytes"] <= (1 << 20) + 8 * 4096, "shared memory beyond the cap"
    s.close()


def test_an_item_larger_than_the_cap_raises_naming_its_size(shm_namespace):
    s = CacheStore("st", "tiny", capacity_bytes=1 << 20)
    with pytest.raises(ItemTooLarge) as info:
        s.put(1, np.zeros(2 << 20, np.uint8))
    msg = str(info.value)
    assert re.search(r"\b2(\.0+)? MiB", msg) and "st/tiny" in msg and "size=" in msg
    assert isinstance(info.value, MemoryError)
    assert s.stats()["items_mem"] == 0 and s.lookup(1) is MISSING
    assert s.put(2, np.zeros(10)), "the cache works on after refusing an item"
    s.close()


def test_an_item_that_cannot_fit_even_in_the_empty_cache_raises(shm_namespace):
    """A cap smaller than one item (once the cache's own tables are counted) is a clear error at
    once (RELIABILITY.md, scenario 13), not a silent rejection on every single put."""
    s = CacheStore("st", "tiny", capacity_bytes=1 << 20)
    with pytest.raises(ItemTooLarge, match="MiB"):
        s.put(1, np.zeros(int(0.95 * (1 << 20)), np.uint8))
    s.close()


def test_capacity_too_small_to_hold_anything_is_refused():
    with pytest.raises(InvalidArgument, match="size="):
        CacheStore("st", "nothing", capacity_bytes=4096)


# --- clear and destroy ---------------------------------------------------------------------------


def test_clear_drops_everything_and_other_store_objects_see_it(store, shm_namespace):
    other = CacheStore("st", "main")
    for k in range(100):
        store.put(k, np.full(50, k))
    store.put("s", "x")
    assert len(other) == 101
    old = set(shm_namespace.owned_segments())
    other.clear()
    assert len(store) == 0 and store.lookup(5) is MISSING and store.lookup("s") is MISSING
    assert store.stats()["items_mem"] == 0 and store.stats()["bytes_mem"] == 0
    assert store.put(5, "after clear")
    assert other.lookup(5) == "after clear" and len(other) == 1
    now = set(shm_namespace.owned_segments())
    assert not [n for n in now if "+g1+" in n], "the old generation's segments were not unlinked"
    assert now != old
    other.close()


def test_destroy_removes_the_cache(store, shm_namespace):
    store.put(1, 1)
    s2 = CacheStore("st", "second")
    s2.put(1, 2)
    store.destroy()
    assert not [n for n in shm_namespace.owned_segments() if "+st+main+" in n]
    with pytest.raises(CacheNotFound, match="second"):
        CacheStore("st", "main", create=False)
    assert s2.lookup(1) == 2
    s2.close()


def test_open_without_create(store):
    store.put(1, "x")
    again = CacheStore("st", "main", create=False)
    assert again.lookup(1) == "x"
    again.close()
    with pytest.raises(SessionNotFound, match="st"):
        CacheStore("nosuch", "main", create=False)
    with pytest.raises(CacheNotFound, match="'other'") as info:
        CacheStore("st", "other", create=False)
    assert "main" in str(info.value)


@pytest.mark.parametrize("session,name", [("a/b", "c"), ("s", "../c"), ("", "c"), ("s", ""),
                                          ("s", "x" * 65), (5, "c"), ("s", None)])
def test_bad_names_are_refused(session, name, shm_namespace):
    with pytest.raises(InvalidArgument):
        CacheStore(session, name, capacity_bytes=4 << 20)
    assert shm_namespace.owned_segments() == []


def test_fingerprint_mismatch(shm_namespace):
    a = CacheStore("st", "fp", capacity_bytes=4 << 20, fingerprint="aaaa")
    b = CacheStore("st", "fp", fingerprint="aaaa")
    c = CacheStore("st", "fp")  # no fingerprint: no opinion
    with pytest.raises(CacheMismatch, match="aaaa") as info:
        CacheStore("st", "fp", fingerprint="bbbb")
    assert "bbbb" in str(info.value) and "name=" in str(info.value)
    for s in (a, b, c):
        s.close()


def test_collect_garbage_on_a_clean_cache_changes_nothing(store, shm_namespace):
    for k in range(10):
        store.put(k, k)
    before = set(shm_namespace.owned_segments())
    assert store.collect_garbage() == (0, [])
    assert set(shm_namespace.owned_segments()) == before
    assert [store.lookup(k) for k in range(10)] == list(range(10))


# --- batches -------------------------------------------------------------------------------------


def test_lookup_batch(store):
    for k in range(5):
        store.put(k, (np.arange(3) + k, k))
    store.put("s", "str")
    values, missing = store.lookup_batch([4, "s", 9, 0, "t"])
    assert missing == [2, 4]
    assert values[2] is MISSING and values[1] == "str" and values[0][1] == 4
    st = store.stats()
    assert st["hits"] == 3 and st["misses"] == 2


def test_gather_ints_uniform_batch(store):
    rows = {k: (np.arange(6, dtype=np.float32).reshape(2, 3) * k, k, float(k) / 4, k % 2 == 0)
            for k in range(-3, 40)}
    for k, v in rows.items():
        store.put(k, v)
    keys = np.array([5, -3, 39, 5, 0], dtype=np.int64)
    tree, leaves, cols = store.gather_ints(keys)
    arr, label, frac, even = cols
    assert arr.shape == (5, 2, 3) and arr.dtype == np.float32
    for j, k in enumerate(keys.tolist()):
        assert np.array_equal(arr[j], rows[k][0])
        assert label[j] == k and frac[j] == k / 4 and bool(even[j]) == (k % 2 == 0)
    out = [np.empty((5, 2, 3), np.float32), np.empty(5, np.int64), np.empty(5, np.float64),
           np.empty(5, np.bool_)]
    _, _, cols2 = store.gather_ints(keys, out)
    assert all(c is o for c, o in zip(cols2, out))
    assert np.array_equal(out[0], arr) and np.array_equal(out[1], label)


def test_gather_ints_refuses_non_uniform_batches(store):
    store.put(0, (np.zeros(4, np.uint8), 0))
    store.put(1, (np.zeros(4, np.uint8), 1))
    store.put(2, (np.zeros(5, np.uint8), 2))  # another layout
    store.put(3, (np.zeros(4000, np.uint8), 3))  # another layout and class
    assert store.gather_ints(np.array([0, 1], np.int64)) is not None
    assert store.gather_ints(np.array([0, 2], np.int64)) is None
    assert store.gather_ints(np.array([0, 3], np.int64)) is None
    assert store.gather_ints(np.array([0, 7], np.int64)) is None  # a miss
    assert store.gather_ints(np.array([7, 0], np.int64)) is None
    assert store.gather_ints(np.array([], np.int64)) is None


def test_clear_destroy_and_gc_of_one_cache_leave_similar_names_alone(shm_namespace):
    """Segment names are prefixes: cache 'a' must never take 'a-b', 'a.b' or 'ab' with it."""
    stores = {n: CacheStore("st", n, capacity_bytes=4 << 20) for n in ("a", "a-b", "a.b", "ab")}
    for n, s in stores.items():
        for k in range(5):
            s.put(k, f"{n}:{k}")
    a = stores.pop("a")
    a.clear()
    a.put(1, "new")
    assert a.collect_garbage() == (0, [])
    for n, s in stores.items():
        assert [s.lookup(k) for k in range(5)] == [f"{n}:{k}" for k in range(5)], n
    a.destroy()
    for n, s in stores.items():
        assert len(s) == 5 and s.lookup(4) == f"{n}:4", n
        again = CacheStore("st", n, create=False)  # and a fresh attach still finds everything
        assert again.lookup(2) == f"{n}:2"
        again.close()
        s.close()


def test_reads_work_when_every_process_slot_of_the_session_is_taken(store):
    """Counters use one slot per live process (256 per session). The 257th process of a session -
    8 ranks x 32 DataLoader workers on a big node - must still read the cache; at worst its
    lookups go uncounted."""
    import fcntl

    from shmcache.cache.registry import MAX_SLOTS, SessionRegistry

    store.put(1, "one")
    slots = SessionRegistry().session_dir("st") / "slots"
    held = []
    for k in range(MAX_SLOTS):  # hold every slot lock ourselves (flock is per open file)
        fd = os.open(slots / f"{k}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass  # already held (by this process's own slot)
        held.append(fd)

    def child():
        assert store.lookup(1) == "one"
        assert store.lookup(2) is MISSING

    try:
        assert _fork(child) == 0, "a lookup failed because no counter slot was free"
    finally:
        for fd in held:
            os.close(fd)


def _stamped(k: int) -> np.ndarray:
    return np.full(1000, k % 251, np.uint8)  # one size class for every key: chunks alias by offset


def test_a_handle_that_outlives_a_forced_destroy_never_touches_the_cache_made_again(shm_namespace):
    """``destroy --force`` under a live reader, then the same session and cache made again (with
    other values under the same keys): the old handle gets misses, never the new cache's bytes,
    and its writes never show up in (or damage) the new cache."""
    from shmcache.cache.registry import SessionRegistry

    writer = CacheStore("again", "c", capacity_bytes=8 << 20)
    for k in range(200):
        writer.put(k, _stamped(k))
    writer.close()
    stale = CacheStore("again", "c", create=False)  # maps root, meta and table; no data yet
    assert len(stale) == 200
    warm = CacheStore("again", "c", create=False)  # maps the data too: it could read old bytes
    assert all(np.array_equal(warm.lookup(k), _stamped(k)) for k in range(200))
    SessionRegistry().destroy("again", force=True)
    new = CacheStore("again", "c", capacity_bytes=8 << 20)
    for k in range(200):
        new.put(k, _stamped(k + 7))  # the same keys, other values, the same chunks
    for k in range(200):
        assert stale.lookup(k) is MISSING, f"key {k}: the new cache's bytes"
        assert warm.lookup(k) is MISSING, f"key {k}: the destroyed cache's bytes"
    assert warm.gather_ints(np.arange(200)) is None and warm.lookup_batch(list(range(200)))[1] == list(range(200))
    assert len(warm) == 0 and not warm.contains(3)
    for k in (500, 7):  # a clear error (its lock file was replaced), never a write into the new cache
        with pytest.raises(CacheNotFound, match="destroyed while this process used it"):
            stale.put(k, _stamped(99))
    with pytest.raises(CacheNotFound, match="destroyed"):
        stale.clear()
    with pytest.raises(CacheNotFound, match="destroyed"):
        stale.destroy()  # it would unlink the new cache's root and segments
    fresh = CacheStore("again", "c", create=False)
    assert fresh.lookup(500) is MISSING
    for k in range(200):
        assert np.array_equal(fresh.lookup(k), _stamped(k + 7)), f"key {k} was damaged"
    for s in (stale, warm, new, fresh):
        s.close()
    SessionRegistry().destroy("again", force=True)


def test_a_put_that_cannot_get_the_lock_is_served_uncached_and_waits_once(shm_namespace, caplog):
    """A live holder keeps the cache lock (a second open file description: flock excludes it as it
    would another process). The first put waits its timeout and gives up (False, counted as
    rejected, one log line naming the lock and `fuser`); the next ones only try, without waiting;
    once the lock is free they store again, and a new stuck spell is a new condition."""
    import fcntl
    import time

    store = CacheStore("s", "c", capacity_bytes=8 << 20, lock_timeout_s=0.5)
    lock = shm_namespace.sessions_dir / "s" / "caches" / "c.lock"
    fd = os.open(lock, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert store.put(1, b"one") is False
        assert time.monotonic() - t0 >= 0.5
        t0 = time.monotonic()
        assert store.put(2, b"two") is False and store.put(3, b"three") is False
        assert time.monotonic() - t0 < 0.2, "a put waited again for a lock known to be stuck"
        stuck = [r.getMessage() for r in caplog.records if "fuser" in r.getMessage()]
        assert len(stuck) == 1 and str(lock) in stuck[0], stuck
        assert store.stats()["rejected"] == 3 and store.lookup(1) is MISSING
        fcntl.flock(fd, fcntl.LOCK_UN)
        assert store.put(2, b"two") is True and store.lookup(2) == b"two"
        fcntl.flock(fd, fcntl.LOCK_EX)
        t0 = time.monotonic()
        assert store.put(4, b"four") is False
        assert time.monotonic() - t0 >= 0.5, "the lock was free in between: a new spell waits again"
        assert len([r for r in caplog.records if "fuser" in r.getMessage()]) == 2
    finally:
        os.close(fd)
    assert store.put(4, b"four") is True
    store.close()


def test_a_put_that_waits_longer_than_a_write_says_why_while_it_waits(shm_namespace, caplog):
    """Issue 30: a lock wait on the read path (a miss's put) longer than the work it waits for
    (a write under the lock: milliseconds) is said while it lasts - not only at its timeout."""
    import fcntl
    import threading
    import time

    store = CacheStore("s", "c", capacity_bytes=8 << 20, lock_timeout_s=20)
    lock = shm_namespace.sessions_dir / "s" / "caches" / "c.lock"
    fd = os.open(lock, os.O_RDWR)
    done = []
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        putter = threading.Thread(target=lambda: done.append(store.put(1, b"one")))
        putter.start()
        deadline = time.monotonic() + 10
        while not [r for r in caplog.records if "a put waits" in r.getMessage()]:
            assert time.monotonic() < deadline, "a put waited 10 s for the lock without saying why"
            time.sleep(0.05)
        said = [r.getMessage() for r in caplog.records if "a put waits" in r.getMessage()]
        assert not done and len(said) == 1, said
        assert str(lock) in said[0] and "lock_timeout_s=20" in said[0] and "fuser" in said[0]
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    putter.join(20)
    assert done == [True] and store.lookup(1) == b"one"
    store.close()


def test_a_cache_restarted_after_losing_its_generation_never_reuses_its_names(shm_namespace):
    """The segments of a cache's generation vanished under its root (what an older destroy killed
    half-way left). The next opener starts it afresh - under a generation number the root never
    named: a handle that still maps the lost table must not map the new data segment by name
    and read other values at its old offsets."""
    writer = CacheStore("lost", "c", capacity_bytes=8 << 20)
    for k in range(50):
        writer.put(k, _stamped(k))
    writer.close()
    old = CacheStore("lost", "c", create=False)  # maps the table, not the data yet
    for name in shm_namespace.owned_segments():
        if "+g1+" in name:
            os.unlink(shm_namespace.shm_path(name))
    new = CacheStore("lost", "c")  # repairs under the lock
    for k in reversed(range(50)):  # other values, in other chunks
        new.put(k, _stamped(k + 7))
    for k in range(50):
        got = old.lookup(k)  # the handle follows the cache (same incarnation): its value now
        assert got is MISSING or np.array_equal(got, _stamped(k + 7)), f"key {k}: another key's bytes"
    old.close()
    new.close()



@pytest.mark.parametrize("end", ["close", "destroy"])
def test_every_read_of_a_closed_handle_says_it_was_closed(shm_namespace, end):
    """A handle closed (or destroyed) in this process: each read names the problem and the fix,
    the hot ``lookup`` too (it reads the root without a check: no raw AttributeError)."""
    from shmcache.tiers.tiered_store import TieredStore

    store = CacheStore("s", "c", capacity_bytes=8 << 20)
    assert store.put(1, "one") and store.lookup(1) == "one"
    tiered = TieredStore(store, [])
    getattr(store, end)()
    reads = [lambda: store.lookup(1), lambda: store.lookup("k"), lambda: tiered.lookup(1),
             lambda: store.lookup_batch([1]), lambda: store.contains(1),
             lambda: store.gather_ints(np.arange(2)), lambda: len(store)]
    for read in reads:
        with pytest.raises(InvalidArgument, match="was closed in this process; open it again"):
            read()


def _destroyed_as_force_does(session: str) -> None:
    """What `destroy --force` does once its wait for a busy cache lock (10 s) is over: the
    session's directory renamed away and removed, its segments unlinked (SessionRegistry.destroy)."""
    import shutil

    from shmcache.cache.registry import SessionRegistry, unlink_segments

    registry = SessionRegistry()
    session_dir, prefix = registry.session_dir(session), registry.segment_prefix(session)
    doomed = session_dir.with_name(f".{session}.tmp-destroy-test")
    session_dir.rename(doomed)
    unlink_segments(registry.ns, prefix)
    shutil.rmtree(doomed)


@pytest.mark.parametrize("when", ["create", "label", "fingerprint"])
def test_a_forced_destroy_while_the_metadata_is_written_says_the_session_went_away(shm_namespace, monkeypatch, when):
    """`destroy --force` waits 10 s for a cache lock whose holder is busy, then renames the
    session's directory away and removes it (SessionRegistry.destroy): a handle that holds the
    lock and is about to write the cache's metadata finds no directory (seen once in the destroy
    stress run). That is the session going away, said as such, never a raw FileNotFoundError.
    The hook does what destroy does after its wait, without the 10 s."""

    from shmcache.cache import store as store_module

    real = store_module.write_json
    armed = [when == "create"]

    def destroyed_first(path, data, **kw):
        if armed[0]:
            armed[0] = False
            _destroyed_as_force_does("gone")
        return real(path, data, **kw)

    monkeypatch.setattr(store_module, "write_json", destroyed_first)
    if when == "create":
        with pytest.raises((SessionNotFound, CacheNotFound), match="destroyed while"):
            CacheStore("gone", "c", capacity_bytes=8 << 20)
        return
    store = CacheStore("gone", "c", capacity_bytes=8 << 20)
    armed[0] = True
    with pytest.raises((SessionNotFound, CacheNotFound), match="destroyed while"):
        if when == "label":
            store.record_label("a dataset")
        else:
            store.bind_fingerprint("f" * 16)
    store.close()


def test_a_forced_destroy_while_a_snapshot_import_binds_the_cache_says_the_session_went_away(shm_namespace, tmp_path):
    """The same race in a snapshot import: it records the snapshot's dataset (fingerprint,
    length) in the cache's metadata under the cache lock too, and a `destroy --force` that
    removes the session's directory there raised a raw FileNotFoundError (the fix above covered
    the store's own writes only). The destroy is made as the import reads the metadata it is
    about to rewrite, under the lock."""

    from shmcache import ShmDatasetCache
    from shmcache.snapshot.load import import_into, read_manifest

    src = ShmDatasetCache(session="src", name="c", size=16)
    for i in range(4):
        src.put(i, np.full(8, i, np.uint8))
    src.export(tmp_path / "snap")
    src.close()
    loc, manifest = read_manifest(tmp_path / "snap")
    store = CacheStore("gone", "c", capacity_bytes=8 << 20)
    read_meta, reads = store.read_meta, []

    def read_then_destroyed():
        meta = read_meta()
        reads.append(1)
        if len(reads) == 2:  # the read under the lock, just before the write
            _destroyed_as_force_does("gone")
        return meta

    store.read_meta = read_then_destroyed
    try:
        with pytest.raises((SessionNotFound, CacheNotFound), match="destroyed while"):
            import_into(store, loc, manifest, allow_unsigned=True)
        assert len(reads) == 2
    finally:
        store.close()
