"""Claims: a key missed by several processes of a node at once is computed by one of them.

NOTE [claims]
    The protocol of a single-key miss (``CacheStore.fill``: ``ds[i]`` of a wrapped dataset,
    ``cache.get(key, fn)``), after the lookup missed:

      1. claim: an OFD byte-range lock (``fcntl.F_OFD_SETLK``, a write lock on one byte) on the
         cache's claims file, ``caches/<cache>.claims`` in the session's private directory; the
         byte is the key's bucket, a hash of its index word (index.key_bytes) into BUCKETS;
      2. re-check: look the key up again (someone may have published it between our miss and our
         claim); found: release, serve it (counted ``claim_waits``, as a wait that found it);
      3. compute the value, then publish it (``put``: NOTE [publish order]);
      4. release the claim - after the publish, so whoever takes the claim next finds the value.

    Who waits, how long. A process whose claim is refused (another process holds the bucket)
    waits: it polls with a growing sleep (50 us, doubling, at most 5 ms) for either the value in
    the index (it serves it: counted ``claim_waits``) or the claim free (it takes it and goes on
    at 2: the holder died, or published nothing - a full cache, an error). The whole wait is
    bounded by ``claim_timeout_s`` (CLAIM_TIMEOUT_S, or $SHMCACHE_CLAIM_TIMEOUT_S): then it
    computes and publishes without the claim (counted ``claim_timeouts``): a stopped holder
    (SIGSTOP, a debugger) or a very slow sample costs one timeout, never a hang. Two keys in one
    bucket wait for each other the same way: a bounded wait, never a wrong value. So does a holder
    whose computation misses other keys (a ``fn`` that reads the cache): a cycle of such holders
    costs one ``claim_timeout_s``, then each computes. A claim never decides which value is
    served: values are deterministic and the first publish wins, as without claims; a second
    computation is waste, never damage (at least once per key). A publish that stores nothing
    (a full cache) leaves the next taker to compute again: misses of one key then take turns.

    What dies with whom. An OFD lock belongs to the open file description, and the kernel drops
    it when the last descriptor of it closes: when its holder exits or is killed (SIGKILL too) -
    at once, not after a timeout, so a waiter takes the claim on its next poll. Threads of one
    process share the description (a lock taken twice is one lock), so a process keeps the
    buckets its threads hold in a set: another thread (or a nested miss of the same thread) that
    finds its bucket held in its own process computes without a claim, never waits for itself
    (two threads that take one bucket at the same instant may both compute: waste only).

    Fork. An inherited descriptor shares the parent's description, so a forked child (a
    DataLoader worker) and its parent would not exclude each other, and a child that kept it would
    keep the parent's claims alive after the parent died. The child closes the inherited
    descriptor first thing after the fork (base/locks.py close_in_forked_children; NOTE [lock
    files]) and opens its own on its first claim (``process_slot.fork_count`` tells).

    Also in the file, at offset 0: the claim counters, MAX_SLOTS rows of COUNTER_NAMES words,
    each process writing only the row of its liveness slot (one aligned 8-byte store per count,
    as NOTE [tier counts]); ``stats()`` sums them. They count since the cache was made (a clear()
    keeps them). The locks are on bytes of their own, past the rows (a lock is on a range of the
    file, not on its contents). The file goes with its cache (destroy, drop, gc of a cache whose
    metadata is gone); nothing is in /dev/shm. Without OFD locks (not Linux) claims are off: every
    miss computes, as before. ``SHMCACHE_CLAIMS=0`` turns them off too (benchmarks).
"""

from __future__ import annotations

import errno
import fcntl
import logging
import mmap
import os
import stat
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..base import settings
from ..base.locks import close_in_forked_children
from ..errors import InvalidArgument
from . import process_slot
from .index import key_bytes
from .registry import MAX_SLOTS

__all__ = [
    "BUCKETS",
    "CLAIM_TIMEOUT_S",
    "COUNTER_NAMES",
    "COMPUTED",
    "CLAIM_WAITS",
    "CLAIM_TIMEOUTS",
    "Claims",
    "fill",
    "read_counts",
    "Served",
    "SUPPORTED",
]

log = logging.getLogger("shmcache")

BUCKETS = 1 << 16  # one byte each: at most this many claims on one inode's lock list at once
CLAIM_TIMEOUT_S = 10.0  # the longest a miss waits for another process's claim (NOTE [claims])
FIRST_SLEEP_S, MAX_SLEEP_S = 50e-6, 5e-3

COUNTER_NAMES = ("computed", "claim_waits", "claim_timeouts")
COMPUTED, CLAIM_WAITS, CLAIM_TIMEOUTS = 0, 1, 2
ROW_WORDS = 4  # a spare word per row
_ROWS_BYTES = MAX_SLOTS * ROW_WORDS * 8
_LOCKS_OFF = _ROWS_BYTES  # bucket b is the byte at _LOCKS_OFF + b

