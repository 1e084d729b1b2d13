"""The shared index: an open-addressing hash table in shared memory, read without locks.

Each entry is three native 8-byte words, 8-byte aligned::

    w0  state: READY (bit 0), INT_KEY (bit 1), SPILLED (bit 2) | layout id << 8 | length << 32
    w1  the key itself for int keys (two's complement), else a 64-bit hash of the key bytes
    w2  where the record is: size class << 48 | chunk   (spilled: file id << 48 | file offset)

An entry goes from EMPTY (w0 == 0) to READY in one aligned 8-byte store of w0, after w1, w2 and
the record's bytes were written (NOTE [publish order]). Entries are never changed or
removed while their table is current, so a reader that sees READY reads w1, w2 and the record and
gets complete data; probing stops at the first EMPTY entry. Readers load w0 *before* the other
words, in a separate load: one memcpy of all three could load w2 first and w0 last.

An int key below the table's capacity lives at its own position (dataset indices 0..N-1 then
never collide: one probe each); other int keys hash with Fibonacci hashing (a multiply). So a batch
of dataset indices is looked up with a couple of numpy gathers. Other keys (str, bytes) store a
64-bit blake2b hash; the record ends with the key bytes (and its header holds their length), which
the store compares to rule out collisions.
"""

from __future__ import annotations

import hashlib
import operator
import struct

import numpy as np

from ..base import ordering, settings
from ..base.shm import WORD, word_view
from ..errors import CorruptSegment, InvalidKey

try:
    from . import _index
except ImportError:  # no C compiler at install, or a source checkout never built
    _index = None
_why = settings.native_unavailable(_index is not None, "the one-pass batch probe")
PROBE_NATIVE = not _why  # lookup_ints probes a batch in one compiled pass (_index.c)


def probe_unavailable_reason() -> str:
    """Why the compiled batch probe is not used, and what to do ('' when it is used)."""
    return _why


__all__ = ["TableView", "key_bytes", "key_hash", "tier_key", "READY", "INT_KEY", "SPILLED", "INLINE24",
           "ENTRY_BYTES", "TABLE_OFF", "MAX_LOAD", "MIN_TABLE", "LOCATION_MASK", "FLAG_BITS", "MAX_RECORD",
           "state_word", "location_word", "entry_length", "entry_layout", "entry_class", "entry_chunk",
           "key_from_bytes"]

# The entry's bit layout (the docstring's table) is defined here only. Hot paths inline it as
# literals (store.CacheStore.lookup and _record): each such place names the accessor it
# inlines, and ``test_index`` checks every inlined copy against the functions below.
READY, INT_KEY, SPILLED = 1, 2, 4  # the state bits of w0
FLAG_BITS = 0xFF  # w0's low byte: the state bits (those above SPILLED no writer sets)
INLINE24 = 0xFFFFFF  # layout id field of an entry whose record carries its layout inline
LOCATION_MASK = (1 << 48) - 1  # w2 below the class (or file id): the chunk (or file offset)
MAX_RECORD = (1 << 32) - 1  # the length field of w0: no record (in memory or spilled) is longer
ENTRY_BYTES = 24
TABLE_OFF = 128  # entries start here in the table segment; capacity is stored at offset 64
MAX_LOAD = 0.7  # linear probing: ~2 probes per hit on average at this load
MIN_TABLE = 1024  # the fewest entries a cache's table has
_M64 = (1 << 64) - 1
_FIB = 0x9E3779B97F4A7C15
_QQ = struct.Struct("QQ")


def key_bytes(key: object) -> tuple[int, bytes]:
    """``(w1, key bytes)``: the word stored in the table and the bytes stored in the record.

    int keys store themselves (key bytes empty); str and bytes keys store a hash and keep their
    bytes, tagged so that ``"a"`` and ``b"a"`` differ.
    """
    tp = type(key)
    if tp is int or isinstance(key, (int, np.integer)) and not isinstance(key, bool):
        k = int(key)
        if not -(1 << 63) <= k < (1 << 63):
            raise InvalidKey(f"int key {k} does not fit in 64 bits; use a str key (str({k}))")
        return k & _M64, b""
    if tp is str:
        kb = b"s" + key.encode("utf-8", "surrogatepass")
    elif tp is bytes:
        kb = b"b" + key
    elif _int_scalar(key) is not None:  # a 0-d integer tensor or array: the int it holds, as ds[i] takes it
        return key_bytes(_int_scalar(key))
    else:
        raise InvalidKey(f"cache keys are int, str or bytes, not {tp.__name__} ({key!r}); convert "
                         f"it, e.g. str(key) or int(key)")
    return key_hash(kb), kb


def key_from_bytes(w1: int, kb: bytes) -> int | str | bytes:
    """The cache key that ``(w1, key bytes)`` stand for: the inverse of :func:`key_bytes`, and the
    one place that decodes key bytes. ValueError when ``kb`` carries no known tag (or a str key's
    bytes are not UTF-8); the caller decides what damaged bytes mean."""
    if not kb:
        return w1 - (1 << 64) if w1 >> 63 else w1  # an int key stores itself, two's complement
    if kb[:1] == b"s":
        return kb[1:].decode("utf-8", "surrogatepass")  # UnicodeDecodeError is a ValueError
    if kb[:1] == b"b":
        return kb[1:]
    raise ValueError(f"key bytes with no known tag: {kb[:40]!r}")


