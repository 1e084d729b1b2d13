"""Workers of tests/integration/test_claims_adversary.py: processes that interrupt, nest and
race batch claims (NOTE [claims]). Not a test module (the leading underscore keeps pytest off it).
"""

from __future__ import annotations

import os
import signal
import time
import traceback

import _claims
import numpy as np


def _enc(pairs):
    from shmcache.cache import codec

    return [(k, codec.encode(v)) for k, v in pairs]


def interrupted(q, trials: int, batch: bool) -> None:
    """Run misses - big batches (``batch``), or one key after another - and interrupt them with
    a real signal (SIGALRM, its handler raising KeyboardInterrupt as Ctrl-C's does) at times that
    land anywhere in the claims' bookkeeping; after each interrupt, report the buckets this
    process still holds, by its own account or as another open file description of the claims
    file (another process's view) finds them."""
    try:
        import faulthandler

        from shmcache.cache import claims as claims_mod
        from shmcache.cache.store import CacheStore

        faulthandler.dump_traceback_later(50, exit=True)  # a hang shows where, then ends the process
        store = CacheStore("adv", "intr", capacity_bytes=16 << 20)
        other = claims_mod.Claims(store.claims.path, lambda: 0)  # another description: another process's view
        other._ready()
        # what a process does once (its slot, its counter row, the maps) done before the interrupts:
        # those are not the claims' bookkeeping, which is what is interrupted here
        store.fill_batch(["first-a", "first-b"], lambda ks: [1] * len(ks), lambda pairs: None)
        store.fill("first-c", lambda k: 1, lambda k, v: None)

        def on_alarm(*_):
            raise KeyboardInterrupt

        signal.signal(signal.SIGALRM, on_alarm)
        landed, leaked, made = 0, [], 0
        for trial in range(trials):
            keys = [f"k{trial}-{i}" for i in range(20000)] if batch else []
            try:
                # armed inside the try: on a loaded machine a 0.3 ms timer can fire before the next
                # line runs, and an interrupt that lands before the miss begins is one like any other
                if batch:
                    signal.setitimer(signal.ITIMER_REAL, 0.002 + 0.004 * (trial % 12))
                else:
                    signal.setitimer(signal.ITIMER_REAL, 0.0003 + 0.0001 * (trial % 7))
                if batch:
                    store.fill_batch(keys, lambda ks: [1] * len(ks), lambda pairs: None)
                else:
                    while True:  # one miss after another until the signal lands
                        made += 1
                        keys.append(f"s{made}")
                        store.fill(keys[-1], lambda k: 1, lambda k, v: None)
                signal.setitimer(signal.ITIMER_REAL, 0)
                continue
            except KeyboardInterrupt:
                landed += 1
            signal.setitimer(signal.ITIMER_REAL, 0)
            busy = []
            for b in {store.claims.bucket(k) for k in keys[-20000:]}:
                if other.take(b) == claims_mod.BUSY:
                    busy.append(b)
                else:
                    other.release(b)
            if busy or store.claims.held:
                leaked.append((trial, len(busy), len(store.claims.held)))
                for b in set(busy) | store.claims.held:  # for the next trial
                    store.claims.release(b)
        other.close()
        store.close()
        q.put(("ok", {"landed": landed, "leaked": leaked}))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))


