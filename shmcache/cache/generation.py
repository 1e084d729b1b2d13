"""A cache's generation: the words of its root, the layout of its meta segment, the totals and the
intent record of NOTE [publish order], and this process's mappings of one generation.

A cache (``CacheStore``) is a root segment that names, in its epoch word, the generation ``g`` and the
table version ``v`` in force; a generation is a meta segment, a table and the data segments of its
size classes. ``clear()`` and gc's drop of a damaged cache make a new generation; a table growth
makes a new table version of the same generation. This module says where every word of the root
and of the meta segment is, and how the totals and the intent record are written (each word a
reader reads without the lock is one aligned store: ``Segment.words``); the store decides when.
"""

from __future__ import annotations

import struct
from array import array
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..base.shm import WORD, Segment, word_view
from .allocator import MAX_CLASSES, ClassTable
from .index import TableView
from .registry import MAX_SLOTS
from .root import DESTROYED, RootLayout, epoch_of, split_epoch

__all__ = ["KIND_ROOT", "KIND_META", "KIND_TABLE", "KIND_DATA", "RootLayout", "DESTROYED", "SIZED", "AUTO", "AUTO_NONE",
           "MetaLayout", "HITS", "MISSES", "REJECTED", "CORRUPT", "COUNTER_NAMES", "INTENT", "Intent",
           "GROUP_RECORDS", "GroupIntent",
           "SPILL_CLASS", "Generation", "DEAD_GEN", "destroyed_generation", "close_generation", "epoch_of",
           "split_epoch"]

KIND_ROOT, KIND_META, KIND_TABLE, KIND_DATA = 1, 2, 3, 4  # segment kinds (``Segment``'s header)


SIZED, AUTO, AUTO_NONE = 0, 1, 2  # size= given; size=0; size=0 on a full machine: nothing in memory


class MetaLayout:
    """Byte offsets inside a meta segment (one per generation)."""

    ITEMS_MEM, BYTES_MEM, COMMITTED, CAPACITY = 64, 72, 80, 88
    ITEMS_DISK, BYTES_DISK, BYTES_DISK_RAW, N_LAYOUTS, TABLE_ITEMS = 96, 104, 112, 120, 128
    # intent record (NOTE [publish order]): phase, table position, class, old bump, then the
    # totals after the write: items, bytes, raw bytes (disk) and table items (INTENT below)
    INTENT = 192
    # the group intent of put_records (NOTE [publish order]; PublishGroup): a header of 8 words, then
    # GROUP_RECORDS records of 2 words and GROUP_RECORDS class words, ending before COUNTERS
    GROUP = 256
    COUNTERS = 4096  # MAX_SLOTS rows of (hits, misses, rejected, corrupt): one row per liveness slot
    COUNTER_ROW = 32
    CLASSES = COUNTERS + MAX_SLOTS * COUNTER_ROW
    LAYOUTS = CLASSES + MAX_CLASSES * 32
    MAX_LAYOUTS, LAYOUT_BYTES = 128, 512
    SIZE = LAYOUTS + MAX_LAYOUTS * LAYOUT_BYTES



# a row of counters (NOTE [lock files]: each live process writes only its own row, no atomics)
HITS, MISSES, REJECTED, CORRUPT = 0, 1, 2, 3
COUNTER_NAMES = ("hits", "misses", "rejected", "corrupt")

# The intent record: phase, table position, class (SPILL_CLASS: a spilled record), old bump, then
# the totals after this write: items, bytes, raw bytes (disk only) and table items
INTENT = struct.Struct("QQQQQQQQ")
SPILL_CLASS = 0xFFFF


# The group intent: a group of up to GROUP_RECORDS records put under one hold of the lock
# (put_records, an import) is published together, with two fences per group instead of one or two
# per record (publish_group.PublishGroup).
# Header: phase (0 none, 1 writing, 2 publishing), records, classes, then the totals after the
# group: items, bytes and table items in memory. A record: class << 48 | table position, and the
# entry's state word w0 to publish. A class word: class << 48 | its bump when the group began.
GROUP_RECORDS = 128
GROUP_HEAD = struct.Struct("QQQQQQ")
_GROUP_RECORDS_OFF = MetaLayout.GROUP + 64
_GROUP_CLASSES_OFF = _GROUP_RECORDS_OFF + 16 * GROUP_RECORDS
assert _GROUP_CLASSES_OFF + 8 * GROUP_RECORDS <= MetaLayout.COUNTERS, "the group intent overlaps the counters"
_M48 = (1 << 48) - 1