def _int_scalar(key: object) -> int | None:
    """The int of a 0-d integer tensor or numpy array (duck-typed: no torch here), else None."""
    if getattr(key, "ndim", None) != 0 or "bool" in str(getattr(key, "dtype", "bool")):
        return None
    try:
        return operator.index(key)
    except TypeError:  # a float or complex one
        return None


def key_hash(kb: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(kb, digest_size=8).digest(), "little")


def tier_key(w1: int, kb: bytes) -> bytes:
    """The key a record carries outside shared memory (spill files, and the tiers of NOTE [tiers]):
    the key word, 8 bytes little-endian, then the key bytes (none for an int key)."""
    return w1.to_bytes(8, "little") + kb


# --- the entry's words (the hot paths inline these: each such place names the accessor) -------


def state_word(flags: int, layout_id: int, length: int) -> int:
    """w0 of an entry: state ``flags`` (READY, INT_KEY, SPILLED), layout id, record length."""
    return flags | (layout_id << 8) | (length << 32)


def location_word(cls: int, chunk: int) -> int:
    """w2 of an entry: size class and chunk (spilled: file id and file offset)."""
    return (cls << 48) | chunk


def entry_length(w0: int) -> int:
    """The record's length in bytes (spilled: as stored in its file)."""
    return w0 >> 32


def entry_layout(w0: int) -> int:
    """The record's layout id in the meta segment (INLINE24: the record carries its layout)."""
    return (w0 >> 8) & INLINE24


def entry_class(w2: int) -> int:
    """The size class of the chunk holding the record (spilled: the spill file's id)."""
    return w2 >> 48


def entry_chunk(w2: int) -> int:
    """The chunk of the size class holding the record (spilled: the offset in the spill file)."""
    return w2 & LOCATION_MASK


