"""Cross-process locks that the kernel releases when their holder dies.

NOTE [lock files]
    Every cross-process lock in shmcache is an ``flock`` on a small file in the namespace
    directory. The kernel drops it the moment the holding process dies, however it dies, so a
    SIGKILLed holder never blocks anyone (a POSIX semaphore would stay at 0 forever). Lock files
    are opened with O_CLOEXEC, once per process: after ``fork`` the child shares the parent's open
    file description (and so its lock), so a child always re-opens its own descriptor before use.
    The same mechanism judges liveness: a process holds a *slot lock* for its whole life, and
    anyone can test whether the slot's owner is alive with a non-blocking attempt - never with a
    PID, which the kernel reuses.

    A forked child closes every inherited lock descriptor at once (``close_in_forked_children``),
    not on its first use of the lock: a child that never takes the lock - a read-only DataLoader
    worker - would otherwise keep the open file description, and so a lock its parent held, alive
    after the parent died. Closing our copy never releases the parent's lock (no ``LOCK_UN``).

    One lock class, :class:`FlockLock`, serves both kinds of lock. A cache's lock is taken on
    every ``put``, so it keeps its descriptor open for the life of the process. The session
    registry's lock is taken rarely (creating, attaching or destroying a session) and by short-lived
    registry objects, so it opens the file on acquire and closes it on release (``keep_open=False``:
    an idle registry holds no descriptor), and it is reentrant within one thread (``destroy_idle``
    calls ``destroy`` under it). Both are an exclusive ``flock`` on the whole file, so they exclude
    any other flock user of the same path too (filelock's ``FileLock``, ``flock(1)``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import LockTimeout, NotOwner

__all__ = ["FlockLock", "LivenessSlot", "SharedHold", "slot_is_alive", "flock_within", "DEFAULT_TIMEOUT_S",
           "close_in_forked_children", "unless_held"]

DEFAULT_TIMEOUT_S = 60.0
# close() waits this long for another thread's hold (a put under the lock takes ms); one that waits
# for the file lock still (a stopped holder elsewhere) closes the descriptor itself when it ends
_CLOSE_WAIT_S = 1.0
_REOPEN = threading.Lock()
_HOLDERS_OF_DESCRIPTORS: weakref.WeakSet = weakref.WeakSet()


def close_in_forked_children(obj) -> None:
    """Have ``obj.after_fork_in_child()`` run in every forked child, first thing after the fork:
    it must close the inherited descriptors that carry locks (see NOTE [lock files])."""
    _HOLDERS_OF_DESCRIPTORS.add(obj)


def _after_fork_in_child() -> None:
    global _REOPEN
    _REOPEN = threading.Lock()  # another thread of the parent may have held it at the fork
    for obj in list(_HOLDERS_OF_DESCRIPTORS):
        obj.after_fork_in_child()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _not_owner(path: Path) -> NotOwner:
    return NotOwner(
        f"cannot open lock file {path}: permission denied; it belongs to another user - "
        f"set $SHMCACHE_DIR to a directory of your own"
    )


def _open_lock_file(path: Path) -> int:
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except PermissionError:
        raise _not_owner(path) from None


def flock_within(fd: int, timeout_s: float, timed_out: Callable[[], Exception],
                 first_sleep_s: float = 20e-6) -> None:
    """Take an exclusive flock on ``fd``, polling with a growing sleep; raise ``timed_out()``
    after ``timeout_s``. (A blocking flock cannot time out; a holder that died has released it
    already, so a long wait always means a live holder - which the error should name.)"""
    deadline = time.monotonic() + timeout_s
    delay = first_sleep_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        if time.monotonic() >= deadline:
            raise timed_out()
        time.sleep(delay)
        delay = min(delay * 2, 0.01)


class FlockLock:
    """An exclusive ``flock`` on ``path`` with a timeout; usable from threads and after fork.

    ``keep_open``: the descriptor stays open between holds (a lock taken often); otherwise it is
    closed on every release. ``reentrant``: the thread that holds the lock may take it again,
    and releases it with its last ``release`` (other threads and processes are excluded either
    way). See NOTE [lock files].
    """

    def __init__(self, path: str | os.PathLike, *, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = "",
                 keep_open: bool = True, reentrant: bool = False):
        self.path = Path(path)
        self.timeout_s = timeout_s
        self.what = what or f"lock {self.path.name}"
        self.keep_open = keep_open
        self.reentrant = reentrant
        self._fd = -1
        self._pid = -1
        self._holds = 0  # this process's nested holds (at most 1 unless reentrant)
        self._close_on_release = False  # close() came during a hold: its last release closes (close)
        self._thread_lock = self._new_thread_lock()  # flock does not exclude threads sharing one fd
        self.reopened = 0  # times the file at ``path`` was found replaced (see acquire)
        close_in_forked_children(self)

    def _new_thread_lock(self) -> threading.RLock:
        # an RLock whatever ``reentrant`` says: it knows whether this thread owns it (_is_owned),
        # so acquire can undo a take that a Ctrl-C cut short (a non-reentrant lock refuses a
        # second hold of its thread itself, in acquire)
        return threading.RLock()

    def after_fork_in_child(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # our copy only: the parent's descriptor keeps its lock
        self._fd, self._pid, self._holds = -1, -1, 0  # the next acquire opens this process's own
        self._close_on_release = False
        self._thread_lock = self._new_thread_lock()

    def _enter_this_process(self) -> None:
        """First use, or first use in a forked child: a thread lock of this process's own (the
        descriptor is opened under it). Serialised, so threads racing here agree on one."""
        with _REOPEN:
            if self._pid != os.getpid():
                if self._fd >= 0:  # inherited: closing our copy leaves the parent's lock alone
                    os.close(self._fd)
                self._fd, self._holds, self._close_on_release = -1, 0, False
                self._thread_lock = self._new_thread_lock()
                self._pid = os.getpid()

    def acquire(self, timeout_s: float | None = None) -> None:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + timeout
        if self._pid != os.getpid():
            self._enter_this_process()
        thread_lock = self._thread_lock
        owned = thread_lock._is_owned()  # by this thread: a nested hold (or a signal handler's)
        if owned and not self.reentrant:
            raise LockTimeout(f"{self.what} is held by this very thread already (a nested hold of a "
                              f"lock that is not reentrant): it would wait for itself")
        try:
            took = thread_lock.acquire(timeout=max(timeout, 0))
        except BaseException:
            # a Ctrl-C is raised as the call returns, the lock taken (or as the wait, with nothing
            # taken: then this thread does not own it, or owned it before and still does once)
            if owned or thread_lock._is_owned():
                thread_lock.release()
            raise
        if not took:
            raise LockTimeout(f"timed out after {timeout:.1f}s waiting for {self.what} (another thread holds it)")
        if self._holds:  # reentrant, and this thread holds the flock already
            self._holds += 1
            return
        try:
            self._flock_until(deadline, timeout)
        except BaseException:
            self._thread_lock.release()
            raise
        self._holds = 1

    def _flock_until(self, deadline: float, timeout: float) -> None:
        if self._fd < 0:
            self._fd = _open_lock_file(self.path)
        try:
            while True:
                flock_within(self._fd, max(0.0, deadline - time.monotonic()),
                             lambda: _held_elsewhere(self.what, self.path, timeout))
                if _same_file(self._fd, self.path):
                    return
                # The file was removed (its session destroyed) or replaced while we held it open:
                # a lock on it excludes nobody any more. Lock the file that is there now;
                # FileNotFoundError when its directory is gone too.
                os.close(self._fd)
                self._fd = -1
                self._fd = _open_lock_file(self.path)
                self.reopened += 1
        except BaseException:
            if not self.keep_open or self._close_on_release:  # (closed meanwhile: close)
                self._close_on_release = False
                self._close_fd()
            elif self._fd >= 0:
                # a Ctrl-C raised as the flock call returned, with the lock taken: no hold is
                # recorded, so let it go (no other hold of this process is on it: _holds is 0;
                # after a timeout, unlocking what is not held changes nothing)
                with contextlib.suppress(OSError):
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
            raise

    def release(self) -> None:
        self._holds -= 1
        try:
            if not self._holds:
                if self.keep_open and not self._close_on_release:
                    fcntl.flock(self._fd, fcntl.LOCK_UN)
                else:
                    self._close_on_release = False
                    self._close_fd()  # closing drops the flock
        finally:
            # a Ctrl-C that arrives during the unlock is raised as it returns: the thread lock
            # must go all the same, or every later hold in this process waits for "another thread"
            self._thread_lock.release()

    def held_directory(self) -> int:
        """A descriptor (O_DIRECTORY; the caller closes it) of the directory holding the file this
        process holds locked, checked to name that file still. What is written relative to it
        (``dir_fd``) goes beside the lock held, never into a directory made since at the same path
        (its session destroyed with force while we held the lock, and made again). FileNotFoundError
        when the file is gone from there or replaced."""
        if not self._holds or self._pid != os.getpid():
            raise RuntimeError(f"{self.what} is not held by this process")
        fd = os.open(self.path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            there, held = os.stat(self.path.name, dir_fd=fd), os.fstat(self._fd)
            if (there.st_dev, there.st_ino) != (held.st_dev, held.st_ino):
                raise FileNotFoundError(errno.ENOENT, "the lock file held was replaced", str(self.path))
        except BaseException:
            os.close(fd)
            raise
        return fd

    def __enter__(self) -> FlockLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _close_fd(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
        self._fd = -1

    def close(self) -> None:
        """Close the descriptor (its cache is closed). A hold in progress in this process keeps it,
        and so the file lock, until its release closes it: another thread's put (waited for up to
        _CLOSE_WAIT_S: a write under the lock takes ms), or the put of this very thread that a signal
        handler closing the cache interrupted (a preemption handler: close, exit). Closed under the
        hold, the file lock went mid-write, and the put's release failed on descriptor -1."""
        if self._pid != os.getpid():  # inherited, or closed already: nothing of this process's
            self._fd, self._pid = -1, -1
            return
        thread_lock = self._thread_lock
        if thread_lock._is_owned():  # this thread holds it, or is taking it: we are its signal handler
            self._close_on_release = True
            return
        try:
            took = thread_lock.acquire(timeout=min(max(self.timeout_s, 0), _CLOSE_WAIT_S))
        except BaseException:  # a Ctrl-C raised as the call returns, the lock taken (see acquire)
            if thread_lock._is_owned():
                thread_lock.release()
            raise
        if not took:
            self._close_on_release = True  # another thread holds it still: its release closes
            return
        try:
            self._close_fd()
            self._pid = -1
        finally:
            thread_lock.release()


