"""Claims (NOTE [claims]): processes that miss one key at once compute it once; a claim dies with
its holder (kill -9: the next waiter takes it at once); a stopped holder is waited for at most
claim_timeout_s; a forked DataLoader worker has claims of its own; the counters are summed over
processes in stats() and `shmcache stat --json`; nothing is left behind.

Every count is the source's own (an O_APPEND file, one byte per computation)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import time

import _claims
import numpy as np
import pytest
import torch
from test_multiprocess import _run  # start, collect one result each, reap

from shmcache import ShmDatasetCache
from shmcache.cache import claims as claims_mod
from shmcache.cache.store import CacheStore

PROBES = 4  # wrap() computes at most 4 samples to fingerprint a dataset (3 probes, one read twice)


def _race(
    tmp_path, nprocs: int, n: int, sleep_s: float, claims_on: bool, method: str = "spawn"
) -> tuple[int, list[dict]]:
    count_path = str(tmp_path / "computed")
    ctx = multiprocessing.get_context(method)
    results = _run(ctx, _claims.racer, lambda r: (r, n, count_path, sleep_s, claims_on), nprocs)
    return os.path.getsize(count_path), results


def _check_race(tmp_path, nprocs: int, n: int, sleep_s: float, method: str) -> None:
    computed, results = _race(tmp_path, nprocs, n, sleep_s, claims_on=True, method=method)
    assert sum(r["wrong"] for r in results) == 0
    assert computed <= n + PROBES * nprocs, f"{computed} computations of {n} keys by {nprocs} processes"
    # the counters, summed over the processes, from a fresh process: the library's and the CLI's
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    code = (
        "from shmcache.cache.store import CacheStore; import json; c = CacheStore('race', 'race', "
        "create=False); print(json.dumps(c.stats())); c.close()"
    )
    st = json.loads(
        subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60, check=True
        ).stdout
    )
    rows = json.loads(
        subprocess.run(
            [sys.executable, "-m", "shmcache", "stat", "race", "--json"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    )
    row = next(r for r in rows if r["name"] == "race")
    for got in (st, row):
        assert got["computed"] == computed  # every computation of the source, probes included
        assert got["claim_waits"] > 0  # the racers read in one order: they met on keys
        assert got["claim_timeouts"] == 0
        assert got["misses"] - got["claim_waits"] <= computed


def test_racing_processes_compute_each_key_once(tmp_path):
    """4 processes read the same 300 keys (2 ms each) in one order: each key computed once, plus
    wrap()'s probes; no wrong value, no hang. Forked here, to stay fast (a spawned process
    imports torch for 2 s): the slow test below spawns them, as separate jobs would be."""
    _check_race(tmp_path, 4, 300, 0.002, "fork")


@pytest.mark.slow
def test_eight_spawned_processes_race_over_1500_keys(tmp_path):
    _check_race(tmp_path, 8, 1500, 0.002, "spawn")


@pytest.mark.slow
def test_without_claims_racing_processes_compute_keys_again(tmp_path):
    """What the claims prevent (so the test above can fail): with SHMCACHE_CLAIMS=0 the same race
    computes keys more than once."""
    computed, results = _race(tmp_path, 4, 300, 0.002, claims_on=False)
    assert sum(r["wrong"] for r in results) == 0
    assert computed > 300 + PROBES * 4


BATCH_MODES = ("get_batch", "getitems", "loader", "warmup", "item")


def test_racing_batch_paths_compute_each_key_once(tmp_path):
    """5 processes read the same 300 keys (2 ms each) in one order, each by another path:
    get_batch, __getitems__, a DataLoader, warmup then ds[i], ds[i]. A batch's misses are claimed
    together (NOTE [claims]): each key computed once, plus wrap()'s probes; no wrong value."""
    n, nprocs = 300, len(BATCH_MODES)
    count_path = str(tmp_path / "computed")
    ctx = multiprocessing.get_context("fork")
    results = _run(ctx, _claims.batch_racer, lambda r: (r, n, count_path, 0.002, BATCH_MODES), nprocs)
    assert sum(r["wrong"] for r in results) == 0
    computed = os.path.getsize(count_path)
    assert computed <= n + PROBES * nprocs, f"{computed} computations of {n} keys by {nprocs} processes"
    store = CacheStore("race", "batch", create=False)
    try:
        st = store.stats()
    finally:
        store.close()
    assert st["computed"] == computed and st["claim_timeouts"] == 0 and st["claim_waits"] > 0


