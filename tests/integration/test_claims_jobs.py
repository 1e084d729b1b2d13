"""Claims (NOTE [claims]) at the issue's scale, slow: a sweep of four jobs on one cache, and racers
killed (kill -9) again and again while they hold a batch's claims. Every count is the source's
own (an O_APPEND file, one byte per computation: tests/integration/_claims.py)."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time

import _claims
import numpy as np
import pytest
import test_claims

from shmcache.cache.store import CacheStore

PROBES = test_claims.PROBES


@pytest.mark.slow
def test_a_sweep_of_four_jobs_computes_about_what_one_job_does(tmp_path):
    """Four independent jobs (DataLoaders of 2 workers, each shuffled its own way) cold on one
    cache at once: the node's computations at most 1.05x one job's (n), plus each job's probes."""
    n = 400
    computed = test_claims.run_jobs(tmp_path, n, 4)
    assert computed <= 1.05 * n + PROBES * 4, f"{computed} computations of {n} samples by four jobs"


def _racer(n: int, count_path: str, done) -> None:
    """Read every key by get_batch in batches of 16, one order; exit 0 when all were right."""
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="race", name="kills", size=64)  # claim timeout: the test's env
    ds = cache.wrap(_claims.CountingSource(n, count_path, 0.002))
    for lo in range(0, n, 16):
        keys = list(range(lo, min(n, lo + 16)))
        batch = ds.get_batch(keys).numpy()
        if not np.array_equal(batch, np.stack([_claims.value_for(i) for i in keys])):
            os._exit(3)
    cache.close()
    done.put(os.getpid())


@pytest.mark.slow
def test_racers_killed_ten_times_while_holding_claims_cost_only_their_batches(tmp_path, monkeypatch):
    """Three racers over 1,500 keys (2 ms each, batches of 16); ten times a random one is killed
    (kill -9, mid-batch as likely as not) and a fresh one started. Computations at most the keys,
    plus every started process's probes, plus a batch (16) per kill - the keys in flight; no
    waiter ever waits out its claim timeout (60 s: a dead holder's claims go at once)."""
    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "60")
    n, kills = 1500, 10
    count_path = str(tmp_path / "computed")
    ctx = multiprocessing.get_context("fork")
    done = ctx.Queue()
    rng = random.Random(5)
    procs = [ctx.Process(target=_racer, args=(n, count_path, done)) for _ in range(3)]
    started = len(procs)
    for p in procs:
        p.start()
    killed = 0
    try:
        for _ in range(kills):
            time.sleep(rng.uniform(0.05, 0.3))
            alive = [p for p in procs if p.is_alive()]
            if not alive:
                break
            killed += 1
            victim = rng.choice(alive)
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(30)
            procs.remove(victim)
            fresh = ctx.Process(target=_racer, args=(n, count_path, done))
            fresh.start()
            procs.append(fresh)
            started += 1
        for p in procs:
            p.join(240)
            assert p.exitcode == 0, f"a racer ended with {p.exitcode}"
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert killed == kills, f"the racers finished after {killed} kills: the test killed too late"
    computed = os.path.getsize(count_path)
    assert computed <= n + PROBES * started + 16 * kills, f"{computed} computations, {started} racers"
    store = CacheStore("race", "kills", create=False)
    try:
        st = store.stats()
    finally:
        store.close()
    assert st["claim_timeouts"] == 0