SUPPORTED = hasattr(fcntl, "F_OFD_SETLK")
_SETLK = getattr(fcntl, "F_OFD_SETLK", 0)
# struct flock (Linux, 64-bit off_t): l_type, l_whence, l_start, l_len, l_pid (0 for OFD locks)
_FLOCK = struct.Struct("hhqqi4x")
_BUSY = (errno.EAGAIN, errno.EACCES)

# Claims.take: ours now; another process's; this process's already. Claims.wait also: the value
# was found (FOUND), or claim_timeout_s passed (TIMED_OUT)
TAKEN, BUSY, OURS, FOUND, TIMED_OUT = 0, 1, 2, 3, 4


class Served:
    """A compute callback's answer for a key whose value it did not compute but found (another
    node's, read from a tier after waiting on its lease: NOTE [remote leases]): already admitted
    into shared memory; neither counted as computed nor published again (``fill`` returns its
    ``value``)."""

    __slots__ = ("value",)

    def __init__(self, value: Any):
        self.value = value


_WRLCK, _UNLCK = fcntl.F_WRLCK, fcntl.F_UNLCK  # l_whence 0: SEEK_SET
_M64 = (1 << 64) - 1
_FIB, _BUCKET_SHIFT = 0x9E3779B97F4A7C15, 64 - 16  # BUCKETS == 1 << 16


class Claims:
    """The claims of one cache in this process (NOTE [claims]): its claims file, opened on first
    use in each process, the buckets this process holds, and this process's counter row."""

    def __init__(self, path: Path, slot: Callable[[], int], timeout_s: float | None = None):
        self.path = Path(path)
        self._slot = slot  # this process's liveness slot in the session (its counter row)
        self.timeout_s = _timeout(timeout_s)
        self.on = SUPPORTED and settings.get(settings.ENV_CLAIMS, "1").strip().lower() not in (
            "0",
            "false",
            "no",
            "off",
        )
        self._fd = -1
        self._gen = -1  # process_slot.fork_count() when the descriptor and row were made
        self._row: Any = None  # this process's counter words: a memoryview of the file's row, or a list
        self._mm: mmap.mmap | None = None
        self._held: set[int] = set()  # buckets this process holds (NOTE [claims]: threads)
        close_in_forked_children(self)

    # --- per process -------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """In a forked child, first thing: our copy of the parent's descriptor goes (closing it
        never drops the parent's locks), and so do the parent's held buckets and row."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._row, self._mm, self._gen = -1, None, None, -1
        self._held = set()

    def _open(self) -> None:
        """This process's descriptor of the claims file and its counter row (once per process)."""
        if self._fd >= 0:  # inherited (a fork the at-fork hook did not see): ours is made anew
            os.close(self._fd)
        self._fd, self._row = -1, None
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
                raise PermissionError(f"{self.path} is not a regular file of this user")
            if st.st_size < _ROWS_BYTES:
                os.ftruncate(fd, _ROWS_BYTES)  # two makers at once truncate to one size: harmless
            mm = mmap.mmap(fd, _ROWS_BYTES)
        except BaseException:
            os.close(fd)
            raise
        self._fd, self._mm, self._gen = fd, mm, process_slot.fork_count()
        try:
            slot = self._slot()
            # one aligned 8-byte store per count (memoryview 'Q' items), as the store's counters
            row = memoryview(mm).cast("Q")[slot * ROW_WORDS : (slot + 1) * ROW_WORDS]
            if any(w >= 1 << 62 for w in row):  # garbage: a statistic restarts, reads go on
                row[:] = memoryview(bytes(8 * ROW_WORDS)).cast("Q")
        except Exception as exc:  # noqa: BLE001 - no slot (every one taken): count in this process only
            log.warning("cache claims %s: this process's counts are kept in the process only (%s)", self.path, exc)
            row = [0] * ROW_WORDS
        self._row = row

    def _ready(self) -> bool:
        if self._gen != process_slot.fork_count():
            try:
                self._open()
            except OSError as exc:
                if self.on:
                    log.warning("cache claims %s cannot be used (%s): misses compute without claims", self.path, exc)
                self.on = False
                self._row, self._gen = [0] * ROW_WORDS, process_slot.fork_count()
                return False
        return True

    def count(self, which: int, n: int = 1) -> None:
        if self._gen != process_slot.fork_count():
            self._ready()
        self._row[which] += n  # one aligned store into our own row

    # --- claims ------------------------------------------------------------------------------

    def bucket(self, key: Any) -> int:
        w1 = key & _M64 if type(key) is int else key_bytes(key)[0]
        return ((w1 * _FIB) & _M64) >> _BUCKET_SHIFT  # Fibonacci hashing: the top 16 bits

    def take(self, bucket: int) -> int:
        """TAKEN (ours now), BUSY (another process holds it) or OURS (this process holds it)."""
        # no thread lock: two threads of ours that both take one bucket both compute (waste only)
        if bucket in self._held:
            return OURS
        try:
            fcntl.fcntl(self._fd, _SETLK, _FLOCK.pack(_WRLCK, 0, _LOCKS_OFF + bucket, 1, 0))
        except OSError as exc:
            if exc.errno in _BUSY:
                return BUSY
            raise
        self._held.add(bucket)
        return TAKEN

    def release(self, bucket: int) -> None:
        self._held.discard(bucket)
        if self._fd >= 0:
            fcntl.fcntl(self._fd, _SETLK, _FLOCK.pack(_UNLCK, 0, _LOCKS_OFF + bucket, 1, 0))

    def wait(self, bucket: int, look: Callable[[], Any], missing: Any) -> tuple[int, Any]:
        """Wait for another process's claim on ``bucket`` (NOTE [claims]): ``(TAKEN, missing)``
        once it is ours (``OURS``: another thread of ours took it), ``(FOUND, value)`` once
        ``look()`` finds the value, ``(TIMED_OUT, missing)`` after ``timeout_s``."""
        deadline = time.monotonic() + self.timeout_s
        delay = FIRST_SLEEP_S
        while True:
            time.sleep(delay)
            value = look()
            if value is not missing:
                return FOUND, value
            got = self.take(bucket)
            if got != BUSY:
                return got, missing
            if time.monotonic() >= deadline:
                return TIMED_OUT, missing
            delay = min(delay * 2, MAX_SLEEP_S)

    def close(self) -> None:
        if self._fd >= 0 and self._gen == process_slot.fork_count():
            os.close(self._fd)  # drops every claim of this process on the file
        self._fd, self._gen, self._row = -1, -1, None
        self._held = set()


