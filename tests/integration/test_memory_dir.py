"""A session's shared memory in a directory the user names (issue 27): ``$SHMCACHE_MEMORY_DIR``,
``shmcache new --memory-dir``, the launcher's ``--memory-dir``, ``memory_dir=``.

The journeys run in a process of its own mount namespace (``unshare -m``, as root) with real mounts
in it: a small tmpfs standing in for a container's, a tmpfs mounted ``huge=always``, a hugetlbfs
with no huge pages reserved. The script there starts the processes a user would - a writer with
the variable, a reader and the CLI without it - and reports what they saw as JSON. Everything it
made goes with the namespace's mounts; what the checks below need is that nothing was left in them
before that. The refusals need no mount of their own: /dev/shm is a tmpfs to make directories in.
"""

from __future__ import annotations

import importlib
import json
import mmap
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

from shmcache import ShmDatasetCache
from shmcache.base.memdir import pmd_size
from shmcache.cache.registry import SessionRegistry
from shmcache.errors import InvalidArgument, NotOwner

SCRIPT = r"""
import json, os, subprocess, sys
from concurrent.futures import ThreadPoolExecutor
OUT, SMALL, HUGE, HTLB, ADVISE = sys.argv[1:6]
PY = sys.executable
ENV = {k: v for k, v in os.environ.items() if k != "SHMCACHE_MEMORY_DIR"}

def run(code, memory_dir=None, *args):
    env = dict(ENV)
    if memory_dir:
        env["SHMCACHE_MEMORY_DIR"] = memory_dir
    p = subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, (code[:80], p.returncode, p.stderr[-3000:])
    return p.stdout

def cli(*argv):
    p = subprocess.run([PY, "-m", "shmcache", *argv], capture_output=True, text=True, env=ENV, timeout=60)
    return {"rc": p.returncode, "out": p.stdout, "err": p.stderr}

def files(mount):
    d = os.path.join(mount, "shmcache-%d" % os.getuid())
    return sorted(os.listdir(d)) if os.path.isdir(d) else []

def in_dev_shm(session):
    return [e for e in os.listdir("/dev/shm") if ("+%s+" % session) in e]

WRITE = '''
import sys, numpy as np
from shmcache import ShmDatasetCache
c = ShmDatasetCache(session=sys.argv[1], name="c", size=int(sys.argv[2]))
for i in range(int(sys.argv[3])):
    c.put(i, np.full(int(sys.argv[4]) // 4, i, dtype=np.int32))
s = c.stats()
print(s["items_mem"], s["rejected"])
'''
READ = '''
import json, sys, numpy as np
from shmcache import ShmDatasetCache
c = ShmDatasetCache(session=sys.argv[1], name="c", create=False)
n = int(sys.argv[2])
ok = all(int(c.get(i)[0]) == i and int(c.get(i)[-1]) == i for i in range(n))
b = c.get_batch(np.arange(n))
print(json.dumps({"ok": ok, "batch": bool((b[:, 0] == np.arange(n)).all())}))
'''
PAGES = r'''
import json, re, sys, numpy as np
from shmcache import ShmDatasetCache
c = ShmDatasetCache(session=sys.argv[1], name="c", size=64)
for i in range(2000):
    c.put(i, np.full(3000 // 4, i, dtype=np.int32))
assert (c.get_batch(np.arange(2000))[:, 5] == np.arange(2000)).all()
pmd_kb, hg, cur = 0, False, False
for line in open("/proc/self/smaps"):
    if re.match(r"[0-9a-f]+-[0-9a-f]+ ", line):  # a mapping: is it a data segment in the mount?
        cur = sys.argv[2] in line and line.rstrip().rsplit("+", 1)[-1][:1] == "c"
    elif cur and line.startswith(("ShmemPmdMapped:", "FilePmdMapped:")):
        pmd_kb += int(line.split()[1])
    elif cur and line.startswith("VmFlags:"):
        hg = hg or "hg" in line.split()
print(json.dumps({"pmd_kb": pmd_kb, "hg": hg}))
'''
# sessions of their own, each in its own processes: side by side (each process imports torch)
def pages(mount, session):
    return json.loads(run(PAGES, mount, session, mount))

SESSIONS = ("mem-pages-huge", "mem-pages-advise", "mem-pages-small")
with ThreadPoolExecutor(3) as pool:
    result = dict(zip(("pages_huge", "pages_advise", "pages_small"), pool.map(pages, (HUGE, ADVISE, SMALL), SESSIONS)))
for s in SESSIONS:
    cli("destroy", s)

def journey(tag, mount):
    s = "mem-" + tag
    written = run(WRITE, mount, s, "4", "200", "3000").split()
    read = json.loads(run(READ, None, s, "200"))  # no variable: the session says where
    r = {"written": written, "read": read, "files": files(mount), "dev_shm": in_dev_shm(s),
         "stat": json.loads(cli("stat", s, "--json")["out"]), "stat_text": cli("stat", s)["out"],
         "info": cli("info")["out"]}
    r["destroy"] = cli("destroy", s)
    r["after_destroy"] = files(mount)
    return r

with ThreadPoolExecutor(2) as pool:
    result.update(zip(("small", "huge"), pool.map(journey, ("small", "huge"), (SMALL, HUGE))))

# gc: a session whose destroy died after its directory went away leaves segments in the mount
run(WRITE, SMALL, "mem-gc", "4", "10", "3000")
ns = json.loads(cli("info", "--json")["out"])["namespace"]
os.rename(os.path.join(ns, "sessions", "mem-gc"), os.path.join(ns, "sessions", ".mem-gc.tmp-destroy-1-x"))
result["gc_before"] = files(SMALL)
result["gc"] = cli("gc")
result["gc_after"] = files(SMALL)

# a full small mount: a cap larger than the mount, the mount nearly filled by someone else
with open(os.path.join(SMALL, "ballast"), "wb") as f:
    f.write(b"x" * (10 << 20))
out = run(WRITE, SMALL, "mem-full", "64", "100", str(256 << 10)).split()
result["full"] = {"items_mem": int(out[0]), "rejected": int(out[1]),
                  "read": json.loads(run(READ, None, "mem-full", out[0]))}
auto = run('''
import sys
from shmcache import ShmDatasetCache
c = ShmDatasetCache(session="mem-auto", name="c", size=0)
c.put(0, b"x" * 1000)
print(c.stats()["capacity_bytes"])
''', SMALL)
result["auto_capacity"] = int(auto)
cli("destroy", "mem-full")
cli("destroy", "mem-auto")
os.unlink(os.path.join(SMALL, "ballast"))
result["full_after"] = files(SMALL)

# hugetlbfs without a huge page reserved: not even the cache's own segments fit, never a SIGBUS
if HTLB != "-":
    result["htlb"] = run('''
import numpy as np
from shmcache import ShmDatasetCache
c = ShmDatasetCache(session="mem-htlb", name="c", size=16)
print(int(c.get(3, lambda k: np.full(8, k))[0]), c.stats().get("rejected"))
''', HTLB).split()
    cli("destroy", "mem-htlb")
    result["htlb_after"] = files(HTLB)
# a session whose mount only this namespace sees: the test runs gc outside, where it is not
run(WRITE, HUGE, "mem-kept", "4", "3", "3000")
result["namespace"] = ns
with open(OUT, "w") as f:
    json.dump(result, f)
"""