@pytest.mark.slow
def test_48_processes_over_3000_keys_compute_each_once(tmp_path):
    """The issue's largest race: 48 processes (forked: 48 spawned torch imports would take the
    2-core machine minutes) read the same 3,000 keys of a 2 ms source, every batch path and
    ds[i] mixed: each key computed once, plus wrap()'s probes; no wrong value, no hang."""
    n, nprocs = 3000, 48
    count_path = str(tmp_path / "computed")
    ctx = multiprocessing.get_context("fork")
    results = _run(ctx, _claims.batch_racer, lambda r: (r, n, count_path, 0.002, BATCH_MODES), nprocs,
                   timeout_s=600)
    assert sum(r["wrong"] for r in results) == 0
    computed = os.path.getsize(count_path)
    assert computed <= n + PROBES * nprocs, f"{computed} computations of {n} keys by {nprocs} processes"


_JOB = """
import os, sys
import numpy as np, torch
from torch.utils.data import DataLoader
sys.path.insert(0, {here!r})
import _claims
from shmcache import ShmDatasetCache
cache = ShmDatasetCache(session="race", name="jobs", size=64)
ds = cache.wrap(_claims.CountingSource({n}, {count!r}, 0.002))
torch.manual_seed(int(sys.argv[1]))
wrong = 0
loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)
seen = 0
for batch in loader:
    seen += len(batch)
assert seen == {n}, seen
for i in range(0, {n}, 37):
    wrong += not np.array_equal(ds[i], _claims.value_for(i))
cache.close()
print("wrong", wrong)
"""


