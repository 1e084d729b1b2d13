"""A cache's lifecycle seen from a process that keeps using it: ``shmcache destroy --force`` under a
live reader (real CLI process), the session and cache made again (another process) with other
values under the same keys. The old handle must see misses or ``CacheNotFound``, never old bytes
(README: "their reads miss, and what they compute is served uncached"). And reader threads while
another handle clears the cache and grows its table: never a crash."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from shmcache import ShmDatasetCache
from shmcache.errors import CacheNotFound

N = 64


def _old(k: int) -> np.ndarray:
    return np.full(256, k, np.int32)


def _new(k: int) -> np.ndarray:
    return np.full(256, 100_000 + k, np.int32)


def _cli(*args: str) -> None:
    r = subprocess.run([sys.executable, "-m", "shmcache", *args], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, (args, r.stdout, r.stderr)


def test_a_reader_never_sees_the_values_of_a_destroyed_cache(tmp_path):
    cache = ShmDatasetCache(session="s", name="c", size=16)
    for k in range(N):
        assert cache.put(k, _old(k))
    keys = list(range(N))
    # every read path is warm: the old handle maps the old segments (table, meta, data)
    assert int(cache[3][0]) == 3 and int(cache.get(5)[0]) == 5
    assert torch.equal(cache.get_batch(keys), torch.stack([torch.from_numpy(_old(k)) for k in keys]))
    assert 7 in cache and len(cache) == N

    _cli("destroy", "--force", "s")
    made_again = textwrap.dedent(f"""
        import numpy as np
        from shmcache import ShmDatasetCache
        c = ShmDatasetCache(session="s", name="c", size=16)
        for k in range({N}):
            assert c.put(k, np.full(256, 100_000 + k, np.int32))
    """)
    r = subprocess.run([sys.executable, "-c", made_again], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    def old_bytes(value) -> bool:
        return bool((np.asarray(value) < 100_000).any())

    for k in keys:
        with pytest.raises(KeyError):
            got = cache[k]
            pytest.fail(f"cache[{k}] returned {'the destroyed' if old_bytes(got) else 'a'} value")
    with pytest.raises(KeyError):
        got = cache.get_batch(keys)  # the vectorised path (store.gather_ints)
        pytest.fail(f"get_batch returned {'old' if old_bytes(got) else 'new'} values")
    values, missing = cache.store.lookup_batch(keys)
    assert missing == keys, "lookup_batch returned values of a destroyed cache"
    assert 7 not in cache and len(cache) == 0
    # a miss with fn: the value comes from the source, uncached, said once; an explicit put raises
    assert int(cache.get(1, fn=_old)[0]) == 1
    assert torch.equal(cache.get_batch(keys, fn=_old), torch.stack([torch.from_numpy(_old(k)) for k in keys]))
    with pytest.raises(CacheNotFound, match="destroyed"):
        cache.put(1, _old(1))
    st = cache.stats()
    assert st["items_mem"] == 0 and st["hits"] == 0, st
    cache.close()
    fresh = ShmDatasetCache(session="s", name="c")
    assert all(int(fresh[k][0]) == 100_000 + k for k in keys), "the cache made again was damaged"
    fresh.close()


def test_a_cache_made_again_counts_only_its_own_hits_in_a_process_that_counted_in_the_old_one():
    """`shmcache destroy --force --cache c` (real CLI process) and cache c made again (another
    process), while this process keeps another cache of the session open (so it keeps its liveness
    slot, and its per-slot counter totals). The cache made again starts at generation 1 as the
    destroyed one did: its stats must count only the lookups made of it, never carry on from this
    process's totals of the destroyed cache."""
    keep = ShmDatasetCache(session="s", name="other", size=16)  # holds the session's slot
    keep.put(0, _old(0))
    old = ShmDatasetCache(session="s", name="c", size=16)
    for k in range(N):
        assert old.put(k, _old(k))
    for k in range(N):
        assert int(old.get(k)[0]) == k
    assert old.stats()["hits"] == N
    old.close()

    _cli("destroy", "--force", "--cache", "c", "s")
    made_again = textwrap.dedent(f"""
        import numpy as np
        from shmcache import ShmDatasetCache
        c = ShmDatasetCache(session="s", name="c", size=16)
        for k in range({N}):
            assert c.put(k, np.full(256, 100_000 + k, np.int32))
    """)
    r = subprocess.run([sys.executable, "-c", made_again], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr

    fresh = ShmDatasetCache(session="s", name="c")
    assert int(fresh.get(3)[0]) == 100_003
    st = fresh.stats()
    assert (st["hits"], st["misses"]) == (1, 0), f"the destroyed cache's counts carried on: {st}"
    fresh.close()
    keep.close()


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
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
