"""The read side of a cache: this handle's mappings of it, and every lookup, without the lock.

A ``CacheView`` maps the root a ``CacheStore`` opened, the generation and table version its epoch
word names (``refresh``: again whenever that word changes), and each size class's data segment
and each layout on first use. Readers never lock (NOTE [publish order]): every entry is checked
before it is followed (a class in use, a chunk handed out, a length within the chunk, a layout the
meta segment holds: NOTE [publish order], Damage), and ``MISSING`` is what an absent key gives.

Its public methods below the lookups are the interface of the cache room's other modules: the writer
(writer.CacheWriter) finds entries and places records through ``find``, ``class_data``,
``recheck_class`` and ``layout``; repair and gc (``cache.repair``), the export walk
(``cache.portable``) and the statistics (``cache.stats``) read through ``refresh``, ``record``,
``read_spilled``; every one of them names damage with ``corrupt``. This process's counters (hits,
misses, rejected, corrupt: one row of the meta segment per live process, NOTE [lock files]) are
counted here, by ``count``.
"""

from __future__ import annotations

import functools
import logging
import pickle
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import numpy as np

from ..base.namespace import Namespace
from ..base.shm import WORD, Segment
from ..errors import CacheNotFound, CorruptSegment, InvalidArgument, LockTimeout, SessionNotFound, ShmcacheError
from . import codec, gather, hit, process_slot
from .allocator import DATA_OFF, MAX_CLASSES, ClassTable, size_class
from .generation import (
    CORRUPT,
    DEAD_GEN,
    DESTROYED,
    HITS,
    KIND_DATA,
    KIND_META,
    KIND_ROOT,
    KIND_TABLE,
    MISSES,
    Generation,
    MetaLayout,
    RootLayout,
    close_generation,
    destroyed_generation,
    split_epoch,
)
from .index import (
    ENTRY_BYTES,
    INLINE24,
    INT_KEY,
    LOCATION_MASK,
    READY,
    SPILLED,
    TABLE_OFF,
    TableView,
    entry_class,
    entry_layout,
    entry_length,
    key_bytes,
    key_from_bytes,
    state_word,
    tier_key,
)
from .indexed_tier import IndexedTier, RecordLocation
from .registry import SEP, SessionRegistry

__all__ = ["CacheView", "Found", "MISSING", "CORRUPT_RECORD", "UNDECODABLE", "key_repr"]

log = logging.getLogger("shmcache")

# The hot path's own global for base.shm.WORD (the same object): a hit through the imported name
# measured ~5% slower (benchmarks: a single ds[i], same sitting), through a name assigned here not.
_WORD = WORD
_QQ = struct.Struct("QQ")
_ABSENT, _LONG_WAY = hit.ABSENT, hit.LONG_WAY  # the compiled hit's other answers, as the hot path's globals
_KEY_LEN = struct.Struct("<I")  # the key length in a record header (codec.record_header, inlined)
_MIN_RECORD = codec.RECORD_HEADER.size
_M64 = (1 << 64) - 1  # an int key's word: the key, two's complement (index.key_bytes)
_PROBED_MIN = 8  # lookup_batch: a batch of this many int keys is probed vectorised first
# what decoding damaged bytes raises (marshal, struct, numpy, pickle, utf-8): CorruptSegment instead
UNDECODABLE = (ValueError, TypeError, OverflowError, IndexError, KeyError, EOFError, struct.error,
               RecursionError, pickle.UnpicklingError)


class Found(NamedTuple):
    """What ``CacheView.find`` found for a key (``cache.index`` has the entry's words)."""

    w0: int  # the state word: 0 when the key is absent
    w2: int  # the location word
    pos: int  # the entry's position (where the key would go when absent)
    kb: bytes  # the key's bytes (empty for an int key; index.key_bytes)
    w1: int  # the key word


