"""Repair and gc of one cache: a dead writer's intent (NOTE [publish order]), damaged
shared memory, and the segments of generations and table versions no longer current.

Every function here runs under the cache's lock. ``repair_intent`` runs before each write (and in
gc): it undoes or finishes what the last writer left, after ``impossible_intent`` has checked the
intent is one a writer can leave. ``collect_garbage`` is ``shmcache gc`` for one cache: repair,
look for damage as readers would find it (``find_damage``), drop a damaged generation for an empty
one (``drop_generation``, the fix CorruptSegment messages promise), recount the totals, and unlink
what is no longer current. They read the cache through its view (view.CacheView: ``refresh``,
``class_data``, ``recheck_class``, ``layout``, its segment names and its error for damage); gc and
the drop ask a little more of the store, declared here as ``Collectable``.
"""

from __future__ import annotations

import logging
import shutil
from contextlib import AbstractContextManager
from typing import Protocol

import numpy as np

from ..base import ordering
from ..base.shm import WORD, Segment
from ..errors import CorruptSegment
from . import codec, publish_group
from .allocator import MAX_CLASSES
from .generation import SPILL_CLASS, Generation, Intent, MetaLayout, RootLayout, split_epoch
from .index import (
    ENTRY_BYTES,
    FLAG_BITS,
    INLINE24,
    INT_KEY,
    MIN_TABLE,
    READY,
    SPILLED,
    TABLE_OFF,
    TableView,
    entry_chunk,
    entry_class,
    entry_layout,
    entry_length,
)
from .indexed_tier import IndexedTier
from .registry import SEP, unlink_segments
from .view import CacheView

__all__ = ["repair_intent", "impossible_intent", "collect_garbage", "find_damage", "recount_items",
           "recount_committed", "drop_generation", "Collectable", "MakesGenerations"]

log = logging.getLogger("shmcache")



class MakesGenerations(Protocol):
    """The writer's call that publishes a new, empty generation (writer.CacheWriter)."""

    def create_generation(self, root: Segment, gen: int, capacity: int, cap: int) -> None: ...


class Collectable(Protocol):
    """What gc and the drop of a damaged generation ask of a cache (a CacheStore has it)."""

    @property
    def view(self) -> CacheView: ...

    @property
    def writer(self) -> MakesGenerations: ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def spill(self) -> IndexedTier | None: ...

    def read_meta(self) -> dict: ...

    def locked(self) -> AbstractContextManager[None]: ...


def repair_intent(view: CacheView, gen: Generation) -> int:
    """Undo or finish the last writer's work if it died mid-way (NOTE [publish order])."""
    if gen.group_phase():  # a publish group of put_records has its own intent record and repair
        return publish_group.repair(gen, view.corrupt)
    intent = gen.intent()
    if intent.phase == 0:
        return 0
    wrong = impossible_intent(gen, intent)
    if wrong:  # restoring that bump would hand out live chunks again: touch nothing
        raise view.corrupt(f"the intent record in {gen.meta.name} is impossible: {wrong}")
    w0 = WORD.unpack_from(gen.index.buf, TABLE_OFF + ENTRY_BYTES * intent.pos)[0]
    if w0 & READY:  # it was published: make the totals count it (assignments: idempotent)
        gen.apply_totals(intent)
        reclaimed = 0
    elif intent.cls == SPILL_CLASS:  # a spill record nobody points to: dead bytes on disk, no chunk
        reclaimed = 0
    else:  # never visible: give the chunk back
        gen.classes.set_bump(intent.cls, intent.old_bump)
        reclaimed = 1
    gen.end()
    log.info("cache %s/%s: repaired an entry left by a dead writer (%s)", view.session,
             view.name, "reclaimed its chunk" if reclaimed else "counted it")
    return reclaimed


