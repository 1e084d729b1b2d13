"""The snapshot format (NOTE [snapshot format]): segments written and read back byte for byte,
looked up through their sorted index, and every kind of damage refused or turned into a miss."""

from __future__ import annotations

import io
import json
import struct

import numpy as np
import pytest
import zstandard

from shmcache.cache import codec
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt
from shmcache.tiers.tiered_store import decode_portable, portable_key, portable_record

CCTX = zstandard.ZstdCompressor(level=1, write_content_size=True, write_checksum=False)
DCTX = zstandard.ZstdDecompressor()


def _items(n=50):
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        key = i if i % 3 else f"k{i}"
        arr = np.zeros(300, np.int64) + i if i % 2 else rng.integers(0, 255, 2000, np.uint8)  # zstd / raw
        value = (arr, i * 1.5, "label")
        out.append((key, value, portable_record(codec.encode(value), key)))
    return out


def _segment(items, number=0):
    f = io.BytesIO()
    w = fmt.DataFileWriter(f, number, CCTX)
    for key, _, rec in items:
        w.add(portable_key(key), rec)
    info = w.finish()
    return f.getvalue(), info, w


def _open(data, where="seg"):
    fmt.parse_header(data[:fmt.HEADER_BYTES], where, 0)
    footer = fmt.parse_footer(data[-fmt.FOOTER_BYTES:], len(data), where)
    body = data[footer.index_offset:footer.index_offset + footer.index_bytes]
    return footer, fmt.parse_index(body, footer, where), body


def test_a_segment_reads_back_every_record_and_its_digest():
    items = _items()
    data, info, w = _segment(items)
    assert info.size == len(data) and info.items == len(items) and info.file == "seg-00000.shms"
    assert w.raw_bytes == sum(len(r) for _, _, r in items)
    footer, index, body = _open(data)
    assert fmt.data_file_digest(body, footer.raw) == info.sha256
    assert (np.diff(index["hash"].astype(np.float64)) >= 0).all()  # sorted: binary-searchable
    got = {pk: bytes(p) for pk, p, why in fmt.iter_records(data, index, DCTX)}
    assert got == {portable_key(k): r for k, _, r in items}
    key, value, _ = items[4]
    np.testing.assert_array_equal(decode_portable(got[portable_key(key)])[0], value[0])


def test_compressible_records_are_stored_smaller_and_random_ones_raw():
    zeros = [(i, None, portable_record(codec.encode(np.zeros(10000, np.uint8)), i)) for i in range(4)]
    noise = [(i, None, portable_record(codec.encode(np.random.default_rng(i).bytes(10000)), i)) for i in range(4)]
    assert len(_segment(zeros)[0]) < 2000
    assert 4 * 10000 < len(_segment(noise)[0]) < 4 * 10000 * 1.05 + 1000


def test_find_by_key_binary_searches_the_index_and_the_record_decides():
    items = _items()
    data, _, _ = _segment(items)
    _, index, _ = _open(data)
    hashes = np.ascontiguousarray(index["hash"])
    for key, _, rec in items:
        rows = fmt.find(index, hashes, portable_key(key))
        assert len(rows) == 1
        pk, payload, why = fmt.read_record(data, int(rows[0]["offset"]), int(rows[0]["length"]), DCTX)
        assert why is None and pk == portable_key(key) and bytes(payload) == rec
    assert len(fmt.find(index, hashes, portable_key(10_000))) == 0


def test_int_keys_hash_to_themselves_so_batches_need_no_hashing():
    assert fmt.key_hash(portable_key(12345)) == 12345
    assert fmt.key_hash(portable_key(-1)) == (1 << 64) - 1


def test_a_flipped_bit_in_a_record_is_a_miss_never_a_value():
    items = _items(8)
    data, _, _ = _segment(items)
    _, index, _ = _open(data)
    row = index[np.argsort(index["offset"])][3]
    for at in (4, 20, 40, int(row["length"]) - 12):  # header, lengths, key, stored bytes
        bad = bytearray(data)
        bad[int(row["offset"]) + at] ^= 0x10
        pk, payload, why = fmt.read_record(bad, int(row["offset"]), int(row["length"]), DCTX)
        assert payload is None and why, at


def test_a_truncated_segment_is_refused_naming_it():
    data, _, _ = _segment(_items(8))
    for cut in (len(data) - 1, len(data) - fmt.FOOTER_BYTES - 5, 100, 10):
        with pytest.raises(SnapshotError, match="seg-7.*(truncated|footer)"):
            fmt.parse_footer(data[:cut][-fmt.FOOTER_BYTES:], cut, "seg-7")


def test_a_damaged_index_or_footer_is_refused():
    data, _, _ = _segment(_items(8))
    footer, _, body = _open(data)
    bad = bytearray(body)
    bad[5] ^= 1
    with pytest.raises(SnapshotError, match="index fails its checksum"):
        fmt.parse_index(bytes(bad), footer, "s")
    tail = bytearray(data[-fmt.FOOTER_BYTES:])
    tail[17] ^= 1
    with pytest.raises(SnapshotError, match="no intact footer"):
        fmt.parse_footer(bytes(tail), len(data), "s")


def test_another_format_version_is_refused_by_header_footer_and_manifest():
    data, info, _ = _segment(_items(2))
    head = bytearray(data[:fmt.HEADER_BYTES])
    struct.pack_into("<H", head, 8, 2)
    with pytest.raises(SnapshotError, match="version 2.*reads version 1"):
        fmt.parse_header(bytes(head), "s")
    tail = bytearray(data[-fmt.FOOTER_BYTES:])
    struct.pack_into("<H", tail, 8, 2)
    struct.pack_into("<I", tail, 36, __import__("zlib").crc32(bytes(tail[:36])))
    with pytest.raises(SnapshotError, match="version 2"):
        fmt.parse_footer(bytes(tail), len(data), "s")
    m = fmt.Manifest("s", "c", "0123456789abcdef" * 2, 2, 2, 10, len(data), {}, [info])
    doc = json.loads(m.to_json())
    assert fmt.Manifest.from_json(m.to_json(), "m").data_files == [info]
    doc["version"] = 99
    with pytest.raises(SnapshotError, match="version 99"):
        fmt.Manifest.from_json(json.dumps(doc).encode(), "m")


@pytest.mark.parametrize("change", [
    lambda d: d.pop("segments"),
    lambda d: d.update(format="something-else"),
    lambda d: d["segments"][0].update(file="../../etc/passwd"),
    lambda d: d.update(items=5),
])
def test_a_damaged_or_forged_manifest_is_refused(change):
    data, info, _ = _segment(_items(2))
    doc = json.loads(fmt.Manifest("s", "c", None, None, 2, 10, len(data), {}, [info]).to_json())
    change(doc)
    with pytest.raises(SnapshotError, match="manifest"):
        fmt.Manifest.from_json(json.dumps(doc).encode(), "x/manifest.json")
    with pytest.raises(SnapshotError, match="not JSON"):
        fmt.Manifest.from_json(b"{", "x/manifest.json")


def test_an_empty_segment_is_valid():
    data, info, _ = _segment([])
    footer, index, _ = _open(data)
    assert info.items == 0 and len(index) == 0 and footer.index_offset == fmt.HEADER_BYTES