def _timeout(given: float | None) -> float:
    """``claim_timeout_s``: given, else $SHMCACHE_CLAIM_TIMEOUT_S, else CLAIM_TIMEOUT_S."""
    raw = given if given is not None else settings.get(settings.ENV_CLAIM_TIMEOUT_S)
    if raw is None:
        return CLAIM_TIMEOUT_S
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = -1.0
    if not 0 <= value < float("inf"):
        where = "claim_timeout_s" if given is not None else f"${settings.ENV_CLAIM_TIMEOUT_S}"
        raise InvalidArgument(
            f"{where}={raw!r}: the longest a miss waits for another process's claim "
            f"is a number of seconds >= 0 (default {CLAIM_TIMEOUT_S:g})"
        )
    return value


def fill(
    claims: Claims | None,
    key: Any,
    look: Callable[[], Any],
    missing: Any,
    compute: Callable[[Any], Any],
    publish: Callable[[Any, Any], Any],
) -> Any:
    """The value of ``key`` after a miss (NOTE [claims]): computed by ``compute(key)`` and
    published by ``publish(key, value)`` under a claim, or found by ``look()`` (no count) once
    another process published it."""
    if claims is None:
        return _computed(None, key, compute, publish)
    if not ((claims._gen == process_slot.fork_count() or claims._ready()) and claims.on):
        return _computed(claims, key, compute, publish)
    bucket = claims.bucket(key)
    try:
        got = claims.take(bucket)
        if got == BUSY:
            got, value = claims.wait(bucket, look, missing)
            if got == FOUND:  # published by the holder while we waited
                claims.count(CLAIM_WAITS)
                return value
            if got == TIMED_OUT:  # a stopped or very slow holder: compute without the claim
                claims.count(CLAIM_TIMEOUTS)
    except OSError as exc:  # the lock itself failed (ENOLCK, a descriptor closed under us)
        log.warning("cache claims %s cannot be taken (%s): misses compute without claims", claims.path, exc)
        claims.on = False
        got = OURS  # compute without a claim, as with claims off
    if got != TAKEN:  # another thread of this process holds it, or we timed out: no claim
        return _computed(claims, key, compute, publish)
    try:
        value = look()  # the re-check: published between our miss and our claim?
        if value is missing:
            # published before the release: the next taker finds it
            value = _computed(claims, key, compute, publish)
        else:
            claims.count(CLAIM_WAITS)  # another's value, not computed: a miss is one or the other
    finally:
        try:
            claims.release(bucket)
        except OSError:  # the descriptor closed under us (close() in another thread): dropped anyway
            pass
    return value


def _computed(claims: Claims | None, key: Any, compute: Callable[[Any], Any],
              publish: Callable[[Any, Any], Any]) -> Any:
    """``compute(key)``, counted and published; a ``Served`` answer (found, already admitted) is
    neither: its value is returned as it is."""
    value = compute(key)
    if type(value) is Served:
        return value.value
    if claims is not None:
        claims.count(COMPUTED)
    publish(key, value)
    return value


def read_counts(path: Path) -> dict:
    """The claim counters summed over every process's row (zeros when the file is missing)."""
    try:
        with open(path, "rb") as f:
            raw = f.read(_ROWS_BYTES)
    except (FileNotFoundError, NotADirectoryError):
        raw = b""
    n = len(raw) // (ROW_WORDS * 8) * (ROW_WORDS * 8)
    rows = np.frombuffer(raw[:n], np.uint64).reshape(-1, ROW_WORDS)
    rows = rows[(rows < 1 << 62).all(axis=1)]
    total = rows.sum(axis=0) if len(rows) else np.zeros(ROW_WORDS, np.uint64)
    return {name: int(total[i]) for i, name in enumerate(COUNTER_NAMES)}