class GroupIntent(NamedTuple):
    """What a writer of a publish group is doing (NOTE [publish order]); phase 0: nothing."""

    phase: int
    items: int  # the totals once the group is published
    total: int
    table_items: int
    records: list  # (table position, class, w0) per record, in the order they were allocated
    classes: list  # (class, its bump when the group began), one per class the group allocates in


class Intent(NamedTuple):
    """What a writer is about to do (NOTE [publish order]); phase 0: nothing."""

    phase: int
    pos: int
    cls: int
    old_bump: int
    items: int
    total: int
    raw: int
    table_items: int


@dataclass
class Generation:
    """This process's mappings of one generation."""

    gen: int
    version: int
    meta: Segment
    table: Segment
    index: TableView
    classes: ClassTable
    data: dict  # class id -> (Segment, read-only memoryview, chunk size, chunks handed out as last seen)
    # layout id -> (layout bytes, decoder, end of its last leaf (at least a record header),
    #               decoder of a private copy)
    layouts: dict
    columns: dict  # layout id -> (tree, leaves, end of the last leaf) for the batch path; gather.PLAN -> a gather.Plan

    # --- totals (read lock-free by len() and stats) ------------------------------------------

    def word(self, off: int) -> int:
        return WORD.unpack_from(self.meta.buf, off)[0]

    def table_items(self) -> int:
        return self.word(MetaLayout.TABLE_ITEMS)

    def mem_totals(self) -> tuple[int, int, int]:
        """``(items, bytes, committed bytes)`` in memory."""
        return struct.unpack_from("QQQ", self.meta.buf, MetaLayout.ITEMS_MEM)

    def disk_totals(self) -> tuple[int, int, int]:
        """``(items, stored bytes, raw bytes)`` spilled."""
        return struct.unpack_from("QQQ", self.meta.buf, MetaLayout.ITEMS_DISK)

    def apply_totals(self, intent: Intent) -> None:
        """Assign the totals after a write (one store each; assignments: redoing them is harmless)."""
        words = self.meta.words
        if intent.cls == SPILL_CLASS:
            words[MetaLayout.ITEMS_DISK >> 3], words[MetaLayout.BYTES_DISK >> 3] = intent.items, intent.total
            words[MetaLayout.BYTES_DISK_RAW >> 3] = intent.raw
        else:
            words[MetaLayout.ITEMS_MEM >> 3], words[MetaLayout.BYTES_MEM >> 3] = intent.items, intent.total
        words[MetaLayout.TABLE_ITEMS >> 3] = intent.table_items

    # --- the intent record (NOTE [publish order]; the caller holds the cache's lock) ----------

    def intent(self) -> Intent:
        return Intent._make(INTENT.unpack_from(self.meta.buf, MetaLayout.INTENT))

    def begin(self, intent: Intent) -> None:
        """Step 1: write the intent, then phase 1 in one store (an undo restores the bump)."""
        INTENT.pack_into(self.meta.buf, MetaLayout.INTENT, 0, *intent[1:])
        self.meta.words[MetaLayout.INTENT >> 3] = 1

    def published(self) -> None:
        """After step 3: phase 2 (the entry is READY; a repair redoes the totals)."""
        self.meta.words[MetaLayout.INTENT >> 3] = 2

    def end(self) -> None:
        """Step 5: no write in progress."""
        self.meta.words[MetaLayout.INTENT >> 3] = 0

    # --- the group intent (NOTE [publish order], PublishGroup; the caller holds the lock) -----

    def group_phase(self) -> int:
        return self.meta.words[MetaLayout.GROUP >> 3]

    def group_intent(self, records: bool = True) -> GroupIntent:
        """The group intent as written (counts clamped to its slots: gc judges the rest); its
        ``records`` empty unless asked for (``group_records`` gives them as arrays)."""
        buf = self.meta.buf
        phase, _, n_cls, items, total, table_items = GROUP_HEAD.unpack_from(buf, MetaLayout.GROUP)
        cls_words = struct.unpack_from(f"{min(n_cls, GROUP_RECORDS)}Q", buf, _GROUP_CLASSES_OFF)
        recs = list(zip(*(a.tolist() for a in self.group_records()))) if records else []
        return GroupIntent(phase, items, total, table_items, recs, [(c >> 48, c & _M48) for c in cls_words])

    def group_records(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The group intent's records (the count clamped to its slots) as arrays: ``(table
        positions, classes, w0s)``, in the order they were allocated; ``group_intent`` lists them
        from here. A group's finish reads them so: a tuple per record cost about 40 us a group of
        64 (a cold batch)."""
        n = min(self.meta.words[(MetaLayout.GROUP >> 3) + 1], GROUP_RECORDS)
        recs = np.frombuffer(self.meta.buf, np.uint64, 2 * n, _GROUP_RECORDS_OFF).copy()
        return recs[0::2] & np.uint64(_M48), recs[0::2] >> np.uint64(48), recs[1::2]

    def group_counts(self) -> tuple[int, int]:
        """``(records, classes)`` as the header says (unclamped)."""
        w = self.meta.words
        return w[(MetaLayout.GROUP >> 3) + 1], w[(MetaLayout.GROUP >> 3) + 2]

    def group_begin(self) -> None:
        """Phase 1, no records yet (a writer about to allocate the first record of a group)."""
        w, h = self.meta.words, MetaLayout.GROUP >> 3
        w[h + 1] = w[h + 2] = 0
        w[h] = 1

    def group_record(self, i: int, pos: int, cls: int, w0: int) -> None:
        """Record ``i`` of the group, then the count that makes it part of the intent."""
        w, r = self.meta.words, (_GROUP_RECORDS_OFF >> 3) + 2 * i
        w[r], w[r + 1] = cls << 48 | pos, w0
        w[(MetaLayout.GROUP >> 3) + 1] = i + 1

    def group_record_run(self, i: int, pos: list[int], cls: int, w0: list[int]) -> None:
        """Records ``i`` .. ``i + len(pos) - 1`` of the group, all of size class ``cls``, with
        state words ``w0`` (a run), then the count that makes them part of the intent (two
        strided stores of the words: the intent is read under the lock only)."""
        n = len(pos)
        w, r = self.meta.words, (_GROUP_RECORDS_OFF >> 3) + 2 * i
        w[r:r + 2 * n:2] = memoryview(array("Q", [cls << 48 | p for p in pos]))
        w[r + 1:r + 2 * n:2] = memoryview(array("Q", w0))
        w[(MetaLayout.GROUP >> 3) + 1] = i + n

    def group_class(self, j: int, cls: int, bump: int) -> None:
        """Class word ``j``: ``cls`` and its bump before the group, then the count."""
        self.meta.words[(_GROUP_CLASSES_OFF >> 3) + j] = cls << 48 | bump
        self.meta.words[(MetaLayout.GROUP >> 3) + 2] = j + 1

    def group_publishing(self, items: int, total: int, table_items: int) -> None:
        """Phase 2: every record's bytes and its entry's w1 and w2 are written and fenced; the
        totals after the group go with it (a repair from here finishes the group)."""
        w, h = self.meta.words, MetaLayout.GROUP >> 3
        w[h + 3], w[h + 4], w[h + 5] = items, total, table_items
        w[h] = 2

    def group_end(self) -> None:
        self.meta.words[MetaLayout.GROUP >> 3] = 0


class _Private:
    """Process-private memory in place of a segment (the generation of a destroyed cache)."""

    def __init__(self, size: int):
        self.buf = bytearray(size)
        self.words = word_view(self.buf)

    def close(self) -> None:
        pass


DEAD_GEN = DESTROYED >> 32  # never a real generation (they count up from 1)


def destroyed_generation() -> Generation:
    """What a handle maps once its cache's root is tombstoned: an empty generation in private
    memory, so every read path (lookup, batches, contains, len, stats) finds nothing."""
    meta, table = _Private(MetaLayout.SIZE), _Private(TableView.bytes_for(8))
    TableView.init(table.buf, 8)
    return Generation(DEAD_GEN, 0, meta, table, TableView(table.buf), ClassTable(meta.buf, MetaLayout.CLASSES),
                      {}, {}, {})


def close_generation(gen: Generation) -> None:
    """Forget a generation's mappings. Nothing is unmapped by hand: another thread may still be
    inside a lookup or a gather on them; they go with the last reference (segment.Segment)."""
    gen.data.clear()
    gen.layouts.clear()
    gen.columns.clear()
