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

    A batch (``CacheStore.fill_batch``: ``get_batch(fn=)``, ``__getitems__`` and so a
    DataLoader's batches, a warm-up's batches of misses, ``dataset.WARMUP_BATCH``), after its
    lookup missed ``keys``: 1. try to claim every key, never waiting (a refused claim is set
    aside); 2. re-check the claimed ones (one vectorised probe for int keys: someone may have
    published them meanwhile); 3. compute the rest in ONE call (the dataset's ``__getitems__``
    where it has one) and publish them in one ``put_many`` (one lock hold, a chunk at a time:
    NOTE [publish order]); 4. release them (one unlock of the range of bytes they span, split
    only around a byte another claim of this process holds: unlocking a byte that no claim of
    ours holds changes nothing). Only then 5. poll the keys set aside: found ones are
    served (``claim_waits``), free ones claimed and taken through 2-4; the whole batch's wait is
    bounded by one ``claim_timeout_s``, then what is left is computed without claims
    (``claim_timeouts``, one per key). A key twice in a batch (a sampler drawing with
    replacement) is claimed and computed once, its other positions served a copy. So a batch
    holds claims only while it computes, never while it waits for the keys it set aside: two
    batches that overlap cannot wait for each other. A compute callback may answer
    ``Served(value)`` for a key it did not compute (a remote tier's lease holder published it):
    not counted, not published again.

    Who waits, how long. A process whose claim is refused (another process holds the bucket)
    waits: it polls with a growing sleep (50 us, doubling, at most 5 ms) for either the value in
    the index (it serves it: counted ``claim_waits``) or the claim free (it takes it and goes on
    at 2: the holder died, or published nothing - a full cache, an error). The whole wait is
    bounded by ``claim_timeout_s`` (CLAIM_TIMEOUT_S, or $SHMCACHE_CLAIM_TIMEOUT_S): then it
    computes and publishes without the claim (counted ``claim_timeouts``): a stopped holder
    (SIGSTOP, a debugger) or a very slow sample costs one timeout, never a hang - one a STUCK_S
    (30 s), not one per batch that meets one of the keys it holds: a holder writes its liveness
    slot into its bucket's owner word once the lock is its own; a wait that times out marks the
    holders of its buckets stuck in this process for STUCK_S; the misses of any bucket whose owner
    word names a stuck holder compute at once, without the claim (counted ``claim_timeouts`` too),
    while that holder keeps the bucket the wait timed out on (``F_OFD_GETLK``, and its owner word
    still names it): one that went on, or died and left its slot to another process, is waited
    for again. An owner word read as it changes names the wrong holder at worst: a wait made or a
    computation made twice, never a wrong value. Two keys in one bucket wait for each other the
    same way: a bounded wait, never a wrong value. So does a holder whose computation misses
    other keys (a ``fn`` that reads this cache or another): a cycle of
    such holders costs one ``claim_timeout_s`` in all, then each computes - not one per nested
    miss: the misses of a thread computing under claims share the deadline its first wait set
    (``Claims.wait_deadline``; a batch's computation misses key after key). A claim never
    decides which value is served: values are deterministic and the first publish wins, as
    without claims; a second computation is waste, never damage (at least once per key). A
    publish that stores nothing (a full cache) leaves the next taker to compute again: misses of
    one key then take turns.

    What dies with whom. An OFD lock belongs to the open file description, and the kernel drops
    it when the last descriptor of it closes: when its holder exits or is killed (SIGKILL too) -
    at once, not after a timeout, so a waiter takes the claim on its next poll. An interrupt
    (Ctrl-C) anywhere in a miss, a batch's or a single key's, leaves no claim held: ``take``
    takes and records a bucket or holds nothing, a bucket is forgotten only after it is
    unlocked, and one ``finally`` releases what was taken (a release an interrupt cuts as it
    begins is made again; releasing a bucket not locked is harmless). Threads of one process
    share the description (a lock taken twice is one lock), so a process keeps the buckets its
    threads hold in a set: another thread (or a nested miss of the same thread) that finds its
    bucket held in its own process computes without a claim, never waits for itself (two threads
    that take one bucket at the same instant may both compute: waste only). A batch releases its
    claims with one unlock of the range they span, split around the other buckets in that set; a
    take locks and records its bucket under a thread lock that this release holds too (else a
    claim another thread took inside the range meanwhile went with the batch's, and another
    process computed its key again).

    Fork. An inherited descriptor shares the parent's description, so a forked child (a
    DataLoader worker) and its parent would not exclude each other, and a child that kept it would
    keep the parent's claims alive after the parent died. The child closes the inherited
    descriptor first thing after the fork (``locks.close_in_forked_children``; NOTE [lock
    files]) and opens its own on its first claim (``process_slot.fork_count`` tells).

    Also in the file, at offset 0: the claim counters, a slot rows file's rows of ROW_WORDS words
    (COUNTER_NAMES, then a spare word; NOTE [slot rows]); ``stats()`` sums them. They count since
    the cache was made (a clear() keeps them). The locks are on bytes of their own, past the rows
    (a lock is on a range of the file, not on its contents); from _OWNERS_OFF (128 KiB, a page
    boundary with pages of up to 64 KiB) each bucket's owner word (u16: the liveness slot + 1 of
    the process that last took it). The file grows to hold them on first use, backed (never a
    hole, whose first store would be a SIGBUS on a full mount; never shrunk under a mapping). The
    file goes with its cache (destroy, drop, gc of a cache whose metadata is gone); nothing is in
    /dev/shm. Without OFD
    locks (not Linux) claims are off: every miss computes, as before. ``SHMCACHE_CLAIMS=0`` turns
    them off too (benchmarks).
