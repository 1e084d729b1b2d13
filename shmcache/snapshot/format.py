"""The snapshot format: a cache as files that can be copied, shipped and read anywhere.

NOTE [snapshot format]
    A snapshot is a directory (or an object-store prefix) holding ``manifest.json`` and data files
    ``seg-00000.shms``, ``seg-00001.shms``, ... of about ``segment_bytes`` each (512 MiB by
    default). Everything is little-endian. A data file is::

        header (32 bytes)                       footer (the last 40 bytes of the file)
         0  8s  magic b"SHMCSNP\\0"               0  8s  magic b"SnapIdx\\0"
         8  H   format version (1)                8  H   format version (1)
        10  H   record alignment (8)             10  H   index entry bytes (32)
        12  I   data file number                 12  I   reserved (0)
        16  8x  reserved                         16  Q   index offset
        24  I   crc32 of bytes 0..24             24  Q   index entries (= records)
        28  4x                                   32  I   crc32 of the index bytes
                                                 36  I   crc32 of footer bytes 0..36
        records: spill records (NOTE [spill records]), each 8-byte aligned,
                 from offset 32; the record's key is the portable key (tiers.tiered_store.portable_key), its
                 payload the portable record (tiers.tiered_store.portable_record: the codec record with its
                 layout inline and its key), zstd-compressed unless that saves under 5%
        index:   INDEX_DTYPE entries sorted by (hash, offset), 8-byte aligned, after the records:
                   hash   u64  the portable key's first 8 bytes: the index word (key_hash)
                   offset u64  where the record starts in this file
                   length u64  the record's bytes on disk, padding included: one ranged read
                   check  u32  the record's head check (bytes 28..32 of the record header)
                   pad    u32  0
        footer:  fixed size, so a reader finds the index with one ranged read of the tail.

    A reader that looks keys up (the read-through tier) reads the footer, then the index (one
    ranged read, or an mmap), binary-searches ``hash`` (np.searchsorted; equal hashes are
    adjacent: the record's own key decides), then reads ``length`` bytes at ``offset`` and checks
    them with ``records.unpack_record``: a record that fails its checks is a miss, never a value.

    manifest.json (written last; a snapshot without one is not a snapshot)::

        {"format": "shmcache-snapshot", "version": 1,
         "cache": {"session": ..., "name": ..., "fingerprint": ... or null},
         "length": the wrapped dataset's len() or null, "items": N, "bytes": portable record bytes,
         "stored_bytes": data file bytes, "layouts": {"count": K, "b64": [...] (when K <= 64)},
         "key_hash": "index-word", "created": ISO-8601 UTC, "shmcache": version,
         "segments": [{"file": "seg-00000.shms", "size": bytes, "items": n,
                       "sha256": hex of the data file's index bytes + footer}]}

    Signed snapshots (an export with the job's secret: NOTE [record authentication]):
    each record is followed by a 40-byte MAC trailer (``b"SpMac\x01\0\0"`` + HMAC-SHA256 over the
    snapshot's dataset - ``fp:FINGERPRINT`` or ``name:NAME`` -, the portable key and the record's
    bytes), counted in its index entry's ``length``; the manifest carries
    ``"mac": {"alg": "hmac-sha256", "tag": HEX}`` over the canonical JSON of the rest of it. A
    reader without a secret ignores both (bytes after a spill record's end are never read).

    The data file hash covers the index and footer only: the index binds every record's offset,
    length and head check (which covers the record's header, key and body check), so a swapped,
    truncated or mixed-up data file fails it without hashing the whole file at import; a flipped
    bit inside a record fails that record's own checks.

    Reading trusts no count: local files are opened O_NOFOLLOW|O_NONBLOCK and must be regular
    files (location.open_regular), the manifest has at most MAX_MANIFEST_BYTES, every number in it
    is checked against what its data files can hold (_check_counts), an index is read only once
    its bytes are really stored (location.check_stored: a sparse file's holes prove nothing), and
    a record decodes to at most the length it declares, within the reader's limit
    (records.decompress_bounded).

    Reading over HTTP and S3 (location._HttpReader, _S3Reader): every read is a ranged GET with ``Accept-Encoding:
    identity`` that reads at most the range and then closes the response; an encoded body, and a
    whole-file answer (200) to a range that does not start at 0 (the server ignores Range), are
    refused unread (RangeNotHonored); past the reader's ``timeout_s`` the request is cancelled.

    Writing order (``export_cache``): every file is written as ``<name>.tmp`` and renamed when complete;
    the manifest is renamed last. An export over an existing snapshot (--overwrite) removes the
    old manifest first. So whatever dies half-way - the process, the disk filling up - leaves no
    ``manifest.json`` that names incomplete data files: a half-written snapshot never looks whole.
    A version other than FORMAT_VERSION is refused, by manifest and by each data file's header.

    Data files were called segments; what is on disk or public keeps that word, unchanged: the
    file names ``seg-*.shms``, the manifest's key ``"segments"``, export's ``segment_bytes=`` and
    the CLI's ``--segment-mb`` (a "segment" in the code is a shared-memory object: ``Segment``).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import struct
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, BinaryIO

import numpy as np

from ..base.trust import ENV_SECRET, SIGNED, UNSIGNED, Mac, canonical
from ..errors import SnapshotError
from ..tiers import records as records

__all__ = [
    "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST", "HEADER_BYTES", "FOOTER_BYTES", "INDEX_DTYPE",
    "DEFAULT_SEGMENT_BYTES", "key_hash", "data_file_name", "DataFileWriter", "DataFileInfo", "Footer",
    "parse_header", "parse_footer", "parse_index", "data_file_digest", "read_record", "iter_records",
    "find", "Manifest", "authenticate", "MAX_MANIFEST_BYTES", "MAX_LENGTH", "unproven_length_problem",
]

FORMAT_NAME = "shmcache-snapshot"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
DATA_FILE_MAGIC = b"SHMCSNP\x00"
FOOTER_MAGIC = b"SnapIdx\x00"
ALIGN = 8
DEFAULT_SEGMENT_BYTES = 512 << 20  # a data file's size: the default of export's segment_bytes=
MAX_MANIFEST_BYTES = 64 << 20  # ~300,000 data files; a larger manifest.json is refused unread
MAX_LENGTH = 1 << 40  # a dataset length beyond this is refused (a sampler allocates 8 bytes an item)
# A length that the job's secret does not authenticate (no secret, or allow_unsigned) is a
# stranger's claim, and len() of wrap(None) sizes a shuffled sampler's memory by it (8 bytes an
# item): it may be at most this many times the items the snapshot holds, or UNPROVEN_LENGTH_FLOOR
# (8 MiB of sampler), whichever is larger. wrap(None) serves only what is held (anything else is
# ItemNotCached), so a real dataset's length is near its items.
UNPROVEN_LENGTH_PER_ITEM = 16
UNPROVEN_LENGTH_FLOOR = 1 << 20

_HEADER = struct.Struct("<8sHHI8xI4x")
_FOOTER = struct.Struct("<8sHHIQQII")
HEADER_BYTES = _HEADER.size  # 32
FOOTER_BYTES = _FOOTER.size  # 40
INDEX_DTYPE = np.dtype([("hash", "<u8"), ("offset", "<u8"), ("length", "<u8"), ("check", "<u4"),
                        ("pad", "<u4")])
_MAX_LISTED_LAYOUTS = 64
_DATA_FILE_RE = re.compile(r"seg-\d{5,}\.shms")
_FINGERPRINT_RE = re.compile(r"[0-9a-f]{1,128}")  # what NOTE [fingerprint] makes: a hex digest


def key_hash(pkey: bytes) -> int:
    """The index's hash of a portable key: its first 8 bytes, the cache's own index word (an int
    key itself, else the blake2b-64 of the key bytes: NOTE [tiers]), so a batch of int keys is
    looked up with one np.searchsorted and no hashing."""
    return int.from_bytes(pkey[:8], "little")


def data_file_name(number: int) -> str:
    return f"seg-{number:05d}.shms"


# --- writing ---------------------------------------------------------------------------------------


@dataclass
class DataFileInfo:
    """What the manifest says of one data file."""

    file: str
    size: int
    items: int
    sha256: str

    def to_json(self) -> dict:
        return {"file": self.file, "size": self.size, "items": self.items, "sha256": self.sha256}


class DataFileWriter:
    """Appends records to one data file (any binary file object with ``write``), then its
    index and footer. The caller closes and renames the file (NOTE [snapshot format])."""

    def __init__(self, f: BinaryIO, number: int, cctx: Any, mac: Any = None, ident: bytes = b""):
        self.f = f
        self.number = number
        self.cctx = cctx
        self.mac, self.ident = mac, ident  # a trust.Mac: every record is signed (NOTE [record authentication])
        self.size = 0
        self.raw_bytes = 0  # portable record bytes before compression
        self._hashes: list[int] = []
        self._entries: list[tuple[int, int, int]] = []  # offset, length, check
        self._write(_pack_header(number))

    @property
    def items(self) -> int:
        return len(self._entries)

    def add(self, pkey: bytes, payload: Any) -> int:
        """Append one record; return its bytes on disk."""
        parts = records.pack_record(pkey, payload, self.cctx)
        if self.mac is not None:  # the record, then its MAC trailer (40 bytes: alignment kept)
            parts.append(self.mac.trailer(self.ident + pkey, *parts))
        head = parts[0]
        self._hashes.append(key_hash(pkey))
        length = sum(memoryview(p).nbytes for p in parts)
        self._entries.append((self.size, length, records.head_check_of(head)))
        self.raw_bytes += memoryview(payload).nbytes
        for part in parts:
            self._write(part)
        return length

    def finish(self) -> DataFileInfo:
        """Write the index and footer; return the data file's manifest entry."""
        index = np.zeros(len(self._entries), INDEX_DTYPE)
        if len(index):
            index["hash"] = np.array(self._hashes, np.uint64)
            cols = np.array(self._entries, np.uint64).reshape(-1, 3)
            index["offset"], index["length"], index["check"] = cols[:, 0], cols[:, 1], cols[:, 2]
            index = index[np.lexsort((index["offset"], index["hash"]))]
        index_offset = self.size  # records end 8-byte aligned (spill records pad themselves)
        body = index.tobytes()
        self._write(body)
        footer = _FOOTER.pack(FOOTER_MAGIC, FORMAT_VERSION, INDEX_DTYPE.itemsize, 0, index_offset,
                              len(index), zlib.crc32(body), 0)
        footer = footer[:36] + struct.pack("<I", zlib.crc32(footer[:36]))
        self._write(footer)
        return DataFileInfo(data_file_name(self.number), self.size, len(index), data_file_digest(body, footer))

    def _write(self, data: Any) -> None:
        n = memoryview(data).nbytes
        self.f.write(data)
        self.size += n


