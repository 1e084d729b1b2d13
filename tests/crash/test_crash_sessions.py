"""Whole jobs killed with SIGKILL, restarted; sessions created, attached and destroyed under kills.

RELIABILITY.md scenarios 5 and 6: after ``kill -9`` of every process of a job, the dead processes
are recognised (``live_pids()`` is empty, ``shmcache gc`` removes their slot locks), and the job
started again reuses the cache - every item a hit - with no FileExistsError and no hang. A thousand
create/attach/destroy cycles with random kills leave the number of ``/dev/shm`` entries and lock
files flat.
"""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
from _procs_util import Procs, Zygote, status_of, wait_for
from _shmcheck import SIZES, check_store, gc_json, same_value, value_for

from shmcache.cache import process_slot
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import CacheNotFound

CAP = 64 << 20


def test_kill_9_a_torch_job_and_start_it_again(tmp_path, capsys):
    """The public API end to end: three processes wrap a dataset, all are SIGKILLed, the job starts
    again and reads everything from the cache."""
    session, n = "job", 64
    counter = tmp_path / "computed"
    with Procs(tmp_path / "run1") as procs:
        ready = [tmp_path / f"ready1.{i}" for i in range(3)]
        members = [procs.start("torch_job", session, n, str(counter), str(r), True) for r in ready]
        for r, p in zip(ready, members):
            wait_for(lambda r=r, p=p: r.exists() or p.poll() is not None, 60, "a job member to fill the cache")
            assert p.poll() is None, f"job member died: {status_of(p.returncode)}"
        reg = SessionRegistry()
        assert sorted(reg.live_pids(session)) == sorted(p.pid for p in members)
        for p in members:
            os.kill(p.pid, signal.SIGKILL)
        for p in members:
            assert procs.finish(p, 10)[0] == -9
    assert reg.live_pids(session) == [], "dead processes are still counted as attached"
    stale = gc_json(capsys)["removed_locks"]
    assert len(stale) == 3, f"gc should remove the three dead slot locks, removed {stale}"
    assert list((reg.session_dir(session) / "slots").glob("*.lock")) == []

    store = CacheStore(session, "train", create=False)
    before = store.stats()
    assert before["items_mem"] == n
    with Procs(tmp_path / "run2") as procs:
        members = [procs.start("torch_job", session, n, str(counter), str(tmp_path / f"ready2.{i}"),
                               False) for i in range(3)]
        results = [procs.finish(p, 90) for p in members]
    for status, res in results:
        assert status == 0, res
        assert res["bad"] == 0 and res["items"] == n
    after = store.stats()
    assert after["misses"] == before["misses"], "the restarted job recomputed items"
    assert after["hits"] - before["hits"] == 3 * n
    assert after["items_mem"] == n
    assert reg.live_pids(session) == []


def test_kill_9_a_busy_job_repeatedly(tmp_path, capsys):
    """Three processes filling and reading one cache are SIGKILLed at a random moment, three times:
    each restart finds what was cached, and the cache is exact after gc."""
    session, cache = "busy", "c"
    keys = list(range(300))
    shares = [keys[i::3] for i in range(3)]
    rng = random.Random(7)
    reg = SessionRegistry()
    with Zygote(tmp_path / "z") as z:
        for rnd in range(3):
            ready = [tmp_path / f"ready.{rnd}.{i}" for i in range(3)]
            kids = [z.spawn("job_member", session, cache, CAP, shares[i], str(ready[i]))
                    for i in range(3)]
            for r in ready:
                wait_for(r.exists, 30, "a job member to be ready")
            assert len(reg.live_pids(session)) == 3
            time.sleep(rng.uniform(0.01, 0.2))  # in the middle of reads and writes
            for pid, _ in kids:
                z.kill(pid)
            for pid, _ in kids:
                assert z.wait(pid, 10) == -9
            assert reg.live_pids(session) == []
            for r in ready:
                assert r.read_text() == "", f"a job member read a wrong value: {r.read_text()}"
            store = CacheStore(session, cache, create=False)
            assert all(same_value(store.lookup(k, count=False), value_for(k)) for k in keys), \
                "the restarted job must find every item the killed one cached"
            store.close()
            if rnd == 1:
                gc_json(capsys)
    # the writes of random keys that were in flight: finish or undo them, then check everything
    gc_json(capsys)
    store = CacheStore(session, cache, create=False)
    assert check_store(store) == []
    assert not list((reg.session_dir(session) / "slots").glob("*.lock"))


