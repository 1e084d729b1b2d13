"""Worker operations run in child processes by the crash and stress tests (see _procs_util.py).

``python _worker.py OP OUT ARGS_JSON`` runs ``op_OP(*ARGS)`` and writes its JSON result to OUT;
``OP = zygote`` serves fork requests on stdin instead. Every loop here is bounded by a deadline or
ends when its parent kills it; nothing waits forever on another process.

Some operations inject a fault into *their own* process only (a ``posix_fallocate`` that reports
ENOSPC, a ``Segment.create`` that SIGKILLs or stalls before a given segment, a reader that is
preempted before a lazy attach): the rest of the system under test is real.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import random
import signal
import sys
import time
import traceback
from pathlib import Path

from _shmcheck import fixed_value, row_value, same_value, value_for

DEADLINE_S = 60.0  # no worker waits longer than this for anything



def _fallocate_fails_after(ok_calls: int) -> list[int]:
    """In this process only: posix_fallocate works ``ok_calls`` times, then raises ENOSPC, as on a
    tmpfs that another process filled. Returns the call counter (one-element list)."""
    real = os.posix_fallocate
    calls = [0]

    def fallocate(fd, offset, length):
        calls[0] += 1
        if calls[0] > ok_calls:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, offset, length)

    os.posix_fallocate = fallocate
    return calls

def _touch(path) -> None:
    Path(path).touch()


def _write_json(path, data) -> None:
    """``data`` into ``path`` whole (a reader polling for the file never sees half of it)."""
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _wait_file(path, timeout_s: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout_s
    p = Path(path)
    while not p.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.0005)


def barrier(barrier_dir) -> None:
    """File barrier: announce readiness, then spin until the parent creates ``go``."""
    _touch(Path(barrier_dir) / f"ready.{os.getpid()}")
    _wait_file(Path(barrier_dir) / "go")


def _value(key, kind: str):
    if kind == "mixed":
        return value_for(key)
    if kind.startswith("rows:"):
        return row_value(key, int(kind.split(":")[1]))
    return fixed_value(key, int(kind.split(":")[1]))


def _store(session, cache, cap, **kw):
    from shmcache.cache.store import CacheStore

    return CacheStore(session, cache, capacity_bytes=cap, **kw)


# --- writers and readers -------------------------------------------------------------------------


def op_put(session, cache, keys, cap, kind="mixed"):
    s = _store(session, cache, cap)
    stored = [s.put(k, _value(k, kind)) for k in keys]
    return {"stored": stored.count(True), "rejected": stored.count(False)}


def op_put_records(session, cache, keys, cap, kind="mixed"):
    """``put_records`` of the keys' values as portable records (what an import stores): one
    group intent per GROUP_RECORDS of them (PublishGroup)."""
    from shmcache.cache import codec
    from shmcache.tiers.tiered_store import portable_record

    s = _store(session, cache, cap)
    recs = [(k, portable_record(codec.encode(_value(k, kind), "a test value"), k)) for k in keys]
    stored = s.put_records(recs)
    return {"stored": stored.count(True), "rejected": stored.count(False)}


def op_clear(session, cache, cap):
    _store(session, cache, cap).clear()
    return {"cleared": True}


def op_reader(session, cache, cap, keys, stop_path, ready_path, kind="mixed"):
    """Hammer lock-free lookups until ``stop_path`` exists; verify every value read."""
    from shmcache.cache.store import MISSING

    s = _store(session, cache, cap)
    rng = random.Random(os.getpid())
    lookups = hits = 0
    bad, errors = [], []
    _touch(ready_path)
    deadline = time.monotonic() + DEADLINE_S
    stop = Path(stop_path)
    while time.monotonic() < deadline:
        for _ in range(200):
            k = rng.choice(keys)
            lookups += 1
            try:
                v = s.lookup(k)
            except Exception as exc:  # a reader must get a value or a miss, never an exception
                errors.append(f"{k!r}: {type(exc).__name__}: {exc}")
                continue
            if v is not MISSING:
                hits += 1
                if not same_value(v, _value(k, kind)) and len(bad) < 20:
                    bad.append(f"{k!r}: read {str(v)[:80]}")
        if stop.exists():
            break
    return {"lookups": lookups, "hits": hits, "bad": bad, "errors": errors[:20],
            "n_errors": len(errors)}


def op_stress(session, cache, cap, seed, n_ops, keys, barrier_dir, clear_every=0):
    """Random get/put on overlapping keys, every value read verified (scenario 10)."""
    from shmcache.cache.store import MISSING

    s = _store(session, cache, cap)
    rng = random.Random(seed)
    barrier(barrier_dir)
    counts = {"hits": 0, "misses": 0, "puts": 0, "rejected": 0, "clears": 0}
    bad, errors = [], []
    t0 = time.monotonic()
    for i in range(n_ops):
        k = rng.choice(keys)
        try:
            if clear_every and i % clear_every == clear_every - 1:
                s.clear()
                counts["clears"] += 1
                continue
            v = s.lookup(k)
            if v is MISSING:
                counts["misses"] += 1
                v = value_for(k)
                counts["puts"] += 1
                if not s.put(k, v):
                    counts["rejected"] += 1
            else:
                counts["hits"] += 1
                if not same_value(v, value_for(k)) and len(bad) < 20:
                    bad.append(f"{k!r}: read {str(v)[:80]}")
        except Exception as exc:
            errors.append(f"op {i} key {k!r}: {type(exc).__name__}: {exc}")
            if len(errors) > 20:
                break
    return {**counts, "bad": bad, "errors": errors, "wall_s": time.monotonic() - t0}


def _uniform(k: int):
    """One layout and one size class for every int key: what the vectorised batch path gathers."""
    import numpy as np

    return np.full(300, k, np.int32)


def op_batch_reader(session, cache, cap, n_keys, stop_path, ready_path, seed):
    """Read batches (gather_ints, lookup_batch) and single str keys until ``stop_path`` exists,
    while others put, grow and clear: every value is right or a miss, nothing raises."""
    import numpy as np

    from shmcache.cache.store import MISSING

    s = _store(session, cache, cap)
    rng = random.Random(seed)
    counts = {"gathered": 0, "batched": 0, "single": 0, "hits": 0}
    bad, errors = [], []
    _touch(ready_path)
    deadline = time.monotonic() + DEADLINE_S
    stop = Path(stop_path)
    while time.monotonic() < deadline and not stop.exists() and len(errors) < 20:
        start = rng.randrange(n_keys - 64)
        keys = np.arange(start, start + rng.choice((8, 64)), dtype=np.int64)
        try:
            got = s.gather_ints(keys)
            if got is not None:
                counts["gathered"] += 1
                column = np.asarray(got[2][0]).reshape(len(keys), -1)
                for k, row in zip(keys.tolist(), column):
                    if not (row == k).all() and len(bad) < 20:
                        bad.append(f"gather_ints key {k}: read {row[:4]}")
            else:
                counts["batched"] += 1
                values, _ = s.lookup_batch(keys.tolist())
                for k, v in zip(keys.tolist(), values):
                    if v is not MISSING:
                        counts["hits"] += 1
                        if not same_value(v, _uniform(k)) and len(bad) < 20:
                            bad.append(f"lookup_batch key {k}: read {str(v)[:80]}")
            k = f"s{rng.randrange(n_keys)}"
            v = s.lookup(k)
            counts["single"] += 1
            if v is not MISSING and not same_value(v, value_for(k)) and len(bad) < 20:
                bad.append(f"lookup {k!r}: read {str(v)[:80]}")
        except Exception as exc:  # a reader gets a value or a miss, never an exception
            errors.append(f"{type(exc).__name__}: {exc}")
    return {**counts, "bad": bad, "errors": errors}


def op_batch_writer(session, cache, cap, n_keys, stop_path, seed, clear_every_s, sweep=False):
    """Put int keys (uniform values) and str keys (values of every size), in random order (or in
    order: ``sweep``, which leaves whole batches behind it), and clear() every ``clear_every_s``
    seconds (0: never), until ``stop_path`` exists."""
    s = _store(session, cache, cap)
    rng = random.Random(seed)
    puts = clears = 0
    errors = []
    deadline = time.monotonic() + DEADLINE_S
    next_clear = time.monotonic() + clear_every_s if clear_every_s else float("inf")
    stop = Path(stop_path)
    while time.monotonic() < deadline and not stop.exists() and len(errors) < 20:
        try:
            if time.monotonic() > next_clear:
                s.clear()
                clears += 1
                next_clear = time.monotonic() + clear_every_s
            i = puts // 2 % n_keys if sweep else rng.randrange(n_keys)
            s.put(i, _uniform(i))
            s.put(f"s{i}", value_for(f"s{i}"))
            puts += 2
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    return {"puts": puts, "clears": clears, "errors": errors}


def op_chaos(session, cache, cap, seed, keys, log_path):
    """Like op_stress, forever (the parent SIGKILLs it at random moments). Problems are appended to
    ``log_path`` at once, since this process never gets to return a result."""
    from shmcache.cache.store import MISSING

    s = _store(session, cache, cap)
    rng = random.Random(seed)
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        k = rng.choice(keys)
        try:
            v = s.lookup(k)
            if v is MISSING:
                s.put(k, value_for(k))
            elif not same_value(v, value_for(k)):
                _log(log_path, f"pid {os.getpid()} key {k!r}: read {str(v)[:80]}")
        except Exception as exc:
            _log(log_path, f"pid {os.getpid()} key {k!r}: {type(exc).__name__}: {exc}")
    return {}


def _log(path, line: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


# --- locks ----------------------------------------------------------------------------------------


def op_hold_flock(path, held_path):
    """Hold an flock on ``path`` until killed (what a live creator or writer does)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    _touch(held_path)
    time.sleep(DEADLINE_S)
    return {}


