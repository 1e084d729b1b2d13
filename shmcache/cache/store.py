"""The cache store: one named cache of a session, shared by every process that opens it.

Objects of one cache (names from Namespace.segment_name; ``g`` is the generation, ``v`` the table
version)::

    +root            epoch word (generation << 32 | table version), capacity, incarnation, sizing
                     (generation.RootLayout)
    +<i>+g<g>+meta   counters, allocator classes, layout table, totals, the intent record
                     (generation.MetaLayout, generation.Generation)
    +<i>+g<g>+t<v>   the hash table (index.py)
    +<i>+g<g>+c<k>   the data segment of size class k (allocator.py)

``i`` is the root's incarnation: a random word drawn when the root is made. A process that still
maps a destroyed cache's root (``destroy --force`` under it) keeps its own names, so it can never
attach, grow or unlink the segments of the cache made again under the same name.

NOTE [publish order]
    Readers never lock. Writers hold the cache's lock file (NOTE [lock files]) while they
    allocate, copy and publish, in this order:

      1. write the *intent* (phase 1: what is about to be allocated, and the class's old bump);
      2. allocate the chunk (move the class's bump) and copy the record into it;
      3. write the entry's key and location words, then its state word READY in one aligned
         8-byte store - from here readers see a complete record;
      4. phase 2: the new totals (items, bytes) are assigned, not added, so redoing them is harmless;
      5. clear the intent.

    A chunk (``put_records``, so an import and a tier hit: cache/chunk.py) publishes up to
    generation.CHUNK_RECORDS records under the one hold of the lock, with its own intent record
    (generation.ChunkIntent, in the meta segment beside the intent above; a writer uses one at a
    time). Point by point, as for one record:

      1. phase 1; per record: note it in the chunk intent (table position, size class, the
         entry's state word; for its class's first record the class's bump before the chunk),
         commit chunks if needed, copy it into the next chunk of its class - counted by the
         writer: the class's bump in shared memory does not move yet - and write the entry's
         key and location words (w1, w2; w0 stays EMPTY, so readers ignore them);
      2. a fence (A), then phase 2 with the totals after the chunk;
      3. each class's bump moves past the chunk's records; a fence (B);
      4. every entry's state word READY, the totals assigned, the chunk intent cleared.

    The repair: in phase 1 nothing is reachable and no bump moved, so it forgets the staged w1
    and w2 and clears the intent (every chunk free again; commit steps stay committed for the
    next writer); in phase 2 every record is whole and fenced, so it finishes steps 3-4 (all
    assignments: bumps, READY words - the same word where one is READY already - totals). A
    writer that raises in the middle of a chunk does what the repair would, before it raises.
    The chunk's impossible intents (CorruptSegment, gc drops the generation): phase 1 with an
    entry filled or a bump moved; phase 2 with a bump neither where it was nor past the chunk's
    records, an entry READY with another word, a staged location outside the chunk's chunks,
    totals neither the current ones nor the chunk's records more; both intents in use.

    "One store" is meant literally: every word a reader reads without the lock (the root's epoch
    word, the meta segment's counts and totals, a class's bump and committed count, an entry's
    words, the counters) is written through ``Segment.words`` (base/shm.py word_view), one aligned
    8-byte store. Never with struct.pack_into, which zeroes its destination before it stores: a
    reader in another process then sees a transient 0 (it did: false CorruptSegment in stress).

    A writer can die anywhere (SIGKILL); the kernel then releases the lock, and whoever takes it
    next - a writer, or ``shmcache gc`` - finds the intent and repairs: if the entry never became
    READY, it restores the class's bump (the chunk is free again: nothing leaked, nothing visible);
    if it did, it re-assigns the totals. Readers never saw a half-written record, because a record
    becomes reachable only by step 3, and memory that was reachable is never reused within a
    generation: ``clear()`` starts a new generation in new segments, and table growth builds a new
    table. Processes still holding old mappings keep reading consistent (old) data until their next
    operation sees the new epoch word. The one entry that is ever rewritten in place is a spilled
    one whose record turned out corrupt: readers verify every spilled record they read (key,
    lengths, checksum), so any mix of old and new location words is a right value or a miss.

    Memory ordering (ordering.py). All of the above says "after" of stores that other processes
    load without a lock; on x86-64 (TSO) the order of a writer's stores is the order every reader
    sees, and nothing more is done. On a weakly ordered CPU (aarch64) the writer makes that order
    with ``ordering.fence()`` - membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED): every registered
    process passes a full barrier before it returns - and readers pay nothing. Point by point:

      * an entry: the record's bytes, its class record (chunk size, bump) and layout record, and
        the entry's w1 and w2 are stored, then a fence, then w0 = READY (index.TableView.publish;
        every put, spilled or not: one fence per record). A reader loads w0 first and the rest
        after, so if it sees READY it sees all of them.
      * a chunk (put_records, an import): two fences per chunk of up to CHUNK_RECORDS records,
        whatever their commit steps. Fence A orders every record's bytes, every w1 and w2, the
        committed counts of the chunk's commit steps (Admission.commit(fence=False)), class and layout
        records before the bumps; fence B orders the bumps before the READY words. So a reader
        that sees READY sees the bump that hands its chunk out, the bytes and w1, w2; one that
        sees a moved bump sees the committed count it needs. A repair that finishes a dead
        writer's chunk makes its own fence B; the dead writer's fence A came before its phase 2.
      * a commit step: the class's committed count (and the meta's total), a fence, and only then a
        bump that relies on it (admission.Admission.commit); ClassTable.get loads the bump before
        the committed count.
      * a generation or a table version: the meta, the table (every entry of a grown table: no
        fence per entry there, nobody reads it yet) and the root's capacity, incarnation and sizing
        words, a fence, then the epoch word (_create_generation, _grow_table). A raised automatic
        cap: CAPACITY, a fence, SIZING.
      * retire, then reuse: clear() and gc's drop publish the new epoch word, fence, and only then
        clear the spill files (whose offsets the new generation reuses): a reader whose read of a
        reused file fails and then loads the epoch word sees the new one (a plain miss). A destroy
        (here and registry.retire_root) fences after the tombstone, before its files and name go.
        Memory inside a generation is never reused (above), and the repair gives back only a
        chunk that no READY entry ever named (a chunk's staged w2 in an EMPTY entry names nothing
        to a reader: it stops at EMPTY), so nothing else is retired.
      * not fenced: the intent records, the totals and the counters. The intent is read under the
        lock only (the lock file's flock orders it, as it orders one writer after the other); the
        totals and counters are statistics, each word one aligned store.
    The argument for membarrier (ordering.py's docstring): a reader's barrier falls before its load
    of the published word (then it sees what the fence covered) or after it (then that load was
    done before the fence returned, so before the word was published: it saw the old one). Every
    process registers when it first maps a segment; a forked child keeps its parent's registration
    (the kernel copies it with the mm; the tests check) and registers again anyway.

    Destroying. Whoever removes a cache (``CacheStore.destroy``, ``SessionRegistry.destroy``,
    ``gc`` of a dead session's segments) first writes the tombstone DESTROYED into its root's epoch
    word, then unlinks the root, then the rest (registry.retire_root). Unlinked segments stay
    mapped in the processes that use them, so without it an old handle would go on returning the
    destroyed values; with it, the word every lookup already compares changes, and the handle maps
    an empty private generation instead: its reads miss, and ``locked()`` refuses its writes with
    CacheNotFound. A reader that compared the word just before the tombstone returns a value that
    was current when it looked (as with ``clear()``). An opener that finds a tombstoned root under
    the lock finishes the dead destroy (unlinks it) and makes a new incarnation.

    Opening. The root is made READY-last (base/shm.py), then its capacity and incarnation words,
    then the first generation, and its epoch word is published last. So an opener attaches the
    root without the lock when its epoch word names a generation whose meta and table exist: a
    writer stopped while holding the lock (SIGSTOP, a debugger) never blocks readers or workers
    that re-attach. Only a root that is missing, half-made, tombstoned or without its generation
    sends the opener to the lock, to create or repair it. A put that cannot get the lock
    within its timeout serves its value uncached (counted as rejected; CacheStore._write_locked).

    Damage (a stray write into /dev/shm, a hostile process of the same user) must never turn into
    a wrong value or a moved bump. Readers check each entry before following it: a class in use,
    a chunk below the class's bump, a length within the chunk, a layout id the meta segment
    holds (_record, _layout; on the batch path with numpy over the batch). Handed out, not merely
    committed: a committed chunk above the bump holds zeros. Sound in every legitimate state: an
    entry is READY only after its chunk's bump step, and a bump goes back (repair) only for a
    chunk no entry ever pointed at (a chunk's bumps move only once all its records are whole,
    and then forward). The repairer checks the intent is one a writer can leave: phase 1 or 2,
    a position inside the table, a class in use (or SPILL_CLASS), an old bump equal to the
    class's bump or one less, phase 2 only with its entry READY, totals at most one item on (a
    chunk's: above, "A chunk"; repair.py, chunk.py). Anything else raises CorruptSegment and touches
    nothing; ``shmcache gc`` (collect_garbage, repair.py) finds the same damage and replaces the generation by an
    empty one, as clear() does.

"""

from __future__ import annotations

