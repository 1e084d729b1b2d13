"""One "node" of the lease tests (NOTE [remote leases]): a process with its own session, the job's
Redis, and a source that appends one byte per computation to an O_APPEND file (``calls``), so a
test counts the computations of every node. ``$SHMCACHE_CLAIM_TIMEOUT_S`` (the lease's TTL and the
longest wait) comes from the test. Run as ``python _lease_node.py MODE URL SESSION ...``:

    batch URL SESSION N CALLS SEED GO   every key of range(N), in batches of 16 in the order SEED
                                        shuffles, once the file GO is there: lookup_batch, then
                                        TieredStore.leased_compute on the misses, the computed
                                        values put (offered to Redis)
    ds URL SESSION N CALLS SEED GO      ds[i] of a wrapped dataset for every i, the same way
    hold URL SESSION N READY         take the leases of range(N) through leased_compute, whose
                                     computation touches READY and then sleeps (the test kills or
                                     stops it)
    after URL SESSION N CALLS [GO]   (once GO is there) the leases of range(N) tried once (how many
                                     another holds: ``refused``), then every key through
                                     leased_compute

Each prints a JSON line: the keys whose value was wrong, stats(), and what the mode counts.
Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

NAME = "leases"


def expected(i: int) -> np.ndarray:
    return np.full(64, i * 7 + 1, np.int64)


def _computed(calls: str) -> None:
    fd = os.open(calls, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, b"x")  # one byte per computation, one write(): never interleaved
    finally:
        os.close(fd)


class Source:
    """Item i is ``expected(i)``, after 1 ms; each computation appends a byte to ``calls``."""

    def __init__(self, n: int, calls: str):
        self.n, self.calls = n, calls

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        _computed(self.calls)
        time.sleep(0.001)
        return expected(i)


def _compute_many(calls: str):
    def compute_many(keys: list) -> list:
        out = []
        for k in keys:
            _computed(calls)
            time.sleep(0.001)
            out.append(expected(k))
        return out
    return compute_many


def _cache(url: str, session: str):
    from shmcache import ShmDatasetCache

    return ShmDatasetCache(session=session, name=NAME, remote=url)


def _through_leases(cache, keys: list, compute_many) -> list:
    """What ``CacheStore.fill_batch`` does with the leases, minus the node's own claims: the
    batch's misses computed behind their leases, the computed ones put (and offered)."""
    from shmcache.cache.claims import Served

    store = cache.store
    values, missing = store.lookup_batch(keys)
    got = store.leased_compute(compute_many)([keys[j] for j in missing])
    for j, v in zip(missing, got):
        if type(v) is Served:
            values[j] = v.value
        else:
            cache.put(keys[j], v)
            values[j] = v
    return values


def _wrong(keys, values) -> list:
    return [k for k, v in zip(keys, values) if not np.array_equal(np.asarray(v), expected(k))]


def _finish(cache, out: dict) -> None:
    cache.store.behind[0].flush(30)
    out["stats"] = cache.stats()
    cache.close()
    from shmcache.cache.registry import SessionRegistry

    SessionRegistry().destroy(cache.session, force=True)
    print(json.dumps(out, default=str))


def _start_line(go: str) -> None:
    """Touch ``go.<pid>``, then wait (bounded) for ``go`` itself: every node starts reading at once."""
    open(f"{go}.{os.getpid()}", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            raise TimeoutError("the test never said go")
        time.sleep(0.005)


def main(mode: str, url: str, session: str, n: str, *rest: str) -> None:
    n_ = int(n)
    cache = _cache(url, session)
    if mode == "batch":
        calls, seed = rest[0], int(rest[1])
        order = np.random.default_rng(seed).permutation(n_).tolist()
        cache.store.lookup_batch([0])  # opened (and its tier connected) before the start line
        _start_line(rest[2])
        wrong = []
        for lo in range(0, n_, 16):
            keys = order[lo:lo + 16]
            wrong += _wrong(keys, _through_leases(cache, keys, _compute_many(calls)))
        _finish(cache, {"wrong": wrong})
    elif mode == "ds":
        calls, seed = rest[0], int(rest[1])
        ds = cache.wrap(Source(n_, calls))
        order = np.random.default_rng(seed).permutation(n_).tolist()
        _start_line(rest[2])
        _finish(cache, {"wrong": [i for i in order if not np.array_equal(ds[i], expected(i))]})
    elif mode == "hold":
        ready = rest[0]

        def hold(keys):
            open(ready, "w").close()
            time.sleep(600)  # killed or stopped by the test meanwhile
            return [expected(k) for k in keys]

        cache.store.leased_compute(hold)(list(range(n_)))
    elif mode == "after":
        from shmcache.tiers.tiered_store import portable_key

        calls = rest[0]
        tier = cache.store.behind[0]
        tier.get(b"")  # connected before the start line
        if len(rest) > 1:
            _start_line(rest[1])
        refused = sum(not g for g in tier.lease([portable_key(k) for k in range(n_)], 30.0))
        keys = list(range(n_))
        _finish(cache, {"wrong": _wrong(keys, _through_leases(cache, keys, _compute_many(calls))),
                        "refused": refused})
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(*sys.argv[1:])
