"""The write side of a cache: its lock, and every write under it (NOTE [publish order]).

A ``CacheWriter`` holds the cache's lock file (NOTE [lock files]) while it allocates, copies and
publishes: ``put`` one record at a time (one fence per record), ``put_many``/``put_records`` a
publish group at a time (publish_group.PublishGroup: two fences per group of up to GROUP_RECORDS
records); the allocation and admission (admission.Admission: is there room), a record memory
refuses to the spill tier, a table grown when it is full, a new generation made (``clear``,
``gc``'s drop, the first one of a new cache). Before each write it repairs what a dead writer
left (``repair``: repair.repair_intent). A put that cannot get the lock within its timeout
serves its value uncached (``write_locked``).

It reads the cache through its ``CacheView``: the same checked mappings the readers use.
"""

from __future__ import annotations

import contextlib
import logging
import struct
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from ..base import ordering
from ..base.faults import ARMED as _CRASH_TESTS
from ..base.faults import crash_point
from ..base.locks import FlockLock
from ..base.shm import PAGE, WORD, Segment
from ..errors import CorruptSegment, InvalidArgument, ItemTooLarge, LockTimeout, SharedMemoryFull
from . import codec, repair
from .admission import Admission, NoRoom
from .allocator import DATA_OFF, size_class
from .generation import (
    KIND_DATA,
    KIND_META,
    KIND_TABLE,
    REJECTED,
    SPILL_CLASS,
    Generation,
    Intent,
    MetaLayout,
    RootLayout,
    epoch_of,
)
from .index import (
    INLINE24,
    INT_KEY,
    MAX_LOAD,
    MAX_RECORD,
    READY,
    SPILLED,
    TableView,
    key_bytes,
    location_word,
    state_word,
    tier_key,
)
from .publish_group import GROUP_RECORDS, PublishGroup
from .registry import unlink_segments
from .view import CacheView

__all__ = ["CacheWriter", "encoded_from_portable"]

log = logging.getLogger("shmcache")

_STUCK_COOLDOWN_S = 30.0  # puts stop waiting for a lock that a live process keeps (write_locked)
_SAY_WAIT_S = 1.0  # a put waiting this long for the lock (a write under it takes ms) says why (issue 30)
_MIN_RECORD = codec.RECORD_HEADER.size


