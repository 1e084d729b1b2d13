"""The vectorised batch gather: a batch of int keys that are all in memory with one layout and
one size class is copied out of the class segment's chunks (chunk k at ``k x chunk size``) with
``np.take(mode="clip")``, straight into ``out=`` buffers when given:
small records whole through a per-thread scratch, then field by field; larger fields one take
each, in units that divide both the chunk and the field, or a copy per row for large fields.
Where the compiled row copy is built (``base.rowcopy``), a field is one call of it instead: a
memcpy per row, straight from the chunks into the column.

The read side (``CacheView.gather_ints``) maps the generation, checks the batch's entries as a
reader checks one (NOTE [publish order], Damage) and counts the hits; this module finds the
batch (``plan``), copies its columns (``columns``) and recycles large output buffers.

A warm batch of a single-layout cache takes a shorter way (issue 27): once a batch went the way
above, its layout, size class and the chunks then handed out are kept as a :class:`Plan` (in the
generation's ``columns``, so it goes with the generation), and the next batch is looked up,
checked and copied in a fixed handful of numpy calls (:func:`gather_planned`): every entry's state
word in one gather, all three words again in another, the checks in one subtract and one compare
(with the compiled row copy: one pass, ``rowcopy.match``), and each field with one fancy index of
a view that strides over the class's chunks. Anything that is not exactly the plan's - another
layout or length, a spilled entry, a key past the table, a chunk past those handed out, another
class, a key word that differs - sends the batch the way above, which reads the class record again
and names any damage.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import NamedTuple

import numpy as np

from ..base import rowcopy
from ..base.shm import WORD
from . import codec, process_slot
from .allocator import DATA_OFF
from .index import (
    ENTRY_BYTES,
    INLINE24,
    READY,
    SPILLED,
    TABLE_OFF,
    TableView,
    entry_chunk,
    entry_class,
    entry_layout,
    entry_length,
    location_word,
)

_TRUE = np.True_.tobytes()
PLAN = "gather plan"  # the key of a generation's ``columns`` dict that holds its Plan (store._columns)

__all__ = ["Batch", "plan", "uniform", "columns", "out_matches", "BatchBuffers", "gather_leaf", "Plan",
           "PLAN", "gather_planned", "planned_chunks", "plannable", "remember"]

GATHERED = ("i", "f", "b", "a", "e")  # leaf tags copied as bytes (the rest decode per item)
SCRATCH_BYTES = 2 << 20  # a batch of whole records up to this is gathered through a scratch (columns)
MIN_UNIT = 256  # gather_rows: the smallest unit np.take copies well
LOOP_BYTES = 16384  # gather_rows: fields this large are copied row by row


class Batch(NamedTuple):
    """A batch that can be gathered: its keys' shared layout, size class and record length, and
    each key's chunk."""

    layout: int
    cls: int
    length: int
    chunks: np.ndarray  # intp, one per key


def plan(index: TableView, keys: np.ndarray) -> Batch | None:
    """The batch of int64 ``keys`` (not empty) if every one is in memory with one interned
    layout and one size class; None otherwise (the caller takes the per-item path)."""
    w0, w2 = index.lookup_ints(keys)
    if not uniform(w0, w2):
        return None
    first0, first2 = int(w0[0]), int(w2[0])
    lid = entry_layout(first0)  # index's accessors: a few calls per batch, none per key
    if lid == INLINE24:
        return None
    return Batch(lid, entry_class(first2), entry_length(first0), entry_chunk(w2).astype(np.intp))


def uniform(w0: np.ndarray, w2: np.ndarray) -> bool:
    """All present, in memory, one layout, one class: the w0 words are equal (READY set; one layout
    and int keys make one record length), and the w2 words agree on the class bits."""
    first0 = int(w0[0])
    return bool(first0 & READY) and not first0 & SPILLED and not (w0 != w0[0]).any() \
        and not entry_class(w2 ^ w2[0]).any()


