"""Import: a snapshot into a cache's shared memory, at the speed of the disk.

    report = import_snapshot("/data/snap", session="job")      # opens (or makes) the cache
    report = import_into(store, loc, manifest)                  # into a store already open

Every data file is checked before anything is stored (present, its size, header, footer, and index
against the manifest's sha256: NOTE [snapshot format]), so a truncated, swapped or missing data file
is an error naming it, not half an import. Then a thread pool reads the data files (file reads and
zstd release the GIL) in blocks of whole records, checks each record, and stores the portable
records of a block straight into shared memory under one hold of the lock
(``CacheStore.put_records``: no decoding, one copy; raw records are not even copied out of the
read buffer). A record that fails its checks is skipped and counted; an item that does not fit
the cap spills when spilling is on, else is counted as rejected: the report says so, and what to
do.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import zstandard

from ..base.faults import ARMED as _CRASH_TESTS
from ..base.faults import crash_point
from ..base.namespace import namespace, resolve_session_name
from ..base.progress import progress_bar
from ..base.trust import FORGED, PICKLE_HINT, TRAILER_BYTES, resolve_secret, snapshot_ident
from ..cache.store_protocol import LocalStore, Store
from ..errors import CacheMismatch, InvalidArgument, SnapshotError
from ..tiers import records as records
from ..tiers.tiered_store import key_of_portable, untrusted_problem
from . import format as fmt
from .location import SnapshotLocation, open_location

__all__ = ["import_snapshot", "import_into", "read_manifest", "read_data_file_index", "read_indexes",
           "ImportReport", "replace_other_dataset", "cache_exists", "given_back_on_failure", "IMPORT_TIMEOUT_S"]

log = logging.getLogger("shmcache")

_READ_BLOCK_BYTES = 4 << 20  # a block: read this much of a data file at once (whole records; a larger one alone)
#: The longest one read of an import from an HTTP(S) or S3 snapshot may take (the manifest, an
#: index, a block of _READ_BLOCK_BYTES or one larger record): a server that trickles bytes, or stopped
#: answering, fails the import then, naming the server and the fix, instead of holding it for
#: ever (aiohttp allows 300 s a request, botocore 60 s a socket read, each retried). timeout_s= of
#: import_snapshot and ShmDatasetCache.from_snapshot, `shmcache import --timeout-s`.
IMPORT_TIMEOUT_S = 60.0
# header, key, pads and a MAC's trailer: what an index entry may add to the record's decoded bytes
_RECORD_SLACK = records.RECORD_HEADER_BYTES + records.MAX_KEY_BYTES + 2 * records.ALIGN + TRAILER_BYTES
_BATCH_RAW_BYTES = 64 << 20  # store a block's records once they decode to this much (bombs do not add up)


@dataclass
class ImportReport:
    """What an import stored."""

    src: str
    session: str
    name: str
    items: int = 0  # in the snapshot
    imported: int = 0  # now in the cache (or were already: put keeps what is there)
    spilled: int = 0  # of those, in spill files (the cap was reached with spilling on)
    rejected: int = 0  # not stored: the cap was reached and spilling is off (or /dev/shm is full)
    memory_full: str = ""  # why, where it was the shared memory and not the cap: where, how much
    damaged: int = 0  # records that failed their checks: skipped
    forged: int = 0  # records without the job's MAC (a signed snapshot, read with the secret): skipped
    pickled: int = 0  # records holding a pickled object, not authenticated: refused unread
    duplicates: int = 0  # index entries of a key already imported: skipped, not counted as imported
    overlapping: int = 0  # index entries sharing bytes with the entry before them: skipped
    bytes: int = 0  # data file bytes read
    seconds: float = 0.0
    length: int | None = None
    damaged_where: list = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return self.imported == self.items

    def __str__(self) -> str:
        rate = self.bytes / self.seconds / 2**20 if self.seconds else 0.0
        text = (f"imported {self.imported} of {self.items} items into {self.session}/{self.name} from "
                f"{self.src} ({self.bytes / 2**20:.1f} MiB in {self.seconds:.1f} s, {rate:.0f} MiB/s)")
        if self.spilled:
            text += f"; {self.spilled} of them spilled to disk (shared memory was full)"
        if self.rejected and self.memory_full:
            text += (f"; {self.rejected} did not fit ({self.memory_full}, and the cache does not spill): free "
                     f"room there (`shmcache gc`, or `shmcache destroy` of sessions no longer used; `shmcache "
                     f"info` shows it), give that mount more, or spilling=True (--spilling --spill-dir DIR)")
        elif self.rejected:
            text += (f"; {self.rejected} did not fit (the cache's cap is reached and it does not spill): "
                     f"give it a larger size= (MiB), or spilling=True (--spilling --spill-dir DIR)")
        if self.damaged:
            text += (f"; {self.damaged} record(s) failed their checks and were skipped "
                     f"({'; '.join(self.damaged_where[:3])}): copy the snapshot again")
        if self.forged:
            text += (f"; {self.forged} record(s) lack this job's MAC (changed, or added by someone "
                     f"without the secret) and were skipped: export the snapshot again")
        if self.pickled:
            text += (f"; {self.pickled} record(s) hold a pickled object and were skipped unread "
                     f"(the snapshot is not signed with this job's secret): {PICKLE_HINT}")
        if self.duplicates:
            text += (f"; {self.duplicates} index entr{'y' if self.duplicates == 1 else 'ies'} named a key "
                     f"already imported (a duplicate: the snapshot is damaged or forged) and were skipped")
        if self.overlapping:
            text += (f"; {self.overlapping} index entr{'y' if self.overlapping == 1 else 'ies'} shared bytes "
                     f"with another (overlapping: the snapshot is damaged or forged) and were skipped")
        return text


def read_manifest(src: str | os.PathLike, storage_options: dict | None = None,
                  timeout_s: float | None = None) -> tuple[SnapshotLocation, fmt.Manifest]:
    """The snapshot's location and manifest; SnapshotError if there is no whole snapshot there.
    ``timeout_s``: the longest each read from the location may take (None: IMPORT_TIMEOUT_S)."""
    if timeout_s is None:
        timeout_s = IMPORT_TIMEOUT_S
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < float("inf"):
        raise InvalidArgument(f"timeout_s must be a positive number of seconds (the longest one read of the "
                              f"import may take; default {IMPORT_TIMEOUT_S:g}), got {timeout_s!r}")
    loc = open_location(src, storage_options, float(timeout_s))
    try:
        data = loc.read_bytes(fmt.MANIFEST, fmt.MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        half = loc.export_left_files(fmt.data_file_name(0))
        raise SnapshotError(
            f"{loc.where(fmt.MANIFEST)} does not exist: "
            + ("the export that wrote this snapshot did not finish (data files but no manifest); export "
               "it again (--overwrite)" if half else "no snapshot there; pass the directory `shmcache "
               "export` wrote")
        ) from None
    except OSError as exc:
        raise loc.error(exc, "read", fmt.MANIFEST) from None
    return loc, fmt.Manifest.from_json(data, loc.where(fmt.MANIFEST))


def _memory_full(session: str, stats: dict) -> str:
    """Why an import's items did not fit where it is the shared memory, not the cap: the cache
    committed well under its cap (a cap larger than the mount, or the mount shared) - "" else."""
    cap, used = stats.get("capacity_bytes", 0), stats.get("committed_bytes", 0)
    if not cap or used >= cap - cap // 10:
        return ""
    from ..cache.registry import SessionRegistry

    try:
        where = SessionRegistry(namespace()).memory_root(session)
    except Exception:  # noqa: BLE001 - a message's detail: the session's record unreadable
        where = "the shared memory"
    return (f"{where} is full: the cache holds {used / 2**20:.1f} MiB of its cap of {cap / 2**20:.0f} MiB")


def import_snapshot(src: str | os.PathLike, *, session: str = "auto", name: str | None = None,
                    size_mb: int = 0, spilling: bool = False, spill_dir: str | os.PathLike | None = None,
                    force: bool = False, threads: int | None = None, progress: bool | None = None,
                    storage_options: dict | None = None, secret: str | bytes | None = None,
                    allow_pickle: bool = False, allow_unsigned: bool = False,
                    timeout_s: float | None = None) -> ImportReport:
    """Import the snapshot at ``src`` into cache ``name`` (default: the exported cache's name) of
    ``session``; the cache is made if needed (``size_mb``: its cap, 0 automatic). ``secret``,
    ``allow_pickle``, ``allow_unsigned``: see import_into. ``timeout_s``: the longest one read may
    take (None: IMPORT_TIMEOUT_S, 60 s); past it the import fails, giving back the cache it made."""
    from ..cache.store import CacheStore

    records.max_item_bytes()  # a bad $SHMCACHE_MAX_ITEM_MB: refused before anything is read or made
    loc, manifest = read_manifest(src, storage_options, timeout_s)
    key = resolve_secret(secret)
    fmt.authenticate(manifest, key, allow_unsigned, loc.where(fmt.MANIFEST))  # before a cache is made
    if spilling:  # checked before the cache (and its session) is made: a refusal leaves nothing behind
        from ..cache.registry import SessionRegistry
        from ..tiers.spill.tier import resolve_spill_dir

        registry, name_s = SessionRegistry(namespace()), resolve_session_name(session)
        spill_dir = resolve_spill_dir(spill_dir, registry.get(name_s).spill_dir if registry.exists(name_s) else None)

    # every index is read and checked before a cache is made: the table is sized by the entries
    # really read (never by a count that claims them), and a snapshot that fails commits nothing
    indexes = read_indexes(loc, manifest)

    def opened() -> CacheStore:
        return CacheStore(resolve_session_name(session), name or manifest.name, capacity_bytes=size_mb << 20,
                          table_hint=sum(len(i) for i in indexes))

    made = not cache_exists(session, name or manifest.name)
    store = opened()
    try:
        with given_back_on_failure(store, made):
            if replace_other_dataset(store, manifest, force):  # destroyed (and closed): a new incarnation
                store = opened()
            if spilling:
                from ..tiers.spill import tier

                tier.attach(store, spill_dir)
            return import_into(store, loc, manifest, force=force, threads=threads, progress=progress, secret=key,
                               allow_pickle=allow_pickle, allow_unsigned=allow_unsigned, indexes=indexes)
    finally:
        store.close()


def read_indexes(loc: SnapshotLocation, manifest: fmt.Manifest) -> list[np.ndarray]:
    """Every data file's index, read and checked (read_data_file_index)."""
    return [read_data_file_index(loc, part, i) for i, part in enumerate(manifest.data_files)]


def cache_exists(session: str, name: str) -> bool:
    """Whether cache ``name`` of ``session`` exists now (an import that makes it gives it back
    if it fails: given_back_on_failure)."""
    from ..cache.registry import SessionRegistry

    registry, session = SessionRegistry(namespace()), resolve_session_name(session)
    return registry.exists(session) and registry.cache_meta_path(session, name).exists()


@contextlib.contextmanager
def given_back_on_failure(store: Store, made: bool):
    """An import into ``store``: if it raises and the import ``made`` the cache, the cache is
    destroyed before the error goes on - its table and segments in /dev/shm given back, not left
    for ``shmcache gc``."""
    try:
        yield
    except BaseException:
        if made and not getattr(store, "uncached", False):
            with contextlib.suppress(Exception):
                cast(LocalStore, store).destroy()  # not uncached: shared memory of its own
        raise


def import_into(store: Store, loc: SnapshotLocation, manifest: fmt.Manifest, *, force: bool = False,
                threads: int | None = None, progress: bool | None = None, secret: str | bytes | None = None,
                allow_pickle: bool = False, allow_unsigned: bool = False,
                indexes: list[np.ndarray] | None = None) -> ImportReport:
    """Store the snapshot's items in ``store`` (a CacheStore, maybe with spilling attached);
    ``indexes``: the data files' indexes if read already (read_indexes).

    ``secret`` (None: ``$SHMCACHE_SECRET``): a snapshot signed with it has every record's MAC
    checked (a record without it is skipped, counted ``forged``) and is trusted, pickled leaves
    included; one unsigned or signed with another secret is refused (SnapshotError) unless
    ``allow_unsigned``. Records that are not authenticated are data: one holding a pickled
    object is skipped unread (counted ``pickled``) unless ``allow_pickle`` (NOTE [record
    authentication])."""
    mac = fmt.authenticate(manifest, resolve_secret(secret), allow_unsigned, loc.where(fmt.MANIFEST))
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise InvalidArgument(f"threads must be a positive int or None, got {threads!r}")
    started = time.perf_counter()
    report = ImportReport(loc.url, store.session, store.name, items=manifest.items, length=manifest.length)
    if indexes is None:
        indexes = read_indexes(loc, manifest)  # all, first
    _bind(store, manifest, force, authenticated=mac is not None)
    if getattr(store, "uncached", False):
        report.rejected = manifest.items
        return report
    spilled_before = store.stats().get("items_disk", 0)
    job = _Job(store, loc, report, progress_bar(progress, sum(s.size for s in manifest.data_files),
                                                 f"import {store.session}/{store.name}", "B"),
               mac, fmt_ident(manifest), allow_pickle or mac is not None)
    job.repeated = _repeated_hashes(indexes)
    indexes = [_within(part, _without_overlaps(index, report), job.limit, report)
               for part, index in zip(manifest.data_files, indexes)]
    units = [u for part, index in zip(manifest.data_files, indexes) for u in _read_blocks(part, index)]
    workers = threads or min(4, os.cpu_count() or 1, max(1, len(units)))
    try:
        with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="shmcache-import") as pool:
            for fut in [pool.submit(job.block, *unit) for unit in units]:
                fut.result()  # the first error (a data file that changed under us, a dead store) raises
    finally:
        job.bar.close()
    stats = store.stats()
    report.spilled = max(0, stats.get("items_disk", 0) - spilled_before)
    report.seconds = time.perf_counter() - started
    if report.rejected:
        report.memory_full = _memory_full(store.session, stats)
    if report.rejected or report.damaged or report.forged or report.pickled or report.duplicates \
            or report.overlapping:
        log.warning("%s", report)
    return report