"""

from __future__ import annotations

import bisect
import copy
import errno
import fcntl
import logging
import mmap
import os
import struct
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..base import settings
from ..base.locks import close_in_forked_children
from ..base.owned_file import grow
from ..errors import InvalidArgument
from . import codec, process_slot
from .index import key_bytes
from .registry import MAX_SLOTS
from .slot_rows import SlotRows

__all__ = [
    "BUCKETS",
    "CLAIM_TIMEOUT_S",
    "COUNTER_NAMES",
    "COMPUTED",
    "CLAIM_WAITS",
    "CLAIM_TIMEOUTS",
    "Claims",
    "fill",
    "fill_batch",
    "Served",
    "read_counts",
    "Served",
    "SUPPORTED",
    "timeout_setting",
]

log = logging.getLogger("shmcache")

BUCKETS = 1 << 16  # one byte each: at most this many claims on one inode's lock list at once
CLAIM_TIMEOUT_S = 10.0  # the longest a miss waits for another process's claim (NOTE [claims])
# after a wait for a holder timed out, misses of the buckets it holds compute without waiting for
# this long (NOTE [claims]): a stopped holder costs one timeout, not one per batch meeting its keys
STUCK_S = 30.0
FIRST_SLEEP_S, MAX_SLEEP_S = 50e-6, 5e-3

COUNTER_NAMES = ("computed", "claim_waits", "claim_timeouts")
COMPUTED, CLAIM_WAITS, CLAIM_TIMEOUTS = 0, 1, 2
ROW_WORDS = 4  # a spare word per row
_LOCKS_OFF = MAX_SLOTS * ROW_WORDS * 8  # past the counter rows: bucket b is the byte at _LOCKS_OFF + b
# past the lock bytes, at a page boundary with 4 to 64 KiB pages (an mmap's offset is one): bucket
# b's holder, as its liveness slot + 1, a u16 (0: none known)
_OWNERS_OFF = 128 << 10
assert _OWNERS_OFF >= _LOCKS_OFF + BUCKETS

SUPPORTED = hasattr(fcntl, "F_OFD_SETLK")
_SETLK = getattr(fcntl, "F_OFD_SETLK", 0)
_GETLK = getattr(fcntl, "F_OFD_GETLK", 0)
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
        self.on = SUPPORTED and not settings.turned_off(settings.ENV_CLAIMS)
        self._fd = -1
        self._gen = -1  # process_slot.fork_count() when the descriptor and row were made
        self._row: Any = None  # this process's counter words: a memoryview of the file's row, or a list
        self._mm: mmap.mmap | None = None
        self._held: set[int] = set()  # buckets this process holds (NOTE [claims]: threads)
        self._owners: np.ndarray | None = None  # the file's owner words (_OWNERS_OFF), mapped
        self._me = 0  # this process's owner word: its liveness slot + 1 (0: it has none)
        # a stuck holder's owner word -> (until when its buckets' misses do not wait, the bucket a
        # wait timed out on: while the holder keeps it, it is stuck)
        self._stuck: dict[int, tuple[float, int]] = {}
        # a take's lock and record vs a batch's range unlock (release_many): re-entrant, for a
        # signal handler that misses on the thread it interrupted
        self._mutex = threading.RLock()
        close_in_forked_children(self)

    # --- per process -------------------------------------------------------------------------

    def after_fork_in_child(self) -> None:
        """In a forked child, first thing: our copy of the parent's descriptor goes (closing it
        never drops the parent's locks), and so do the parent's held buckets and row."""
        if self._fd >= 0:
            os.close(self._fd)
        self._fd, self._row, self._mm, self._gen = -1, None, None, -1
        self._owners, self._me = None, 0  # the mapping is the same file's: made again with our slot
        self._held = set()
        self._stuck = {}
        self._mutex = threading.RLock()  # held by a thread of the parent's at the fork, maybe

    def _open(self) -> None:
        """This process's descriptor of the claims file and its counter row (once per process)."""
        if self._fd >= 0:  # inherited (a fork the at-fork hook did not see): ours is made anew
            os.close(self._fd)
        self._fd, self._row = -1, None
        rows = _rows(self.path, self._slot)
        fd, mm = rows.open()
        self._fd, self._mm, self._gen = fd, mm, process_slot.fork_count()
        self._row = rows.row_in(mm, fd)  # no slot: a row of process memory
        self._owners, self._me = _owner_words(fd, self._slot)

    def _ready(self) -> bool:
        if self._gen != process_slot.fork_count():
            try:
                self._open()
            except OSError as exc:
                if self.on:
                    log.warning("cache claims %s cannot be used (%s): misses compute without claims", self.path, exc)
                self.on = False
                self._row, self._gen = _rows(self.path).memory_row(), process_slot.fork_count()
                return False
        return True

    def usable(self) -> bool:
        """Whether misses go through claims in this process: the claims file opened here (once
        per process; a failure to open it turns claims off, said once) and claims not switched off."""
        return (self._gen == process_slot.fork_count() or self._ready()) and self.on

    @property
    def held(self) -> frozenset[int]:
        """The buckets this process holds now (a test's view: none once a miss has returned)."""
        return frozenset(self._held)

    def owner_word(self, bucket: int) -> int:
        """The owner word the last holder of ``bucket`` wrote (its liveness slot + 1; 0 where none
        was written, or the words cannot be had): a test's view of who a stuck mark names."""
        return 0 if self._owners is None else int(self._owners[bucket])

    def forget(self, bucket: int) -> None:
        """Drop ``bucket`` from what this process holds without unlocking it: its descriptor is
        closed already (``close()`` in another thread), which dropped the lock."""
        self._held.discard(bucket)

    def count(self, which: int, n: int = 1) -> None:
        if self._gen != process_slot.fork_count():
            self._ready()
        self._row[which] += n  # one aligned store into our own row

    # --- claims ------------------------------------------------------------------------------

    def bucket(self, key: Any) -> int:
        w1 = key & _M64 if type(key) is int else key_bytes(key)[0]
        return ((w1 * _FIB) & _M64) >> _BUCKET_SHIFT  # Fibonacci hashing: the top 16 bits

    def buckets(self, keys: Sequence) -> list[int]:
        """``bucket`` of each of ``keys``: a batch of int keys in one numpy pass."""
        if all(type(k) is int for k in keys):
            try:
                w1 = np.fromiter(keys, np.int64, len(keys)).view(np.uint64)  # key & _M64, as bucket
            except OverflowError:  # a key past 64 bits: one at a time
                pass
            else:
                return ((w1 * np.uint64(_FIB)) >> np.uint64(_BUCKET_SHIFT)).tolist()  # mod 2**64, as bucket
        return [self.bucket(key) for key in keys]

    def take_many(self, buckets: Sequence[int], positions: Sequence[int], held: list[int]) -> tuple[list, list]:
        """``take`` of ``buckets[j]`` for each ``j`` of ``positions``, under one hold of the thread
        lock: ``(mine, busy)``, the positions whose claim is ours now (taken, or this process's
        already) and those another process holds. Each bucket is appended to ``held`` before it
        is taken and removed again unless taken, so the caller releases ``held`` whatever
        happens after; an interrupt (Ctrl-C) as a bucket is taken is undone here, under the
        thread lock. OSError where the lock itself fails (ENOLCK, a descriptor closed under us)."""
        mine: list[int] = []
        busy: list[int] = []
        own, fd, pack, owners = self._held, self._fd, _FLOCK.pack, self._owners
        with self._mutex:  # as take: recorded only once locked
            for j in positions:
                bucket = buckets[j]
                if bucket in own:
                    mine.append(j)
                    continue
                try:
                    held.append(bucket)
                    fcntl.fcntl(fd, _SETLK, pack(_WRLCK, 0, _LOCKS_OFF + bucket, 1, 0))
                except OSError as exc:
                    held.pop()
                    if exc.errno in _BUSY:
                        busy.append(j)
                        continue
                    raise
                except BaseException:
                    # an interrupt before the lock or as it returns: undone here, under the thread
                    # lock. Left in held, it would be released once we let go of the thread lock,
                    # after another thread of ours may have taken it (its claim unlocked with ours)
                    if held and held[-1] == bucket:
                        try:
                            fcntl.fcntl(fd, _SETLK, pack(_UNLCK, 0, _LOCKS_OFF + bucket, 1, 0))
                        except OSError:  # the descriptor closed under us: its locks went with it
                            pass
                        held.pop()
                    raise
                own.add(bucket)
                mine.append(j)
                if owners is not None:  # who holds it, for a waiter whose wait times out (stuck)
                    owners[bucket] = self._me
        return mine, busy

    def take(self, bucket: int) -> int:
        """TAKEN (ours now), BUSY (another process holds it) or OURS (this process holds it):
        ``take_many`` of one bucket, whose lock and record it shares."""
        held: list[int] = []
        try:
            _, busy = self.take_many((bucket,), (0,), held)
            return BUSY if busy else TAKEN if held else OURS
        except BaseException:  # an interrupt once it was recorded (take_many undoes one before)
            for b in held:
                _release(self, b)
            raise

    def release(self, bucket: int) -> None:
        if self._fd >= 0:
            fcntl.fcntl(self._fd, _SETLK, _FLOCK.pack(_UNLCK, 0, _LOCKS_OFF + bucket, 1, 0))
        self._held.discard(bucket)

    def release_many(self, buckets: list[int]) -> None:
        """Release ``buckets`` (each taken by ``take``, none twice) with one unlock of the range
        from the lowest to the highest, split only where another claim of this process (another
        thread's, an outer miss's) lies between: unlocking a byte nobody of ours holds is a no-op."""
        if not buckets:
            return
        ours = sorted(buckets)
        mine = set(ours)
        # no take() in between: a claim another thread takes while we read what it holds, inside
        # our range, would be unlocked with ours (another process computes its key again)
        with self._mutex:
            others = [b for b in sorted(self._held) if b not in mine] if len(self._held) > len(mine) else []
            if self._fd >= 0:
                start = ours[0]
                for lo, hi in zip(ours, ours[1:]):
                    k = bisect.bisect_right(others, lo)
                    if k < len(others) and others[k] < hi:  # another claim of ours between: keep it
                        self._unlock(start, lo)
                        start = hi
                self._unlock(start, ours[-1])
            self._held.difference_update(mine)

    def _unlock(self, first: int, last: int) -> None:
        fcntl.fcntl(self._fd, _SETLK, _FLOCK.pack(_UNLCK, 0, _LOCKS_OFF + first, last - first + 1, 0))

    def timed_out(self, buckets: Sequence[int]) -> None:
        """A wait for the holders of ``buckets`` timed out: the misses of every bucket those
        holders hold compute without waiting, for STUCK_S or until the holder lets go of the
        bucket waited on (``stuck``; NOTE [claims]: a holder stopped in a debugger costs one
        timeout, not one a batch that meets one of its keys)."""
        if self._owners is None:
            return
        until = time.monotonic() + STUCK_S
        for bucket in buckets:
            owner = int(self._owners[bucket])
            if owner and owner != self._me:
                self._stuck[owner] = (until, bucket)

    def has_stuck(self) -> bool:
        return bool(self._stuck)

    def stuck(self, bucket: int) -> bool:
        """Whether ``bucket``'s holder, as its owner word says, is one a wait of this process
        timed out on (``timed_out``) that still holds the bucket of that wait, within STUCK_S: its
        misses compute without waiting. A holder that let go of that bucket (it went on, or died
        and another process took its slot) is waited for again."""
        if not self._stuck or self._owners is None:
            return False
        owner = int(self._owners[bucket])
        mark = self._stuck.get(owner)
        if mark is None:
            return False
        until, witness = mark
        if time.monotonic() < until and int(self._owners[witness]) == owner and self._locked(witness):
            return True
        self._stuck.pop(owner, None)  # (another thread may have dropped it too)
        return False

    def _locked(self, bucket: int) -> bool:
        """Whether another open file description (another process) holds ``bucket``'s lock."""
        try:
            got = fcntl.fcntl(self._fd, _GETLK, _FLOCK.pack(_WRLCK, 0, _LOCKS_OFF + bucket, 1, 0))
        except OSError:  # the descriptor closed under us: nothing is known to wait for
            return False
        return _FLOCK.unpack(got)[0] != _UNLCK

    def wait(self, bucket: int, look: Callable[[], Any], missing: Any) -> tuple[int, Any]:
        """Wait for another process's claim on ``bucket`` (NOTE [claims]): ``(TAKEN, missing)``
        once it is ours (``OURS``: another thread of ours took it), ``(FOUND, value)`` once
        ``look()`` finds the value, ``(TIMED_OUT, missing)`` after ``timeout_s``."""
        deadline = self.wait_deadline()
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

    def wait_deadline(self) -> float:
        """When a wait for other processes' claims that starts now gives up: ``timeout_s`` from
        now; for a miss nested in a computation under this thread's claims (a ``compute`` that
        reads this cache or another), which waits while it holds them, the deadline the first
        such wait set: holders that wait for each other's keys (a cycle) cost one ``timeout_s``
        in all, not one per nested miss (a batch's computation misses one key after another)."""
        t = _THREAD
        if not t.depth:
            return time.monotonic() + self.timeout_s
        if not t.deadline:
            t.deadline = time.monotonic() + self.timeout_s
        return t.deadline

    def holding(self) -> None:
        """This thread computes under claims (until ``done``): its misses meanwhile are nested."""
        _THREAD.depth += 1

    def done(self) -> None:
        t = _THREAD
        t.depth -= 1
        if not t.depth:
            t.deadline = 0.0

    def close(self) -> None:
        if self._fd >= 0 and self._gen == process_slot.fork_count():
            os.close(self._fd)  # drops every claim of this process on the file
        self._fd, self._gen, self._row = -1, -1, None
        self._owners, self._me = None, 0  # (the mapping goes with its last view)
        self._held = set()


