"""A cache's lifecycle when its processes misbehave: a writer stopped (SIGSTOP) while it holds
the cache lock, and a creation that fails half-way."""

from __future__ import annotations

import json
import os
import signal
import time

import numpy as np
import pytest
from _procs_util import Procs, Zygote, status_of, wait_for
from _worker import stuck_lock_items

from shmcache import ShmDatasetCache, cli
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import MISSING, CacheStore

S, C, N = "stuck", "c", 20


def _state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_writer_stopped_holding_the_lock_blocks_neither_opening_nor_serving(tmp_path, shm_namespace):
    """Before: opening the cache waited 60 s for the lock in CacheStore.__init__, and get(miss, fn)
    raised LockTimeout after computing the value. Now readers and re-attaching processes open
    without the lock, and a miss whose write cannot get the lock is served uncached (counted as
    rejected), waiting once per stuck condition, with one log line naming the lock and `fuser`."""
    cache = ShmDatasetCache(session=S, name=C, size=16)
    ds = cache.wrap(stuck_lock_items(N))
    assert all(np.array_equal(ds[k], v) for k, v in enumerate(stuck_lock_items(N)))
    cache.close()
    lock = shm_namespace.sessions_dir / S / "caches" / f"{C}.lock"
    held = tmp_path / "held"
    with Zygote(tmp_path / "z") as z, Procs(tmp_path / "p") as procs:
        holder, _ = z.spawn("hold_cache_lock", S, C, 16 << 20, str(held))
        try:
            wait_for(held.exists, 30, "the lock holder")
            z.kill(holder, signal.SIGSTOP)
            wait_for(lambda: _state(holder) == "T", 10, "the holder to stop")
            t0 = time.monotonic()
            status, res = procs.finish(procs.start("read_under_a_stopped_writer", S, C, N, 2.0), 110)
            assert status == 0, (status_of(status), res)
            assert res["open_s"] < 5, f"opening waited {res['open_s']:.1f}s for the stopped writer's lock"
            assert res["hits_ok"] and res["ds_hits_ok"], res
            assert res["hits_s"] < 5 and res["wrap_s"] < 5, res
            assert all(res["values_ok"]), res
            # the first write that cannot get the lock waits its timeout (2 s); later ones do not
            assert max(res["miss_s"]) < 3 and sorted(res["miss_s"])[1] < 0.5, res["miss_s"]
            assert res["rejected"] >= 4 and not any(res["cached"]), res
            named = [line for line in res["logs"] if str(lock) in line and "fuser" in line]
            # one line when the writes give up on the lock; before it, at most one while the first
            # write waits (past _SAY_WAIT_S: a wait longer than any write is said while it lasts)
            stuck = [line for line in named if "stop waiting" in line]
            assert len(stuck) == 1 and len(named) <= 2, res["logs"]
            assert time.monotonic() - t0 < 60
        finally:
            os.kill(holder, signal.SIGCONT)
            z.kill(holder)
            z.wait(holder, 10)
    # the lock is free again: a writer gets it at once and stores
    cache = ShmDatasetCache(session=S, name=C, lock_timeout_s=5)
    assert cache.put(10**6, np.zeros(100, np.int16))
    assert 10**6 in cache
    cache.close()