def _without_overlaps(index: np.ndarray, report: ImportReport) -> np.ndarray:
    """The index less the entries that start inside the bytes of the entry before them (in file
    order): two entries sharing bytes cannot both be records, and reading both would store one
    record twice and report an item that is not there. Counted in ``report.overlapping``."""
    if len(index) < 2:
        return index
    index = index[np.argsort(index["offset"], kind="stable")]
    offsets = index["offset"].astype(np.int64)
    ends = np.maximum.accumulate(offsets + index["length"].astype(np.int64))
    keep = np.ones(len(index), bool)
    keep[1:] = offsets[1:] >= ends[:-1]
    report.overlapping += int(len(index) - keep.sum())
    return index[keep]


def _within(part: fmt.DataFileInfo, index: np.ndarray, limit: int, report: ImportReport) -> np.ndarray:
    """The index less the entries longer on disk than any record of at most ``limit`` bytes can be:
    counted damaged without a byte of them read (a forged entry must not size a read)."""
    over = index["length"] > np.uint64(limit + _RECORD_SLACK)
    if over.any():
        report.damaged += int(over.sum())
        offsets, lengths = index["offset"][over][:3].tolist(), index["length"][over][:3].tolist()
        report.damaged_where += [f"{part.file} at offset {off} (an entry of {n} bytes)"
                                 for off, n in zip(offsets, lengths)]
    return index[~over]


