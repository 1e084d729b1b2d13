"""The snapshot read-through tier: a snapshot read key by key behind a cache's shared memory.

    tier = SnapshotTier("s3://bucket/snap")            # reads the manifest, checks its version
    tier.bind("PhotoCrops-179b5afeea4b", fingerprint)  # CacheMismatch: a snapshot of another dataset
    records = tier.get_many([portable_key(k) for k in keys])   # portable records, or None

``ShmDatasetCache(..., snapshot=URL)`` (or ``$SHMCACHE_SNAPSHOT``) puts one in front of every
other tier (``tiered``): a miss in shared memory reads just the records it needs from the
snapshot, one batched read per batch, and admits them into shared memory (tiers.tiered_store.TieredStore).

NOTE [snapshot read-through]
    Opening reads manifest.json only: its format version, and the cache's identity, checked by
    ``bind`` against the cache that reads it - fingerprints when both are known, else the cache's
    name - so a snapshot of another dataset is refused (CacheMismatch) unless ``force``; it never
    serves another dataset's values. A named cache whose dataset is not known yet (no wrap() so
    far) reads nothing from a snapshot of a wrapped dataset until wrap() binds its fingerprint.
    With the job's secret (NOTE [record authentication]) the manifest must be signed with it -
    else SnapshotError naming ``snapshot_options={'allow_unsigned': True}`` - and then every
    record's MAC is checked before it is decompressed: a record without it is a miss counted as
    ``forged``, and the tier is ``authenticated`` (its pickled objects are the job's own).
    A manifest that cannot be reached yet (the store is down) is read again later; if it then
    names another dataset the tier turns itself off (a log line: a tier never raises from a read).

    The first read loads every data file's index: one ranged read of the file's tail (the index and
    the footer are its last ``items * 32 + 40`` bytes, really stored; all data files in one
    ``read_ranges`` call on an fsspec store), checked like an import checks it (footer, index crc, the manifest's sha256
    of index + footer). The indexes are merged into one array sorted by the key's index word, so a
    batch is one ``np.searchsorted`` pair; colliding words are all read and the record's own key
    decides. Then the records a batch needs are read in one call: on a local file (a path or
    ``file://``) ``os.preadv`` on one descriptor per data file, adjacent records in one call; on an
    fsspec store one ``read_ranges`` for the whole batch, bounded by ``timeout_s`` (over HTTP the
    transfer is then cancelled; a server that ignores Range turns the tier off, one log line). Each record
    is checked by ``records.unpack_record`` (magic, key, lengths, head and body checks)
    and against its index entry's head check, and its payload - the portable record - returned.

    The data file must still be the one whose index was loaded: each batch also checks every
    data file it touches - a local file's link count (0: deleted) and its footer, re-read (40 bytes,
    in the same ``read_ranges`` call on a store) and compared with the one loaded. A data file that
    was deleted, truncated or replaced is dropped for the rest of the run (its keys miss: they are
    computed from the source); a record that fails its checks is a miss. Faults of the store
    (unreachable, slow: the timeout) are misses too, and open a circuit breaker: for 1 s, doubling
    up to 30 s while they go on, reads of the tier are misses without a call. Every condition is
    logged once per process (the data file, the URL, the fix) and counted; nothing is raised, and a
    wrong value is never returned.

    Counters (hits, misses, bytes read, reads, errors, corrupt) live in one row per process of a
    file beside the cache's metadata (``caches/NAME.snapshot``, a row per liveness slot, the same
    scheme: NOTE [tier counts]): each process stores only its own row, one aligned word per
    counter; ``stats()`` and ``shmcache stat`` sum the rows. The file ends with the URL read.

    Per process: descriptors, the fsspec filesystem and the reader threads belong to the process
    that made them; a forked child (a DataLoader worker) opens its own on first use, from the
    manifest and indexes it inherited (nothing of them changes after loading).
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zstandard

from ..base.settings import ENV_SNAPSHOT
from ..base.trust import FORGED, TRAILER_BYTES, snapshot_ident
from ..base.urls import mask_url, scrub_secret
from ..cache.store_protocol import Store
from ..errors import CacheMismatch, InvalidArgument, RangeNotHonored, SnapshotError
from ..tiers import assembly
from ..tiers import counts as tier_counts
from ..tiers import records as records
from ..tiers.breaker import Breaker
from ..tiers.tiered_store import TieredStore
from . import format as fmt
from .location import FsspecLocation, LocalLocation, check_stored, open_location, open_regular, with_timeouts

__all__ = ["SnapshotTier", "tiered", "ENV_SNAPSHOT", "OPTIONS", "COUNTERS", "counts_path", "read_counts",
           "open_tier", "check_options", "manifest_of", "snapshot_tier"]

log = logging.getLogger("shmcache")
_ADVICE = "copy the snapshot again, or export it again"
_VERBS = ("is ", "has", "was", "can")  # a reason that reads on from the data file's path

OPTIONS = ("force", "storage_options", "timeout_s", "allow_unsigned")  # snapshot_options= of ShmDatasetCache
COUNTERS = tier_counts.COUNTERS["snapshot"]  # hits, misses, bytes read, ... (NOTE [tier counts])
_I = {name: i for i, name in enumerate(COUNTERS)}
_BACKOFF_MIN_S, _BACKOFF_MAX_S = 1.0, 30.0
_ENTRY = fmt.INDEX_DTYPE.itemsize

_REASONS = {
    "unreachable": "cannot be read ({detail}); its items are computed from the source until it answers "
                   "(retried after a pause; check the URL, the network and your credentials)",
    "timeout": "did not answer within {t} s; its items are computed from the source until it answers "
               "(raise snapshot_options={{'timeout_s': ...}} if it is only slow)",
    "corrupt": "holds a record that fails its checks ({detail}); that item is computed from the source, "
               "later ones are only counted ('snapshot_corrupt' in stats()); copy the snapshot again",
    "forged": "holds a record without this job's MAC ({detail}): changed, or added by someone without the "
              "secret; that item is computed from the source, later ones are only counted "
              "('snapshot_forged' in stats()); export the snapshot again",
}


class _Fault(Exception):
    """A fault of the store behind the tier (unreachable, slow): a miss, and the breaker opens."""

    def __init__(self, kind: str, detail: str):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def check_options(options: dict | None) -> dict:
    """``snapshot_options`` checked: InvalidArgument for a key or value the tier does not take."""
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise InvalidArgument(f"snapshot_options must be a dict (keys {', '.join(OPTIONS)}), got "
                              f"{type(options).__name__}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise InvalidArgument(f"snapshot_options has unknown key(s) {unknown}; it takes {', '.join(OPTIONS)}")
    t = options.get("timeout_s", 10.0)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
        raise InvalidArgument(f"snapshot_options['timeout_s'] must be a positive number of seconds, got {t!r}")
    for flag in ("force", "allow_unsigned"):
        if not isinstance(options.get(flag, False), bool):
            raise InvalidArgument(f"snapshot_options[{flag!r}] must be True or False, got {options[flag]!r}")
    so = options.get("storage_options")
    if so is not None and not isinstance(so, dict):
        raise InvalidArgument(f"snapshot_options['storage_options'] must be a dict, got {type(so).__name__}")
    return dict(options)


class _DataFile:
    """One data file as the tier reads it; ``index`` etc. are set once it is loaded."""

    def __init__(self, number: int, info: fmt.DataFileInfo):
        self.number, self.info = number, info
        self.footer: bytes | None = None  # the 40 bytes loaded: later reads compare against them
        self.dead: str | None = None  # why it is no longer read (deleted, truncated, replaced)

    @property
    def tail_start(self) -> int:
        return self.info.size - self.info.items * _ENTRY - fmt.FOOTER_BYTES


# a record's bytes on disk beyond its payload: header, the longest key, padding
_RECORD_SLACK = records.RECORD_HEADER_BYTES + records.MAX_KEY_BYTES + 2 * records.ALIGN + TRAILER_BYTES


class SnapshotTier:
    """A snapshot as a read-only ``tiers.protocol.Tier`` (NOTE [snapshot read-through]); ``offer`` ignores.

    ``url``: a local path or an fsspec URL. ``force``: serve it even if it names another dataset.
    ``timeout_s``: the longest a read of an fsspec store may take (then a miss, and a pause).
    ``counts_path`` and ``slot``: where this process's counters go (else they stay in it)."""

    name = "snapshot"
    COUNTERS = COUNTERS
    read_only = True  # TieredStore.put offers it nothing (NOTE [tiers])
    leases = False  # nothing is computed for it: no lease (NOTE [remote leases])
    # the most bytes one batch's values may take in all (TieredStore lowers it to the cache's
    # cap): a batch of records that each claim a GiB is refused past it, never all decoded
    max_batch_bytes = records.MAX_RAW_BYTES

    def __init__(self, url: str | os.PathLike, *, force: bool = False, storage_options: dict | None = None,
                 timeout_s: float = 10.0, counts_path: str | os.PathLike | None = None,
                 slot: Callable[[], int] | None = None, secret: bytes | None = None,
                 allow_unsigned: bool = False):
        self._target = os.fspath(url)  # what is opened; ``url`` is what is shown (no password)
        self.url = mask_url(self._target)
        self.force = force
        # NOTE [record authentication]: with the job's secret a snapshot signed with it has every
        # record's MAC checked (and is trusted); another is refused unless allow_unsigned
        self._secret, self.allow_unsigned = secret, allow_unsigned
        self._mac: Any = None
        self._max_item = records.max_item_bytes()  # what an unsigned record may decode to
        self._ident = b""
        self.timeout_s = float(timeout_s)
        self._storage_options = with_timeouts(self.url, storage_options, self.timeout_s)
        self._counts_path, self._slot = counts_path, slot
        self._pid = -1
        self._bound: tuple[str | None, str | None] | None = None  # (cache name, fingerprint) to check
        self.manifest: fmt.Manifest | None = None
        self.off: str | None = None  # why the tier serves nothing (a manifest of another dataset)
        self.pending: str | None = None  # why it serves nothing yet (the cache's dataset is unknown)
        self._parts: list[_DataFile] = []
        # the merged index: hashes sorted, and per row the data file number << 40 | its row there;
        # replaced whole (never changed in place), so a reading thread sees one consistent state
        self._merged = (np.zeros(0, np.uint64), np.zeros(0, np.int64), {})
        self._indexes: dict[int, np.ndarray] = {}
        self._unloaded: set[int] = set()
        self._ensure()
        try:
            self._read_manifest()
        except _Fault as fault:  # down now: read it again after the pause (NOTE [snapshot read-through])
            self._fault(fault)
        except BaseException:
            self.close()  # its reader thread, if an fsspec store started one
            raise

    # --- per process -------------------------------------------------------------------------------

    def _ensure(self) -> None:
        if self._pid == os.getpid():
            return
        # a new process (or the first use): descriptors, threads and locks of the parent are not ours
        self._lock = threading.Lock()  # counters, breaker, data files
        self._load_lock = threading.Lock()  # one thread loads the indexes
        self.loc = open_location(self._target, self._storage_options)
        self.local = isinstance(self.loc, LocalLocation)
        if not self.local:  # its transfers are cancelled past the bound (an HTTP response closed)
            self.loc.timeout_s = self.timeout_s
        self._fds: dict[int, int] = {}
        self._dead_fds: list[int] = []
        self._dctx = threading.local()
        self._logged: set[str] = set()
        self._breaker = Breaker(_BACKOFF_MIN_S, _BACKOFF_MAX_S)  # no jitter: a snapshot's reads
        self._c = self._counts_row()
        self._pid = os.getpid()

    def _counts_row(self) -> np.ndarray:
        return tier_counts.process_row(self._counts_path, self.url, self._slot, f"snapshot tier {self.url}")

    # --- opening: the manifest, the cache's identity ------------------------------------------------

    def _read_manifest(self) -> None:
        """Read and check manifest.json; SnapshotError when there is no snapshot of this version,
        _Fault when the store cannot be reached (try again later)."""
        try:
            data = self._call(lambda: self.loc.read_bytes(fmt.MANIFEST, fmt.MAX_MANIFEST_BYTES), "read")
        except FileNotFoundError:
            raise SnapshotError(f"snapshot={self.url}: {self.loc.where(fmt.MANIFEST)} does not exist: no "
                                f"whole snapshot is there; pass the directory or URL `shmcache export` "
                                f"wrote") from None
        except OSError as exc:  # a local file: no store to wait for (a store's faults are _Fault)
            if isinstance(exc, SnapshotError):
                raise
            raise self.loc.error(exc, "read", fmt.MANIFEST) from None
        manifest = fmt.Manifest.from_json(data, self.loc.where(fmt.MANIFEST))
        self._mac = fmt.authenticate(manifest, self._secret, self.allow_unsigned,
                                     f"snapshot={self.url}: {self.loc.where(fmt.MANIFEST)}")
        self._ident = snapshot_ident(manifest.fingerprint, manifest.name)
        self._parts = [_DataFile(i, s) for i, s in enumerate(manifest.data_files)]
        self._unloaded = set(range(len(self._parts)))
        self.manifest = manifest
        if self._bound is not None:
            self._check_identity(*self._bound)

    def bind(self, name: str | None, fingerprint: str | None) -> None:
        """Check that the snapshot holds the dataset of cache ``name`` (``fingerprint``: its
        dataset's, when known); CacheMismatch if not, unless the tier was made with force."""
        self._bound = (name, fingerprint)
        if self.manifest is not None:
            self._check_identity(name, fingerprint)

    def _check_identity(self, name: str | None, fingerprint: str | None) -> None:
        m = self.manifest
        self.pending = None
        if m.fingerprint and fingerprint:
            same, what = m.fingerprint == fingerprint, f"fingerprint {m.fingerprint}, not {fingerprint}"
        else:
            same, what = m.name == name, f"cache {m.name!r}, not {name!r}"
        if same or self.force:
            self.off = None
            return
        if m.fingerprint and not fingerprint:  # a named cache that has not wrapped its dataset yet
            self.pending = (f"snapshot tier {self.url}: not read until cache {name!r} wraps its dataset "
                            f"(the snapshot is of dataset {m.fingerprint}, exported from {m.session}/"
                            f"{m.name}; the cache's own dataset is not known yet)")
            return
        self.off = (f"the snapshot at {self.url} holds another dataset ({what}; exported from "
                    f"{m.session}/{m.name})")
        raise CacheMismatch(f"{self.off}: it would serve another dataset's values. Pass the snapshot of "
                            f"this dataset, or snapshot_options={{'force': True}} if it is this dataset "
                            f"(e.g. only the transform's code changed)")

    @property
    def authenticated(self) -> bool:
        """Whether every record this tier returns carried the job's MAC (TieredStore trusts those)."""
        return self._mac is not None

    # --- the Tier protocol ------------------------------------------------------------------------------

    def get(self, key: bytes) -> bytearray | None:
        return self.get_many([key])[0]

    def get_many(self, keys: Sequence[bytes]) -> list[bytearray | None]:
        out: list[bytearray | None] = [None] * len(keys)
        if not len(keys):
            return out
        self._ensure()
        try:
            if self._ready():
                self._lookup(keys, out)
        except _Fault as fault:
            self._fault(fault)
        except RangeNotHonored as exc:  # the server's behaviour, not a file's: nothing more is asked of it
            with self._lock:
                self._add("errors", 1)
            self.off = str(exc)
            self._log("off", f"snapshot tier {self.url} is turned off: {exc}; its items are computed "
                             f"from the source")
        found = sum(v is not None for v in out)
        with self._lock:
            self._add("hits", found)
            self._add("misses", len(keys) - found)
        return out

    def offer(self, items: Sequence[tuple[bytes, Any]]) -> None:
        """Read-only: what the job computes is not written to the snapshot."""

    def counters(self) -> dict[str, int]:
        """This process's counts (NOTE [snapshot read-through])."""
        self._ensure()
        return {name: int(self._c[i]) for i, name in enumerate(COUNTERS)}

    def totals(self) -> dict:
        """The counts summed over every process of the session (this process's when not shared),
        and ``url``: this tier's (no password)."""
        shared = read_counts(self._counts_path) if self._counts_path and self._slot else None
        return {**(shared if shared is not None else self.counters()), "url": self.url}

    def close(self) -> None:
        if self._pid != os.getpid():
            return
        with self._lock:
            for fd in [*self._fds.values(), *self._dead_fds]:
                os.close(fd)
            self._fds.clear()
            self._dead_fds.clear()

    def __repr__(self) -> str:
        return f"SnapshotTier({self.url!r})"

    # --- reading ----------------------------------------------------------------------------------------

    def _ready(self) -> bool:
        """Whether reads may go to the store now: not paused, manifest and indexes loaded."""
        if self.off is not None or self._breaker.is_open():
            return False
        if self.pending is not None:
            self._log("pending", self.pending)
            return False
        if self.manifest is None:
            try:
                self._read_manifest()
            except (SnapshotError, CacheMismatch) as exc:  # it can no longer raise: turn the tier off
                self.off = str(exc)
                self._log("off", f"snapshot tier {self.url} is turned off: {exc}")
                return False
        if self._unloaded:
            with self._load_lock:
                if self._unloaded:
                    self._load_indexes()
        return True

    def _load_indexes(self) -> None:
        """Every data file's index and footer, one ranged read each (one call on an fsspec store)."""
        todo = [self._parts[i] for i in sorted(self._unloaded)]
        if self.local:
            tails = []
            for part in todo:
                try:
                    fd = self._fd(part)
                    st = os.fstat(fd)
                    if st.st_size != part.info.size:
                        raise SnapshotError(f"is {st.st_size} bytes, the manifest says {part.info.size}")
                    check_stored(fd, part.tail_start, part.info.size, self.loc.where(part.info.file))
                    tails.append(os.pread(fd, part.info.size - part.tail_start, part.tail_start))
                except FileNotFoundError:
                    tails.append(SnapshotError("is missing"))
                except OSError as exc:
                    tails.append(exc if isinstance(exc, SnapshotError) else SnapshotError(str(exc)))
        else:
            tails = self._cat([part.info.file for part in todo], [part.tail_start for part in todo],
                              [part.info.size for part in todo])
        for part, tail in zip(todo, tails):
            if isinstance(tail, RangeNotHonored):
                raise tail  # the server's, not the file's: the tier turns itself off
            if isinstance(tail, BaseException):
                if not _of_the_file(tail):
                    raise _Fault("unreachable", f"{self.loc.where(part.info.file)}: {tail!r}")
                self._drop(part, str(tail) if isinstance(tail, SnapshotError) else
                           "is missing" if isinstance(tail, FileNotFoundError) else f"cannot be read ({tail})")
                continue
            with self._lock:
                self._add("bytes_read", len(tail))
            try:
                self._indexes[part.number] = self._parse_tail(part, tail)
            except SnapshotError as exc:
                self._drop(part, str(exc))
        self._unloaded.clear()
        self._merge()

    def _parse_tail(self, part: _DataFile, tail: bytes) -> np.ndarray:
        where = self.loc.where(part.info.file)
        if len(tail) != part.info.size - part.tail_start:
            raise SnapshotError(f"is truncated (read {len(tail)} bytes of its index and footer)")
        body, footer_raw = tail[:-fmt.FOOTER_BYTES], tail[-fmt.FOOTER_BYTES:]
        footer = fmt.parse_footer(footer_raw, part.info.size, where)
        index = fmt.parse_index(body, footer, where)
        if fmt.data_file_digest(body, footer.raw) != part.info.sha256 or len(index) != part.info.items:
            raise SnapshotError("is not the data file the manifest names (its index hash or item count "
                                "differs): it was replaced or mixed with another snapshot's")
        part.footer = footer.raw
        return index

    def _merge(self) -> None:
        live = [(n, idx) for n, idx in sorted(self._indexes.items()) if self._parts[n].dead is None]
        if not live:
            self._merged = (np.zeros(0, np.uint64), np.zeros(0, np.int64), {})
            return
        hashes = np.concatenate([idx["hash"] for _, idx in live])
        rows = np.concatenate([(np.int64(n) << 40) | np.arange(len(idx), dtype=np.int64) for n, idx in live])
        order = np.argsort(hashes, kind="stable")
        self._merged = (np.ascontiguousarray(hashes[order]), rows[order], dict(live))

    def _lookup(self, keys: Sequence[bytes], out: list) -> None:
        merged, rows, indexes = self._merged
        hashes = np.frombuffer(b"".join(bytes(k[:8]).ljust(8, b"\0") for k in keys), "<u8")
        lo = np.searchsorted(merged, hashes, "left")
        hi = np.searchsorted(merged, hashes, "right")
        found = np.nonzero(hi > lo)[0]
        if not len(found):
            return
        # every candidate row (usually one per key; colliding index words give several)
        cnt = (hi - lo)[found]
        key_i = np.repeat(found, cnt)
        first = np.repeat(lo[found] - (np.cumsum(cnt) - cnt), cnt)
        cand = rows[first + np.arange(len(key_i))]
        part_of, row_of = cand >> 40, cand & ((1 << 40) - 1)
        wanted: dict[int, list[tuple[int, int, int, int]]] = {}  # data file -> (key i, offset, length, check)
        corrupt: list = []
        room = self.max_batch_bytes + len(keys) * _RECORD_SLACK  # what the batch may read from the files
        for part_n in np.unique(part_of).tolist():
            sel = part_of == part_n
            e = indexes[part_n][row_of[sel]]
            rows = []
            for row in zip(key_i[sel].tolist(), e["offset"].tolist(), e["length"].tolist(), e["check"].tolist()):
                if row[2] > min(room, self.max_batch_bytes + _RECORD_SLACK):  # read nothing of it
                    corrupt.append((part_n, row[1], f"its index entry says {row[2]} bytes, more than the "
                                                   f"{self.max_batch_bytes} a batch's values may have here"))
                    continue
                room -= row[2]
                rows.append(row)
            wanted[part_n] = rows
        reads = self._read_local(wanted) if self.local else self._read_remote(wanted)
        dctx, nbytes, left, forged = self._decompressor(), 0, self.max_batch_bytes, []
        for part_n, items in wanted.items():
            bufs = reads.get(part_n)
            if bufs is None:
                continue  # the data file changed under us: dropped, its keys miss
            for (i, offset, length, check), buf in zip(items, bufs):
                nbytes += len(buf)
                if out[i] is not None:
                    continue  # a colliding candidate already matched
                why = "it is cut short" if len(buf) != length else None
                if why is None and records.head_check_of(buf) != check:
                    why = "its head check is not its index entry's"
                payload, key = None, bytes(keys[i])
                if why is None and self._mac is not None:
                    if records.declared_key_len(buf) != len(key) or records.declared_key(buf) != key:
                        continue  # another key's record (a colliding index word): not this key's
                    buf, verdict = self._mac.open(self._ident + key, buf)  # before it is decompressed
                    if verdict == FORGED:
                        forged.append((part_n, offset))
                        continue
                if why is None:
                    payload, why = records.unpack_record(
                        buf, key, dctx, limit=left if self._mac is not None else min(left, self._max_item))
                if payload is not None:
                    out[i] = payload
                    left -= len(payload)
                elif why != "it holds another key" and not why.startswith("its key is"):
                    corrupt.append((part_n, offset, why))  # (another key's intact record: a collision)
        with self._lock:
            self._add("reads", 1)
            self._add("bytes_read", nbytes)
            self._add("corrupt", len(corrupt))
            self._add("forged", len(forged))
        if forged:
            part_n, offset = forged[0]
            detail = f"{self.loc.where(self._parts[part_n].info.file)} at offset {offset}"
            self._log("forged", f"snapshot tier {self.url} {_REASONS['forged'].format(detail=detail)}")
        if corrupt:
            part_n, offset, why = corrupt[0]
            detail = f"{self.loc.where(self._parts[part_n].info.file)} at offset {offset}: {why}"
            self._log("corrupt", f"snapshot tier {self.url} {_REASONS['corrupt'].format(detail=detail)}")

    def _read_local(self, wanted: dict) -> dict[int, list]:
        """The records of each data file: preadv on its descriptor, adjacent records in one call."""
        out = {}
        for part_n, items in wanted.items():
            part = self._parts[part_n]
            try:
                fd = self._fd(part)
                if os.fstat(fd).st_nlink == 0:
                    raise SnapshotError("was deleted while the job ran")
                tail = os.pread(fd, fmt.FOOTER_BYTES, part.info.size - fmt.FOOTER_BYTES)
                if tail != part.footer:
                    raise SnapshotError("was truncated or rewritten while the job ran (its footer changed)")
                bufs: list = [None] * len(items)
                order = sorted(range(len(items)), key=lambda j: items[j][1])
                run: list[int] = []
                for j in order + [None]:
                    if run and (j is None or items[j][1] != items[run[-1]][1] + items[run[-1]][2]):
                        views = [bytearray(items[k][2]) for k in run]
                        got = os.preadv(fd, views, items[run[0]][1])
                        for k, v in zip(run, views):  # a short read leaves later buffers short
                            take = max(0, min(len(v), got))
                            bufs[k] = v if take == len(v) else v[:take]
                            got -= len(v)
                        run = []
                    if j is not None:
                        run.append(j)
            except (OSError, SnapshotError) as exc:
                self._drop(part, str(exc) if isinstance(exc, SnapshotError) else f"cannot be read: {exc}")
                continue
            out[part_n] = bufs
        return out

    def _read_remote(self, wanted: dict) -> dict[int, list]:
        """The records of every data file in one ``read_ranges`` call, with each data file's footer."""
        paths, starts, ends, where = [], [], [], []
        for part_n, items in wanted.items():
            part = self._parts[part_n]
            paths.append(part.info.file)
            starts.append(part.info.size - fmt.FOOTER_BYTES)
            ends.append(part.info.size)
            where.append(part_n)
            for _, offset, length, _ in items:
                paths.append(part.info.file)
                starts.append(offset)
                ends.append(offset + length)
        got = self._cat(paths, starts, ends)
        out, pos = {}, 0
        for part_n in where:
            part, n = self._parts[part_n], len(wanted[part_n])
            footer, bufs = got[pos], got[pos + 1:pos + 1 + n]
            pos += 1 + n
            errors = [b for b in [footer, *bufs] if isinstance(b, BaseException)]
            refused = [e for e in errors if isinstance(e, RangeNotHonored)]
            if refused:
                raise refused[0]
            faults = [e for e in errors if not _of_the_file(e)]
            if faults:
                raise _Fault("unreachable", f"{self.loc.where(part.info.file)}: {faults[0]!r}")
            if any(isinstance(e, FileNotFoundError) for e in errors):
                self._drop(part, "was deleted while the job ran")
            elif errors or footer != part.footer:  # a range past its end: it is shorter now
                self._drop(part, "was truncated or rewritten while the job ran (its footer changed)")
            else:
                out[part_n] = bufs
        return out

    def _cat(self, names: list[str], starts: list[int], ends: list[int]) -> list:
        """Byte ranges of the snapshot's files (FsspecLocation.read_ranges: none longer than asked
        for), each result bytes or the exception; a fault of the whole call (or one longer than
        ``timeout_s``: then cancelled) raises _Fault."""
        loc: FsspecLocation = self.loc
        return self._call(lambda: loc.read_ranges(names, starts, ends), "read")

    def _call(self, fn: Callable, what: str) -> Any:
        """``fn()`` bounded by ``timeout_s`` on a store (a local file needs no bound).

        It runs in a daemon thread of its own: a read that outlives its bound (a store that
        stopped answering, while s3fs retries) is left behind, and must not keep the
        interpreter from exiting - a ThreadPoolExecutor's threads are joined at exit, which held
        a finished job for every retry (a minute at the default timeout). The breaker limits
        how many are left behind: none is started while it is open."""
        if self.local:
            return fn()
        box: dict[str, Any] = {}

        def run() -> None:
            try:
                box["value"] = fn()
            except BaseException as exc:  # noqa: BLE001 - handed to the caller below
                box["error"] = exc

        reader = threading.Thread(target=run, name="shmcache-snapshot-read", daemon=True)
        reader.start()
        reader.join(self.timeout_s)
        if reader.is_alive():
            raise _Fault("timeout", f"{what} {self.url}")
        exc = box.get("error")
        if exc is None:
            return box["value"]
        if isinstance(exc, (FileNotFoundError, SnapshotError)):
            raise exc
        if not isinstance(exc, Exception):
            raise exc
        if isinstance(exc, TimeoutError):  # the read's own bound (HTTP, S3: cancelled at timeout_s)
            raise _Fault("timeout", f"{what} {self.url}") from None
        raise _Fault("unreachable", f"{type(exc).__name__}: {exc}") from None

    # --- faults -----------------------------------------------------------------------------------------

    def _fault(self, fault: _Fault) -> None:
        with self._lock:
            self._add("errors", 1)
            self._breaker.trip()
        text = _REASONS[fault.kind].format(detail=fault.detail, t=self.timeout_s)
        self._log(fault.kind, f"snapshot tier {self.url} {text}")

    def _drop(self, part: _DataFile, why: str) -> None:
        """A data file that can no longer be trusted: its keys miss from now on."""
        with self._lock:
            if part.dead is not None:
                return
            part.dead = why
            self._add("errors", 1)
            fd = self._fds.pop(part.number, None)
            if fd is not None:  # closed at close(): another thread may be reading it right now
                self._dead_fds.append(fd)
            if self._indexes.pop(part.number, None) is not None:
                self._merge()
        where = self.loc.where(part.info.file)
        # the format's own errors name the file and give the advice: said once here, not twice
        why = why.removeprefix(where).removeprefix(":").strip().removesuffix(_ADVICE).rstrip("; ")
        self._log(f"part{part.number}", f"snapshot tier: data file {where}{' ' if why[:3] in _VERBS else ': '}{why}; "
                                       f"its {part.info.items} items are computed from the source from now on "
                                       f"({_ADVICE})")

    def _log(self, condition: str, text: str) -> None:
        if condition not in self._logged:
            self._logged.add(condition)
            log.warning("%s", scrub_secret(text, self._target))  # a backend's message may quote the URL

    def _add(self, counter: str, n: int) -> None:
        """Count into this process's row (the caller holds the lock)."""
        if n:
            self._c[_I[counter]] += np.uint64(n)

    def _fd(self, part: _DataFile) -> int:
        fd = self._fds.get(part.number)
        if fd is None:
            fd = open_regular(self.loc.path / part.info.file)[0]  # no link followed, no FIFO waited on
            self._fds[part.number] = fd
        return fd

    def _decompressor(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._dctx, "d", None)
        if d is None:
            d = self._dctx.d = zstandard.ZstdDecompressor()  # not thread-safe: one per thread
        return d

    def __getstate__(self) -> dict:
        raise TypeError("a SnapshotTier is not pickled; pickle the ShmDatasetCache, which opens its own")


