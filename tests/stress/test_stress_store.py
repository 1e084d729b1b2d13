"""N processes x M random get/put on overlapping keys, then an invariant check (RELIABILITY.md 10).

In the manner of diskcache's stress scripts: every worker starts at one barrier, verifies every
value it reads against the source, and the test ends with ``check_store`` - totals exact, each key
stored once, every chunk referenced exactly once - and a ``collect_garbage()`` that finds nothing
to repair. The chaos variant SIGKILLs workers at random moments (not only at the named crash
points) and still expects an exact cache after ``shmcache gc``. Long variants are marked slow.
"""

from __future__ import annotations

import json
import random
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crash"))

from _procs_util import Zygote, release_barrier, status_of  # noqa: E402
from _shmcheck import check_store  # noqa: E402

from shmcache import cli  # noqa: E402
from shmcache.cache import process_slot
from shmcache.cache.store import CacheStore  # noqa: E402

S, C = "stress", "c"
CAP = 512 << 20


@pytest.fixture(autouse=True)
def _own_slots():
    yield
    process_slot.release_all()


def _keys(n_int: int, n_str: int) -> list:
    return list(range(n_int)) + [f"k{i}" for i in range(n_str)]


def _run_stress(tmp_path, n_procs, n_ops, keys, clear_every=0):
    CacheStore(S, C, capacity_bytes=CAP).close()
    bar = tmp_path / "barrier"
    bar.mkdir()
    with Zygote(tmp_path / "z") as z:
        kids = [z.spawn("stress", S, C, CAP, seed, n_ops, keys, str(bar), clear_every)
                for seed in range(n_procs)]
        release_barrier(bar, n_procs)
        results = []
        for pid, out in kids:
            status = z.wait(pid, 110)
            res = json.loads(out.read_text())
            assert status == 0, f"{status_of(status)}: {res.get('traceback')}"
            results.append(res)
    return results


@pytest.mark.parametrize("n_procs,n_ops,n_int,n_str", [
    pytest.param(4, 15_000, 1500, 300, id="4x15000"),
    pytest.param(4, 40_000, 10_000, 2000, id="4x40000", marks=pytest.mark.slow),
])
def test_processes_get_and_put_overlapping_keys(n_procs, n_ops, n_int, n_str, tmp_path):
    keys = _keys(n_int, n_str)  # enough distinct keys to grow the table twice
    results = _run_stress(tmp_path, n_procs, n_ops, keys)
    for res in results:
        assert res["errors"] == [], res["errors"]
        assert res["bad"] == [], f"a worker read a value that is not its source's: {res['bad']}"
        assert res["rejected"] == 0
    assert sum(r["hits"] for r in results) > 0
    store = CacheStore(S, C, create=False)
    assert check_store(store, keys) == []
    g = store.view.refresh()
    assert g.version >= 2, "the test is meant to cover table growth under concurrency"
    assert len(g.classes.used_classes()) >= 5, "the test is meant to cover several size classes"
    assert store.collect_garbage() == (0, [])
    st = store.stats()
    assert st["hits"] == sum(r["hits"] for r in results)
    assert st["misses"] == sum(r["misses"] for r in results)


@pytest.mark.slow
def test_processes_get_put_and_clear(tmp_path):
    """Clears in the mix: readers of an old generation keep reading consistent values."""
    keys = _keys(800, 100)
    results = _run_stress(tmp_path, 4, 20_000, keys, clear_every=997)
    for res in results:
        assert res["errors"] == [], res["errors"]
        assert res["bad"] == [], res["bad"]
    store = CacheStore(S, C, create=False)
    assert check_store(store, keys) == []
    assert store.collect_garbage() == (0, [])


@pytest.mark.parametrize("seconds", [pytest.param(2.5, id="2.5s"),
                                     pytest.param(60.0, id="60s", marks=pytest.mark.slow)])
def test_random_sigkills_during_get_put(seconds, tmp_path, capsys):
    """Four workers doing get/put; every 20-150 ms one of them is SIGKILLed, wherever it is, and
    replaced. After gc the cache is exact and no worker ever read a wrong value."""
    keys = _keys(1200, 200)
    CacheStore(S, C, capacity_bytes=CAP).close()
    log = tmp_path / "problems.log"
    rng = random.Random(11)
    kills = 0
    with Zygote(tmp_path / "z") as z:
        workers = [z.spawn("chaos", S, C, CAP, seed, keys, str(log))[0] for seed in range(4)]
        end = time.monotonic() + seconds
        seed = 4
        while time.monotonic() < end:
            time.sleep(rng.uniform(0.02, 0.15))
            i = rng.randrange(len(workers))
            z.kill(workers[i])
            assert z.wait(workers[i], 10) == -9
            kills += 1
            workers[i] = z.spawn("chaos", S, C, CAP, seed, keys, str(log))[0]
            seed += 1
        for pid in workers:
            z.kill(pid)
            z.wait(pid, 10)
    problems = log.read_text() if log.exists() else ""
    assert problems == "", f"workers read wrong values or got exceptions:\n{problems[:3000]}"
    assert kills > 10
    capsys.readouterr()
    assert cli.main(["gc"]) == 0
    store = CacheStore(S, C, create=False)
    assert check_store(store, keys) == []
    assert store.stats()["items_mem"] > 100


def test_repeated_clear_does_not_grow_the_empty_cache():
    """A job that clears its cache every epoch: the empty cache must not get bigger each time
    (the index table of a new generation is sized for what the cache holds, not doubled)."""
    store = CacheStore(S, C, capacity_bytes=64 << 20)
    st = store.stats()
    first = (store.view.refresh().index.capacity, st["committed_bytes"], st["shm_bytes"])
    for k in range(100):
        assert store.put(k, k)
    for epoch in range(24):
        store.clear()
        st = store.stats()
        now = (store.view.refresh().index.capacity, st["committed_bytes"], st["shm_bytes"])
        assert now == first, (f"clear() number {epoch + 1} left an empty cache of (table slots, "
                              f"committed bytes, shm bytes) {now}; a new cache is {first}")
        for k in range(100):
            assert store.put(k, k), f"epoch {epoch}: the cache no longer admits small items"


@pytest.mark.slow
def test_lock_free_readers_during_clear_and_growth(tmp_path):
    """Readers hammer lookups while a writer fills, grows and clears the cache over and over: a
    reader gets the right value or a miss, never an exception (the deterministic version of the
    race is in tests/crash/test_crash_generations.py)."""
    keys = _keys(1500, 0)
    CacheStore(S, C, capacity_bytes=CAP).close()
    stop = tmp_path / "stop"
    with Zygote(tmp_path / "z") as z:
        readers = [z.spawn("reader", S, C, CAP, keys, str(stop), str(tmp_path / f"r{i}"))
                   for i in range(2)]
        end = time.monotonic() + 30
        while time.monotonic() < end:
            for op, args in (("put", (keys[:800], CAP)), ("clear", (CAP,))):  # put grows the table
                status, res = z.run(op, S, C, *args)
                assert status == 0, f"the writer's {op} failed: {res and res.get('exception')}"
        stop.touch()
        reports = []
        for pid, out in readers:
            assert z.wait(pid, 30) == 0
            reports.append(json.loads(out.read_text()))
    for r in reports:
        assert r["bad"] == [], r["bad"]
        assert r["errors"] == [], f"{r['n_errors']} lookups raised: {r['errors'][:3]}"
