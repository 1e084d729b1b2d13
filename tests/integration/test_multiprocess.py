"""Several real processes on one cache: ranks that wrap the same dataset share one copy of it
(epoch 1 disjoint shards, epoch 2 reshuffled: every read a hit, each item stored once, shared
memory close to the payload), and processes racing on get(key, fn) over overlapping keys store
each key once and always read the source's value.
"""

from __future__ import annotations

import multiprocessing
import os
import queue as queue_mod

import _workers
from _workers import FixedDataset, VarDataset, value_for_key

from shmcache import ShmDatasetCache
from shmcache.cache.store import CacheStore


def _run(ctx, target, args_for_rank, nprocs, timeout_s=100):
    """Start ``nprocs`` processes with a shared barrier, collect one result from each, reap all."""
    q = ctx.Queue()
    barrier = ctx.Barrier(nprocs)
    procs = [ctx.Process(target=target, args=(q, barrier, *args_for_rank(r)), daemon=True)
             for r in range(nprocs)]
    for p in procs:
        p.start()
    results, errors = [], []
    try:
        for _ in range(nprocs):
            try:
                status, payload = q.get(timeout=timeout_s)
            except queue_mod.Empty:
                errors.append(f"a process gave no result within {timeout_s}s "
                              f"(exit codes {[p.exitcode for p in procs]})")
                break
            (results if status == "ok" else errors).append(payload)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        q.close()
        q.join_thread()
    assert not errors, "\n".join(errors)
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    return results


N = 20000
BOUNDS = {"fixed": 1.05, "var": 1.10}


def test_ranks_share_one_copy_of_the_dataset():
    """4 spawned ranks wrap the same dataset (name=None: they must all find one cache through the
    fingerprint). Epoch 1: rank r reads indices r::4. Epoch 2: a reshuffled assignment. Every
    value is checked bit for bit in the process that read it. Done for fixed-shape samples (3 KB
    uint8 + an int label) and for variable-size ones (1-8 KB), in the same 4 processes."""
    ctx = multiprocessing.get_context("spawn")
    results = _run(ctx, _workers.shard_worker, lambda r: (r, 4, N, list(BOUNDS), 11), 4)
    problems = []
    for kind, bound in BOUNDS.items():
        by_rank = sorted((x for res in results for x in res if x["kind"] == kind),
                         key=lambda x: x["rank"])
        problems += _check_shards(kind, bound, by_rank)
    assert not problems, "\n".join(problems)


def _check_shards(kind, bound, by_rank) -> list[str]:
    out = []
    if len({r["name"] for r in by_rank}) != 1:
        return [f"{kind}: the ranks found different caches: {[r['name'] for r in by_rank]}"]
    if sum(r["epoch1_calls"] for r in by_rank) > N:
        out.append(f"{kind}: epoch 1 read the source more than once per item")
    for r in by_rank:
        if r["epoch2_calls"]:
            out.append(f"{kind}: rank {r['rank']} read the source {r['epoch2_calls']}x in epoch 2")
        assert r["epoch2_reads"] == N // 4
    st = by_rank[0]["stats"]
    if st["items_mem"] != N or st["rejected"]:
        out.append(f"{kind}: {st['items_mem']} items stored for {N} (rejected {st['rejected']})")
    if (st["hits"], st["misses"]) != (N + 3, N - 3):  # 3 probes put by wrap() hit in epoch 1
        out.append(f"{kind}: hits/misses {st['hits']}/{st['misses']}, expected {N + 3}/{N - 3}")
    src = FixedDataset(N, 3072, 11) if kind == "fixed" else VarDataset(N, seed=11)
    payload = N * (3072 + 8) if kind == "fixed" else src.payload_bytes()
    ratio = st["shm_bytes"] / payload
    if ratio > bound:
        out.append(f"{kind}: shared memory {st['shm_bytes']} B = {ratio:.3f} x payload {payload} B "
                   f"(bound {bound})")
    store = CacheStore("shards", by_rank[0]["name"], create=False)  # still there after they exit
    if len(store) != N:
        out.append(f"{kind}: {len(store)} items after the ranks exited")
    store.close()
    return out


def test_processes_racing_on_get_store_each_key_once():
    """RELIABILITY.md scenario 10: N processes x random get(key, fn) on overlapping keys."""
    keys = list(range(-50, 250)) + [f"key-{i}" for i in range(100)] + [f"k{i}".encode() for i in range(50)]
    ctx = multiprocessing.get_context("fork")  # cheap; spawned ranks are covered above
    results = _run(ctx, _workers.random_get_worker, lambda r: (r, keys, 1500, "overlap"), 3)
    with ShmDatasetCache(session="overlap", name="overlap") as cache:
        st = cache.stats()
        touched = len(keys)  # 4500 draws over 450 keys: each is drawn (p of a miss ~ e^-10)
        assert st["items_mem"] == touched, "a key was stored more than once (or lost)"
        assert sum(r["computed"] for r in results) >= touched
        assert st["hits"] + st["misses"] == 3 * 1500
        # a miss computes, or gets the value another process computed under its claim (NOTE [claims])
        assert st["misses"] == sum(r["computed"] for r in results) + st["claim_waits"]
        assert st["computed"] == sum(r["computed"] for r in results)
        for k in keys:
            _workers.assert_same(cache[k], value_for_key(k), f"key {k!r}")
        # bytes counted once per key: each record's length is known up to where its layout lives
        # (the shared layout table holds 128; the others are stored inline in their record)
        interned = sum(_record_len(k, False) for k in keys)
        inline = sum(_record_len(k, True) for k in keys)
        assert interned <= st["bytes_mem"] <= inline
        index = cache.store.view.refresh().index
        assert st["bytes_mem"] == sum(w0 >> 32 for w0, _, _ in index.entries())
        assert len(list(index.entries())) == touched


def _record_len(key, inline: bool) -> int:
    from shmcache.cache import codec
    from shmcache.cache.index import key_bytes

    return codec.encode(value_for_key(key)).record_len(len(key_bytes(key)[1]), inline)


def test_a_reader_in_another_process_never_sees_a_wrong_value_while_the_table_grows():
    """A forked reader loops over keys while this process inserts thousands of them (the table
    grows several times): every value it finds is the right one."""
    writer = CacheStore("grow", "race", capacity_bytes=64 << 20)
    writer.put(0, 0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # reader
        code = 1
        try:
            os.close(w)
            reader = CacheStore("grow", "race", create=False)
            found, wrong = 0, 0
            os.set_blocking(r, False)
            while True:
                for k in range(0, 6000, 7):
                    v = reader.lookup(k, count=False)
                    if v is not reader_missing():
                        found += 1
                        wrong += v != k * 3
                try:
                    if os.read(r, 1) == b"":
                        break
                except BlockingIOError:
                    pass
            code = 0 if wrong == 0 and found > 0 else 2
        finally:
            os._exit(code)
    os.close(r)
    for k in range(1, 6000):
        writer.put(k, k * 3)
    os.close(w)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the reader saw a wrong value (or nothing)"
    assert writer.view.refresh().index.capacity >= 8192
    writer.close()


def reader_missing():
    from shmcache.cache.store import MISSING

    return MISSING
