"""SIGKILL a writer at every step of NOTE [publish order] (store.py), with a reader hammering lookups.

RELIABILITY.md scenarios 3 and 4: whoever dies holding the cache lock, or between allocating a
chunk and publishing its entry, the kernel releases the lock at once, no half-published entry is
ever visible, no torn value is ever read, and the next writer - or ``shmcache gc`` - leaves the
totals exact and every chunk accounted for.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
from _procs_util import Zygote, crash_env, status_of, wait_for
from _shmcheck import check_store, fixed_value, gc_json, intent_phase, reader_saw_no_harm, same_value, value_for

from shmcache.cache import process_slot
from shmcache.cache.allocator import commit_step_chunks
from shmcache.cache.store import MISSING, CacheStore

S, C = "crash", "c"
CAP = 64 << 20
KILLS_PER_POINT = 20
PUBLISH_POINTS = ["locked", "allocated", "mid_copy", "before_publish", "after_publish"]
UNPUBLISHED = {"allocated", "mid_copy", "before_publish"}  # dies after allocating, before READY


@pytest.fixture(autouse=True)
def _own_slots():
    yield
    process_slot.release_all()  # the slots this test process took (hit/miss counters)


def _lock_wait_s(store: CacheStore) -> float:
    t0 = time.monotonic()
    store.lock.acquire(timeout_s=5)
    waited = time.monotonic() - t0
    store.lock.release()
    return waited


@pytest.mark.parametrize("point", PUBLISH_POINTS)
def test_sigkilled_writer_is_invisible_and_repaired(point, tmp_path, capsys):
    store = CacheStore(S, C, capacity_bytes=CAP)
    base = list(range(60))  # every kind and size class of value_for
    for k in base:
        assert store.put(k, value_for(k))
    doomed = list(range(1000, 1000 + KILLS_PER_POINT))
    later = list(range(2000, 2000 + KILLS_PER_POINT))
    universe = base + doomed + later
    published = set(base)
    stop, ready = tmp_path / "stop", tmp_path / "reader.ready"
    with Zygote(tmp_path / "crashing", crash_at=point) as crashing, Zygote(tmp_path / "clean") as clean:
        reader, reader_out = clean.spawn("reader", S, C, CAP, universe, str(stop), str(ready))
        wait_for(ready.exists, 30, "the reader to start")
        for i, key in enumerate(doomed):
            status, _ = crashing.run("put", S, C, [key], CAP)
            assert status == -9, f"the writer should die at {point!r}, but it ended with {status_of(status)}"
            waited = _lock_wait_s(store)
            assert waited < 1.0, f"the lock stayed taken {waited:.2f}s after its holder died at {point!r}"
            seen = store.lookup(key, count=False)
            if point == "after_publish":
                assert same_value(seen, value_for(key)), "a READY entry must read back complete"
                published.add(key)
            else:
                assert seen is MISSING, f"an entry that was never published is visible (died at {point!r})"
            if i % 2 == 0:  # the next writer, another process, repairs on its way in
                status, _ = clean.run("put", S, C, [later[i]], CAP)
                assert status == 0
                published.add(later[i])
                assert check_store(store, universe) == []
        # the last kill was not followed by a writer: gc must finish the job
        if point in UNPUBLISHED | {"after_publish"}:
            assert intent_phase(store) != 0, "the dead writer's intent record should still be there"
        stop.touch()
        assert clean.wait(reader, 30) == 0
    reader_saw_no_harm(reader_out)

    result = gc_json(capsys)
    assert result["reclaimed_entries"] == (1 if point in UNPUBLISHED else 0)
    assert result["removed_segments"] == []
    assert check_store(store, universe) == []
    present = {k for k in universe if store.lookup(k, count=False) is not MISSING}
    assert present == published
    st = store.stats()
    assert st["items_mem"] == len(published)


def test_hundred_kills_between_allocation_and_publish_leak_no_chunk(tmp_path):
    """Scenario 4: 100 SIGKILLs between allocation and publish (same-size items), then `shmcache gc`:
    nothing appears, every chunk is reclaimed, and re-putting reuses them."""
    kind = "fixed:3000"
    store = CacheStore(S, C, capacity_bytes=CAP)
    published = set()
    zygotes = {p: Zygote(tmp_path / p, crash_at=p) for p in sorted(UNPUBLISHED)}
    try:
        with Zygote(tmp_path / "clean") as clean:
            assert clean.run("put", S, C, list(range(10)), CAP, kind)[0] == 0
            published |= set(range(10))
            doomed = list(range(10_000, 10_100))
            for i, key in enumerate(doomed):
                point = sorted(UNPUBLISHED)[i % 3]
                status, _ = zygotes[point].run("put", S, C, [key], CAP, kind)
                assert status == -9, f"kill {i} at {point!r}: {status_of(status)}"
                if i % 10 == 9 and i != 99:
                    new = [20_000 + i, 20_000 + i + 1000]
                    assert clean.run("put", S, C, new, CAP, kind)[0] == 0
                    published |= set(new)
    finally:
        for z in zygotes.values():
            z.close()
    assert all(store.lookup(k, count=False) is MISSING for k in doomed)
    source = lambda k: fixed_value(k, 3000)  # noqa: E731
    universe = sorted(published) + doomed
    before = check_store(store, universe, source, after_gc=False)
    assert any("leaked [" in p for p in before), f"the last kill's chunk is not free yet: {before}"

    gc = subprocess.run([sys.executable, "-m", "shmcache", "gc", "--json"], env=crash_env(),
                        capture_output=True, text=True, timeout=60)
    assert gc.returncode == 0, gc.stderr
    assert json.loads(gc.stdout)["reclaimed_entries"] == 1  # the last kill's chunk

    assert check_store(store, universe, source) == []
    g = store.view.refresh()
    (cls,) = g.classes.used_classes()
    chunk, bump, committed = g.classes.get(cls)
    step = commit_step_chunks(chunk)
    assert bump == len(published), "every chunk a dead writer took was given back"
    assert committed <= bump + step, (
        f"{committed} chunks committed for {bump} items: the dead writers' chunks leaked")

    with Zygote(tmp_path / "again") as clean:
        assert clean.run("put", S, C, doomed, CAP, kind)[0] == 0
    assert check_store(store, universe, source) == []
    chunk, bump, committed = g.classes.get(cls)
    assert bump == len(published) + len(doomed)
    assert committed <= bump + step
    assert store.stats()["committed_bytes"] - store.stats()["bytes_mem"] < (
        committed - bump + 1) * chunk + 2 * 2**20, "committed memory tracks what is stored"


@pytest.mark.parametrize("lock", ["cache", "registry"])
def test_waiters_get_the_lock_as_soon_as_its_holder_is_sigkilled(lock, tmp_path):
    """Scenario 3: processes blocked on a lock whose holder is SIGKILLed proceed at once, not after
    their lock timeout."""
    CacheStore(S, C, capacity_bytes=CAP).close()
    held = tmp_path / "held"
    with Zygote(tmp_path / "z") as z:
        if lock == "cache":
            holder, _ = z.spawn("hold_cache_lock", S, C, CAP, str(held))
        else:
            holder, _ = z.spawn("hold_registry_lock", str(held))
        wait_for(held.exists, 30, f"the {lock} lock holder")
        refused = [tmp_path / f"refused-{i}" for i in range(3)]
        if lock == "cache":
            waiters = [z.spawn("timed_put", S, C, CAP, 500 + i, 30, str(refused[i])) for i in range(3)]
        else:
            waiters = [z.spawn("timed_create", f"new-{i}", 30, str(refused[i])) for i in range(3)]
        # the handshake: each waiter's first try (0.2 s at most) was refused, so the lock is held
        # and each is now in its second, long wait
        wait_for(lambda: all(p.exists() for p in refused), 30, "the waiters' first tries")
        assert [json.loads(p.read_text())["stored"] for p in refused] == [False] * 3, \
            "a waiter got a lock that is held"
        killed_at = time.time()
        z.kill(holder)
        assert z.wait(holder, 10) == -9
        for pid, out in waiters:
            assert z.wait(pid, 10) == 0
            res = json.loads(out.read_text())
            # well under the waiters' 30 s lock timeout; wide enough for a loaded 2-core CI machine
            assert res["done_at"] - killed_at < 5.0, f"a waiter took {res['done_at'] - killed_at:.2f}s"
    if lock == "cache":
        store = CacheStore(S, C, create=False)
        assert check_store(store, list(range(500, 503))) == []
        assert store.stats()["items_mem"] == 3