def columns(buf, handed_out: int, chunk: int, chunks: np.ndarray, leaves: list, out: list | None,
            buffers: BatchBuffers) -> list:
    """One stacked array per leaf of the records at ``chunks`` of a class segment (``buf``, chunks
    of ``chunk`` bytes, ``handed_out`` of them: checked by the caller, so every index is in range
    and ``np.take``'s ``mode="clip"`` never clips); ``out``: one array per leaf to gather into.

    Small records (a batch of whole chunks up to ``SCRATCH_BYTES``) are gathered whole, with one
    ``np.take`` into a per-thread scratch that stays in cache, and each field is copied out of it:
    the random reads of shared memory (a TLB miss and a cache miss per record) are paid once per
    record, not once per field. Larger ones are gathered field by field (:func:`gather_rows`)."""
    rows = np.ndarray((handed_out, chunk), np.uint8, buf, DATA_OFF)
    n = len(chunks)
    if n * chunk <= SCRATCH_BYTES:
        scratch = buffers.scratch(n, chunk)
        # the keys were checked (every chunk handed out): clip never clips, and without it take buffers
        np.take(rows, chunks, axis=0, out=scratch, mode="clip")
        return [_from_scratch(scratch, rows, chunks, leaf, out[i] if out is not None else None)
                for i, leaf in enumerate(leaves)]
    return [gather_leaf(rows, chunks, leaf, out[i] if out is not None else None, buffers)
            for i, leaf in enumerate(leaves)]


def _from_scratch(scratch: np.ndarray, rows: np.ndarray, chunks: np.ndarray, leaf: codec.Leaf, out):
    """One field of the batch out of the scratch rows (``columns``): a copy from cache."""
    n = len(chunks)
    if leaf.tag == "n":
        return None
    if leaf.tag not in GATHERED:
        decode = codec.leaf_decoder(leaf)  # str / bytes / pickle: per item
        return [decode(rows[c]) for c in chunks]
    column = scratch[:, leaf.offset:leaf.offset + leaf.nbytes]
    if out is not None:
        np.copyto(out.reshape(n, -1).view(np.uint8), column)
        return out
    flat = column.copy()
    if leaf.tag == "e":
        return flat
    return flat.view(leaf.dtype).reshape((n, *leaf.shape))


def out_matches(layout: tuple, n: int, out: list, dtypes: list, shapes: list) -> bool:
    """True if ``out`` (one array per leaf, in the record's leaf order; ``dtypes``: the torch
    dtype name of a tensor out, else None; ``shapes``: their shapes) can receive a batch of
    ``n`` records of ``layout`` (what ``batch_layout`` returned) byte for byte."""
    leaves = layout[1]
    if len(out) != len(leaves):
        return False
    for arr, dtype, arr_shape, leaf in zip(out, dtypes, shapes, leaves):
        if leaf.tag not in GATHERED or not arr.flags.c_contiguous:
            return False
        if arr_shape != (n, *leaf.shape):
            return False
        if leaf.tag == "e":
            if dtype != leaf.meta.split(":", 1)[0] or arr.nbytes != n * leaf.nbytes:
                return False
        elif arr.dtype != leaf.dtype:
            return False
    return True