def _held_elsewhere(what: str, path: Path, timeout_s: float) -> LockTimeout:
    return LockTimeout(
        f"timed out after {timeout_s:.1f}s waiting for {what} ({path}): a live process holds it "
        f"(a dead one would have released it); find it with `fuser {path}`"
    )


def slot_is_alive(path: Path, *, unlink_if_dead: bool = False) -> bool:
    """True if a live process holds the slot lock at ``path`` (see NOTE [lock files]).

    With ``unlink_if_dead``, a dead slot's file is removed *while we hold its lock*: a process
    that opened it just before has to notice (LivenessSlot checks the inode after locking),
    instead of holding a lock on a file nobody else can see.
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        if unlink_if_dead and _same_file(fd, path):
            os.unlink(path)
    except BlockingIOError:
        return True
    except OSError as exc:  # pragma: no cover - exotic filesystems
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            return True
        raise
    finally:
        os.close(fd)  # closing drops our lock, if we got it
    return False


def _same_file(fd: int, path: Path) -> bool:
    try:
        return os.stat(path).st_ino == os.fstat(fd).st_ino
    except FileNotFoundError:
        return False


class LivenessSlot:
    """Slot ``k`` in ``directory``, held by this process for its whole life.

    The first free ``<k>.lock`` is taken with a non-blocking flock; the owner's PID is written
    into it for display only. Counters indexed by the slot number are then written by one live
    process at a time, which makes them race-free without atomic instructions.
    """

    def __init__(self, directory: Path, max_slots: int):
        self.directory = Path(directory)
        self.pid = os.getpid()
        k = 0
        while k < max_slots:
            path = self.directory / f"{k}.lock"
            fd = _open_lock_file(path)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                k += 1
                continue
            if not _same_file(fd, path):  # gc unlinked it between our open and our lock
                os.close(fd)
                continue  # the same k again, on a fresh file
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{self.pid}\n".encode(), 0)
            self.index, self.path, self._fd = k, path, fd
            return
        raise LockTimeout(
            f"all {max_slots} process slots in {self.directory} are held by live processes "
            f"(each process that reads a cache of the session holds one until it exits)"
        )

    def release(self) -> None:
        if self._fd >= 0 and self.pid == os.getpid():
            os.close(self._fd)  # the kernel drops the lock with the last descriptor
        self._fd = -1

    def forget_after_fork(self) -> None:
        """In a forked child: close the inherited descriptor without touching the parent's lock."""
        if self._fd >= 0:
            os.close(self._fd)  # the parent's descriptor keeps the open file, and so the lock
        self._fd = -1