def _stat_rows(capsys) -> list[dict]:
    capsys.readouterr()
    assert cli.main(["stat", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("ok_calls,fails_at", [(0, "root"), (1, "meta"), (2, "table")])
def test_a_creation_that_fails_leaves_no_cache_behind(ok_calls, fails_at, tmp_path, capsys, shm_namespace):
    """Before: the cache's json (written first) stayed, and `shmcache stat` showed an error row for
    it forever (or a cache that nobody made, once stat repaired the half-made root). Now the
    creator removes what it made on its error path: no json, no segment, no row."""
    SessionRegistry().create(S)
    with Zygote(tmp_path / "z") as z:
        status, res = z.run("create_without_room", S, C, 16 << 20, ok_calls)
    assert status == 0 and res["type"] == "SharedMemoryFull", (fails_at, res)
    assert _stat_rows(capsys) == [], f"a creation that failed at its {fails_at} left a cache behind"
    assert SessionRegistry().cache_names(S) == []
    assert [n for n in shm_namespace.owned_segments() if f"+{S}+{C}+" in n] == []
    store = CacheStore(S, C, capacity_bytes=16 << 20)  # and the cache can be made afterwards
    assert store.put(1, b"one") and store.lookup(1) == b"one"
    store.close()


def test_gc_removes_the_json_of_a_creator_killed_before_its_root(tmp_path, capsys, shm_namespace):
    """The creator wrote the json and was SIGKILLed before it made the root: `shmcache stat` shows
    an error row for it, and `shmcache gc` - which takes the cache's lock, so no live creator is
    racing it - removes the json: no row afterwards."""
    SessionRegistry().create(S)
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_creating", S, C, 16 << 20, "+root", "open")
    assert status == -9, status_of(status)
    assert [r["name"] for r in _stat_rows(capsys) if "error" in r] == [C]
    capsys.readouterr()
    assert cli.main(["gc", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["removed_caches"] == [f"{S}/{C}"]
    assert _stat_rows(capsys) == [], "`shmcache gc` left the json of a cache that was never made"
    assert SessionRegistry().cache_names(S) == []


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_gc_leaves_a_cache_being_created_alone(tmp_path, capsys, shm_namespace):
    """A creator that holds the cache lock between its json and its root (alive, just slow): gc
    must not take its json away."""
    started, go = tmp_path / "started", tmp_path / "go"
    SessionRegistry().create(S)
    with Zygote(tmp_path / "z") as z:
        creator, out = z.spawn("slow_creator", S, C, 16 << 20, "+root", str(started), str(go), 1)
        wait_for(started.exists, 30, "the creator to be half-way")
        capsys.readouterr()
        assert cli.main(["gc"]) == 0
        assert SessionRegistry().cache_names(S) == [C], "gc removed the json of a live creator"
        go.touch()
        assert z.wait(creator, 30) == 0, json.loads(out.read_text())
    store = CacheStore(S, C, create=False)
    assert store.lookup(1) is not MISSING
    store.close()


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_gc_skips_a_cache_whose_lock_a_stopped_writer_holds_and_does_the_rest(tmp_path, capsys,
                                                                            shm_namespace):
    """`shmcache gc` with one cache's lock held by a stopped writer: it waited for that lock and
    then failed as a whole (LockTimeout, exit 1), leaving the other caches unrepaired. It must
    skip that cache, say so, and do the rest."""
    from shmcache.cache.generation import MetaLayout

    CacheStore("a-stuck", C, capacity_bytes=16 << 20).close()
    ok = CacheStore("b-ok", C, capacity_bytes=16 << 20)
    assert ok.put(1, b"one")
    import struct

    struct.pack_into("Q", ok.view.refresh().meta.buf, MetaLayout.ITEMS_MEM, 7)  # counters gc must recount
    ok.close()
    held = tmp_path / "held"
    with Zygote(tmp_path / "z") as z:
        holder, _ = z.spawn("hold_cache_lock", "a-stuck", C, 16 << 20, str(held))
        wait_for(held.exists, 30, "the writer to hold the lock")
        os.kill(holder, signal.SIGSTOP)
        try:
            capsys.readouterr()
            rc = cli.main(["gc", "--json"])
            out = capsys.readouterr()
        finally:
            os.kill(holder, signal.SIGCONT)
            z.kill(holder)
            z.wait(holder, 10)
    assert rc == 0, out.err
    result = json.loads(out.out)
    assert [r["cache"] for r in result["recounted_caches"]] == ["b-ok/c"], result
    assert [r["cache"] for r in result["skipped_caches"]] == ["a-stuck/c"], result
    assert "lock" in result["skipped_caches"][0]["reason"]
    store = CacheStore("b-ok", C, create=False)
    assert len(store) == 1
    store.close()