def run_jobs(tmp_path, n: int, jobs: int) -> int:
    """``jobs`` independent jobs (separate processes, DataLoaders of 2 workers, each shuffled its
    own way) read ``n`` samples of one cold cache at once; the source's count of computations."""
    count_path = str(tmp_path / "computed")
    code = _JOB.format(here=os.path.dirname(__file__), n=n, count=count_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [subprocess.Popen([sys.executable, "-c", code, str(seed)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in range(1, jobs + 1)]
    try:
        outs = [proc.communicate(timeout=480) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (out, err) in zip(procs, outs):
        assert proc.returncode == 0, err
        assert out.split()[-2:] == ["wrong", "0"], out
    return os.path.getsize(count_path)


def test_two_jobs_cold_on_one_cache_compute_each_sample_about_once(tmp_path):
    """Two independent jobs cold on one cache at once: at most 1.02 computations per sample,
    plus wrap()'s probes."""
    n = 400
    computed = run_jobs(tmp_path, n, 2)
    assert computed <= 1.02 * n + PROBES * 2, f"{computed} computations of {n} samples by two jobs"


def _start_holder(ctx, tmp_path, key: int):
    count_path = str(tmp_path / "computed")
    started, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_claims.holder, args=(key, count_path, started, release, 60))
    holder.start()
    assert started.wait(60), f"the holder never computed (exit code {holder.exitcode})"
    return holder, release, count_path


def _start_waiter(ctx, key: int, count_path: str, claim_timeout_s: float):
    q, busy_seen = ctx.Queue(), ctx.Event()
    waiter = ctx.Process(target=_claims.waiter, args=(q, key, count_path, claim_timeout_s, busy_seen))
    waiter.start()
    return waiter, q, busy_seen


def _result(q, proc) -> dict:
    try:
        status, payload = q.get(timeout=90)
    finally:
        proc.join(timeout=30)
    assert status == "ok", payload
    return payload


def test_a_killed_holder_releases_its_claim_at_once(tmp_path):
    """kill -9 of a process computing a key under its claim: the kernel drops the claim, and the
    process waiting for it takes it and computes (well within its 60 s claim_timeout_s: a wait
    that ran out would count as a claim_timeout). The key is computed twice, no more."""
    ctx = multiprocessing.get_context("spawn")
    holder, release, count_path = _start_holder(ctx, tmp_path, 7)
    waiter, q, busy_seen = _start_waiter(ctx, 7, count_path, 60.0)
    try:
        assert busy_seen.wait(60), "the waiter never saw the claim held"
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)
        res = _result(q, waiter)
    finally:
        for p in (holder, waiter):
            if p.is_alive():
                p.kill()
            p.join()
    assert holder.exitcode == -signal.SIGKILL
    # computed counts finished computations: the holder died in its own
    assert res == {"right": True, "computed": 1, "claim_waits": 0, "claim_timeouts": 0}
    with open(count_path, "rb") as f:
        assert f.read() == b"hw"  # the holder began, the waiter computed after the kill


def test_a_stopped_holder_is_waited_for_at_most_claim_timeout(tmp_path):
    """SIGSTOP of a process computing a key under its claim: the waiter computes after its
    claim_timeout_s (counted as a claim timeout); the holder, continued, finishes: one value."""
    ctx = multiprocessing.get_context("spawn")
    holder, release, count_path = _start_holder(ctx, tmp_path, 9)
    os.kill(holder.pid, signal.SIGSTOP)
    waiter, q, busy_seen = _start_waiter(ctx, 9, count_path, 0.3)
    try:
        res = _result(q, waiter)
    finally:
        os.kill(holder.pid, signal.SIGCONT)
        release.set()
        holder.join(30)
        for p in (holder, waiter):
            if p.is_alive():
                p.kill()
            p.join()
    assert holder.exitcode == 0
    assert res == {"right": True, "computed": 1, "claim_waits": 0, "claim_timeouts": 1}
    store = CacheStore("race", "hold", create=False)
    try:
        assert np.array_equal(store.lookup(9), _claims.value_for(9))
        assert len(store) == 1
        st = store.stats()
        assert (st["computed"], st["claim_waits"], st["claim_timeouts"]) == (2, 0, 1)  # and the holder's
    finally:
        store.close()
    with open(count_path, "rb") as f:
        assert f.read() == b"hw"


def _batch_holder_and_waiter(ctx, tmp_path, claim_timeout_s: float):
    count_path = str(tmp_path / "computed")
    started, release = ctx.Event(), ctx.Event()
    holder = ctx.Process(target=_claims.batch_holder, args=(list(range(10, 20)), count_path, started, release, 60))
    holder.start()
    assert started.wait(60), f"the holder never computed (exit code {holder.exitcode})"
    q, busy_seen = ctx.Queue(), ctx.Event()
    waiter = ctx.Process(target=_claims.batch_waiter,
                         args=(q, list(range(15, 25)), list(range(15, 20)), count_path, claim_timeout_s, busy_seen))
    waiter.start()
    return holder, release, waiter, q, busy_seen, count_path


@pytest.mark.parametrize("how", ["kill", "stop"])
def test_a_batch_computes_its_own_claims_first_then_waits_for_a_dead_or_stopped_holder(tmp_path, how):
    """A batch of 10 misses, 5 of them claimed by another process's batch: the waiter computes
    its own 5 first (one call), then waits for the other 5. Holder killed (kill -9): the kernel
    drops its claims and the waiter takes and computes them at once (no timeout counted, within a
    60 s claim_timeout_s). Holder stopped (SIGSTOP): the waiter computes them after its
    claim_timeout_s, each counted as a timeout; the holder, continued, finishes."""
    ctx = multiprocessing.get_context("spawn")
    holder, release, waiter, q, busy_seen, count_path = _batch_holder_and_waiter(
        ctx, tmp_path, 60.0 if how == "kill" else 0.3)
    try:
        if how == "stop":
            os.kill(holder.pid, signal.SIGSTOP)
        if not busy_seen.wait(60):
            raise AssertionError(f"the waiter never saw the claims held: {q.get(timeout=5)}")
        if how == "kill":
            os.kill(holder.pid, signal.SIGKILL)
        res = _result(q, waiter)
    finally:
        if how == "stop":
            os.kill(holder.pid, signal.SIGCONT)
            release.set()  # (a killed holder may have died holding the event's lock)
        holder.join(30)
        for p in (holder, waiter):
            if p.is_alive():
                p.kill()
            p.join()
    assert res["right"]
    if how == "stop":
        assert res["calls"] == [list(range(20, 25)), list(range(15, 20))]
    else:  # the kill may land before the waiter's first round, which then takes all ten, or during
        # its takes (the holder's first keys refused, the rest taken): its own five come first
        # either way, and the holder's five once each, those refused in the second call
        first, *rest = res["calls"]
        assert set(range(20, 25)) <= set(first) and len(rest) <= 1, res["calls"]
        assert sorted(first + [k for call in rest for k in call]) == list(range(15, 25)), res["calls"]
        assert not rest or rest[0] == list(range(15, rest[0][-1] + 1)), res["calls"]
    assert (res["computed"], res["claim_waits"], res["claim_timeouts"]) == (10, 0, 0 if how == "kill" else 5)
    assert holder.exitcode == (-signal.SIGKILL if how == "kill" else 0)
    with open(count_path, "rb") as f:
        assert sorted(f.read()) == sorted(b"h" * 10 + b"w" * 10)


class _TriesTheClaim(torch.utils.data.Dataset):
    """Each item: what this process's claim on ``bucket`` of the cache gets (a DataLoader worker)."""

    def __init__(self, cache: ShmDatasetCache, bucket: int):
        self.cache, self.bucket = cache, bucket

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        claims = self.cache.store.claims
        claims._ready()
        got = claims.take(self.bucket)
        if got == claims_mod.TAKEN:
            claims.release(self.bucket)
        return got


def test_a_forked_worker_does_not_share_its_parents_claims():
    """The parent holds a claim; a forked DataLoader worker, which inherited the parent's claims
    file descriptor, must find that claim busy (a shared open file description would let it
    take the very same lock)."""
    cache = ShmDatasetCache(session="race", name="fork", size=16)
    claims = cache.store.claims
    try:
        claims._ready()
        assert claims.take(123) == claims_mod.TAKEN
        loader = torch.utils.data.DataLoader(
            _TriesTheClaim(cache, 123), batch_size=None, num_workers=1, multiprocessing_context="fork"
        )
        assert list(loader) == [claims_mod.BUSY]
        claims.release(123)
        assert list(loader) == [claims_mod.TAKEN]  # and free once the parent lets it go
    finally:
        cache.close()


def test_the_claims_file_goes_with_its_cache():
    cache = ShmDatasetCache(session="race", name="gone", size=16)
    assert cache.get(1, lambda k: k + 1) == 2
    path = cache.store.claims.path
    assert path.exists() and oct(path.stat().st_mode & 0o777) == "0o600"
    assert cache.stats()["computed"] == 1
    cache.store.destroy()
    assert not path.exists()
    cache.close()


def test_drop_and_gc_take_the_claims_file_too():
    from shmcache.cache.registry import SessionRegistry

    registry = SessionRegistry()
    for name in ("dropped", "stray"):
        cache = ShmDatasetCache(session="race", name=name, size=16)
        assert cache.get(1, lambda k: k + 1) == 2
        cache.close()
    dropped = registry.cache_claims_path("race", "dropped")
    stray = registry.cache_claims_path("race", "stray")
    assert dropped.exists() and stray.exists()
    registry.drop_cache("race", "dropped")
    assert not dropped.exists()
    # a cache whose metadata went (a destroy killed half-way): gc takes its claims file
    registry.cache_meta_path("race", "stray").unlink()
    opener = ShmDatasetCache(session="race", name="held", size=16)  # holds its use file
    assert opener.get(1, lambda k: k + 1) == 2
    held = registry.cache_claims_path("race", "held")
    registry.cache_meta_path("race", "held").rename(held.with_suffix(".json.away"))  # as while being made
    registry.gc()
    assert not stray.exists()
    # an opener still holds the cache's use file (it is being made): its claims file stays, or
    # the next opener would claim on a new inode, apart from the handles open now
    assert held.exists()
    held.with_suffix(".json.away").rename(registry.cache_meta_path("race", "held"))
    opener.close()


def test_computed_counts_every_path(tmp_path):
    """wrap()'s probes, warm-up, get_batch(fn=) and single misses: every computation is counted
    (before, a warm-up of the whole dataset showed none)."""
    count_path = str(tmp_path / "computed")
    cache = ShmDatasetCache(session="race", name="paths", size=16)
    try:
        ds = cache.wrap(_claims.CountingSource(40, count_path))
        assert cache.warmup(ds, progress=False) > 0
        cache.get_batch([1000, 1001], fn=_claims.value_for)
        assert np.array_equal(cache.get(1002, _claims.value_for), _claims.value_for(1002))
        assert cache.stats()["computed"] == os.path.getsize(count_path) + 3
    finally:
        cache.close()


def test_claim_timeout_and_switches(monkeypatch):
    from shmcache.errors import InvalidArgument

    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "soon")
    with pytest.raises(InvalidArgument, match="SHMCACHE_CLAIM_TIMEOUT_S"):
        CacheStore("race", "switch", capacity_bytes=4 << 20)
    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "2.5")
    store = CacheStore("race", "switch", capacity_bytes=4 << 20)
    assert store.claims.timeout_s == 2.5 and store.claims.on
    store.close()
    store = CacheStore("race", "switch", claim_timeout_s=0.5)
    assert store.claims.timeout_s == 0.5
    store.close()
    # without OFD locks (not Linux), or SHMCACHE_CLAIMS=0: misses compute without claims, counted
    monkeypatch.setattr(claims_mod, "SUPPORTED", False)
    store = CacheStore("race", "switch")
    assert not store.claims.on
    assert store.fill(5, lambda k: k * 2, store.put) == 10
    assert store.lookup(5) == 10 and store.stats()["computed"] == 1
    store.close()
    monkeypatch.setattr(claims_mod, "SUPPORTED", True)
    monkeypatch.setenv("SHMCACHE_CLAIMS", "0")
    store = CacheStore("race", "switch")
    assert not store.claims.on
    store.close()