def op_hold_cache_lock(session, cache, cap, held_path):
    s = _store(session, cache, cap)
    s.lock.acquire()
    _touch(held_path)
    time.sleep(DEADLINE_S)
    return {}


def op_write_across_a_reincarnation(session, cache, cap, what, stopped_path):
    """A write that a forced destroy and a new cache of the same name overtake: this process opens
    the cache, puts key 0, then starts one write (``what``: "label", "fingerprint", "meta" - a
    metadata write - "put" or "put_many") and, holding the cache lock inside it, stops itself (SIGSTOP) after
    touching ``stopped_path``; the test destroys the session, makes the cache again and SIGCONTs
    it. Returns what the write did: its result, or the error it raised."""
    import shmcache.cache.store as store_module
    from shmcache.cache import codec

    s = _store(session, cache, cap)
    s.put(0, value_for(0))

    def stop_here():
        _touch(stopped_path)
        os.kill(os.getpid(), signal.SIGSTOP)

    if what in ("put", "put_many"):
        repair = s.writer.repair

        def stopped_repair(*args, **kw):  # under the lock, the generation mapped, before the write
            stop_here()
            return repair(*args, **kw)

        s.writer.repair = stopped_repair
    else:
        real = store_module.write_json

        def stopped_write_json(path, data, *args, **kw):  # the metadata read, about to be written
            stop_here()
            return real(path, data, *args, **kw)

        store_module.write_json = stopped_write_json
    try:
        if what == "label":
            s.record_label("A's stale label")
        elif what == "fingerprint":
            s.bind_fingerprint("a" * 16)
        elif what == "meta":
            with s.locked():
                s.write_meta({**s.read_meta(), "label": "A's stale label", "spill_path": "/nowhere/a"})
        elif what == "put":
            return {"stored": s.put(7, value_for(7))}
        else:
            return {"stored": s.put_many([(k, codec.encode(value_for(k))) for k in (7, 8, 9)])}
    except Exception as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        s.close()
    return {"raised": None}