import contextlib
import logging
import pickle
import secrets
import shutil
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..base import ordering
from ..base.faults import ARMED as _CRASH_TESTS
from ..base.faults import crash_point
from ..base.namespace import Namespace, namespace, validate_name
from ..base.shm import PAGE, Segment
from ..errors import (
    CacheMismatch,
    CacheNotFound,
    CorruptSegment,
    InvalidArgument,
    ItemTooLarge,
    LockTimeout,
    SessionNotFound,
    SharedMemoryFull,
    ShmcacheError,
)
from . import chunk as chunks
from . import claims, codec, gather, portable, process_slot, repair, stats
from .admission import MIN_CAPACITY, Admission, NoRoom, initial_capacity, log_no_memory
from .allocator import DATA_OFF, MAX_CLASSES, ClassTable, size_class
from .generation import (
    AUTO_NONE,
    CORRUPT,
    DEAD_GEN,
    DESTROYED,
    HITS,
    KIND_DATA,
    KIND_META,
    KIND_ROOT,
    KIND_TABLE,
    MISSES,
    REJECTED,
    SPILL_CLASS,
    Generation,
    Intent,
    M,
    RootLayout,
    close_generation,
    destroyed_generation,
    epoch_of,
    split_epoch,
)
from .index import (
    ENTRY_BYTES,
    INLINE24,
    INT_KEY,
    LOCATION_MASK,
    MAX_LOAD,
    MAX_RECORD,
    MIN_TABLE,
    READY,
    SPILLED,
    TABLE_OFF,
    TableView,
    entry_class,
    entry_layout,
    entry_length,
    key_bytes,
    location_word,
    state_word,
    tier_key,
)
from .indexed_tier import IndexedTier, RecordLocation
from .registry import SEP, SessionRegistry, unlink_segments, write_json
from .stats import STAT_KEYS

__all__ = ["CacheStore", "UncachedStore", "STAT_KEYS"]

log = logging.getLogger("shmcache")

_Q = struct.Struct("Q")
_QQ = struct.Struct("QQ")
R = RootLayout
_KEY_LEN = struct.Struct("<I")  # the key length in a record header (codec.record_header, inlined)
_STUCK_COOLDOWN_S = 30.0  # puts stop waiting for a lock that a live process keeps (_write_locked)
_SAY_WAIT_S = 1.0  # a put waiting this long for the lock (a write under it takes ms) says why (issue 30)
_MIN_RECORD = codec.RECORD_HEADER.size
# what decoding damaged bytes raises (marshal, struct, numpy, pickle, utf-8): CorruptSegment instead
_UNDECODABLE = (ValueError, TypeError, OverflowError, IndexError, KeyError, EOFError, struct.error,
                RecursionError, pickle.UnpicklingError)


class Found(NamedTuple):
    """What ``CacheStore._find`` found for a key (index.py has the entry's words)."""

    w0: int  # the state word: 0 when the key is absent
    w2: int  # the location word
    pos: int  # the entry's position (where the key would go when absent)
    kb: bytes  # the key's bytes (empty for an int key; index.key_bytes)
    w1: int  # the key word


