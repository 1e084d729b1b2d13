"""Workers of tests/integration/test_claims.py (NOTE [claims]): a source that counts its own
computations (an O_APPEND file, one byte per computation: the count the dataset itself keeps, so
no process of ours can miscount it), and the processes that race, hold, die or stop.

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import os
import time
import traceback

import numpy as np


def value_for(i: int) -> np.ndarray:
    return np.full(64, i % 251, np.uint8) + np.arange(64, dtype=np.uint8)


def count_one(path: str, tag: bytes = b"x") -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, tag)
    finally:
        os.close(fd)


class CountingSource:
    """A map-style dataset of ``n`` items that sleeps ``sleep_s`` per item and counts each
    computation in ``count_path``."""

    def __init__(self, n: int, count_path: str, sleep_s: float = 0.0):
        self.n, self.count_path, self.sleep_s = n, count_path, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        count_one(self.count_path)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return value_for(int(i))


def racer(q, barrier, rank: int, n: int, count_path: str, sleep_s: float, claims_on: bool) -> None:
    """Wrap the source and read every key in the same order as every other racer: even ranks by
    ``ds[i]``, odd ranks by ``cache.get(i, fn)``. Reports the wrong values it got."""
    try:
        if not claims_on:
            os.environ["SHMCACHE_CLAIMS"] = "0"
        from shmcache import ShmDatasetCache

        cache = ShmDatasetCache(session="race", name="race", size=64)
        source = CountingSource(n, count_path, sleep_s)
        ds = cache.wrap(source)
        barrier.wait(timeout=60)
        wrong = 0
        for i in range(n):
            got = ds[i] if rank % 2 == 0 else cache.get(i, source.__getitem__)
            wrong += not np.array_equal(np.asarray(got), value_for(i))
        cache.close()
        q.put(("ok", {"rank": rank, "wrong": wrong}))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))


def holder(key: int, count_path: str, started, release, timeout_s: float) -> None:
    """Miss ``key`` in cache race/hold and compute it under the claim, saying so (``started``)
    and then blocking on ``release`` (bounded): the process a test kills or stops."""
    from shmcache.cache.store import CacheStore

    store = CacheStore("race", "hold", capacity_bytes=16 << 20)

    def compute(k):
        count_one(count_path, b"h")
        started.set()
        release.wait(timeout_s)
        return value_for(k)

    store.fill(key, compute, lambda k, v: store.put(k, v))
    store.close()


def waiter(q, key: int, count_path: str, claim_timeout_s: float, busy_seen) -> None:
    """Miss ``key`` while another holds its claim (checked first: ``busy_seen`` set only after
    this process found the claim taken), then get it by the miss path; report the value's
    correctness and the claim counters."""
    try:
        from shmcache.cache.claims import BUSY
        from shmcache.cache.store import MISSING, CacheStore

        store = CacheStore("race", "hold", capacity_bytes=16 << 20, claim_timeout_s=claim_timeout_s)
        claims = store.claims
        assert store.lookup(key) is MISSING
        claims._ready()
        assert claims.take(claims.bucket(key)) == BUSY, "the holder's claim is not held"
        busy_seen.set()

        def compute(k):
            count_one(count_path, b"w")
            return value_for(k)

        got = store.fill(key, compute, lambda k, v: store.put(k, v))
        st = store.stats()
        store.close()
        q.put(
            (
                "ok",
                {
                    "right": bool(np.array_equal(got, value_for(key))),
                    **{k: st[k] for k in ("computed", "claim_waits", "claim_timeouts")},
                },
            )
        )
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))


def batch_racer(q, barrier, rank: int, n: int, count_path: str, sleep_s: float, modes: tuple) -> None:
    """Wrap the source and read every key in one order, by the batch path ``modes[rank]`` names:
    ``get_batch`` (the wrapped dataset's, batches of 16), ``getitems`` (its ``__getitems__``),
    ``loader`` (a DataLoader, batches of 16, in the process: a daemonic racer has no workers; the
    jobs test runs workers), ``warmup`` (then every key by ``ds[i]``),
    ``item`` (``ds[i]``). Reports the wrong values it got."""
    try:
        import torch
        from torch.utils.data import DataLoader

        from shmcache import ShmDatasetCache

        mode = modes[rank % len(modes)]
        cache = ShmDatasetCache(session="race", name="batch", size=64)
        source = CountingSource(n, count_path, sleep_s)
        ds = cache.wrap(source)
        barrier.wait(timeout=60)
        wrong = 0
        batches = [list(range(lo, min(n, lo + 16))) for lo in range(0, n, 16)]
        if mode == "get_batch":
            got = [(keys, ds.get_batch(keys)) for keys in batches]
        elif mode == "getitems":
            got = [(keys, torch.as_tensor(np.stack(ds.__getitems__(keys)))) for keys in batches]
        elif mode == "loader":
            got = list(zip(batches, DataLoader(ds, batch_size=16)))
        else:
            if mode == "warmup":
                cache.warmup(ds, progress=False)
            got = [(keys, torch.as_tensor(np.stack([ds[i] for i in keys]))) for keys in batches]
        for keys, batch in got:
            wrong += not np.array_equal(batch.numpy(), np.stack([value_for(i) for i in keys]))
        cache.close()
        q.put(("ok", {"rank": rank, "wrong": wrong, "mode": mode}))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))


def batch_holder(keys: list, count_path: str, started, release, timeout_s: float) -> None:
    """Miss ``keys`` in cache race/hold as one batch and compute them under their claims, saying
    so (``started``) and then blocking on ``release`` (bounded): the process a test kills or stops."""
    from shmcache.cache.store import CacheStore

    store = CacheStore("race", "hold", capacity_bytes=16 << 20)

    def compute_many(ks):
        for _ in ks:
            count_one(count_path, b"h")
        started.set()
        release.wait(timeout_s)
        return [value_for(k) for k in ks]

    store.fill_batch(list(keys), compute_many, lambda pairs: store.put_many([(k, _enc(v)) for k, v in pairs]))
    store.close()


def _enc(value):
    from shmcache.cache import codec

    return codec.encode(value)


def batch_waiter(q, keys: list, held: list, count_path: str, claim_timeout_s: float, busy_seen) -> None:
    """Miss ``keys`` as one batch while another process holds the claims of ``held`` (checked
    first), then fill them; report the values' correctness, the calls of compute_many (the keys
    of each, in order) and the claim counters."""
    try:
        from shmcache.cache.claims import BUSY
        from shmcache.cache.store import MISSING, CacheStore

        store = CacheStore("race", "hold", capacity_bytes=16 << 20, claim_timeout_s=claim_timeout_s)
        claims = store.claims
        assert all(store.lookup(k) is MISSING for k in keys)
        claims._ready()
        assert all(claims.take(claims.bucket(k)) == BUSY for k in held), "the holder's claims are not held"
        busy_seen.set()
        calls = []

        def compute_many(ks):
            calls.append(list(ks))
            for _ in ks:
                count_one(count_path, b"w")
            return [value_for(k) for k in ks]

        got = store.fill_batch(list(keys), compute_many,
                               lambda pairs: store.put_many([(k, _enc(v)) for k, v in pairs]))
        st = store.stats()
        store.close()
        q.put(("ok", {"right": all(np.array_equal(g, value_for(k)) for k, g in zip(keys, got)),
                      "calls": calls, **{k: st[k] for k in ("computed", "claim_waits", "claim_timeouts")}}))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))