class _ThreadState(threading.local):
    """Per thread: how many computations under claims (of any cache) it is inside
    (``Claims.holding``), and the deadline its nested misses' waits share (``Claims.wait_deadline``)."""

    depth = 0
    deadline = 0.0


_THREAD = _ThreadState()


def _forget_thread_state() -> None:
    """In a forked child: the forking thread's computations under claims are the parent's."""
    _THREAD.depth, _THREAD.deadline = 0, 0.0


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_thread_state)


def timeout_setting() -> float:
    """$SHMCACHE_CLAIM_TIMEOUT_S (else CLAIM_TIMEOUT_S), InvalidArgument naming the fix if it is no
    number of seconds: every store's opening reads it (``shmcache gc`` checks it first)."""
    return _timeout(None)


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
    if claims is None or not claims.usable():
        return _compute_one(claims, key, compute, publish)
    bucket = claims.bucket(key)
    got = OURS
    # one try from the take to the release (NOTE [claims]: an interrupt leaves no claim held):
    # take() returns TAKEN or holds nothing, and ``got`` is TAKEN from then on
    try:
        try:
            got = claims.take(bucket)
            if got == BUSY and claims.stuck(bucket):  # its holder kept it past a whole wait lately
                got = TIMED_OUT
                claims.count(CLAIM_TIMEOUTS)
            elif got == BUSY:
                got, value = claims.wait(bucket, look, missing)
                if got == FOUND:  # published by the holder while we waited
                    claims.count(CLAIM_WAITS)
                    return value
                if got == TIMED_OUT:  # a stopped or very slow holder: compute without the claim
                    claims.count(CLAIM_TIMEOUTS)
                    claims.timed_out((bucket,))
        except OSError as exc:  # the lock itself failed (ENOLCK, a descriptor closed under us)
            log.warning("cache claims %s cannot be taken (%s): misses compute without claims", claims.path, exc)
            claims.on = False
            got = OURS  # compute without a claim, as with claims off
        if got != TAKEN:  # another thread of this process holds it, or we timed out: no claim
            return _compute_one(claims, key, compute, publish)
        claims.holding()
        try:
            value = look()  # the re-check: published between our miss and our claim?
            if value is missing:
                value = _compute_one(claims, key, compute, publish)  # published before the release
            else:
                claims.count(CLAIM_WAITS)  # another's value, not computed: a miss is one or the other
        finally:
            claims.done()
        return value
    finally:
        if got == TAKEN:
            try:
                _release(claims, bucket)
            except BaseException:  # an interrupt as the release began: it goes anyway
                _release(claims, bucket)
                raise


