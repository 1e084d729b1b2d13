"""The vectorised batch gather: a batch of int keys that are all in memory with one layout and
one size class is copied out of the class segment's chunks (chunk k at ``k x chunk size``) with
``np.take(mode="clip")``, straight into ``out=`` buffers when given:
small records whole through a per-thread scratch, then field by field; larger fields one take
each, in units that divide both the chunk and the field, or a copy per row for large fields.

The store (``CacheStore.gather_ints``) maps the generation, checks the batch's entries as a
reader checks one (NOTE [publish order], Damage) and counts the hits; this module finds the
batch (``plan``), copies its columns (``columns``) and recycles large output buffers.
"""

from __future__ import annotations

import math
import sys
import threading
from typing import NamedTuple

import numpy as np

from . import codec, process_slot
from .allocator import DATA_OFF
from .index import INLINE24, READY, SPILLED, TableView, entry_chunk, entry_class, entry_layout, entry_length

__all__ = ["Batch", "plan", "uniform", "columns", "out_matches", "BatchBuffers", "gather_leaf"]

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

    Fields of ``LOOP_BYTES`` and more: one copy per row (a memcpy each; measured 3-6% faster than
    a take in 1 KB units for 150 KB rows). Smaller ones: ``np.take`` needs a C-contiguous source,
    so the rows are read through a view in units of ``g`` bytes, g the largest that divides both
    the chunk and the field: the field of row c is units ``c x chunk/g`` on, ``nbytes/g`` of them,
    one take into ``dst`` seen as units too. Units under ``MIN_UNIT`` bytes would make take copy
    piece by piece: one fancy-index copy through a temporary then."""
    n, nbytes = dst.shape
    chunk = rows.shape[1]
    if not nbytes:  # an empty field: nothing to copy
        return
    if nbytes >= LOOP_BYTES:
        column = rows[:, offset:offset + nbytes]
        for i, c in enumerate(chunks.tolist()):
            dst[i] = column[c]
        return
    g = math.gcd(chunk, nbytes)
    if g >= MIN_UNIT or g == nbytes:
        # the last unit of the last chunk ends inside it: offset + nbytes <= chunk (the caller's checks)
        units = np.ndarray(((rows.nbytes - offset) // g, g), np.uint8, rows, offset)
        step, per = chunk // g, nbytes // g
        if per == 1:
            np.take(units, chunks * step, axis=0, out=dst, mode="clip")
        else:
            idx = (chunks * step)[:, None] + np.arange(per)
            np.take(units, idx, axis=0, out=dst.reshape(n, per, g), mode="clip")
        return
    dst[...] = rows[:, offset:offset + nbytes][chunks]