def _of_the_file(exc: BaseException) -> bool:
    """Whether a failed range read is the file's fault (gone, or shorter than the range: S3's
    416 arrives as EINVAL) rather than the store's (unreachable, slow: the breaker's business)."""
    return isinstance(exc, (FileNotFoundError, SnapshotError, ValueError)) or (
        isinstance(exc, OSError) and exc.errno in (errno.EINVAL, errno.ERANGE))


# --- counters shared by the processes of a session -------------------------------------------------


def counts_path(registry, session: str, name: str) -> Path:
    """The file of a cache's snapshot counters (NOTE [tier counts]), beside its metadata."""
    return tier_counts.counts_path(registry, session, name, "snapshot")


def read_counts(path: str | os.PathLike) -> dict | None:
    """A cache's snapshot counters summed over every process, and ``url`` (None: no snapshot tier
    was ever in force for it). NOTE [tier counts]."""
    return tier_counts.read_counts(path, COUNTERS)


# --- wiring ---------------------------------------------------------------------------------------------


def open_tier(local: Store, url: str | os.PathLike, registry, options: dict | None = None,
              secret: bytes | None = None) -> SnapshotTier:
    """The snapshot tier at ``url`` of cache ``local`` (a CacheStore or a TieredStore), its
    counters in the cache's counts file when the store is shared. The caller hands it to
    ``tiers.assembly.assemble``, which binds it to the cache and puts it first (NOTE [tiers])."""
    from ..cache import process_slot

    shared = not local.uncached  # an uncached store holds no liveness slot
    session, name = local.session, local.name
    return SnapshotTier(url, **check_options(options), secret=secret,
                        counts_path=counts_path(registry, session, name) if shared else None,
                        slot=(lambda: process_slot.slot(registry, session)) if shared else None)