def _compute_one(claims: Claims | None, key: Any, compute: Callable, publish: Callable) -> Any:
    """``compute(key)``, published and counted unless it was ``Served``."""
    value = compute(key)
    if type(value) is Served:
        return value.value
    if claims is not None:
        claims.count(COMPUTED)
    publish(key, value)
    return value


def fill_batch(
    claims: Claims | None,
    keys: Sequence,
    look_many: Callable[[list], list],
    missing: Any,
    compute_many: Callable[[list], list],
    publish_many: Callable[[list], Any],
) -> list:
    """The values of ``keys``, every one a miss (NOTE [claims], a batch): the keys whose claims
    this process takes are re-checked with one ``look_many(keys)`` (values, ``missing`` where
    absent), computed with one ``compute_many(keys)`` and published with one ``publish_many([(key,
    value), ...])``, then released; only then does it wait for the keys other processes hold,
    polling them with ``look_many`` and taking and computing what they leave, within one
    ``claim_timeout_s`` for the whole batch. A key met twice (a sampler drawing with replacement)
    is computed once; its other positions get their own copy. A batch computed in more than one
    call serves what the earlier calls returned as the cache holds it (``_detach``)."""
    again = _repeats(keys)
    if again:
        return _fill_repeats(claims, keys, again, look_many, missing, compute_many, publish_many)
    out = [missing] * len(keys)
    if claims is None or not claims.usable():
        _compute(claims, keys, list(range(len(keys))), out, compute_many, publish_many)
        return out
    computed: list[int] = []  # positions an earlier call of compute_many filled (_detach)

    def compute(positions: list[int]) -> None:
        if computed and positions:  # the source is called again for this batch
            _detach(keys, computed, out, look_many, missing)
            computed.clear()
        _compute(claims, keys, positions, out, compute_many, publish_many)
        computed.extend(positions)

    buckets = claims.buckets(keys)
    todo: list[int] = list(range(len(keys)))
    deadline, delay, first = 0.0, FIRST_SLEEP_S, True
    while todo:
        held: list[int] = []  # buckets taken in this round
        mine: list[int] = []  # positions to compute now: their claim is ours (or this process's)
        busy: list[int] = []
        failed: OSError | None = None
        # one try from the first take to the last release, and each bucket in ``held`` before it
        # is taken: an interrupt (Ctrl-C) anywhere in between must not leave a claim held by
        # nobody's account for as long as the process lives (every other process missing its
        # keys would wait claim_timeout_s); releasing one not taken is harmless
        try:
            try:
                mine, busy = claims.take_many(buckets, todo, held)
            except OSError as exc:  # the lock itself failed (ENOLCK, a descriptor closed under us)
                failed = exc
            if failed is None and held:
                mine = _found(claims, keys, mine, out, look_many, missing)  # published meanwhile?
                claims.holding()  # its misses are nested (NOTE [claims]: a cycle costs one timeout)
                try:
                    compute(mine)  # published before the release
                finally:
                    claims.done()
            elif failed is None:  # nothing taken: another thread of ours (or an outer miss) holds them
                compute(mine)
        finally:
            try:
                _release_all(claims, held)
            except BaseException:  # an interrupt as the release began: they go anyway
                _release_all(claims, held)
                raise
        if failed is not None:
            log.warning("cache claims %s cannot be taken (%s): misses compute without claims", claims.path, failed)
            claims.on = False
            compute(todo)
            return out
        if busy and claims.has_stuck():  # keys whose holders kept them past a whole wait lately:
            stuck = [j for j in busy if claims.stuck(buckets[j])]  # computed now, without waiting
            if stuck:
                claims.count(CLAIM_TIMEOUTS, len(stuck))
                compute(stuck)
                skipped = set(stuck)
                busy = [j for j in busy if j not in skipped]
        if not busy:
            break
        if first:
            deadline, first = claims.wait_deadline(), False
        elif time.monotonic() >= deadline:  # stopped or very slow holders: compute without the claims
            claims.count(CLAIM_TIMEOUTS, len(busy))
            claims.timed_out([buckets[j] for j in busy])
            compute(busy)
            break
        time.sleep(delay)
        delay = min(delay * 2, MAX_SLEEP_S)
        todo = _found(claims, keys, busy, out, look_many, missing)  # published by their holders
    return out