def test_a_batch_releases_its_claims_in_one_call_and_never_a_claim_of_another_thread(monkeypatch):
    """A batch takes each key's claim (one fcntl each) but releases them with one unlock of the
    range they span, split only around a claim another thread of this process holds between
    them (a claim is a byte of the claims file; unlocking a byte nobody holds is a no-op)."""
    import fcntl

    cache = ShmDatasetCache(session="race", name="release", size=16)
    claims = cache.store.claims
    calls = []

    class Counting:  # the claims module's fcntl, counted
        def __getattr__(self, name):
            return getattr(fcntl, name)

        @staticmethod
        def fcntl(fd, cmd, arg):
            calls.append(cmd)
            return fcntl.fcntl(fd, cmd, arg)

    try:
        claims._ready()
        keys = list(range(1000, 1200))
        buckets = sorted({claims.bucket(k) for k in keys})
        between = next(b for b in range(buckets[0] + 1, buckets[-1]) if b not in buckets)
        monkeypatch.setattr(claims_mod, "fcntl", Counting())
        got = cache.store.fill_batch(keys, lambda ks: [k * 2 for k in ks],
                                     lambda pairs: [cache.store.put(k, v) for k, v in pairs])
        assert got == [k * 2 for k in keys]
        assert len(calls) == len(buckets) + 1, f"{len(buckets)} claims taken, {len(calls) - len(buckets)} unlocks"
        assert claims.held == frozenset()

        # another thread of ours holds a claim between the batch's: it stays held
        assert claims.take(between) == claims_mod.TAKEN
        calls.clear()
        keys = list(range(2000, 2200))
        cache.store.fill_batch(keys, lambda ks: [k * 2 for k in ks],
                               lambda pairs: [cache.store.put(k, v) for k, v in pairs])
        assert claims.held == frozenset({between})
        other = claims_mod.Claims(claims.path, lambda: 0)  # another open file description: another holder
        monkeypatch.undo()
        other._ready()
        assert other.take(between) == claims_mod.BUSY
        assert all(other.take(claims.bucket(k)) == claims_mod.TAKEN for k in keys[:20])
        other.close()
        claims.release(between)
    finally:
        cache.close()