def _repeated_hashes(indexes: list[np.ndarray]) -> frozenset[int]:
    """The index words that more than one entry of the snapshot carries: only a record with one of
    these can repeat a key (a portable key starts with its index word), so only those keys are
    remembered to find duplicates."""
    if not indexes:
        return frozenset()
    hashes = np.sort(np.concatenate([i["hash"] for i in indexes]))
    same = hashes[1:] == hashes[:-1]
    return frozenset(hashes[1:][same].tolist())


def _read_blocks(part: fmt.DataFileInfo, index: np.ndarray):
    """The data file's records in file order, in blocks read at once, up to _READ_BLOCK_BYTES (a larger record alone):
    ``(part, start, end, offsets, lengths)``, the thread pool's units of work."""
    order = np.argsort(index["offset"], kind="stable")
    offsets = index["offset"][order].astype(np.int64)
    ends = offsets + index["length"][order].astype(np.int64)
    i, n = 0, len(order)
    while i < n:
        start = int(offsets[i])
        j = i + 1 + int(np.searchsorted(ends[i + 1:], start + _READ_BLOCK_BYTES, "right"))
        yield part, start, int(ends[j - 1]), offsets[i:j].tolist(), (ends[i:j] - offsets[i:j]).tolist()
        i = j


def read_data_file_index(loc: SnapshotLocation, part: fmt.DataFileInfo, number: int) -> np.ndarray:
    """The index of data file ``number``, read with three ranged reads (header, footer, index) and
    checked against the manifest: what a reader that looks keys up (format.find) starts from.
    SnapshotError naming the file when it is missing, truncated, damaged or not the one named."""
    where = loc.where(part.file)
    try:
        size = loc.size(part.file)
        if size != part.size:
            raise SnapshotError(f"{where} is {size} bytes, the manifest says {part.size}: it is "
                                f"{'truncated' if size < part.size else 'not the file exported'}; copy "
                                f"the snapshot again, or export it again")
        fmt.parse_header(loc.read_range(part.file, 0, fmt.HEADER_BYTES), where, number)
        footer = fmt.parse_footer(loc.read_range(part.file, size - fmt.FOOTER_BYTES, size), size, where)
        if footer.count != part.items:  # before the index is read: its size is the manifest's, checked
            raise SnapshotError(f"{where} holds {footer.count} index entries, the manifest says {part.items}: "
                                f"it was replaced or mixed with another snapshot's; copy the snapshot "
                                f"again, or export it again")
        # the footer's count sizes this read: only once the bytes it names are really stored
        body = loc.read_range(part.file, footer.index_offset, footer.index_offset + footer.index_bytes,
                              stored=True)
    except FileNotFoundError:
        raise SnapshotError(f"data file {where} is missing (the manifest names it); copy the whole "
                            f"snapshot again") from None
    except OSError as exc:
        if isinstance(exc, SnapshotError):
            raise
        raise loc.error(exc, "read", part.file) from None
    index = fmt.parse_index(body, footer, where)
    if fmt.data_file_digest(body, footer.raw) != part.sha256 or len(index) != part.items:
        raise SnapshotError(f"{where} is not the data file the manifest names (its index hash or item "
                            f"count differs): it was replaced or mixed with another snapshot's; copy "
                            f"the snapshot again, or export it again")
    return index