def _pack_header(number: int) -> bytes:
    head = _HEADER.pack(DATA_FILE_MAGIC, FORMAT_VERSION, ALIGN, number, 0)
    return head[:24] + struct.pack("<I", zlib.crc32(head[:24])) + bytes(4)


def data_file_digest(index_bytes: Any, footer: Any) -> str:
    h = hashlib.sha256(index_bytes)
    h.update(footer)
    return h.hexdigest()


# --- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Footer:
    index_offset: int
    count: int
    index_crc: int
    raw: bytes  # the footer's 40 bytes (for the data file digest)

    @property
    def index_bytes(self) -> int:
        return self.count * INDEX_DTYPE.itemsize


def parse_header(head: Any, where: str, number: int | None = None) -> None:
    """Check a data file's first 32 bytes; raise SnapshotError naming ``where`` if they are wrong."""
    head = bytes(head[:HEADER_BYTES])
    if len(head) < HEADER_BYTES:
        raise SnapshotError(f"{where} is {len(head)} bytes long, shorter than a data file header: it is "
                            f"truncated; copy the snapshot again, or export it again")
    magic, version, align, num, crc = _HEADER.unpack(head)
    if magic != DATA_FILE_MAGIC:
        raise SnapshotError(f"{where} is not a shmcache snapshot data file (magic {magic!r}); the "
                            f"snapshot holds a foreign file: copy it again, or export it again")
    if version != FORMAT_VERSION:
        raise SnapshotError(_version_message(where, version))
    if crc != zlib.crc32(head[:24]) or align != ALIGN or (number is not None and num != number):
        raise SnapshotError(f"{where}: its header is damaged (data file number {num}, alignment {align}); "
                            f"copy the snapshot again, or export it again")