def op_hold_registry_lock(held_path):
    from shmcache.cache.registry import SessionRegistry

    reg = SessionRegistry()
    reg._lock.acquire()
    _touch(held_path)
    time.sleep(DEADLINE_S)
    return {}


def op_timed_put(session, cache, cap, key, timeout_s, refused_path=None):
    """A writer that may have to wait for the lock: how long its put took. With ``refused_path``,
    first a put that waits 0.2 s at most, whose outcome goes to that file (the test's handshake:
    refused, so the lock is held), then the put that waits up to ``timeout_s``."""
    if refused_path is not None:
        first = _store(session, cache, cap, lock_timeout_s=0.2)
        stored = first.put(key, value_for(key))  # False: served uncached, the lock is held
        first.close()
        _write_json(refused_path, {"stored": stored})
    s = _store(session, cache, cap, lock_timeout_s=timeout_s)
    t0 = time.monotonic()
    ok = s.put(key, value_for(key))
    return {"ok": ok, "waited_s": time.monotonic() - t0, "done_at": time.time()}


def op_timed_create(name, timeout_s, refused_path=None):
    """``SessionRegistry.create`` that may have to wait for the registry lock; ``refused_path``:
    as op_timed_put's, a first try that waits 0.2 s at most."""
    from shmcache.cache.registry import SessionRegistry
    from shmcache.errors import LockTimeout

    if refused_path is not None:
        try:
            SessionRegistry(timeout_s=0.2).create(name, exist_ok=True)
            stored = True
        except LockTimeout:
            stored = False
        _write_json(refused_path, {"stored": stored})
    t0 = time.monotonic()
    SessionRegistry(timeout_s=timeout_s).create(name, exist_ok=True)
    return {"waited_s": time.monotonic() - t0, "done_at": time.time()}