class BatchBuffers:
    """Recycled output buffers for large batches gathered without ``out=``.

    A fresh batch above glibc's mmap threshold (32 MiB: 256 images of 150 KB) is new memory every
    time, and the page faults of its first touch cost as much as the copy itself. A buffer is
    handed out again once nothing references it any more - the batch (and every tensor or view
    made from it) was dropped: its reference count is back to the pool's own.
    """

    MIN_BYTES = 4 << 20
    PER_SHAPE = 4

    def __init__(self):
        self._free: dict[tuple, list[np.ndarray]] = {}
        # what the count reads for a buffer only the pool holds, measured through the same code
        # path (so it holds whatever an interpreter version borrows or adds)
        self._alone = _refs([np.empty(1)], 0)
        # a DataLoader's pin-memory thread gathers batches sent by workers as keys, next to the
        # main thread (NOTE [collated batch]): two must never take one buffer
        self._lock = threading.Lock()
        self._lock_gen = process_slot.fork_count()
        self._local = threading.local()

    def scratch(self, n: int, chunk: int) -> np.ndarray:
        """A ``(n, chunk)`` scratch of this thread's (a DataLoader's pin-memory thread gathers next
        to the main thread), overwritten by its next batch: never handed out."""
        local = self._local
        buf = getattr(local, "buf", None)
        if buf is None or buf.nbytes < n * chunk:
            buf = local.buf = np.empty(max(n * chunk, 1 << 16), np.uint8)
        return buf[:n * chunk].reshape(n, chunk)

    def take(self, shape: tuple) -> np.ndarray:
        if self._lock_gen != process_slot.fork_count():  # forked: a thread of the parent may have held it
            self._lock, self._lock_gen = threading.Lock(), process_slot.fork_count()
        with self._lock:
            return self._take(shape)

    def _take(self, shape: tuple) -> np.ndarray:
        pool = self._free.setdefault(shape, [])
        for i in range(len(pool)):
            if _refs(pool, i) <= self._alone:
                return pool[i]
        arr = np.empty(shape, np.uint8)
        if len(pool) >= self.PER_SHAPE:
            pool.pop(0)  # forget the oldest (whoever holds it keeps it alive)
        pool.append(arr)
        return arr


def _refs(pool: list, i: int) -> int:
    return sys.getrefcount(pool[i])


def gather_leaf(rows: np.ndarray, chunks: np.ndarray, leaf: codec.Leaf, out, buffers: BatchBuffers):
    """One field of every record in the batch, stacked: a single vectorised copy."""
    n = len(chunks)
    if leaf.tag == "n":
        return None
    if leaf.tag in GATHERED:
        if out is not None:
            gather_rows(rows, leaf.offset, chunks, out.reshape(n, -1).view(np.uint8))
            return out
        if n * leaf.nbytes >= BatchBuffers.MIN_BYTES:
            flat = buffers.take((n, leaf.nbytes))
        else:
            flat = np.empty((n, leaf.nbytes), np.uint8)
        gather_rows(rows, leaf.offset, chunks, flat)
        if leaf.tag == "e":
            return flat
        return flat.view(leaf.dtype).reshape((n, *leaf.shape))
    decode = codec.leaf_decoder(leaf)  # str / bytes / pickle: per item
    return [decode(rows[c]) for c in chunks]