class CacheStore:
    """One cache (``session``/``name``); see the module docstring for what lives where."""

    uncached = False  # see UncachedStore

    def __init__(self, session: str, name: str, *, capacity_bytes: int = 0,
                 fingerprint: str | None = None, table_hint: int = 0,
                 ns: Namespace | str | None = None, lock_timeout_s: float = 60.0,
                 create: bool = True, claim_timeout_s: float | None = None):
        ordering.register()  # a weakly ordered machine without membarrier refuses here (ordering.py)
        self.session = validate_name(session, "session")
        self.name = validate_name(name, "cache")
        self.ns = ns if isinstance(ns, Namespace) else namespace(ns)
        self.registry = SessionRegistry(self.ns)
        if create:
            self.registry.ensure(self.session)
        else:
            self.registry.get(self.session)  # SessionNotFound, naming the sessions there are
        self.meta_path = self.registry.cache_meta_path(self.session, self.name)
        self.lock = self.registry.cache_lock(self.session, self.name, lock_timeout_s)
        # in the session's memory directory when it has one (checked: a mount gone is refused)
        where = self.registry.check_memory_dir(self.session) or ""
        self._base = where + self.ns.segment_name(self.session, self.name)
        # who computes a key many processes miss at once (NOTE [claims]); opened on first use
        self.claims = claims.Claims(self.registry.cache_claims_path(self.session, self.name),
                                    lambda: process_slot.slot(self.registry, self.session), claim_timeout_s)
        self._gen: Generation | None = None
        self._epoch = -1
        self._counters = [0, 0, 0, 0]  # hits, misses, rejected, corrupt: this process's totals
        self._counter_off = -1
        self._proc_gen = -1
        self._map_lock = threading.Lock()
        self._lock_gen = process_slot.fork_count()
        self._buffers = gather.BatchBuffers()
        self.spill: IndexedTier | None = None  # where records go when memory is full (spill_to)
        self._root = None
        self._incarnation = 0  # the root's (set when it is opened; see the module docstring)
        self._lock_stuck_until = 0.0  # puts try the lock without waiting until then (_write_locked)
        self._lock_stuck_logged = False
        self._use = None  # held while this handle is open to use the cache (NOTE [cache use])
        if create:
            try:
                self._use = self.registry.hold_cache(self.session, self.name)
            except FileNotFoundError:  # the session's directory went away under us
                raise SessionNotFound(f"session {self.session!r} was destroyed while cache {self.name!r} "
                                      f"was being opened in it; open it again") from None
        try:
            self._open_cache(capacity_bytes, fingerprint, table_hint, create)
        except BaseException:
            self._release_use()
            raise

    def _open_cache(self, capacity_bytes: int, fingerprint: str | None, table_hint: int, create: bool) -> None:
        # a whole cache opens without the lock (NOTE [publish order]: Opening): a writer stopped
        # while it holds the lock must not block readers and re-attaching workers
        self._root = self._attach_whole_root(fingerprint)
        if self._root is None:  # missing, half-made or tombstoned: create or repair, under the lock
            try:
                self.lock.acquire()
            except FileNotFoundError:  # the session's directory went away under us
                raise SessionNotFound(f"session {self.session!r} was destroyed while cache {self.name!r} "
                                      f"was being opened in it; open it again") from None
            try:
                self._root = self._open_root(capacity_bytes, fingerprint, table_hint, create)
            finally:
                self.lock.release()
        self._lock_reopened = self.lock.reopened
        # the cap, and whether there is room (NOTE [memory limits]): the store asks it, under the lock
        self.admission = Admission(self._root, self.registry, self.session, self.name)
        if capacity_bytes and capacity_bytes != self.capacity_bytes:
            log.warning("cache %s/%s exists with a cap of %.0f MiB; size=%.0f MiB applies only to a "
                        "new cache (clear() keeps the cap: destroy the session to change it)",
                        self.session, self.name, self.capacity_bytes / 2**20, capacity_bytes / 2**20)
        self._attached = -1  # the process generation in which this store counts as a user
        if create:
            try:  # attached from now on: `shmcache ls` counts us, `destroy` waits for us
                process_slot.attach(self.registry, self.session)
                self._attached = process_slot.fork_count()
            except LockTimeout:
                pass  # served without a slot; _count says so when it first counts
            except FileNotFoundError:  # its slots directory is gone: destroyed just now
                raise self._destroyed() from None
        self._refresh()

    @property
    def capacity_bytes(self) -> int:
        """The cache's cap in bytes (the root's CAPACITY word as this handle last read it)."""
        return self.admission.capacity_bytes

    # --- opening ------------------------------------------------------------------------------

    def _seg_name(self, *parts: str) -> str:
        """The name of the root (``"root"``), or of a segment of this incarnation of the cache."""
        if parts == ("root",):
            return self._base + SEP + "root"
        return self._base + SEP + SEP.join((f"{self._incarnation:08x}", *parts))

    def _adopt(self, root: Segment) -> Segment:
        self._incarnation = _Q.unpack_from(root.buf, R.INCARNATION)[0]
        return root

    @contextlib.contextmanager
    def locked(self):
        """Hold the cache's lock, and make sure it is still the lock of the cache this handle
        opened: a lock file found replaced means the session was destroyed (and maybe made again)."""
        self._acquire(None)
        try:
            yield
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def _write_locked(self):
        """``locked()`` for a put: yields False, holding nothing, when the lock cannot be had - a
        live process keeps it (stopped, in a debugger), and the caller serves its value uncached.
        After one full wait, puts only try without waiting until a try has not failed for
        _STUCK_COOLDOWN_S: a stuck lock costs one timeout, not one per miss."""
        try:
            if time.monotonic() < self._lock_stuck_until:
                self._acquire(0.0)
            else:
                self._acquire_saying_why()
        except LockTimeout as exc:
            self._lock_stuck_until = time.monotonic() + _STUCK_COOLDOWN_S
            if not self._lock_stuck_logged:
                self._lock_stuck_logged = True
                log.warning("cache %s/%s: %s; new values are served uncached (counted as rejected), "
                            "and writes stop waiting for it until it is free", self.session, self.name, exc)
            yield False
            return
        if self._lock_stuck_logged:
            self._lock_stuck_logged, self._lock_stuck_until = False, 0.0
            log.info("cache %s/%s: its lock is free again; new values are cached", self.session, self.name)
        try:
            yield True
        finally:
            self.lock.release()

    def _acquire_saying_why(self) -> None:
        """Wait for the lock up to its timeout; a wait longer than any write under it (_SAY_WAIT_S)
        is said, once per wait, while it lasts: who holds it, how long it may go on, the fix."""
        full = self.lock.timeout_s
        try:
            self._acquire(min(_SAY_WAIT_S, full))
            return
        except LockTimeout:
            if full <= _SAY_WAIT_S:
                raise
        log.warning("cache %s/%s: a put waits for the cache's lock (%s), which a live process has held for "
                    "over %.0f s, where a write under it takes milliseconds (a writer stopped, or in a "
                    "debugger? `fuser %s` names it); it waits up to lock_timeout_s=%g s in all, then "
                    "serves new values uncached", self.session, self.name, self.lock.path, _SAY_WAIT_S,
                    self.lock.path, full)
        self._acquire(full - _SAY_WAIT_S)

    def _acquire(self, timeout_s: float | None) -> None:
        """Take the lock for ``locked()``: CacheNotFound if this handle's cache was destroyed."""
        try:
            self.lock.acquire(timeout_s)
        except FileNotFoundError:  # the session's directory is gone: only a destroy removes it
            raise self._destroyed() from None
        try:
            if self.lock.reopened != self._lock_reopened:
                stale = self._destroyed_under_us()
                if stale is not None:
                    raise stale
                self._lock_reopened = self.lock.reopened
            if self._root is not None and _Q.unpack_from(self._root.buf, R.EPOCH)[0] == DESTROYED:
                raise self._destroyed()  # its root was tombstoned: this cache is gone
        except BaseException:
            self.lock.release()
            raise

    def _destroyed_under_us(self) -> CacheNotFound | None:
        """The error to raise if this cache's root is gone or is another incarnation's now."""
        try:
            live = Segment.attach(self._seg_name("root"), kind=KIND_ROOT)
            same = _Q.unpack_from(live.buf, R.INCARNATION)[0] == self._incarnation
            live.close()
        except (FileNotFoundError, CorruptSegment):
            same = False
        return None if same else self._destroyed()

    def _destroyed(self) -> CacheNotFound:
        return CacheNotFound(f"cache {self.session}/{self.name} was destroyed while this process used it "
                             f"(`shmcache destroy --force`, or `shmcache import --force` replacing it?); open it again "
                             f"(a new ShmDatasetCache) to use the cache made since")

    def _attach_whole_root(self, fingerprint: str | None) -> Segment | None:
        """The root, attached without the lock, if its epoch word names a generation whose meta
        and table exist (NOTE [publish order]: Opening); None when only the lock can tell."""
        try:
            root = self._adopt(Segment.attach(self._seg_name("root"), kind=KIND_ROOT))
        except (FileNotFoundError, CorruptSegment):
            return None
        if _Q.unpack_from(root.buf, R.EPOCH)[0] == DESTROYED or not self._generation_exists(root):
            root.close()
            return None
        self._check_fingerprint(fingerprint)
        return root

    def _open_root(self, capacity_bytes: int, fingerprint: str | None, table_hint: int,
                   create: bool) -> Segment:
        name = self._seg_name("root")
        try:
            root = self._adopt(Segment.attach(name, kind=KIND_ROOT))
        except FileNotFoundError:
            root = None
        except CorruptSegment:  # its creator died mid-way (we hold the lock, so it is not busy)
            self.ns.unlink_segment(name)
            root = None
        if root is not None and _Q.unpack_from(root.buf, R.EPOCH)[0] == DESTROYED:
            root.unlink()  # tombstoned by a destroy that died before it unlinked it: finish that
            root = None
        if root is not None and _Q.unpack_from(root.buf, R.EPOCH)[0] == 0:
            # its creator died before publishing the first generation, maybe before writing the
            # cap (a cache of 0 bytes for good): nobody ever read it - make it afresh, below
            log.info("cache %s/%s: its creator died while making it; what it made is removed",
                     self.session, self.name)
            root.unlink()
            root = None
            unlink_segments(self.ns, self._base + SEP)
            if not create:  # the cache was never made: forget it, as gc does (no error row in stat)
                self.meta_path.unlink(missing_ok=True)
        if root is not None and not self._generation_exists(root):
            # its creator died after making it, before the first generation; or a destroy died
            # after unlinking some segments: what is left is debris - start the cache afresh
            log.warning("cache %s/%s was left half-made or half-destroyed by a process that died; "
                        "it starts empty", self.session, self.name)
            capacity = _Q.unpack_from(root.buf, R.CAPACITY)[0]
            unlink_segments(self.ns, self._base + SEP, keep=(name,))
            # a generation number this root never named: a handle still mapping the lost one must
            # see the epoch word change, never new segments under the names it maps lazily
            gen = split_epoch(_Q.unpack_from(root.buf, R.EPOCH)[0])[0] + 1
            self._create_generation(root, gen, capacity, _table_capacity(table_hint))
        if root is not None:
            self._check_fingerprint(fingerprint)
            return root
        if not create:
            raise CacheNotFound(
                f"no cache {self.name!r} in session {self.session!r} (caches: "
                f"{', '.join(self.registry.cache_names(self.session)) or 'none'})"
            )
        unlink_segments(self.ns, self._base + SEP)  # debris of an earlier incarnation of this cache
        # size=0: the session's automatic cap (NOTE [memory limits])
        sizing, capacity = initial_capacity(self.registry, self.session, capacity_bytes)
        if capacity < MIN_CAPACITY:
            raise InvalidArgument(
                f"the cache {self.session}/{self.name} would get {capacity / 2**20:.2f} MiB, too "
                f"little to hold anything; give it size= (MiB) of at least 1, or size=0 for the "
                f"automatic cap (`shmcache info` shows what limits memory here)"
            )
        # the metadata first: a creator that dies later leaves a cache that stat and gc can see
        write_json(self.meta_path, {
            "session": self.session, "name": self.name, "fingerprint": fingerprint,
            "created": time.time(), "capacity_bytes": capacity,
        })
        try:
            root = Segment.create(name, PAGE, kind=KIND_ROOT, commit=PAGE)
            root.words[R.CAPACITY >> 3] = capacity
            root.words[R.INCARNATION >> 3] = secrets.randbits(32)
            root.words[R.SIZING >> 3] = sizing
            self._adopt(root)
            self._create_generation(root, 1, capacity, _table_capacity(table_hint))
        except BaseException:
            # no room, or interrupted: take back what this attempt made, json last (we hold the
            # lock, and the epoch word was never published, so nobody attached any of it)
            unlink_segments(self.ns, self._base + SEP)
            self.meta_path.unlink(missing_ok=True)
            raise
        if sizing == AUTO_NONE:  # said once, here: a cache that could not be made says it above us
            log_no_memory(self.session, self.name, self.registry.memory_root(self.session))
        return root

    def _generation_exists(self, root: Segment) -> bool:
        """The meta and table segments the root's epoch word names are there. Under the lock nobody
        is making or removing them; without it, a clear() may replace them right after (_refresh
        copes), or make this False for a moment (the opener then asks under the lock)."""
        epoch = _Q.unpack_from(root.buf, R.EPOCH)[0]
        gen, version = split_epoch(epoch)
        return gen > 0 and all(self.ns.shm_path(self._seg_name(f"g{gen}", part)).exists()
                               for part in ("meta", f"t{version}"))

    def bind_fingerprint(self, fingerprint: str) -> None:
        """Record which dataset this cache holds (first binding), or raise if it holds another."""
        if self.read_meta().get("fingerprint") == fingerprint:
            return  # recorded already: nothing to write, no lock to wait for
        with self.locked():
            self._check_fingerprint(fingerprint)
            meta = self.read_meta()
            if meta.get("fingerprint") is None:
                meta["fingerprint"] = fingerprint
                write_json(self.meta_path, meta)

    def read_meta(self) -> dict:
        return self.registry.read_cache_meta(self.session, self.name)

    def record_label(self, label: str) -> None:
        """What a user recognises the cache by (wrap(label=), else the dataset's repr), kept in its
        metadata for `shmcache stat`; rewritten under the lock only when it changes."""
        if self.read_meta().get("label") == label:
            return
        with self.locked():
            meta = self.read_meta()
            if meta and meta.get("label") != label:
                meta["label"] = label
                write_json(self.meta_path, meta)

    def _check_fingerprint(self, fingerprint: str | None) -> None:
        if fingerprint is None:
            return
        known = self.read_meta().get("fingerprint")
        if known and known != fingerprint:
            raise CacheMismatch(
                f"cache {self.session}/{self.name} holds another dataset (fingerprint {known}, "
                f"this one is {fingerprint}); use another name=, let shmcache name it "
                f"(name=None), or drop the old cache with `shmcache destroy {self.session} --cache "
                f"{self.name}` (clear() empties a cache but keeps which dataset it holds: a "
                f"process still reading the old one must not fill it with the new)"
            )

    def _create_generation(self, root: Segment, gen: int, capacity: int, cap: int) -> None:
        """Make the meta and table (``cap`` entries) of ``gen`` and publish it (caller holds the
        lock). Leftovers of an attempt whose process died are removed first."""
        unlink_segments(self.ns, self._seg_name(f"g{gen}", ""))
        meta = Segment.create(self._seg_name(f"g{gen}", "meta"), M.SIZE, kind=KIND_META, commit=M.SIZE)
        table = Segment.create(self._seg_name(f"g{gen}", "t1"), TableView.bytes_for(cap),
                               kind=KIND_TABLE, commit=TableView.bytes_for(cap))
        TableView.init(table.buf, cap)
        meta.words[M.CAPACITY >> 3] = capacity
        meta.words[M.COMMITTED >> 3] = M.SIZE + TableView.bytes_for(cap)
        meta.close()
        table.close()
        ordering.fence()  # the root's words, the meta and the table before the epoch word names them
        root.words[R.EPOCH >> 3] = epoch_of(gen, 1)  # the epoch word: published last, one store

    # --- generations ----------------------------------------------------------------------------

    def _refresh(self) -> Generation:
        """Map the generation and table version the root announces now (if not mapped already)."""
        if self._root is None:
            raise InvalidArgument(f"cache {self.session}/{self.name} was closed in this process; "
                                  f"open it again")
        for _ in range(100):
            epoch = _Q.unpack_from(self._root.buf, R.EPOCH)[0]
            if epoch == self._epoch and self._gen is not None:
                return self._gen
            if self._lock_gen != process_slot.fork_count():  # forked: a thread of the parent may
                self._map_lock = threading.Lock()        # have held it at the fork
                self._lock_gen = process_slot.fork_count()
            try:
                with self._map_lock:  # a prefetch thread and the main thread may both get here
                    if epoch != self._epoch or self._gen is None:
                        self._map_epoch(epoch)
                return self._gen
            except FileNotFoundError:
                time.sleep(0.001)  # a clear() or a table growth is replacing it right now
        stale = self._destroyed_under_us()
        if stale is not None:
            raise stale
        raise CorruptSegment(f"cache {self.session}/{self.name}: the root names segments that do not "
                             f"exist; run `shmcache gc`")

    def _map_epoch(self, epoch: int) -> None:
        old = self._gen
        if epoch == DESTROYED:  # tombstoned (NOTE [publish order]): every read is a miss from now on
            self._gen = destroyed_generation()
            self._proc_gen = -1  # its counters went with it (_count)
            self._epoch = epoch
            if old is not None:
                close_generation(old)
            return
        gen, version = split_epoch(epoch)
        if old is not None and old.gen == gen:
            table = Segment.attach(self._seg_name(f"g{gen}", f"t{version}"), kind=KIND_TABLE)
            # a new Generation, not an update in place: a thread inside a lookup keeps the one it has
            self._gen = Generation(gen, version, old.meta, table, TableView(table.buf, table.name), old.classes,
                             old.data, old.layouts, old.columns)
        else:
            meta = Segment.attach(self._seg_name(f"g{gen}", "meta"), kind=KIND_META)
            try:
                table = Segment.attach(self._seg_name(f"g{gen}", f"t{version}"), kind=KIND_TABLE)
            except BaseException:
                meta.close()
                raise
            self._gen = Generation(gen, version, meta, table, TableView(table.buf, table.name),
                             ClassTable(meta.buf, M.CLASSES), {}, {}, {})
            if old is not None:
                close_generation(old)
                if self.spill is not None:  # clear() elsewhere replaced the spill files too
                    self.spill.reopen()
            self._proc_gen = -1  # counters live in the new meta: re-read our slot's totals
        self._epoch = epoch

    def _data(self, g: Generation, cls: int) -> tuple:
        """``(segment, read-only view, chunk size, chunks handed out when last checked)`` of size
        class ``cls``, mapped on first use (its class record checked by :meth:`_committed`)."""
        entry = g.data.get(cls)
        if entry is None:
            if not (0 < cls < MAX_CLASSES and g.classes.chunk_size(cls)):
                raise self._corrupt(f"an entry of {g.table.name} names size class {cls}, which holds "
                                    f"no chunks in {g.meta.name}")
            seg = Segment.attach(self._seg_name(f"g{g.gen}", f"c{cls}"), kind=KIND_DATA)
            entry = self._committed(g, cls, (seg, memoryview(seg.buf).toreadonly(), 0, 0))
        return entry

    def _committed(self, g: Generation, cls: int, entry: tuple) -> tuple:
        """``entry`` of :meth:`_data` with the class record read again from meta and checked: a
        chunk size the allocator gives that class, ``bump <= committed``, and committed chunks
        inside the segment. Called when an entry points past what this process saw handed out.
        The bump, not the committed count: a committed chunk above the bump was never written, and
        an entry pointing there would read as a record of zeros."""
        seg, view = entry[:2]
        chunk, bump, committed = g.classes.get(cls)
        try:
            ok = size_class(chunk) == (cls, chunk)
        except OverflowError:
            ok = False
        if not ok or bump > committed or DATA_OFF + committed * chunk > seg.size:
            raise self._corrupt(f"the record of size class {cls} in {g.meta.name} is damaged (chunks of "
                                f"{chunk} bytes, {bump} handed out of {committed} committed, in "
                                f"{seg.name} of {seg.size} bytes)")
        entry = g.data[cls] = (seg, view, chunk, bump)
        return entry

    def _record(self, g: Generation, w0: int, w2: int, w1: int, kb: bytes) -> memoryview:
        """The bytes of the in-memory record that entry (w0, w2) points at. The entry is checked
        first with a few int compares: a damaged one (issue 8) names a class, a chunk or a length
        the allocator never handed out, where reading would return zeros or another record."""
        # index.entry_class, entry_chunk and entry_length, inlined (every str key's read comes here;
        # tests/unit/test_index.py checks these copies against index's layout)
        cls = w2 >> 48
        entry = g.data.get(cls) or self._data(g, cls)
        chunk, n = w2 & LOCATION_MASK, w0 >> 32
        if chunk >= entry[3] or not 16 <= n <= entry[2]:  # 16: _MIN_RECORD, as a constant
            entry = self._committed(g, cls, entry)  # more may have been handed out since
            if chunk >= entry[3] or not _MIN_RECORD <= n <= entry[2]:
                raise self._corrupt(f"the entry of key {_key_repr(w1, kb)} in {g.table.name} points at "
                                    f"{n} bytes in chunk {chunk} of size class {cls}, which has handed "
                                    f"out {entry[3]} chunks of {entry[2]} bytes")
        start = DATA_OFF + chunk * entry[2]
        return entry[1][start:start + n]

    def _layout(self, g: Generation, lid: int) -> tuple[bytes, Callable, int]:
        """``(layout bytes, decoder, the end of its last leaf)`` of layout ``lid``, checked on
        first use: an id the table never gave out or bytes that are not a layout are damage."""
        item = g.layouts.get(lid)
        if item is None:
            meta = g.meta.buf
            count = _Q.unpack_from(meta, M.N_LAYOUTS)[0]
            if lid >= min(count, M.MAX_LAYOUTS):
                raise self._corrupt(f"an entry of {g.table.name} names layout {lid}, but {g.meta.name} "
                                    f"holds {count} layouts (at most {M.MAX_LAYOUTS})")
            off = M.LAYOUTS + lid * M.LAYOUT_BYTES
            n = struct.unpack_from("I", meta, off)[0]
            raw = bytes(meta[off + 4:off + 4 + min(n, M.LAYOUT_BYTES - 4)])
            try:
                if n > M.LAYOUT_BYTES - 4:
                    raise ValueError(f"a length of {n} bytes in a slot of {M.LAYOUT_BYTES - 4}")
                leaves = codec.leaves(raw)[1]
                end = max((leaf.offset + leaf.nbytes for leaf in leaves), default=0)
                item = (raw, codec.decoder_for(raw), max(end, _MIN_RECORD),
                        codec.decoder_for(raw, private=True))
            except ShmcacheError:
                raise
            except _UNDECODABLE as exc:
                raise self._corrupt(f"layout {lid} in {g.meta.name} is damaged ({exc!r})") from None
            g.layouts[lid] = item
        return item

    def _corrupt(self, what: str, fix: str = "it will drop this cache's contents; they are "
                                             "recomputed on use") -> CorruptSegment:
        """The error for damaged shared memory; `shmcache gc` finds the same damage and drops the
        generation (or recounts counters: collect_garbage), so that is the fix the message gives."""
        return CorruptSegment(f"cache {self.session}/{self.name}: {what}; its shared memory is damaged. "
                              f"Run `shmcache gc` ({fix})")

    # --- counters (NOTE [lock files]: one slot per live process, so no atomics are needed) -----

    def _count(self, which: int, n: int = 1) -> None:
        g = self._gen
        if self._proc_gen != process_slot.fork_count():
            if g.gen == DEAD_GEN:  # a destroyed cache: nothing to count into (no slot is taken)
                self._counters, self._counter_off = [0, 0, 0, 0], -1
                self._proc_gen = process_slot.fork_count()
                return
            try:
                slot = process_slot.slot(self.registry, self.session)
            except LockTimeout as exc:  # every slot taken: serve, but count nowhere
                log.warning("cache %s/%s: this process's hits and misses are not counted: %s",
                            self.session, self.name, exc)
                self._counters, self._counter_off = [0, 0, 0, 0], -1
                self._proc_gen = process_slot.fork_count()
                return
            off = M.COUNTERS + M.COUNTER_ROW * slot
            key = f"{self.ns.root}{self._base}+g{g.gen}+{slot}"
            # a total of garbage (a damaged slot) restarts at 0: a stat, not worth failing reads over,
            # and one at the top of the word would overflow on the next count (struct.error)
            self._counters = process_slot.counters(key, lambda: [c if c < 1 << 62 else 0 for c in
                                                             struct.unpack_from("QQQQ", g.meta.buf, off)])
            self._counter_off = off
            self._proc_gen = process_slot.fork_count()
        self._counters[which] += n
        if self._counter_off >= 0:
            g.meta.words[(self._counter_off >> 3) + which] = self._counters[which]

    # --- reads ---------------------------------------------------------------------------------

    def _find(self, g: Generation, key: Any) -> Found:
        """The entry of ``key`` (``Found.w0`` == 0 when absent: ``pos`` is then where it would go)."""
        w1, kb = key_bytes(key)
        index = g.index
        pos, w0, w2 = index.find(w1, not kb)
        # a hash matched: compare the key bytes stored at the end of the record (a spilled record
        # is checked against the key when it is read)
        probes = 0
        while w0 and kb and not w0 & SPILLED:
            rec = self._record(g, w0, w2, w1, kb)
            # codec.record_header(rec).key_len and codec.record_key(rec), inlined: a call less per probe
            if _KEY_LEN.unpack_from(rec, 4)[0] == len(kb) and rec[len(rec) - len(kb):] == kb:
                break
            probes += 1
            if probes >= index.capacity:  # around the whole table: no EMPTY entry ends the probe
                raise index.corrupt()
            pos, w0, w2 = index.find_from((pos + 1) & index.mask, w1, False)
        return Found(w0, w2, pos, kb, w1)

    def _decode(self, g: Generation, w0: int, w2: int, copy: bool, w1: int = 0, kb: bytes = b"") -> Any:
        if w0 & SPILLED:
            buf = self._read_spilled(w0, w2, w1, kb, g.gen)
            if buf is None:
                return _CORRUPT
        else:
            view = self._record(g, w0, w2, w1, kb)
            buf = bytearray(view) if copy else view
        lid = entry_layout(w0)
        try:  # a damaged record must not decode to a raw exception (issue 8); free unless raised
            if lid == INLINE24:
                return codec.decode(buf, codec.inline_layout(buf))
            return self._layout(g, lid)[1](buf)  # a record too short for it raises (codec)
        except ShmcacheError:
            raise
        except _UNDECODABLE as exc:
            where = "a spill file" if w0 & SPILLED else self._seg_name(f"g{g.gen}", f"c{entry_class(w2)}")
            raise self._undecodable(f"the record of key {_key_repr(w1, kb)} in {where}", exc) from None

    def _undecodable(self, what: str, exc: Exception) -> CorruptSegment:
        """A record whose bytes do not decode: gc checks metadata, not every record, so the fix
        given is a clear."""
        return CorruptSegment(f"cache {self.session}/{self.name}: {what} cannot be decoded ({exc!r}); its "
                              f"bytes are damaged. Clear the cache (cache.clear(), or `shmcache destroy "
                              f"{self.session}`): its contents are recomputed on use")

    def lookup(self, key: Any, copy: bool = True, count: bool = True) -> Any:
        """The cached value of ``key``, or ``MISSING``."""
        # 64: R.EPOCH, inlined (a constant, not an attribute lookup, on the hot path; every copy of
        # the root's and the entry's layout inlined here is checked by tests/unit/test_index.py)
        g = self._gen if _Q.unpack_from(self._root.buf, 64)[0] == self._epoch else self._refresh()
        if type(key) is int and 0 <= key < g.index.capacity:
            # the hot path, inlined (a hit of a dataset index costs ~2x a plain row copy): the key
            # sits at its own position (index.py), in memory, with an interned layout whose
            # decoder and data segment this process already has; anything else goes the long way.
            # It is _find + _decode for that case, with the same checks of the entry (_record:
            # the chunk handed out, the length within the chunk and covering the layout); anything
            # unexpected - a check that fails, bytes that do not decode - takes the long way,
            # which names the damage (NOTE [publish order], Damage).
            buf = g.index.buf
            off = TABLE_OFF + ENTRY_BYTES * key
            w0 = _Q.unpack_from(buf, off)[0]  # first, on its own: see index.py
            if not w0:  # EMPTY at the key's own position: absent (index.find stops there too)
                if count:
                    self._count(MISSES)
                return MISSING
            if w0 & 7 == READY | INT_KEY:  # 7: READY | INT_KEY | SPILLED (and not SPILLED)
                k, w2 = _QQ.unpack_from(buf, off + 8)
                # index.entry_class, entry_layout, entry_chunk and entry_length, inlined
                data = g.data.get(w2 >> 48)
                layout = g.layouts.get((w0 >> 8) & INLINE24)
                chunk, n = w2 & LOCATION_MASK, w0 >> 32
                value = MISSING
                if k == key and data is not None and layout is not None and chunk < data[3] \
                        and layout[2] <= n <= data[2]:
                    start = DATA_OFF + chunk * data[2]
                    view = data[1][start:start + n]
                    try:
                        value = layout[3](bytearray(view)) if copy else layout[1](view)
                    except _UNDECODABLE:
                        value = MISSING  # the long way below raises CorruptSegment naming the key
                if value is not MISSING:
                    if count:
                        if self._proc_gen == process_slot._fork_count and self._counter_off >= 0:
                            counters = self._counters
                            counters[0] += 1  # counters[HITS], inlined
                            g.meta.words[self._counter_off >> 3] = counters[0]
                        else:
                            self._count(HITS)
                    return value
        try:
            w0, w2, _, kb, w1 = self._find(g, key)
            value = self._decode(g, w0, w2, copy, w1, kb) if w0 else MISSING
        except FileNotFoundError:  # a clear() elsewhere unlinked a segment we had yet to map
            w0, value = 0, MISSING
        if w0:
            if value is not _CORRUPT:
                if count:
                    self._count(HITS)
                return value
            if self.is_current(g.gen):  # else a clear() dropped the record under us: a plain miss
                self._count(CORRUPT)
        if count:
            self._count(MISSES)
        return MISSING

    def _spill(self, g: Generation, pos: int, w1: int, kb: bytes, enc: codec.Encoded, *,
               replace: bool = False) -> bool:
        """Write the record to the spill tier and publish where it went at table position ``pos``
        (caller holds the lock): the same intent protocol as a record in memory (NOTE [publish
        order]). ``replace``: the entry there is a spilled record found corrupt, rewritten in
        place. False if the tier did not take it."""
        tier = self.spill
        if tier is None or not tier.accepting:
            return False
        lid = self._intern_layout(g, enc.layout)
        record = bytearray(enc.record_len(len(kb), lid == INLINE24))
        enc.write(memoryview(record), codec.INLINE if lid == INLINE24 else lid, kb)
        loc = tier.write(tier_key(w1, kb), record)
        if loc is None or loc.stored > MAX_RECORD:  # the entry's length field has 32 bits
            return False
        if _CRASH_TESTS:
            crash_point("spilled")  # record on disk, not yet in the index
        items, total, raw = g.disk_totals()
        new = 0 if replace else 1  # a replaced corrupt record is still one item
        intent = Intent(1, pos, SPILL_CLASS, 0, items + new, total + loc.stored, raw + loc.raw,
                        g.table_items() + new)
        g.begin(intent)
        g.index.publish(pos, state_word(READY | SPILLED | (0 if kb else INT_KEY), lid, loc.stored), w1, loc.word)
        g.published()
        g.apply_totals(intent)
        g.end()
        return True

    def _read_spilled(self, w0: int, w2: int, w1: int, kb: bytes, gen: int = -1) -> bytearray | None:
        """The record a spilled entry of generation ``gen`` names, or None; a read that fails
        because a clear() replaced that generation meanwhile is a quiet miss (the caller counts
        it as a plain miss)."""
        if self.spill is None:
            return None
        stale = None if gen < 0 else (lambda: not self.is_current(gen))
        return self.spill.read(RecordLocation(w2, entry_length(w0)), tier_key(w1, kb), stale)

    def spill_to(self, tier: IndexedTier, *, record: bool = True) -> None:
        """Put records that memory refuses into ``tier`` from now on (NOTE [tiers]), and read
        spilled entries from it. ``record``: note its place in the cache's metadata first, so
        ``destroy`` and ``gc`` find it (a reader that only looks - stat, gc - passes False)."""
        if record and self.read_meta().get("spill_path") != tier.where:
            with self.locked():  # the cache's metadata is only ever rewritten under its lock
                meta = self.read_meta()
                if meta.get("spill_path") != tier.where:
                    meta["spill_path"] = tier.where
                    write_json(self.meta_path, meta)
        self.spill = tier

    @property
    def incarnation(self) -> int:
        """The root's incarnation (module docstring): tells this cache from one made again."""
        return self._incarnation

    def is_current(self, gen: int) -> bool:
        """Generation ``gen`` is still the cache's (no clear() replaced it): asked after a failed
        read of a spilled record, which is damage only if its generation is still in force."""
        root = self._root
        return root is not None and split_epoch(_Q.unpack_from(root.buf, R.EPOCH)[0])[0] == gen

    def fill(self, key: Any, compute: Callable[[Any], Any], publish: Callable[[Any, Any], Any],
             copy: bool = True) -> Any:
        """The value of ``key`` after a miss: ``compute(key)``, stored by ``publish(key, value)``,
        under a claim so that processes missing it at once compute it once (NOTE [claims])."""
        return claims.fill(self.claims, key, lambda: self.lookup(key, copy, count=False), MISSING,
                           compute, publish)

    def fill_batch(self, keys: list, compute_many: Callable[[list], list],
                   publish_many: Callable[[list], Any], copy: bool = True) -> list:
        """The values of ``keys``, every one a miss: ``compute_many(keys)`` of those this process
        claims, stored by ``publish_many([(key, value), ...])``, the rest waited for (NOTE [claims])."""
        return claims.fill_batch(self.claims, keys, lambda ks: self._look_many(ks, copy), MISSING,
                                 compute_many, publish_many)

    def _look_many(self, keys: list, copy: bool) -> list:
        """A claim's re-check of ``keys`` (values, MISSING where absent; nothing counted): int keys
        by one vectorised probe first, and only those present decoded."""
        try:
            ints = np.fromiter(keys, np.int64, len(keys)) if all(type(k) is int for k in keys) else None
        except OverflowError:
            ints = None
        if ints is None:
            return self.lookup_batch(keys, copy, count=False)[0]
        present = np.flatnonzero(self._refresh().index.lookup_ints(ints)[0]).tolist()
        out = [MISSING] * len(keys)
        if present:
            for j, value in zip(present, self.lookup_batch([keys[j] for j in present], copy, count=False)[0]):
                out[j] = value
        return out

    def count_computed(self, n: int = 1) -> None:
        """``n`` values computed for this cache on a path without claims (an iterable's pass)."""
        self.claims.count(claims.COMPUTED, n)

    def count_misses(self, n: int = 1) -> None:
        """Count ``n`` items computed from the source without a lookup (warm-up) as misses: every
        item computed from the source is a miss in stats()."""
        self._count(MISSES, n)

    def contains(self, key: Any) -> bool:
        try:
            return self._find(self._refresh(), key)[0] != 0
        except FileNotFoundError:  # cleared meanwhile
            return False

    # --- writes ----------------------------------------------------------------------------------

    def put(self, key: Any, value: Any, *, encoded: codec.Encoded | None = None) -> bool:
        """Store ``value`` under ``key`` unless present. False if it was not admitted: the cache is
        full, or a live process keeps its lock beyond the lock timeout (see _write_locked)."""
        enc = encoded or codec.encode(value, f"the value of key {key!r}")
        w1, kb = key_bytes(key)
        with self._write_locked() as locked:
            if not locked:  # a live process keeps the lock: the caller serves the value uncached
                self._count(REJECTED)
                return False
            if _CRASH_TESTS:
                crash_point("locked")
            g = self._refresh()
            self._repair(g)
            return self._put_locked(g, key, w1, kb, enc)

    def _put_locked(self, g: Generation, key: Any, w1: int, kb: bytes, enc: codec.Encoded,
                    chunk: chunks.Chunk | None = None) -> bool:
        """The body of ``put`` (and of each item of ``put_records``, with its ``chunk``: chunk.py);
        the caller holds the lock."""
        w0, w2, pos, _, _ = self._find(g, key)
        if chunk is not None and not w0 and pos in chunk:  # the chunk took that entry
            pos = chunk.probe(g.index, pos, w1, kb)
            if pos < 0:
                return True  # twice in this put_records: stored once
        if w0 and w0 & SPILLED and self.spill is not None and self._read_spilled(w0, w2, w1, kb) is None:
            if chunk is not None:
                chunk.flush()  # one intent record in use at a time
            return self._spill(g, pos, w1, kb, enc, replace=True)  # a corrupt record
        if w0:
            return True  # another process stored it first: stored once
        if chunk is not None and _Q.unpack_from(g.meta.buf, M.TABLE_ITEMS)[0] + len(chunk) + 1 > \
                MAX_LOAD * g.index.capacity:
            chunk.flush()  # a table growth copies READY entries only
        if _Q.unpack_from(g.meta.buf, M.TABLE_ITEMS)[0] + 1 > MAX_LOAD * g.index.capacity:
            try:
                g = self._grow_table(g)
            except NoRoom:  # the index cannot grow: nothing more is admitted, not even to disk
                self._count(REJECTED)
                return False
            w0, _, pos, _, _ = self._find(g, key)
        try:
            self._insert(g, pos, w1, kb, enc, chunk)
            return True
        except FileNotFoundError:  # a data segment our meta names is gone: not by clear(), we lock
            raise self._destroyed_under_us() or CorruptSegment(
                f"cache {self.session}/{self.name} lost a data segment; run `shmcache gc`") from None
        except ItemTooLarge:
            if self.spill is None:  # counted as every overflow is; the caller decides what to say
                self._count(REJECTED)  # (a dataset serves it from the source, said once)
                raise
            # it can never fit in memory, but a spill file takes any size: spill it below
        except NoRoom:
            pass
        if chunk is not None and self.spill is not None:
            chunk.flush()  # one intent record in use at a time
        if self._spill(g, pos, w1, kb, enc):
            return True
        self._count(REJECTED)
        return False

    # --- portable records (NOTE [tiers]): what a snapshot export reads and an import admits ------

    def put_records(self, items: Sequence[tuple[Any, Any]]) -> list[bool]:
        """``put`` of (key, portable record) pairs (the codec record with its layout inline,
        tiers/tiered_store.py) without decoding them: their bytes go straight into shared memory (or a spill
        file), one copy each, under one hold of the lock (an import stores thousands: the lock,
        refresh and repair check once per batch), published a chunk at a time (chunk.py: two
        fences per chunk of records, not one per record). InvalidArgument for bytes that are not a
        portable record, before anything is stored."""
        return self.put_many([(key, _encoded_from_portable(rec, key, self)) for key, rec in items])

    def put_many(self, items: Sequence[tuple[Any, codec.Encoded]], *,
                 too_large: list | None = None) -> list[bool]:
        """``put`` of many (key, encoded value) pairs under one hold of the lock, published a
        chunk at a time (chunk.py): a batch's or a warm-up's computed misses, a batch's tier hits,
        an import. A value that can never fit (ItemTooLarge, no spill) is False, counted as
        rejected, and its error appended to ``too_large`` when given (else raised, as ``put``)."""
        with self._write_locked() as locked:
            if not locked:  # a live process keeps the lock: the caller serves the values uncached
                self._count(REJECTED, len(items))
                return [False] * len(items)
            self._repair(self._refresh())
            out = []
            chunk = chunks.Chunk()
            try:
                for key, enc in items:
                    w1, kb = key_bytes(key)
                    try:
                        out.append(self._put_locked(self._refresh(), key, w1, kb, enc, chunk))  # a grown table
                    except ItemTooLarge as exc:  # counted by _put_locked; nothing of it was staged
                        if too_large is None:
                            raise
                        too_large.append(exc)
                        out.append(False)
                chunk.flush()
            except BaseException:
                chunk.abandon(self._corrupt)  # undone before its fence, finished after
                raise
            return out

    def portable_records(self):
        """Every item of the current generation as ``(portable key, portable record)``, lock-free
        (portable.records, which says what a damaged or cleared one gives)."""
        return portable.records(self)

    def _insert(self, g: Generation, pos: int, w1: int, kb: bytes, enc: codec.Encoded,
                chunk: chunks.Chunk | None = None) -> None:
        """Allocate, copy and publish a record at EMPTY entry ``pos`` (NOTE [publish order]); with
        a ``chunk`` (put_records), allocate and copy it and stage its entry: the chunk publishes."""
        lid = self._intern_layout(g, enc.layout)
        nbytes = enc.record_len(len(kb), lid == INLINE24)
        cls, chunk_size = size_class(nbytes)
        self.admission.check_fits(nbytes, chunk_size, g.index.capacity)  # ItemTooLarge, NoRoom
        seg = self._class_segment(g, cls, chunk_size)
        self._committed(g, cls, g.data[cls])  # a damaged class record must not place this record
        chunk_size_, bump, committed = g.classes.get(cls)
        if chunk is not None:  # the chunk's bumps move when it is published
            bump = chunk.next_chunk(cls, bump)
        if bump >= committed:  # a chunk's commits are fenced with the chunk (chunk.py)
            committed = self.admission.commit(g, cls, seg, chunk_size, committed, self.spill,
                                              fence=chunk is None)
        items, total, _ = g.mem_totals()
        items, total, table_items = items + 1, total + nbytes, g.table_items()
        if chunk is not None:
            items, total, table_items = items + len(chunk), total + chunk.bytes, table_items + len(chunk)
        if items > g.index.capacity or table_items >= g.index.capacity or total >> 63:
            raise self._corrupt(f"the counters in {g.meta.name} are impossible ({items - 1} items and "
                                f"{total - nbytes} bytes in memory, {table_items} entries, in a "
                                f"table of {g.index.capacity})", fix="it recounts them")
        w0 = state_word(READY | (0 if kb else INT_KEY), lid, nbytes)
        if chunk is not None:
            chunk.allocate(g, pos, w1, kb, cls, bump, w0)  # in the chunk's intent (undo: forget it)
        else:
            intent = Intent(1, pos, cls, bump, items, total, 0, table_items + 1)
            g.begin(intent)  # phase 1: allocating (undo restores the bump)
            g.classes.set_bump(cls, bump + 1)
        if _CRASH_TESTS:
            crash_point("allocated")
        start = DATA_OFF + bump * chunk_size
        with memoryview(seg.buf) as mv:
            if _CRASH_TESTS:  # die with half of the record written
                mv[start:start + nbytes // 2] = b"\xee" * (nbytes // 2)
                crash_point("mid_copy")
            enc.write(mv[start:start + nbytes], lid if lid != INLINE24 else codec.INLINE, kb)
        if chunk is not None:
            g.index.stage(pos, w1, location_word(cls, bump))
            if _CRASH_TESTS:
                crash_point("chunk_copied")
            if len(chunk) >= chunks.CHUNK_RECORDS:
                chunk.flush()
            return
        if _CRASH_TESTS:
            crash_point("before_publish")
        g.index.publish(pos, w0, w1, location_word(cls, bump))
        g.published()  # phase 2: published (redo the totals)
        if _CRASH_TESTS:
            crash_point("after_publish")
        g.apply_totals(intent)
        g.end()

    def _repair(self, g: Generation) -> int:
        """Undo or finish the last writer's work if it died mid-way (repair.repair_intent)."""
        return repair.repair_intent(self, g)

    def collect_garbage(self, report: dict | None = None) -> tuple[int, list[str]]:
        """``shmcache gc`` for this cache: repair a dead writer's entry and unlink segments of
        generations or table versions that are no longer current (a clear() or a table growth
        whose process died before it unlinked them). Returns (chunks reclaimed, names removed).

        Damaged shared memory (issue 8: an impossible intent, an entry, class record or layout
        the allocator never wrote, a table with no EMPTY entry) cannot be repaired entry by entry:
        the generation is dropped for a new empty one (it is a cache: the data is recomputed), and
        ``report["dropped"]`` says why. Item counters that disagree with the table are recounted
        (``report["recounted"]``)."""
        return repair.collect_garbage(self, report)

    def _intern_layout(self, g: Generation, layout: bytes) -> int:
        cache = g.layouts
        for lid, (raw, *_) in cache.items():
            if raw == layout:
                return lid
        n = _Q.unpack_from(g.meta.buf, M.N_LAYOUTS)[0]
        if n > M.MAX_LAYOUTS:
            raise self._corrupt(f"{g.meta.name} counts {n} layouts, more than its {M.MAX_LAYOUTS} slots")
        for lid in range(n):
            if self._layout(g, lid)[0] == layout:
                return lid
        if n >= M.MAX_LAYOUTS or len(layout) > M.LAYOUT_BYTES - 4:
            return INLINE24
        off = M.LAYOUTS + n * M.LAYOUT_BYTES
        struct.pack_into("I", g.meta.buf, off, len(layout))
        g.meta.buf[off + 4:off + 4 + len(layout)] = layout
        g.meta.words[M.N_LAYOUTS >> 3] = n + 1  # after the bytes: readers never see it half-made
        return n

    def _class_segment(self, g: Generation, cls: int, chunk_size: int) -> Segment:
        if g.classes.chunk_size(cls):
            return self._data(g, cls)[0]
        name = self._seg_name(f"g{g.gen}", f"c{cls}")
        self.ns.unlink_segment(name)  # debris of a writer that died before registering the class
        try:
            virtual = self.admission.data_segment_bytes()
            seg = Segment.create(name, DATA_OFF + virtual + chunk_size, kind=KIND_DATA, commit=PAGE)
        except SharedMemoryFull as exc:
            self.admission.log_shm_full(exc, self.spill)
            raise NoRoom from None
        g.classes.create(cls, chunk_size)
        g.data[cls] = (seg, memoryview(seg.buf).toreadonly(), chunk_size, 0)
        return seg

    def _grow_table(self, g: Generation) -> Generation:
        """Rebuild the table at twice the size as a new version (caller holds the lock)."""
        cap = g.index.capacity * 2
        version = g.version + 1
        name = self._seg_name(f"g{g.gen}", f"t{version}")
        self.ns.unlink_segment(name)
        size = TableView.bytes_for(cap)
        try:
            table = Segment.create(name, size, kind=KIND_TABLE, commit=size)
        except SharedMemoryFull as exc:
            self.admission.log_shm_full(exc, self.spill)
            raise NoRoom from None
        TableView.init(table.buf, cap)
        new = TableView(table.buf)
        for w0, w1, w2 in g.index.entries():
            pos = _first_empty(new, w1)  # keys are unique: the first EMPTY slot on its path
            new.publish(pos, w0, w1, w2, fence=False)  # unreachable until the epoch word names it
        table.close()
        old = g.table
        if _CRASH_TESTS:
            crash_point("table_built")
        ordering.fence()  # every entry of the new table before the epoch word names it
        self._root.words[R.EPOCH >> 3] = epoch_of(g.gen, version)  # publish: one store
        old.unlink()
        g = self._refresh()
        repair.recount_committed(g)
        return g

    # --- batches ---------------------------------------------------------------------------------

    def lookup_batch(self, keys: Sequence, copy: bool = True, count: bool = True) -> tuple[list, list[int]]:
        """Values for ``keys`` (MISSING where absent) and the positions of the misses; counted as
        hits and misses unless not ``count`` (a claim's re-check, a waiter's poll)."""
        g = self._refresh()
        values: list = [MISSING] * len(keys)
        missing = []
        for i, key in enumerate(keys):
            try:
                w0, w2, _, kb, w1 = self._find(g, key)
                v = self._decode(g, w0, w2, copy, w1, kb) if w0 else MISSING
            except FileNotFoundError:  # cleared meanwhile
                v = MISSING
            if v is _CORRUPT:
                if self.is_current(g.gen):  # else cleared under us: a plain miss
                    self._count(CORRUPT)
                v = MISSING
            if v is MISSING:
                missing.append(i)
            else:
                values[i] = v
        if count:
            self._count(HITS, len(keys) - len(missing))
            if missing:
                self._count(MISSES, len(missing))
        return values, missing

    def batch_layout(self, keys: np.ndarray) -> tuple | None:
        """``(tree, leaves, end of the last leaf)`` of the record of ``keys[0]`` (codec.leaves): the structure a
        vectorised batch of ``keys`` would have. None if that key is not cached with a shared layout."""
        g = self._refresh()
        planned = g.columns.get(gather.PLAN)  # a warm batch's layout (gather.Plan)
        if planned is not None and planned.holds(g.index, int(keys[0])):
            return planned.layout
        try:  # one key: a scalar probe costs a tenth of the vectorised lookup's numpy calls
            w0 = self._find(g, int(keys[0]))[0]
        except FileNotFoundError:  # cleared meanwhile
            return None
        lid = entry_layout(w0)
        if not w0 or lid == INLINE24:
            return None
        columns = self._columns(g, lid)
        return None if columns[3] else columns[:3]

    def _columns(self, g: Generation, lid: int) -> tuple:
        """``(tree, leaves, end of the last leaf, has a list of numbers)`` of layout ``lid`` for
        the batch path (a list of numbers is never a column: ``default_collate`` transposes lists)."""
        shape = g.columns.get(lid)
        if shape is None:
            raw, _, end, _ = self._layout(g, lid)  # checked there: codec.leaves takes it as sound
            tree, leaves = codec.leaves(raw)
            shape = g.columns[lid] = (tree, leaves, end, any(leaf.tag == codec.NUMBERS for leaf in leaves))
        return shape

    out_matches = staticmethod(gather.out_matches)

    def absent_ints(self, keys: np.ndarray) -> np.ndarray:
        """The int64 ``keys`` that are not cached (in memory or on disk), in their order: one
        vectorised lookup, nothing counted (warm-up skips what is there)."""
        w0, _ = self._refresh().index.lookup_ints(keys)
        return keys[w0 == 0]

    def all_in_memory(self, keys: np.ndarray) -> bool:
        """True if every int key is cached in memory with one layout and size class: what
        :meth:`gather_ints` needs (checked without copying or counting anything)."""
        g = self._refresh()
        planned = g.columns.get(gather.PLAN)  # a warm batch: its plan's checks (gather.planned_chunks)
        if len(keys) and planned is not None and gather.planned_chunks(planned, g.index.words, keys) is not None:
            return True
        return len(keys) > 0 and gather.uniform(*g.index.lookup_ints(keys))

    def gather_ints(self, keys: np.ndarray, out: list | None = None):
        """Vectorised batch of int keys that share one layout and one size class, all in memory.

        Returns ``(tree, leaves, columns)`` - the layout tree, its leaves (codec.Leaf) and one
        stacked array per leaf - or None
        when the batch is not uniform (the caller falls back to :meth:`lookup_batch`). ``out``:
        optional list of arrays, one per leaf, to gather into (e.g. pinned host buffers).
        """
        g = self._refresh()
        if len(keys) == 0:
            return None
        planned = g.columns.get(gather.PLAN)  # a warm batch: a few numpy calls (gather.gather_planned)
        got = planned and gather.gather_planned(planned, g.index.words, keys, out, self._buffers)
        if got is not None:
            self._count(HITS, len(keys))
            return planned.tree, planned.leaves, got
        batch = gather.plan(g.index, keys)
        if batch is None:
            return None
        tree, leaves, end, numbers = self._columns(g, batch.layout)
        if numbers:  # never a column (_columns): the caller goes item by item
            return None
        cls, n = batch.cls, batch.length
        try:
            entry = g.data.get(cls) or self._data(g, cls)
        except FileNotFoundError:  # cleared meanwhile: the caller's slow path sees misses
            return None
        # the checks of _record, for the whole batch at once: every chunk handed out, the one
        # length within a chunk and long enough for the layout (issue 8: never zeros or a neighbour)
        top = int(batch.chunks.max())
        if top >= entry[3] or not end <= n <= entry[2]:  # end: at least a record header (_layout)
            entry = self._committed(g, cls, entry)
            if top >= entry[3] or not end <= n <= entry[2]:
                raise self._corrupt(f"an entry of {g.table.name} in a batch of keys from {int(keys[0])} "
                                    f"points at {n} bytes in chunk {top} of size class {cls}, which "
                                    f"has handed out {entry[3]} chunks of {entry[2]} bytes (layout "
                                    f"{batch.layout} needs {end})")
        seg, _, chunk, handed_out = entry
        try:  # str, bytes and pickled leaves decode per item: damaged bytes raise there
            columns = gather.columns(seg.buf, handed_out, chunk, batch.chunks, leaves, out, self._buffers)
        except ShmcacheError:
            raise
        except _UNDECODABLE as exc:
            raise self._undecodable(f"a record of the batch of keys from {int(keys[0])} in {seg.name}",
                                    exc) from None
        self._count(HITS, len(keys))
        # checked above: the next such batch takes the planned way
        gather.remember(g.columns, state_word(READY | INT_KEY, batch.layout, n), cls, handed_out, chunk, seg.buf,
                        (tree, leaves, end))
        return tree, leaves, columns

    # --- bookkeeping ------------------------------------------------------------------------------

    def stats(self) -> dict:
        return stats.cache_stats(self)

    def shm_bytes(self) -> int:
        """Bytes of /dev/shm that this cache's segments really occupy (allocated pages)."""
        return self.ns.occupied_bytes(self._base + SEP)

    def __len__(self) -> int:
        g = self._refresh()
        n = _Q.unpack_from(g.meta.buf, M.ITEMS_MEM)[0] + _Q.unpack_from(g.meta.buf, M.ITEMS_DISK)[0]
        if n > g.index.capacity:  # every item has an entry: more is garbage (len() cannot return it)
            raise self._corrupt(f"the item counters in {g.meta.name} say {n} items, in a table of "
                                f"{g.index.capacity} entries", fix="it recounts them")
        return n

    def clear(self) -> None:
        """Drop every item: a new generation in new segments; old mappings stay valid for readers."""
        with self.locked():
            g = self._refresh()
            self._create_generation(self._root, g.gen + 1, self.capacity_bytes, g.index.capacity)
            # The spill files go after the new generation is published: a reader whose read of
            # them fails then sees the generation moved on - a plain miss, not damage to report.
            # (Writers wait for our lock, so nothing of the new generation is in them yet.) The
            # fence puts the retirement (the epoch word) before that reuse for every reader.
            ordering.fence()
            if self.spill is not None:
                self.spill.clear()
            elif self.read_meta().get("spill_path"):  # spilled by others; this handle doesn't spill
                shutil.rmtree(self.read_meta()["spill_path"], ignore_errors=True)
            if _CRASH_TESTS:
                crash_point("cleared_before_unlink")
            unlink_segments(self.ns, self._seg_name(f"g{g.gen}", ""))
            self._refresh()
        codec.clear_decoders()  # the old generation's layouts are gone: free their decoders

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        if self._gen is not None:
            close_generation(self._gen)
            self._gen = None
        self._epoch = -1
        if self._root is not None:
            self._root.close()
            self._root = None
        self.lock.close()
        self.claims.close()
        self._release_use()
        if self._attached == process_slot.fork_count():  # (a forked child never attached this one)
            self._attached = -1
            process_slot.detach(self.registry, self.session)

    def _release_use(self) -> None:
        if self._use is not None:
            self._use.release()
            self._use = None

    def destroy(self) -> None:
        """Remove this cache from its session (segments, metadata and spill files)."""
        with self.locked():
            spill_path = self.read_meta().get("spill_path")
            # the tombstone first: every handle still mapping this root misses from now on
            self._root.words[R.EPOCH >> 3] = DESTROYED
            ordering.fence()  # retired for every reader before its spill files and name are reused
            self.meta_path.unlink(missing_ok=True)
            self.claims.path.unlink(missing_ok=True)  # its claims and their counters go with it
            unlink_segments(self.ns, self._base + SEP)  # the root first: the cache is gone at once
            if self.spill is not None:
                self.spill.destroy()
            elif spill_path:
                shutil.rmtree(spill_path, ignore_errors=True)
        self.close()

class UncachedStore:
    """A cache that could not be made: not even its own segments fit in /dev/shm (or the process
    could not map them). It has the methods the dataset layer calls on a CacheStore: every lookup
    misses, every put is refused and counted as rejected (in this process: there is no shared
    memory for counters), so a training run computes its items from the source instead of
    stopping. Said once, in the log, with what to do about it."""

    uncached = True

    def __init__(self, session: str, name: str, reason: Exception):
        self.session, self.name = session, name
        self.capacity_bytes = 0
        self.spill = None
        self._counters = [0, 0, 0]  # hits, misses, rejected
        self._computed = 0
        log.warning("cache %s/%s is not cached: %s; its items are computed from the source", session,
                    name, reason)

    def lookup(self, key: Any, copy: bool = True, count: bool = True) -> Any:
        if count:
            self._counters[MISSES] += 1
        return MISSING

    def count_misses(self, n: int = 1) -> None:
        self._counters[MISSES] += n

    def lookup_batch(self, keys: Sequence, copy: bool = True, count: bool = True) -> tuple[list, list[int]]:
        if count:
            self._counters[MISSES] += len(keys)
        return [MISSING] * len(keys), list(range(len(keys)))

    def put(self, key: Any, value: Any, *, encoded: codec.Encoded | None = None) -> bool:
        if encoded is None:
            codec.encode(value, f"the value of key {key!r}")  # what is not cacheable says so anyway
        self._counters[REJECTED] += 1
        return False

    def put_records(self, items: Sequence[tuple[Any, Any]]) -> list[bool]:
        self._counters[REJECTED] += len(items)
        return [False] * len(items)

    def put_many(self, items: Sequence[tuple[Any, codec.Encoded]], *,
                 too_large: list | None = None) -> list[bool]:
        return self.put_records(items)

    def contains(self, key: Any) -> bool:
        return False

    def fill(self, key: Any, compute: Callable[[Any], Any], publish: Callable[[Any, Any], Any],
             copy: bool = True) -> Any:
        """No shared memory, so no claims: compute (and offer it to ``publish``, which refuses)."""
        return claims.fill(None, key, lambda: MISSING, MISSING,
                           lambda k: self._counted([compute(k)])[0], publish)

    def fill_batch(self, keys: list, compute_many: Callable[[list], list],
                   publish_many: Callable[[list], Any], copy: bool = True) -> list:
        return claims.fill_batch(None, keys, lambda ks: [MISSING] * len(ks), MISSING,
                                 lambda ks: self._counted(compute_many(ks)), publish_many)

    def _counted(self, values: list) -> list:
        """``values`` just computed, counted - once they are (not the keys asked for: a key twice
        in a batch is computed once, a compute that raises half-way counts what it kept itself,
        and a ``Served`` value was not computed here)."""
        if type(values) is not list:
            values = list(values)
        self._computed += sum(type(v) is not claims.Served for v in values)
        return values

    def count_computed(self, n: int = 1) -> None:
        self._computed += n

    def batch_layout(self, keys: np.ndarray) -> None:
        return None

    def absent_ints(self, keys: np.ndarray) -> np.ndarray:
        return keys

    def all_in_memory(self, keys: np.ndarray) -> bool:
        return False

    def gather_ints(self, keys: np.ndarray, out: list | None = None) -> None:
        return None

    out_matches = CacheStore.out_matches

    def bind_fingerprint(self, fingerprint: str) -> None:
        """Nothing is stored, so nothing can be another dataset's."""

    def stats(self) -> dict:
        return stats.uncached_stats(self.session, self.name, self._counters, self._computed)

    def __len__(self) -> int:
        return 0

    def clear(self) -> None:
        """Nothing to drop."""

    def close(self) -> None:
        """Nothing to release."""


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
_CORRUPT: Any = object()


def _encoded_from_portable(record: Any, key: Any, store: CacheStore) -> codec.Encoded:
    """A portable record as what ``_insert`` writes: its body and its layout, views of ``record``."""
    view = memoryview(record).cast("B")
    lid, key_len, lay_len, _ = codec.RECORD_HEADER.unpack_from(view, 0) if len(view) >= _MIN_RECORD \
        else (0, 0, 0, 0)
    body = len(view) - key_len - lay_len
    if lid != codec.INLINE or not _MIN_RECORD <= body < body + lay_len:
        raise InvalidArgument(f"the record for key {key!r} in cache {store.session}/{store.name} is not "
                              f"a portable record (layout id {lid:#x}, {len(view)} bytes); pass "
                              f"shmcache.tiers.tiered_store.portable_record(...) bytes")
    return codec.Encoded(bytes(view[body:body + lay_len]), body, view[_MIN_RECORD:body], [])


def _first_empty(index: TableView, w1: int) -> int:
    pos = index.home(w1)
    for _ in range(index.capacity):  # bounded, as every probe of shared memory is
        if not _Q.unpack_from(index.buf, TABLE_OFF + ENTRY_BYTES * pos)[0]:
            return pos
        pos = (pos + 1) & index.mask
    raise index.corrupt()


def _key_repr(w1: int, kb: bytes) -> str:
    """The key of an entry, for messages: ``kb`` is its tagged bytes (empty for int keys)."""
    if not kb:
        return str(w1 - (1 << 64) if w1 >> 63 else w1)
    return repr(kb[1:].decode("utf-8", "surrogatepass") if kb[:1] == b"s" else kb[1:])


def _table_capacity(hint: int) -> int:
    want = max(MIN_TABLE, int(hint / MAX_LOAD) + 1)
    return 1 << (want - 1).bit_length()
