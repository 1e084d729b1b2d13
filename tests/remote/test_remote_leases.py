"""Leases in Redis (NOTE [remote leases]): nodes that miss a key at once compute it once.

Every "node" is its own process with its own session (tests/remote/_lease_node.py), against a real
redis-server; computations are counted by the source itself (one byte per computation appended to
an O_APPEND file), never timed. A test's waits are kept short with $SHMCACHE_CLAIM_TIMEOUT_S (the
lease's TTL and the longest wait on another's lease).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import redis
from _redis import PASSWORD, free_port

from shmcache import ShmDatasetCache
from shmcache.tiers.tiered_store import portable_key

HERE = Path(__file__).parent
NODE = str(HERE / "_lease_node.py")


def _start(mode: str, url: str, session: str, *args, timeout_s: float) -> subprocess.Popen:
    env = dict(os.environ, SHMCACHE_CLAIM_TIMEOUT_S=str(timeout_s), PYTHONPATH=str(HERE))
    return subprocess.Popen([sys.executable, NODE, mode, url, session, *map(str, args)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _result(proc: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)  # a hang fails here
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _count(calls: Path) -> int:
    return calls.stat().st_size if calls.exists() else 0


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.01)


@pytest.mark.parametrize("mode", ["batch", "ds"])
def test_two_nodes_reading_everything_at_once_compute_each_sample_about_once(redis_server, tmp_path, mode):
    """Two nodes (separate sessions and processes), each reading the whole dataset at once, in the
    same shuffled order (one seed, no sharding), from one start line: without leases both compute
    almost every sample."""
    n = 400 if mode == "batch" else 240
    calls, go = tmp_path / "calls", tmp_path / "go"
    nodes = [_start(mode, redis_server.url, f"node{r}", n, calls, 7, go, timeout_s=10) for r in range(2)]
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("go.*"))) < 2:  # both opened (and wrapped: its probes computed)
        assert all(p.poll() is None for p in nodes), [p.communicate()[1][-2000:] for p in nodes]
        assert time.monotonic() < deadline, "the nodes never reached the start line"
        time.sleep(0.01)
    go.touch()
    results = [_result(p) for p in nodes]
    assert [r["wrong"] for r in results] == [[], []]
    # wrap() computes a few samples per process for its fingerprint (mode "ds"): allowed for
    assert _count(calls) <= 1.05 * n, _count(calls)
    stats = [r["stats"] for r in results]
    assert sum(s["remote_lease_waits"] for s in stats) > 0  # each node served some of the other's
    assert sum(s["remote_leases"] for s in stats) >= n * 0.95
    assert sum(s["remote_lease_timeouts"] for s in stats) == 0


def test_a_killed_holder_s_leases_expire_and_are_taken_over(redis_server, tmp_path):
    """A node SIGKILLed while it holds leases (computing): another node that misses those keys
    waits until the leases expire (their TTL, the holder's claim timeout), then takes them over
    and computes - before its own, longer, wait times out; no hang."""
    n = 24
    ready, calls, go = tmp_path / "ready", tmp_path / "calls", tmp_path / "go"
    other = _start("after", redis_server.url, "b", n, calls, go, timeout_s=30)  # started first: it
    holder = _start("hold", redis_server.url, "a", n, ready, timeout_s=4)    # comes within the TTL
    try:
        _wait_for(ready, holder)
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob("go.*")):
            assert other.poll() is None and time.monotonic() < deadline, "the node never reached the start line"
            time.sleep(0.01)
    except BaseException:
        other.kill()
        other.communicate(timeout=30)
        raise
    finally:
        holder.kill()
        holder.communicate(timeout=30)
    go.touch()
    got = _result(other)
    assert got["refused"] == n  # the dead holder's leases were live when the node came
    assert got["wrong"] == [] and _count(calls) == n
    st = got["stats"]
    assert st["remote_leases"] == n and st["remote_lease_timeouts"] == 0 and st["remote_lease_waits"] == 0


def test_a_stopped_holder_costs_one_bounded_wait(redis_server, tmp_path):
    """A node SIGSTOPped while it holds leases of a long TTL: another node waits for its values at
    most its own claim timeout, then computes them (counted as lease timeouts)."""
    n = 24
    ready, calls = tmp_path / "ready", tmp_path / "calls"
    holder = _start("hold", redis_server.url, "a", n, ready, timeout_s=120)
    try:
        _wait_for(ready, holder)
        holder.send_signal(signal.SIGSTOP)
        got = _result(_start("after", redis_server.url, "b", n, calls, timeout_s=1.5))
    finally:
        holder.send_signal(signal.SIGCONT)
        holder.kill()
        holder.communicate(timeout=30)
    assert got["refused"] == n
    assert got["wrong"] == [] and _count(calls) == n
    st = got["stats"]
    assert st["remote_lease_timeouts"] == n and st["remote_lease_waits"] == 0


def _counted(calls: list):
    def fn(k):
        calls.append(k)
        return np.full(64, k * 7 + 1, np.int64)
    return fn


def test_a_forged_lease_costs_one_bounded_wait_never_a_wrong_value(redis_server, monkeypatch, caplog):
    """Anyone who can write to the Redis plants leases (a string, another type, no TTL): a miss
    of such a key waits once, at most the claim timeout, then computes the right value; a key
    whose planted value fails its checks is computed at once (no wait mends it)."""
    caplog.set_level(logging.WARNING, "shmcache")
    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "0.5")
    cache = ShmDatasetCache(session="s", name="forged", remote=redis_server.url)
    tier = cache.store.behind[0]
    r = redis.Redis(port=redis_server.port, password=PASSWORD)
    try:
        for k in range(4):
            r.set(tier.lease_prefix + portable_key(k), b"someone else")
        r.rpush(tier.lease_prefix + portable_key(4), b"a list, not a string")
        r.set(tier.lease_prefix + portable_key(5), b"someone else")
        r.set(tier.prefix + portable_key(5), b"not a record")  # and a forged value beside it
        calls: list = []
        fn = _counted(calls)
        for k in range(6):
            assert np.array_equal(cache.get(k, fn), np.full(64, k * 7 + 1, np.int64))
        assert sorted(calls) == list(range(6))
        st = cache.stats()
        assert st["remote_lease_timeouts"] == 5 and st["remote_lease_waits"] == 0
        assert st["remote_corrupt"] == 1
        for k in range(6):  # in shared memory now: no wait, no computation
            assert np.array_equal(cache.get(k, fn), np.full(64, k * 7 + 1, np.int64))
        assert len(calls) == 6 and cache.stats()["remote_lease_timeouts"] == 5
    finally:
        r.close()
        cache.close()


@pytest.mark.parametrize("fault", ["down", "stopped"])
def test_a_tier_down_or_stopped_grants_leases_at_once(redis_factory, monkeypatch, fault):
    """No Redis (nothing listens), or a stopped one (every call times out): a miss computes at
    once - no lease is waited for, none counted, the values right."""
    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "30")  # a wait would show as a timeout, or a hang
    if fault == "down":
        url = f"redis://:{PASSWORD}@127.0.0.1:{free_port()}?timeout=0.2"
    else:
        server = redis_factory()
        server.stop()
        url = server.url + "?timeout=0.2"
    cache = ShmDatasetCache(session="s", name="down", remote=url)
    try:
        calls: list = []
        fn = _counted(calls)
        for k in range(20):
            assert np.array_equal(cache.get(k, fn), np.full(64, k * 7 + 1, np.int64))
        values = cache.get_batch(list(range(20, 40)), fn=fn)
        assert np.array_equal(values, np.stack([np.full(64, k * 7 + 1, np.int64) for k in range(20, 40)]))
        assert sorted(calls) == list(range(40))
        st = cache.stats()
        assert st["remote_leases"] == 0 and st["remote_lease_waits"] == 0 and st["remote_lease_timeouts"] == 0
        assert st["remote_errors"] >= 1
    finally:
        cache.close()


@pytest.mark.parametrize("kind", ["shards", "cluster"])
def test_leases_across_shards_and_a_cluster_in_one_round_trip(redis_factory, request, kind):
    """Each lease and each polled value goes to the server (the master) of its own key: a lease
    taken by one process is refused to another until its value is there, then found by a poll."""
    from shmcache.tiers.remote import RedisTier

    if kind == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    else:
        servers = [redis_factory() for _ in range(3)]
        url = f"redis+shards://:{PASSWORD}@" + ",".join(s.addr for s in servers)
    a, b = RedisTier(url, "leases"), RedisTier(url, "leases")
    try:
        keys = [portable_key(i) for i in range(40)]
        assert a.lease(keys, 30.0) == [True] * 40
        assert b.lease(keys, 30.0) == [False] * 40
        assert a.lease(keys[:5], 30.0) == [True] * 5  # its own leases: still its own
        a.offer([(k, b"value %d" % i) for i, k in enumerate(keys[:20])])
        assert a.flush(30)
        records, compute = b.poll(keys, 30.0)
        assert records == [b"value %d" % i for i in range(20)] + [None] * 20
        assert compute == [False] * 40  # every lease still held: wait on for the other 20
        assert a.counters()["leases"] == 40 and b.counters()["leases"] == 0
        assert a.counters()["errors"] == b.counters()["errors"] == 0
    finally:
        a.close()
        b.close()


def test_a_served_answer_is_returned_neither_counted_nor_published():
    """The seam with the node's claims (claims.fill): a compute callback that answers
    ``Served(value)`` (another node's value, admitted already) is not counted as computed and
    not published again; a plain answer is both."""
    from shmcache.cache import claims
    from shmcache.cache.store import MISSING, CacheStore

    store = CacheStore("served", "c", capacity_bytes=8 << 20)
    try:
        published: list = []
        publish = lambda k, v: published.append(k)  # noqa: E731
        look = lambda: MISSING  # noqa: E731
        assert claims.fill(store.claims, 1, look, MISSING, lambda k: claims.Served("theirs"), publish) == "theirs"
        assert published == [] and claims.read_counts(store.claims.path)["computed"] == 0
        assert claims.fill(store.claims, 2, look, MISSING, lambda k: "mine", publish) == "mine"
        assert published == [2] and claims.read_counts(store.claims.path)["computed"] == 1
        assert claims.fill(None, 3, look, MISSING, lambda k: claims.Served("theirs"), publish) == "theirs"
        assert published == [2]
    finally:
        store.close()


def test_a_batch_computed_in_two_calls_behind_leases_serves_and_stores_each_sample_as_computed(
        redis_server, monkeypatch):
    """Review, fixed: 8cb4a94 made a batch computed in more than one call of the source (claims: some
    keys held by another process at first) serve the earlier calls' samples as stored, else a deep
    copy (claims._detach): a source may hand out views of one buffer that its next call fills
    again (torch calls ``__getitems__`` once a batch). Behind a remote tier's leases the batch's
    one call of ``compute_many`` is itself split (TieredStore._leased): the keys whose lease is
    ours are computed first, the keys another node leases once their leases expire or the wait
    times out - a second call of the source, with the first call's values kept as they were. A
    buffer-reusing source's first rows then hold the second call's samples: served wrong, and
    stored wrong (published after the whole call: in shared memory and offered to Redis, for every
    node to read)."""
    monkeypatch.setenv("SHMCACHE_CLAIM_TIMEOUT_S", "0.5")
    cache = ShmDatasetCache(session="s", name="reused", remote=redis_server.url)
    tier = cache.store.behind[0]
    r = redis.Redis(port=redis_server.port, password=PASSWORD)
    buf = np.zeros((8, 64), np.int64)

    def reused(keys):  # a fast loader: the batch read into one buffer, its rows handed out
        for row, k in enumerate(keys):
            buf[row] = k * 7 + 1
        return [buf[row] for row in range(len(keys))]

    def one(k):
        raise AssertionError(f"key {k} computed one at a time")

    try:
        keys = [10, 11, 12, 13]
        for k in keys[2:]:  # another node computes these (its leases live)
            r.set(tier.lease_prefix + portable_key(k), b"another node")
        batch = cache.get_batch(keys, fn=one, fn_many=reused)
        want = [k * 7 + 1 for k in keys]
        served, stored = batch[:, 0].tolist(), [int(cache.get(k)[0]) for k in keys]
        assert (served, stored) == (want, want), (
            f"keys {keys} (values {want}) were served {served} and stored {stored}")
    finally:
        r.close()
        cache.close()
