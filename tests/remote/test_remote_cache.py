"""The remote tier under ShmDatasetCache, against real redis-server processes: several simulated
nodes (separate processes, each its own $SHMCACHE_DIR), each item computed about once per job;
the batch path; Redis killed, stopped, filled and corrupted mid-epoch; a wrong password; a
Cluster; passwords absent from every log line, message, stat and info output; an imported cache
shares remote values by dataset, not by name."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from _nodes import Counted, calls_of, expected, same
from _redis import PASSWORD

from shmcache import ShmDatasetCache, cli
from shmcache.base.namespace import namespace
from shmcache.cache.store import CacheStore
from shmcache.errors import InvalidArgument
from shmcache.tiers.tiered_store import TieredStore

HERE = Path(__file__).resolve().parent
N = 240


def _cache(session: str, url: str, n: int = N, calls=None):
    cache = ShmDatasetCache(session=session, remote=url)
    return cache, cache.wrap(Counted(n, calls))


def _flush(cache) -> None:
    assert cache.store.behind[0].flush(10)


def _logs(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


# --- several nodes, each item computed about once --------------------------------------------------

def test_three_nodes_compute_each_item_about_once(redis_server, tmp_path):
    calls, barrier = tmp_path / "calls", tmp_path / "barrier"
    barrier.mkdir()
    procs = []
    for rank in range(3):
        env = dict(os.environ, SHMCACHE_DIR=str(tmp_path / f"node{rank}"), PYTHONPATH=str(HERE))
        procs.append(subprocess.Popen(
            [sys.executable, str(HERE / "_nodes.py"), redis_server.url, str(rank), "3", str(N),
             str(calls), str(barrier)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=100)
        assert p.returncode == 0, err[-3000:]
        assert PASSWORD not in out + err
        outs.append(json.loads(out.strip().splitlines()[-1]))
    assert all(o["wrong"] == [] for o in outs)
    done = calls_of(calls)
    # each node computes its own shard, plus the few samples wrap() reads to fingerprint the
    # dataset; nothing of another node's shard (read from Redis in epoch 2)
    assert set(done) == set(range(N))
    assert len(done) <= N + 3 * 4, f"{len(done)} computations for {N} items"
    for o in outs:
        st = o["stats"]
        assert st["remote"] == redis_server.url.replace(PASSWORD, "***")
        assert st["remote_hits"] >= N // 3 - 4 and st["remote_errors"] == 0 and st["remote_backlog"] == 0
    for rank in range(3):  # every node cleaned its own namespace
        assert namespace(tmp_path / f"node{rank}").owned_segments() == []


def test_no_remote_keeps_the_plain_store(redis_server, monkeypatch):
    monkeypatch.delenv("SHMCACHE_REMOTE", raising=False)
    cache = ShmDatasetCache(session="plain")
    cache.wrap(Counted(10))
    assert type(cache.store) is CacheStore and "remote" not in cache.stats()
    cache.close()
    monkeypatch.setenv("SHMCACHE_REMOTE", redis_server.url)
    cache = ShmDatasetCache(session="env")
    cache.wrap(Counted(10))
    assert isinstance(cache.store, TieredStore)
    cache.close()
    cache = ShmDatasetCache(session="off", remote="")  # "" turns it off, whatever the environment
    cache.wrap(Counted(10))
    assert type(cache.store) is CacheStore
    cache.close()


def test_session_carries_its_remote(redis_server, monkeypatch, capsys):
    monkeypatch.delenv("SHMCACHE_REMOTE", raising=False)
    assert cli.main(["new", "withremote", "--remote", redis_server.url]) == 0
    capsys.readouterr()
    cache, ds = _cache("withremote", None)
    assert isinstance(cache.store, TieredStore)
    assert same(ds[3], 3)
    _flush(cache)
    assert cache.stats()["remote_bytes_written"] > 0
    cache.close()
    assert cli.main(["ls", "--json"]) == 0
    assert PASSWORD not in capsys.readouterr().out
    assert cli.main(["new", "bad", "--remote", f"redis://:{PASSWORD}@host:notaport"]) == 2
    err = capsys.readouterr().err
    assert "port" in err and PASSWORD not in err and "***" in err


def test_bad_urls_are_refused_without_the_password():
    with pytest.raises(InvalidArgument) as e:
        ShmDatasetCache(session="x", remote=f"mysql://:{PASSWORD}@h:1")
    assert PASSWORD not in str(e.value) and "***" in str(e.value)
    with pytest.raises(InvalidArgument):
        ShmDatasetCache(session="x", remote=42)


# --- the batch path and the counters ------------------------------------------------------------

def test_batches_read_another_nodes_values_in_one_round_trip(redis_server, tmp_path):
    calls = tmp_path / "calls"
    a, dsa = _cache("nodeA", redis_server.url, calls=calls)
    for i in range(N):
        assert same(dsa[i], i)
    _flush(a)
    before = len(calls_of(calls))
    b, dsb = _cache("nodeB", redis_server.url, calls=calls)  # another session: another node's memory
    first = b.stats()
    keys = list(range(100, 164))
    got = b.get_batch(keys)  # collated, from Redis: one round trip
    for j, k in enumerate(keys):
        assert same((got[0][j], got[1][j]), k)
    st = b.stats()
    assert 64 - 4 <= st["remote_hits"] - first["remote_hits"] <= 64  # (wrap() computed a few)
    assert len(calls_of(calls)) - before <= 4  # only wrap()'s fingerprint samples
    # admitted into node B's shared memory: the next batch is all local
    again = b.get_batch(keys)
    assert b.stats()["remote_hits"] == st["remote_hits"] and (again[0] == got[0]).all()
    a.close()
    b.close()


# --- faults mid-epoch ------------------------------------------------------------------------

def _epoch_survives(ds, start: int, stop: int, deadline_s: float) -> None:
    t0 = time.monotonic()
    for i in range(start, stop):
        assert same(ds[i], i), f"item {i}"
    assert time.monotonic() - t0 < deadline_s


@pytest.mark.parametrize("fault", ["kill", "stop"])
def test_redis_killed_or_stopped_mid_epoch(redis_server, caplog, fault):
    caplog.set_level(logging.WARNING, "shmcache")
    url = redis_server.url + "?timeout=0.3"
    a, dsa = _cache("nodeA", url)
    _epoch_survives(dsa, 0, N // 2, 30)
    _flush(a)
    b, dsb = _cache("nodeB", url)
    _epoch_survives(dsb, 0, N // 4, 30)  # from Redis
    redis_server.kill() if fault == "kill" else redis_server.stop()
    _epoch_survives(dsb, N // 4, N, 10)  # the rest: Redis gone, computed, right
    st = dsb.cache.stats()
    assert st["remote_errors"] >= 1 and st["hits"] + st["misses"] >= N
    t0 = time.monotonic()
    b.close()
    a.close()
    assert time.monotonic() - t0 < 12  # close() flushes within its deadline, never hangs
    text = _logs(caplog)
    assert ("unreachable" if fault == "kill" else "did not answer") in text
    assert PASSWORD not in text + json.dumps(st) + repr(b) + repr(dsb.cache)
    redis_server.cont()


def test_values_corrupted_mid_epoch(redis_server, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    import redis

    a, dsa = _cache("nodeA", redis_server.url)
    for i in range(N):
        dsa[i]
    _flush(a)
    other = ShmDatasetCache(session="nodeA", name="another", remote=redis_server.url)
    other.put(7, expected(999))
    _flush(other)
    r = redis.Redis(port=redis_server.port, password=PASSWORD)
    keys = sorted(k for k in r.keys(b"shmcache:*") if b"another" not in k and b":lease:" not in k)  # values, not leases
    assert len(keys) == N
    other_record = r.get(next(k for k in r.keys(b"shmcache:another:*")))
    victims = keys[:30]
    for j, k in enumerate(victims):
        v = r.get(k)
        r.set(k, [b"garbage", v[:len(v) // 2], other_record][j % 3])
    r.close()
    b, dsb = _cache("nodeB", redis_server.url)
    for i in range(N):
        assert same(dsb[i], i)
    st = b.stats()
    assert 30 - 4 <= st["remote_corrupt"] <= 30 and st["remote_hits"] >= N - 30 - 4  # (wrap() computed a few)
    assert _logs(caplog).count("is not this cache's record") == 1
    for c in (a, b, other):
        c.close()


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_redis_full_noeviction_and_lru(redis_factory, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    for policy in ("noeviction", "allkeys-lru"):
        server = redis_factory(maxmemory="1500kb", policy=policy)
        a = ShmDatasetCache(session=f"a-{policy}", remote=server.url)
        dsa = a.wrap(Counted(N * 4))  # 960 items x ~800 B + records: more than Redis keeps
        for i in range(N * 4):
            assert same(dsa[i], i)
        _flush(a)
        b = ShmDatasetCache(session=f"b-{policy}", remote=server.url)
        dsb = b.wrap(Counted(N * 4))
        for i in range(N * 4):
            assert same(dsb[i], i)
        st = b.stats()
        assert 0 < st["remote_hits"] < N * 4, st
        if policy == "noeviction":
            assert "out of memory" in _logs(caplog)
        else:
            assert int(server.cli("info", "stats").split("evicted_keys:")[1].split()[0]) > 0
        a.close()
        b.close()
    assert PASSWORD not in _logs(caplog)


def test_wrong_password_trains_on(redis_server, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    cache, ds = _cache("nodeA", redis_server.url.replace(PASSWORD, "not-the-password"))
    for i in range(50):
        assert same(ds[i], i)
    st = cache.stats()
    cache.close()
    assert st["remote_errors"] >= 1 and "refused the credentials" in _logs(caplog)
    assert redis_server.cli("dbsize") == "0"


def test_cluster(redis_cluster, tmp_path):
    calls = tmp_path / "calls"
    a, dsa = _cache("nodeA", redis_cluster.url, calls=calls)
    for i in range(N):
        dsa[i]
    _flush(a)
    b, dsb = _cache("nodeB", redis_cluster.url, calls=calls)
    n0 = len(calls_of(calls))
    got = b.get_batch(list(range(N)))
    assert all(same((got[0][i], got[1][i]), i) for i in range(N))
    assert len(calls_of(calls)) == n0 and b.stats()["remote_hits"] >= N - 4
    assert all(int(s.cli("dbsize")) > N // 6 for s in redis_cluster.servers)
    a.close()
    b.close()


# --- what a user sees: stat, info -----------------------------------------------------------------

def test_stats_and_stat_json_have_the_same_tier_keys_with_a_remote(redis_server, capsys):
    from shmcache.cli.main import main as cli_main

    cache, ds = _cache("agree", redis_server.url)
    for i in range(20):
        ds[i]
    _flush(cache)
    st = cache.stats()
    assert cli_main(["stat", "agree", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    keys = {k for k in st if k == "tiers" or k.startswith(("remote", "tier_"))}
    assert {"remote", "remote_misses", "tiers", "tier_admitted", "tier_pickle_refused"} <= keys
    assert {k: row.get(k) for k in keys} == {k: st[k] for k in keys}
    assert st["tiers"]["remote"]["misses"] == st["remote_misses"] >= 16
    cache.close()


def test_stat_and_info_show_the_remote_never_its_password(redis_server, capsys, monkeypatch, caplog):
    caplog.set_level(logging.DEBUG)
    cache, ds = _cache("nodeA", redis_server.url)
    for i in range(20):
        ds[i]
    _flush(cache)
    assert cli.main(["stat", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    row = next(r for r in rows if r["session"] == "nodeA")
    assert row["remote"] == redis_server.url.replace(PASSWORD, "***")
    assert row["remote_bytes_written"] > 0 and row["remote_misses"] >= 16
    assert cli.main(["stat"]) == 0
    table = capsys.readouterr().out
    assert "remote hits" in table and "backlog" in table
    monkeypatch.setenv("SHMCACHE_REMOTE", redis_server.url)
    assert cli.main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    (r,) = info["remotes"]
    assert r["answers"] and r["used_memory"] > 0 and r["url"] == row["remote"]
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert "answers" in text
    redis_server.kill()
    assert cli.main(["info"]) == 0
    text += capsys.readouterr().out
    assert "does not answer" in text
    cache.close()
    assert PASSWORD not in json.dumps(rows) + table + json.dumps(info) + text + _logs(caplog)


# --- processes: DataLoader workers, exit ---------------------------------------------------------

def test_dataloader_workers_read_and_count_through_the_remote(redis_server):
    import torch
    from torch.utils.data import DataLoader

    a, dsa = _cache("nodeA", redis_server.url)
    for i in range(N):
        dsa[i]
    _flush(a)
    b, dsb = _cache("nodeB", redis_server.url)
    before = b.stats()["remote_hits"]
    seen = 0
    for imgs, labels in DataLoader(dsb, batch_size=16, num_workers=2,
                                   multiprocessing_context="fork"):
        for img, label in zip(imgs, labels):
            i = int(label)  # label = i % 10: find i by content
            assert any(torch.equal(img, torch.from_numpy(expected(k)[0])) for k in range(i, N, 10))
            seen += 1
    assert seen == N
    # the workers' reads are counted in their own rows of the shared counts (NOTE [tier counts])
    assert b.stats()["remote_hits"] - before >= N - 8
    a.close()
    b.close()


EXIT_SCRIPT = r"""
import sys
sys.path.insert(0, {here!r})
from _nodes import Counted
from shmcache import ShmDatasetCache
cache = ShmDatasetCache(session="exiting", remote={url!r})
ds = cache.wrap(Counted({n}))
for i in range({n}):
    ds[i]