def nested_holder(q, barrier, keys: list, partner_off: int, count_path: str, claim_timeout_s: float,
                  names: tuple = ("nest", "nest")) -> None:
    """Miss ``keys`` as one batch in cache ``names[0]``; computing each key misses, in cache
    ``names[1]``, the key ``partner_off`` away - which the partner process holds in its own batch
    (a cycle). Reports the seconds the batch took and the values' correctness."""
    try:
        from shmcache.cache.store import CacheStore

        outer = CacheStore("adv", names[0], capacity_bytes=16 << 20, claim_timeout_s=claim_timeout_s)
        store = outer if names[1] == names[0] else CacheStore("adv", names[1], capacity_bytes=16 << 20,
                                                              claim_timeout_s=claim_timeout_s)

        def inner(k):
            _claims.count_one(count_path, b"n")
            return _claims.value_for(k)

        def one(k):
            _claims.count_one(count_path)
            time.sleep(0.02)  # long enough that the partner holds its batch when we miss its keys
            got = store.fill(k + partner_off, inner, lambda kk, v: store.put(kk, v))
            assert np.array_equal(got, _claims.value_for(k + partner_off))
            return _claims.value_for(k)

        barrier.wait(timeout=60)
        t0 = time.monotonic()
        got = outer.fill_batch(list(keys), lambda ks: [one(k) for k in ks], lambda pairs: outer.put_many(_enc(pairs)))
        took = time.monotonic() - t0
        right = all(np.array_equal(g, _claims.value_for(k)) for k, g in zip(keys, got))
        for s in {id(outer): outer, id(store): store}.values():
            s.close()
        q.put(("ok", {"took": took, "right": right, "pid": os.getpid()}))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))


def _distinct_buckets(claims, keys, avoid=frozenset()) -> list:
    """``keys`` whose buckets differ from each other and from ``avoid``, in their order."""
    seen, out = set(avoid), []
    for k in keys:
        b = claims.bucket(k)
        if b not in seen:
            seen.add(b)
            out.append(k)
    return out


def thread_beside_batches(q, barrier, rank: int, keys: list, batch: bool, count_path: str, claimed) -> None:
    """Rank 0: one thread misses ``keys`` (4 at a time as a batch, or one by one), computing each
    for 10 ms under its claims (``claimed``: how many keys it has claimed so far), while another
    thread of the same process misses batch after batch of other keys (buckets of their own) as
    fast as it can. Rank 1: misses the same ``keys`` the same way, each once rank 0 has claimed it
    (so it waits on rank 0's claim). Every computation of ``keys`` is counted (b"k"); reports the
    wrong values and the claim counters."""
    try:
        import threading

        from shmcache.cache.store import CacheStore

        store = CacheStore("adv", "beside", capacity_bytes=32 << 20, claim_timeout_s=60)
        claims = store.claims
        claims._ready()
        mine = {claims.bucket(k) for k in keys}

        def compute_many(ks):
            if rank == 0:
                claimed.value = keys.index(ks[-1]) + 1
            for _ in ks:
                _claims.count_one(count_path, b"k")
            time.sleep(0.01)
            return [_claims.value_for(k) for k in ks]

        def publish_many(pairs):
            store.put_many(_enc(pairs))

        stop = threading.Event()
        filled = [0]

        def filler():  # batch after batch of fresh misses whose buckets are none of ``keys``'
            fresh = 1 << 40
            while not stop.is_set():
                ks = _distinct_buckets(claims, range(fresh, fresh + 64), mine)
                fresh += 64
                store.fill_batch(ks, lambda b: [0] * len(b), lambda pairs: None)
                filled[0] += 1

        barrier.wait(timeout=60)
        side = None
        if rank == 0:
            side = threading.Thread(target=filler)
            side.start()
        got = []
        try:
            for lo in range(0, len(keys), 4 if batch else 1):
                deadline = time.monotonic() + 30
                while rank == 1 and claimed.value <= lo and time.monotonic() < deadline:
                    time.sleep(0.0005)  # right behind rank 0: it holds this key's claim now
                if batch:
                    got += store.fill_batch(keys[lo:lo + 4], compute_many, publish_many)
                else:
                    got.append(store.fill(keys[lo], lambda k: compute_many([k])[0],
                                          lambda k, v: publish_many([(k, v)])))
        finally:
            stop.set()
            if side is not None:
                side.join(30)
        wrong = sum(not np.array_equal(g, _claims.value_for(k)) for k, g in zip(keys, got))
        st = store.stats()
        held = len(claims.held)
        store.close()
        q.put(("ok", {"rank": rank, "wrong": wrong, "held": held, "filled": filled[0],
                      **{k: st[k] for k in ("claim_waits", "claim_timeouts")}}))
    except BaseException:  # noqa: BLE001 - reported to the test
        q.put(("error", traceback.format_exc()))