def test_destroy_killed_half_way_leaves_nothing_gc_cannot_remove(tmp_path, capsys, shm_namespace):
    """`shmcache destroy` SIGKILLed while it deletes the session directory (after session.json is
    gone): the session is no longer listed, so `shmcache gc` is the only thing that can remove
    what is left (sessions created by `shmcache new` get new names, so nobody reuses it)."""
    store = CacheStore("doomed", "c", capacity_bytes=CAP)
    assert store.put(1, value_for(1))
    store.close()
    process_slot.release_all()
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_destroying", "doomed")
    assert status == -9, status_of(status)
    assert SessionRegistry().list() == []
    gc_json(capsys)
    left = [str(p.relative_to(shm_namespace.root)) for p in shm_namespace.sessions_dir.rglob("*")]
    assert left == [], f"a destroyed session's files outlive `shmcache gc`: {left}"
    assert shm_namespace.owned_segments() == []


def test_destroy_killed_while_unlinking_segments_leaves_no_broken_cache(tmp_path, capsys, shm_namespace):
    """`shmcache destroy` SIGKILLed after it unlinked some of a cache's segments. destroy renames
    the session away first and unlinks roots before anything else, so the session is gone at
    once: the next job gets a fresh session and cache (never a cache with missing segments, whose
    lookups would fail), and `shmcache gc` removes what the dead destroy left."""
    keys = list(range(60))
    store = CacheStore("half", "c", capacity_bytes=CAP)
    for k in keys:
        assert store.put(k, value_for(k))
    store.close()
    process_slot.release_all()
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_destroying", "half", "+g1+c")
        assert status == -9, status_of(status)
        assert not SessionRegistry().exists("half"), "the session is gone before any segment"
        assert not any(n.endswith("+root") for n in shm_namespace.owned_segments())
        store = CacheStore("half", "c", capacity_bytes=CAP)  # the next job, before any gc
        assert len(store) == 0 and store.lookup(3) is MISSING
        assert store.put(3, value_for(3)) and store.lookup(3) == value_for(3)
        store.close()
    gc_json(capsys)
    store = CacheStore("half", "c")
    assert check_store(store, [3]) == []
    store.close()