class SharedHold:
    """A shared ``flock`` on ``path``, held while this process uses what the file stands for (an
    open cache: NOTE [cache use]). Any number of processes hold it at once;
    :func:`unless_held` takes it exclusively only when none does. Taking it and letting it go
    touch the file: its mtime says when it was last taken or let go. A forked child closes its
    inherited copy (NOTE [lock files]): the parent's hold is the parent's."""

    def __init__(self, path: str | os.PathLike, *, timeout_s: float = DEFAULT_TIMEOUT_S, what: str = ""):
        self.path, self.pid, self._fd = Path(path), os.getpid(), -1
        deadline, delay = time.monotonic() + timeout_s, 20e-6
        while True:
            fd = _open_lock_file(self.path)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:  # unless_held has it, for a moment (it drops the cache, or not)
                os.close(fd)
                if time.monotonic() >= deadline:
                    raise _held_elsewhere(what or "a shared lock", self.path, timeout_s) from None
                time.sleep(delay)
                delay = min(delay * 2, 0.01)
                continue
            if not _same_file(fd, self.path):  # removed by whoever held it: take the new file
                os.close(fd)
                continue
            break
        self._fd = fd
        _touch(fd)
        close_in_forked_children(self)

    def release(self) -> None:
        if self._fd >= 0 and self.pid == os.getpid():
            _touch(self._fd)
            os.close(self._fd)
        self._fd = -1

    def after_fork_in_child(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # the parent's descriptor keeps the open file, and so its hold
        self._fd = -1


def _touch(fd: int) -> None:
    try:
        os.utime(fd)
    except OSError:  # a read-only directory: the time only looks older
        pass


@contextlib.contextmanager
def unless_held(path: str | os.PathLike) -> Iterator[bool]:
    """Yield True holding ``path`` exclusively when no process holds it (SharedHold), so that
    nobody takes it until the block ends - the block may remove the file: a waiting SharedHold
    then takes a new one; yield False, holding nothing, when a live process holds it."""
    path = Path(path)
    try:
        fd = _open_lock_file(path)
    except FileNotFoundError:  # its directory is gone
        yield True
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)
