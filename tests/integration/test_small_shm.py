"""A small /dev/shm for real: Docker's default 64 MiB, or one already full (issue 8, items 10-12).

Each scenario runs in a process of its own mount namespace, with a real tmpfs of the given size
mounted over /dev/shm (``unshare -m``), so filling it touches nothing of the machine's. The
process reports what it saw as JSON; its log (stderr) is checked here. Everything it made in that
tmpfs goes with the namespace; its session is destroyed by the script (and the registry entry
again by the autouse fixture).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

PRELUDE = r"""
import json, logging, os, sys
import torch
logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="LOG %(levelname)s %(message)s")
from shmcache import ShmDatasetCache
from shmcache.base.memory import memory_limits
from shmcache.base.namespace import namespace
from shmcache.cache.registry import SessionRegistry
OUT = sys.argv[1]
SPILL = sys.argv[2]
ITEM = int(sys.argv[3])

def value(i):
    return torch.full((ITEM // 4,), i, dtype=torch.int32)

def right(v, i):
    return isinstance(v, torch.Tensor) and v.shape == (ITEM // 4,) and bool((v == i).all())

class Source(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n
    def __len__(self):
        return self.n
    def __getitem__(self, i):
        return value(i)

def session_shm_bytes(session):
    reg = SessionRegistry(namespace())
    prefix = reg.segment_prefix(session)
    return sum(os.stat(reg.ns.shm_path(s)).st_blocks * 512 for s in reg.ns.owned_segments()
               if s.startswith(prefix))

def finish(result, *sessions):
    reg = SessionRegistry(namespace())
    for s in sessions:
        if reg.exists(s):
            reg.destroy(s, force=True)
    with open(OUT, "w") as f:
        json.dump(result, f)
"""


def _in_small_shm(tmp_path, body: str, *, shm_size: str = "64m", item: int = 256 << 10,
                  timeout: float = 100) -> tuple[dict, str]:
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts a tmpfs over /dev/shm in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) for a private mount namespace")
    script = tmp_path / "scenario.py"
    script.write_text(PRELUDE + body)
    out, spill = tmp_path / "result.json", tmp_path / "spill"
    spill.mkdir()
    inner = (f"mount -t tmpfs -o size={shm_size} tmpfs /dev/shm || exit 99; "
             f"exec {sys.executable} {script} {out} {spill} {item}")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", inner],
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode == 99 or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs over /dev/shm here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, f"the scenario failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text()), proc.stderr


def _warnings(log: str) -> list[str]:
    return [line for line in log.splitlines() if line.startswith("LOG WARNING")]


# --- 10: with spilling on, shared memory must not cap what goes to disk ---------------------------

SPILL_BY_GET = r"""
N = int(os.environ["N_ITEMS"])
cache = ShmDatasetCache(session="s10", name="c", size=1024, spilling=True, spill_dir=SPILL)
for i in range(N):
    cache.get(i, value)
bad = sum(not right(cache.get(i), i) for i in range(N) if i in cache)
missing = sum(i not in cache for i in range(N))
st = cache.stats()
cache.close()
finish({"bad": bad, "missing": missing, **{k: st[k] for k in ("items_mem", "items_disk", "rejected")}}, "s10")
"""

SPILL_BY_WRAP = r"""
N = int(os.environ["N_ITEMS"])
cache = ShmDatasetCache(session="s10", spilling=True, spill_dir=SPILL, size=1024)
ds = cache.wrap(Source(N))
bad = sum(not right(ds[i], i) for i in range(N))
bad += sum(not right(ds[i], i) for i in range(N))  # the second epoch: from memory or disk
st = cache.stats()
cache.close()
finish({"bad": bad, "missing": 0, **{k: st[k] for k in ("items_mem", "items_disk", "rejected")}}, "s10")
"""


def _check_everything_cached(res: dict, log: str, n: int) -> None:
    assert res["bad"] == 0
    assert res["rejected"] == 0, (f"{res['rejected']} of {n} items were rejected although the disk "
                                  f"had room: {res}\n{log[-3000:]}")
    assert res["missing"] == 0 and res["items_mem"] + res["items_disk"] == n, res
    assert res["items_mem"] > 0 and res["items_disk"] > 0, res
    assert "enable spilling" not in log, f"spilling is on, yet the log says to enable it:\n{log[-2000:]}"
    assert any("spill" in line for line in _warnings(log)), f"nothing says items now go to disk:\n{log[-2000:]}"


@pytest.mark.parametrize("body", [SPILL_BY_GET, SPILL_BY_WRAP], ids=["get", "wrap"])
def test_spilled_items_are_not_limited_by_a_64mib_dev_shm(tmp_path, monkeypatch, body):
    """size=1024, spilling on, 64 MiB /dev/shm: 128 MiB of 64 KiB items. Memory holds ~900 of
    them; the index must then grow (at 1,434 items) in a /dev/shm that data has filled: get(i, fn)
    rejected every item from there on."""
    monkeypatch.setenv("N_ITEMS", "2048")
    res, log = _in_small_shm(tmp_path, body, item=64 << 10)
    _check_everything_cached(res, log, 2048)


@pytest.mark.slow
@pytest.mark.parametrize("body", [SPILL_BY_GET, SPILL_BY_WRAP], ids=["get", "wrap"])
def test_spilled_items_are_not_limited_by_a_64mib_dev_shm_full_size(tmp_path, monkeypatch, body):
    """The issue's numbers: 1 GiB of 256 KiB items, size=1024, spilling on, 64 MiB /dev/shm:
    get(i, fn) cached 2,867 of 4,096 and rejected 1,229."""
    monkeypatch.setenv("N_ITEMS", "4096")
    res, log = _in_small_shm(tmp_path, body, timeout=300)
    _check_everything_cached(res, log, 4096)


# --- 11: /dev/shm already full when the cache is made ---------------------------------------------

FULL_AT_WRAP = r"""
N = 64
left = int(os.environ["LEAVE_FREE"])
with open("/dev/shm/filler", "wb") as f:  # fill the tmpfs to the brim (or to `left` bytes)
    chunk = b"\0" * (1 << 20)
    while True:
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize - left
        if free <= 0:
            break
        try:
            f.write(chunk[:min(len(chunk), free)])
            f.flush()
        except OSError:
            break
cache = ShmDatasetCache(session="s11", spilling=os.environ.get("SPILLING") == "1", spill_dir=SPILL)
ds = cache.wrap(Source(N))
bad = sum(not right(ds[i], i) for i in range(N))
bad += sum(not right(ds[i], i) for i in range(N))
st = cache.stats()
cache.close()
finish({"bad": bad, "rejected": st["rejected"], "items": st["items_mem"] + st["items_disk"],
        "items_disk": st["items_disk"]}, "s11")
"""


@pytest.mark.parametrize("leave_free", [0, 160 << 10], ids=["brim", "160KiB"])
def test_wrap_on_a_full_dev_shm_serves_the_source(tmp_path, monkeypatch, leave_free):
    """Was: InvalidArgument blaming size= (the automatic cap of a full /dev/shm is ~0), or
    SharedMemoryFull from making the cache's own segments."""
    monkeypatch.setenv("LEAVE_FREE", str(leave_free))
    res, log = _in_small_shm(tmp_path, FULL_AT_WRAP, item=64 << 10)
    assert res["bad"] == 0
    assert res["items"] == 0 and res["rejected"] > 0, res
    shm = [line for line in _warnings(log) if "/dev/shm" in line]
    assert len(shm) == 1, f"a full /dev/shm must be reported once, got:\n{log[-3000:]}"
    assert "--shm-size" in shm[0]
    assert "InvalidArgument" not in log and "size=" not in shm[0].split(";")[0]


def test_wrap_on_a_full_dev_shm_spills(tmp_path, monkeypatch):
    """The same with spilling on: when the cache's segments can be made, items go to disk."""
    monkeypatch.setenv("LEAVE_FREE", str(1 << 20))
    monkeypatch.setenv("SPILLING", "1")
    res, log = _in_small_shm(tmp_path, FULL_AT_WRAP, item=64 << 10)
    assert res["bad"] == 0
    assert res["items"] == 64 and res["items_disk"] > 0 and res["rejected"] == 0, res
    assert "enable spilling" not in log


WEDGED_AFTER_FULL = r"""
N = 64
left = int(os.environ["LEAVE_FREE"])
with open("/dev/shm/filler", "wb") as f:  # /dev/shm full for a moment (but for `left` bytes)
    while True:
        free = os.statvfs("/dev/shm").f_bavail * os.statvfs("/dev/shm").f_frsize - left
        if free <= 0:
            break
        try:
            f.write(b"\0" * min(1 << 20, free))
            f.flush()
        except OSError:
            break
first = ShmDatasetCache(session="s11w", name="c")
ds = first.wrap(Source(N))
bad = sum(not right(ds[i], i) for i in range(N))
before = first.stats()["items_mem"]
first.close()
os.unlink("/dev/shm/filler")  # memory is free again: the next run of the job
again = ShmDatasetCache(session="s11w", name="c")
ds = again.wrap(Source(N))
bad += sum(not right(ds[i], i) for i in range(N))
bad += sum(not right(ds[i], i) for i in range(N))
st = again.stats()
again.close()
finish({"bad": bad, "before": before, "items": st["items_mem"], "cap": st["capacity_bytes"]}, "s11w")
"""


@pytest.mark.parametrize("leave_free", [170 << 10, 1 << 20], ids=["no-room", "1MiB"])
def test_an_auto_sized_cache_made_while_dev_shm_was_full_grows_once_it_is_free(tmp_path, monkeypatch,
                                                                               leave_free):
    """size=0 while /dev/shm was full for a moment made a cache with no room (AUTO_NONE) - and it
    stayed so: after memory was freed, the same cache (the next run of the job) still cached
    nothing, until someone destroyed the session."""
    monkeypatch.setenv("LEAVE_FREE", str(leave_free))
    res, log = _in_small_shm(tmp_path, WEDGED_AFTER_FULL, item=64 << 10)
    assert res["bad"] == 0 and res["before"] < 64, res
    assert res["items"] == 64, f"memory was free again, yet the cache holds nothing: {res}\n{log[-2000:]}"


# --- 12: the automatic cap is the session's, not each cache's ---------------------------------------

TWO_AUTO_CACHES = r"""
cap = memory_limits().auto_capacity()
a = ShmDatasetCache(session="s12", name="a")
b = ShmDatasetCache(session="s12", name="b")
n = (cap * 3 // 4) // ITEM   # each cache alone fits; both together do not
for i in range(n):
    a.get(i, value)
for i in range(n):
    b.get(i, value)
for i in range(n):  # and once more: a full session must not let either grow past it
    a.get(n + i, value)
used = session_shm_bytes("s12")
bad = sum(not right(c.get(i), i) for c in (a, b) for i in range(n) if i in c)
rejected = a.stats()["rejected"] + b.stats()["rejected"]
caps = [a.stats()["capacity_bytes"], b.stats()["capacity_bytes"]]
a.close(); b.close()
finish({"cap": cap, "used": used, "bad": bad, "rejected": rejected, "caps": caps}, "s12")
"""


def test_auto_sized_caches_of_a_session_share_one_automatic_cap(tmp_path):
    """Two caches with size=0 in one session each took 80% of /dev/shm: together they filled it."""
    res, log = _in_small_shm(tmp_path, TWO_AUTO_CACHES)
    assert res["bad"] == 0
    assert res["used"] <= res["cap"], (f"the session's caches take {res['used'] / 2**20:.1f} MiB, over "
                                       f"the automatic cap of {res['cap'] / 2**20:.1f} MiB")
    assert res["rejected"] > 0
    assert res["caps"] == [res["cap"], res["cap"]]
    assert any("automatic cap" in line for line in _warnings(log)), f"the full session is not reported:\n{log[-2000:]}"


# --- a cache named before a dataset of a huge len(): its index sized within its cap -------------

HUGE_LEN = r"""
opened_by_name = os.environ["OPENED_BY_NAME"] == "1"
cache = ShmDatasetCache(session="s31", name="c" if opened_by_name else None, size=8)
ds = cache.wrap(Source(10**12))  # a dataset that generates its samples: a len() no cache can hold
bad = sum(not right(ds[i], i) for i in range(20))
st = cache.stats()
used = session_shm_bytes("s31")
cache.close()
finish({"bad": bad, "items_mem": st["items_mem"], "used": used}, "s31")
"""


@pytest.mark.parametrize("opened_by_name", ["1", "0"])
def test_a_dataset_of_a_huge_len_does_not_size_the_index_past_the_caches_cap(tmp_path, monkeypatch,
                                                                             opened_by_name):
    """size=8 (MiB), 64 MiB /dev/shm, a dataset of len() 10**12: wrap() sized the index for all of
    it - in a cache opened by name (reserve_entries) doubling it until /dev/shm had no room, 24 MiB
    of index for a cache of 8 MiB; in one it made, an index that could not be made (served
    uncached). Either way nothing was admitted. Sized up front, it stays within half the cap (it
    grows as it fills)."""
    monkeypatch.setenv("OPENED_BY_NAME", opened_by_name)
    res, log = _in_small_shm(tmp_path, HUGE_LEN, item=1 << 10)
    assert res["bad"] == 0
    assert res["used"] <= (8 << 20) + (1 << 20), f"the cache of 8 MiB holds {res['used'] / 2**20:.1f} MiB"
    assert res["items_mem"] >= 20 - 3, res  # its samples cached (wrap's probes may be counted apart)


# --- pages backed ahead (issue 31) on a /dev/shm that fills --------------------------------------

AHEAD_FAILS = r"""
import time
import numpy as np
from shmcache.base import ahead
from shmcache.cache import codec
from shmcache.cache.store import CacheStore
import shmcache.base.shm as shm

asked = []
real_submit = shm.ahead.submit
shm.ahead.submit = lambda fd, off, n: asked.append(real_submit(fd, off, n)) or asked[-1]

def settle():
    t = time.monotonic() + 20
    while asked and ahead.outcome(asked[-1]) is None and time.monotonic() < t:
        time.sleep(0.001)
    return ahead.outcome(asked[-1]) if asked else None

def free():
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize

def batch(first):
    return [(k, codec.encode(np.full(ITEM // 8, k, np.int64))) for k in range(first, first + 64)]

store = CacheStore("aheadfull", "c", capacity_bytes=256 << 20)  # a cap past /dev/shm's size
assert all(store.put_many(batch(0)))
settle()  # the next run's pages are backed ahead, with room to spare
fd = os.open("/dev/shm/filler", os.O_RDWR | os.O_CREAT, 0o600)
os.posix_fallocate(fd, 0, free() - (1 << 20))  # another user of /dev/shm leaves 1 MiB free
left = free()
stored = sum(store.put_many(batch(64)))  # its pages were backed ahead: it takes none of the 1 MiB
outcome = settle()  # then its next run's pages, ~1.6 MiB: no room
after = free()
try:  # a PyTorch DataLoader worker's batch, say, in what the cache does not hold
    os.posix_fallocate(os.open("/dev/shm/batch", os.O_RDWR | os.O_CREAT, 0o600), 0, 512 << 10)
    batch_ok = True
except OSError:
    batch_ok = False
store.destroy()
finish({"stored": stored, "outcome": outcome, "left": left, "after": after, "batch_ok": batch_ok}, "aheadfull")
"""


def test_a_request_that_finds_dev_shm_full_leaves_the_free_pages_it_found(tmp_path):
    """A range asked ahead that /dev/shm has no room for fails (ENOSPC) and the next commit backs
    its own range (and fails, the cache then full). A posix_fallocate that fails gives back what it
    allocated, so a commit without pages ahead leaves the 1 MiB that was free; the worker's request
    must do the same, not keep the pieces it backed before the one that failed (measured: 0 bytes
    left, and another user's 512 KiB - a DataLoader's batch - no longer fits)."""
    res, log = _in_small_shm(tmp_path, AHEAD_FAILS, shm_size="16m", item=24 << 10)
    if res["outcome"] is None:  # then no batch's pages were backed ahead, and the second one finds 1 MiB
        pytest.skip("pages ahead are not built or turned off here")
    assert res["stored"] == 64, res
    assert res["outcome"] != 0, f"the request found room after all: {res}"
    assert res["after"] >= res["left"] - (64 << 10), (
        f"/dev/shm had {res['left'] >> 10} KiB free before the failed request, {res['after'] >> 10} KiB after it")
    assert res["batch_ok"], res


DESTROYED_AND_MADE_AGAIN = r"""
import gc, time
import numpy as np
from shmcache.base import ahead
from shmcache.cache import codec
from shmcache.cache.store import CacheStore

def free():
    st = os.statvfs("/dev/shm")
    return st.f_bavail * st.f_frsize

def batch(first, n=64):
    return [(k, codec.encode(np.full(ITEM // 8, k, np.int64))) for k in range(first, first + n)]

base = free()
old = CacheStore("again", "c", capacity_bytes=40 << 20)
stored_old = sum(sum(old.put_many(batch(b * 64))) for b in range(20))  # cold batches: the last asks ahead
old.destroy()
old.close()
del old
gc.collect()  # no handle, no mapping of this process left on the destroyed cache's segments
left = free()
new = CacheStore("again", "c", capacity_bytes=40 << 20)  # the same cache made again, and warmed up
stored_new = sum(new.put_many(batch(0, 20 * 64)))
new.destroy()
new.close()
finish({"native": ahead.NATIVE, "base": base, "left": left, "stored_old": stored_old, "stored_new": stored_new},
       "again")
"""


CLEARED_AND_REFILLED = DESTROYED_AND_MADE_AGAIN.replace(
    "old.destroy()\nold.close()\ndel old\n", "old.clear()  # a new generation: the last one's segments unlinked\n"
).replace('new = CacheStore("again", "c", capacity_bytes=40 << 20)', "new = old")


@pytest.mark.parametrize("script, done", [(DESTROYED_AND_MADE_AGAIN, "destroyed and closed"),
                                          (CLEARED_AND_REFILLED, "cleared")], ids=["destroyed", "cleared"])
def test_a_cache_destroyed_or_cleared_and_filled_again_at_once_has_the_room_it_had(tmp_path, script, done):
    """A cache of 30 MiB in a 48 MiB /dev/shm, destroyed (every handle closed) and made again at
    once with the same size - or cleared (a new generation, the last one's segments unlinked) and
    filled again by the same handle -, then warmed up with the same 30 MiB in one put_many (a
    warm-up, an import). Unlinking gives /dev/shm its pages back at once, so everything fits again
    (with SHMCACHE_NATIVE=0: all 1,280 stored). The pages-ahead worker's mapping of the last range
    asked for kept the old segment's file alive - all of its pages, not only the range's - until a
    newer request or MAP_KEEP_S, later still where its SCHED_IDLE thread gets no CPU (measured
    before ahead.release: 17 MiB free after the destroy or clear, 640 of 1,280 stored)."""
    assert "old.clear()" in CLEARED_AND_REFILLED and "new = old" in CLEARED_AND_REFILLED
    res, log = _in_small_shm(tmp_path, script, shm_size="48m", item=24 << 10)
    assert res["stored_old"] == 1280, res
    assert res["left"] >= res["base"] - (1 << 20), (
        f"/dev/shm had {res['base'] >> 20} MiB free before the cache, {res['left'] >> 20} MiB after it was "
        f"{done}: its pages are kept (pages ahead native: {res['native']})")
    assert res["stored_new"] == 1280, res


# the same, in a process of one CPU (a container of one CPU, or every core computing: a DataLoader
# worker per core): the ahead worker, SCHED_IDLE, runs only where that CPU has nothing else to do,
# so the request the last batch asked for may still wait - its descriptor a duplicate of the class
# segment's - when the cache is destroyed or cleared
ONE_CPU = "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # before the worker: it inherits it\n"


@pytest.mark.parametrize("script, done", [(DESTROYED_AND_MADE_AGAIN, "destroyed and closed"),
                                          (CLEARED_AND_REFILLED, "cleared")], ids=["destroyed", "cleared"])
def test_on_one_cpu_a_cache_destroyed_or_cleared_and_filled_again_at_once_has_the_room_it_had(tmp_path, script,
                                                                                              done):
    """As above, on one CPU. ahead.release() unmaps the worker's mapping and has the worker drop the
    mapping of a request under way, but a request that is still waiting (or in the worker's call)
    holds a duplicate descriptor of the unlinked class segment: the whole file (30 MiB) stays until
    the worker, which gets that CPU only when the main thread leaves it, takes and closes it - and it
    then still backs the dead file's range first."""
    res, log = _in_small_shm(tmp_path, ONE_CPU + script, shm_size="48m", item=24 << 10)
    assert res["stored_old"] == 1280, res
    assert res["left"] >= res["base"] - (1 << 20), (
        f"/dev/shm had {res['base'] >> 20} MiB free before the cache, {res['left'] >> 20} MiB after it was "
        f"{done}: its pages are kept (pages ahead native: {res['native']})")
    assert res["stored_new"] == 1280, res
