"""Regressions for what the code review found: each test failed (or crashed, or hung) before its fix."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from shmcache import ShmDatasetCache
from shmcache.base.shm import Segment
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import InvalidArgument, SessionInUse, SharedMemoryFull


def test_a_reader_thread_survives_clears_and_table_growth_elsewhere(tmp_path):
    """A thread inside get_batch/stats while the generation or the table changes used to touch
    unmapped memory (SIGSEGV). Run in a child so that a crash is a failed test, not a dead run."""
    script = textwrap.dedent("""
        import threading, time, subprocess, sys
        import numpy as np
        from shmcache import ShmDatasetCache
        cache = ShmDatasetCache(session="thr", name="c", size=64)
        for i in range(2000):
            cache.put(i, (np.full(64, i % 200, np.uint8), i))
        stop = time.monotonic() + 4
        errors = []
        def reader():
            while time.monotonic() < stop:
                try:
                    b = cache.get_batch(list(range(0, 256)), fn=lambda k: (np.full(64, k % 200, np.uint8), k))
                    assert int(b[0][7, 0]) == 7 and int(b[1][9]) == 9
                    cache.stats()
                except Exception as exc:
                    errors.append(repr(exc))
        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        other = ShmDatasetCache(session="thr", name="c")
        n = 0
        while time.monotonic() < stop:
            other.clear()  # a new generation under the readers' feet
            for i in range(3000):  # and table growth
                other.put(f"k{n}-{i}", i)
            n += 1
        for t in threads:
            t.join()
        print("errors", errors[:3], "clears", n)
        sys.exit(1 if errors else 0)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])


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


def test_get_batch_into_tensors_of_another_dtype_converts():
    with ShmDatasetCache(session="rr", name="dt") as cache:
        for k in range(4):
            cache.put(k, (torch.full((3,), 100 + k, dtype=torch.int32), k))
        out = [torch.zeros((4, 3), dtype=torch.float32), torch.zeros(4, dtype=torch.int64)]
        got = cache.get_batch([0, 1, 2, 3], out=out)
        assert got is out
        assert out[0][:, 0].tolist() == [100.0, 101.0, 102.0, 103.0]


def test_get_batch_into_bfloat16_tensors_and_cuda_out_refused():
    with ShmDatasetCache(session="rr", name="bf") as cache:
        vals = [torch.randn(5).to(torch.bfloat16) for _ in range(3)]
        for k, v in enumerate(vals):
            cache.put(k, v)
        out = torch.empty((3, 5), dtype=torch.bfloat16)
        assert torch.equal(cache.get_batch([0, 1, 2], out=out), torch.stack(vals))
        meta = torch.empty((3, 5), dtype=torch.bfloat16, device="meta")
        with pytest.raises(InvalidArgument, match="CPU memory"):
            cache.get_batch([0, 1, 2], out=meta)


def test_a_full_cache_computes_each_miss_once():
    calls = []

    def fn(k):
        calls.append(k)
        return np.full(300_000, k % 250, np.uint8)  # 300 KB: a 1 MB cache holds none of them

    with ShmDatasetCache(session="rr", name="full", size=1) as cache:
        batch = cache.get_batch([1, 2, 3], fn=fn)
        assert sorted(calls) == [1, 2, 3]
        assert batch[:, 0].tolist() == [1, 2, 3]
        st = cache.stats()
        assert st["misses"] == 3 and st["hits"] == 0
        assert st["rejected"] == 3 - st["items_mem"] > 0


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


def test_a_process_that_only_writes_counts_as_attached():
    script = ("import sys, numpy as np\nfrom shmcache.cache.store import MISSING, CacheStore\n"
              "s = CacheStore('w', 'c', capacity_bytes=8 << 20)\ns.put(1, np.zeros(3))\n"
              "print('ready', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert p.pid in SessionRegistry().live_pids("w")
        with pytest.raises(SessionInUse, match="in use"):
            SessionRegistry().destroy("w")
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        p.stdout.close()


def test_one_shot_iterators_are_refused():
    with ShmDatasetCache(session="rr") as cache:
        with pytest.raises(InvalidArgument, match="one-shot iterator"):
            cache.wrap(iter([1, 2, 3]))