def _repeats(keys: Sequence) -> dict[int, int]:
    """{position: position of its key's first occurrence} for every key met again in ``keys``."""
    first: dict = {}
    again = {}
    try:
        if len(set(keys)) == len(keys):  # most batches (a sampler without replacement): one C pass
            return again
        for j, key in enumerate(keys):
            at = first.setdefault(key, j)
            if at != j:
                again[j] = at
    except TypeError:  # an unhashable key (none the cache takes): nothing to merge
        return {}
    return again


def _fill_repeats(claims: Claims | None, keys: Sequence, again: dict[int, int], look_many: Callable,
                  missing: Any, compute_many: Callable, publish_many: Callable) -> list:
    """``fill_batch`` of a batch that holds a key more than once: each key filled once, and
    every other position given its own object (a collate that changes samples in place must not
    change another's): read from the cache as any hit, else a deep copy (not stored: a full cache)."""
    firsts = [j for j in range(len(keys)) if j not in again]
    out = [missing] * len(keys)
    for j, value in zip(firsts, fill_batch(claims, [keys[j] for j in firsts], look_many, missing,
                                           compute_many, publish_many)):
        out[j] = value
    rest = list(again)
    for j, value in zip(rest, look_many([keys[j] for j in rest])):
        out[j] = copy.deepcopy(out[again[j]]) if value is missing else value
    return out


