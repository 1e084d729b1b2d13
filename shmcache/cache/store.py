"""The cache store: one named cache of a session, shared by every process that opens it.

Objects of one cache (names from Namespace.segment_name; ``g`` is the generation, ``v`` the table
version)::

    +root            epoch word (generation << 32 | table version), capacity, incarnation, sizing
                     (generation.RootLayout)
    +<i>+g<g>+meta   counters, allocator classes, layout table, totals, the intent record
                     (generation.MetaLayout, generation.Generation)
    +<i>+g<g>+t<v>   the hash table (index.TableView)
    +<i>+g<g>+c<k>   the data segment of size class k (allocator.ClassTable)

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

    A publish group (``put_records`` and ``put_many``, so an import, a tier hit, a batch's misses:
    publish_group.PublishGroup) is a group of up to generation.GROUP_RECORDS records published
    together under the one hold of the lock, with its own intent record (generation.GroupIntent,
    in the meta segment beside the intent above; a writer uses one at a time). ("Chunk" means
    only the allocator's: the piece of a size class's segment a record is copied into.) Point by
    point, as for one record:

      1. phase 1; per record: note it in the group intent (table position, size class, the
         entry's state word; for its class's first record the class's bump before the group),
         commit chunks if needed, copy it into the next chunk of its class - counted by the
         writer: the class's bump in shared memory does not move yet - and write the entry's
         key and location words (w1, w2; w0 stays EMPTY, so readers ignore them);
      2. a fence (A), then phase 2 with the totals after the group;
      3. each class's bump moves past the group's records; a fence (B);
      4. every entry's state word READY, the totals assigned, the group intent cleared.

    A run (``put_many``'s records with int keys, of one size class: a batch of one dataset's
    samples, whose layouts may differ with a str field's length; CacheWriter._put_run) is a
    stretch of a group written with numpy over the run: the same words, the same fences. Its
    records are noted in the group intent in one go (the count word last), its chunks are the
    next ones of its class in a row, its bytes go into them with one pwrite of the class's
    segment, each record from its own layout's offsets (Segment.write_at: the kernel's copy, no
    page fault per page of the writer's mapping; through the mapping on a hugetlbfs, which has
    no write(); ordered by fence A as any store), its entries' w1 and w2 staged together; a
    group's READY words are one numpy assignment (one aligned 8-byte store per word,
    TableView.ready_many). The repair cannot tell a run from records put one at a time.

    The repair: in phase 1 nothing is reachable and no bump moved, so it forgets the staged w1
    and w2 and clears the intent (every chunk free again; commit steps stay committed for the
    next writer); in phase 2 every record is whole and fenced, so it finishes steps 3-4 (all
    assignments: bumps, READY words - the same word where one is READY already - totals). A
    writer that raises in the middle of a group does what the repair would, before it raises.
    The group's impossible intents (CorruptSegment, gc drops the generation): phase 1 with an
    entry filled or a bump moved; phase 2 with a bump neither where it was nor past the group's
    records, an entry READY with another word, a staged location outside the group's chunks,
    totals neither the current ones nor the group's records more; both intents in use.

    "One store" is meant literally: every word a reader reads without the lock (the root's epoch
    word, the meta segment's counts and totals, a class's bump and committed count, an entry's
    words, the counters) is written through ``Segment.words`` (shm.word_view), one aligned
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

    Memory ordering (base.ordering). All of the above says "after" of stores that other processes
    load without a lock; on x86-64 (TSO) the order of a writer's stores is the order every reader
    sees, and nothing more is done. On a weakly ordered CPU (aarch64) the writer makes that order
    with ``ordering.fence()`` - membarrier(MEMBARRIER_CMD_GLOBAL_EXPEDITED): every registered
    process passes a full barrier before it returns - and readers pay nothing. Point by point:

      * an entry: the record's bytes, its class record (chunk size, bump) and layout record, and
        the entry's w1 and w2 are stored, then a fence, then w0 = READY (index.TableView.publish;
        every put, spilled or not: one fence per record). A reader loads w0 first and the rest
        after, so if it sees READY it sees all of them.
      * a publish group (put_records, an import): two fences per group of up to GROUP_RECORDS
        records, whatever their commit steps. Fence A orders every record's bytes, every w1 and w2, the
        committed counts of the group's commit steps (Admission.commit(fence=False)), class and layout
        records before the bumps; fence B orders the bumps before the READY words. So a reader
        that sees READY sees the bump that hands its chunk out, the bytes and w1, w2; one that
        sees a moved bump sees the committed count it needs. A repair that finishes a dead
        writer's group makes its own fence B; the dead writer's fence A came before its phase 2.
      * a commit step: the class's committed count (and the meta's total), a fence, and only then a
        bump that relies on it (admission.Admission.commit); ClassTable.get loads the bump before
        the committed count.
      * a generation or a table version: the meta, the table (every entry of a grown table: no
        fence per entry there, nobody reads it yet) and the root's capacity, incarnation and sizing
        words, a fence, then the epoch word (CacheWriter.create_generation, its table growth). A raised automatic
        cap: CAPACITY, a fence, SIZING.
      * retire, then reuse: clear() and gc's drop publish the new epoch word, fence, and only then
        clear the spill files (whose offsets the new generation reuses): a reader whose read of a
        reused file fails and then loads the epoch word sees the new one (a plain miss). A destroy
        (here and registry.retire_root) fences after the tombstone, before its files and name go.
        Memory inside a generation is never reused (above), and the repair gives back only a
        chunk that no READY entry ever named (a group's staged w2 in an EMPTY entry names nothing
        to a reader: it stops at EMPTY), so nothing else is retired.
      * not fenced: the intent records, the totals and the counters. The intent is read under the
        lock only (the lock file's flock orders it, as it orders one writer after the other); the
        totals and counters are statistics, each word one aligned store.
    The argument for membarrier (base.ordering's docstring): a reader's barrier falls before its load
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
    A write a forced destroy overtook (it waits 10 s for a busy lock, then goes on without it, and
    the session and cache may be made again at once) must not land in the new incarnation: its
    segments carry the old incarnation's names; its metadata is written relative to the directory
    of the lock file it holds (``write_meta``: FlockLock.held_directory), the one renamed away and
    removed; and a put that finds its root tombstoned when it is done (CacheWriter._check_not_overtaken)
    removes what it made under its incarnation's names and raises CacheNotFound, as the next would.

    Opening. The root is made READY-last (NOTE [segment lifecycle]), then its capacity and incarnation words,
    then the first generation, and its epoch word is published last. So an opener attaches the
    root without the lock when its epoch word names a generation whose meta and table exist: a
    writer stopped while holding the lock (SIGSTOP, a debugger) never blocks readers or workers
    that re-attach. Only a root that is missing, half-made, tombstoned or without its generation
    sends the opener to the lock, to create or repair it. A put that cannot get the lock
    within its timeout serves its value uncached (counted as rejected; CacheWriter.write_locked).

    Damage (a stray write into /dev/shm, a hostile process of the same user) must never turn into
    a wrong value or a moved bump. Readers check each entry before following it: a class in use, a
    chunk below the class's bump, a length within the chunk, a layout id the meta segment holds
    (CacheView.record, CacheView.layout; on the batch path with numpy over the batch). Handed out,
    not merely committed: a committed chunk above the bump holds zeros. Sound in every legitimate
    state: an entry is READY only after its chunk's bump step, and a bump goes back (repair) only
    for a chunk no entry ever pointed at (a group's bumps move only once all its records are whole,
    and then forward). The repairer checks the intent is one a writer can leave: phase 1 or 2, a
    position inside the table, a class in use (or SPILL_CLASS), an old bump equal to the class's
    bump or one less, phase 2 only with its entry READY, totals at most one item on (a group's:
    above, "A publish group"; cache.repair, publish_group.repair). Anything else raises
    CorruptSegment and touches nothing; ``shmcache gc`` (CacheStore.collect_garbage) finds the same
    damage and replaces the generation by an empty one, as clear() does.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

import numpy as np

from ..base import ordering
from ..base.faults import ARMED as _CRASH_TESTS
from ..base.faults import crash_point
from ..base.namespace import Namespace, namespace, validate_name
from ..base.shm import PAGE, WORD, Segment
from ..errors import CacheMismatch, CacheNotFound, CorruptSegment, InvalidArgument, LockTimeout, SessionNotFound
from . import claims, codec, gather, portable, process_slot, repair, stats
from .admission import MIN_CAPACITY, Admission, initial_capacity, log_no_memory
from .generation import AUTO_NONE, DESTROYED, KIND_ROOT, MISSES, REJECTED, RootLayout, split_epoch
from .index import MAX_LOAD, MIN_TABLE, TableView
from .indexed_tier import IndexedTier
from .registry import SEP, SessionRegistry, unlink_segments, write_json
from .root import NOTICE_WORDS
from .stats import STAT_KEYS
from .view import MISSING, CacheView
from .writer import CacheWriter

__all__ = ["CacheStore", "UncachedStore", "STAT_KEYS", "MISSING"]

log = logging.getLogger("shmcache")



class CacheStore:
    """One cache (``session``/``name``): the facade over its two sides. ``view`` (view.CacheView)
    maps it and reads it lock-free; ``writer`` (writer.CacheWriter) holds its lock and writes. This
    class opens the cache (the root, lock-free where it can: NOTE [publish order], Opening), binds
    it to a dataset, and clears, closes and destroys it; see the module docstring for what lives
    where."""

    uncached = False  # see UncachedStore

    def __init__(self, session: str, name: str, *, capacity_bytes: int = 0,
                 fingerprint: str | None = None, table_hint: int = 0,
                 ns: Namespace | str | None = None, lock_timeout_s: float = 60.0,
                 create: bool = True, claim_timeout_s: float | None = None):
        ordering.register()  # a weakly ordered machine without membarrier refuses here (ordering.register)
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
        # the read side (lock-free) and the write side (under the lock) of this handle
        self.view = CacheView(self.session, self.name, self.ns, self.registry,
                              where + self.ns.segment_name(self.session, self.name))
        self.writer = CacheWriter(self.view, self.lock)
        # the hot calls, bound once to the side that serves them: no extra call per lookup
        view, writer = self.view, self.writer
        self.lookup, self.lookup_batch, self.contains = view.lookup, view.lookup_batch, view.contains
        self.batch_layout, self.absent_ints = view.batch_layout, view.absent_ints
        self.all_in_memory, self.gather_ints = view.all_in_memory, view.gather_ints
        self.put, self.put_many, self.put_records = writer.put, writer.put_many, writer.put_records
        # who computes a key many processes miss at once (NOTE [claims]); opened on first use
        self.claims = claims.Claims(self.registry.cache_claims_path(self.session, self.name),
                                    lambda: process_slot.slot(self.registry, self.session), claim_timeout_s)
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
        self.view.root = self._attach_whole_root(fingerprint)
        if self.view.root is None:  # missing, half-made or tombstoned: create or repair, under the lock
            try:
                self.lock.acquire()
            except FileNotFoundError:  # the session's directory went away under us
                raise SessionNotFound(f"session {self.session!r} was destroyed while cache {self.name!r} "
                                      f"was being opened in it; open it again") from None
            try:
                self.view.root = self._open_root(capacity_bytes, fingerprint, table_hint, create)
            finally:
                self.lock.release()
        self.writer.trust_lock()
        # the cap, and whether there is room (NOTE [memory limits]): the writer asks it, under the lock
        self.writer.admission = Admission(self.view.root, self.registry, self.session, self.name)
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
                pass  # served without a slot; CacheView.count says so when it first counts
            except FileNotFoundError:  # its slots directory is gone: destroyed just now
                raise self.view.destroyed() from None
        self.view.refresh()

    @property
    def capacity_bytes(self) -> int:
        """The cache's cap in bytes (the root's CAPACITY word as this handle last read it)."""
        return self.writer.admission.capacity_bytes

    def _attach_whole_root(self, fingerprint: str | None) -> Segment | None:
        """The root, attached without the lock, if its epoch word names a generation whose meta
        and table exist (NOTE [publish order]: Opening); None when only the lock can tell."""
        try:
            root = self.view.adopt(Segment.attach(self.view.segment_name("root"), kind=KIND_ROOT))
        except (FileNotFoundError, CorruptSegment):
            return None
        if WORD.unpack_from(root.buf, RootLayout.EPOCH)[0] == DESTROYED or not self.view.generation_exists(root):
            root.close()
            return None
        self._check_fingerprint(fingerprint)
        return root

    def _open_root(self, capacity_bytes: int, fingerprint: str | None, table_hint: int,
                   create: bool) -> Segment:
        name = self.view.segment_name("root")
        try:
            root = self.view.adopt(Segment.attach(name, kind=KIND_ROOT))
        except FileNotFoundError:
            root = None
        except CorruptSegment:  # its creator died mid-way (we hold the lock, so it is not busy)
            self.ns.unlink_segment(name)
            root = None
        if root is not None and WORD.unpack_from(root.buf, RootLayout.EPOCH)[0] == DESTROYED:
            root.unlink()  # tombstoned by a destroy that died before it unlinked it: finish that
            root = None
        if root is not None and WORD.unpack_from(root.buf, RootLayout.EPOCH)[0] == 0:
            # its creator died before publishing the first generation, maybe before writing the
            # cap (a cache of 0 bytes for good): nobody ever read it - make it afresh, below
            log.info("cache %s/%s: its creator died while making it; what it made is removed",
                     self.session, self.name)
            root.unlink()
            root = None
            unlink_segments(self.ns, self.view.base + SEP)
            if not create:  # the cache was never made: forget it, as gc does (no error row in stat)
                self.meta_path.unlink(missing_ok=True)
        if root is not None and not self.view.generation_exists(root):
            # its creator died after making it, before the first generation; or a destroy died
            # after unlinking some segments: what is left is debris - start the cache afresh
            log.warning("cache %s/%s was left half-made or half-destroyed by a process that died; "
                        "it starts empty", self.session, self.name)
            capacity = WORD.unpack_from(root.buf, RootLayout.CAPACITY)[0]
            unlink_segments(self.ns, self.view.base + SEP, keep=(name,))
            # a generation number this root never named: a handle still mapping the lost one must
            # see the epoch word change, never new segments under the names it maps lazily
            gen = split_epoch(WORD.unpack_from(root.buf, RootLayout.EPOCH)[0])[0] + 1
            self.writer.create_generation(root, gen, capacity, _table_capacity(table_hint, capacity))
        if root is not None:
            self._check_fingerprint(fingerprint)
            return root
        if not create:
            known = self.registry.cache_names(self.session)
            if self.name in known:  # its metadata, no root: not made yet, or made where we cannot see
                where = self.registry.segment_dir(self.session) or "/dev/shm"
                raise CacheNotFound(
                    f"cache {self.session}/{self.name} has no shared memory in {where} as this process sees "
                    f"it: its creator has not finished it or died (`shmcache gc` forgets it then), or its "
                    f"memory is where this process cannot see it - the memory directory mounted over since, "
                    f"or another mount namespace's (a container's) tmpfs at that path; look from there")
            raise CacheNotFound(
                f"no cache {self.name!r} in session {self.session!r} (caches: {', '.join(known) or 'none'})")
        unlink_segments(self.ns, self.view.base + SEP)  # debris of an earlier incarnation of this cache
        # size=0: the session's automatic cap (NOTE [memory limits])
        sizing, capacity = initial_capacity(self.registry, self.session, capacity_bytes)
        if capacity < MIN_CAPACITY:
            raise InvalidArgument(
                f"the cache {self.session}/{self.name} would get {capacity / 2**20:.2f} MiB, too "
                f"little to hold anything; give it size= (MiB) of at least 1, or size=0 for the "
                f"automatic cap (`shmcache info` shows what limits memory here)"
            )
        # the metadata first: a creator that dies later leaves a cache that stat and gc can see
        self.write_meta({
            "session": self.session, "name": self.name, "fingerprint": fingerprint,
            "created": time.time(), "capacity_bytes": capacity,
        })
        try:
            root = Segment.create(name, PAGE, kind=KIND_ROOT, commit=PAGE)
            root.words[RootLayout.CAPACITY >> 3] = capacity
            root.words[RootLayout.INCARNATION >> 3] = secrets.randbits(32)
            root.words[RootLayout.SIZING >> 3] = sizing
            self.view.adopt(root)
            self.writer.create_generation(root, 1, capacity, _table_capacity(table_hint, capacity))
        except BaseException:
            # no room, or interrupted: take back what this attempt made, json last (we hold the
            # lock, and the epoch word was never published, so nobody attached any of it)
            unlink_segments(self.ns, self.view.base + SEP)
            self.meta_path.unlink(missing_ok=True)
            raise
        if sizing == AUTO_NONE:  # said once, here: a cache that could not be made says it above us
            log_no_memory(self.session, self.name, self.registry.memory_root(self.session))
        return root

    def bind_fingerprint(self, fingerprint: str) -> None:
        """Record which dataset this cache holds (first binding), or raise if it holds another."""
        if self.read_meta().get("fingerprint") == fingerprint:
            return  # recorded already: nothing to write, no lock to wait for
        with self.locked():
            self._check_fingerprint(fingerprint)
            meta = self.read_meta()
            if meta.get("fingerprint") is None:
                meta["fingerprint"] = fingerprint
                self.write_meta(meta)

    def reserve_entries(self, n: int) -> None:
        """Size the index for ``n`` items now, as ``table_hint`` sizes a new cache's: wrap() of a
        dataset of ``n`` items in a cache opened by name before it (its misses then never wait
        for a table growth, and each dataset index sits at its own entry). Nothing when it holds
        them already, or when memory has no room for a larger table (it grows as it fills)."""
        want = _table_capacity(n, self.capacity_bytes)
        if self.view.refresh().index.capacity >= want:
            return
        with self.locked():
            self.writer.grow_table_to(want)

    def read_meta(self) -> dict:
        return self.registry.read_cache_meta(self.session, self.name)

    def write_meta(self, meta: dict) -> None:
        """Rewrite the cache's metadata (under its lock: ``locked()``). A forced destroy does not
        wait for the lock: the session's directory may be gone under the write, or made again
        with a new cache of this name (NOTE [publish order], Destroying). So it is written beside
        the lock file held, never by name: in a directory gone, the write fails and says so."""
        try:
            where = self.lock.held_directory()
            try:
                write_json(self.meta_path, meta, dir_fd=where)
            finally:
                os.close(where)
        except FileNotFoundError:
            raise SessionNotFound(f"session {self.session!r} was destroyed while cache {self.name!r} "
                                  f"was being written in this process (`shmcache destroy --force`?); "
                                  f"open it again") from None

    def record_label(self, label: str) -> None:
        """What a user recognises the cache by (wrap(label=), else the dataset's repr), kept in its
        metadata for `shmcache stat`; rewritten under the lock only when it changes."""
        if self.read_meta().get("label") == label:
            return
        with self.locked():
            meta = self.read_meta()
            if meta and meta.get("label") != label:
                meta["label"] = label
                self.write_meta(meta)

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

    def spill_to(self, tier: IndexedTier, *, record: bool = True) -> None:
        """Put records that memory refuses into ``tier`` from now on (NOTE [tiers]), and read
        spilled entries from it. ``record``: note its place in the cache's metadata first, so
        ``destroy`` and ``gc`` find it (a reader that only looks - stat, gc - passes False)."""
        if record and self.read_meta().get("spill_path") != tier.where:
            with self.locked():  # the cache's metadata is only ever rewritten under its lock
                meta = self.read_meta()
                if meta.get("spill_path") != tier.where:
                    meta["spill_path"] = tier.where
                    self.write_meta(meta)
        self.spill = tier

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
        return claims.fill_batch(self.claims, keys, lambda ks: self.view.look_many(ks, copy), MISSING,
                                 compute_many, publish_many)

    def count_computed(self, n: int = 1) -> None:
        """``n`` values computed for this cache on a path without claims (an iterable's pass)."""
        self.claims.count(claims.COMPUTED, n)

    def first_to_say(self, kind: str, notice: str) -> bool:
        """Whether this process is the first of its job to say ``notice``, of ``kind`` (a key of
        root.NOTICE_WORDS), about this cache, marking it said: a warning said once per job, not
        once per process."""
        return self.writer.admission.first_to_say(NOTICE_WORDS[kind], notice)

    def portable_records(self):
        """Every item of the current generation as ``(portable key, portable record)``, lock-free
        (portable.records, which says what a damaged or cleared one gives)."""
        return portable.records(self.view)

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

    def stats(self) -> dict:
        return stats.cache_stats(self)

    def __len__(self) -> int:
        return len(self.view)

    def shm_bytes(self) -> int:
        """Bytes of /dev/shm that this cache's segments really occupy (allocated pages)."""
        return self.ns.occupied_bytes(self.view.base + SEP)

    def clear(self) -> None:
        """Drop every item: a new generation in new segments; old mappings stay valid for readers."""
        with self.locked():
            gen = self.view.refresh()
            self.writer.create_generation(self.view.root, gen.gen + 1, self.capacity_bytes, gen.index.capacity)
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
            unlink_segments(self.ns, self.view.segment_name(f"g{gen.gen}", ""))
            self.view.refresh()
        codec.clear_decoders()  # the old generation's layouts are gone: free their decoders

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()
            self.spill = None
        self.view.close()
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
            self.view.root.words[RootLayout.EPOCH >> 3] = DESTROYED
            ordering.fence()  # retired for every reader before its spill files and name are reused
            self.meta_path.unlink(missing_ok=True)
            # its claims and counts go with it: a cache made again counts from zero
            self.registry.drop_cache_files(self.session, self.name)
            unlink_segments(self.ns, self.view.base + SEP)  # the root first: the cache is gone at once
            if self.spill is not None:
                self.spill.destroy()
            elif spill_path:
                shutil.rmtree(spill_path, ignore_errors=True)
        self.close()

    # --- the two sides' calls (the hot ones are bound to them in __init__ as well) ---------------

    @property
    def spill(self) -> IndexedTier | None:
        """Where records go when memory is full (``spill_to``), and spilled ones are read from."""
        return self.view.spill

    @spill.setter
    def spill(self, tier: IndexedTier | None) -> None:
        self.view.spill = tier

    @property
    def claim_timeout_s(self) -> float:
        """How long a miss waits on another process's claim (NOTE [claims]); 0.0 with claims off."""
        return self.claims.timeout_s if self.claims.on else 0.0

    @property
    def incarnation(self) -> int:
        """The root's incarnation (module docstring): tells this cache from one made again."""
        return self.view.incarnation

    def locked(self) -> AbstractContextManager[None]:
        """Hold the cache's lock (CacheWriter.locked: CacheNotFound if it was destroyed)."""
        return self.writer.locked()

    def lookup(self, key: Any, copy: bool = True, count: bool = True) -> Any:
        """The cached value of ``key``, or ``MISSING`` (CacheView.lookup)."""
        return self.view.lookup(key, copy, count)

    def lookup_batch(self, keys: Sequence, copy: bool = True, count: bool = True) -> tuple[list, list[int]]:
        """Values for ``keys`` (MISSING where absent) and the positions of the misses."""
        return self.view.lookup_batch(keys, copy, count)

    def contains(self, key: Any) -> bool:
        return self.view.contains(key)

    def is_current(self, gen: int) -> bool:
        """Generation ``gen`` is still the cache's (CacheView.is_current)."""
        return self.view.is_current(gen)

    def count_misses(self, n: int = 1) -> None:
        """Count ``n`` items computed from the source without a lookup (warm-up) as misses."""
        self.view.count_misses(n)

    def batch_layout(self, keys: np.ndarray) -> tuple | None:
        return self.view.batch_layout(keys)

    def absent_ints(self, keys: np.ndarray) -> np.ndarray:
        return self.view.absent_ints(keys)

    def all_in_memory(self, keys: np.ndarray) -> bool:
        return self.view.all_in_memory(keys)

    def gather_ints(self, keys: np.ndarray, out: list | None = None):
        """Vectorised batch of int keys of one layout and size class, all in memory (CacheView)."""
        return self.view.gather_ints(keys, out)

    out_matches = staticmethod(gather.out_matches)

    def put(self, key: Any, value: Any, *, encoded: codec.Encoded | None = None) -> bool:
        """Store ``value`` under ``key`` unless present (CacheWriter.put)."""
        return self.writer.put(key, value, encoded=encoded)

    def put_many(self, items: Sequence[tuple[Any, codec.Encoded]], *,
                 too_large: list | None = None) -> list[bool]:
        """``put`` of many (key, encoded value) pairs under one hold of the lock (CacheWriter)."""
        return self.writer.put_many(items, too_large=too_large)

    def put_records(self, items: Sequence[tuple[Any, Any]]) -> list[bool]:
        """``put`` of (key, portable record) pairs without decoding them (CacheWriter)."""
        return self.writer.put_records(items)


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
        self.claim_timeout_s = 0.0  # nothing shared: nothing to wait for
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

    def first_to_say(self, kind: str, notice: str) -> bool:
        return True  # nothing shared: each process says it

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

    def reserve_entries(self, n: int) -> None:
        """No index to size."""

    def stats(self) -> dict:
        return stats.uncached_stats(self.session, self.name, self._counters, self._computed)

    def __len__(self) -> int:
        return 0

    def clear(self) -> None:
        """Nothing to drop."""

    def close(self) -> None:
        """Nothing to release."""


def _table_capacity(hint: int, capacity_bytes: int) -> int:
    """Entries of an index sized up front for ``hint`` items: no more than take half the cap (all
    of a dataset's items, spilled ones too, where that fits; a len() past it would make an index
    of the whole cap, or of all of /dev/shm, and leave no room for data: it grows as it fills)."""
    want = max(MIN_TABLE, int(hint / MAX_LOAD) + 1)
    entries = 1 << (want - 1).bit_length()
    while entries > MIN_TABLE and TableView.bytes_for(entries) > capacity_bytes // 2:
        entries //= 2
    return entries