def replace_other_dataset(store: Store, manifest: fmt.Manifest, force: bool) -> bool:
    """If ``store`` holds another dataset than the snapshot: CacheMismatch, unless ``force``, which
    destroys that cache - its root tombstoned first, as ``shmcache destroy --force`` does - and
    answers True: the caller opens the cache again (a new, empty incarnation) and imports into
    that. A clear() would not do: processes still reading the old dataset would find the
    snapshot's values under their keys and take them for theirs; tombstoned, their handles miss
    (and their writes raise CacheNotFound) from then on."""
    if getattr(store, "uncached", False):
        return False
    local = cast(LocalStore, store)  # not uncached: shared memory of its own, metadata and all
    fp = manifest.fingerprint
    known = local.read_meta().get("fingerprint")
    if not (fp and known and known != fp):
        return False
    if not force:
        raise CacheMismatch(
            f"cache {store.session}/{store.name} holds another dataset (fingerprint {known}) than "
            f"the snapshot (fingerprint {fp}, of {manifest.session}/{manifest.name}); import it "
            f"under another name (--name), or pass --force (force=True) to replace that cache "
            f"(processes still reading it then miss: they recompute or stop, never read the snapshot's "
            f"values as theirs)")
    log.warning("cache %s/%s held another dataset (fingerprint %s): destroyed for the import of %s "
                "(processes still reading it miss from now on)", store.session, store.name, known, fp)
    local.destroy()
    return True


