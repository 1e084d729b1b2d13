"""`destroy --force` racing live readers and writers of the same session, which is then made again.

Workers open the cache, read and write deterministic values, and now and then destroy the whole
session under everyone (force) or create it again. Segment names carry the root's incarnation and a
lock file found replaced marks a handle stale (store.py), so: every value read is the right one,
and the only errors are SessionNotFound / CacheNotFound, which say that the session went away.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from shmcache import cli
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import MISSING, CacheStore

WORKER = textwrap.dedent("""
    import json, random, sys, time
    from shmcache import ShmDatasetCache
    from shmcache.errors import CacheNotFound, SessionNotFound
    from shmcache.cache.registry import SessionRegistry
    from shmcache.cache.store import MISSING

    def value(k):
        return (b"%08d" % k) * (1 + k % 40)

    seed, seconds = int(sys.argv[1]), float(sys.argv[2])
    rng, wrong, errors, ops, gone = random.Random(seed), 0, [], 0, 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        try:
            roll = rng.random()
            if roll < 0.05:
                SessionRegistry(timeout_s=20).destroy("s", force=True)
            elif roll < 0.10:
                SessionRegistry(timeout_s=20).create("s", exist_ok=True)
            else:
                cache = ShmDatasetCache(session="s", name="c", size=2, lock_timeout_s=20)
                for _ in range(40):
                    k = rng.randrange(300)
                    got = cache.store.lookup(k)
                    ops += 1
                    if got is MISSING:
                        cache.put(k, value(k))
                    elif got != value(k):
                        wrong += 1
                cache.close()
        except (SessionNotFound, CacheNotFound):
            gone += 1
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:300])
    print(json.dumps({"wrong": wrong, "errors": errors[:10], "ops": ops, "gone": gone}))
""")


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_forced_destroys_under_live_readers_and_writers_never_mix_incarnations(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    workers = [subprocess.Popen([sys.executable, str(script), str(seed), "6"], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True) for seed in range(3)]
    results = []
    for w in workers:
        out, err = w.communicate(timeout=120)
        assert w.returncode == 0, err[-2000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert sum(r["ops"] for r in results) > 1000, results  # the test did real work
    assert sum(r["gone"] for r in results) > 0, results  # ... and handles really went stale
    assert [r["wrong"] for r in results] == [0, 0, 0], results
    assert [r["errors"] for r in results] == [[], [], []], results

    assert cli.main(["gc"]) == 0
    registry = SessionRegistry()
    if registry.exists("s") and "c" in registry.cache_names("s"):
        store = CacheStore("s", "c", create=False)
        for k in range(300):
            got = store.lookup(k)
            assert got is MISSING or got == (b"%08d" % k) * (1 + k % 40), f"key {k} after gc"
        store.close()
    if registry.exists("s"):
        registry.destroy("s", force=True)