def tiered(local: Store, url: str | os.PathLike, name: str, fingerprint: str | None, registry,
           options: dict | None = None, secret: bytes | None = None, allow_pickle: bool = False) -> TieredStore:
    """``local`` (a CacheStore, or a TieredStore already) with the snapshot at ``url`` as its first
    tier: read-only, exact and cheap, it is asked before a remote (assembly.ORDER)."""
    return assembly.assemble(local, [open_tier(local, url, registry, options, secret)], name=name,
                             fingerprint=fingerprint, allow_pickle=allow_pickle, registry=registry)


def manifest_of(url: str | os.PathLike, options: dict | None = None, secret: bytes | None = None) -> fmt.Manifest:
    """The manifest of the snapshot at ``url``, read as the tier reads it (bounded by ``timeout_s``,
    authenticated with ``secret`` as the tier would): what ``wrap(None)`` of an unnamed cache takes
    its name, identity and length from. SnapshotError if there is no snapshot there, or the store
    does not answer now."""
    tier = SnapshotTier(url, secret=secret, **check_options(options))
    try:
        if tier.manifest is None:  # a fault of the store, logged by the tier
            raise SnapshotError(f"snapshot={tier.url}: its manifest.json cannot be read now (the store does "
                                f"not answer), and wrap(None) takes the cache's name and length from it; "
                                f"try again, or give name= of a cache imported from it")
        return tier.manifest
    finally:
        tier.close()


def snapshot_tier(store: Store) -> SnapshotTier | None:
    """The snapshot tier behind ``store``, if any."""
    for tier in assembly.tiers_of(store):
        if isinstance(tier, SnapshotTier):
            return tier
    return None
