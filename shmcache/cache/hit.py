"""The hit of an int key, compiled: ``CacheView.lookup``'s hot path in one call (issue 27).

A warm ``ds[i]`` was three Python calls and some thirty bytecodes of checks around one copy of
the record: about 4x ``arr[i].copy()``. ``_hit.c`` makes the same checks in the same order - the
root's epoch word; the entry's state word first, on its own, then its key and location words
(NOTE [publish order]); the class and the layout mapped in this process; the chunk among those
handed out, the length within the chunk and covering the layout - copies the record into a
bytearray, calls the layout's decoder on it and counts the hit. Whatever is not exactly that case
it answers with ``LONG_WAY``, and the lookup goes the long way (``CacheView.find`` and
``decode``), which reads everything again and names any damage. So the compiled part holds no
rule of its own: the entry's shifts and masks come from ``cache.index``'s packers below, the
class and layout records from the view's own dicts, the counters from the view's ``count``.

It is built at install where a C compiler is present, like ``base.rowcopy``; without it, or with
``SHMCACHE_NATIVE=0``, ``NATIVE`` is False and the lookup takes its Python hot path, which gives
the same values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..base import settings
from .allocator import DATA_OFF
from .generation import RootLayout
from .index import ENTRY_BYTES, INLINE24, INT_KEY, LOCATION_MASK, READY, SPILLED, TABLE_OFF, location_word, state_word

__all__ = ["NATIVE", "reader", "unavailable_reason", "LONG_WAY", "ABSENT"]

try:
    from . import _hit
except ImportError:  # no C compiler at install, or a source checkout never built
    _hit = None
_why = settings.native_unavailable(_hit is not None, "the compiled hit")
NATIVE = not _why

# the entry's fields, from index's packers (its one definition of them): where each starts
_LAYOUT_SHIFT = state_word(0, 1, 0).bit_length() - 1
_LENGTH_SHIFT = state_word(0, 0, 1).bit_length() - 1
_CLASS_SHIFT = location_word(1, 0).bit_length() - 1


def unavailable_reason() -> str:
    """Why the compiled hit is not used, and what to do ('' when it is used)."""
    return _why


class _Answer:
    """get's answer where it has no value: LONG_WAY or ABSENT (never a cached value)."""

    __slots__ = ("name",)

    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return self.name


LONG_WAY = _Answer("LONG_WAY")  # anything but the hot path's case: the lookup goes the long way
ABSENT = _Answer("ABSENT")  # the key's own position is EMPTY: not cached


def reader(root, epoch: int, table, capacity: int, meta, classes: dict, layouts: dict,
           undecodable: tuple[type[BaseException], ...], count_hit: Callable[[], Any]) -> Any:
    """The compiled hot path of one mapping of a generation: the root segment's buffer and the
    ``epoch`` it names for this mapping, the table's buffer and capacity, the meta segment's
    buffer (writable: hits are counted there; TypeError otherwise), and the view's dicts of that
    generation - ``classes`` (size class -> (segment, view, chunk size, chunks handed out)) and
    ``layouts`` (layout id -> (bytes, decoder, end of the last leaf, private decoder)), read at
    each call, never changed.

    Its ``get(key)`` answers the value of an int key on the hot path (its record copied into a
    bytearray and decoded), ``ABSENT`` for one whose entry is EMPTY, and ``LONG_WAY`` for anything
    else - a decoder that raises one of ``undecodable`` too (the long way names the damage). A
    value's hit is counted: into the target its ``target(counters, word_at)`` set in this process
    (``counters[0] += 1``, then that word of the meta segment: what ``CacheView.count`` does), or
    else by ``count_hit()``. ``peek(key)`` answers the same without counting (a batch read key by
    key counts its hits at once). Only where ``NATIVE``."""
    return _hit.Hits(root, RootLayout.EPOCH, epoch, table, TABLE_OFF, ENTRY_BYTES, capacity, DATA_OFF,
                     READY | INT_KEY | SPILLED, READY | INT_KEY, _LAYOUT_SHIFT, INLINE24, _LENGTH_SHIFT,
                     _CLASS_SHIFT, LOCATION_MASK, classes, layouts, undecodable, LONG_WAY, ABSENT, meta, count_hit)
