"""An index entry whose offset plus length wraps around 2**64 (found attacking issue 24): the
index's bounds check summed them in uint64, so an entry at offset 2**64 - 64 of 96 bytes "ended"
at byte 32 and passed as inside the records. An import then asked the file for bytes from a
negative offset and failed as a whole with "cannot read ...: Invalid argument; check the path
and your access to it" - an error that names neither the index nor the fix; a read-through
handed the offset to preadv (OverflowError), which failed the tier's whole batch. Now the entry
is what it is: an index that points outside its records, refused as one with the message every
other such index gets."""

from __future__ import annotations

import dataclasses
import logging
import os

import pytest
import zstandard
from test_snapshot import Source, _same
from test_snapshot_hostile import real  # noqa: F401 - the fixture

from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt
from shmcache.snapshot.load import import_snapshot
from shmcache.tiers.tiered_store import portable_key

WRAP = (1 << 64) - 64  # + 96 bytes: "ends" at 32 in uint64


def _with_entries(made, dest, extra):
    """``made``'s snapshot (the ``real`` fixture) at ``dest`` plus the index entries ``extra``:
    (pkey, offset, length), an offset of None meaning "here, over a hole of that length"."""
    _, manifest, recs = made
    dest.mkdir()
    with open(dest / fmt.data_file_name(0), "wb") as f:
        w = fmt.DataFileWriter(f, 0, zstandard.ZstdCompressor(level=1, write_content_size=True))
        for pkey, rec in recs.items():
            w.add(pkey, rec)
        for pkey, offset, length in extra:
            w._hashes.append(fmt.key_hash(pkey))
            w._entries.append((w.size if offset is None else offset, length, 0))
            if offset is None:
                f.seek(length, os.SEEK_CUR)
                w.size += length
        info = w.finish()
    m = dataclasses.replace(manifest, items=info.items, stored_bytes=info.size, data_files=[info])
    (dest / fmt.MANIFEST).write_bytes(m.to_json())
    return dest


def _wrapping(made, dest):
    """``made``'s snapshot plus a second index entry for key 3 (the same index word: a reader
    tries both), whose offset + length wraps past 2**64."""
    return _with_entries(made, dest, [(portable_key(3), WRAP, 96)])


def test_an_index_entry_that_wraps_past_2_64_is_an_index_pointing_outside_its_records(real, tmp_path):  # noqa: F811
    snap = _wrapping(real, tmp_path / "wrap")
    with pytest.raises(SnapshotError, match="points outside its records"):
        fmt.parse_index(*_index_and_footer(snap), "seg")
    with pytest.raises(SnapshotError, match="points outside its records; copy the snapshot again"):
        import_snapshot(snap, session="imp")


def test_a_read_through_drops_that_data_file_and_computes_its_items(real, tmp_path, caplog):  # noqa: F811
    snap = _wrapping(real, tmp_path / "wrap")
    cache = ShmDatasetCache(session="rt", snapshot=snap)
    try:
        ds = cache.wrap(Source())
        with caplog.at_level(logging.WARNING, logger="shmcache"):
            batch = ds.get_batch(list(range(8)))
        assert all(_same((batch[0][j], int(batch[1][j])), Source()[j]) for j in range(8))
        said = " ".join(r.getMessage() for r in caplog.records)
        assert "points outside its records" in said and "OverflowError" not in said, said
    finally:
        cache.close()


def _index_and_footer(snap):
    data = (snap / fmt.data_file_name(0)).read_bytes()
    footer = fmt.parse_footer(data[-fmt.FOOTER_BYTES :], len(data), "seg")
    return data[footer.index_offset : footer.index_offset + footer.index_bytes], footer