# --- creation races -------------------------------------------------------------------------------


def op_open_at_barrier(session, cache, cap, barrier_dir, n):
    """Open a brand-new session and cache at the same instant as n-1 others (no rank variables)."""
    from shmcache.cache.registry import SessionRegistry
    from shmcache.cache.store import MISSING

    assert not any(v in os.environ for v in ("RANK", "LOCAL_RANK", "WORLD_SIZE"))
    barrier(barrier_dir)
    s = _store(session, cache, cap)
    info = SessionRegistry().get(session)
    me = os.getpid()
    assert s.put(me, value_for(me))
    _touch(Path(barrier_dir) / f"stored.{me}")
    deadline = time.monotonic() + DEADLINE_S
    while len(list(Path(barrier_dir).glob("stored.*"))) < n:
        if time.monotonic() > deadline:
            raise TimeoutError("the others never stored their keys")
        time.sleep(0.001)
    pids = sorted(int(p.name.split(".")[1]) for p in Path(barrier_dir).glob("stored.*"))
    seen = {p: (v is not MISSING and same_value(v, value_for(p)))
            for p in pids for v in [s.lookup(p)]}
    return {"root_ino": s.view.root._inode, "meta_ino": s.view.mapped.meta._inode,
            "table_ino": s.view.mapped.table._inode, "session_created": info.created,
            "session_creator": info.creator_pid, "seen": sum(seen.values()), "pids": pids}


def op_registry_create_at_barrier(name, barrier_dir, exist_ok):
    from shmcache.cache.registry import SessionRegistry
    from shmcache.errors import SessionExists

    reg = SessionRegistry()
    barrier(barrier_dir)
    try:
        info = reg.create(name, exist_ok=exist_ok)
    except SessionExists as exc:
        return {"exists": str(exc)}
    return {"created": info.created, "creator": info.creator_pid,
            "dir_ino": os.stat(reg.session_dir(name)).st_ino}


def _patch_segment_create(suffix: str, action):
    """Make this process run ``action()`` right before it creates the segment ending in ``suffix``."""
    from shmcache.base import shm as segment

    orig = segment.Segment.create.__func__

    def create(cls, name, *a, **k):
        if name.endswith(suffix):
            action()
        return orig(cls, name, *a, **k)

    segment.Segment.create = classmethod(create)


def _die():
    os.kill(os.getpid(), signal.SIGKILL)


def op_die_creating(session, cache, cap, suffix, then="open"):
    """SIGKILL this process right before it creates the segment ``...suffix`` (a creator, or a
    clear(), dying half-way)."""
    _patch_segment_create(suffix, _die)
    s = _store(session, cache, cap)
    if then == "clear":
        s.clear()
    elif then == "put":
        for k in range(100_000):
            s.put(k, value_for(k))
    return {"survived": True}


def op_die_after_creating(session, cache, cap, suffix):
    """SIGKILL this process right after it created the segment ``...suffix`` (its header ready),
    before it wrote anything into it: a creator dying between two of its statements."""
    from shmcache.base import shm as segment

    orig = segment.Segment.create.__func__

    def create(cls, name, *a, **k):
        seg = orig(cls, name, *a, **k)
        if name.endswith(suffix):
            _die()
        return seg

    segment.Segment.create = classmethod(create)
    _store(session, cache, cap)
    return {"survived": True}


def op_die_in_rename(session, cache, cap):
    """SIGKILL this process at its first os.rename: for a new cache in an existing session, that
    is when write_json() publishes ``<cache>.json`` - after the segments were made."""
    def rename(src, dst, *a, **k):
        _die()

    os.rename = rename
    _store(session, cache, cap)
    return {"survived": True}