def _files(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def _debris(ns) -> list[str]:
    """What a quiescent namespace holds beyond its live objects, right after `shmcache gc`: any
    segment that is not part of a cache's current generation, any file that is not a session's
    json or last_used, a cache's json, lock or use file (NOTE [cache use]), or the registry lock
    (no process is alive: no slot locks)."""
    reg = SessionRegistry(ns)
    want_segments, want_files = set(), {"registry.lock"}
    for info in reg.list():
        want_files.add(f"sessions/{info.name}/session.json")
        want_files.add(f"sessions/{info.name}/last_used")  # NOTE [session lifecycle], last use
        for name in reg.cache_names(info.name):
            want_files.add(f"sessions/{info.name}/caches/{name}.json")
            want_files.add(f"sessions/{info.name}/caches/{name}.open")
            try:  # a destroy() killed after unlinking the segments leaves the json: destroy again
                store = CacheStore(info.name, name, create=False, lock_timeout_s=5)
            except CacheNotFound:
                continue
            g = store.view.refresh()
            want_segments |= {store.view.segment_name("root"), store.view.segment_name(f"g{g.gen}", "meta"),
                              store.view.segment_name(f"g{g.gen}", f"t{g.version}")}
            want_segments |= {store.view.segment_name(f"g{g.gen}", f"c{c}") for c in g.classes.used_classes()}
            store.close()
    debris = sorted(set(ns.owned_segments()) - want_segments)
    debris += [f for f in _files(ns.root) if f not in want_files and not
               (f.startswith("sessions/") and "/caches/" in f and f.endswith(".lock"))]
    return debris


@pytest.mark.parametrize("cycles", [pytest.param(60, id="60"),
                                    pytest.param(1000, id="1000", marks=pytest.mark.slow)])
def test_create_attach_destroy_cycles_with_random_kills_stay_flat(cycles, tmp_path, capsys,
                                                                   shm_namespace):
    names = ["j0", "j1", "j2"]
    # per cache: root, meta, table (+ one growing), one segment per size class
    max_segments = len(names) * 2 * (4 + len(SIZES))
    max_files = 1 + len(names) * (2 + 2 * 3 + 8)  # + a few slot locks of killed processes
    rng = random.Random(cycles)
    killed = 0
    with Zygote(tmp_path / "z") as z:
        for i in range(cycles):
            kill = rng.uniform(0, 0.012) if rng.random() < 0.7 else None
            status, res = z.run("cycle", names, i, CAP, kill_after_s=kill)
            assert status in (0, -9), f"cycle {i}: {status_of(status)}: {res and res.get('exception')}"
            killed += status == -9
            segments, files = len(shm_namespace.owned_segments()), len(_files(shm_namespace.root))
            assert segments <= max_segments, f"cycle {i}: {segments} segments in /dev/shm"
            assert files <= max_files, f"cycle {i}: {files} files: {_files(shm_namespace.root)}"
            if i % 10 == 9:
                process_slot.release_all()
                gc_json(capsys)
                debris = _debris(shm_namespace)
                assert debris == [], f"cycle {i}: left behind after `shmcache gc`: {debris}"
    assert killed >= cycles // 4  # enough kills to mean something (timing decides how many land)
    # every surviving session is sound, and destroying them all leaves nothing at all
    gc_json(capsys)
    reg = SessionRegistry()
    for info in reg.list():
        for name in reg.cache_names(info.name):
            try:
                store = CacheStore(info.name, name, create=False, lock_timeout_s=5)
            except CacheNotFound:
                continue
            assert check_store(store, list(range(400))) == [], (info.name, name)
            store.close()
        process_slot.release_all()
        reg.destroy(info.name)
    gc_json(capsys)
    assert shm_namespace.owned_segments() == []
    assert _files(shm_namespace.root) == ["registry.lock"], \
        f"files left after destroying every session: {_files(shm_namespace.root)}"
    assert list((shm_namespace.root / "sessions").iterdir()) == [], \
        f"directories left: {list((shm_namespace.root / 'sessions').iterdir())}"


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


@pytest.mark.parametrize("what", ["label", "fingerprint", "meta", "put", "put_many"])
def test_a_write_overtaken_by_a_forced_destroy_and_a_new_cache_lands_nowhere(what, tmp_path, shm_namespace,
                                                                             monkeypatch):
    """Process A is inside a write of cache job/c, holding its lock (stopped there: SIGSTOP); B
    destroys the session with force and makes job/c again, then A goes on. A's metadata write
    went by name into the new session's directory: B's cache took A's label, fingerprint or
    spill folder. A's write must say the cache went away, and B's cache hold only B's values.
    (destroy --force waits 10 s for a busy cache lock before it goes on without it: shortened
    here to 0.2 s; the rest of the destroy is the real one.)"""
    from functools import partialmethod

    hold = SessionRegistry._hold_cache_locks
    monkeypatch.setattr(SessionRegistry, "_hold_cache_locks", partialmethod(hold, timeout_s=0.2))
    session, stopped = "job", tmp_path / "stopped"
    with Procs(tmp_path / "p") as procs:
        a = procs.start("write_across_a_reincarnation", session, "c", CAP, what, str(stopped))
        try:
            wait_for(lambda: stopped.exists() or a.poll() is not None, 60, "A to be inside its write")
            wait_for(lambda: a.poll() is not None or _state(a.pid) == "T", 10, "A to stop")
            assert a.poll() is None, procs.finish(a)
            SessionRegistry().destroy(session, force=True)
            b = CacheStore(session, "c", capacity_bytes=CAP, fingerprint="b" * 16)
            b.record_label("B's label")
            assert b.put(1, value_for(1))
        finally:
            os.kill(a.pid, signal.SIGCONT)
        status, res = procs.finish(a, 30)
    try:
        assert status == 0, res
        meta = b.read_meta()
        assert (meta.get("label"), meta.get("fingerprint"), meta.get("spill_path")) == \
            ("B's label", "b" * 16, None), meta
        assert all(b.lookup(k) is MISSING for k in (0, 7, 8, 9)) and len(b) == 1
        assert same_value(b.lookup(1), value_for(1))
        assert b.stats()["items_mem"] == 1
        mine = (b.view.segment_name("root"), b.view.segment_name(""))
        assert [n for n in shm_namespace.owned_segments() if not n.startswith(mine)] == []
        assert res.get("raised") in ("SessionNotFound", "CacheNotFound"), res
        assert "destroyed while" in res["message"], res
    finally:
        b.close()