def parse_footer(tail: Any, size: int, where: str) -> Footer:
    """The footer from the file's last FOOTER_BYTES bytes (``size``: the file's length)."""
    tail = bytes(tail[-FOOTER_BYTES:]) if len(tail) >= FOOTER_BYTES else bytes(tail)
    if size < HEADER_BYTES + FOOTER_BYTES or len(tail) != FOOTER_BYTES:
        raise SnapshotError(f"{where} is {size} bytes long, too short for a data file: it is truncated; "
                            f"copy the snapshot again, or export it again")
    magic, version, entry, _, offset, count, index_crc, crc = _FOOTER.unpack(tail)
    if magic != FOOTER_MAGIC or crc != zlib.crc32(tail[:36]):
        raise SnapshotError(f"{where} has no intact footer at its end (it was truncated or damaged, "
                            f"size {size} bytes); copy the snapshot again, or export it again")
    if version != FORMAT_VERSION:
        raise SnapshotError(_version_message(where, version))
    if entry != INDEX_DTYPE.itemsize or not HEADER_BYTES <= offset <= size - FOOTER_BYTES \
            or offset + count * entry != size - FOOTER_BYTES:
        raise SnapshotError(f"{where}: its footer says {count} index entries of {entry} bytes at "
                            f"offset {offset}, which does not fit a file of {size} bytes; copy the "
                            f"snapshot again, or export it again")
    return Footer(offset, count, index_crc, tail)


