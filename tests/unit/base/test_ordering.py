"""Memory ordering (shmcache/base/ordering.py, NOTE [publish order]): where fences are made, and where not.

With ``SHMCACHE_ORDERING=membarrier`` x86 runs the weak-ordering path: every writer that publishes
makes a membarrier(2) fence between "bytes visible" and "publish", readers make none. The counts
below are real fences (the syscall returned 0; ordering.fences() counts only those); the strace
test checks the count against the kernel's own record of the system calls."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import textwrap

import pytest

from shmcache.base import ordering

X86 = platform.machine().lower() in ("x86_64", "amd64")


def _run(script: str, env_extra: dict, *, timeout: float = 90, prefix: list[str] | None = None):
    env = dict(os.environ)
    env.update(env_extra)
    proc = subprocess.run([*(prefix or []), sys.executable, "-c", textwrap.dedent(script)], env=env,
                          capture_output=True, text=True, timeout=timeout)
    return proc


_COUNTS = """
import json
import numpy as np
from shmcache.base import ordering
from shmcache.cache.store import MISSING, CacheStore

out = {"mode": ordering.mode()}
def fences(fn):
    before = ordering.fences()
    r = fn()
    return ordering.fences() - before, r

def check(name, fn, want=None):
    n, r = fences(fn)
    out[name] = n
    if want is not None:
        assert r == want or (hasattr(r, "__eq__") and np.array_equal(r, want)), (name, r)
    return r