def _in_mounts(tmp_path: Path) -> dict:
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts tmpfs and hugetlbfs in a private mount namespace")
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare(1) (util-linux) for a private mount namespace")
    small, huge, htlb, advise = tmp_path / "small", tmp_path / "huge", tmp_path / "htlb", tmp_path / "advise"
    for d in (small, huge, htlb, advise):
        d.mkdir()
    script, out = tmp_path / "scenario.py", tmp_path / "result.json"
    script.write_text(SCRIPT)
    inner = (f"mount -t tmpfs -o size=16m,mode=1777 tmpfs {small} || exit 99; "
             f"mount -t tmpfs -o size=64m,huge=always tmpfs {huge} || exit 99; "
             f"mount -t tmpfs -o size=64m,huge=advise tmpfs {advise} || exit 99; "
             f"H={htlb}; mount -t hugetlbfs none {htlb} || H=-; "
             f"exec {sys.executable} {script} {out} {small} {huge} $H {advise}")
    proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", inner],
                          capture_output=True, text=True, timeout=500)
    if proc.returncode == 99 or "unshare failed" in proc.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, f"the scenario failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def journey(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("memdir")
    old = os.environ.get("SHMCACHE_DIR")
    os.environ["SHMCACHE_DIR"] = str(tmp / "ns")  # the module's own namespace (the fixture's is per test)
    try:
        yield _in_mounts(tmp)
    finally:
        if old is None:
            os.environ.pop("SHMCACHE_DIR", None)
        else:
            os.environ["SHMCACHE_DIR"] = old