def parse_index(body: Any, footer: Footer, where: str) -> np.ndarray:
    """The index array (read-only, sorted by hash) from its bytes; checked against the footer."""
    if memoryview(body).nbytes != footer.index_bytes or zlib.crc32(body) != footer.index_crc:
        raise SnapshotError(f"{where}: its index fails its checksum (damaged); copy the snapshot "
                            f"again, or export it again")
    index = np.frombuffer(body, INDEX_DTYPE)
    # offset + length may not be summed in uint64: 2**64 - 64 and 96 "end" at 32 (wrapped)
    records_end = np.uint64(footer.index_offset)
    lengths = index["length"]
    outside = (lengths > records_end) | (index["offset"] > records_end - np.minimum(lengths, records_end))
    if len(index) and (index["offset"].min() < HEADER_BYTES or outside.any()
                       or (index["hash"][1:] < index["hash"][:-1]).any()):
        raise SnapshotError(f"{where}: its index is not sorted or points outside its records; copy the snapshot "
                            f"again, or export it again")
    return index


def read_record(buf: Any, offset: int, length: int, dctx: Any) -> tuple[bytes | None, Any, str | None]:
    """``(portable key, payload, None)`` of the record at ``offset`` of ``buf`` (a data file's bytes
    or an mmap), or ``(key or None, None, why)`` if it fails any check: a damaged record is a
    miss, never a value."""
    view = memoryview(buf).cast("B")[offset:offset + length]
    if len(view) != length or length < records.RECORD_HEADER_BYTES:
        return None, None, f"the record at offset {offset} is cut short"
    pkey = records.declared_key(view)
    payload, why = records.unpack_record(view, pkey, dctx)
    if payload is None:
        return None, None, f"the record at offset {offset}: {why}"
    return pkey, payload, None


def iter_records(buf: Any, index: np.ndarray, dctx: Any) -> Iterator[tuple[bytes | None, Any, str | None]]:
    """Every record of a data file in file order, as :func:`read_record` gives them."""
    for offset, length in sorted(zip(index["offset"].tolist(), index["length"].tolist())):
        yield read_record(buf, offset, length, dctx)


def find(index: np.ndarray, hashes: np.ndarray, pkey: bytes) -> np.ndarray:
    """The index rows whose hash is ``pkey``'s (``hashes``: the index's hash column, contiguous,
    loaded once): usually one; the record's own key decides between colliding ones."""
    h = np.uint64(key_hash(pkey))
    lo = int(np.searchsorted(hashes, h, "left"))
    hi = int(np.searchsorted(hashes, h, "right"))
    return index[lo:hi]