def op_die_destroying(session, after="session.json"):
    """SIGKILL this process in the middle of destroy(): right after it removed the first file
    whose path contains ``after`` (``session.json``: while deleting the session directory;
    ``+g1+c``: after the first data segment, while unlinking segments)."""
    from shmcache.cache.registry import SessionRegistry

    real = os.unlink

    def unlink(path, *a, **k):
        real(path, *a, **k)
        if after in os.fspath(path):
            _die()

    os.unlink = unlink
    SessionRegistry().destroy(session, force=True)
    return {"survived": True}


def op_create_without_room(session, cache, cap, ok_calls):
    """Create a cache in a process whose /dev/shm fills up after ``ok_calls`` posix_fallocate
    calls (0: the root cannot be made, 1: the meta, 2: the table); report the error."""
    _fallocate_fails_after(ok_calls)
    try:
        _store(session, cache, cap)
    except Exception as exc:
        return {"type": type(exc).__name__, "error": str(exc)}
    return {"type": None}


def op_slow_creator(session, cache, cap, suffix, started_path, go_path, key):
    """A creator that stalls (holding the cache lock) right before it makes ``...suffix``."""
    _patch_segment_create(suffix, lambda: (_touch(started_path), _wait_file(go_path)))
    s = _store(session, cache, cap)
    s.put(key, value_for(key))
    return {"root_ino": s.view.root._inode}


def op_open(session, cache, cap, timeout_s, key=None):
    """Attach (or create) a cache, optionally store ``key``; report what it mapped or the error."""
    t0 = time.monotonic()
    try:
        s = _store(session, cache, cap, lock_timeout_s=timeout_s)
        if key is not None:
            s.put(key, value_for(key))
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "type": type(exc).__name__,
                "waited_s": time.monotonic() - t0}
    return {"root_ino": s.view.root._inode, "waited_s": time.monotonic() - t0,
            "items": s.stats()["items_mem"]}


def op_preempted_reader(session, cache, cap, key, paused_path, go_path):
    """A lock-free reader that is preempted right before it maps a data segment lazily (it has
    already checked the epoch word and found the entry), as a busy machine does at random."""
    from shmcache.base import shm as segment
    from shmcache.cache.generation import KIND_DATA
    from shmcache.cache.store import MISSING

    s = _store(session, cache, cap)
    s.lookup(-1)  # map the current generation (meta and table; no data segment yet)
    orig = segment.Segment.attach.__func__

    def attach(cls, name, *, kind=None):
        if kind == KIND_DATA:
            _touch(paused_path)
            _wait_file(go_path)
        return orig(cls, name, kind=kind)

    segment.Segment.attach = classmethod(attach)
    try:
        v = s.lookup(key)
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"}
    if v is MISSING:
        return {"missing": True}
    return {"correct": same_value(v, value_for(key))}


# --- jobs, cycles, liveness -------------------------------------------------------------------------


def op_job_member(session, cache, cap, keys, ready_path):
    """One process of a training job: fill its share of the cache, then keep reading until killed."""
    from shmcache.cache.store import MISSING

    s = _store(session, cache, cap)
    misses = 0
    for k in keys:
        if s.lookup(k) is MISSING:
            misses += 1
            s.put(k, value_for(k))
    _touch(ready_path)
    rng = random.Random(os.getpid())
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        k = rng.choice(keys)
        v = s.lookup(k)
        if v is MISSING or not same_value(v, value_for(k)):
            _log(ready_path, f"bad read of {k}")
        if rng.random() < 0.3:  # some writes in flight when the job dies
            s.put(rng.randrange(10**6, 2 * 10**6), value_for(k))
    return {"misses": misses}


class _Source:
    """A deterministic map-style dataset that counts how often it is asked for an item."""

    def __init__(self, n, counter_path):
        self.n, self.counter_path = n, counter_path

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import torch

        _log(self.counter_path, str(i))
        g = torch.Generator().manual_seed(int(i))
        return {"x": torch.rand(3, 16, 16, generator=g), "y": int(i) % 10}


def op_torch_job(session, n, counter_path, ready_path, hang):
    """A DataLoader-free training process using the public API: wrap, read every item."""
    import torch

    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session=session, name="train", size=32)
    ds = cache.wrap(_Source(n, counter_path))
    bad = 0
    for i in range(n):
        item = ds[i]
        g = torch.Generator().manual_seed(i)
        if not torch.equal(item["x"], torch.rand(3, 16, 16, generator=g)) or item["y"] != i % 10:
            bad += 1
    _touch(ready_path)
    if hang:
        time.sleep(DEADLINE_S)
    st = cache.stats()
    cache.close()
    return {"bad": bad, "hits": st["hits"], "items": st["items_mem"]}