@pytest.mark.parametrize("tag", ["small", "huge"])
def test_a_session_lives_in_the_mount_and_is_found_without_the_variable(journey, tag):
    r = journey[tag]
    assert r["written"] == ["200", "0"]
    assert r["read"] == {"ok": True, "batch": True}  # another process, no variable: right values
    assert any(f.endswith("+root") for f in r["files"]) and any(f.rsplit("+", 1)[1][:1] == "c" for f in r["files"])
    assert r["dev_shm"] == []  # nothing of it in /dev/shm
    (row,) = r["stat"]
    assert row["items_mem"] == 200
    assert row["memory_dir"].endswith(f"/{tag}")
    huge = tag == "huge"  # stat says what backs it: the mount's huge=, its page size
    assert row["page_size"] == (pmd_size() if huge else mmap.PAGESIZE), row
    assert row["pages"] == (f"{pmd_size() >> 20} MiB pages (tmpfs huge=always)" if huge
                            else f"{mmap.PAGESIZE >> 10} KiB pages (tmpfs huge=never)")
    assert row["huge_pages_would_help"] is False  # 600 KB: within a TLB's reach
    assert r["destroy"]["rc"] == 0, r["destroy"]
    assert r["after_destroy"] == []  # destroy leaves the mount empty


def test_huge_pages_back_a_huge_mount_and_are_asked_for_on_an_advise_one(journey):
    assert journey["pages_huge"]["pmd_kb"] > 0, journey["pages_huge"]  # PMD-mapped: huge pages
    assert journey["pages_small"]["pmd_kb"] == 0 and not journey["pages_small"]["hg"]
    assert journey["pages_advise"]["hg"], journey["pages_advise"]  # madvise(MADV_HUGEPAGE) on it


def test_gc_sweeps_a_memory_directory(journey):
    assert journey["gc_before"], "the scenario left no segments for gc to find"
    assert journey["gc"]["rc"] == 0, journey["gc"]
    assert journey["gc_after"] == []


def test_a_full_small_mount_is_full_not_a_crash(journey):
    full = journey["full"]
    assert 0 < full["items_mem"] < 100 and full["rejected"] == 100 - full["items_mem"]
    assert full["read"] == {"ok": True, "batch": True}
    assert 0 < journey["auto_capacity"] <= 16 << 20  # 80% of what that mount has, not of /dev/shm
    assert journey["full_after"] == []


def test_a_hugetlbfs_without_pages_serves_uncached(journey):
    if "htlb" not in journey:
        pytest.skip("no hugetlbfs mount here")
    assert journey["htlb"][0] == "3"
    assert journey["htlb_after"] == []