class CacheWriter:
    """The write side of one cache in this process (see the module docstring). ``admission`` is
    set by the store once the root is open (it reads the cap from the root)."""

    admission: Admission  # is there room (NOTE [memory limits]); set once the root is open

    def __init__(self, view: CacheView, lock: FlockLock):
        self.view = view
        self.lock = lock
        self._lock_reopened = lock.reopened
        self._lock_stuck_until = 0.0  # puts try the lock without waiting until then (write_locked)
        self._lock_stuck_logged = False

    def trust_lock(self) -> None:
        """The lock file as it is now is this cache's (the store opened the cache under it): a
        later reopen of the file (the session destroyed and made again) is checked on ``locked``."""
        self._lock_reopened = self.lock.reopened

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the cache's lock, and make sure it is still the lock of the cache this handle
        opened: a lock file found replaced means the session was destroyed (and maybe made again)."""
        self._acquire(None)
        try:
            yield
        finally:
            self.lock.release()

    @contextlib.contextmanager
    def write_locked(self) -> Iterator[bool]:
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
                            "and writes stop waiting for it until it is free", self.view.session, self.view.name, exc)
            yield False
            return
        if self._lock_stuck_logged:
            self._lock_stuck_logged, self._lock_stuck_until = False, 0.0
            log.info("cache %s/%s: its lock is free again; new values are cached", self.view.session, self.view.name)
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
                    "serves new values uncached", self.view.session, self.view.name, self.lock.path, _SAY_WAIT_S,
                    self.lock.path, full)
        self._acquire(full - _SAY_WAIT_S)

    def _acquire(self, timeout_s: float | None) -> None:
        """Take the lock for ``locked()``: CacheNotFound if this handle's cache was destroyed."""
        try:
            self.lock.acquire(timeout_s)
        except FileNotFoundError:  # the session's directory is gone: only a destroy removes it
            raise self.view.destroyed() from None
        try:
            if self.lock.reopened != self._lock_reopened:
                stale = self.view.destroyed_under_us()
                if stale is not None:
                    raise stale
                self._lock_reopened = self.lock.reopened
            if self.view.tombstoned():
                raise self.view.destroyed()  # its root was tombstoned: this cache is gone
        except BaseException:
            self.lock.release()
            raise

    def _check_not_overtaken(self) -> None:
        """After a write, under the lock: CacheNotFound if a destroy tombstoned the root meanwhile
        (a forced one goes on without a lock whose holder is busy). The write went nowhere the
        cache made since can see (NOTE [publish order], Destroying); what it made under this
        incarnation's names (a data segment) is debris, removed."""
        if self.view.tombstoned():
            unlink_segments(self.view.ns, self.view.segment_name(""))
            raise self.view.destroyed()

    def create_generation(self, root: Segment, gen: int, capacity: int, cap: int) -> None:
        """Make the meta and table (``cap`` entries) of ``gen`` and publish it (caller holds the
        lock). Leftovers of an attempt whose process died are removed first."""
        unlink_segments(self.view.ns, self.view.segment_name(f"g{gen}", ""))
        meta = Segment.create(self.view.segment_name(f"g{gen}", "meta"), MetaLayout.SIZE, kind=KIND_META,
                              commit=MetaLayout.SIZE)
        table = Segment.create(self.view.segment_name(f"g{gen}", "t1"), TableView.bytes_for(cap),
                               kind=KIND_TABLE, commit=TableView.bytes_for(cap))
        TableView.init(table.buf, cap)
        meta.words[MetaLayout.CAPACITY >> 3] = capacity
        meta.words[MetaLayout.COMMITTED >> 3] = MetaLayout.SIZE + TableView.bytes_for(cap)
        meta.close()
        table.close()
        ordering.fence()  # the root's words, the meta and the table before the epoch word names them
        root.words[RootLayout.EPOCH >> 3] = epoch_of(gen, 1)  # the epoch word: published last, one store

    def put(self, key: Any, value: Any, *, encoded: codec.Encoded | None = None) -> bool:
        """Store ``value`` under ``key`` unless present. False if it was not admitted: the cache is
        full, or a live process keeps its lock beyond the lock timeout (see write_locked)."""
        enc = encoded or codec.encode(value, f"the value of key {key!r}")
        w1, kb = key_bytes(key)
        with self.write_locked() as locked:
            if not locked:  # a live process keeps the lock: the caller serves the value uncached
                self.view.count(REJECTED)
                return False
            if _CRASH_TESTS:
                crash_point("locked")
            gen = self.view.refresh()
            self.repair(gen)
            stored = self.put_locked(gen, key, w1, kb, enc)
            self._check_not_overtaken()
            return stored

    def put_locked(self, gen: Generation, key: Any, w1: int, kb: bytes, enc: codec.Encoded,
                    group: PublishGroup | None = None) -> bool:
        """The body of ``put`` (and of each item of ``put_records``, with its ``group``: PublishGroup);
        the caller holds the lock."""
        w0, w2, pos, _, _ = self.view.find(gen, key)
        if group is not None and not w0 and pos in group:  # the group took that entry
            pos = group.probe(gen.index, pos, w1, kb)
            if pos < 0:
                return True  # twice in this put_records: stored once
        if w0 and w0 & SPILLED and self.view.spill is not None and self.view.read_spilled(w0, w2, w1, kb) is None:
            if group is not None:
                group.flush()  # one intent record in use at a time
            return self._spill(gen, pos, w1, kb, enc, replace=True)  # a corrupt record
        if w0:
            return True  # another process stored it first: stored once
        if group is not None and WORD.unpack_from(gen.meta.buf, MetaLayout.TABLE_ITEMS)[0] + len(group) + 1 > \
                MAX_LOAD * gen.index.capacity:
            group.flush()  # a table growth copies READY entries only
        if WORD.unpack_from(gen.meta.buf, MetaLayout.TABLE_ITEMS)[0] + 1 > MAX_LOAD * gen.index.capacity:
            try:
                gen = self._grow_table(gen)
            except NoRoom:  # the index cannot grow: nothing more is admitted, not even to disk
                self.view.count(REJECTED)
                return False
            w0, _, pos, _, _ = self.view.find(gen, key)
        try:
            self._insert(gen, pos, w1, kb, enc, group)
            return True
        except FileNotFoundError:  # a data segment our meta names is gone: not by clear(), we lock
            raise self.view.destroyed_under_us() or CorruptSegment(
                f"cache {self.view.session}/{self.view.name} lost a data segment; run `shmcache gc`") from None
        except ItemTooLarge:
            if self.view.spill is None:  # counted as every overflow is; the caller decides what to say
                self.view.count(REJECTED)  # (a dataset serves it from the source, said once)
                raise
            # it can never fit in memory, but a spill file takes any size: spill it below
        except NoRoom:
            pass
        if group is not None and self.view.spill is not None:
            group.flush()  # one intent record in use at a time
        if self._spill(gen, pos, w1, kb, enc):
            return True
        self.view.count(REJECTED)
        return False

    def put_records(self, items: Sequence[tuple[Any, Any]]) -> list[bool]:
        """``put`` of (key, portable record) pairs (the codec record with its layout inline,
        TieredStore) without decoding them: their bytes go straight into shared memory (or a spill
        file), one copy each, under one hold of the lock (an import stores thousands: the lock,
        refresh and repair check once per batch), published a group at a time (PublishGroup: two
        fences per group of records, not one per record). InvalidArgument for bytes that are not a
        portable record, before anything is stored."""
        return self.put_many([(key, encoded_from_portable(rec, key, self.view)) for key, rec in items])

    def put_many(self, items: Sequence[tuple[Any, codec.Encoded]], *,
                 too_large: list | None = None) -> list[bool]:
        """``put`` of many (key, encoded value) pairs under one hold of the lock, published a
        group at a time (PublishGroup): a batch's or a warm-up's computed misses, a batch's tier hits,
        an import. A value that can never fit (ItemTooLarge, no spill) is False, counted as
        rejected, and its error appended to ``too_large`` when given (else raised, as ``put``)."""
        with self.write_locked() as locked:
            if not locked:  # a live process keeps the lock: the caller serves the values uncached
                self.view.count(REJECTED, len(items))
                return [False] * len(items)
            self.repair(self.view.refresh())
            out: list = [None] * len(items)
            group = PublishGroup()
            last_run = None
            try:
                for run in _runs(items):  # int keys, one size class: a run at a time
                    try:
                        last_run = self._put_run(self.view.refresh(), items, run, group, out) or last_run
                    except FileNotFoundError:  # a data segment our meta names is gone (as put_locked)
                        raise self.view.destroyed_under_us() or CorruptSegment(
                            f"cache {self.view.session}/{self.view.name} lost a data segment; run "
                            f"`shmcache gc`") from None
                for i, (key, enc) in enumerate(items):
                    if out[i] is not None:
                        continue
                    w1, kb = key_bytes(key)
                    try:
                        out[i] = self.put_locked(self.view.refresh(), key, w1, kb, enc, group)  # a grown table
                    except ItemTooLarge as exc:  # counted by put_locked; nothing of it was staged
                        if too_large is None:
                            raise
                        too_large.append(exc)
                        out[i] = False
                group.flush()
            except BaseException:
                group.abandon(self.view.corrupt)  # undone before its fence, finished after
                raise
            self._check_not_overtaken()
            if last_run is not None:  # the next batch's run backed while it is computed
                self.admission.commit_ahead(*last_run, self.view.spill)
            return out

    def _put_run(self, gen: Generation, items: Sequence[tuple[Any, codec.Encoded]], run: list[int],
                 group: PublishGroup, out: list) -> tuple | None:
        """Put ``items[i]`` for ``i`` in ``run`` (int keys, records of one size class) as runs of a
        publish group (NOTE [publish order], "A publish group": the same intent, stores and fences
        as one record at a time, written over the run with numpy): the table positions by one
        vectorised probe, the chunks by one bump of the class, the pages by one commit, the bytes
        by one pwrite (Segment.write_at: no page fault per page), each record from its own
        shape's offsets (``_RunShape``). The items it sets ``out[i] = True`` for are stored; the
        rest go one at a time (put_locked): a key present or whose home entry is taken, a full
        table, no room (spill or reject), a layout that does not fit the meta segment. Returns
        ``(gen, cls, seg, chunk_size, chunks)`` of the run's class once all of it went as runs
        (for ``Admission.commit_ahead``), else None."""
        shapes: dict = {}
        of: list = []  # each record's _RunShape
        for i in run:
            enc = items[i][1]
            key = (enc.layout, enc.body_len, len(enc.scalars), len(enc.pieces))
            shape = shapes.get(key)
            if shape is None:
                shape = shapes[key] = _RunShape(enc, self._intern_layout(gen, enc.layout))
            of.append(shape)
        if any(shape.lid == INLINE24 for shape in shapes.values()):  # the meta segment's layouts are full
            run, of = [i for i, sh in zip(run, of) if sh.lid != INLINE24], [sh for sh in of if sh.lid != INLINE24]
            if len(run) < _RUN_MIN:
                return
        try:
            keys = np.array([int(items[i][0]) for i in run], np.int64)
        except OverflowError:  # a key past 64 bits: put_locked says so
            return
        nbytes = [shape.nbytes for shape in of]
        cls, chunk_size = size_class(max(nbytes))  # one class: _runs
        try:
            self.admission.check_fits(max(nbytes), chunk_size, gen.index.capacity)
        except (ItemTooLarge, NoRoom):
            return
        index = gen.index
        w1 = keys.view(np.uint64)
        home, picked = _probe_run(index, w1, group)
        try:
            seg = self._class_segment(gen, cls, chunk_size)
        except NoRoom:  # /dev/shm cannot take the class's segment: spill or reject one at a time
            return
        self.view.recheck_class(gen, cls, gen.data[cls])  # a damaged class record must not place a record
        for shape in shapes.values():
            shape.fill(chunk_size)
        lo = 0
        while lo < len(picked):  # the group's room at a time: groups of GROUP_RECORDS, as one by one
            if len(group) >= GROUP_RECORDS:
                group.flush()
            part = picked[lo:lo + GROUP_RECORDS - len(group)]
            lo += len(part)
            n = len(part)
            if gen.table_items() + len(group) + n > MAX_LOAD * index.capacity:
                group.flush()  # a table growth copies READY entries only
                try:
                    gen = self._grow_table(gen)
                except NoRoom:  # the index cannot grow: put_locked rejects them one at a time
                    return
                # the rest in the grown table (its homes differ): a growth doubles it, so this
                # recursion is as deep as the table can double
                return self._put_run(gen, items, [i for i in run if out[i] is None], group, out)
            _, bump, committed = gen.classes.get(cls)
            bump = group.next_chunk(cls, bump)
            try:
                while bump + n > committed:  # a group's commits are fenced with the group
                    committed = self.admission.commit(gen, cls, seg, chunk_size, committed, self.view.spill,
                                                      fence=False, chunks=bump + n - committed)
            except NoRoom:
                return
            ks = part.tolist()
            part_bytes = sum(nbytes[k] for k in ks)
            items_, total, _ = gen.mem_totals()
            table_items = gen.table_items() + len(group) + n
            if items_ + len(group) + n > index.capacity or table_items >= index.capacity or \
                    (total + group.bytes + part_bytes) >> 63:
                raise self.view.corrupt(f"the counters in {gen.meta.name} are impossible ({items_} items and "
                                        f"{total} bytes in memory, {table_items - n - len(group)} entries, in a "
                                        f"table of {index.capacity})", fix="it recounts them")
            pos = home[part]
            w0 = [of[k].w0 for k in ks]
            group.allocate_run(gen, pos, w1[part], cls, bump, w0, part_bytes)  # in the group's intent (undo: forget it)
            if _CRASH_TESTS:
                crash_point("run_allocated")
            # each record's bytes where enc.write would put them, the gaps and the chunk's tail
            # zeros (as a chunk committed and never written), for one pwritev from the pieces
            vecs: list = []
            starts: list = []
            for k in ks:
                starts.append(len(vecs))
                of[k].vecs(items[run[k]][1], vecs)
            start = DATA_OFF + bump * chunk_size
            if _CRASH_TESTS:  # die with half of the run's records written
                half = starts[n // 2]
                seg.write_at(start, vecs[:half])
                crash_point("run_mid_copy")
                seg.write_at(start + (n // 2) * chunk_size, vecs[half:])
            else:
                seg.write_at(start, vecs)
            index.stage_many(pos, w1[part], np.uint64(cls << 48) + np.arange(bump, bump + n, dtype=np.uint64))
            if _CRASH_TESTS:
                crash_point("run_copied")
            for k in ks:
                out[run[k]] = True
            if len(group) >= GROUP_RECORDS:
                group.flush()
        return (gen, cls, seg, chunk_size, len(run))

    def _insert(self, gen: Generation, pos: int, w1: int, kb: bytes, enc: codec.Encoded,
                group: PublishGroup | None = None) -> None:
        """Allocate, copy and publish a record at EMPTY entry ``pos`` (NOTE [publish order]); with
        a ``group`` (put_records), allocate and copy it and stage its entry: the group publishes."""
        lid = self._intern_layout(gen, enc.layout)
        nbytes = enc.record_len(len(kb), lid == INLINE24)
        cls, chunk_size = size_class(nbytes)
        self.admission.check_fits(nbytes, chunk_size, gen.index.capacity)  # ItemTooLarge, NoRoom
        seg = self._class_segment(gen, cls, chunk_size)
        self.view.recheck_class(gen, cls, gen.data[cls])  # a damaged class record must not place this record
        chunk_size_, bump, committed = gen.classes.get(cls)
        if group is not None:  # the group's bumps move when it is published
            bump = group.next_chunk(cls, bump)
        if bump >= committed:  # a group's commits are fenced with the group (PublishGroup)
            committed = self.admission.commit(gen, cls, seg, chunk_size, committed, self.view.spill,
                                              fence=group is None)
        items, total, _ = gen.mem_totals()
        items, total, table_items = items + 1, total + nbytes, gen.table_items()
        if group is not None:
            items, total, table_items = items + len(group), total + group.bytes, table_items + len(group)
        if items > gen.index.capacity or table_items >= gen.index.capacity or total >> 63:
            raise self.view.corrupt(f"the counters in {gen.meta.name} are impossible ({items - 1} items and "
                                f"{total - nbytes} bytes in memory, {table_items} entries, in a "
                                f"table of {gen.index.capacity})", fix="it recounts them")
        w0 = state_word(READY | (0 if kb else INT_KEY), lid, nbytes)
        if group is not None:
            group.allocate(gen, pos, w1, kb, cls, bump, w0)  # in the group's intent (undo: forget it)
        else:
            intent = Intent(1, pos, cls, bump, items, total, 0, table_items + 1)
            gen.begin(intent)  # phase 1: allocating (undo restores the bump)
            gen.classes.set_bump(cls, bump + 1)
        if _CRASH_TESTS:
            crash_point("allocated")
        start = DATA_OFF + bump * chunk_size
        if _CRASH_TESTS:  # die with half of the record written
            with memoryview(seg.buf) as mv:
                mv[start:start + nbytes // 2] = b"\xee" * (nbytes // 2)
            crash_point("mid_copy")
        layout_id = lid if lid != INLINE24 else codec.INLINE
        if nbytes >= PWRITE_MIN_BYTES and seg.base_pages:  # one pwritev: no page fault on each page
            seg.write_at(start, enc.buffers(layout_id, kb))
        else:  # a few pages (opening the segment again to pwrite them costs more than their
            # faults), or huge ones (one fault each: the pwritev costs more than it saves)
            with memoryview(seg.buf) as mv:
                enc.write(mv[start:start + nbytes], layout_id, kb)
        if group is not None:
            gen.index.stage(pos, w1, location_word(cls, bump))
            if _CRASH_TESTS:
                crash_point("group_copied")
            if len(group) >= GROUP_RECORDS:
                group.flush()
            return
        if _CRASH_TESTS:
            crash_point("before_publish")
        gen.index.publish(pos, w0, w1, location_word(cls, bump))
        gen.published()  # phase 2: published (redo the totals)
        if _CRASH_TESTS:
            crash_point("after_publish")
        gen.apply_totals(intent)
        gen.end()

    def repair(self, gen: Generation) -> int:
        """Undo or finish the last writer's work if it died mid-way (repair.repair_intent)."""
        return repair.repair_intent(self.view, gen)

    def _intern_layout(self, gen: Generation, layout: bytes) -> int:
        cache = gen.layouts
        for lid, (raw, *_) in cache.items():
            if raw == layout:
                return lid
        n = WORD.unpack_from(gen.meta.buf, MetaLayout.N_LAYOUTS)[0]
        if n > MetaLayout.MAX_LAYOUTS:
            raise self.view.corrupt(f"{gen.meta.name} counts {n} layouts, more than its {MetaLayout.MAX_LAYOUTS} slots")
        for lid in range(n):
            if self.view.layout(gen, lid)[0] == layout:
                return lid
        if n >= MetaLayout.MAX_LAYOUTS or len(layout) > MetaLayout.LAYOUT_BYTES - 4:
            return INLINE24
        off = MetaLayout.LAYOUTS + n * MetaLayout.LAYOUT_BYTES
        struct.pack_into("I", gen.meta.buf, off, len(layout))
        gen.meta.buf[off + 4:off + 4 + len(layout)] = layout
        gen.meta.words[MetaLayout.N_LAYOUTS >> 3] = n + 1  # after the bytes: readers never see it half-made
        return n

    def _class_segment(self, gen: Generation, cls: int, chunk_size: int) -> Segment:
        if gen.classes.chunk_size(cls):
            return self.view.class_data(gen, cls)[0]
        name = self.view.segment_name(f"g{gen.gen}", f"c{cls}")
        self.view.ns.unlink_segment(name)  # debris of a writer that died before registering the class
        try:
            virtual = self.admission.data_segment_bytes()
            seg = Segment.create(name, DATA_OFF + virtual + chunk_size, kind=KIND_DATA, commit=PAGE)
        except SharedMemoryFull as exc:
            self.admission.log_shm_full(exc, self.view.spill)
            raise NoRoom from None
        gen.classes.create(cls, chunk_size)
        gen.data[cls] = (seg, memoryview(seg.buf).toreadonly(), chunk_size, 0)
        return seg

    def grow_table_to(self, capacity: int) -> None:
        """Grow the index until it has ``capacity`` entries (caller holds the lock): as far as
        memory has room (NoRoom stops it: the table grows as it fills then)."""
        gen = self.view.refresh()
        self.repair(gen)
        try:
            for _ in range(64):  # bounded: each growth doubles it
                if gen.index.capacity >= capacity:
                    return
                gen = self._grow_table(gen)
        except NoRoom:
            return

    def _grow_table(self, gen: Generation) -> Generation:
        """Rebuild the table at twice the size as a new version (caller holds the lock)."""
        cap = gen.index.capacity * 2
        version = gen.version + 1
        name = self.view.segment_name(f"g{gen.gen}", f"t{version}")
        self.view.ns.unlink_segment(name)
        size = TableView.bytes_for(cap)
        try:
            table = Segment.create(name, size, kind=KIND_TABLE, commit=size)
        except SharedMemoryFull as exc:
            self.admission.log_shm_full(exc, self.view.spill)
            raise NoRoom from None
        TableView.init(table.buf, cap)
        _rehash(gen.index, TableView(table.buf))
        table.close()
        old = gen.table
        if _CRASH_TESTS:
            crash_point("table_built")
        ordering.fence()  # every entry of the new table before the epoch word names it
        self.view.root.words[RootLayout.EPOCH >> 3] = epoch_of(gen.gen, version)  # publish: one store
        old.unlink()
        gen = self.view.refresh()
        repair.recount_committed(gen)
        return gen

    def _spill(self, gen: Generation, pos: int, w1: int, kb: bytes, enc: codec.Encoded, *,
               replace: bool = False) -> bool:
        """Write the record to the spill tier and publish where it went at table position ``pos``
        (caller holds the lock): the same intent protocol as a record in memory (NOTE [publish
        order]). ``replace``: the entry there is a spilled record found corrupt, rewritten in
        place. False if the tier did not take it."""
        tier = self.view.spill
        if tier is None or not tier.accepting:
            return False
        lid = self._intern_layout(gen, enc.layout)
        record = bytearray(enc.record_len(len(kb), lid == INLINE24))
        enc.write(memoryview(record), codec.INLINE if lid == INLINE24 else lid, kb)
        loc = tier.write(tier_key(w1, kb), record)
        if loc is None or loc.stored > MAX_RECORD:  # the entry's length field has 32 bits
            return False
        if _CRASH_TESTS:
            crash_point("spilled")  # record on disk, not yet in the index
        items, total, raw = gen.disk_totals()
        new = 0 if replace else 1  # a replaced corrupt record is still one item
        intent = Intent(1, pos, SPILL_CLASS, 0, items + new, total + loc.stored, raw + loc.raw,
                        gen.table_items() + new)
        gen.begin(intent)
        gen.index.publish(pos, state_word(READY | SPILLED | (0 if kb else INT_KEY), lid, loc.stored), w1, loc.word)
        gen.published()
        gen.apply_totals(intent)
        gen.end()
        return True


def encoded_from_portable(record: Any, key: Any, cache: CacheView) -> codec.Encoded:
    """A portable record as what a put writes: its body and its layout, views of ``record``
    (``cache``: the cache it is for, named in the error for bytes that are not one)."""
    view = memoryview(record).cast("B")
    lid, key_len, lay_len, _ = codec.RECORD_HEADER.unpack_from(view, 0) if len(view) >= _MIN_RECORD \
        else (0, 0, 0, 0)
    body = len(view) - key_len - lay_len
    if lid != codec.INLINE or not _MIN_RECORD <= body < body + lay_len:
        raise InvalidArgument(f"the record for key {key!r} in cache {cache.session}/{cache.name} is not "
                              f"a portable record (layout id {lid:#x}, {len(view)} bytes); pass "
                              f"shmcache.tiers.tiered_store.portable_record(...) bytes")
    return codec.Encoded(bytes(view[body:body + lay_len]), body, view[_MIN_RECORD:body], [])


class _RunShape:
    """What the records of one shape in a run share (one layout, length and form: the same
    offsets): the layout id, state word and length, and - once the run's chunk size is known
    (``fill``) - the header, the zeros before each piece and the chunk's tail zeros."""

    __slots__ = ("lid", "nbytes", "w0", "head", "gaps", "tail", "_first")

    def __init__(self, enc: codec.Encoded, lid: int):
        self.lid = lid
        self.nbytes = enc.record_len(0, False)
        self.w0 = state_word(READY | INT_KEY, lid, self.nbytes) if lid != INLINE24 else 0
        self.head = b""
        self.gaps: list = []
        self.tail = memoryview(b"")
        self._first: codec.Encoded | None = enc

    def fill(self, chunk_size: int) -> None:
        """The header and zeros of a record in a chunk of ``chunk_size`` (the run's class)."""
        self.head = codec.RECORD_HEADER.pack(self.lid, 0, 0, 0)
        self.gaps, self.tail = _gaps(self._first, chunk_size)
        self._first = None

    def vecs(self, enc: codec.Encoded, out: list) -> None:
        """``enc``'s record, as its chunk's bytes one after the other, appended to ``out``."""
        if len(enc.scalars) <= _JOIN_SCALARS:  # a few numbers: joined costs less than a buffer more
            out.append(self.head + enc.scalars)
        else:  # a portable record's whole body (writer.encoded_from_portable): pwritten as it is
            out.append(self.head)
            out.append(enc.scalars)
        for gap, (_, piece) in zip(self.gaps, enc.pieces):
            out.append(gap)
            out.append(piece)
        out.append(self.tail)


def _gaps(enc: codec.Encoded, chunk_size: int) -> tuple[list, memoryview]:
    """The zeros of a run's records (one layout: the same offsets in each): before each piece
    (after the header and scalars, or the piece before it), and from the end of the last to the
    end of the chunk."""
    zeros = memoryview(bytes(chunk_size))
    end, gaps = codec.RECORD_HEADER.size + len(enc.scalars), []
    for off, piece in enc.pieces:
        gaps.append(zeros[:off - end])
        end = off + memoryview(piece).nbytes
    return gaps, zeros[:chunk_size - end]


def _probe_run(index: TableView, w1: np.ndarray, group: PublishGroup) -> tuple[np.ndarray, np.ndarray]:
    """``(positions, picked)``: the EMPTY entry each int key word of ``w1`` goes to, as
    put_locked's probe would find it one key at a time (find, then PublishGroup.probe), for the
    keys ``picked``; all of them at once, a step along the probe paths per loop. The others go
    one at a time: a key met earlier in ``w1`` or held by the group, one found in the table (present, or spilled: a
    corrupt one is rewritten by put_locked), one not placed within _RUN_PROBES entries. An entry
    the group or an earlier key of the run took is passed as a taken one (a key READY past an
    EMPTY entry is never this key: probes stop at EMPTY, and entries are never emptied)."""
    words, mask = index.words, np.uint64(index.mask)
    n = len(w1)
    pos = index.homes(w1)
    taken = np.fromiter(group.positions, np.uint64, len(group))  # at most GROUP_RECORDS
    # a key the group holds already (another run of this call) goes one at a time: stored once
    held = np.fromiter((k for k, kb in group.positions.values() if not kb), np.uint64)
    again = (w1[:, None] == held[None, :]).any(axis=1)
    if not again.any() and not words[pos, 0].any() and not (pos[:, None] == taken[None, :]).any():
        by_pos = np.sort(pos)
        if not (by_pos[1:] == by_pos[:-1]).any():  # each key at its own EMPTY home: all placed
            return pos, np.arange(n)
    _, first = np.unique(w1, return_index=True)
    todo = np.sort(first[~again[first]])  # each key once, in the run's order
    out = np.zeros(n, bool)
    want = np.uint64(READY | INT_KEY)
    for _ in range(_RUN_PROBES):  # the keys still on their way after these go one at a time
        if not len(todo):
            break
        p = pos[todo]
        s0 = words[p, 0]
        found = ((s0 & want) == want) & (words[p, 1] == w1[todo])
        free = (s0 == 0) & ~np.isin(p, taken)  # by sorting: no len(p) x len(taken) table of bools
        if free.any():  # the first key at each free entry takes it; the others go on
            _, at = np.unique(p[free], return_index=True)
            claim = np.zeros(len(todo), bool)
            claim[np.flatnonzero(free)[at]] = True
            out[todo[claim]] = True
            taken = np.concatenate([taken, p[claim]])
        else:
            claim = free
        go_on = ~claim & ~found
        todo = todo[go_on]
        pos[todo] = (pos[todo] + np.uint64(1)) & mask
    return pos, np.flatnonzero(out)


# A record put on its own (_insert) this large is copied in with one pwritev (Segment.write_at);
# a smaller one through the mapping, and any on a huge-page mount (Segment.base_pages: one fault
# a huge page there). A put of one item, pwritev / mapping (benchmarks/bench_put_one.py, results/
# put_one.md): /dev/shm 1.31x at 4 KiB (pwritev opens the segment by name each time), equal at
# 24 KiB, 0.88x at 48 KiB, 0.72x at 150 KB, 0.65x at 1 MiB; a huge=within_size tmpfs 1.2x at
# 48 KiB, 1.06-1.17x at 150 KB, 0.91-1.01x at 1 MiB.
PWRITE_MIN_BYTES = 32 << 10
_RUN_MIN = 8  # records of one size class that go as a run (fewer: one at a time)
_JOIN_SCALARS = 256  # a run's record header and scalars this short go as one buffer (_RunShape.vecs)
_RUN_PROBES = 4  # steps along the probe paths taken with numpy (a probe takes ~1.5 at 70% load)


def _runs(items: Sequence[tuple[Any, codec.Encoded]]) -> list[list[int]]:
    """The positions in ``items`` of each run: at least _RUN_MIN int keys whose records take one
    size class (a batch of one dataset's samples, mostly: their layouts may differ, as a str
    field's length does), each key's first item only."""
    if len(items) < _RUN_MIN:
        return []
    by: dict = {}
    seen: set = set()  # a key's first item only: runs go first, and its first value is the one stored
    for i, (key, enc) in enumerate(items):
        if type(key) is int or isinstance(key, np.integer):  # (a bool is no int key here)
            k = int(key)
            if k not in seen:
                seen.add(k)
                # one shape: a layout, a length and one form (a portable record's body is its
                # scalars, a codec value's in pieces): the offsets _put_run writes each record from
                by.setdefault((enc.layout, enc.body_len, len(enc.scalars), len(enc.pieces)), []).append(i)
        elif type(key) not in (str, bytes) and not isinstance(key, bool):  # a 0-d int array or tensor
            try:
                seen.add(int(key))  # the int key it stands for (key_bytes), stored first
            except Exception:  # noqa: BLE001 - no int: put_locked says what the key is not
                pass
    by_class: dict = {}
    for (_, body_len, _, _), run in by.items():  # a record of an int key is its body (record_len)
        try:
            by_class.setdefault(size_class(body_len)[0], []).extend(run)
        except OverflowError:  # beyond the largest class: put_locked says so
            pass
    return [sorted(run) for run in by_class.values() if len(run) >= _RUN_MIN]


def _rehash(old: TableView, new: TableView) -> None:
    """Every READY entry of ``old`` into the empty, larger table ``new``, which no reader can reach
    yet (a growth: one fence before its epoch word covers all entries). Keys are unique, so each
    goes to the first EMPTY entry on its probe path; all at once, a step along the paths per
    loop: at each EMPTY entry the first key there takes it, the others go on. An entry taken stays
    taken, so no key has an EMPTY entry between its home and its place (what find relies on)."""
    words = old.words[(old.words[:, 0] & np.uint64(READY)) != 0]  # a copy: the live entries
    dst, mask = new.words, np.uint64(new.mask)
    pos = new.homes(words[:, 1])
    todo = np.arange(len(words))
    for _ in range(new.capacity):  # bounded: a loop places at least one key while any is left
        if not len(todo):
            return
        p = pos[todo]
        free = np.flatnonzero(dst[p, 0] == 0)
        _, first = np.unique(p[free], return_index=True)
        placed = todo[free[first]]
        dst[pos[placed], 1:] = words[placed, 1:]
        dst[pos[placed], 0] = words[placed, 0]
        left = np.ones(len(todo), bool)
        left[free[first]] = False
        todo = todo[left]
        pos[todo] = (pos[todo] + np.uint64(1)) & mask
    raise new.corrupt()