def op_cycle(names, seed, cap):
    """One create/attach/use/destroy cycle on a few session names (the parent kills it at random)."""
    from shmcache.cache.registry import SessionRegistry
    from shmcache.errors import InvalidArgument

    rng = random.Random(seed)
    reg = SessionRegistry()
    session = rng.choice(names)
    reg.create(session, exist_ok=True)
    s = _store(session, rng.choice(["a", "b"]), cap)
    for k in rng.sample(range(400), 20):
        s.put(k, value_for(k))
        s.lookup(rng.randrange(400))
    if rng.random() < 0.3:
        s.clear()
    s.close()
    if rng.random() < 0.5:
        try:
            reg.destroy(session)
        except InvalidArgument:  # another live process holds a slot: fine
            pass
    return {"session": session}


def op_slot_churn(session, seconds):
    """Take and release a liveness slot over and over; after each take, check that the slot is
    visibly ours: its file still names our lock and live_pids() reports us."""
    from shmcache.base.locks import LivenessSlot
    from shmcache.cache.registry import MAX_SLOTS, SessionRegistry

    reg = SessionRegistry()
    slots_dir = reg.session_dir(session) / "slots"
    n = lost = invisible = 0
    samples = []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        slot = LivenessSlot(slots_dir, MAX_SLOTS)
        time.sleep(0.0005)
        try:
            ours = os.stat(slot.path).st_ino == os.fstat(slot._fd).st_ino
        except FileNotFoundError:
            ours = False
        if not ours:
            lost += 1
            if os.getpid() not in reg.live_pids(session):
                invisible += 1
            if len(samples) < 5:
                samples.append(f"slot {slot.index}: file {slot.path} no longer names our lock")
        n += 1
        slot.release()
    return {"takes": n, "lost": lost, "invisible": invisible, "samples": samples}


def op_gc_loop(seconds):
    from shmcache.cache.registry import SessionRegistry

    reg = SessionRegistry()
    n = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        reg.gc()
        n += 1
    return {"gcs": n}


# --- a full /dev/shm ----------------------------------------------------------------------------------


def op_enospc(session, cache, cap, ok_calls, keys, kind="mixed"):
    """/dev/shm fills up after ``ok_calls`` posix_fallocate calls of this process: from then on
    every one raises ENOSPC, as on a full tmpfs. Serve every key (get-or-compute), as training does."""
    import logging

    from shmcache.cache.store import MISSING

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    calls = _fallocate_fails_after(ok_calls)
    s = _store(session, cache, cap)
    admitted = rejected = bad = 0
    errors = []
    for k in keys:
        try:
            v = s.lookup(k)
            if v is MISSING:
                v = _value(k, kind)
                if s.put(k, v):
                    admitted += 1
                else:
                    rejected += 1
            if not same_value(v, _value(k, kind)):
                bad += 1
        except Exception as exc:
            errors.append(f"key {k}: {type(exc).__name__}: {exc}")
            if len(errors) >= 5:
                break
    for k in keys:  # the second epoch: what was cached is served, the rest comes from the source
        v = s.lookup(k)
        if v is not MISSING and not same_value(v, _value(k, kind)):
            bad += 1
    st = s.stats()
    return {"admitted": admitted, "rejected": rejected, "bad": bad, "errors": errors,
            "stats_rejected": st["rejected"], "items_mem": st["items_mem"],
            "fallocate_calls": calls[0]}


def op_torch_enospc(session, ok_calls, n):
    """The same through the public API: a wrapped dataset read by a training loop."""
    import logging

    import torch

    from shmcache import ShmDatasetCache

    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s %(message)s")
    calls = _fallocate_fails_after(ok_calls)

    cache = ShmDatasetCache(session=session, name="tiny", size=64)
    source = lambda i: torch.tensor([i, i * 2], dtype=torch.int32)  # noqa: E731
    errors, bad = [], 0
    for epoch in range(2):
        for i in range(n):
            try:
                if not torch.equal(cache.get(i, source), source(i)):
                    bad += 1
            except Exception as exc:
                errors.append(f"epoch {epoch} item {i}: {type(exc).__name__}: {exc}")
                break
    return {"bad": bad, "errors": errors, "items": len(cache), "fallocate_calls": calls[0]}


# --- a writer stopped while it holds the cache lock --------------------------------------------------