def test_gc_where_the_mount_is_not_visible_keeps_the_session_whole(journey):
    """`shmcache gc` in another mount namespace (the host, for a container's tmpfs) sees no root:
    no proof that the cache is gone, so its metadata stays; destroy there removes the session."""
    env = {**{k: v for k, v in os.environ.items() if k != "SHMCACHE_MEMORY_DIR"}, "SHMCACHE_DIR": journey["namespace"]}
    meta = Path(journey["namespace"], "sessions", "mem-kept", "caches", "c.json")
    assert meta.exists()
    p = subprocess.run([sys.executable, "-m", "shmcache", "gc"], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    assert meta.exists(), p.stdout
    p = subprocess.run([sys.executable, "-m", "shmcache", "stat", "mem-kept", "--json"], capture_output=True,
                       text=True, env=env, timeout=60)
    (row,) = json.loads(p.stdout)
    assert "is not usable now" in row["error"] and "not in memory" in row["error"], row  # says why
    p = subprocess.run([sys.executable, "-m", "shmcache", "destroy", "mem-kept"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0 and not meta.exists(), p.stderr


# --- refusals: the named directory checked as /dev/shm's names are -------------------------------


@pytest.fixture
def shm_dir():
    """A fresh directory in /dev/shm (a tmpfs), removed after the test."""
    path = Path("/dev/shm") / f"shmcache-test-{uuid.uuid4().hex[:8]}"
    path.mkdir(mode=0o700)
    yield path
    shutil.rmtree(path, ignore_errors=True)
    if path.is_symlink():
        path.unlink()


def test_a_directory_on_disk_is_refused_with_the_fix(tmp_path):
    with pytest.raises(InvalidArgument, match=r"not in memory \(tmpfs or hugetlbfs\).*mount -t tmpfs"):
        SessionRegistry().create("s", memory_dir=tmp_path)
    assert not (tmp_path / f"shmcache-{os.getuid()}").exists()


def test_a_symlink_is_refused(tmp_path, shm_dir):
    link = tmp_path / "link"
    link.symlink_to(shm_dir)
    with pytest.raises(NotOwner, match="is a symlink"):
        SessionRegistry().create("s", memory_dir=link)


def test_a_directory_others_can_write_without_sticky_is_refused(shm_dir):
    os.chmod(shm_dir, 0o777)
    with pytest.raises(NotOwner, match=r"writable by others \(mode 0777\) without the sticky bit.*chmod \+t"):
        SessionRegistry().create("s", memory_dir=shm_dir)
    os.chmod(shm_dir, 0o1777)  # sticky, as /dev/shm: accepted
    SessionRegistry().create("s", memory_dir=shm_dir)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another user")
def test_a_directory_of_another_user_is_refused(shm_dir):
    os.chown(shm_dir, 65534, 65534)
    with pytest.raises(NotOwner, match="belongs to uid 65534"):
        SessionRegistry().create("s", memory_dir=shm_dir)


def test_a_private_directory_squatted_by_a_symlink_is_refused(shm_dir, tmp_path):
    (shm_dir / f"shmcache-{os.getuid()}").symlink_to(tmp_path)
    with pytest.raises(NotOwner, match="symlink"):
        SessionRegistry().create("s", memory_dir=shm_dir)


def test_segments_are_private_files_in_a_private_directory(shm_dir):
    c = ShmDatasetCache(session="s", name="c", size=4, memory_dir=shm_dir)
    c.put(1, b"abc")
    private = shm_dir / f"shmcache-{os.getuid()}"
    assert private.stat().st_mode & 0o777 == 0o700
    segs = list(private.iterdir())
    assert segs and all(p.stat().st_mode & 0o777 == 0o600 and p.stat().st_uid == os.getuid() for p in segs)
    c.close()
    with pytest.raises(InvalidArgument, match=f"keeps its shared memory in {shm_dir}"):
        ShmDatasetCache(session="s", name="c", memory_dir="/dev/shm")
    SessionRegistry().destroy("s")
    assert list(private.iterdir()) == []


def test_the_cli_and_the_launcher_refuse_a_directory_on_disk(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "SHMCACHE_MEMORY_DIR"}
    p = subprocess.run([sys.executable, "-m", "shmcache", "new", "s", "--memory-dir", str(tmp_path)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode != 0 and "not in memory" in p.stderr and "mount -t tmpfs" in p.stderr
    p = subprocess.run([sys.executable, "-m", "shmcache.launch", "--memory-dir", str(tmp_path), "-m", "json.tool"],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and "argument --memory-dir" in p.stderr and "not in memory" in p.stderr


WORKER = """
import os, sys, numpy as np
from shmcache import ShmDatasetCache
c = ShmDatasetCache(name="c", size=4)  # the launcher's session
rank = int(os.environ["RANK"])
c.put(rank, np.full(10, rank))
print("MEMDIR", rank, os.environ.get("SHMCACHE_MEMORY_DIR"), c.session, flush=True)
"""


def test_the_launcher_makes_its_session_in_the_memory_directory(shm_dir, tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k != "SHMCACHE_MEMORY_DIR"}
    p = subprocess.run([sys.executable, "-m", "shmcache.launch", "--nproc", "2", "--session", "job",
                        "--memory-dir", str(shm_dir), str(script)], capture_output=True, text=True, env=env,
                       timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = sorted(ln.split() for ln in p.stdout.splitlines() if ln.startswith("MEMDIR"))
    assert lines == [["MEMDIR", "0", str(shm_dir), "job"], ["MEMDIR", "1", str(shm_dir), "job"]]
    assert SessionRegistry().get("job").memory_dir == str(shm_dir)
    private = shm_dir / f"shmcache-{os.getuid()}"
    assert any(p.name.endswith("+root") for p in private.iterdir())
    # a later run that names another directory for the same session is refused before it starts
    p = subprocess.run([sys.executable, "-m", "shmcache.launch", "--session", "job", "--memory-dir", "/dev/shm",
                        str(script)], capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 2 and f"keeps its shared memory in {shm_dir}" in p.stderr
    p = subprocess.run([sys.executable, "-m", "shmcache", "destroy", "job"], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0 and list(private.iterdir()) == []


def test_shmcache_new_records_the_memory_directory(shm_dir):
    env = {k: v for k, v in os.environ.items() if k != "SHMCACHE_MEMORY_DIR"}
    p = subprocess.run([sys.executable, "-m", "shmcache", "new", "s", "--memory-dir", str(shm_dir)],
                       capture_output=True, text=True, env=env, timeout=60)
    assert p.returncode == 0, p.stderr
    c = ShmDatasetCache(session="s", name="c", size=4)  # no memory_dir, no variable: the session's
    c.put(1, b"x")
    assert any((shm_dir / f"shmcache-{os.getuid()}").iterdir())
    c.close()


def test_stat_says_when_huge_pages_would_help(monkeypatch, capsys):
    """A cache on base pages that holds more than a TLB reaches gets a line below the table naming
    the fix (the threshold lowered: 256 MiB is a lot to write; a huge mount's cache says no in the
    journey above)."""
    cli = importlib.import_module("shmcache.cli.main")  # the module (the package's `main` is the function)
    monkeypatch.setattr(cli, "HUGE_HELPS_BYTES", 1 << 10)
    big = ShmDatasetCache(session="big", name="c", size=4)  # /dev/shm: 4 KiB pages here
    big.put(1, np.zeros(4096, np.uint8))
    if not memdir_backing_is_base("/dev/shm"):
        pytest.skip("/dev/shm has huge pages here")
    assert cli.main(["stat", "big"]) == 0
    out = capsys.readouterr().out
    assert "big/c:" in out and "huge pages make them faster" in out and "SHMCACHE_MEMORY_DIR" in out
    assert cli.main(["stat", "big", "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)
    assert row["huge_pages_would_help"] is True and row["memory_dir"] == "/dev/shm"
    big.close()


def memdir_backing_is_base(where: str) -> bool:
    from shmcache.base import memdir

    return memdir.backing(None if where == "/dev/shm" else where).page_size == mmap.PAGESIZE


HTLB_SCRIPT = r"""
import os, subprocess, sys
MOUNT, PY = sys.argv[1], sys.executable
ENV = {**os.environ, "SHMCACHE_MEMORY_DIR": MOUNT}
WRITE = '''
import numpy as np, torch
from shmcache import ShmDatasetCache
class Rows(torch.utils.data.Dataset):
    def __len__(self): return 300
    def __getitem__(self, i): return np.full(3000, i % 251, np.uint8), i
    def __getitems__(self, keys): return [self[i] for i in keys]
c = ShmDatasetCache(session="htlb-pages", name="c", size=16)
ds = c.wrap(Rows())
c.warmup(ds, progress=False)  # a batch of misses: one run of records of one layout
got = ds.get_batch(list(range(300)))
assert all(int(got[0][i][0]) == i % 251 for i in range(300)) and got[1].tolist() == list(range(300))
st = c.stats()
print(st["items_mem"], st["rejected"])
'''
READ = '''
from shmcache import ShmDatasetCache
c = ShmDatasetCache(session="htlb-pages", name="c", create=False)
print(sum(int(c.get(i)[0][0]) == i % 251 for i in range(300)))
'''
out = []
for code, env in ((WRITE, ENV), (READ, {k: v for k, v in os.environ.items() if k != "SHMCACHE_MEMORY_DIR"})):
    p = subprocess.run([PY, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    if p.returncode:
        sys.exit("rc %d: %s" % (p.returncode, p.stderr[-3000:]))
    out.append(p.stdout.strip())
subprocess.run([PY, "-m", "shmcache", "destroy", "htlb-pages"], env=ENV, timeout=60, check=True, capture_output=True)
print(" | ".join(out))
"""


def test_a_hugetlbfs_with_pages_holds_a_batch_of_misses(tmp_path, huge_pages, private_mounts):
    """A hugetlbfs takes no write(2): a batch of misses admitted as one run (written with pwritev
    on tmpfs) must still land in its pages, be read back by another process without the
    variable, and leave the mount empty after destroy."""
    mount = tmp_path / "htlb"
    mount.mkdir()
    script = tmp_path / "htlb.py"
    script.write_text(HTLB_SCRIPT)
    proc = private_mounts(f"mount -t hugetlbfs none {mount} || exit 99; {sys.executable} {script} {mount}; "
                          f"rc=$?; ls -A {mount}/shmcache-{os.getuid()} 2>/dev/null; exit $rc", timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "300 0 | 300", proc.stdout  # all admitted into its pages, all read back
    assert lines[1:] == [], proc.stdout  # destroy left nothing in the mount


WRITE_AT_SCRIPT = r"""
import os, sys
import numpy as np
from shmcache.base.shm import Segment
MOUNT, SIZE = sys.argv[1], int(sys.argv[2])
odd = [np.array(5), np.array([1j, 2j]), np.arange(3, dtype=">i8"), np.full(2, 1.5, np.float16), bytearray(b"xyz"),
       memoryview(np.arange(12, dtype=np.int16).reshape(3, 4)), b"", np.zeros((0, 3)), np.zeros((2, 0), np.int64)]
name = f"{MOUNT}/shmcache-write-at-{os.getpid()}"
seg = Segment.create(name, SIZE, kind=3, commit=SIZE)
out = []
for many in (False, True):  # one pwritev (or copy), then more buffers than IOV_MAX
    bufs = odd * (300 if many else 1)
    want = b"".join(memoryview(b).tobytes() for b in bufs)
    seg.write_at(4096 + 3, bufs)
    out.append(bytes(seg.buf[4096:4096 + 3 + len(want) + 1]) == bytes(3) + want + b"\0")
try:  # past the end: refused, nothing written, the object not grown
    seg.write_at(SIZE - 8, [b"\xee" * 4] * 3)
    out.append("taken")
except ValueError:
    out.append(not any(seg.buf[SIZE - 8:]) and os.stat(name).st_size == SIZE)
seg.unlink()
print(out)
"""


@pytest.mark.parametrize("fs", ["hugetlbfs", "tmpfs huge=always"])
def test_write_at_writes_the_same_bytes_on_a_huge_page_mount(tmp_path, huge_pages, fs, private_mounts):
    """hugetlbfs takes no write(2) (write_at copies through the mapping), a huge=always tmpfs takes
    pwritev into 2 MiB pages: buffers of any kind and shape, few or more than IOV_MAX, land as
    their concatenation there too, and a write past the end is refused on both."""
    mount = tmp_path / "mnt"
    mount.mkdir()
    script = tmp_path / "write_at.py"
    script.write_text(WRITE_AT_SCRIPT)
    how = "-t hugetlbfs none" if fs == "hugetlbfs" else "-t tmpfs -o size=16m,huge=always tmpfs"
    proc = private_mounts(f"mount {how} {mount} || exit 99; {sys.executable} {script} {mount} {4 * pmd_size()}")
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert proc.stdout.strip() == "[True, True, True]", proc.stdout


PUT_ONE_SCRIPT = r"""
import os, sys
import numpy as np
from shmcache.cache.store import CacheStore
from shmcache.cache.writer import PWRITE_MIN_BYTES
from shmcache.base.shm import Segment
real, calls = Segment.write_at, [0]

def write_at(self, offset, buffers):  # counted: the writer's pwritev copies into a data segment
    calls[0] += 1
    return real(self, offset, buffers)

Segment.write_at = write_at
c = CacheStore(sys.argv[1], "c", capacity_bytes=16 << 20)  # the writer's layer: no torch to import
value = np.arange(PWRITE_MIN_BYTES + 4096, dtype=np.uint8) * 7  # one record, put on its own
c.put(1, value)
c.close()
print(calls[0])
"""
READ_ONE_SCRIPT = r"""
import sys
import numpy as np
from shmcache.cache.store import CacheStore
from shmcache.cache.writer import PWRITE_MIN_BYTES
c = CacheStore(sys.argv[1], "c", create=False)
print(bool((c.lookup(1) == np.arange(PWRITE_MIN_BYTES + 4096, dtype=np.uint8) * 7).all()))
"""


def test_a_large_record_put_on_its_own_goes_through_the_mapping_of_a_huge_mount(tmp_path, private_mounts):
    """A record of PWRITE_MIN_BYTES and more is copied in with one pwritev on base pages (a first
    store through the mapping faults on each 4 KiB page); on a tmpfs of huge pages the mapping
    faults once a huge page and the pwritev costs more than it saves (benchmarks/bench_put_one.py):
    through the mapping there. Either way another process reads it back."""
    small, huge = tmp_path / "small", tmp_path / "huge"
    small.mkdir()
    huge.mkdir()
    (tmp_path / "put.py").write_text(PUT_ONE_SCRIPT)
    (tmp_path / "read.py").write_text(READ_ONE_SCRIPT)
    py = sys.executable
    steps = [f"mount -t tmpfs -o size=64m tmpfs {small} || exit 99",
             f"mount -t tmpfs -o size=64m,huge=within_size tmpfs {huge} || exit 99"]
    for tag, mount in (("small", small), ("huge", huge)):
        s = f"put-one-{tag}-{uuid.uuid4().hex[:6]}"
        steps += [f"SHMCACHE_MEMORY_DIR={mount} {py} {tmp_path / 'put.py'} {s} || exit 1",
                  f"{py} {tmp_path / 'read.py'} {s} || exit 1",
                  f"{py} -m shmcache destroy {s} >/dev/null || exit 1"]
    proc = private_mounts("; ".join(steps), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    # base pages: one pwritev; huge pages: none (through the mapping); both read back whole
    assert proc.stdout.split() == ["1", "True", "0", "True"], proc.stdout
