"""Export: a cache's items, from shared memory and its spill files, into a snapshot.

    report = export_cache(store, "/data/snap")              # or "s3://bucket/snap", "memory://x"
    report = export_cache(store, dest, overwrite=True, segment_bytes=256 << 20)

The files are written in the order of NOTE [snapshot format], so an export that dies half-way (a
full disk, a kill) leaves no snapshot that looks whole. The cache is read without its lock, like every read: a
process that keeps storing items meanwhile does not stop the export (what it adds may or may not
be included); a clear() or destroy meanwhile is an error, since what was read is no one state.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, cast

import zstandard

from ..base.faults import ARMED as _CRASH_TESTS
from ..base.faults import crash_point
from ..base.progress import progress_bar
from ..base.trust import Mac, resolve_secret, snapshot_ident
from ..cache import codec
from ..cache.store_protocol import LocalStore, Store
from ..errors import InvalidArgument, SnapshotError
from . import format as fmt
from .location import SnapshotLocation, open_location

__all__ = ["export_cache", "ExportReport"]

log = logging.getLogger("shmcache")

_OURS = re.compile(r"(manifest\.json|seg-\d{5,}\.shms)(\.tmp)?")
_MIN_SEGMENT_BYTES = 4096


@dataclass
class ExportReport:
    """What an export wrote."""

    dest: str
    items: int = 0
    bytes: int = 0  # portable records, before compression
    stored_bytes: int = 0  # the data files
    segments: int = 0  # data files written (the field keeps its public name, as segment_bytes= does)
    damaged: int = 0  # spilled records that failed their checks: not exported
    seconds: float = 0.0
    damaged_keys: list = field(default_factory=list)

    def __str__(self) -> str:
        ratio = self.bytes / self.stored_bytes if self.stored_bytes else 1.0
        text = (f"exported {self.items} items ({self.bytes / 2**20:.1f} MiB, stored in "
                f"{self.stored_bytes / 2**20:.1f} MiB: {ratio:.2f}x) in {self.segments} data file(s) to "
                f"{self.dest} in {self.seconds:.1f} s")
        if self.damaged:
            text += (f"; {self.damaged} damaged spilled record(s) were left out (recomputed from the "
                     f"source when used)")
        return text


def export_cache(store: Store, dest: str | os.PathLike, *, overwrite: bool = False, length: int | None = None,
                 segment_bytes: int = fmt.DEFAULT_SEGMENT_BYTES, level: int = 1,
                 progress: bool | None = None, storage_options: dict | None = None,
                 secret: str | bytes | None = None) -> ExportReport:
    """Write every item of ``store`` (a CacheStore, or a TieredStore in front of one) to a snapshot at ``dest``.

    ``secret``: the job's (None: ``$SHMCACHE_SECRET``; ``""``: none): with one, every record and
    the manifest carry its MAC (NOTE [record authentication]), so a reader with the same secret
    trusts them, pickled leaves included, and refuses anything changed.
    ``overwrite``: replace a snapshot already there (else SnapshotError). ``length``: the wrapped
    dataset's len(), recorded for ``wrap(None)`` (None: the cache's own record of it, or, when
    its keys are exactly 0..n-1, n). ``progress``: a progress bar on stderr (None: when stderr is
    a terminal)."""
    if isinstance(segment_bytes, bool) or not isinstance(segment_bytes, int) or segment_bytes < _MIN_SEGMENT_BYTES:
        raise InvalidArgument(f"segment_bytes must be an int of at least {_MIN_SEGMENT_BYTES}, got "
                              f"{segment_bytes!r} (default {fmt.DEFAULT_SEGMENT_BYTES}: 512 MiB)")
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
        raise InvalidArgument(f"length must be a non-negative int or None, got {length!r}")
    key = resolve_secret(secret)
    if getattr(store, "uncached", False):
        raise SnapshotError(f"cache {store.session}/{store.name} has no shared memory (it could not be "
                            f"made), so there is nothing to export; make room in /dev/shm and fill it")
    loc = open_location(dest, storage_options)
    try:
        return _export(cast(LocalStore, store), loc, overwrite, length, segment_bytes, level, progress, key)
    finally:
        loc.close()


def _export(store: LocalStore, loc: SnapshotLocation, overwrite: bool, length: int | None, segment_bytes: int,
            level: int, progress: bool | None, key: bytes | None) -> ExportReport:
    _prepare(loc, overwrite)
    started = time.perf_counter()
    report = ExportReport(loc.url)
    meta = store.read_meta()
    mac = Mac(key) if key else None
    writer = _Writer(loc, segment_bytes, level, mac, snapshot_ident(meta.get("fingerprint"), store.name))
    keys = _KeyRange()
    bar = progress_bar(progress, len(store), f"export {store.session}/{store.name}")
    try:
        for pkey, record in store.portable_records():
            if record is None:
                report.damaged += 1
                if len(report.damaged_keys) < 10:
                    report.damaged_keys.append(pkey)
                continue
            writer.add(pkey, record)
            keys.add(pkey)
            bar.update(1)
        parts = writer.close()
        manifest = fmt.Manifest(
            store.session, store.name, meta.get("fingerprint"),
            length if length is not None else meta.get("length", keys.length()),
            writer.items, writer.raw_bytes, sum(s.size for s in parts),
            fmt.describe_layouts(writer.layouts), parts,
            datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), _version())
        _write_file(loc, fmt.MANIFEST, manifest.to_json(mac))
    except BaseException as exc:
        writer.abort()
        if isinstance(exc, OSError) and not isinstance(exc, SnapshotError):
            raise loc.error(exc, "write the snapshot at") from None
        raise
    finally:
        bar.close()
    if report.damaged:
        log.warning("export of %s/%s: %d spilled record(s) failed their checks and were left out",
                    store.session, store.name, report.damaged)
    report.items, report.bytes = writer.items, writer.raw_bytes
    report.stored_bytes, report.segments = manifest.stored_bytes, len(parts)
    report.seconds = time.perf_counter() - started
    return report


def _prepare(loc: SnapshotLocation, overwrite: bool) -> None:
    """Refuse an existing destination unless ``overwrite``; then make it take no old snapshot for
    a new one: the old manifest goes first, then its data files. A local destination is made, or
    checked to be the user's own and writable by no one else, before anything is listed there."""
    loc.prepare_export()
    names = loc.listdir()
    if names and not overwrite:
        what = "a snapshot" if fmt.MANIFEST in names else f"{len(names)} file(s)"
        raise SnapshotError(f"{loc.url} already holds {what}; pass --overwrite (overwrite=True) to replace "
                            f"it, or choose another destination")
    foreign = [n for n in names if not _OURS.fullmatch(n)]
    if foreign:
        raise SnapshotError(f"{loc.url} holds files that are not a snapshot's ({', '.join(foreign[:3])}); "
                            f"--overwrite replaces only a snapshot: choose another destination")
    try:
        if fmt.MANIFEST in names:
            loc.remove(fmt.MANIFEST)  # first: from now on the old snapshot no longer looks whole
        for name in names:
            loc.remove(name)
    except SnapshotError:
        raise  # it names the file and the fix already
    except OSError as exc:
        raise loc.error(exc, "replace the snapshot at") from None