def impossible_intent(gen: Generation, intent: Intent) -> str:
    """Why the intent record cannot be one a writer left (NOTE [publish order]), or "". A
    writer dies with the bump where it found it or one on; phase 2 comes after its entry is
    READY; its totals are the current ones or one item more."""
    phase, pos, cls, old_bump, items, total, raw, table_items = intent
    if phase not in (1, 2):
        return f"phase {phase} (a writer writes 1 or 2)"
    if pos >= gen.index.capacity:
        return f"table position {pos} (the table has {gen.index.capacity} entries)"
    ready = WORD.unpack_from(gen.index.buf, TABLE_OFF + ENTRY_BYTES * pos)[0] & READY
    if phase == 2 and not ready:
        return f"phase 2 (published) with entry {pos} of {gen.table.name} empty"
    if cls == SPILL_CLASS:
        now_items, now_total, now_raw = gen.disk_totals()
        most = total  # spilled sizes are not bounded by a chunk
    elif 0 < cls < MAX_CLASSES and gen.classes.chunk_size(cls):
        most, bump, _ = gen.classes.get(cls)
        if not ready and old_bump not in (bump, bump - 1):
            return f"old bump {old_bump} of size class {cls}, whose bump is {bump}"
        now_items, now_total, _ = gen.mem_totals()
        now_raw = raw
    else:
        return f"size class {cls} (not in use)"
    now_table = gen.table_items()
    if items - now_items not in (0, 1) or table_items - now_table not in (0, 1) \
            or not 0 <= total - now_total <= most or raw < now_raw:
        return (f"totals of {items} items, {total} bytes and {table_items} entries after a write "
                f"to {now_items} items, {now_total} bytes and {now_table} entries")
    return ""


def collect_garbage(store: Collectable, report: dict | None = None) -> tuple[int, list[str]]:
    """``shmcache gc`` for this cache (CacheStore.collect_garbage, which documents it)."""
    report = {} if report is None else report
    view = store.view
    with store.locked():
        try:
            gen = view.refresh()
            reclaimed = repair_intent(view, gen)
            damage = find_damage(view, gen)
        except CorruptSegment as exc:
            damage, reclaimed = str(exc), 0
        if damage:
            drop_generation(store, damage)
            report["dropped"] = damage
            gen = view.refresh()
        else:
            report["recounted"] = recount_items(view, gen)
        recount_committed(gen)
        name = view.segment_name
        keep = {name("root"), name(f"g{gen.gen}", "meta"), name(f"g{gen.gen}", f"t{gen.version}")}
        keep |= {name(f"g{gen.gen}", f"c{c}") for c in gen.classes.used_classes()}
        removed = unlink_segments(view.ns, view.base + SEP, keep=keep)
        if store.spill is not None:
            store.spill.collect_garbage()
        return reclaimed, removed


def find_damage(view: CacheView, gen: Generation) -> str:
    """What is damaged in generation ``g``, or "" (gc; caller holds the lock). Every READY
    entry is checked as readers check one, with numpy over the whole table (index's accessors
    over arrays of words)."""
    if gen.index.damage:
        raise gen.index.corrupt()
    count = WORD.unpack_from(gen.meta.buf, MetaLayout.N_LAYOUTS)[0]
    if count > MetaLayout.MAX_LAYOUTS:
        return f"{gen.meta.name} counts {count} layouts, more than its {MetaLayout.MAX_LAYOUTS} slots"
    for lid in range(count):
        view.layout(gen, lid)  # raises CorruptSegment on a damaged one
    chunk = np.zeros(MAX_CLASSES + 1, np.uint64)  # class MAX_CLASSES: "not in use"
    handed = np.zeros(MAX_CLASSES + 1, np.uint64)
    for cls in gen.classes.used_classes():
        try:
            entry = view.recheck_class(gen, cls, view.class_data(gen, cls))
        except FileNotFoundError:
            return f"the data segment of size class {cls} is missing"
        chunk[cls], handed[cls] = entry[2], entry[3]
    w = gen.index.words
    s0, w2 = w[:, 0], w[:, 2]
    if (s0 != 0).all():
        raise gen.index.corrupt()
    ready = (s0 & np.uint64(READY)) != 0
    unused = FLAG_BITS & ~(READY | INT_KEY | SPILLED)
    if ((s0 != 0) & ~ready).any() or (s0 & np.uint64(unused)).any():
        return f"{gen.table.name} holds entries with state bits no writer sets"
    lid = entry_layout(s0)
    bad_lid = ready & (lid >= np.uint64(count)) & (lid != np.uint64(INLINE24))
    mem = ready & ((s0 & np.uint64(SPILLED)) == 0)
    cls = np.minimum(entry_class(w2), np.uint64(MAX_CLASSES)).astype(np.intp)
    n = entry_length(s0)
    bad = mem & ((entry_chunk(w2) >= handed[cls]) | (n > chunk[cls]) | (n < np.uint64(codec.MIN_RECORD_BYTES)))
    if bad.any() or bad_lid.any():
        pos = int(np.flatnonzero(bad | bad_lid)[0])
        return (f"entry {pos} of {gen.table.name} points where no record is (words "
                f"{int(s0[pos]):#x}, {int(w2[pos]):#x})")
    return ""