s = CacheStore("ord", "c", capacity_bytes=64 << 20)
small = np.arange(100, dtype=np.int64)
check("put_first", lambda: s.put(0, small), True)  # a new class segment, commit, layout, publish
check("put", lambda: s.put(1, small), True)
check("put_present", lambda: s.put(1, small), True)
check("put_str", lambda: s.put("k", small), True)
out["values_right"] = all(np.array_equal(s.lookup(k), small) for k in (0, 1, "k"))
check("get", lambda: s.lookup(1).sum(), small.sum())
check("get_str", lambda: s.lookup("k").sum(), small.sum())
check("get_missing", lambda: s.lookup(12345) is MISSING, True)
check("contains", lambda: s.contains(1), True)
check("lookup_batch", lambda: len(s.lookup_batch([0, 1, 7])[0]), 3)
check("gather_ints", lambda: s.gather_ints(np.array([0, 1])) is not None, True)
check("len", lambda: len(s), 3)
check("stats", lambda: s.stats()["items_mem"], 3)
big = np.zeros(150_000 // 8, np.int64)
check("put_150k_first", lambda: s.put(100, big), True)
check("put_150k", lambda: s.put(101, big), True)  # > 64 KiB: one commit (fenced) and one publish
out["big_right"] = bool(np.array_equal(s.lookup(101), big))
from shmcache.tiers.tiered_store import key_of_portable
recs = [(key_of_portable(k), r) for k, r in s.portable_records()]
t = CacheStore("ord", "d", capacity_bytes=64 << 20)
t.put_records(recs[:1])
check("put_records", lambda: t.put_records(recs[1:]), [True] * (len(recs) - 1))
out["n_records"] = len(recs) - 1
out["import_right"] = all(np.array_equal(t.lookup(k), s.lookup(k)) for k in (0, 1, "k", 100, 101))
check("clear", lambda: s.clear())
check("get_after_clear", lambda: s.lookup(1) is MISSING, True)
u = CacheStore("ord", "grow", capacity_bytes=64 << 20)
for i in range(716):
    u.put(10_000 + i, small[:2])
g0 = u.view.refresh().version
check("put_grows", lambda: u.put(20_000, small[:2]), True)  # the 717th entry: > 0.7 * 1024
assert u.view.refresh().version == g0 + 1
for i in range(717):
    assert u.lookup(10_000 + i if i < 716 else 20_000)[1] == 1
check("destroy", lambda: t.destroy())
for c in (s, u):
    c.destroy()
print(json.dumps(out))
"""


def _counts(mode: str) -> dict:
    proc = _run(_COUNTS, {ordering.ENV: mode})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_forced_mode_fences_writers_only_and_every_value_is_right():
    c = _counts("membarrier")
    assert c["mode"] == "membarrier"
    assert c["values_right"] and c["big_right"] and c["import_right"]
    # readers: none
    for reader in ("get", "get_str", "get_missing", "contains", "lookup_batch", "gather_ints", "len",
                   "stats", "get_after_clear", "put_present"):
        assert c[reader] == 0, (reader, c)
    # writers: one fence per publication (a 64 KiB commit step adds one: committed before bump)
    assert c["put"] == 1 and c["put_str"] == 1, c
    assert c["put_first"] == 2, c  # the class's first commit, then the publish
    assert c["put_150k"] == 2, c  # each chunk > 64 KiB is its own commit step
    assert c["clear"] == 2, c  # the new generation before its epoch word; the retirement before reuse
    assert c["put_grows"] == 2, c  # the new table before its epoch word (not one per entry); the publish
    assert c["destroy"] >= 1, c
    # an import: two fences per publish group of records, whatever their commit steps (the 150 KB ones
    # commit one each): see test_an_import_makes_a_fence_per_group_not_per_record
    assert c["put_records"] == 2, c


@pytest.mark.skipif(not X86, reason="on x86 only: elsewhere fences are always on")
def test_x86_default_makes_no_fence():
    c = _counts("")
    assert c["mode"] == "tso"
    assert all(v == 0 for k, v in c.items() if isinstance(v, int) and not isinstance(v, bool)
               and k != "n_records"), c


def test_setting_is_checked():
    proc = _run("import shmcache.cache.store", {ordering.ENV: "none"})
    assert proc.returncode != 0 and "is not a setting" in proc.stderr and ordering.ENV in proc.stderr


def _strace_works() -> bool:  # not under qemu-user emulation (no ptrace there), nor without strace
    return shutil.which("strace") is not None and subprocess.run(
        ["strace", "-qq", "-e", "trace=none", "true"], capture_output=True).returncode == 0


@pytest.mark.skipif(not _strace_works(), reason="needs a working strace")
def test_strace_counts_the_same_fences():
    """The kernel's count of membarrier(GLOBAL_EXPEDITED) calls equals ordering.fences(), and
    the process registered once (REGISTER_GLOBAL_EXPEDITED)."""
    script = """
    import numpy as np
    from shmcache.base import ordering
    from shmcache.cache.store import CacheStore
    s = CacheStore("ord", "st", capacity_bytes=16 << 20)
    for i in range(20):
        s.put(i, np.arange(10))
    for i in range(20):
        s.lookup(i)
    s.destroy()
    print("FENCES", ordering.fences())
    """
    proc = _run(script, {ordering.ENV: "membarrier"}, prefix=["strace", "-f", "-qq", "-e", "trace=membarrier"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    made = int(proc.stdout.split("FENCES")[1])
    calls = proc.stderr.splitlines()
    expedited = [c for c in calls if "membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED," in c]
    register = [c for c in calls if "membarrier(MEMBARRIER_CMD_REGISTER_GLOBAL_EXPEDITED," in c]
    assert len(expedited) == made >= 20, (made, calls[:10])
    assert len(register) == 1, calls[:10]
    assert all(c.rstrip().endswith("= 0") for c in expedited + register), calls[:10]


def test_registration_survives_fork_and_not_exec():
    """What the kernel keeps (checked here, shown with the private command, whose use unregistered
    fails with EPERM): registration is state of the mm; a fresh interpreter (exec) starts
    unregistered, and a forked child's copy of the mm keeps the parent's registration. ordering
    registers again in a forked child all the same (os.register_at_fork; idempotent), so a
    kernel that reset it would not leave a child unfenced, and counts the child's fences apart."""
    script = """
    import errno, os, sys
    from shmcache.base import ordering
    m = ordering._membarrier
    assert m(ordering.MEMBARRIER_CMD_PRIVATE_EXPEDITED) == -errno.EPERM  # after exec: not registered
    assert m(ordering.MEMBARRIER_CMD_REGISTER_PRIVATE_EXPEDITED) == 0
    assert m(ordering.MEMBARRIER_CMD_PRIVATE_EXPEDITED) == 0
    ordering.register()
    ordering.fence()
    assert ordering._registered_pid == os.getpid() and ordering.fences() == 1
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        kept = m(ordering.MEMBARRIER_CMD_PRIVATE_EXPEDITED)
        os.write(w, f"{kept} {ordering._registered_pid == os.getpid()} {ordering.fences()}".encode())
        os._exit(0)
    os.waitpid(pid, 0)
    print(os.read(r, 100).decode())
    """
    proc = _run(script, {ordering.ENV: "membarrier"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    kept, registered, counted = proc.stdout.split()
    assert int(kept) == 0  # the child's mm kept the parent's registration
    assert registered == "True"  # and ordering registered the child (again) at the fork
    assert counted == "0"  # its own count


def test_a_forked_child_reads_and_writes_fenced():
    """A child forked with the cache mapped: its reads are right, its writes make fences."""
    script = """
    import os
    import numpy as np
    from shmcache.base import ordering
    from shmcache.cache.store import CacheStore
    s = CacheStore("ord", "fork", capacity_bytes=16 << 20)
    s.put(1, np.arange(5))
    pid = os.fork()
    if pid == 0:
        ok = s.lookup(1)[4] == 4
        before = ordering.fences()
        ok = ok and s.put(2, np.arange(6)) and ordering.fences() == before + 1
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert s.lookup(2)[5] == 5
    s.destroy()
    print("ok")
    """
    proc = _run(script, {ordering.ENV: "membarrier"})
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-3000:]


_SECCOMP = """
import ctypes, errno, struct
# a seccomp filter that fails membarrier(2) with ENOSYS (as an old kernel would) and allows the rest
BPF_LD_W_ABS, BPF_JEQ_K, BPF_RET_K = 0x20, 0x15, 0x06
ERRNO = 0x00050000 | {errno}
prog = [(BPF_LD_W_ABS, 0, 0, 0), (BPF_JEQ_K, 0, 1, {nr}), (BPF_RET_K, 0, 0, ERRNO), (BPF_RET_K, 0, 0, 0x7FFF0000)]
buf = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in prog))
class Fprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]
fprog = Fprog(len(prog), ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(38, 1, 0, 0, 0) or libc.prctl(22, 2, ctypes.byref(fprog), 0, 0):  # NO_NEW_PRIVS; SECCOMP
    print("NOSECCOMP", ctypes.get_errno())  # qemu-user emulation refuses filters
    raise SystemExit(0)
from shmcache.errors import ShmcacheError
from shmcache.cache.store import CacheStore
try:
    CacheStore("ord", "refused", capacity_bytes=16 << 20)
except ShmcacheError as exc:
    print(type(exc).__name__, exc)
else:
    print("OPENED")
"""


@pytest.mark.parametrize("err", ["ENOSYS", "EPERM"])
def test_membarrier_refused_means_no_cache_with_a_clear_error(err):
    nr = ordering.SYS_MEMBARRIER.get(platform.machine().lower())
    if nr is None:
        pytest.skip("no membarrier number for this machine")
    script = _SECCOMP.format(errno=getattr(__import__("errno"), err), nr=nr)
    proc = _run(script, {ordering.ENV: "membarrier"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    if proc.stdout.startswith("NOSECCOMP"):
        pytest.skip("this machine (or emulator) installs no seccomp filter")
    assert proc.stdout.startswith("OrderingUnavailable"), proc.stdout
    assert "membarrier" in proc.stdout and "seccomp" in proc.stdout and err in proc.stdout
    if X86:
        assert f"unset {ordering.ENV}" in proc.stdout  # forced here: the fix includes not forcing


@pytest.mark.skipif(not X86, reason="x86: the default makes no fence, so a refused membarrier is no matter")
def test_x86_default_needs_no_membarrier():
    script = _SECCOMP.format(errno=38, nr=ordering.SYS_MEMBARRIER["x86_64"]).replace(
        'CacheStore("ord", "refused", capacity_bytes=16 << 20)',
        'CacheStore("ord", "refused", capacity_bytes=16 << 20).destroy()')
    proc = _run(script, {ordering.ENV: ""})
    if proc.stdout.startswith("NOSECCOMP"):
        pytest.skip("this machine (or emulator) installs no seccomp filter")
    assert proc.returncode == 0 and proc.stdout.strip() == "OPENED", (proc.stdout, proc.stderr[-2000:])


def test_forced_mode_two_writer_processes_and_a_reader_process():
    """A CI-sized run of the weak-ordering path across processes: two writers and a reader
    process, values checked by the reader as they appear, then a clear and more writes."""
    script = """
    import os, sys
    import numpy as np
    from shmcache.base import ordering
    from shmcache.cache.store import MISSING, CacheStore
    assert ordering.mode() == "membarrier"
    s = CacheStore("ord", "mp", capacity_bytes=32 << 20)
    pids = []
    for w in range(2):
        pid = os.fork()
        if pid == 0:
            c = CacheStore("ord", "mp", capacity_bytes=32 << 20)
            for i in range(w, 2000, 2):
                c.put(i, np.full(i % 50 + 1, i, np.int64))
            os._exit(0 if ordering.fences() >= 1000 else 3)
        pids.append(pid)
    pid = os.fork()
    if pid == 0:
        c = CacheStore("ord", "mp", capacity_bytes=32 << 20)
        seen = 0
        while seen < 2000:
            seen = 0
            for i in range(2000):
                v = c.lookup(i)
                if v is not MISSING:
                    if len(v) != i % 50 + 1 or (v != i).any():
                        os._exit(4)
                    seen += 1
        os._exit(0 if ordering.fences() == 0 else 5)
    pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) for p in pids]
    assert codes == [0, 0, 0], codes
    s.clear()
    assert s.lookup(5) is MISSING and s.put(5, np.arange(3)) and s.lookup(5)[2] == 2
    s.destroy()
    print("ok")
    """
    proc = _run(script, {ordering.ENV: "membarrier"}, timeout=110)
    assert proc.returncode == 0 and "ok" in proc.stdout, (proc.stdout, proc.stderr[-3000:])


def test_forced_mode_dataset_reads_make_no_fence():
    """ds[i], a batch and a DataLoader-style __getitems__ on a warm cache: no fence."""
    pytest.importorskip("torch")
    script = """
    import numpy as np
    from shmcache.base import ordering
    from shmcache.data.dataset import ShmDatasetCache

    class Src:
        def __len__(self):
            return 64
        def __getitem__(self, i):
            return {"x": np.full(32, i, np.float32), "y": i}

    with ShmDatasetCache(session="ordds", size=64) as cache:
        ds = cache.wrap(Src())
        for i in range(64):
            ds[i]
        before = ordering.fences()
        assert all(int(ds[i]["y"]) == i for i in range(64))
        ds.get_batch(list(range(32)))
        ds.__getitems__(list(range(16, 48)))
        print("READS", ordering.fences() - before, "WRITES", before)
    """
    proc = _run(script, {ordering.ENV: "membarrier"}, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    words = proc.stdout.split()
    assert words[words.index("READS") + 1] == "0"
    assert int(words[words.index("WRITES") + 1]) >= 64


def test_the_default_mode_follows_the_machine():
    """No setting: x86 makes no fence, every other machine fences (aarch64 under emulation too)."""
    proc = _run("from shmcache.base import ordering; print(ordering.mode())", {ordering.ENV: ""})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == ("tso" if X86 else "membarrier")



_IMPORT = """
import json, sys, tempfile
import numpy as np
from shmcache.base import ordering
from shmcache.cache import generation
from shmcache.cache.store import CacheStore
from shmcache.snapshot.export import export_cache
from shmcache.snapshot.load import import_snapshot
from shmcache.tiers.tiered_store import key_of_portable

out = {"group": generation.GROUP_RECORDS}
key = lambda i: i if i % 3 else f"k{i}"
for label, n, size in (("3k", 1000, 3000), ("150k", 64, 150_000)):
    s = CacheStore("ordimp", "src" + label, capacity_bytes=256 << 20)
    for i in range(n):
        s.put(key(i), np.full(size // 8, i, np.int64))
    recs = [(key_of_portable(k), r) for k, r in s.portable_records()]
    t = CacheStore("ordimp", "dst" + label, capacity_bytes=256 << 20, table_hint=n)  # no growth
    before = ordering.fences()
    assert t.put_records(recs) == [True] * n
    out[label] = ordering.fences() - before
    out[label + "_right"] = all(int(t.lookup(key(i))[-1]) == i for i in range(n))
    out[label + "_items"] = t.stats()["items_mem"]
    before = ordering.fences()
    assert t.put_records(recs[:10]) == [True] * 10  # present already: nothing published, no fence
    out[label + "_present"] = ordering.fences() - before
    with tempfile.TemporaryDirectory() as d:  # a snapshot import stores through put_records
        export_cache(s, d + "/snap")
        before = ordering.fences()
        report = import_snapshot(d + "/snap", session="ordimp", name="imp" + label, size_mb=256,
                                 threads=1, progress=False, allow_unsigned=True)
        out[label + "_import"] = ordering.fences() - before
        u = CacheStore("ordimp", "imp" + label, capacity_bytes=256 << 20)
        out[label + "_import_right"] = report.imported == n and all(
            int(u.lookup(key(i))[-1]) == i for i in range(n))
    for c in (s, t, u):
        c.destroy()
print(json.dumps(out))
"""


def test_an_import_makes_a_fence_per_group_not_per_record():
    """put_records (what a snapshot import and a tier hit store through) publishes its records a
    group at a time: two fences per group of up to generation.GROUP_RECORDS records (the
    committed counts before the bumps, the bumps before the entries), not one per record and one
    per commit step (NOTE [publish order])."""
    proc = _run(_IMPORT, {ordering.ENV: "membarrier"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    c = json.loads(proc.stdout.strip().splitlines()[-1])
    groups = lambda n: -(-n // c["group"])  # noqa: E731
    assert c["3k_right"] and c["150k_right"] and c["3k_items"] == 1000 and c["150k_items"] == 64, c
    assert c["3k_import_right"] and c["150k_import_right"], c
    assert c["3k"] <= 2 * groups(1000), c  # was 1000 (+ a fence per 64 KiB commit step)
    assert c["150k"] <= 2 * groups(64), c  # was 128: a publish and a commit step per record
    # an import makes a few more: the new cache's generation, a table growth (then the group
    # is published first: a growth copies READY entries), before it a class's layout
    assert c["3k_import"] <= 2 * groups(1000) + 4 and c["150k_import"] <= 2 * groups(64) + 4, c
    assert c["3k_present"] == 0 and c["150k_present"] == 0, c