class _Writer:
    """Fills data file after data file (``*.tmp``, renamed when complete)."""

    def __init__(self, loc: SnapshotLocation, segment_bytes: int, level: int, mac: Any = None, ident: bytes = b""):
        self.loc = loc
        self.mac, self.ident = mac, ident
        self.segment_bytes = segment_bytes
        self.cctx = zstandard.ZstdCompressor(level=level, write_content_size=True, write_checksum=False)
        self.done: list[fmt.DataFileInfo] = []
        self.items = 0
        self.raw_bytes = 0
        self.layouts: dict[bytes, int] = {}
        self._f: Any = None
        self._part: fmt.DataFileWriter | None = None
        self._tmp: list[str] = []

    def add(self, pkey: bytes, record: Any) -> None:
        if self._part is None:
            self._open()
        self._part.add(pkey, record)
        self.items += 1
        self.raw_bytes += len(record)
        layout = codec.inline_layout(record)  # a portable record carries its layout (NOTE [record format])
        self.layouts[layout] = self.layouts.get(layout, 0) + 1
        if self._part.size >= self.segment_bytes:
            self._finish()

    def _open(self) -> None:
        name = fmt.data_file_name(len(self.done)) + ".tmp"
        self._tmp.append(name)
        self._f = self.loc.open_write(name)
        self._part = fmt.DataFileWriter(self._f, len(self.done), self.cctx, self.mac, self.ident)

    def _finish(self) -> None:
        info = self._part.finish()
        self._f.close()  # flushes: a full disk raises here at the latest, before the rename
        self._f = self._part = None
        self.loc.rename(info.file + ".tmp", info.file)
        self.done.append(info)
        if _CRASH_TESTS:
            crash_point("snapshot_segment")  # data files complete, no manifest yet (the point keeps its name)

    def close(self) -> list[fmt.DataFileInfo]:
        if self._part is None and not self.done:
            self._open()  # an empty cache is an empty snapshot: one data file with no records
        if self._part is not None:
            self._finish()
        return self.done

    def abort(self) -> None:
        """Remove what this export wrote (best effort: the disk may be full, the store gone)."""
        if self._f is not None:
            with contextlib.suppress(Exception):
                self._f.close()
        for name in self._tmp:
            with contextlib.suppress(Exception):
                self.loc.remove(name)
            with contextlib.suppress(Exception):
                self.loc.remove(name[:-4])


def _write_file(loc: SnapshotLocation, name: str, data: bytes) -> None:
    f = loc.open_write(name + ".tmp")
    try:
        f.write(data)
    finally:
        f.close()
    if _CRASH_TESTS:
        crash_point("snapshot_manifest")  # the manifest written, not yet renamed
    loc.rename(name + ".tmp", name)


class _KeyRange:
    """Whether the keys are exactly 0..n-1 (a whole map-style dataset): then n is its length."""

    def __init__(self):
        self.count = 0
        self.ints = True
        self.lo, self.hi = 0, -1

    def add(self, pkey: bytes) -> None:
        self.count += 1
        if len(pkey) != 8:
            self.ints = False
            return
        k = int.from_bytes(pkey, "little", signed=True)
        self.lo, self.hi = (k, k) if self.count == 1 else (min(self.lo, k), max(self.hi, k))

    def length(self) -> int | None:
        if self.count and self.ints and self.lo == 0 and self.hi == self.count - 1:
            return self.count
        return None


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shmcache")
    except PackageNotFoundError:
        return ""

