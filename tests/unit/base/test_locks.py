"""flock locks: exclusion between processes and threads, timeouts that name the lock, a forked
child never shares its parent's lock, release when the holder exits, liveness slots.

Each lock test runs against both kinds of FlockLock: a cache's (descriptor kept open) and the
session registry's (opened per hold, reentrant)."""

from __future__ import annotations

import fcntl
import itertools
import os
import stat
import subprocess
import sys
import threading
import time
from functools import partial

import pytest
from _forks import die_holding_after_forking_an_idle_child, reap

from shmcache.base.locks import FlockLock, LivenessSlot, slot_is_alive
from shmcache.errors import LockTimeout

registry_lock = partial(FlockLock, keep_open=False, reentrant=True)  # as SessionRegistry makes it
LOCK_CLASSES = pytest.mark.parametrize("Lock", [FlockLock, registry_lock], ids=["cache-lock", "registry-lock"])

_HOLD = r"""
import sys, time
from shmcache.base.locks import FlockLock
lock = FlockLock(sys.argv[1])
lock.acquire()
print("held", flush=True)
sys.stdin.read()          # hold until the parent closes our stdin, then exit WITHOUT releasing
"""


def _holder(path):
    proc = subprocess.Popen([sys.executable, "-c", _HOLD, str(path)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    return proc


@LOCK_CLASSES
def test_other_process_excludes_then_exit_releases(tmp_path, Lock):
    path = tmp_path / "x.lock"
    proc = _holder(path)
    try:
        lock = Lock(path, what="the test lock")
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as info:
            lock.acquire(timeout_s=0.3)
        assert time.monotonic() - t0 >= 0.29
        assert "the test lock" in str(info.value) and str(path) in str(info.value)
    finally:
        proc.stdin.close()
        proc.wait(timeout=30)
        proc.stdout.close()
    t0 = time.monotonic()
    lock.acquire(timeout_s=5)  # the kernel dropped the dead holder's lock
    assert time.monotonic() - t0 < 1.0
    lock.release()
    lock.close()


@LOCK_CLASSES
@pytest.mark.parametrize("warm", [True, False], ids=["used-before", "first-use-in-threads"])
def test_threads_sharing_one_lock_object_exclude_each_other(tmp_path, warm, monkeypatch, Lock):
    """FlockLock is "usable from threads": threads that share one lock object (a store used by a
    prefetch thread and the main thread) never overlap inside it - also when their very first
    acquire happens at the same time (opening the file is slowed down to make that likely)."""
    import shmcache.base.locks as locks_mod

    real_open = locks_mod._open_lock_file
    opens = itertools.count()

    def slow_open(path):
        # the first opens are slowed down, so the first acquires overlap; later ones (the registry's
        # lock opens its file on every hold) go at full speed: 800 slowed opens took 16 s
        if next(opens) < 8:
            time.sleep(0.02)
        return real_open(path)

    monkeypatch.setattr(locks_mod, "_open_lock_file", slow_open)
    lock = Lock(tmp_path / "t.lock", timeout_s=1)
    if warm:
        with lock:
            pass
    inside, overlaps, errors = [0], [], []
    start = threading.Barrier(4)

    def work():
        try:
            start.wait(timeout=10)
            for _ in range(200):
                with lock:
                    inside[0] += 1
                    if inside[0] != 1:
                        overlaps.append(inside[0])
                    time.sleep(0)
                    inside[0] -= 1
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(repr(exc))

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors
    assert not overlaps, f"{len(overlaps)} times more than one thread held the lock"
    lock.close()


@LOCK_CLASSES
def test_thread_timeout_names_the_lock(tmp_path, Lock):
    lock = Lock(tmp_path / "t.lock", what="thread test lock")
    lock.acquire()
    err = []
    t = threading.Thread(target=lambda: _try(lock, err))
    t.start()
    t.join(timeout=10)
    lock.release()
    assert err and isinstance(err[0], LockTimeout) and "thread test lock" in str(err[0])
    lock.close()


def _try(lock, err):
    try:
        lock.acquire(timeout_s=0.1)
        lock.release()
    except LockTimeout as exc:
        err.append(exc)


@LOCK_CLASSES
def test_forked_child_does_not_share_the_parents_lock(tmp_path, Lock):
    """After fork the child shares the parent's open file description (and a reentrant lock's
    count); it must take its own, so the parent's held lock excludes the child."""
    lock = Lock(tmp_path / "f.lock")
    lock.acquire()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(r)
        try:
            lock.acquire(timeout_s=0.2)
            os.write(w, b"GOT IT")
        except LockTimeout:
            os.write(w, b"timeout")
        except BaseException:
            os.write(w, b"error")
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 100)
    os.close(r)
    os.waitpid(pid, 0)
    lock.release()
    assert got == b"timeout"
    # and once released, a forked child takes it
    pid = os.fork()
    if pid == 0:
        try:
            lock.acquire(timeout_s=2)
            lock.release()
            os._exit(0)
        except BaseException:
            os._exit(3)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    lock.close()


def test_lock_files_are_mode_0600_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        locks = [FlockLock(tmp_path / "m.lock"), registry_lock(tmp_path / "r.lock")]
        for lock in locks:
            with lock:
                pass
        (tmp_path / "slots").mkdir()
        slot = LivenessSlot(tmp_path / "slots", 4)
    finally:
        os.umask(old)
    for p in (tmp_path / "m.lock", tmp_path / "r.lock", slot.path):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p
    slot.release()
    for lock in locks:
        lock.close()


def test_registry_lock_held_by_another_flock_user_times_out_with_shmcache_error(tmp_path):
    """Another flock holder of the registry path (filelock's FileLock, flock(1): an exclusive
    flock on their own open file) excludes us; the error is ours."""

    class OtherFlockUser:
        def __enter__(self):
            self.fd = os.open(tmp_path / "reg.lock", os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(self.fd, fcntl.LOCK_EX)

        def __exit__(self, *exc):
            os.close(self.fd)

    other = OtherFlockUser()
    lock = registry_lock(tmp_path / "reg.lock", what="the session registry lock")
    errors = []

    def attempt():
        try:
            lock.acquire(timeout_s=0.2)
        except LockTimeout as exc:
            errors.append(exc)

    with other:
        t = threading.Thread(target=attempt)
        t.start()
        t.join(timeout=10)
    assert len(errors) == 1 and "the session registry lock" in str(errors[0])
    with lock:  # free once the other holder let go
        pass


def test_liveness_slots(tmp_path):
    a = LivenessSlot(tmp_path, 3)
    b = LivenessSlot(tmp_path, 3)
    c = LivenessSlot(tmp_path, 3)
    assert sorted([a.index, b.index, c.index]) == [0, 1, 2]
    assert a.path.read_text().split()[0] == str(os.getpid())
    with pytest.raises(LockTimeout, match="3 process slots"):
        LivenessSlot(tmp_path, 3)
    assert slot_is_alive(b.path)
    b.release()
    assert not slot_is_alive(b.path)
    assert not slot_is_alive(tmp_path / "nonexistent.lock")
    d = LivenessSlot(tmp_path, 3)
    assert d.index == b.index  # freed slots are reused
    for s in (a, c, d):
        s.release()


def test_a_forked_child_that_never_takes_the_lock_does_not_keep_a_dead_parents_lock(tmp_path):
    """The kernel releases a lock when the last descriptor of its open file description closes;
    a child that inherited one and never used the lock must not be that last descriptor."""
    path = tmp_path / "c.lock"
    lock = FlockLock(path)

    def hold():
        lock.acquire()
        return lock.release

    child = die_holding_after_forking_an_idle_child(hold, tmp_path / "child.pid")
    try:
        os.kill(child, 0)  # the idle child is alive...
        other = FlockLock(path)
        other.acquire(timeout_s=2)  # ...and the dead parent's lock is free anyway
        other.release()
        other.close()
    finally:
        reap(child)


def test_registry_lock_is_reentrant_within_a_thread_and_keeps_no_descriptor(tmp_path):
    """The registry's lock: ``destroy_idle`` calls ``destroy`` under it (a nested hold), the
    last release lets others in, and no descriptor stays open between holds."""
    lock = registry_lock(tmp_path / "r.lock", what="the registry lock")
    other = FlockLock(tmp_path / "r.lock")
    with lock:
        with lock:
            pass
        with pytest.raises(LockTimeout, match="the registry lock|lock r.lock"):
            other.acquire(timeout_s=0.1)  # still held after the inner release
        err = []
        t = threading.Thread(target=lambda: _try(lock, err))
        t.start()
        t.join(timeout=10)
        assert err and "the registry lock" in str(err[0])  # another thread is excluded
    assert lock._fd == -1
    other.acquire(timeout_s=1)
    other.release()
    other.close()


def test_a_cache_lock_is_not_reentrant(tmp_path):
    """A cache's lock taken twice by one thread is refused (a bug, never a silent nested hold),
    saying so - at once: it would only wait for itself."""
    lock = FlockLock(tmp_path / "c.lock", what="the cache lock")
    with lock:
        with pytest.raises(LockTimeout, match="held by this very thread already"):
            lock.acquire(timeout_s=0.05)
    lock.close()


@LOCK_CLASSES
def test_close_under_another_threads_hold_keeps_the_lock_until_its_release(tmp_path, Lock):
    """The main thread closes the cache (``FlockLock.close``) while a PrefetchRing's producer
    thread stores a miss under the lock: the descriptor was closed under the hold, so another
    process could take the lock mid-write, and the producer's release then failed (ValueError:
    descriptor -1). The hold in progress keeps the file lock; its release lets it go."""
    path = tmp_path / "cache.lock"
    lock = Lock(path, timeout_s=5)
    held, go, errors = threading.Event(), threading.Event(), []

    def put():
        lock.acquire()
        held.set()
        go.wait(10)
        try:
            lock.release()
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    producer = threading.Thread(target=put)
    producer.start()
    try:
        assert held.wait(10)
        closer = threading.Thread(target=lock.close)
        closer.start()
        closer.join(10)  # close() returns (within its own bound) while the producer still holds
        assert not closer.is_alive(), "close() waited past its bound for the producer's hold"
        assert slot_is_alive(path), "the file lock was let go under the producer's hold"
    finally:
        go.set()
        producer.join(10)
        closer.join(10)
    assert not errors, errors
    assert not slot_is_alive(path)


@LOCK_CLASSES
def test_close_by_the_holding_thread_keeps_the_lock_until_its_release(tmp_path, Lock):
    """A signal handler closing the cache runs on the thread whose put holds the lock: the close
    must not wait for that thread (itself), nor drop the file lock under the put it interrupted;
    the put's release lets it go and closes the descriptor."""
    path = tmp_path / "cache.lock"
    lock = Lock(path, timeout_s=5)
    lock.acquire()
    started = time.monotonic()
    lock.close()
    assert time.monotonic() - started < 0.5
    assert slot_is_alive(path), "the file lock was let go under this thread's hold"
    lock.release()
    assert not slot_is_alive(path)
    assert lock._fd == -1
