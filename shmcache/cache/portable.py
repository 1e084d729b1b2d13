"""A cache's records as portable records (NOTE [tiers]): what a snapshot export reads.

``records`` walks the current generation's index without the lock, as every read does, and yields
each item as ``(portable key, portable record)``: the key word and key bytes, and the codec record
with its layout inline (a record whose layout is interned in the meta segment gets it copied in).
The other way, an import, is a write: ``CacheStore.put_records``.
"""

from __future__ import annotations

from typing import Any

from ..errors import SnapshotError
from . import codec
from .generation import Generation
from .index import INLINE24, INT_KEY, SPILLED, entry_layout, entry_length
from .indexed_tier import RecordLocation
from .view import CacheView

__all__ = ["records", "portable"]



def records(view: CacheView):
    """Every item of the current generation ``view`` maps as ``(portable key, portable record)``; the
    record is None for a spilled one that fails its checks (damaged: the caller counts it).
    Lock-free, like every read: items stored meanwhile may or may not be included. SnapshotError
    when a clear() or destroy replaced the generation under the walk (what was read is not one
    state)."""
    gen = view.refresh()
    spill = view.spill
    try:
        for w0, w1, w2 in gen.index.entries():
            kb = b""
            if w0 & SPILLED:
                if spill is None:
                    yield w1.to_bytes(8, "little"), None
                    continue
                if not w0 & INT_KEY:
                    kb = spill.key_of(RecordLocation(w2, entry_length(w0)), w1)
                rec = None if kb is None else view.read_spilled(w0, w2, w1, kb, gen.gen)
                if rec is None:
                    yield w1.to_bytes(8, "little") + (kb or b""), None
                    continue
            else:
                rec = view.record(gen, w0, w2, w1, b"")
                if not w0 & INT_KEY:
                    kb = bytes(codec.record_key(rec))
            yield w1.to_bytes(8, "little") + kb, portable(view, gen, w0, rec, kb)
    except FileNotFoundError:  # a segment of this generation was unlinked: cleared under us
        pass
    if not view.is_current(gen.gen):
        raise SnapshotError(f"cache {view.session}/{view.name} was cleared or destroyed while it was "
                            f"read; export it again when nothing clears it")


def portable(view: CacheView, gen: Generation, w0: int, rec: Any, kb: bytes) -> bytes | bytearray:
    """A stored record with its layout inline (a record whose layout is inline already is one)."""
    lid = entry_layout(w0)
    if lid == INLINE24:
        return bytes(rec)
    layout = view.layout(gen, lid)[0]
    body = len(rec) - len(kb)
    out = bytearray(body + len(layout) + len(kb))
    codec.RECORD_HEADER.pack_into(out, 0, codec.INLINE, len(kb), len(layout), 0)
    out[codec.MIN_RECORD_BYTES:body] = rec[codec.MIN_RECORD_BYTES:body]
    out[body:body + len(layout)] = layout
    out[body + len(layout):] = kb
    return out