def _detach(keys: Sequence, positions: list[int], out: list, look_many: Callable, missing: Any) -> None:
    """Before the source is called again for one batch (its keys were claimed in turns): the
    values its earlier calls returned for ``positions``, as the cache stored them, else a copy of
    their own (``codec.own_copy``: not stored, a full cache; left as they are if they cannot be
    copied). torch calls ``__getitems__`` once a batch and collates before the next call, so a
    source may hand out views of one buffer that its next call fills again (issue 31)."""
    for j, value in zip(positions, look_many([keys[j] for j in positions])):
        if value is not missing:
            out[j] = value
            continue
        try:
            out[j] = codec.own_copy(out[j])
        except Exception:  # noqa: BLE001 - an object that cannot be copied is served as it is
            pass


def _found(claims: Claims, keys: Sequence, positions: list[int], out: list, look_many: Callable,
           missing: Any) -> list[int]:
    """Look ``positions`` up; the values found go to ``out`` (counted as claim waits: another's
    value, not computed); the positions still missing are returned."""
    if not positions:
        return positions
    values = look_many([keys[j] for j in positions])
    still = []
    for j, value in zip(positions, values):
        if value is missing:
            still.append(j)
        else:
            out[j] = value
    if len(still) < len(positions):
        claims.count(CLAIM_WAITS, len(positions) - len(still))
    return still