def gather_rows(rows: np.ndarray, offset: int, chunks: np.ndarray, dst: np.ndarray) -> None:
    """Gather the bytes ``offset`` to ``offset + dst.shape[1]`` of rows ``chunks`` of ``rows`` (a
    class segment's chunks, C-contiguous) into ``dst``, without a temporary.

    Fields of ``LOOP_BYTES`` and more: one copy per row (a memcpy each; measured 3-6% faster than a
    take in 1 KB units for 150 KB rows). Smaller ones: ``np.take`` needs a C-contiguous source, so
    the rows are read through a view in units of ``unit`` bytes, the largest number that divides
    both the chunk and the field: the field of row c is units ``c x chunk/unit`` on, ``nbytes/unit``
    of them, one take into ``dst`` seen as units too. Units under ``MIN_UNIT`` bytes would make take
    copy piece by piece: one fancy-index copy through a temporary then."""
    n, nbytes = dst.shape
    chunk = rows.shape[1]
    if not nbytes:  # an empty field: nothing to copy
        return
    if rowcopy.NATIVE:  # a memcpy per row, straight into dst
        rowcopy.gather(rows, offset, chunk, nbytes, chunks, dst)
        return
    if nbytes >= LOOP_BYTES:
        column = rows[:, offset:offset + nbytes]
        for i, c in enumerate(chunks.tolist()):
            dst[i] = column[c]
        return
    unit = math.gcd(chunk, nbytes)
    if unit >= MIN_UNIT or unit == nbytes:
        # the last unit of the last chunk ends inside it: offset + nbytes <= chunk (the caller's checks)
        units = np.ndarray(((rows.nbytes - offset) // unit, unit), np.uint8, rows, offset)
        step, per = chunk // unit, nbytes // unit
        if per == 1:
            np.take(units, chunks * step, axis=0, out=dst, mode="clip")
        else:
            idx = (chunks * step)[:, None] + np.arange(per)
            np.take(units, idx, axis=0, out=dst.reshape(n, per, unit), mode="clip")
        return
    dst[...] = rows[:, offset:offset + nbytes][chunks]


# --- the planned batch (issue 27): a warm batch of a single-layout cache --------------------------


def plannable(leaves: list) -> bool:
    """True if a batch of records of ``leaves`` can be gathered by a :class:`Plan`: every leaf is
    copied as bytes (or is None); str, bytes and pickled leaves decode per item."""
    return all(leaf.tag in GATHERED or leaf.tag == "n" for leaf in leaves)


class Field(NamedTuple):
    """One leaf of a Plan: where it sits in a record, how its column is copied out of the class
    segment, and what the column is."""

    offset: int  # in the record
    nbytes: int
    dtype: np.dtype  # the column's dtype and row shape (an extension leaf: its bytes, (nbytes,))
    shape: tuple
    item: np.dtype  # what numpy copies a row as: the dtype of a scalar, else V<nbytes> (one memcpy)
    items: np.ndarray  # one item per chunk handed out: the field (a view over the class segment)
    rows: np.ndarray | None  # the same bytes as (chunks, nbytes) uint8 rows, for fields copied row by row
    records: np.ndarray  # every chunk handed out, whole: (chunks, chunk size) uint8 (rowcopy's source)


class Plan:
    """How the batches of one layout in one size class are gathered while nothing changes: the
    state word every entry has (READY | INT_KEY, the layout, the length: one interned layout and
    int keys make one record length), the class, the chunks handed out when it was made, and per
    leaf a view that strides over those chunks (:class:`Field`). Made by the store after a batch
    passed every check of the long way (``CacheStore.gather_ints``): the length within the chunk
    and covering the layout, the chunks handed out. Never changed once made (only the arrays its
    checks work in are per thread); a batch that does not fit it goes the long way again."""

    __slots__ = ("w0", "base", "handed_out", "layout", "tree", "leaves", "fields", "_w0_bytes", "_limit",
                 "_local")

    def __init__(self, w0: int, cls: int, handed_out: int, chunk: int, buf, layout: tuple):
        self.w0 = w0
        self.base = location_word(cls, 0)
        self.handed_out = handed_out
        self.layout = layout  # (tree, leaves, end of the last leaf): what CacheStore.batch_layout returns
        self.tree, self.leaves = layout[0], layout[1]
        records = np.ndarray((handed_out, chunk), np.uint8, buf, DATA_OFF)  # every field's rowcopy source
        self.fields = [None if leaf.tag == "n" else _field(buf, handed_out, chunk, leaf, records)
                       for leaf in self.leaves]
        self._w0_bytes = np.array([w0], np.uint64).tobytes()
        # the entry words a batch must have, less what it must be below: (w0, key, chunk) - (w0, key,
        # class << 48) < (1, 1, handed_out), row by row (gather_planned)
        self._limit = np.array([1, 1, handed_out], np.uint64)
        self._local = threading.local()  # per thread: the arrays of the checks (want)

    def want(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """This thread's ``(n, 3)`` uint64 rows ``(w0, key, class << 48)`` (the batch's keys go in
        the middle column), an ``(n, 3)`` array for the entries' words and one of bools (a
        DataLoader's pin-memory thread gathers next to the main thread)."""
        local = self._local
        want = getattr(local, "want", None)
        if want is None or len(want) < n:
            want = local.want = np.empty((max(n, 256), 3), np.uint64)
            want[:, 0], want[:, 2] = self.w0, self.base
            local.words = np.empty_like(want)
            local.ok = np.empty(want.shape, np.bool_)
        return want[:n], local.words[:n], local.ok[:n]

    def chunks(self, n: int) -> np.ndarray:
        """This thread's intp array of ``n`` for the chunks of a batch (the compiled checks')."""
        local = self._local
        chunks = getattr(local, "chunks", None)
        if chunks is None or len(chunks) < n:
            chunks = local.chunks = np.empty(max(n, 256), np.intp)
        return chunks[:n]

    def holds(self, index: TableView, key: int) -> bool:
        """True if int ``key`` sits at its own position with the plan's state word (a scalar
        probe: w0 first, then the key word), so a batch from it has the plan's layout."""
        if not 0 <= key < index.capacity:
            return False
        off = TABLE_OFF + ENTRY_BYTES * key
        return WORD.unpack_from(index.buf, off)[0] == self.w0 and WORD.unpack_from(index.buf, off + 8)[0] == key


def remember(columns: dict, w0: int, cls: int, handed_out: int, chunk: int, buf, layout: tuple) -> None:
    """Keep the Plan of a batch that passed every check of the long way in ``columns`` (the
    generation's dict: the plan goes with the generation), unless the one there is the same
    (a batch of keys past the table's capacity goes the long way every time: no new plan each)."""
    old = columns.get(PLAN)
    if old is not None and (old.w0, old.base, old.handed_out) == (w0, location_word(cls, 0), handed_out):
        return
    if plannable(layout[1]):
        columns[PLAN] = Plan(w0, cls, handed_out, chunk, buf, layout)


def _field(buf, handed_out: int, chunk: int, leaf: codec.Leaf, records: np.ndarray) -> Field:
    """Leaf ``leaf`` of every chunk handed out, over the class segment ``buf`` (views: nothing is
    copied). A field of one scalar is an item of its dtype; a larger one an opaque item of its
    bytes (``V<nbytes>``): numpy then copies each with one memcpy, where an item of many small
    elements (an image's 3-byte pixels) is copied element by element."""
    dtype, shape = (np.dtype(np.uint8), (leaf.nbytes,)) if leaf.tag == "e" else (leaf.dtype, tuple(leaf.shape))
    offset, nbytes = DATA_OFF + leaf.offset, leaf.nbytes
    item = dtype if not shape or not nbytes else np.dtype((np.void, nbytes))
    if item is dtype:
        inner = [dtype.itemsize] * len(shape)  # C-contiguous within the field (empty: any)
        items = np.ndarray((handed_out, *shape), dtype, buf, offset, (chunk, *inner))
    else:
        items = np.ndarray((handed_out,), item, buf, offset, (chunk,))
    rows = np.ndarray((handed_out, nbytes), np.uint8, buf, offset, (chunk, 1)) if nbytes >= LOOP_BYTES else None
    return Field(leaf.offset, nbytes, dtype, shape, item, items, rows, records)


def gather_planned(plan: Plan, words: np.ndarray, keys: np.ndarray, out: list | None,
                   buffers: BatchBuffers) -> list | None:
    """The columns of the batch of int64 ``keys`` (one per leaf, into ``out`` when given: matched
    by the caller, ``out_matches``) if every key's entry is exactly what ``plan`` expects; None
    otherwise, having written nothing (the caller takes the long way, which names any damage).

    ``words``: the index table's ``(capacity, 3)`` words (index.TableView.words). The entry checks
    of a reader (NOTE [publish order], Damage; CacheView.record), vectorised:

    * the state words are gathered first, on their own (TableView.find: w0 before w1 and w2), and must
      all be ``plan.w0``: READY, an int key, not spilled, the plan's layout and length (checked
      against the chunk size and the layout's end when the plan was made);
    * a key below the table's capacity sits at its own position (TableView.lookup_ints); one past it raises
      IndexError here and goes the long way (which probes); a negative one wraps to another
      position, which the key word then rules out unless it is that key's entry;
    * all three words again (a second gather, after every state word was loaded), minus
      ``(w0, key, class << 48)``, compared with ``(1, 1, handed out)`` in one ``np.less``: the
      state word again, every key word equal, every chunk below the chunks handed out when the
      plan was made (a chunk of another class wraps around to a huge number).

    With the compiled row copy (``rowcopy.NATIVE``) the same checks are one pass over the keys
    (``rowcopy.match``): each entry's state word loaded first, then its other two; a negative key
    or one past the table is refused there (the long way then probes for it).

    Each field is then copied straight from the class segment with one fancy index (into ``out=``
    by way of it and one ``np.copyto``: numpy has no gather from a strided source into ``out=``),
    a field of ``LOOP_BYTES`` or more one row at a time (:func:`_copy_rows`); with the compiled
    row copy, every field into ``out=`` in one pass.
    """
    n = len(keys)
    chunks = planned_chunks(plan, words, keys)
    if chunks is None:
        return None
    # field by field straight from the class segment, one fancy index each: measured faster than
    # whole records through a scratch (columns) even for records of nine fields
    if out is None:
        return [f and _new_column(f, chunks, n, buffers) for f in plan.fields]
    for f, dst in zip(plan.fields, out):
        if f is not None:
            _copy_rows(f, chunks, dst)
    return [f and dst for f, dst in zip(plan.fields, out)]


def planned_chunks(plan: Plan, words: np.ndarray, keys: np.ndarray) -> np.ndarray | None:
    """The chunks (intp) of the batch of int64 ``keys`` if every entry is exactly what ``plan``
    expects (the checks of :func:`gather_planned`), else None."""
    n = len(keys)
    if rowcopy.NATIVE:  # the same checks, fused into one compiled pass over the keys
        chunks = plan.chunks(n)
        return chunks if rowcopy.match(words, keys, plan.w0, plan.base, plan.handed_out, chunks) else None
    try:
        s0 = words[keys, 0]  # first, in its own gather
    except IndexError:
        return None
    if s0.tobytes() != plan._w0_bytes * n:
        return None
    want, got, ok = plan.want(n)
    want[:, 1] = keys
    words.take(keys, 0, got)  # all three words again: w1 and w2 after every w0 above (raises if out of range)
    np.subtract(got, want, out=got)
    if np.less(got, plan._limit, out=ok).tobytes() != _TRUE * (3 * n):
        return None
    return got[:, 2].view(np.intp)  # below handed_out: the same number as an intp


def _new_column(f: Field, chunks: np.ndarray, n: int, buffers: BatchBuffers) -> np.ndarray:
    """A new column of rows ``chunks`` of ``f``: one fancy index (a memcpy per row) for a small
    batch, or the compiled row copy (which asks for each next row ahead: faster from memory the
    CPU caches do not hold); a large one into a recycled buffer (BatchBuffers)."""
    if n * f.nbytes < BatchBuffers.MIN_BYTES:
        if rowcopy.NATIVE:
            col = np.empty((n, *f.shape), f.dtype)
            _copy_rows(f, chunks, col)
            return col
        col = f.items[chunks]
        return col if f.item is f.dtype else np.ndarray((n, *f.shape), f.dtype, col)
    dst = buffers.take((n, f.nbytes))
    _copy_rows(f, chunks, dst)
    return np.ndarray((n, *f.shape), f.dtype, dst)


def _copy_rows(f: Field, chunks: np.ndarray, dst: np.ndarray) -> None:
    """Rows ``chunks`` of ``f`` into ``dst`` (C-contiguous, as many bytes as the batch's field):
    a fancy index and one copy, or one copy per row for fields of ``LOOP_BYTES`` and more (no
    temporary as large as the batch); with rowcopy, one memcpy per row, straight into ``dst``."""
    if rowcopy.NATIVE:
        rowcopy.gather(f.records, f.offset, f.records.shape[1], f.nbytes, chunks, dst)
        return
    n = len(chunks)
    if f.rows is not None:
        rows, flat = f.rows, np.ndarray((n, f.nbytes), np.uint8, dst)
        for i, c in enumerate(chunks.tolist()):
            flat[i] = rows[c]
    else:
        np.copyto(np.ndarray((n, *f.items.shape[1:]), f.item, dst), f.items[chunks])