def _version_message(where: str, version: int) -> str:
    return (f"{where} is snapshot format version {version!s:.40}; this shmcache reads version "
            f"{FORMAT_VERSION} only: import it with the shmcache that exported it, or export it again")


# --- the manifest ----------------------------------------------------------------------------------


@dataclass
class Manifest:
    session: str
    name: str
    fingerprint: str | None
    length: int | None
    items: int
    bytes: int
    stored_bytes: int
    layouts: dict
    data_files: list[DataFileInfo]  # the manifest's key for them is "segments" (kept: the file format)
    created: str = ""
    shmcache: str = ""
    mac: Any = None  # the manifest's "mac" field as read (None: unsigned)
    signed_body: bytes = b""  # the canonical bytes of the rest of the document, as read

    def to_json(self, mac: Any = None) -> bytes:
        """The manifest's bytes; with ``mac`` (a trust.Mac) signed (NOTE [record authentication])."""
        doc = {"format": FORMAT_NAME, "version": FORMAT_VERSION,
               "cache": {"session": self.session, "name": self.name, "fingerprint": self.fingerprint},
               "length": self.length, "items": self.items, "bytes": self.bytes,
               "stored_bytes": self.stored_bytes, "layouts": self.layouts, "key_hash": "index-word",
               "created": self.created, "shmcache": self.shmcache,
               "segments": [s.to_json() for s in self.data_files]}
        if mac is not None:
            doc = mac.sign_doc(doc)
        return (json.dumps(doc, indent=1) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str) -> Manifest:
        try:
            doc = json.loads(data)
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # nested past the parser's depth
            raise SnapshotError(f"{where} is not JSON ({exc}); it is damaged: copy the snapshot again, "
                                f"or export it again") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
            raise SnapshotError(f"{where} is not a shmcache snapshot manifest (format "
                                f"{doc.get('format') if isinstance(doc, dict) else None!r:.60}); pass the "
                                f"directory `shmcache export` wrote")
        if doc.get("version") != FORMAT_VERSION:
            raise SnapshotError(_version_message(where, doc.get("version")))
        mac = doc.pop("mac", None)  # what a reader with the job's secret checks (trust.Mac.doc_verdict)
        try:
            cache = doc["cache"]
            data_files = [DataFileInfo(str(s["file"]), int(s["size"]), int(s["items"]), str(s["sha256"]))
                        for s in doc["segments"]]
            m = cls(str(cache["session"]), str(cache["name"]), cache.get("fingerprint"),
                    None if doc.get("length") is None else int(doc["length"]), int(doc["items"]),
                    int(doc["bytes"]), int(doc["stored_bytes"]), dict(doc.get("layouts") or {}),
                    data_files, str(doc.get("created", "")), str(doc.get("shmcache", "")), mac,
                    canonical(doc))
        except (KeyError, TypeError, ValueError, OverflowError) as exc:  # OverflowError: int(1e999)
            raise SnapshotError(f"{where} lacks a field or has a wrong one ({exc!r}); it is damaged: "
                                f"copy the snapshot again, or export it again") from None
        fp = m.fingerprint  # becomes the cache's identity (its meta, the remote tier's keys): a digest or none
        if fp is not None and not (isinstance(fp, str) and _FINGERPRINT_RE.fullmatch(fp)):
            raise SnapshotError(f"{where} says the dataset's fingerprint is {str(fp)[:80]!r}, not a hex digest "
                                f"an export writes; it is damaged or forged: export the snapshot again")
        for s in m.data_files:  # names come from a file: never a path out of the snapshot
            if not _DATA_FILE_RE.fullmatch(s.file):
                raise SnapshotError(f"{where} names data file {s.file!r}, not a name an export writes; it is "
                                    f"damaged or forged: export the snapshot again")
        _check_counts(m, where)
        if sum(s.items for s in m.data_files) != m.items:
            raise SnapshotError(f"{where} says {m.items} items, its data files {sum(s.items for s in m.data_files)}; "
                                f"it is damaged: export the snapshot again")
        return m