def _compute(claims: Claims | None, keys: Sequence, positions: list[int], out: list,
             compute_many: Callable, publish_many: Callable) -> None:
    """Compute the keys at ``positions`` in one call, publish what was computed (not what was
    ``Served``), and count it."""
    if not positions:
        return
    batch = [keys[j] for j in positions]
    values = compute_many(batch)
    if type(values) is not list:
        values = list(values)
    if len(values) != len(batch):  # else positions left unfilled would hand ``missing`` to the caller
        raise InvalidArgument(
            f"a batch's compute (get_batch's fn_many) returned {len(values)} values for {len(batch)} "
            f"keys; return a list of one value per key, in the keys' order")
    pairs = []
    for j, key, value in zip(positions, batch, values):
        if type(value) is Served:
            out[j] = value.value
        else:
            out[j] = value
            pairs.append((key, value))
    if claims is not None and pairs:
        claims.count(COMPUTED, len(pairs))
    if pairs:
        publish_many(pairs)


def _release(claims: Claims, bucket: int) -> None:
    try:
        claims.release(bucket)
    except OSError:  # the descriptor closed under us (close() in another thread): dropped anyway
        claims.forget(bucket)


def _release_all(claims: Claims, buckets: list[int]) -> None:
    """Release ``buckets`` (a few unlocks: ``Claims.release_many``); an interrupt (Ctrl-C)
    half-way releases them again, then goes on (a release is idempotent; so is each caller's
    retry of this call, made for an interrupt that lands as it begins)."""
    try:
        _release_many(claims, buckets)
    except BaseException:
        _release_many(claims, buckets)
        raise