def test_a_batchs_buckets_are_each_keys_bucket():
    """``Claims.buckets`` hashes a batch of int keys in one numpy pass: the same bucket as
    ``bucket`` for each, negative keys and keys past 63 bits (one at a time) included."""
    cache = ShmDatasetCache(session="race", name="buckets", size=16)
    claims = cache.store.claims
    try:
        for keys in ([0, 1, 2**16, -1, -2**63, 2**63 - 1, 12345678901], [5, 2**63, 7], [1, "a", b"b", 3],
                     []):
            assert claims.buckets(keys) == [claims.bucket(k) for k in keys], keys
    finally:
        cache.close()


def test_an_interrupt_before_a_batchs_lock_leaves_no_bucket_to_release_that_another_thread_then_takes(monkeypatch):
    """A signal's handler runs at a call: one that raises (Ctrl-C) as ``take_many`` packs the lock
    of a bucket it has put in ``held`` but not locked yet leaves the thread lock at once; another
    thread of ours may take that bucket before the batch's ``finally`` releases ``held``, and that
    release must not unlock the other thread's claim (another process would compute its key too)."""
    import threading

    cache = ShmDatasetCache(session="race", name="intrheld", size=16)
    claims = cache.store.claims
    other = None
    try:
        claims._ready()
        bucket = claims.bucket(4242)
        real = claims_mod._FLOCK

        class Interrupted:  # the lock's argument packed: the call at which the handler runs (once)
            landed = False

            @classmethod
            def pack(cls, *args):
                if not cls.landed:
                    cls.landed = True
                    raise KeyboardInterrupt
                return real.pack(*args)

        monkeypatch.setattr(claims_mod, "_FLOCK", Interrupted)
        held: list[int] = []
        with pytest.raises(KeyboardInterrupt):
            claims.take_many([bucket], [0], held)
        monkeypatch.setattr(claims_mod, "_FLOCK", real)
        got = []
        taker = threading.Thread(target=lambda: got.append(claims.take(bucket)))  # before the finally below
        taker.start()
        taker.join()
        assert got == [claims_mod.TAKEN]
        claims_mod._release_all(claims, held)  # fill_batch's finally
        assert bucket in claims.held, "the other thread's claim was dropped from its account"
        other = claims_mod.Claims(claims.path, lambda: 0)  # another open file description: another process
        other._ready()
        assert other.take(bucket) == claims_mod.BUSY, "the other thread's claim was unlocked"
        claims.release(bucket)
    finally:
        if other is not None:
            other.close()
        cache.close()