def _check_counts(m: Manifest, where: str) -> None:
    """Every number of a manifest within what its files can hold: a reader sizes its reads and
    the cache's table by them before a data file is opened (a forged count must not become a
    32 TB read, nor a dataset length that len() cannot return)."""
    def bad(what: str, value: Any) -> SnapshotError:
        return SnapshotError(f"{where} says {what} {value!r}, which no data file of its size can hold; "
                             f"it is damaged or forged: export the snapshot again")

    fixed = HEADER_BYTES + FOOTER_BYTES
    for s in m.data_files:
        if not fixed <= s.size < 1 << 63:
            raise bad(f"data file {s.file} has size", s.size)
        if not 0 <= s.items <= (s.size - fixed) // (INDEX_DTYPE.itemsize + records.RECORD_HEADER_BYTES):
            raise bad(f"data file {s.file} of {s.size} bytes has items", s.items)
    if m.length is not None and not 0 <= m.length <= MAX_LENGTH:
        raise SnapshotError(f"{where} says the dataset's length is {m.length!r}, beyond the {MAX_LENGTH} items a "
                            f"snapshot may have (a sampler allocates 8 bytes per item): it is damaged or "
                            f"forged: export the snapshot again")
    for name in ("items", "bytes", "stored_bytes"):
        if not 0 <= getattr(m, name) < 1 << 63:
            raise bad(f"{name} is", getattr(m, name))
    if m.stored_bytes != sum(s.size for s in m.data_files):
        raise bad(f"stored_bytes (its data files have {sum(s.size for s in m.data_files)}) is", m.stored_bytes)
    if m.bytes > m.items * records.MAX_RAW_BYTES:
        raise bad(f"{m.items} items of at most {records.MAX_RAW_BYTES} bytes each hold bytes", m.bytes)


def unproven_length_problem(length: int, items: int) -> str | None:
    """Why a dataset ``length`` that no secret authenticates is not to be believed for a snapshot
    that proves ``items`` items (None: it may be): see UNPROVEN_LENGTH_PER_ITEM."""
    bound = max(UNPROVEN_LENGTH_FLOOR, UNPROVEN_LENGTH_PER_ITEM * max(items, 0))
    if length <= bound:
        return None
    return (f"a dataset length of {length} over the {items} items the snapshot holds, beyond the {bound} "
            f"an unauthenticated length may claim ({UNPROVEN_LENGTH_PER_ITEM} per item, at least "
            f"{UNPROVEN_LENGTH_FLOOR}; a shuffled sampler allocates 8 bytes an item)")


def describe_layouts(layouts: dict[bytes, int]) -> dict:
    """The manifest's ``layouts``: how many distinct ones, and each (base64) when there are few."""
    out: dict = {"count": len(layouts)}
    if len(layouts) <= _MAX_LISTED_LAYOUTS:
        out["b64"] = [base64.b64encode(lay).decode() for lay in layouts]
        out["items"] = list(layouts.values())
    return out


def authenticate(manifest: Manifest, key: bytes | None, allow_unsigned: bool, where: str) -> Any:
    """The trust.Mac that checks every record of the snapshot, when ``key`` (the job's secret)
    verifies its manifest; None when there is no secret (records are then data, not trusted),
    or when the manifest is unsigned or foreign-signed and ``allow_unsigned``; SnapshotError
    naming the flag otherwise (NOTE [record authentication])."""
    if key is None:
        return None
    mac = Mac(key)
    verdict = mac.doc_verdict(manifest.signed_body, manifest.mac)
    if verdict == SIGNED:
        return mac
    if allow_unsigned:
        return None
    what = ("is not signed" if verdict == UNSIGNED else
            "is signed with another secret, or was changed after it was signed")
    raise SnapshotError(
        f"{where} {what}, and this job has a secret (${ENV_SECRET} or secret=): the snapshot cannot be "
        f"authenticated. Read it as untrusted data (its values served, pickled objects refused) with "
        f"allow_unsigned=True (`shmcache import --allow-unsigned`, snapshot_options={{'allow_unsigned': "
        f"True}}), or export it again with this job's secret")