# no close(): the write-behind queue is flushed at exit (atexit)
"""


def test_queue_flushed_at_exit(redis_server):
    script = EXIT_SCRIPT.format(here=str(HERE), url=redis_server.url, n=N)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100)
    assert out.returncode == 0, out.stderr[-3000:]
    assert redis_server.values() == N


class _Numbers:
    """A small map-style dataset; ``seed`` makes another dataset of the same length and type."""

    def __init__(self, seed, n=24):
        self.seed, self.n = seed, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(64, self.seed * 1000 + i, np.int64)


def test_an_imported_cache_shares_its_remote_values_by_dataset_not_by_name(redis_server, tmp_path):
    """ShmDatasetCache.from_snapshot opened its remote tier before the import told it the
    dataset, so the tier kept the bare cache name as its identity ('train', where every other
    process of the cache uses 'train.<fingerprint>'): an imported node shared nothing with the
    others, and two datasets imported under one name read each other's values - a wrong value."""
    snaps = {}
    for seed in (1, 2):  # two datasets, both exported as cache "train", items 0-7 only
        cache = ShmDatasetCache(session=f"make{seed}", name="train", remote="")
        ds = cache.wrap(_Numbers(seed))
        for i in range(8):
            ds[i]
        snaps[seed] = tmp_path / f"snap{seed}"
        cache.export(snaps[seed])
        cache.close()
    a = ShmDatasetCache.from_snapshot(snaps[1], session="node_a", remote=redis_server.url)
    b = ShmDatasetCache.from_snapshot(snaps[2], session="node_b", remote=redis_server.url)
    try:
        da, db = a.wrap(_Numbers(1)), b.wrap(_Numbers(2))
        assert int(da[15][0]) == 1015  # computed on node a, written to Redis behind the loop
        a.store.behind[0].flush(5)
        assert int(db[15][0]) == 2015, "node b was served dataset 1's value"
        other = ShmDatasetCache(session="node_c", name="train", remote=redis_server.url)
        try:  # a third node of dataset 1, opened the ordinary way, finds node a's value
            dc = other.wrap(_Numbers(1))
            assert other.store.behind[0].identity == a.store.behind[0].identity
            assert int(dc[15][0]) == 1015
        finally:
            other.close()
    finally:
        a.close()
        b.close()