class TableView:
    """Lock-free reads of one table segment (and, under the cache lock, inserts)."""

    def __init__(self, buf, name: str = "the index table"):
        self.buf = buf
        self.name = name  # the table segment's, for messages
        cap = WORD.unpack_from(buf, 64)[0]
        # a capacity that is no power of two or does not fit the segment is damage: the view then
        # has no entries, so every probe raises CorruptSegment saying so (and gc drops the table)
        self.damage = None
        if cap < 1 or cap & (cap - 1) or TABLE_OFF + cap * ENTRY_BYTES > len(buf):
            self.damage = f"its header gives a capacity of {cap} entries, which does not fit its {len(buf)} bytes"
            cap = 0
        self.capacity = cap
        self.shift = 64 - max(cap.bit_length() - 1, 0)
        self.mask = max(cap - 1, 0)
        self.words = np.ndarray((cap, 3), np.uint64, buf, TABLE_OFF)
        self._store = word_view(buf)  # writes: one aligned store per word (``shm.word_view``)

    @staticmethod
    def init(buf, capacity: int) -> None:
        assert capacity & (capacity - 1) == 0, "table capacity is a power of two"
        WORD.pack_into(buf, 64, capacity)

    @staticmethod
    def bytes_for(capacity: int) -> int:
        return TABLE_OFF + capacity * ENTRY_BYTES

    def home(self, w1: int) -> int:
        if w1 < self.capacity:
            return w1
        return ((w1 * _FIB) & _M64) >> self.shift

    def homes(self, w1: np.ndarray) -> np.ndarray:
        """:meth:`home` of each uint64 key word in ``w1`` (a run of a publish group)."""
        return np.where(w1 < np.uint64(self.capacity), w1, (w1 * np.uint64(_FIB)) >> np.uint64(self.shift))

    def find(self, w1: int, int_key: bool) -> tuple[int, int, int]:
        """``(position, w0, w2)`` of the READY entry whose key word is ``w1``, or of the EMPTY
        entry where it would go (w0 == 0). str/bytes keys may match several hashes in theory: the
        caller verifies the key bytes and calls :meth:`find_from` to go on."""
        return self.find_from(self.home(w1), w1, int_key)

    def find_from(self, pos: int, w1: int, int_key: bool) -> tuple[int, int, int]:
        buf, mask = self.buf, self.mask
        want = READY | INT_KEY if int_key else READY
        unpack, unpack2 = WORD.unpack_from, _QQ.unpack_from
        for _ in range(self.capacity):  # the load stays <= MAX_LOAD: an EMPTY entry comes first
            off = TABLE_OFF + ENTRY_BYTES * pos
            w0 = unpack(buf, off)[0]  # first, on its own: see the module docstring
            if w0 == 0:
                return pos, 0, 0
            if w0 & 3 == want:
                k, w2 = unpack2(buf, off + 8)
                if k == w1:
                    return pos, w0, w2
            pos = (pos + 1) & mask
        raise self.corrupt()

    def corrupt(self) -> CorruptSegment:
        """The error of a probe that found no EMPTY entry: the load stays <= MAX_LOAD, so the
        table was damaged (or its header is)."""
        what = self.damage or (f"it has no empty entry in {self.capacity}, though it is never filled "
                               f"past {MAX_LOAD:.0%}")
        return CorruptSegment(f"index table {self.name} is damaged: {what}; run `shmcache gc` (it "
                              f"will drop this cache's contents; they are recomputed on use)")

    def publish(self, pos: int, w0: int, w1: int, w2: int, fence: bool = True) -> None:
        """Fill EMPTY entry ``pos``: w1 and w2 first, then w0 in one aligned store (caller holds the
        lock), with a fence between (NOTE [publish order]): it orders everything stored before w0 -
        the record's bytes, its class and layout records, w1 and w2. ``fence=False`` only in a table
        no reader can reach yet (a growth: one fence before its epoch word covers all entries)."""
        off = TABLE_OFF + ENTRY_BYTES * pos
        w = off >> 3
        self._store[w + 1] = w1
        self._store[w + 2] = w2
        if fence:
            ordering.fence()
        self._store[w] = w0  # one aligned 8-byte store (``shm.word_view``: never struct.pack_into)

    def stage(self, pos: int, w1: int, w2: int) -> None:
        """Write w1 and w2 of EMPTY entry ``pos`` (caller holds the lock): the first half of
        :meth:`publish`, for a publish group of put_records (PublishGroup), whose one fence covers many
        entries. Readers ignore them until w0 is READY (they load w0 first)."""
        w = (TABLE_OFF + ENTRY_BYTES * pos) >> 3
        self._store[w + 1] = w1
        self._store[w + 2] = w2

    def ready(self, pos: int, w0: int) -> None:
        """The second half: w0 in one aligned store, after a fence that follows :meth:`stage`."""
        self._store[(TABLE_OFF + ENTRY_BYTES * pos) >> 3] = w0

    def stage_many(self, pos: np.ndarray, w1: np.ndarray, w2: np.ndarray) -> None:
        """:meth:`stage` of many EMPTY entries at once (a run of a publish group): readers stop at
        their EMPTY w0, so the order of these stores does not matter."""
        self.words[pos, 1] = w1
        self.words[pos, 2] = w2

    def ready_many(self, pos: np.ndarray, w0: np.ndarray) -> None:
        """:meth:`ready` of many entries, after the group's fence B: numpy stores each aligned
        uint64 element with one 8-byte store (never a zeroing first, as struct.pack_into does)."""
        self.words[pos, 0] = w0

    def entries(self):
        """Every READY entry as ``(w0, w1, w2)`` (for rebuilding and for gc)."""
        w = self.words
        ready = np.flatnonzero(w[:, 0] & np.uint64(READY))
        for i in ready:
            yield int(w[i, 0]), int(w[i, 1]), int(w[i, 2])

    def lookup_ints(self, keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Vectorised lookup of int64 ``keys``: ``(w0, w2)`` arrays, w0 == 0 where a key is absent;
        in one compiled pass where built (``_index.c``), else by numpy's passes below (the same
        probe: the tests compare them)."""
        w = self.words
        k = keys.astype(np.uint64, copy=False)
        if PROBE_NATIVE:  # the same probe in one pass (_index.c), every home row asked for first
            k = np.require(k, requirements=("C", "A"))  # the C loads aligned 8-byte words, in order
            w0, w2 = np.empty(len(k), np.uint64), np.empty(len(k), np.uint64)
            if not _index.lookup_ints(w, k, _FIB, self.shift, READY | INT_KEY, w0, w2):
                raise self.corrupt()
            return w0, w2
        cap = np.uint64(self.capacity)
        if len(k) and k.max() < cap:  # dataset indices: each at its own position, one probe
            s0 = w[k, 0]  # state words first, in their own gather
            s1 = w[k, 1]
            if ((s0 & np.uint64(3)) == np.uint64(READY | INT_KEY)).all() and (s1 == k).all():
                return s0, w[k, 2]
        pos = np.where(k < cap, k, (k * np.uint64(_FIB)) >> np.uint64(self.shift))
        w0 = np.zeros(len(k), np.uint64)
        w2 = np.zeros(len(k), np.uint64)
        todo = np.arange(len(k))
        want = np.uint64(READY | INT_KEY)
        mask = np.uint64(self.mask)
        for _ in range(self.capacity):  # bounded as find_from is: an EMPTY entry comes first
            if not len(todo):
                return w0, w2
            p = pos[todo]
            s0 = w[p, 0]  # state words first, in their own gather
            s1 = w[p, 1]
            hit = ((s0 & np.uint64(3)) == want) & (s1 == k[todo])
            if hit.any():
                idx = todo[hit]
                w0[idx] = s0[hit]
                w2[idx] = w[p[hit], 2]
            go_on = ~hit & (s0 != 0)
            todo = todo[go_on]
            pos[todo] = (pos[todo] + np.uint64(1)) & mask
        if len(todo):
            raise self.corrupt()
        return w0, w2
