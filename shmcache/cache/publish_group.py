"""A publish group of ``put_records``/``put_many``: a group of up to GROUP_RECORDS records put
under one hold of the lock and published together, with two fences per group rather than a fence
or two per record (NOTE [publish order], "a group"; the intent record is generation.GroupIntent).
"Chunk" here means only the allocator's: the fixed-size piece of a size class a record goes in.

The writer (``PublishGroup``, driven by CacheWriter.put_locked and its insert):

  1. phase 1 (``group_begin``); for each record: note it in the intent (table position, class,
     the entry's state word w0; the class's bump before the group, for its first record of that
     class), commit more chunks of its class if needed (no fence here), copy the record into the
     next chunk of its class (counted here, in the process: the class's bump in shared memory
     does not move yet), and write the entry's w1 and w2 (``TableView.stage``);
  2. fence A: the records' bytes, w1 and w2, committed counts, class and layout records;
  3. phase 2, with the totals after the group; each class's bump moves past the group's records;
  4. fence B: the bumps;
  5. every entry's w0 = READY (``TableView.ready``), the totals, phase 0 (``finish``).

Why this order is safe for readers, and how the repair undoes phase 1 or finishes phase 2: NOTE
[publish order], "A publish group" and "Memory ordering".
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

import numpy as np

from ..base import ordering
from ..base.faults import ARMED as _CRASH_TESTS
from ..base.faults import crash_point
from ..errors import CorruptSegment
from . import codec
from .allocator import MAX_CLASSES
from .generation import GROUP_RECORDS, Generation, GroupIntent, Intent
from .index import READY, SPILLED, TableView, entry_chunk, entry_class, entry_length

__all__ = ["PublishGroup", "finish", "repair", "impossible", "GROUP_RECORDS"]

log = logging.getLogger("shmcache")


class PublishGroup:
    """The records of one group that this writer has allocated and not yet published (the caller
    holds the cache's lock from the first ``allocate`` to ``flush``)."""

    def __init__(self):
        self.gen: Generation | None = None
        self.positions: dict[int, tuple[int, bytes]] = {}  # table position -> its key (w1, key bytes)
        self.bumps: dict[int, list[int]] = {}  # class -> [its bump before the group, its next chunk]
        self.bytes = 0

    def __len__(self) -> int:
        return len(self.positions)

    def __contains__(self, pos: int) -> bool:
        return pos in self.positions

    def probe(self, index: TableView, pos: int, w1: int, kb: bytes) -> int:
        """Where a key goes whose probe found EMPTY entry ``pos`` taken by this group: the next
        EMPTY entry on its path that the group has not taken, or -1 when the group holds the key
        already. (A READY entry past an EMPTY one is never this key: its probe passed non-EMPTY
        entries only, and none is ever emptied; so only the group's own entries are compared.)"""
        words = index.words
        for _ in range(index.capacity):
            taken = self.positions.get(pos)
            if taken == (w1, kb):
                return -1
            if taken is None and not words[pos, 0]:
                return pos
            pos = (pos + 1) & index.mask
        raise index.corrupt()

    def next_chunk(self, cls: int, bump: int) -> int:
        """The chunk of ``cls`` the next record gets (``bump``: the class's bump in shared memory)."""
        b = self.bumps.get(cls)
        return bump if b is None else b[1]

    def allocate(self, gen: Generation, pos: int, w1: int, kb: bytes, cls: int, chunk: int, w0: int) -> None:
        """Note a record in the intent before its bytes are written: entry ``pos`` gets key
        ``w1``/``kb``, ``w0`` and chunk ``chunk`` of class ``cls`` (from :meth:`next_chunk`)."""
        if not self.positions:
            self.gen = gen
            gen.group_begin()
        assert gen is self.gen, "a group is published before its table grows"
        gen.group_record(len(self.positions), pos, cls, w0)
        self.positions[pos] = (w1, kb)
        b = self.bumps.get(cls)
        if b is None:
            gen.group_class(len(self.bumps), cls, chunk)
            self.bumps[cls] = [chunk, chunk + 1]
        else:
            b[1] += 1
        self.bytes += entry_length(w0)

    def allocate_run(self, gen: Generation, pos: np.ndarray, w1: np.ndarray, cls: int, chunk: int,
                     w0: list[int], nbytes: int) -> None:
        """:meth:`allocate` of a run of records of one size class (int keys): entries ``pos`` get
        keys ``w1``, state words ``w0`` and chunks ``chunk``, ``chunk + 1``, ... (from
        :meth:`next_chunk`), noted in the intent in one go; ``nbytes``: their lengths' sum."""
        n = len(pos)
        if not self.positions:
            self.gen = gen
            gen.group_begin()
        assert gen is self.gen, "a group is published before its table grows"
        assert len(self.positions) + n <= GROUP_RECORDS, "a run fits in its group"
        at = pos.tolist()
        gen.group_record_run(len(self.positions), at, cls, w0)
        self.positions.update(zip(at, zip(w1.tolist(), [b""] * n)))
        b = self.bumps.get(cls)
        if b is None:
            gen.group_class(len(self.bumps), cls, chunk)
            self.bumps[cls] = [chunk, chunk + n]
        else:
            b[1] += n
        self.bytes += nbytes

    def flush(self) -> None:
        """Publish the group's records (steps 2-5); nothing to do when it has none."""
        if not self.positions:
            return
        gen, n = self.gen, len(self.positions)
        items, total, _ = gen.mem_totals()
        table_items = gen.table_items()
        ordering.fence()  # A: bytes, w1 and w2, committed counts, class and layout records
        if _CRASH_TESTS:
            crash_point("group_fenced")
        gen.group_publishing(items + n, total + self.bytes, table_items + n)
        finish(gen)
        self.positions.clear()
        self.bumps.clear()
        self.bytes = 0

    def abandon(self, corrupt: Callable[..., CorruptSegment]) -> None:
        """After an exception in the middle of a group: what a repair would do (undo it before its
        fence, finish it after)."""
        if self.positions and self.gen.group_phase():
            repair(self.gen, corrupt, dead=False)
        self.positions.clear()
        self.bumps.clear()
        self.bytes = 0


def finish(gen: Generation) -> None:
    """Steps 3-5 of a group in phase 2 (its writer, or the repair of a dead one)."""
    ci = gen.group_intent(records=False)
    pos, cls_of, w0 = gen.group_records()
    for cls, bump in ci.classes:
        gen.classes.set_bump(cls, bump + int(np.count_nonzero(cls_of == np.uint64(cls))))
    if _CRASH_TESTS:
        crash_point("group_bumped")
    ordering.fence()  # B: the bumps before the entries that point below them
    index = gen.index
    if _CRASH_TESTS:  # one record at a time, to die between two of them
        for p, w in zip(pos.tolist(), w0.tolist()):
            crash_point("group_publishing")
            index.ready(p, w)  # the same word again where a dead writer published it already
    elif len(pos):  # the same stores, one numpy assignment (TableView.ready_many)
        index.ready_many(pos, w0)
    if _CRASH_TESTS:
        crash_point("group_published")
    gen.apply_totals(Intent(2, 0, 0, 0, ci.items, ci.total, 0, ci.table_items))
    gen.group_end()


def repair(gen: Generation, corrupt: Callable[..., CorruptSegment], dead: bool = True) -> int:
    """Undo (phase 1) or finish (phase 2) the group in generation ``g``'s intent (caller holds the
    lock); the number of chunks given back. ``corrupt``: the view's ``corrupt``, for an intent no
    writer can leave (damage: touch nothing; gc drops the generation)."""
    ci = gen.group_intent()
    wrong = impossible(gen, ci)
    if wrong:
        raise corrupt(f"the group intent record in {gen.meta.name} is impossible: {wrong}")
    if ci.phase == 1:  # nothing published, no bump moved: forget the words staged in EMPTY entries
        for pos, _, _ in ci.records:
            gen.index.stage(pos, 0, 0)
        gen.group_end()
        reclaimed = len(ci.records)
    else:
        finish(gen)
        reclaimed = 0
    if dead:
        log.info("cache %s: repaired a publish group of %d records left by a dead writer (%s)", gen.meta.name,
                 len(ci.records), "gave its chunks back" if reclaimed else "published them")
    return reclaimed


def impossible(gen: Generation, ci: GroupIntent) -> str:
    """Why the group intent cannot be one a writer left (NOTE [publish order]), or "". Phase 1:
    no entry of it filled and no bump moved; phase 2: its classes' bumps where they were or past
    its records, its entries EMPTY or holding its w0, their staged chunks those it took, the
    totals the current ones or its records more."""
    if ci.phase not in (1, 2):
        return f"phase {ci.phase} (a writer writes 1 or 2)"
    if gen.intent().phase:
        return "the record intent is in use too (a writer uses one at a time)"
    n, n_cls = gen.group_counts()
    if n > GROUP_RECORDS or n_cls > n or (ci.phase == 2 and not n):
        return f"{n} records in {n_cls} size classes in phase {ci.phase} (at most {GROUP_RECORDS} records)"
    words, count, seen = gen.index.words, Counter(), set()
    for pos, cls, w0 in ci.records:
        if pos >= gen.index.capacity or pos in seen:
            return f"table position {pos} (twice, or past the table's {gen.index.capacity} entries)"
        seen.add(pos)
        count[cls] += 1
        size = gen.classes.chunk_size(cls) if 0 < cls < MAX_CLASSES else 0
        if not size or w0 & (READY | SPILLED) != READY or not codec.MIN_RECORD_BYTES <= entry_length(w0) <= size:
            return f"a record of {entry_length(w0)} bytes in size class {cls} (chunks of {size} bytes), state {w0:#x}"
        now = int(words[pos, 0])
        if now and (ci.phase == 1 or now != w0):
            return f"entry {pos} of {gen.table.name} holds {now:#x} in phase {ci.phase}"
    olds = {}
    for cls, old in ci.classes:
        if cls in olds or cls not in count:
            return f"a class word for size class {cls}, which holds none of its records or another word"
        olds[cls] = old
        _, bump, committed = gen.classes.get(cls)
        if ci.phase == 1:  # no bump moves before phase 2
            ok = bump == old
        else:  # where it was, or past the group's records; committed for all of them
            ok = bump in (old, old + count[cls]) and old + count[cls] <= committed
        if not ok:
            return (f"size class {cls} with bump {bump} and {committed} chunks committed, for "
                    f"{count[cls]} records from chunk {old} in phase {ci.phase}")
    if ci.phase == 1:
        return ""
    if set(olds) != set(count):
        return "a record whose size class has no class word in phase 2"
    located = set()
    for pos, cls, _ in ci.records:
        w2 = int(words[pos, 2])
        located.add(w2)
        if entry_class(w2) != cls or not olds[cls] <= entry_chunk(w2) < olds[cls] + count[cls]:
            return f"entry {pos} of {gen.table.name} locates its record at {w2:#x}, not in the group's chunks"
    if len(located) != n:
        return "two of its entries locate the same chunk"
    now_items, now_total, _ = gen.mem_totals()
    now_table = gen.table_items()
    most = sum(entry_length(w0) for _, _, w0 in ci.records)
    if not (0 <= ci.items - now_items <= n and 0 <= ci.table_items - now_table <= n
            and 0 <= ci.total - now_total <= most):
        return (f"totals of {ci.items} items, {ci.total} bytes and {ci.table_items} entries after a group of "
                f"{n} to {now_items} items, {now_total} bytes and {now_table} entries")
    return ""
