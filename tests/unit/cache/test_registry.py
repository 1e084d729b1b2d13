"""The session registry: create / get / list / destroy, names that cannot escape the namespace,
destroy that touches only its own session's segments, liveness by slot locks (a process that only
writes is attached too), gc."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import CacheStore
from shmcache.errors import InvalidArgument, SessionExists, SessionInUse, SessionNotFound, ShmcacheError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _workers import process_attached_to  # noqa: E402

BAD_NAMES = ["", "a/b", "..", ".", "...", "../etc", "/abs", "x" * 65, "a b", "tab\t", "new\nline",
             "a+b", "é", "semi;colon", "*", "a\x00b"]


@pytest.fixture
def reg(shm_namespace):
    return SessionRegistry(shm_namespace)


def _cache_with_items(session, name, n=3):
    s = CacheStore(session, name, capacity_bytes=4 << 20)
    for i in range(n):
        s.put(i, np.full(100, i))
    return s


def test_create_get_list_destroy(reg, shm_namespace):
    info = reg.create("alpha")
    assert info.name == "alpha" and info.uid == os.getuid() and info.creator_pid == os.getpid()
    assert reg.get("alpha").created == pytest.approx(info.created)
    assert [s.name for s in reg.list()] == ["alpha"]
    assert reg.exists("alpha") and not reg.exists("beta")
    sdir = reg.session_dir("alpha")
    assert stat.S_IMODE(sdir.stat().st_mode) == 0o700
    assert stat.S_IMODE((sdir / "session.json").stat().st_mode) == 0o600
    store = _cache_with_items("alpha", "c")
    store.close()
    assert reg.cache_names("alpha") == ["c"]
    removed = reg.destroy("alpha")
    assert removed and all("+alpha+" in n for n in removed)
    assert not reg.exists("alpha") and reg.list() == []
    assert shm_namespace.owned_segments() == []


def test_random_names_are_valid_and_distinct(reg):
    names = {reg.create().name for _ in range(5)}
    assert len(names) == 5
    assert {s.name for s in reg.list()} == names


def test_create_existing_raises_and_exist_ok_returns_it(reg):
    reg.create("dup")
    with pytest.raises(SessionExists, match="dup") as info:
        reg.create("dup")
    assert isinstance(info.value, FileExistsError)
    assert reg.create("dup", exist_ok=True).name == "dup"
    assert reg.ensure("dup").name == "dup" and reg.ensure("fresh").name == "fresh"


def test_unknown_session_errors_list_what_exists(reg):
    reg.create("known-one")
    with pytest.raises(SessionNotFound, match="known-one") as info:
        reg.get("missing")
    assert "missing" in str(info.value) and isinstance(info.value, LookupError)
    with pytest.raises(SessionNotFound, match="missing"):
        reg.destroy("missing")


@pytest.mark.parametrize("bad", BAD_NAMES + [None, 5, b"bytes", ["a"]])
def test_bad_session_names_are_refused_everywhere(reg, bad, shm_namespace):
    calls = [reg.get, reg.destroy, reg.ensure, reg.session_dir]
    if bad is not None:  # create(None) means "a random name"
        calls.append(reg.create)
    for call in calls:
        with pytest.raises(InvalidArgument, match="session") as info:
            call(bad)
        assert "A-Z" in str(info.value)  # says what a valid name is
    assert list(shm_namespace.sessions_dir.iterdir()) == []


def test_name_of_64_characters_is_fine(reg):
    assert reg.create("x" * 64).name == "x" * 64


def test_session_names_starting_with_a_dot_are_refused(reg):
    """Names starting with '.' are the registry's own (sessions being made or destroyed), which
    list() skips: a session named '.hidden' would be invisible to `ls` and to destroy, so it is
    refused at creation with the rule named."""
    with pytest.raises(InvalidArgument, match="starting with '.'"):
        reg.create(".hidden")
    reg.create("visible")
    assert [s.name for s in reg.list()] == ["visible"]


def test_destroy_touches_only_its_own_session(reg, shm_namespace):
    """Session 'a' must not take 'a-b', 'a.b' or 'ab' with it (segment names are prefixes)."""
    stores = {s: _cache_with_items(s, "c") for s in ("a", "a-b", "a.b", "ab", "b")}
    before = {s: [n for n in shm_namespace.owned_segments() if f"+{s}+" in n] for s in stores}
    reg.destroy("a", force=True)
    after = shm_namespace.owned_segments()
    assert not [n for n in after if "+a+" in n]
    for s in ("a-b", "a.b", "ab", "b"):
        assert set(before[s]) <= set(after), f"destroying 'a' removed segments of {s!r}"
        assert stores[s].lookup(2) is not None and (stores[s].lookup(2) == 2).all()
    for s in stores.values():
        s.close()


def test_live_pids_and_destroy_refuses_a_session_in_use(reg):
    reg.create("busy")
    with process_attached_to("busy") as proc:
        assert proc.pid in reg.live_pids("busy")
        with pytest.raises(SessionInUse, match=str(proc.pid)) as info:
            reg.destroy("busy")
        assert "force" in str(info.value)
        assert reg.exists("busy")
    assert proc.pid not in reg.live_pids("busy")
    reg.destroy("busy")  # nobody attached now
    assert not reg.exists("busy")


def test_this_process_does_not_block_its_own_destroy(reg):
    from shmcache.cache import process_slot

    reg.create("mine")
    process_slot.slot(reg, "mine")
    assert os.getpid() in reg.live_pids("mine")
    reg.destroy("mine")
    assert not reg.exists("mine")


def test_gc_removes_debris_and_keeps_what_is_live(reg, shm_namespace):
    import posix_ipc

    reg.create("live")
    store = _cache_with_items("live", "c")
    keep = set(shm_namespace.owned_segments())
    # an orphan segment of a session that no longer exists
    ghost = shm_namespace.segment_name("ghost", "cache", "root")
    posix_ipc.SharedMemory(ghost, posix_ipc.O_CREX, mode=0o600, size=4096).close_fd()
    # a half-made session of a creator that died before renaming it into place
    tmp = shm_namespace.sessions_dir / ".half.tmp-999999-abc"
    tmp.mkdir()
    # a stale slot lock (nobody holds it)
    stale = reg.session_dir("live") / "slots" / "200.lock"
    stale.write_text("999999\n")
    report = reg.gc()
    assert ghost in report.removed_segments
    assert str(tmp) in report.removed_dirs and not tmp.exists()
    assert str(stale) in report.removed_locks and not stale.exists()
    assert set(shm_namespace.owned_segments()) == keep
    assert (store.lookup(1) == 1).all()
    again = reg.gc()
    assert again.removed_segments == [] and again.removed_dirs == [] and again.removed_locks == []
    store.close()


def test_unreadable_session_json_is_reported_and_skipped_by_list(reg):
    reg.create("good")
    reg.create("broken")
    (reg.session_dir("broken") / "session.json").write_text("{not json")
    assert [s.name for s in reg.list()] == ["good"]
    with pytest.raises(ShmcacheError, match="destroy broken"):
        reg.get("broken")
    reg.destroy("broken")
    assert not reg.session_dir("broken").exists()


def test_everything_in_the_namespace_is_private_whatever_the_umask(shm_namespace):
    """Files 0600 and directories 0700 (registry, sessions, cache metadata, lock files, slots),
    and segments 0600 - even with umask 0."""
    from shmcache.cache import process_slot

    old = os.umask(0)
    try:
        reg = SessionRegistry(shm_namespace)
        reg.create("private")
        store = _cache_with_items("private", "c")
        store.lookup(1)  # takes a liveness slot
        store.clear()
        store.put(1, np.zeros(10))
        process_slot.slot(reg, "private")
    finally:
        os.umask(old)
    wrong = []
    for path in [shm_namespace.root, *shm_namespace.root.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        want = 0o700 if path.is_dir() else 0o600
        if mode != want:
            wrong.append(f"{path.relative_to(shm_namespace.root)}: {oct(mode)}")
    for name in shm_namespace.owned_segments():
        mode = stat.S_IMODE(os.stat(shm_namespace.shm_path(name)).st_mode)
        if mode != 0o600:
            wrong.append(f"{name}: {oct(mode)}")
    assert not wrong, wrong
    store.close()


# --- last use and destroy_idle (NOTE [session lifecycle], last use) ----------------------------------

DAY = 86400.0


def _age(reg, name, seconds):
    """Pretend session ``name`` was last used ``seconds`` ago."""
    t = time.time() - seconds
    reg.mark_used(name)  # a session nobody ever attached to has no last_used file yet
    os.utime(reg.session_dir(name) / "last_used", (t, t))


def _idle_s(reg, name):
    return time.time() - reg.last_used(name)


def test_every_attach_and_clean_exit_refreshes_last_use_and_in_use_is_now(reg):
    reg.create("s")
    with process_attached_to("s"):
        _age(reg, "s", 3 * DAY)
        assert _idle_s(reg, "s") < 5  # attached: in use now, whatever the file says
    assert _idle_s(reg, "s") < 60  # its clean exit was a use
    _age(reg, "s", 3 * DAY)
    assert _idle_s(reg, "s") > 3 * DAY - 60
    with process_attached_to("s"):
        pass
    assert _idle_s(reg, "s") < 60


def test_destroy_idle_destroys_only_old_sessions_that_nobody_is_attached_to(reg, shm_namespace):
    from shmcache.cache import process_slot

    for name in ("busy", "old", "fresh"):
        reg.create(name)
    _cache_with_items("old", "c").close()
    process_slot.release_all()  # this process detaches: only the subprocess below is attached anywhere
    _age(reg, "old", 10 * DAY)
    _age(reg, "fresh", 3600)
    with process_attached_to("busy"):
        _age(reg, "busy", 10 * DAY)  # attached for ten days, say
        gone = reg.destroy_idle(DAY)
        assert [s.name for s in gone] == ["old"]
        assert gone[0].idle_s > 10 * DAY - 60 and gone[0].removed_segments
        assert reg.exists("busy") and reg.exists("fresh") and not reg.exists("old")
        assert not [n for n in shm_namespace.owned_segments() if "+old+" in n]
        assert [s.name for s in reg.destroy_idle(0)] == ["fresh"]  # in use beats any duration
    assert [s.name for s in reg.list()] == ["busy"]


def test_destroy_idle_seen_in_use_counts_idle_time_from_then(reg):
    reg.create("busy")
    with process_attached_to("busy"):
        _age(reg, "busy", 10 * DAY)
        assert reg.destroy_idle(DAY) == []
        _age(reg, "busy", 10 * DAY)
        assert reg.destroy_idle(DAY) == []
    assert reg.exists("busy") and _idle_s(reg, "busy") < 60


def test_a_process_attaching_after_the_liveness_check_wins(reg, monkeypatch):
    # A process that takes its slot between destroy's first liveness check and the rename: the
    # check is made to see nobody (as it would have a moment earlier); the real slot taken by a
    # real process must still stop the destroy.
    reg.create("s")
    with process_attached_to("s") as proc:
        _age(reg, "s", 10 * DAY)
        monkeypatch.setattr(reg, "live_pids", lambda name: [])
        with pytest.raises(SessionInUse, match=str(proc.pid)):
            reg.destroy("s")
        assert reg.destroy_idle(DAY) == []
        monkeypatch.undo()
        assert reg.exists("s") and proc.pid in reg.live_pids("s")
        assert (reg.session_dir("s") / "session.json").is_file()


def test_attaching_while_a_destroy_has_the_directory_away_waits_for_its_decision(reg, shm_namespace):
    reg.create("s")
    away = shm_namespace.sessions_dir / ".s.tmp-destroy-test"
    reg._lock.acquire()
    try:
        os.rename(reg.session_dir("s"), away)  # what destroy does, under the registry lock
        code = ("import sys; from shmcache.cache.registry import SessionRegistry; "
                "slot = SessionRegistry().attach_process('s'); print('attached', flush=True); sys.stdin.read()")
        proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            # the handshake: it opens the registry lock only to wait for it (keep_open=False)
            lock = str(shm_namespace.root / "registry.lock")
            deadline = time.monotonic() + 30
            while not _has_open(proc.pid, lock):
                assert proc.poll() is None, proc.communicate()[1]  # waiting for the lock, not failed
                assert time.monotonic() < deadline, "the attacher never waited for the registry lock"
                time.sleep(0.01)
            assert proc.poll() is None, proc.communicate()[1]
            os.rename(away, reg.session_dir("s"))  # the destroy was refused: the directory is back
            reg._lock.release()
            assert proc.stdout.readline().strip() == "attached"
            assert proc.pid in reg.live_pids("s")
        finally:
            proc.stdin.close()
            proc.wait(timeout=30)
            proc.stdout.close()
            proc.stderr.close()
    finally:
        if away.exists():
            os.rename(away, reg.session_dir("s"))
            reg._lock.release()


def test_destroy_idle_refuses_a_negative_duration(reg):
    with pytest.raises(InvalidArgument, match="-1"):
        reg.destroy_idle(-1)


def test_the_session_automatic_cap_is_fixed_by_its_first_auto_sized_cache(reg):
    """size=0: the first auto-sized cache of a session fixes the cap they all share; caches made
    later (when less is free) get the same, not 80% of what is left. A cap computed while memory
    is full is not kept: the next cache asks again."""
    reg.create("s")
    calls = []

    def compute(value):
        return lambda: calls.append(value) or value

    assert reg.auto_capacity("s", compute(10), floor=100) == 10  # below the floor: not kept
    assert reg.auto_capacity("s", compute(500 << 20), floor=100) == 500 << 20
    assert reg.auto_capacity("s", compute(100 << 20), floor=100) == 500 << 20
    assert calls == [10, 500 << 20]
    a = CacheStore("s", "a")
    b = CacheStore("s", "b")
    sized = CacheStore("s", "sized", capacity_bytes=8 << 20)
    assert a.capacity_bytes == b.capacity_bytes == 500 << 20
    assert sized.capacity_bytes == 8 << 20
    for store in (a, b, sized):
        store.close()
    reg.destroy("s")
    reg.create("s")  # a new session computes its own
    assert reg.auto_capacity("s", compute(200 << 20), floor=100) == 200 << 20
    assert [p.name for p in reg.session_dir("s").iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("text", ["", "garbage", "12.5"])
def test_a_damaged_auto_capacity_file_is_measured_again(text):
    """The session's automatic-cap file damaged (truncated, overwritten): opening an auto-sized
    cache raised a raw ValueError (int() of its text, after a lost race to create it)."""
    from shmcache.cache import process_slot
    from shmcache.cache.store import CacheStore

    reg = SessionRegistry()
    reg.create("dmg")
    (reg.session_dir("dmg") / "auto_capacity").write_text(text)
    store = CacheStore("dmg", "c")  # size=0
    try:
        assert store.capacity_bytes > 1 << 20
        assert store.put(1, b"one") and store.lookup(1) == b"one"
        assert int((reg.session_dir("dmg") / "auto_capacity").read_text()) == store.capacity_bytes
    finally:
        store.close()
        process_slot.release_all()


def test_a_process_that_only_writes_counts_as_attached():
    script = ("import sys, numpy as np\nfrom shmcache.cache.store import MISSING, CacheStore\n"
              "s = CacheStore('w', 'c', capacity_bytes=8 << 20)\ns.put(1, np.zeros(3))\n"
              "print('ready', flush=True)\nsys.stdin.read()\n")
    p = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        assert p.pid in SessionRegistry().live_pids("w")
        with pytest.raises(SessionInUse, match="in use"):
            SessionRegistry().destroy("w")
    finally:
        p.stdin.close()
        p.wait(timeout=30)
        p.stdout.close()


def _has_open(pid: int, path: str) -> bool:
    """Process ``pid`` has ``path`` open (one of its /proc/PID/fd links names it)."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == path:
                return True
        except OSError:
            continue
    return False
