"""Configuration: names, the session "auto", the namespace that $SHMCACHE_DIR moves (and that keeps
two namespaces from ever seeing each other), and the memory limits behind size=0."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from shmcache.base.memory import MemoryLimits, memory_limits
from shmcache.base.namespace import (
    ENV_DIR,
    ENV_SESSION,
    namespace,
    resolve_session_name,
    validate_name,
)
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import InvalidArgument, NotOwner


@pytest.mark.parametrize("good", ["a", "A-z_0.9", "x" * 64, "default", "run.2024-01-01", "x-", "_"])
def test_valid_names(good):
    assert validate_name(good, "cache") == good


@pytest.mark.parametrize("bad", ["", "/", "a/b", "..", ".", "x" * 65, "a b", "a+b", "ü", "a\n",
                                 "\na", "a\\b", "~", "-rf", "--all"])  # a leading '-' reads as a CLI option
def test_invalid_names_name_the_argument_and_the_rule(bad):
    with pytest.raises(InvalidArgument) as info:
        validate_name(bad, "cache")
    msg = str(info.value)
    assert "cache" in msg and repr(bad) in msg and "1-64" in msg


@pytest.mark.parametrize("bad", [None, 1, 1.5, b"abc", ["a"], object()])
def test_non_str_names_are_refused(bad):
    with pytest.raises(InvalidArgument, match="session name must be a str"):
        validate_name(bad, "session")


def test_session_auto(monkeypatch):
    assert resolve_session_name("auto") == "default"
    assert resolve_session_name(None) == "default"
    monkeypatch.setenv(ENV_SESSION, "from-env")
    assert resolve_session_name("auto") == "from-env"
    assert resolve_session_name("explicit") == "explicit"
    monkeypatch.setenv(ENV_SESSION, "../evil")
    with pytest.raises(InvalidArgument, match=r"\$SHMCACHE_SESSION"):
        resolve_session_name("auto")


def test_namespace_follows_shmcache_dir(tmp_path, monkeypatch):
    a = namespace()
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "other"))
    b = namespace()
    assert a.root != b.root and a.prefix != b.prefix
    assert b.root == tmp_path / "other" and b.root.is_dir()
    assert stat.S_IMODE(b.root.stat().st_mode) == 0o700
    assert b.prefix.startswith(f"shmcache-{os.getuid()}-")
    assert a.segment_name("s", "c") == f"/{a.prefix}+s+c"


def test_namespace_root_spelled_differently_is_the_same_namespace(tmp_path, monkeypatch):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    prefixes = set()
    for spelling in (str(real), str(real) + "/", str(tmp_path / "link"), str(real / "sub" / "..")):
        monkeypatch.setenv(ENV_DIR, spelling)
        prefixes.add(namespace().prefix)
    assert len(prefixes) == 1, prefixes


def test_two_namespaces_never_see_each_others_sessions_or_segments(tmp_path, monkeypatch,
                                                                   shm_namespace):
    mine = shm_namespace
    store_a = CacheStore("shared-name", "c", capacity_bytes=4 << 20)
    store_a.put(1, np.arange(10))
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "ns-b"))
    other = namespace()
    try:
        reg_b = SessionRegistry(other)
        assert reg_b.list() == [] and other.owned_segments() == []
        store_b = CacheStore("shared-name", "c", capacity_bytes=4 << 20)  # same names, other world
        assert store_b.lookup(1) is MISSING and len(store_b) == 0
        store_b.put(1, np.zeros(3))
        assert set(other.owned_segments()).isdisjoint(mine.owned_segments())
        store_b.close()
        reg_b.destroy("shared-name")
        assert other.owned_segments() == []
        assert (store_a.lookup(1) == np.arange(10)).all(), "the other namespace's destroy reached us"
        assert [s.name for s in SessionRegistry(mine).list()] == ["shared-name"]
    finally:
        for name in other.owned_segments():
            os.unlink(other.shm_path(name))
        store_a.close()


@pytest.mark.parametrize("where", ["file", "under-a-file", "proc"])
def test_shmcache_dir_that_cannot_be_a_directory_gets_a_clear_error(tmp_path, monkeypatch, where):
    f = tmp_path / "not-a-dir"
    f.write_text("")
    path = {"file": f, "under-a-file": f / "sub", "proc": "/proc/shmcache-test"}[where]
    monkeypatch.setenv(ENV_DIR, str(path))
    with pytest.raises(InvalidArgument, match="SHMCACHE_DIR"):
        namespace()


def test_shmcache_dir_that_is_too_open_is_made_private(tmp_path, monkeypatch):
    d = tmp_path / "open"
    d.mkdir(mode=0o777)
    os.chmod(d, 0o777)
    monkeypatch.setenv(ENV_DIR, str(d))
    namespace()
    assert stat.S_IMODE(d.stat().st_mode) == 0o700


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to make a directory owned by another uid")
def test_shmcache_dir_of_another_user_is_refused(tmp_path, monkeypatch):
    d = tmp_path / "theirs"
    d.mkdir()
    os.chown(d, 12345, 12345)
    monkeypatch.setenv(ENV_DIR, str(d))
    with pytest.raises(NotOwner, match="12345"):
        namespace()


def test_memory_limits_take_the_smallest():
    lim = MemoryLimits(mem_available=8 << 30, cgroup_limit=4 << 30, cgroup_free=3 << 30,
                       shm_total=64 << 20, shm_free=60 << 20)
    assert lim.available == 60 << 20
    assert lim.auto_capacity() == int((60 << 20) * 0.8)
    assert MemoryLimits(None, None, None, None, None).available == 0
    assert MemoryLimits(1 << 30, None, None, None, None).auto_capacity() == int((1 << 30) * 0.8)
    assert MemoryLimits(-5, None, None, None, None).available == 0


def test_memory_limits_here_are_sane():
    lim = memory_limits()
    st = os.statvfs("/dev/shm")
    assert lim.shm_total == st.f_blocks * st.f_frsize
    assert lim.mem_available and lim.mem_available > 0
    assert 0 < lim.auto_capacity() <= min(v for v in (lim.mem_available, lim.shm_free,
                                                       lim.cgroup_free) if v is not None)


# --- cgroup limits: the process's own cgroup, not the root of the tree ---------------------------


def _fake_proc(tmp_path, cgroup: str, mounts: list[tuple[str, str, str, str]]) -> str:
    """A fake /proc/self: ``cgroup`` as given, a mountinfo line per (fstype, root, mount point,
    super options)."""
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text(cgroup)
    lines = [f"{30 + i} 23 0:{40 + i} {root} {point} rw,relatime - {fs} {fs} {opts}"
             for i, (fs, root, point, opts) in enumerate(mounts)]
    (proc / "mountinfo").write_text("\n".join(lines) + "\n")
    return str(proc)


def _cg_dir(base, rel: str, **files) -> None:
    d = base / rel.strip("/") if rel.strip("/") else base
    d.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (d / name.replace("_", ".", 1)).write_text(f"{value}\n")


def test_cgroup_v2_limit_of_the_process_own_cgroup_is_seen(tmp_path):
    """A Slurm job: the limit sits on the job's cgroup, the step below it has none, the root of
    the tree has no memory.max at all. Reading only /sys/fs/cgroup/memory.max misses it."""
    cg = tmp_path / "cg"
    _cg_dir(cg, "/")
    _cg_dir(cg, "/system.slice/slurmstepd.scope/job_42", memory_max=4 << 30, memory_current=1 << 30)
    _cg_dir(cg, "/system.slice/slurmstepd.scope/job_42/step_0", memory_max="max", memory_current=1 << 29)
    proc = _fake_proc(tmp_path, "0::/system.slice/slurmstepd.scope/job_42/step_0\n",
                      [("cgroup2", "/", str(cg), "rw")])
    lim = memory_limits(proc)
    assert lim.cgroup_limit == 4 << 30 and lim.cgroup_free == 3 << 30
    assert lim.cgroup_file == str(cg / "system.slice/slurmstepd.scope/job_42/memory.max")


def test_cgroup_tightest_ancestor_applies(tmp_path):
    cg = tmp_path / "cg"
    _cg_dir(cg, "/user", memory_max=2 << 30, memory_current=(3 << 30) // 2)  # 0.5 GiB free
    _cg_dir(cg, "/user/job", memory_max=1 << 30, memory_current=0)           # 1 GiB free
    proc = _fake_proc(tmp_path, "0::/user/job\n", [("cgroup2", "/", str(cg), "rw")])
    lim = memory_limits(proc)
    assert (lim.cgroup_limit, lim.cgroup_free) == (2 << 30, 1 << 29)


def test_cgroup_v1_memory_hierarchy_path_is_followed(tmp_path):
    """v1: the memory controller's line (here joined with another controller), and a container
    whose mount shows only its own cgroup (mount root /docker/abc)."""
    mem = tmp_path / "memory"
    _cg_dir(mem, "/", memory_limit_in_bytes=(1 << 63) - 4096, memory_usage_in_bytes=5 << 30)
    _cg_dir(mem, "/job", memory_limit_in_bytes=3 << 30, memory_usage_in_bytes=1 << 30)
    proc = _fake_proc(tmp_path, "12:pids:/docker/abc\n4:cpuacct,memory:/docker/abc/job\n1:name=systemd:/\n",
                      [("cgroup", "/docker/abc", str(tmp_path / "cpu"), "rw,cpu"),
                       ("cgroup", "/docker/abc", str(mem), "rw,memory,cpuacct")])
    lim = memory_limits(proc)
    assert (lim.cgroup_limit, lim.cgroup_free) == (3 << 30, 2 << 30)


def test_no_cgroup_limit_anywhere(tmp_path):
    cg = tmp_path / "cg"
    _cg_dir(cg, "/a", memory_max="max", memory_current=123)
    proc = _fake_proc(tmp_path, "0::/a\n", [("cgroup2", "/", str(cg), "rw")])
    lim = memory_limits(proc)
    assert (lim.cgroup_limit, lim.cgroup_free, lim.cgroup_file) == (None, None, None)


def test_a_real_cgroup_limit_is_seen_by_shmcache_info(tmp_path):
    """A child cgroup of our own with a 300 MiB limit (what Slurm or a container sets); a process
    moved into it runs `shmcache info --json`, which must report that limit."""
    import json
    import subprocess
    import sys

    if os.geteuid() != 0:
        pytest.skip("needs root to make a cgroup")
    with open("/proc/self/cgroup") as f:
        lines = f.read().splitlines()
    v1 = [ln.split(":", 2)[2] for ln in lines if "memory" in ln.split(":", 2)[1].split(",")]
    v2 = [ln.split(":", 2)[2] for ln in lines if ln.startswith("0::")]
    limit = 300 << 20
    if v1 and os.path.isdir("/sys/fs/cgroup/memory"):
        d = f"/sys/fs/cgroup/memory{v1[0].rstrip('/')}/shmcache-test-{os.getpid()}"
        limit_file, value = "memory.limit_in_bytes", str(limit)
    elif v2 and os.path.exists("/sys/fs/cgroup/cgroup.controllers"):
        d = f"/sys/fs/cgroup{v2[0].rstrip('/')}/shmcache-test-{os.getpid()}"
        limit_file, value = "memory.max", str(limit)
    else:
        pytest.skip(f"no memory cgroup mounted at /sys/fs/cgroup ({lines})")
    try:
        os.mkdir(d)
    except OSError as exc:
        pytest.skip(f"cannot make a cgroup under {os.path.dirname(d)}: {exc.strerror}")
    try:
        try:
            with open(os.path.join(d, limit_file), "w") as f:
                f.write(value)
        except OSError as exc:
            pytest.skip(f"cannot set {limit_file} in {d} (memory controller not enabled?): {exc.strerror}")
        procs = os.path.join(d, "cgroup.procs")
        script = (f"import os, sys, pathlib; pathlib.Path({procs!r}).write_text(str(os.getpid())); "
                  f"from shmcache.cli.main import main; sys.exit(main(['info', '--json']))")
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        info = json.loads(out.stdout)
        assert info["cgroup_limit_bytes"] == limit, info
        assert 0 < info["cgroup_free_bytes"] <= limit
        assert info["auto_capacity_bytes"] <= 0.8 * limit
        assert info["cgroup_limit_file"] == os.path.join(d, limit_file)
    finally:
        os.rmdir(d)  # empty again: its one process has exited