def _release_many(claims: Claims, buckets: list[int]) -> None:
    try:
        claims.release_many(buckets)
    except OSError:  # the descriptor closed under us (close() in another thread): dropped anyway
        for bucket in buckets:
            claims.forget(bucket)


def _owner_words(fd: int, slot: Callable[[], int]) -> tuple[np.ndarray | None, int]:
    """The claims file's owner words (``_OWNERS_OFF``: a u16 a bucket, the file grown to hold
    them), mapped, and this process's word (its liveness slot + 1); ``(None, 0)`` where they
    cannot be had: waits then never learn who is stuck (each costs its own timeout, as before)."""
    try:
        me = slot() + 1
        if not 0 < me <= MAX_SLOTS:
            return None, 0
        grow(fd, _OWNERS_OFF, 2 * BUCKETS)  # backed: a store into a hole of a full mount is a SIGBUS
        mm = mmap.mmap(fd, 2 * BUCKETS, offset=_OWNERS_OFF)
    except Exception:  # noqa: BLE001 - no slot, no room: claims work on without it
        return None, 0
    return np.frombuffer(mm, np.uint16), me


def _rows(path: Path, slot: Callable[[], int] | None = None) -> SlotRows:
    """The counter rows at the start of the claims file (NOTE [claims]); the lock bytes follow."""
    return SlotRows(path, ROW_WORDS, slot=slot, what=f"cache claims {path}")


def read_counts(path: Path) -> dict:
    """The claim counters summed over every process's row (zeros when the file is missing)."""
    total = (_rows(path).sum() or ([0] * ROW_WORDS, b""))[0]
    return {name: total[i] for i, name in enumerate(COUNTER_NAMES)}
