"""The tier seam: what a place for a cache's values outside its shared memory must do, and the
store that reads through such places in order.

A value lives first in shared memory, and, when that is full, in the cache's spill files (both
found through the shared index: ``store.CacheStore``). Behind them may stand *tiers* shared
wider than one node or one run: a Redis server for every node of a job (``RedisTier``), a
read-only snapshot on disk or object storage (``snapshot/``). :class:`TieredStore` composes
them::

    store = assembly.assemble(CacheStore(...), [remote_tier, snapshot_tier], name=..., fingerprint=...)
    store.lookup(key)          # shared memory; else each tier in order; a tier's hit is admitted
    store.lookup_batch(keys)   # the same, one batched call per tier for the batch's misses
    store.put(key, value)      # into shared memory, and offered to every tier (write-behind)

NOTE [tiers]
    A tier is reached with the *portable* key and holds the *portable* record, never anything
    that is only meaningful on one node:

    * portable key = the index word of the key (8 bytes, little-endian: an int key itself, else
      the hash of the key bytes) followed by the key bytes (none for an int key) - the same key a
      spill record carries. A tier adds the cache's identity (from its fingerprint, never the
      session's name) to it, so nodes find each other's values and two datasets never meet.
    * portable record = the codec's record with its layout inline (``codec.INLINE``), so it
      decodes anywhere, with no interned layout table. A tier wraps it in the self-checking
      record of NOTE [spill records] (magic, key, lengths, codec, checksum): a value that is
      corrupt, cut short or another key's is a miss, counted by the tier, never returned.

    Trust (NOTE [record authentication]): a tier whose every record carried the job's
    MAC (``tier.authenticated``) serves the job's own values. Any other tier serves data: before a
    record is decoded or admitted its layout is checked (codec.check_layout: structure, dtypes,
    bounds, never an unpickling) and one holding a pickled leaf is refused - a miss, counted as
    ``tier_pickle_refused``, one log line naming ``allow_pickle=True`` - since once admitted into
    shared memory it would be unpickled by every process that reads it.

    Assembly: one place, ``tiers.assembly``, wires a cache's tiers, only through the methods of
    the ``Tier`` protocol (``tiers.protocol.Tier``; RedisTier and SnapshotTier implement it): the layer
    of each tier makes it (``remote.open_tier``, ``snapshot.tier.open_tier``), and
    ``assembly.assemble`` binds it to the cache's identity (``Tier.bind``: name and fingerprint,
    again through ``assembly.bind`` when the dataset becomes known later), puts it in ORDER,
    lowers its ``max_batch_bytes`` to the cache's cap and offers writes only to the tiers that
    are not ``read_only``. The order: shared memory, then the snapshot (read-only, exact: a value
    of this very dataset, checked when it was opened, and the cheapest to reach - a local file or
    one ranged read), then the remote (shared and writable, but a network round trip and values
    other nodes wrote), whatever order they were attached in.

    The key is converted once: the seam turns the cache key into its portable key (and, for a
    write, the key bytes the record carries) once per read or write, and hands the same bytes
    to every tier.

    Counts: each tier counts in its own file, the seam (tier hits admitted, records that do not
    decode, pickled leaves refused) in the cache's ``tiers`` file, both NOTE [tier counts];
    ``counts.stats_keys`` alone turns them into the keys of ``stats()`` and of
    ``shmcache stat --json`` (``assembly.stats_from_files``), which therefore agree.

    A tier never raises for its own faults (unreachable, slow, full, damaged): it answers a miss,
    counts it, and logs one line per condition. ``TieredStore`` still guards every call, so a tier
    that breaks this rule costs a miss and one log line, never a training step. A tier's hit is
    admitted into shared memory within its cap (a cache that is full keeps serving it from the
    tier), and what the process computes is offered to every tier, which may write it behind the
    training loop and drop it when its queue is full. A value in shared memory is never replaced
    by a tier's: shared memory is the first and final word on one node.

    The spill files are a tier too, of the other kind: an *indexed* tier
    (``cache.indexed_tier.IndexedTier``, implemented by ``SpillTier``), found
    through the store's own shared index rather than asked by key. It holds the same key
    (``index.tier_key``) with the record, but it does not decide anything: the store, under its
    lock, calls ``write(key, record)``, which only stores and answers a ``RecordLocation`` (or None: not
    stored, a miss later), and publishes that location in the index with the intent record of
    NOTE [publish order]; a reader hands the entry's location back to ``read(location, key)``,
    which checks the key and the record and answers None for anything else. The store gets it
    through ``CacheStore.spill_to(tier)`` and never calls back into the spill package, and the
    tier never touches the store.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import numpy as np

from ..base.trust import PICKLE_HINT
from ..cache import codec
from ..cache.claims import Served
from ..cache.index import key_bytes, key_from_bytes, tier_key
from ..cache.indexed_tier import IndexedTier
from ..cache.store import MISSING
from ..cache.store_protocol import Store
from ..errors import ItemTooLarge
from . import counts as tier_counts
from .protocol import Buffer, LeaseTier, Tier

__all__ = ["Tier", "TieredStore", "portable_key", "key_of_portable", "portable_record", "decode_portable",
           "PickleRefused", "untrusted_problem"]

log = logging.getLogger("shmcache")
_SEAM = {name: i for i, name in enumerate(tier_counts.COUNTERS["tiers"])}
# a wait on another node's lease polls the tier for its value (NOTE [remote leases]): the first
# sleep, doubling to the longest (a value lands after its holder computed it and wrote it behind)
LEASE_FIRST_SLEEP_S, LEASE_MAX_SLEEP_S = 1e-3, 50e-3


def portable_key(key: Any) -> bytes:
    """The key a tier is asked for (NOTE [tiers]); InvalidKey for a key the cache refuses."""
    return tier_key(*key_bytes(key))


def key_of_portable(pkey: Buffer) -> Any:
    """The cache key a portable key stands for (its inverse): an int, str or bytes. ValueError
    when the bytes are not a portable key (a reader of a damaged file counts a miss)."""
    pkey = bytes(pkey)
    if len(pkey) < 8:
        raise ValueError(f"a portable key of {len(pkey)} bytes is shorter than its index word")
    w1, kb = int.from_bytes(pkey[:8], "little"), pkey[8:]
    if not kb:
        return key_from_bytes(w1, kb)  # an int key: any 8 bytes are one
    try:
        key = key_from_bytes(w1, kb)
    except ValueError:
        key = None
    if key is None or key_bytes(key) != (w1, kb):
        raise ValueError(f"not a portable key: {pkey[:40]!r}")
    return key


def portable_record(enc: codec.Encoded, key: Any) -> bytes:
    """The encoded value as a record that decodes on any node (its layout inline)."""
    return _portable_record(enc, key_bytes(key)[1])


def _portable_record(enc: codec.Encoded, kb: bytes) -> bytes:
    """``portable_record`` of the key whose bytes (index.key_bytes) are ``kb``."""
    return bytes(_fresh_record(enc, kb))


def _fresh_record(enc: codec.Encoded, kb: bytes) -> memoryview:
    """The portable record as a read-only view of a buffer of its own, written once (no zero
    fill, no copy after): what ``put`` hands over to the tiers (Tier.offer keeps it as it is)."""
    out = memoryview(np.empty(enc.record_len(len(kb), True), np.uint8))
    enc.write(out, codec.INLINE, kb)
    return out.toreadonly()


class PickleRefused(ValueError):
    """A record from outside this user's shared memory, not authenticated, holds a pickled leaf
    (NOTE [record authentication]): refused before anything of it is unpickled."""


def untrusted_problem(record: Buffer, allow_pickle: bool, authenticated: bool = False) -> str | None:
    """Why the portable record in ``record`` may not be decoded or stored when it does not come
    from this user's own memory: a layout the encoder does not write, leaves beyond its body, an
    extension type no handler of this process knows (unless ``authenticated``: the job's MAC says
    our own writer made it, with a type registered where it runs, and it is stored to be decoded
    there), or (unless ``allow_pickle``) a pickled leaf - found without decoding or unpickling
    anything; None when it may. PickleRefused is said with the prefix ``"pickle: "``."""
    view = memoryview(record).cast("B")
    n = len(view)
    if n < codec.MIN_RECORD_BYTES:
        return f"a record of {n} bytes is shorter than its header"
    layout_id, key_len, layout_len, _ = codec.RECORD_HEADER.unpack_from(view, 0)
    if layout_id != codec.INLINE:
        return f"not a portable record (layout id {layout_id:#x}, not an inline layout)"
    body = n - key_len - layout_len
    if not codec.RECORD_HEADER.size <= body < n - key_len:
        return f"an inline layout of {layout_len} bytes and a key of {key_len} in a record of {n} bytes"
    check = codec.check_layout(view[body:body + layout_len].tobytes())  # cached per layout
    if check.problem is not None:
        return check.problem
    if check.unknown_tag is not None and not authenticated:
        return (f"its layout is not one the encoder writes (extension tag {check.unknown_tag!r} names no type "
                f"registered in this process)")
    if check.needed > body:
        return f"its leaves span {check.needed} bytes, its body holds {body}"
    for off, length in check.texts:  # the one leaf whose bytes can fail to decode: what decode would raise
        try:
            str(view[off:off + length], "utf-8", "surrogatepass")
        except UnicodeDecodeError as exc:
            return f"its str leaf at offset {off} is not UTF-8 ({exc.reason})"
    if check.pickled and not allow_pickle:
        return "pickle: it holds a pickled object"
    return None


def decode_portable(record: Buffer, trusted: bool = True, allow_pickle: bool = False) -> Any:
    """The value of a portable record (its arrays view ``record``: pass a private buffer).
    ValueError when the bytes are not a portable record (the caller counts a miss). Not
    ``trusted`` (neither this user's memory nor authenticated): the record is checked first
    (``untrusted_problem``), PickleRefused for a pickled leaf unless ``allow_pickle``."""
    view = memoryview(record).cast("B")
    if not trusted:
        why = untrusted_problem(view, allow_pickle)
        if why is not None:
            raise PickleRefused(why[8:]) if why.startswith("pickle: ") else ValueError(why)
    if len(view) < codec.MIN_RECORD_BYTES:
        raise ValueError(f"a record of {len(view)} bytes is shorter than its header")
    layout_id = codec.record_header(view).layout_id
    if layout_id != codec.INLINE:
        raise ValueError(f"not a portable record (layout id {layout_id:#x}, not an inline layout)")
    layout = codec.inline_layout(view)  # ValueError: not a portable record either
    try:
        return codec.decode(view, layout)
    except Exception as exc:  # noqa: BLE001 - bytes that passed the tier's checksum yet do not decode
        # (an EncodeError too: a handler this process lacks, a tag of another version)
        raise ValueError(f"the record does not decode: {exc!r}") from None




class TieredStore:
    """A cache's local store (shared memory, then spill) with tiers behind it (NOTE [tiers]).

    Reads, writes, stats and close go through the tiers; the local store's other methods that
    callers use (the batch gather, metadata, import and export, lifecycle) are this object's own,
    bound to the local store once (no lookup per call; the batch gather serves only keys that are
    all in shared memory, anything else comes back here through ``lookup_batch``). Without tiers,
    callers keep the local store itself: no cost on a hit. Built by ``assembly.assemble``, which
    orders the tiers; ``tiers`` here are asked in the order given.
    """

    def __init__(self, local: Store, behind: Sequence[Tier], allow_pickle: bool = False, *,
                 counts_path: str | os.PathLike | None = None, slot: Callable[[], int] | None = None):
        self.local = local
        # a tier whose records are not authenticated (``tier.authenticated`` false) serves data,
        # never code: a pickled leaf is refused unless allowed (NOTE [record authentication])
        self.allow_pickle = allow_pickle
        self.behind: list[Tier] = []
        self._writable: list[Tier] = []
        self.set_tiers(behind)
        self._failed: set[tuple[str, str]] = set()  # (tier, method) that raised: logged once
        # the seam's counters (tier hits admitted, records refused): this process's row of the
        # cache's ``tiers`` counts file (NOTE [tier counts]), made again in a forked child
        self._counts_path, self._slot = counts_path, slot
        self._pid, self._c = -1, np.zeros(len(_SEAM), np.uint64)
        # the batch gather's calls, bound to the local store once (no lookup per call on a hit)
        self.batch_layout, self.absent_ints = local.batch_layout, local.absent_ints
        self.all_in_memory, self.gather_ints = local.all_in_memory, local.gather_ints
        self.out_matches = local.out_matches

    def set_tiers(self, tiers: Sequence[Tier]) -> None:
        """Read through ``tiers`` in this order from now on (``assembly.assemble`` orders them)."""
        cap = getattr(self.local, "capacity_bytes", 0)  # an uncached store has none
        for tier in tiers:  # a batch's values past the cache's cap are refused, never decoded
            if cap:
                tier.max_batch_bytes = min(tier.max_batch_bytes, cap)
        self.behind = list(tiers)
        # a read-only tier (a snapshot) takes nothing: put packs no copy of the value for it
        self._writable = [tier for tier in self.behind if not tier.read_only]
        # where a miss takes its lease before computing (NOTE [remote leases]): the first writable
        # tier that takes leases (the remote), None without one (no lease, no round trip)
        self._leaser: LeaseTier | None = next((tier for tier in self._writable if tier.leases), None)

    # --- the local store's state ------------------------------------------------------------

    @property
    def session(self) -> str:
        return self.local.session

    @property
    def name(self) -> str:
        return self.local.name

    @property
    def uncached(self) -> bool:
        return self.local.uncached

    @property
    def capacity_bytes(self) -> int:
        return self.local.capacity_bytes

    @property
    def spill(self) -> IndexedTier | None:
        return self.local.spill

    @property
    def claim_timeout_s(self) -> float:
        return self.local.claim_timeout_s

    @property
    def meta_path(self):
        return self.local.meta_path

    # --- the local store's own calls (metadata, import and export, lifecycle) ---------------

    def locked(self):
        return self.local.locked()

    def read_meta(self) -> dict:
        return self.local.read_meta()

    def write_meta(self, meta: dict) -> None:
        self.local.write_meta(meta)

    def record_label(self, label: str) -> None:
        self.local.record_label(label)

    def bind_fingerprint(self, fingerprint: str) -> None:
        self.local.bind_fingerprint(fingerprint)

    def reserve_entries(self, n: int) -> None:
        self.local.reserve_entries(n)

    def put_records(self, items: Sequence[tuple[Any, Any]]) -> list[bool]:
        return self.local.put_records(items)  # an import: into shared memory only, not offered

    def portable_records(self):
        return self.local.portable_records()  # an export: what this node holds

    def clear(self) -> None:
        self.local.clear()  # shared memory (the tiers are shared wider: left as they are)

    def destroy(self) -> None:
        self.local.destroy()

    # --- reads ------------------------------------------------------------------------------

    def lookup(self, key: Any, copy: bool = True, count: bool = True) -> Any:
        value = self.local.lookup(key, copy, count)
        if value is not MISSING or not self.behind:
            return value
        pk = portable_key(key)  # converted once: every tier is asked with these bytes
        for tier in self.behind:
            record = self._call(tier, "get", pk)
            if record is not None:
                value = self._admit(key, record, tier)
                if value is not MISSING:
                    return value
        return MISSING

    def lookup_batch(self, keys: Sequence, copy: bool = True, count: bool = True) -> tuple[list, list[int]]:
        values, missing = self.local.lookup_batch(keys, copy, count)
        if not missing or not self.behind:
            return values, missing
        pks = {i: portable_key(keys[i]) for i in missing}  # converted once for every tier
        for tier in self.behind:
            records = self._call(tier, "get_many", [pks[i] for i in missing]) or [None] * len(missing)
            still, hits = [], []
            for i, record in zip(missing, records):
                value = MISSING if record is None else self._decoded(keys[i], record, tier)
                if value is MISSING:
                    still.append(i)
                else:
                    values[i] = value
                    hits.append((keys[i], record))
            self._admit_many(hits)  # the batch's hits of this tier: one put_records, one lock hold
            missing = still
            if not missing:
                break
        return values, missing

    def count_misses(self, n: int = 1) -> None:
        self.local.count_misses(n)

    def contains(self, key: Any) -> bool:
        return self.local.contains(key)  # what this node holds; a tier is asked only on a read

    def __len__(self) -> int:
        return len(self.local)  # what this node holds, as contains()

    def fill(self, key: Any, compute: Callable[[Any], Any], publish: Callable[[Any, Any], Any],
             copy: bool = True) -> Any:
        """The miss path of shared memory (NOTE [claims]): the tiers were asked already (the miss
        was ours); a waiter polls shared memory, where the holder's value (or its tier hit) lands.
        ``publish`` is the caller's: this store's put, so the tiers are offered the value too.
        With a remote tier the computation first takes the key's lease (NOTE [remote leases])."""
        if self._leaser is None:
            return self.local.fill(key, compute, publish, copy)
        return self.local.fill(key, self._leased_one(compute), publish, copy)

    def fill_batch(self, keys: Sequence, compute_many: Callable[[list], list],
                   publish_many: Callable[[list], Any], copy: bool = True) -> list:
        """The batch miss path (the local store's ``fill_batch``: NOTE [claims]), the computation
        taking the keys' leases first with a remote tier (``leased_compute``)."""
        return self.local.fill_batch(keys, self.leased_compute(compute_many), publish_many, copy)

    def leased_compute(self, compute_many: Callable[[list], list]) -> Callable[[list], list]:
        """``compute_many`` (keys -> their values) behind the keys' leases (NOTE [remote leases]):
        a callable keys -> list, each element the value computed here or a ``claims.Served`` (the
        value another node computed, found in the tier after waiting on its lease, admitted into
        shared memory already: the caller neither counts nor publishes it). Without a tier that
        takes leases, ``compute_many`` itself."""
        return compute_many if self._leaser is None else partial(self._leased, compute_many)

    def _leased_one(self, compute: Callable[[Any], Any]) -> Callable[[Any], Any]:
        """``compute`` (key -> value) behind the key's lease, as ``leased_compute``."""
        leased = self.leased_compute(lambda keys: [compute(keys[0])])
        return lambda key: leased([key])[0]

    def _lease_ttl(self) -> float:
        """How long a lease lives, and a wait on another's lasts: the cache's claim timeout
        (NOTE [claims]); 0 (no leases) when claims are off, or there is no shared memory."""
        if self._leaser is None or self.local.uncached:
            return 0.0
        return self.local.claim_timeout_s

    def _leased(self, compute_many: Callable[[list], list], keys: Sequence) -> list:
        """NOTE [remote leases]: take the keys' leases (one round trip), compute the keys whose
        lease is ours, then wait for the others' values - computing a key whose lease expires
        (taken over), and every key left when the wait times out."""
        keys = list(keys)
        ttl, tier = self._lease_ttl(), self._leaser
        if not keys or ttl <= 0 or tier is None:
            return list(compute_many(keys))
        pks = [portable_key(k) for k in keys]
        granted = self._call(tier, "lease", pks, ttl) or [True] * len(keys)
        if all(granted):
            return list(compute_many(keys))
        out: list = [None] * len(keys)
        computed: list[int] = []  # what earlier calls of compute_many filled

        def compute_into(idx: list[int]) -> None:
            if idx and computed:  # the source is called again for this batch: what it returned
                for i in computed:  # before is kept as a copy of its own (claims._detach: a source
                    out[i] = codec.own_copy(out[i])  # may fill one buffer again each call)
                computed.clear()
            self._compute_into(out, keys, idx, compute_many)
            computed.extend(idx)

        compute_into([i for i, g in enumerate(granted) if g])
        waiting = [i for i, g in enumerate(granted) if not g]
        found: list = []  # (i, value, record): another node's values, admitted below
        deadline = time.monotonic() + ttl
        delay = LEASE_FIRST_SLEEP_S
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(delay, left))
            delay = min(delay * 2, LEASE_MAX_SLEEP_S)
            got = self._call(tier, "poll", [pks[i] for i in waiting], ttl)
            records, taken = got if got is not None else ([None] * len(waiting), [True] * len(waiting))
            still, ours = [], []
            for i, record, mine in zip(waiting, records, taken):
                # a record refused here was counted by the lookup that missed it (the same bytes)
                value = MISSING if record is None else self._decoded(keys[i], record, tier, count=False)
                if value is not MISSING:
                    found.append((i, value, record))
                elif mine or record is not None:  # taken over, or a record no wait will mend
                    ours.append(i)
                else:
                    still.append(i)
            compute_into(ours)
            waiting = still
        compute_into(waiting)  # timed out: computed here
        self._admit_many([(keys[i], record) for i, _, record in found])
        for i, value, _ in found:
            out[i] = Served(value)
        self._call(tier, "waited", len(found), len(waiting))
        return out

    @staticmethod
    def _compute_into(out: list, keys: list, idx: list[int], compute_many: Callable[[list], list]) -> None:
        if idx:
            for i, value in zip(idx, compute_many([keys[i] for i in idx]), strict=True):
                out[i] = value

    def count_computed(self, n: int = 1) -> None:
        self.local.count_computed(n)

    def first_to_say(self, kind: str, notice: str) -> bool:
        return self.local.first_to_say(kind, notice)

    def _admit(self, key: Any, record: Buffer, tier: Tier) -> Any:
        """A tier's record as a value (``_decoded``), stored in shared memory too (within its cap)."""
        value = self._decoded(key, record, tier)
        if value is not MISSING:
            self._admit_many([(key, record)])
        return value

    def _decoded(self, key: Any, record: Buffer, tier: Tier, count: bool = True) -> Any:
        """A tier's record as a value, or MISSING (counted, unless not ``count``). Decoded first:
        bytes that passed the tier's checks yet are no portable record are refused before they
        reach shared memory; so is a pickled leaf from a tier whose records are not authenticated
        (unless allow_pickle): it would run code here, and in every process that reads it later."""
        try:
            # private bytes: the value owns them (a tier returns a bytearray only when it is fresh
            # and its own - Tier.get - so it is not copied again)
            return decode_portable(record if type(record) is bytearray else bytearray(record),
                                   tier.authenticated, self.allow_pickle)
        except PickleRefused as exc:
            if count:
                self._count("pickle_refused")
            if ("pickle", tier.name) not in self._failed:
                self._failed.add(("pickle", tier.name))
                log.warning("cache %s/%s: the %s tier returned a record of key %r that %s, and its records "
                            "are not authenticated: refused unread (a miss, computed from the source); %s. "
                            "Further ones are only counted", self.local.session, self.local.name,
                            tier.name, key, str(exc).removeprefix("it "), PICKLE_HINT)
            return MISSING
        except ValueError as exc:
            if count:
                self._count("undecodable")
            if ("decode", "") not in self._failed:
                self._failed.add(("decode", ""))
                log.warning("cache %s/%s: a tier returned a record of key %r that does not decode "
                            "(%s); treated as a miss, further ones are only counted",
                            self.local.session, self.local.name, key, exc)
            return MISSING

    def _admit_many(self, items: list[tuple[Any, Buffer]]) -> None:
        """Tier records that decoded (``_decoded``) into shared memory, one ``put_records`` call
        (one lock hold, published a chunk at a time) - the record as it came, no decode-and-encode
        round: put_records copies its bytes in once. One that can never fit is served from the
        tier, counted as rejected (by the store) and said once; the others still go in."""
        if not items:
            return
        try:
            stored = self.local.put_records(items)
        except ItemTooLarge as exc:  # one of them: the rest one by one (rare: a cap below an item)
            self._too_large(exc)
            stored = []
            for item in items:
                try:
                    stored += self.local.put_records([item])
                except ItemTooLarge:
                    stored.append(False)
        self._count("admitted", sum(stored))

    def _too_large(self, exc: ItemTooLarge) -> None:
        if ("too_large", "") not in self._failed:
            self._failed.add(("too_large", ""))
            log.warning("%s; such items are served from the tier, not cached in shared memory, and "
                        "counted as rejected (said once)", exc)

    # --- writes -----------------------------------------------------------------------------

    def put(self, key: Any, value: Any, *, encoded: codec.Encoded | None = None) -> bool:
        enc = encoded or codec.encode(value, f"the value of key {key!r}")
        stored = self.local.put(key, value, encoded=enc)
        if self._writable:  # a read-only tier (a snapshot) takes nothing: no copy of the value for it
            w1, kb = key_bytes(key)  # converted once, for the key and the record
            item = [(tier_key(w1, kb), _fresh_record(enc, kb))]  # handed over: no copy is kept here
            for tier in self._writable:
                self._call(tier, "offer", item)
        return stored

    def put_many(self, items: Sequence[tuple[Any, codec.Encoded]], *,
                 too_large: list | None = None) -> list[bool]:
        """``put`` of many encoded values: into shared memory under one hold of its lock, and
        offered to every writable tier in one call."""
        stored = self.local.put_many(items, too_large=too_large)
        if self._writable:
            pairs = []
            for key, enc in items:
                w1, kb = key_bytes(key)
                pairs.append((tier_key(w1, kb), _portable_record(enc, kb)))
            for tier in self._writable:
                self._call(tier, "offer", pairs)
        return stored

    # --- counters ---------------------------------------------------------------------------

    def _count(self, counter: str, n: int = 1) -> None:
        """``n`` more of the seam's ``counter`` in this process's row (NOTE [tier counts])."""
        if self._pid != os.getpid():  # the first count, or a forked child: its own row
            self._c = tier_counts.process_row(self._counts_path, "", self._slot,
                                              f"the tiers of cache {self.local.session}/{self.local.name}")
            self._pid = os.getpid()
        self._c[_SEAM[counter]] += np.uint64(n)

    def seam_totals(self) -> dict:
        """The seam's counters summed over every process (this process's when not shared)."""
        if self._counts_path is not None and self._slot is not None:
            shared = tier_counts.read_counts(self._counts_path, tier_counts.COUNTERS["tiers"])
            if shared is not None:
                return shared
        mine = self._c if self._pid == os.getpid() else np.zeros(len(_SEAM), np.uint64)
        return {name: int(mine[i]) for name, i in _SEAM.items()}

    def stats(self) -> dict:
        """The local store's stats and the tier keys (counts.stats_keys: the keys of
        ``shmcache stat --json`` too), every counter summed over every process."""
        st = self.local.stats()
        st.update(tier_counts.stats_keys({tier.name: (tier.COUNTERS, self._call(tier, "totals"))
                                          for tier in self.behind}, self.seam_totals()))
        return st

    # --- lifecycle --------------------------------------------------------------------------

    def close(self) -> None:
        try:
            for tier in self.behind:
                self._call(tier, "close")
        finally:
            self.local.close()

    def _call(self, tier: Tier, method: str, *args):
        """``tier.method(*args)``, a raise turned into None (a miss) and one log line."""
        try:
            return getattr(tier, method)(*args)
        except Exception as exc:  # noqa: BLE001 - NOTE [tiers]: a tier's fault never stops training
            if (tier.name, method) not in self._failed:
                self._failed.add((tier.name, method))
                log.warning("cache %s/%s: the %s tier failed in %s (%s: %s); treated as a miss, "
                            "further failures are only counted", self.local.session,
                            self.local.name, tier.name, method, type(exc).__name__, exc)
            return None