def recount_items(view: CacheView, gen: Generation) -> list[str]:
    """Set the item counters that the table's entries determine; the names of those that were
    wrong (a damaged meta segment: len() and stats would lie, and a wrong entry count would
    grow the table on every write)."""
    s0 = gen.index.words[:, 0]
    ready = (s0 & np.uint64(READY)) != 0
    mem = ready & ((s0 & np.uint64(SPILLED)) == 0)
    right = {MetaLayout.TABLE_ITEMS: int(ready.sum()), MetaLayout.ITEMS_MEM: int(mem.sum()),
             MetaLayout.BYTES_MEM: int(entry_length(s0[mem]).sum()),
             MetaLayout.ITEMS_DISK: int((ready & ~mem).sum())}
    names = {MetaLayout.TABLE_ITEMS: "table entries", MetaLayout.ITEMS_MEM: "items in memory",
             MetaLayout.BYTES_MEM: "bytes in memory", MetaLayout.ITEMS_DISK: "items on disk"}
    wrong = []
    for off, value in right.items():
        if WORD.unpack_from(gen.meta.buf, off)[0] != value:
            wrong.append(f"{names[off]} ({WORD.unpack_from(gen.meta.buf, off)[0]}, now {value})")
            gen.meta.words[off >> 3] = value
    if wrong:
        log.warning("cache %s/%s: gc recounted %s", view.session, view.name, ", ".join(wrong))
    return wrong


def recount_committed(gen: Generation) -> None:
    """Set the committed total from what it is made of (after a growth, and in gc: a writer
    killed between two of its updates must not skew it for good)."""
    total = MetaLayout.SIZE + TableView.bytes_for(gen.index.capacity)
    for cls in gen.classes.used_classes():
        chunk, _, committed = gen.classes.get(cls)
        total += chunk * max(committed, gen.classes.reserved(cls))  # chunks asked ahead count too
    gen.meta.words[MetaLayout.COMMITTED >> 3] = total


def drop_generation(store: Collectable, why: str) -> None:
    """Replace a damaged generation by a new empty one (caller holds the lock): the fix that
    CorruptSegment messages promise. Old segments go with gc's sweep of non-current names."""
    root = store.view.root
    gen = split_epoch(WORD.unpack_from(root.buf, RootLayout.EPOCH)[0])[0] + 1
    generation = store.view.mapped
    cap = generation.index.capacity if generation is not None and generation.index.capacity else MIN_TABLE
    store.writer.create_generation(root, gen if gen < 1 << 32 else 1, store.capacity_bytes, cap)
    ordering.fence()  # as in clear(): the new epoch word (the retirement) before the files' reuse
    if store.spill is not None:
        store.spill.clear()
    elif store.read_meta().get("spill_path"):
        shutil.rmtree(store.read_meta()["spill_path"], ignore_errors=True)
    log.warning("cache %s/%s was damaged (%s); gc dropped its contents (they are recomputed on "
                "use)", store.view.session, store.view.name, why)