def test_a_holder_a_wait_timed_out_on_is_not_waited_for_again_until_it_lets_go(tmp_path):
    """NOTE [claims], who waits: a wait that timed out marks its bucket's holder (by the owner
    word it wrote) stuck, so a miss of another bucket it holds computes at once; once that holder
    lets go of the bucket the wait timed out on, its buckets are waited for again - not when this
    process takes a bucket it let go of before (owner words keep naming their last holder)."""
    path = tmp_path / "one.claims"
    waiter = claims_mod.Claims(path, lambda: 3, timeout_s=0.2)  # two open file descriptions:
    holder = claims_mod.Claims(path, lambda: 5, timeout_s=0.2)  # two holders, as two processes
    try:
        assert waiter.usable() and holder.usable()
        first, second, third = 11, 22, 33
        assert [holder.take(b) for b in (first, second, third)] == [claims_mod.TAKEN] * 3
        assert waiter.take(first) == claims_mod.BUSY and not waiter.stuck(first)
        start = time.monotonic()
        assert waiter.wait(first, lambda: None, None)[0] == claims_mod.TIMED_OUT
        assert time.monotonic() - start >= 0.2
        waiter.timed_out([first])
        assert waiter.stuck(second) and waiter.stuck(third)  # the same holder's other buckets
        holder.release(second)
        assert waiter.take(second) == claims_mod.TAKEN  # a bucket it let go of: still stuck
        waiter.release(second)
        assert waiter.stuck(third) and waiter.stuck(first)
        holder.release(first)  # the bucket the wait timed out on: it went on
        assert not waiter.stuck(third) and not waiter.stuck(first)
    finally:
        waiter.close()
        holder.close()



_MAKER = """
import os, signal, sys
from pathlib import Path
from shmcache.cache import claims

hits = 0

def breakpoints(frame, event, arg):  # a debugger's breakpoints around open_owned's ftruncate
    global hits
    if event in ("c_call", "c_return") and arg is os.ftruncate and frame.f_code.co_name == "open_owned":
        hits += 1
        Path({marks!r}, str(hits)).touch()
        os.kill(os.getpid(), signal.SIGSTOP)

sys.setprofile(breakpoints)
c = claims.Claims({path!r}, lambda: 1)
c.usable()
sys.setprofile(None)
c.close()
"""

_MAPPER = """
import sys
from shmcache.cache import claims

c = claims.Claims({path!r}, lambda: 2)
assert c.usable() and c.take(7) == claims.TAKEN  # the owner words mapped and written
c.release(7)
print("mapped", flush=True)
sys.stdin.readline()
assert c.take(8) == claims.TAKEN
c.release(8)
c.close()
"""