class CacheView:
    """The read side of one cache in this process (see the module docstring). Made by
    ``CacheStore``, which opens the root (``adopt``, then ``root``) and closes it (``close``)."""

    def __init__(self, session: str, name: str, ns: Namespace, registry: SessionRegistry, base: str):
        self.session, self.name, self.ns, self.registry = session, name, ns, registry
        self.base = base  # the prefix of this cache's segment names (in its memory directory, if any)
        self.root: Segment | None = None  # the root segment, once opened (CacheStore)
        self._incarnation = 0  # the root's (NOTE [publish order], Opening)
        self._gen: Generation | None = None
        self._epoch = -1
        self._hit = None  # the compiled hot path of the mapping of _gen (hit.reader), where built
        self._hit_get = self._hit_peek = None  # its get and peek, bound once
        self._counters = [0, 0, 0, 0]  # hits, misses, rejected, corrupt: this process's totals
        self._counter_off = -1
        self._proc_gen = -1
        self._map_lock = threading.Lock()
        self._lock_gen = process_slot.fork_count()
        self._buffers = gather.BatchBuffers()
        self.spill: IndexedTier | None = None  # where records go when memory is full (spill_to)

    @property
    def mapped(self) -> Generation | None:
        """The generation this handle mapped last (None before the first ``refresh``)."""
        return self._gen

    def tombstoned(self) -> bool:
        """The root's epoch word is the tombstone: the cache was destroyed (NOTE [publish order])."""
        return self.root is not None and WORD.unpack_from(self.root.buf, RootLayout.EPOCH)[0] == DESTROYED

    def close(self) -> None:
        """Forget the generation's mappings and close the root (the store closes the rest)."""
        self._hit = self._hit_get = self._hit_peek = None
        if self._gen is not None:
            close_generation(self._gen)
            self._gen = None
        self._epoch = -1
        if self.root is not None:
            self.root.close()
            self.root = None

    def segment_name(self, *parts: str) -> str:
        """The name of the root (``"root"``), or of a segment of this incarnation of the cache."""
        if parts == ("root",):
            return self.base + SEP + "root"
        return self.base + SEP + SEP.join((f"{self._incarnation:08x}", *parts))

    def adopt(self, root: Segment) -> Segment:
        self._incarnation = WORD.unpack_from(root.buf, RootLayout.INCARNATION)[0]
        return root

    def destroyed_under_us(self) -> CacheNotFound | None:
        """The error to raise if this cache's root is gone or is another incarnation's now."""
        try:
            live = Segment.attach(self.segment_name("root"), kind=KIND_ROOT)
            same = WORD.unpack_from(live.buf, RootLayout.INCARNATION)[0] == self._incarnation
            live.close()
        except (FileNotFoundError, CorruptSegment):
            same = False
        return None if same else self.destroyed()

    def destroyed(self) -> CacheNotFound:
        try:  # its memory directory unmounted or removed under it: no destroy, say what happened
            self.registry.check_memory_dir(self.session)
        except SessionNotFound:  # the session itself is gone: destroyed
            pass
        except ShmcacheError as exc:
            return CacheNotFound(f"cache {self.session}/{self.name} lost its shared memory: {exc}; it was "
                                 f"unmounted or removed while this process used the cache. Mount it again "
                                 f"and open the cache again (a new ShmDatasetCache), or `shmcache destroy "
                                 f"{self.session}` and make the session elsewhere")
        except OSError:  # its session.json unreadable: say what a destroy does
            pass
        return CacheNotFound(f"cache {self.session}/{self.name} was destroyed while this process used it "
                             f"(`shmcache destroy --force`, or `shmcache import --force` replacing it?); open it again "
                             f"(a new ShmDatasetCache) to use the cache made since")

    def generation_exists(self, root: Segment) -> bool:
        """The meta and table segments the root's epoch word names are there. Under the lock nobody
        is making or removing them; without it, a clear() may replace them right after (refresh
        copes), or make this False for a moment (the opener then asks under the lock)."""
        epoch = WORD.unpack_from(root.buf, RootLayout.EPOCH)[0]
        gen, version = split_epoch(epoch)
        return gen > 0 and all(self.ns.shm_path(self.segment_name(f"g{gen}", part)).exists()
                               for part in ("meta", f"t{version}"))

    def refresh(self) -> Generation:
        """Map the generation and table version the root announces now (if not mapped already)."""
        if self.root is None:
            raise self.closed()
        for _ in range(100):
            epoch = WORD.unpack_from(self.root.buf, RootLayout.EPOCH)[0]
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
        stale = self.destroyed_under_us()
        if stale is not None:
            raise stale
        raise CorruptSegment(f"cache {self.session}/{self.name}: the root names segments that do not "
                             f"exist; run `shmcache gc`")

    def _map_epoch(self, epoch: int) -> None:
        self._hit = self._hit_get = self._hit_peek = None  # until the new mapping is made: the long way
        self._map_generation(epoch)
        gen = self._gen
        if hit.NATIVE and gen.gen != DEAD_GEN and self.root is not None:
            self._hit = hit.reader(self.root.buf, epoch, gen.index.buf, gen.index.capacity, gen.meta.buf, gen.data,
                                   gen.layouts, UNDECODABLE, functools.partial(self.count, HITS))
            self._hit_get, self._hit_peek = self._hit.get, self._hit.peek
            if self._proc_gen == process_slot.fork_count():  # a table growth: the same counters
                self._aim_hits()

    def _map_generation(self, epoch: int) -> None:
        old = self._gen
        if epoch == DESTROYED:  # tombstoned (NOTE [publish order]): every read is a miss from now on
            self._gen = destroyed_generation()
            self._proc_gen = -1  # its counters went with it (count)
            self._epoch = epoch
            if old is not None:
                close_generation(old)
            return
        gen, version = split_epoch(epoch)
        if old is not None and old.gen == gen:
            table = Segment.attach(self.segment_name(f"g{gen}", f"t{version}"), kind=KIND_TABLE)
            # a new Generation, not an update in place: a thread inside a lookup keeps the one it has
            self._gen = Generation(gen, version, old.meta, table, TableView(table.buf, table.name), old.classes,
                             old.data, old.layouts, old.columns)
        else:
            meta = Segment.attach(self.segment_name(f"g{gen}", "meta"), kind=KIND_META)
            try:
                table = Segment.attach(self.segment_name(f"g{gen}", f"t{version}"), kind=KIND_TABLE)
            except BaseException:
                meta.close()
                raise
            self._gen = Generation(gen, version, meta, table, TableView(table.buf, table.name),
                             ClassTable(meta.buf, MetaLayout.CLASSES), {}, {}, {})
            if old is not None:
                close_generation(old)
                if self.spill is not None:  # clear() elsewhere replaced the spill files too
                    self.spill.reopen()
            self._proc_gen = -1  # counters live in the new meta: re-read our slot's totals
        self._epoch = epoch

    def class_data(self, gen: Generation, cls: int) -> tuple:
        """``(segment, read-only view, chunk size, chunks handed out when last checked)`` of size
        class ``cls``, mapped on first use (its class record checked by :meth:`recheck_class`)."""
        entry = gen.data.get(cls)
        if entry is None:
            if not (0 < cls < MAX_CLASSES and gen.classes.chunk_size(cls)):
                raise self.corrupt(f"an entry of {gen.table.name} names size class {cls}, which holds "
                                    f"no chunks in {gen.meta.name}")
            seg = Segment.attach(self.segment_name(f"g{gen.gen}", f"c{cls}"), kind=KIND_DATA)
            entry = self.recheck_class(gen, cls, (seg, memoryview(seg.buf).toreadonly(), 0, 0))
        return entry

    def recheck_class(self, gen: Generation, cls: int, entry: tuple) -> tuple:
        """``entry`` of :meth:`class_data` with the class record read again from meta and checked: a
        chunk size the allocator gives that class, ``bump <= committed``, and committed chunks
        inside the segment. Called when an entry points past what this process saw handed out.
        The bump, not the committed count: a committed chunk above the bump was never written, and
        an entry pointing there would read as a record of zeros."""
        seg, view = entry[:2]
        chunk, bump, committed = gen.classes.get(cls)
        try:
            ok = size_class(chunk) == (cls, chunk)
        except OverflowError:
            ok = False
        if not ok or bump > committed or DATA_OFF + committed * chunk > seg.size:
            raise self.corrupt(f"the record of size class {cls} in {gen.meta.name} is damaged (chunks of "
                                f"{chunk} bytes, {bump} handed out of {committed} committed, in "
                                f"{seg.name} of {seg.size} bytes)")
        entry = gen.data[cls] = (seg, view, chunk, bump)
        return entry

    def record(self, gen: Generation, w0: int, w2: int, w1: int, kb: bytes) -> memoryview:
        """The bytes of the in-memory record that entry (w0, w2) points at. The entry is checked
        first with a few int compares: a damaged one (issue 8) names a class, a chunk or a length
        the allocator never handed out, where reading would return zeros or another record."""
        # index.entry_class, entry_chunk and entry_length, inlined (every str key's read comes here;
        # ``test_index`` checks these copies against index's layout)
        cls = w2 >> 48
        entry = gen.data.get(cls) or self.class_data(gen, cls)
        chunk, n = w2 & LOCATION_MASK, w0 >> 32
        if chunk >= entry[3] or not 16 <= n <= entry[2]:  # 16: _MIN_RECORD, as a constant
            entry = self.recheck_class(gen, cls, entry)  # more may have been handed out since
            if chunk >= entry[3] or not _MIN_RECORD <= n <= entry[2]:
                raise self.corrupt(f"the entry of key {key_repr(w1, kb)} in {gen.table.name} points at "
                                    f"{n} bytes in chunk {chunk} of size class {cls}, which has handed "
                                    f"out {entry[3]} chunks of {entry[2]} bytes")
        start = DATA_OFF + chunk * entry[2]
        return entry[1][start:start + n]

    def layout(self, gen: Generation, lid: int) -> tuple[bytes, Callable, int]:
        """``(layout bytes, decoder, the end of its last leaf)`` of layout ``lid``, checked on
        first use: an id the table never gave out or bytes that are not a layout are damage."""
        item = gen.layouts.get(lid)
        if item is None:
            meta = gen.meta.buf
            count = WORD.unpack_from(meta, MetaLayout.N_LAYOUTS)[0]
            if lid >= min(count, MetaLayout.MAX_LAYOUTS):
                raise self.corrupt(f"an entry of {gen.table.name} names layout {lid}, but {gen.meta.name} "
                                    f"holds {count} layouts (at most {MetaLayout.MAX_LAYOUTS})")
            off = MetaLayout.LAYOUTS + lid * MetaLayout.LAYOUT_BYTES
            n = struct.unpack_from("I", meta, off)[0]
            raw = bytes(meta[off + 4:off + 4 + min(n, MetaLayout.LAYOUT_BYTES - 4)])
            try:
                if n > MetaLayout.LAYOUT_BYTES - 4:
                    raise ValueError(f"a length of {n} bytes in a slot of {MetaLayout.LAYOUT_BYTES - 4}")
                leaves = codec.leaves(raw)[1]
                end = max((leaf.offset + leaf.nbytes for leaf in leaves), default=0)
                item = (raw, codec.decoder_for(raw), max(end, _MIN_RECORD),
                        codec.decoder_for(raw, private=True))
            except ShmcacheError:
                raise
            except UNDECODABLE as exc:
                raise self.corrupt(f"layout {lid} in {gen.meta.name} is damaged ({exc!r})") from None
            gen.layouts[lid] = item
        return item

    def corrupt(self, what: str, fix: str = "it will drop this cache's contents; they are "
                                             "recomputed on use") -> CorruptSegment:
        """The error for damaged shared memory; `shmcache gc` finds the same damage and drops the
        generation (or recounts counters: collect_garbage), so that is the fix the message gives."""
        return CorruptSegment(f"cache {self.session}/{self.name}: {what}; its shared memory is damaged. "
                              f"Run `shmcache gc` ({fix})")

    def closed(self) -> InvalidArgument:
        """The error of a use after ``close()`` in this process."""
        return InvalidArgument(f"cache {self.session}/{self.name} was closed in this process; open it again")

    def count(self, which: int, n: int = 1) -> None:
        gen = self._gen
        if gen is None:  # not mapped yet, or closed since the caller's checks (another thread: refresh says so)
            gen = self.refresh()
        if self._proc_gen != process_slot.fork_count():
            if gen.gen == DEAD_GEN:  # a destroyed cache: nothing to count into (no slot is taken)
                self._counters, self._counter_off = [0, 0, 0, 0], -1
                self._proc_gen = process_slot.fork_count()
                self._aim_hits()
                return
            try:
                slot = process_slot.slot(self.registry, self.session)
            except LockTimeout as exc:  # every slot taken: serve, but count nowhere
                log.warning("cache %s/%s: this process's hits and misses are not counted: %s",
                            self.session, self.name, exc)
                self._counters, self._counter_off = [0, 0, 0, 0], -1
                self._proc_gen = process_slot.fork_count()
                self._aim_hits()
                return
            off = MetaLayout.COUNTERS + MetaLayout.COUNTER_ROW * slot
            # the incarnation too: a cache destroyed and made again starts at g1 again, and must
            # not carry on from this process's totals of the one destroyed
            key = f"{self.ns.root}{self.segment_name(f'g{gen.gen}')}+{slot}"
            # a total of garbage (a damaged slot) restarts at 0: a stat, not worth failing reads over,
            # and one at the top of the word would overflow on the next count (struct.error)
            self._counters = process_slot.counters(key, lambda: [c if c < 1 << 62 else 0 for c in
                                                             struct.unpack_from("QQQQ", gen.meta.buf, off)])
            self._counter_off = off
            self._proc_gen = process_slot.fork_count()
            self._aim_hits()
        self._counters[which] += n
        if self._counter_off >= 0:
            gen.meta.words[(self._counter_off >> 3) + which] = self._counters[which]

    def _aim_hits(self) -> None:
        """Point the compiled hot path's hit counts at this process's counters (what ``count``
        just set up), or, with no slot, back at ``count``."""
        compiled = self._hit
        if compiled is not None:
            at = self._counter_off
            compiled.target(self._counters if at >= 0 else None, at + 8 * HITS if at >= 0 else -1)

    def find(self, gen: Generation, key: Any) -> Found:
        """The entry of ``key`` (``Found.w0`` == 0 when absent: ``pos`` is then where it would go)."""
        w1, kb = key_bytes(key)
        index = gen.index
        pos, w0, w2 = index.find(w1, not kb)
        # a hash matched: compare the key bytes stored at the end of the record (a spilled record
        # is checked against the key when it is read)
        probes = 0
        while w0 and kb and not w0 & SPILLED:
            rec = self.record(gen, w0, w2, w1, kb)
            # codec.record_header(rec).key_len and codec.record_key(rec), inlined: a call less per probe
            if _KEY_LEN.unpack_from(rec, 4)[0] == len(kb) and rec[len(rec) - len(kb):] == kb:
                break
            probes += 1
            if probes >= index.capacity:  # around the whole table: no EMPTY entry ends the probe
                raise index.corrupt()
            pos, w0, w2 = index.find_from((pos + 1) & index.mask, w1, False)
        return Found(w0, w2, pos, kb, w1)

    def decode(self, gen: Generation, w0: int, w2: int, copy: bool, w1: int = 0, kb: bytes = b"") -> Any:
        if w0 & SPILLED:
            buf = self.read_spilled(w0, w2, w1, kb, gen.gen)
            if buf is None:
                return CORRUPT_RECORD
        else:
            view = self.record(gen, w0, w2, w1, kb)
            buf = bytearray(view) if copy else view
        lid = entry_layout(w0)
        try:  # a damaged record must not decode to a raw exception (issue 8); free unless raised
            if lid == INLINE24:
                return codec.decode(buf, codec.inline_layout(buf))
            return self.layout(gen, lid)[1](buf)  # a record too short for it raises (codec)
        except ShmcacheError:
            raise
        except UNDECODABLE as exc:
            where = "a spill file" if w0 & SPILLED else self.segment_name(f"g{gen.gen}", f"c{entry_class(w2)}")
            raise self.undecodable(f"the record of key {key_repr(w1, kb)} in {where}", exc) from None

    def undecodable(self, what: str, exc: Exception) -> CorruptSegment:
        """A record whose bytes do not decode: gc checks metadata, not every record, so the fix
        given is a clear."""
        return CorruptSegment(f"cache {self.session}/{self.name}: {what} cannot be decoded ({exc!r}); its "
                              f"bytes are damaged. Clear the cache (cache.clear(), or `shmcache destroy "
                              f"{self.session}`): its contents are recomputed on use")

    def lookup(self, key: Any, copy: bool = True, count: bool = True) -> Any:
        """The cached value of ``key``, or ``MISSING``."""
        get = self._hit_get
        if get is not None and copy and count:  # the hot path below in one call (cache.hit)
            value = get(key)  # counted there
            if value is _ABSENT:  # EMPTY at the key's own position
                self.count(MISSES)
                return MISSING
            if value is not _LONG_WAY:
                return value
        # 64: RootLayout.EPOCH, inlined (a constant, not an attribute lookup, on the hot path; every copy of
        # the root's and the entry's layout inlined here is checked by ``test_index``)
        try:  # free in CPython 3.11+ unless raised
            gen = self._gen if _WORD.unpack_from(self.root.buf, 64)[0] == self._epoch else self.refresh()
        except AttributeError:  # closed in this process (root None): refresh says so, and the fix
            gen = self.refresh()
        if type(key) is int and 0 <= key < gen.index.capacity:
            # the hot path, inlined (a hit of a dataset index costs ~2x a plain row copy): the key
            # sits at its own position (``TableView.lookup_ints``), in memory, with an interned layout whose
            # decoder and data segment this process already has; anything else goes the long way.
            # It is find + decode for that case, with the same checks of the entry (record:
            # the chunk handed out, the length within the chunk and covering the layout); anything
            # unexpected - a check that fails, bytes that do not decode - takes the long way,
            # which names the damage (NOTE [publish order], Damage).
            buf = gen.index.buf
            off = TABLE_OFF + ENTRY_BYTES * key
            w0 = _WORD.unpack_from(buf, off)[0]  # first, on its own: see TableView.find
            if not w0:  # EMPTY at the key's own position: absent (index.find stops there too)
                if count:
                    self.count(MISSES)
                return MISSING
            if w0 & 7 == READY | INT_KEY:  # 7: READY | INT_KEY | SPILLED (and not SPILLED)
                k, w2 = _QQ.unpack_from(buf, off + 8)
                # index.entry_class, entry_layout, entry_chunk and entry_length, inlined
                data = gen.data.get(w2 >> 48)
                layout = gen.layouts.get((w0 >> 8) & INLINE24)
                chunk, n = w2 & LOCATION_MASK, w0 >> 32
                value = MISSING
                if k == key and data is not None and layout is not None and chunk < data[3] \
                        and layout[2] <= n <= data[2]:
                    start = DATA_OFF + chunk * data[2]
                    view = data[1][start:start + n]
                    try:
                        value = layout[3](bytearray(view)) if copy else layout[1](view)
                    except UNDECODABLE:
                        value = MISSING  # the long way below raises CorruptSegment naming the key
                if value is not MISSING:
                    if count:
                        if self._proc_gen == process_slot.forks and self._counter_off >= 0:
                            counters = self._counters
                            counters[0] += 1  # counters[HITS], inlined
                            gen.meta.words[self._counter_off >> 3] = counters[0]
                        else:
                            self.count(HITS)
                    return value
        try:
            w0, w2, _, kb, w1 = self.find(gen, key)
            value = self.decode(gen, w0, w2, copy, w1, kb) if w0 else MISSING
        except FileNotFoundError:  # a clear() elsewhere unlinked a segment we had yet to map
            w0, value = 0, MISSING
        if w0:
            if value is not CORRUPT_RECORD:
                if count:
                    self.count(HITS)
                return value
            if self.is_current(gen.gen):  # else a clear() dropped the record under us: a plain miss
                self.count(CORRUPT)
        if count:
            self.count(MISSES)
        return MISSING

    def read_spilled(self, w0: int, w2: int, w1: int, kb: bytes, gen: int = -1) -> bytearray | None:
        """The record a spilled entry of generation ``gen`` names, or None; a read that fails
        because a clear() replaced that generation meanwhile is a quiet miss (the caller counts
        it as a plain miss)."""
        if self.spill is None:
            return None
        stale = None if gen < 0 else (lambda: not self.is_current(gen))
        return self.spill.read(RecordLocation(w2, entry_length(w0)), tier_key(w1, kb), stale)

    @property
    def incarnation(self) -> int:
        """The root's incarnation (module docstring): tells this cache from one made again."""
        return self._incarnation

    def is_current(self, gen: int) -> bool:
        """Generation ``gen`` is still the cache's (no clear() replaced it): asked after a failed
        read of a spilled record, which is damage only if its generation is still in force."""
        root = self.root
        return root is not None and split_epoch(WORD.unpack_from(root.buf, RootLayout.EPOCH)[0])[0] == gen

    def look_many(self, keys: list, copy: bool) -> list:
        """A claim's re-check of ``keys`` (values, MISSING where absent; nothing counted)."""
        return self.lookup_batch(keys, copy, count=False)[0]

    def count_misses(self, n: int = 1) -> None:
        """Count ``n`` items computed from the source without a lookup (warm-up) as misses: every
        item computed from the source is a miss in stats()."""
        self.count(MISSES, n)

    def contains(self, key: Any) -> bool:
        try:
            return self.find(self.refresh(), key)[0] != 0
        except FileNotFoundError:  # cleared meanwhile
            return False

    def lookup_batch(self, keys: Sequence, copy: bool = True, count: bool = True) -> tuple[list, list[int]]:
        """Values for ``keys`` (MISSING where absent) and the positions of the misses; counted as
        hits and misses unless not ``count`` (a claim's re-check, a waiter's poll). A batch of int
        keys is probed by one vectorised lookup first and only the keys present are read one by
        one: the misses of a cold batch cost no probe each."""
        gen = self.refresh()
        probed = _PROBED_MIN <= len(keys) and self._probe_ints(gen, keys)
        if not probed:
            values, missing = self._lookup_each(gen, keys, copy)
        else:
            values, missing = self._read_probed(gen, keys, *probed, copy)
        if count:
            self.count(HITS, len(keys) - len(missing))
            if missing:
                self.count(MISSES, len(missing))
        return values, missing

    def _probe_ints(self, gen: Generation, keys: Sequence) -> tuple[np.ndarray, np.ndarray] | None:
        """The entries (w0, w2) of ``keys`` by one vectorised lookup (w0 0 where absent), if every
        key is an int64; else None."""
        if not all(type(k) is int for k in keys):
            return None
        try:
            ints = np.fromiter(keys, np.int64, len(keys))
        except OverflowError:
            return None
        return gen.index.lookup_ints(ints)

    def _read_probed(self, gen: Generation, keys: Sequence, w0s: np.ndarray, w2s: np.ndarray,
                     copy: bool) -> tuple[list, list[int]]:
        """``_lookup_each`` of int ``keys`` whose entries ``_probe_ints`` found: each present one
        decoded from the entry probed (as ``lookup`` decodes the entry it found), none probed again."""
        values: list = [MISSING] * len(keys)
        missing = np.flatnonzero(w0s == 0).tolist()
        present = np.flatnonzero(w0s)
        if not len(present):
            return values, missing
        lost = []
        peek = self._hit_peek if copy else None  # the compiled hit, uncounted: the batch counts its hits
        for j, w0, w2 in zip(present.tolist(), w0s[present].tolist(), w2s[present].tolist()):
            v = _LONG_WAY if peek is None else peek(keys[j])
            if v is _LONG_WAY or v is _ABSENT:  # another mapping since the probe, or not the hot path's case
                v = self._read_entry(gen, w0, w2, copy, keys[j] & _M64, b"")
            if v is MISSING:
                lost.append(j)
            else:
                values[j] = v
        return values, sorted(missing + lost) if lost else missing

    def _lookup_each(self, gen: Generation, keys: Sequence, copy: bool) -> tuple[list, list[int]]:
        """``lookup_batch`` key by key, nothing counted but damage."""
        values: list = [MISSING] * len(keys)
        missing = []
        for i, key in enumerate(keys):
            try:
                w0, w2, _, kb, w1 = self.find(gen, key)
            except FileNotFoundError:  # cleared meanwhile
                w0 = 0
            v = self._read_entry(gen, w0, w2, copy, w1, kb) if w0 else MISSING
            if v is MISSING:
                missing.append(i)
            else:
                values[i] = v
        return values, missing

    def _read_entry(self, gen: Generation, w0: int, w2: int, copy: bool, w1: int, kb: bytes) -> Any:
        """The value of an entry found in ``gen``, or MISSING: cleared meanwhile, or damaged
        (counted, unless a clear() dropped the record under us: a plain miss then)."""
        try:
            v = self.decode(gen, w0, w2, copy, w1, kb)
        except FileNotFoundError:  # cleared meanwhile
            return MISSING
        if v is CORRUPT_RECORD:
            if self.is_current(gen.gen):
                self.count(CORRUPT)
            return MISSING
        return v

    def batch_layout(self, keys: np.ndarray) -> tuple | None:
        """``(tree, leaves, end of the last leaf)`` of the record of ``keys[0]`` (codec.leaves): the structure a
        vectorised batch of ``keys`` would have. None if that key is not cached with a shared layout."""
        gen = self.refresh()
        planned = gen.columns.get(gather.PLAN)  # a warm batch's layout (gather.Plan)
        if planned is not None and planned.holds(gen.index, int(keys[0])):
            return planned.layout
        try:  # one key: a scalar probe costs a tenth of the vectorised lookup's numpy calls
            w0 = self.find(gen, int(keys[0]))[0]
        except FileNotFoundError:  # cleared meanwhile
            return None
        lid = entry_layout(w0)
        if not w0 or lid == INLINE24:
            return None
        columns = self._columns(gen, lid)
        return None if columns[3] else columns[:3]

    def _columns(self, gen: Generation, lid: int) -> tuple:
        """``(tree, leaves, end of the last leaf, has a list of numbers)`` of layout ``lid`` for
        the batch path (a list of numbers is never a column: ``default_collate`` transposes lists)."""
        shape = gen.columns.get(lid)
        if shape is None:
            raw, _, end, _ = self.layout(gen, lid)  # checked there: codec.leaves takes it as sound
            tree, leaves = codec.leaves(raw)
            shape = gen.columns[lid] = (tree, leaves, end, any(leaf.tag == codec.NUMBERS for leaf in leaves))
        return shape

    def absent_ints(self, keys: np.ndarray) -> np.ndarray:
        """The int64 ``keys`` that are not cached (in memory or on disk), in their order: one
        vectorised lookup, nothing counted (warm-up skips what is there)."""
        w0, _ = self.refresh().index.lookup_ints(keys)
        return keys[w0 == 0]

    def all_in_memory(self, keys: np.ndarray) -> bool:
        """True if every int key is cached in memory with one layout and size class: what
        :meth:`gather_ints` needs (checked without copying or counting anything)."""
        gen = self.refresh()
        planned = gen.columns.get(gather.PLAN)  # a warm batch: its plan's checks (gather.planned_chunks)
        if len(keys) and planned is not None and gather.planned_chunks(planned, gen.index.words, keys) is not None:
            return True
        return len(keys) > 0 and gather.uniform(*gen.index.lookup_ints(keys))

    def gather_ints(self, keys: np.ndarray, out: list | None = None):
        """Vectorised batch of int keys that share one layout and one size class, all in memory.

        Returns ``(tree, leaves, columns)`` - the layout tree, its leaves (codec.Leaf) and one
        stacked array per leaf - or None
        when the batch is not uniform (the caller falls back to :meth:`lookup_batch`). ``out``:
        optional list of arrays, one per leaf, to gather into (e.g. pinned host buffers).
        """
        gen = self.refresh()
        if len(keys) == 0:
            return None
        planned = gen.columns.get(gather.PLAN)  # a warm batch: a few numpy calls (gather.gather_planned)
        got = planned and gather.gather_planned(planned, gen.index.words, keys, out, self._buffers)
        if got is not None:
            self.count(HITS, len(keys))
            return planned.tree, planned.leaves, got
        batch = gather.plan(gen.index, keys)
        if batch is None:
            return None
        tree, leaves, end, numbers = self._columns(gen, batch.layout)
        if numbers:  # never a column (_columns): the caller goes item by item
            return None
        cls, n = batch.cls, batch.length
        try:
            entry = gen.data.get(cls) or self.class_data(gen, cls)
        except FileNotFoundError:  # cleared meanwhile: the caller's slow path sees misses
            return None
        # the checks of record, for the whole batch at once: every chunk handed out, the one
        # length within a chunk and long enough for the layout (issue 8: never zeros or a neighbour)
        top = int(batch.chunks.max())
        if top >= entry[3] or not end <= n <= entry[2]:  # end: at least a record header (layout)
            entry = self.recheck_class(gen, cls, entry)
            if top >= entry[3] or not end <= n <= entry[2]:
                raise self.corrupt(f"an entry of {gen.table.name} in a batch of keys from {int(keys[0])} "
                                    f"points at {n} bytes in chunk {top} of size class {cls}, which "
                                    f"has handed out {entry[3]} chunks of {entry[2]} bytes (layout "
                                    f"{batch.layout} needs {end})")
        seg, _, chunk, handed_out = entry
        try:  # str, bytes and pickled leaves decode per item: damaged bytes raise there
            columns = gather.columns(seg.buf, handed_out, chunk, batch.chunks, leaves, out, self._buffers)
        except ShmcacheError:
            raise
        except UNDECODABLE as exc:
            raise self.undecodable(f"a record of the batch of keys from {int(keys[0])} in {seg.name}",
                                    exc) from None
        self.count(HITS, len(keys))
        # checked above: the next such batch takes the planned way
        gather.remember(gen.columns, state_word(READY | INT_KEY, batch.layout, n), cls, handed_out, chunk, seg.buf,
                        (tree, leaves, end))
        return tree, leaves, columns

    def __len__(self) -> int:
        gen = self.refresh()
        meta = gen.meta.buf
        n = WORD.unpack_from(meta, MetaLayout.ITEMS_MEM)[0] + WORD.unpack_from(meta, MetaLayout.ITEMS_DISK)[0]
        if n > gen.index.capacity:  # every item has an entry: more is garbage (len() cannot return it)
            raise self.corrupt(f"the item counters in {gen.meta.name} say {n} items, in a table of "
                                f"{gen.index.capacity} entries", fix="it recounts them")
        return n

    out_matches = staticmethod(gather.out_matches)


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
CORRUPT_RECORD: Any = object()  # what decode returns for a spilled record that fails its checks


def key_repr(w1: int, kb: bytes) -> str:
    """The key of an entry, for messages: ``kb`` is its tagged bytes (empty for int keys)."""
    try:
        key = key_from_bytes(w1, kb)
    except ValueError:  # damaged key bytes: shown as they are
        return repr(kb)
    return str(key) if isinstance(key, int) else repr(key)


