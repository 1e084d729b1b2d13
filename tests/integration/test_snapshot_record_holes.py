"""Index entries that each fit the record bound but point into holes of a sparse data file (found
attacking issue 24, item 4): the index is checked to be stored, the records it points at were
not. 64 entries of 256 MiB over holes - a snapshot of 104 KB on disk, 16 GiB apparent - made an
import read 16 GiB of zeros for 28 s (every entry then counted damaged); its cost grows with the apparent
size a stranger writes in the manifest and the footer, not with the bytes they store. Now an
import checks each chunk of records is stored before reading it (location.check_stored, as for
the index): a hole is a SnapshotError naming the sparse file, with nothing of it read, and the
cache the import made is given back."""

from __future__ import annotations

import pytest
from test_snapshot_hostile import real  # noqa: F401 - the fixture
from test_snapshot_index_wrap import _with_entries

from shmcache.base.namespace import namespace
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt
from shmcache.snapshot.load import import_snapshot
from shmcache.tiers.tiered_store import portable_key

HOLES, HOLE_BYTES = 16, 8 << 20  # (a test's size: the attack is the same at 256 MiB each)


def _holey(made, dest):
    """``made``'s snapshot (the ``real`` fixture) and HOLES index entries of HOLE_BYTES each, for
    keys no record has, over holes."""
    _with_entries(made, dest, [(portable_key(10_000 + i), None, HOLE_BYTES) for i in range(HOLES)])
    assert (dest / fmt.data_file_name(0)).stat().st_blocks * 512 < HOLE_BYTES, "the file system filled the holes"
    return dest


def test_an_import_reads_no_record_from_a_hole(real, tmp_path):  # noqa: F811
    snap = _holey(real, tmp_path / "holes")
    with pytest.raises(SnapshotError, match="is a sparse file"):
        import_snapshot(snap, session="imp", threads=1)
    assert [n for n in namespace().owned_segments() if "+imp+" in n] == []