def stuck_lock_items(n: int) -> list:
    """The dataset of the stopped-writer tests (the same in every process)."""
    import numpy as np

    return [np.full(100, i, np.int16) for i in range(n)]


def op_read_under_a_stopped_writer(session, cache, n, put_timeout_s):
    """A new process while another holds the cache lock and is stopped (SIGSTOP): open (default
    60 s lock timeout), read hits, compute and serve misses. Reports how long each step took."""
    import logging

    import numpy as np

    from shmcache import ShmDatasetCache

    logs: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            logs.append(record.getMessage())

    logging.getLogger("shmcache").addHandler(Keep(logging.WARNING))
    items = stuck_lock_items(n)
    out = {}
    t0 = time.monotonic()
    c = ShmDatasetCache(session=session, name=cache)  # the default lock timeout (60 s)
    out["open_s"] = time.monotonic() - t0
    out["hits_ok"] = all(np.array_equal(c.get(k), items[k]) for k in range(n))
    out["hits_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    w = ShmDatasetCache(session=session, name=cache, lock_timeout_s=put_timeout_s)
    ds = w.wrap(items)  # opened by name: the recorded fingerprint matches, nothing to write
    out["wrap_s"] = time.monotonic() - t0
    out["ds_hits_ok"] = all(np.array_equal(ds[k], items[k]) for k in range(n))
    timings, values_ok = [], []
    for key in (10**6, 10**6 + 1, 10**6 + 2):  # misses: computed, the write cannot get the lock
        t0 = time.monotonic()
        values_ok.append(np.array_equal(w.get(key, lambda k: np.full(100, k % 999, np.int16)),
                                        np.full(100, key % 999, np.int16)))
        timings.append(time.monotonic() - t0)
    batch = w.get_batch([0, 10**6 + 3], fn=lambda k: np.full(100, k % 999, np.int16))
    values_ok.append(int(batch[1][0]) == (10**6 + 3) % 999 and int(batch[0][0]) == 0)
    out.update(miss_s=timings, values_ok=values_ok, rejected=w.stats()["rejected"],
               cached=[10**6 + i in w for i in range(4)], logs=logs)
    return out


# --- the zygote ---------------------------------------------------------------------------------------


def _run_op(op: str, out: str, args: list) -> int:
    try:
        result = globals()[f"op_{op}"](*args)
        code = 0
    except BaseException as exc:
        result = {"exception": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        code = 1
    tmp = f"{out}.tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.rename(tmp, out)
    return code


def _reap(pid: int, timeout_s: float, kill_after: float | None) -> dict:
    start = time.monotonic()
    killed = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return {"status": os.waitstatus_to_exitcode(status)}
        elapsed = time.monotonic() - start
        if kill_after is not None and not killed and elapsed >= kill_after:
            os.kill(pid, signal.SIGKILL)
            killed = True
        elif elapsed >= timeout_s and not killed:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return {"status": -9, "timed_out": True}
        time.sleep(0.0005)


def zygote() -> None:
    import shmcache.cache.registry  # noqa: F401  (imported once; children start warm)
    import shmcache.cache.store  # noqa: F401
    import shmcache.cli.main  # noqa: F401

    children: set[int] = set()
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # children's prints must not corrupt the protocol
    proto.write(json.dumps({"ready": True}) + "\n")
    for line in sys.stdin:
        req = json.loads(line)
        if req["cmd"] == "spawn":
            pid = os.fork()
            if pid == 0:
                proto.close()
                os._exit(_run_op(req["op"], req["out"], req["args"]))
            children.add(pid)
            reply = {"pid": pid}
        elif req["cmd"] == "wait":
            reply = _reap(req["pid"], req["timeout"], req.get("kill_after"))
            children.discard(req["pid"])
        elif req["cmd"] == "kill":
            try:
                os.kill(req["pid"], req["sig"])
            except ProcessLookupError:
                pass
            reply = {}
        else:
            reply = {"error": f"unknown command {req['cmd']}"}
        proto.write(json.dumps(reply) + "\n")
    for pid in children:  # parent went away or is done: leave nothing behind
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in children:
        try:
            os.waitpid(pid, 0)
        except ChildProcessError:
            pass


if __name__ == "__main__":
    op, out, raw = sys.argv[1], sys.argv[2], sys.argv[3]
    if op == "zygote":
        zygote()
        sys.exit(0)
    sys.exit(_run_op(op, out, json.loads(raw)))