def _at_breakpoint(proc: subprocess.Popen, mark) -> bool:
    """Wait until ``proc`` made ``mark`` and stopped (True), or exited without making it (False)."""
    deadline = time.monotonic() + 60
    while True:
        if mark.exists():
            with open(f"/proc/{proc.pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "T":
                    return True
        elif proc.poll() is not None:
            assert proc.returncode == 0, proc.communicate()[1][-2000:]
            return False
        assert time.monotonic() < deadline, f"the maker never reached breakpoint {mark.name}"
        time.sleep(0.01)


def test_a_process_making_the_claims_file_never_shrinks_it_under_another_processs_owner_words(tmp_path):
    """Review, fixed: the claims file has two sizes now: open_owned grows a short file to its rows (32 KiB,
    "two makers at once truncate to one size: harmless"), then _owner_words grows it past the
    owner words. A process that found the file empty (fstat) and truncates it to the rows' size
    after another process grew it and mapped its owner words (two processes starting cold on a
    new cache at once, one descheduled between fstat and ftruncate: here a debugger's breakpoint)
    shrinks the file under that mapping; the other process's next claim writes its owner word
    past the end of the file: SIGBUS, the process dies (every process that mapped the words, until
    the shrinker grows the file again). Growing must never shrink the file."""
    path = str(tmp_path / "new.claims")
    marks = tmp_path / "breakpoints"
    marks.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    maker = subprocess.Popen([sys.executable, "-c", _MAKER.format(path=path, marks=str(marks))], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    mapper = None
    try:
        stopped = _at_breakpoint(maker, marks / "1")  # it found the file empty: about to truncate it
        mapper = subprocess.Popen([sys.executable, "-c", _MAPPER.format(path=path)], env=env,
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert mapper.stdout.readline() == "mapped\n", mapper.communicate(timeout=60)[1][-2000:]
        if stopped:
            maker.send_signal(signal.SIGCONT)
            _at_breakpoint(maker, marks / "2")  # truncated: stopped before it grows the file again
        out, err = mapper.communicate("go\n", timeout=60)
        assert mapper.returncode == 0, (
            f"a process that had mapped the claims file's owner words died ({mapper.returncode}: "
            f"{signal.Signals(-mapper.returncode).name if mapper.returncode < 0 else err[-2000:]}) on its "
            f"next claim: another process making the file at once truncated it to {os.path.getsize(path)} bytes")
    finally:
        for proc in (maker, mapper):
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
            if proc is not None:
                proc.communicate(timeout=30)


_FULL_MOUNT = r"""
import errno, os, sys
from shmcache.cache import claims

mount = sys.argv[1]
c = claims.Claims(os.path.join(mount, "cache.claims"), lambda: 1)
assert c.usable() and c.take(7) == claims.TAKEN  # the file made, its rows and owner words mapped
c.release(7)
fd = os.open(os.path.join(mount, "filler"), os.O_WRONLY | os.O_CREAT)  # something else fills the mount
try:
    while True:
        os.write(fd, b"\0" * 4096)
except OSError as exc:
    assert exc.errno == errno.ENOSPC, exc
os.close(fd)
far = (8 * 4096) // 2  # a bucket whose owner word is on a page of the file nobody wrote yet
print("taken" if c.take(far) == claims.TAKEN else "busy", flush=True)
c.release(far)
c.close()
"""


def test_a_claim_on_a_full_mount_is_a_claim_not_a_crash(tmp_path, private_mounts):
    """Review, fixed: the owner words are 128 KiB of the claims file grown with ftruncate (a hole) and
    mapped; a claim writes its bucket's word, and the first write to a page of the hole needs a
    page of the file system. The claims file lives in the session's private directory (by default
    $XDG_RUNTIME_DIR/shmcache or /tmp/shmcache-<uid>: often a tmpfs, small and shared); once
    something else filled it, the first claim of a bucket on one of the 32 pages nobody wrote yet
    - at any point of a run - kills the process with SIGBUS (shm.py: the reason segments are
    posix_fallocate'd before anything touches them). The claim should go on (or claims turn off)
    with the mount full; the counter rows at the start of the file are a hole too."""
    mount = tmp_path / "private"
    mount.mkdir()
    script = tmp_path / "full.py"
    script.write_text(_FULL_MOUNT)
    proc = private_mounts(f"mount -t tmpfs -o size=1m tmpfs {mount} || exit 99; {sys.executable} {script} {mount}",
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "taken", (
        f"a claim with the claims file's mount full ended with {proc.returncode} "
        f"({signal.Signals(-proc.returncode).name if proc.returncode < 0 else ''}"
        f"{'SIGBUS' if proc.returncode == 128 + signal.SIGBUS else ''}): {proc.stderr[-2000:]}")
