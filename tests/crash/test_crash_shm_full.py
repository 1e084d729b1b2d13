"""A full /dev/shm, a memory cap, and items that can never fit (RELIABILITY.md 1, 2 and 13).

Filling the real /dev/shm is not an option on a shared machine, so the ENOSPC tests make
``os.posix_fallocate`` of *one child process* report ENOSPC from its N-th call on - exactly what a
full tmpfs does to it (and ftruncate+mmap would not report; the first write would SIGBUS). That
process must not die, must count the items it could not admit as rejected, must keep serving the
source's values, and must say once, in its log, that /dev/shm is full and how to raise
``--shm-size``. The cap path uses a small ``capacity_bytes``.
"""

from __future__ import annotations

import subprocess
import time

import pytest
from _procs_util import Procs, Zygote, status_of
from _shmcheck import check_store, fixed_value

from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import InvalidArgument, ItemTooLarge

S, C = "full", "c"
CAP = 64 << 20
# posix_fallocate calls a new cache makes before its first item: root, meta, first table
NEW_CACHE_CALLS = 3


def _enospc(tmp_path, ok_calls, keys, kind="mixed"):
    procs = Procs(tmp_path / "p")
    try:
        p = procs.start("enospc", S, C, CAP, ok_calls, keys, kind, stderr=subprocess.PIPE)
        try:
            _, log = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate(timeout=10)
            raise AssertionError("the process serving items on a full /dev/shm hangs") from None
        status, res = procs.finish(p, 10)
    finally:
        procs.close()
    assert status == 0, f"{status_of(status)} (SIGBUS is -7): {res}\n{log.decode()[-2000:]}"
    return res, log.decode()


def _assert_full_shm_reported(log: str) -> None:
    warnings = [line for line in log.splitlines() if "/dev/shm" in line]
    assert warnings, f"nothing in the log names /dev/shm:\n{log[-2000:]}"
    assert any("--shm-size" in line for line in warnings), f"no hint to raise --shm-size: {warnings}"
    assert len(warnings) == 1, f"the full /dev/shm is reported {len(warnings)} times, not once"


def test_enospc_from_the_first_item_rejects_and_serves_the_source(tmp_path):
    keys = list(range(200))
    res, log = _enospc(tmp_path, NEW_CACHE_CALLS, keys)
    assert res["errors"] == []
    assert res["bad"] == 0
    assert res["admitted"] == 0 and res["rejected"] == len(keys)
    assert res["stats_rejected"] == len(keys)
    _assert_full_shm_reported(log)
    store = CacheStore(S, C, create=False)
    assert check_store(store, keys) == []  # nothing half-made, no debris


def test_enospc_mid_run_keeps_what_is_cached_and_rejects_the_rest(tmp_path):
    keys = list(range(600))
    res, log = _enospc(tmp_path, NEW_CACHE_CALLS + 12, keys)
    assert res["errors"] == []
    assert res["bad"] == 0
    assert res["admitted"] > 0 and res["rejected"] > 0
    assert res["stats_rejected"] == res["rejected"]
    assert res["items_mem"] == res["admitted"]
    _assert_full_shm_reported(log)
    store = CacheStore(S, C, create=False)
    assert check_store(store, keys) == []
    assert store.stats()["items_mem"] == res["admitted"]


def test_enospc_when_the_index_table_must_grow(tmp_path):
    """Small items: the first data commit holds 1024 of them, so the first allocation that finds
    /dev/shm full is the table growth at 717 items. put() must reject, not raise."""
    keys = list(range(1000))
    res, log = _enospc(tmp_path, NEW_CACHE_CALLS + 2, keys, "fixed:8")
    assert res["errors"] == [], f"put() raised on a full /dev/shm instead of rejecting: {res['errors'][0]}"
    assert res["bad"] == 0
    assert res["admitted"] + res["rejected"] == len(keys)
    _assert_full_shm_reported(log)


def test_enospc_through_the_public_api_does_not_stop_training(tmp_path):
    """`cache.get(key, fn)` in a training loop while /dev/shm fills up: every item is served.
    (Tiny tensors: 512 fit a data commit; /dev/shm is full from the table growth at 717 on.)"""
    with Procs(tmp_path / "p") as procs:
        p = procs.start("torch_enospc", S, NEW_CACHE_CALLS + 3, 1000)
        status, res = procs.finish(p, 90)
    assert status == 0, f"{status_of(status)}: {res}"
    assert res["errors"] == [], f"training stopped: {res['errors'][0]}"
    assert res["bad"] == 0


def test_cap_rejects_what_does_not_fit_and_serves_the_source(tmp_path):
    cap = 2 << 20
    keys = list(range(300))
    with Zygote(tmp_path / "z") as z:
        status, res = z.run("enospc", S, C, cap, 10**9, keys)  # /dev/shm never full: the cap is
    assert status == 0, res
    assert res["errors"] == [] and res["bad"] == 0
    assert res["admitted"] > 0 and res["rejected"] > 0
    assert res["stats_rejected"] == res["rejected"]
    store = CacheStore(S, C, create=False)
    st = store.stats()
    assert st["committed_bytes"] <= cap
    assert st["items_mem"] == res["admitted"]
    assert check_store(store, keys) == []


def _lock_is_free(tmp_path, cap) -> None:
    """Another process can write right away: nothing was left holding the cache lock."""
    with Zygote(tmp_path / "after") as z:
        status, res = z.run("timed_put", S, C, cap, 10**6, 2.0)
    # a held lock makes the put give up after 2 s, unstored (ok False)
    assert status == 0 and res["ok"], f"the cache lock is still held: {res}"


def test_item_larger_than_the_cap_fails_at_once(tmp_path):
    cap = 1 << 20
    store = CacheStore(S, C, capacity_bytes=cap)
    t0 = time.monotonic()
    with pytest.raises(ItemTooLarge, match="size="):
        store.put(1, b"x" * (2 << 20))
    assert time.monotonic() - t0 < 0.5
    _lock_is_free(tmp_path, cap)
    assert store.lookup(1, count=False) is MISSING
    assert check_store(store, [1, 10**6]) == []


def test_cap_smaller_than_one_item_fails_at_once(tmp_path):
    cap = 256 << 10
    store = CacheStore(S, C, capacity_bytes=cap)
    t0 = time.monotonic()
    with pytest.raises(ItemTooLarge):
        store.put("big", fixed_value("big", 300_000))
    assert time.monotonic() - t0 < 0.5
    _lock_is_free(tmp_path, cap)


def test_item_that_cannot_fit_even_in_an_empty_cache_fails_at_once(tmp_path):
    """An item a little smaller than the cap can still never be stored: the cache's own meta and
    table segments are charged to the cap too. Rejecting it silently, on every epoch, hides a
    configuration error that ItemTooLarge exists to report."""
    cap = 1 << 20
    store = CacheStore(S, C, capacity_bytes=cap)
    empty_committed = store.stats()["committed_bytes"]
    item = fixed_value(1, cap - 4096)
    assert len(item) < cap and len(item) > cap - empty_committed  # it can never fit
    with pytest.raises(ItemTooLarge):
        store.put(1, item)


def test_cap_too_small_for_any_item_is_refused_at_creation(tmp_path, shm_namespace):
    with pytest.raises(InvalidArgument, match="size="):
        CacheStore(S, C, capacity_bytes=64 << 10)
    assert shm_namespace.owned_segments() == []
    with Zygote(tmp_path / "z") as z:
        status, res = z.run("open", S, C, CAP, 1.0, 1)
    assert status == 0 and "error" not in res, res
