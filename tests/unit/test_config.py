"""Configuration: names, the session "auto", the namespace that $SHMCACHE_DIR moves (and that keeps
two namespaces from ever seeing each other), and the memory limits behind size=0."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

from shmcache.config import (
    ENV_DIR,
    ENV_SESSION,
    MemoryLimits,
    memory_limits,
    namespace,
    resolve_session_name,
    validate_name,
)
from shmcache.errors import InvalidArgument, NotOwner
from shmcache.registry import SessionRegistry
from shmcache.store import MISSING, CacheStore


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
