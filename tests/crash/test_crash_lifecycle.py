"""A cache's lifecycle when its processes misbehave: a writer stopped (SIGSTOP) while it holds
the cache lock, and a creation that fails half-way."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
from _procs_util import Procs, Zygote, status_of, wait_for
from _worker import stuck_lock_items

from shmcache import ShmDatasetCache

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
            stuck = [line for line in res["logs"] if str(lock) in line and "fuser" in line]
            assert len(stuck) == 1, res["logs"]
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