def _bind(store: Store, manifest: fmt.Manifest, force: bool, authenticated: bool = False) -> None:
    """Record the snapshot's dataset (fingerprint) and length in the cache, and whether the job's
    secret authenticated that length (wrap(None) bounds one it did not); a cache holding another
    dataset is refused (CacheMismatch): ``force`` replaces it only through
    :func:`replace_other_dataset`, before the store is handed here."""
    if getattr(store, "uncached", False):
        return
    local = cast(LocalStore, store)  # not uncached: shared memory of its own, metadata and all
    fp = manifest.fingerprint
    known = local.read_meta().get("fingerprint")
    if fp and known and known != fp:
        raise CacheMismatch(
            f"cache {store.session}/{store.name} holds another dataset (fingerprint {known}) than "
            f"the snapshot (fingerprint {fp}, of {manifest.session}/{manifest.name}); import it "
            f"under another name (--name), or pass --force (force=True) to import_snapshot or "
            f"ShmDatasetCache.from_snapshot, which replace that cache")
    with local.locked():  # the cache's metadata is only ever rewritten under its lock
        meta = local.read_meta()
        if fp:
            meta["fingerprint"] = fp
        if manifest.length is not None:
            meta["length"] = manifest.length
            meta["length_authenticated"] = authenticated
        local.write_meta(meta)  # a forced destroy meanwhile: SessionNotFound


class _Job:
    """The work of one import, shared by its threads."""

    def __init__(self, store: Store, loc: SnapshotLocation, report: ImportReport, bar: Any, mac: Any = None,
                 ident: bytes = b"", allow_pickle: bool = False):
        self.mac, self.ident = mac, ident  # a trust.Mac: every record must carry it
        self.allow_pickle = allow_pickle  # authenticated, or the caller's opt-in
        self.store = store
        self.loc = loc
        self.report = report
        self.bar = bar
        self.lock = threading.Lock()  # the report's counters and the bar
        self.repeated: frozenset[int] = frozenset()  # index words more than one entry carries
        self.seen: set[bytes] = set()  # the keys imported with one of those words
        # a record may decode to no more than the cache can hold (the spill files: any item)
        cap = getattr(store, "capacity_bytes", 0)
        self.limit = records.MAX_RAW_BYTES if getattr(store, "spill", None) is not None or not cap \
            else min(records.MAX_RAW_BYTES, cap)
        if mac is None:  # a stranger's record: at most what a value from outside may have (``records.max_item_bytes``)
            self.limit = min(self.limit, records.max_item_bytes())
        self._local = threading.local()  # a zstd decompressor per thread

    def block(self, part: fmt.DataFileInfo, start: int, end: int, offsets: list[int], lengths: list[int]) -> None:
        """Read records [start, end) of a data file in one read, check them, store them in one batch."""
        buf = memoryview(self._read(part, start, end))
        dctx = self._dctx()
        items, damaged, raw, stored, rejected, duplicates, forged, pickled = [], [], 0, 0, 0, 0, 0, 0
        for off, length in zip(offsets, lengths):
            item = self._checked(buf[off - start:off - start + length], dctx)
            if item is _FORGED:
                forged += 1
                continue
            if item is _PICKLED:
                pickled += 1
                continue
            if item is None:
                damaged.append(f"{part.file} at offset {off}")
                continue
            if self._repeats(item[2]):
                duplicates += 1
                continue
            items.append(item[:2])
            raw += len(item[1])
            if raw >= _BATCH_RAW_BYTES:  # decoded values are stored before more are decoded
                done = sum(self.store.put_records(items))
                stored, rejected, items, raw = stored + done, rejected + len(items) - done, [], 0
        if items:
            done = sum(self.store.put_records(items))
            stored, rejected = stored + done, rejected + len(items) - done
        if _CRASH_TESTS:
            crash_point("snapshot_block")  # a block stored, the import not finished
        with self.lock:
            r = self.report
            r.imported += stored
            r.rejected += rejected
            r.duplicates += duplicates
            r.damaged += len(damaged)
            r.forged += forged
            r.pickled += pickled
            r.bytes += end - start
            r.damaged_where += damaged[:3]
            self.bar.update(end - start)

    def _repeats(self, pkey: bytes) -> bool:
        """Whether ``pkey`` was imported already (another entry of the same key: a duplicate)."""
        if fmt.key_hash(pkey) not in self.repeated:
            return False
        with self.lock:
            if pkey in self.seen:
                return True
            self.seen.add(pkey)
            return False

    def _dctx(self) -> Any:
        dctx = getattr(self._local, "dctx", None)
        if dctx is None:
            dctx = self._local.dctx = zstandard.ZstdDecompressor()
        return dctx

    def _read(self, part: fmt.DataFileInfo, start: int, end: int) -> Any:
        try:
            # stored: index entries within the record bound, over the holes of a sparse file, made
            # an import read the apparent size a stranger chose (16 GiB of zeros, 28 s, for 104 KB on disk)
            buf = self.loc.read_range(part.file, start, end, stored=True)
        except SnapshotError:
            raise  # it names the file and the fix already
        except OSError as exc:
            raise self.loc.error(exc, "read", part.file) from None
        if len(buf) != end - start:
            raise SnapshotError(f"{self.loc.where(part.file)} ended at {start + len(buf)} bytes while it was "
                                f"imported (it was {part.size}): it changed under the import; copy it again")
        return buf

    def _checked(self, view: memoryview, dctx: Any) -> Any:
        """``(key, portable record, portable key)`` of one record, or None if it fails any check (damaged),
        _FORGED if it lacks the job's MAC, _PICKLED if it holds a pickled leaf that may not be
        read. Nothing is decoded, nothing unpickled: the layout is checked (codec.check_layout)."""
        if len(view) < records.RECORD_HEADER_BYTES:
            return None
        pkey = records.declared_key(view)
        if self.mac is not None:  # before a byte of the record is decompressed
            view, verdict = self.mac.open(self.ident + pkey, view)
            if verdict == FORGED:
                return _FORGED
        payload, _ = records.unpack_record(view, pkey, dctx, copy=False, limit=self.limit)  # raw: a view
        if payload is None:
            return None
        try:
            key = key_of_portable(pkey)
        except ValueError:
            return None
        # checked bytes can still be a forged or foreign record: its layout must be one the encoder
        # writes, its leaves inside it, and a pickled leaf only from an authenticated snapshot
        why = untrusted_problem(payload, self.allow_pickle, authenticated=self.mac is not None)
        if why is None:
            return key, payload, pkey
        return _PICKLED if why.startswith("pickle: ") else None


_FORGED, _PICKLED = object(), object()


def fmt_ident(manifest: fmt.Manifest) -> bytes:
    """The start of every record's MAC context in this snapshot (trust.snapshot_ident)."""
    return snapshot_ident(manifest.fingerprint, manifest.name)
