"""Counts from a snapshot never size memory or /dev/shm before the bytes that prove them (issue 24,
item 4). A 16 KiB snapshot whose data file is a sparse file passed the count check, which trusts
the apparent size: the import read the whole "index" (holes, read as zeros) before its checksum
failed, after committing the cache's index table in /dev/shm for every item the manifest claimed
(left there when the import failed); the read-through tier read it too. A manifest `length` far
beyond its items, read with wrap(None), committed a table for that many items. Real sparse files;
the readers run in a subprocess where their peak memory is measured."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

from shmcache import ShmDatasetCache
from shmcache.base.namespace import namespace
from shmcache.snapshot import format as fmt

MiB = 1 << 20
SPARSE = 256 * MiB  # the data file's apparent size: an "index" of 128 MiB (4 million items)


def _snapshot(dest) -> fmt.Manifest:
    src = ShmDatasetCache(session="src", name="c")
    for i in range(64):
        src.put(i, np.full(32, i, np.int64))
    src.export(dest)
    src.close()
    return fmt.Manifest.from_json((dest / fmt.MANIFEST).read_bytes(), "m")


def _sparse(dest) -> int:
    """The snapshot at ``dest`` with its data file made a sparse file of SPARSE bytes: its header
    and records as exported, then a hole, then a footer (intact) claiming as many index entries as
    the count check lets a file of that size hold; the manifest says the same. Its bytes weigh
    about 16 KiB."""
    m = _snapshot(dest)
    part = m.data_files[0]
    path = dest / part.file
    data = path.read_bytes()
    footer = fmt.parse_footer(data[-fmt.FOOTER_BYTES:], len(data), "x")
    items = (SPARSE - fmt.HEADER_BYTES - fmt.FOOTER_BYTES) // (fmt.INDEX_DTYPE.itemsize + 32)
    offset = SPARSE - fmt.FOOTER_BYTES - items * fmt.INDEX_DTYPE.itemsize
    tail = fmt._FOOTER.pack(fmt.FOOTER_MAGIC, fmt.FORMAT_VERSION, fmt.INDEX_DTYPE.itemsize, 0, offset, items, 0, 0)
    tail = tail[:36] + zlib.crc32(tail[:36]).to_bytes(4, "little")
    with open(path, "r+b") as f:
        f.truncate(footer.index_offset)
        f.truncate(SPARSE - fmt.FOOTER_BYTES)  # a hole: nothing stored
        f.seek(0, os.SEEK_END)
        f.write(tail)
    assert os.stat(path).st_blocks * 512 < MiB
    info = fmt.DataFileInfo(part.file, SPARSE, items, "0" * 64)
    forged = dataclasses.replace(m, items=items, stored_bytes=SPARSE, data_files=[info])
    (dest / fmt.MANIFEST).write_bytes(forged.to_json())
    return items


_READER = """
import json, os, resource, sys
from shmcache import ShmDatasetCache
from shmcache.errors import ItemNotCached, SnapshotError
how, snap = sys.argv[1:3]
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = {}
try:
    if how == "import":
        ShmDatasetCache.from_snapshot(snap, session="dst").close()
    elif how == "cli":
        from shmcache.snapshot.load import import_snapshot
        import_snapshot(snap, session="dst")
    else:
        cache = ShmDatasetCache(session="dst", snapshot=snap)
        ds = cache.wrap(None)
        try:
            ds[0]
        except ItemNotCached:
            out["miss"] = True
        out["errors"] = cache.stats()["snapshot_errors"]
        cache.close()
except SnapshotError as exc:
    out["error"] = str(exc)
out["grew_mib"] = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
print(json.dumps(out))
"""


def _dst_segments() -> list[str]:
    return [n for n in namespace().owned_segments() if "+dst+" in n]


def _shm_bytes() -> int:
    """What the reader's session holds in /dev/shm (allocated blocks)."""
    return sum(os.stat(namespace().shm_path(n)).st_blocks * 512 for n in _dst_segments())


@pytest.mark.parametrize("how", ["import", pytest.param("cli", marks=pytest.mark.slow), "read-through"])
def test_a_sparse_data_file_sizes_nothing_before_its_bytes_are_read(tmp_path, how):
    _sparse(tmp_path / "snap")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_READER), how, str(tmp_path / "snap")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["grew_mib"] < 32, out
    if how == "read-through":  # a counted miss, one log line naming the file, no exception
        assert out.get("miss") and out["errors"] >= 1 and "error" not in out, out
        assert "is a sparse file" in proc.stderr and "seg-00000.shms" in proc.stderr, proc.stderr[-2000:]
        assert _shm_bytes() < 4 * MiB
    else:  # refused before a cache is made: nothing committed in /dev/shm, nothing left there
        assert "is a sparse file" in out["error"] and "seg-00000.shms" in out["error"], out
        assert _dst_segments() == []


def test_wrap_none_of_a_manifest_claiming_a_long_dataset_commits_no_table_for_it(tmp_path):
    """`length` 2**22 over 64 items: wrap(None) sized the cache's table for 2**22 items (192 MiB
    of /dev/shm, left after the process exits; 3 GiB for 2**26). The table now grows as records
    arrive; len() is still what the manifest says (2**20: as long as an unsigned manifest may
    claim over 64 items, test_wrap_none_refuses_a_length_that_no_secret_and_no_item_proves)."""
    snap = tmp_path / "snap"
    _snapshot(snap)
    doc = json.loads((snap / fmt.MANIFEST).read_text())
    doc["length"] = fmt.UNPROVEN_LENGTH_FLOOR
    (snap / fmt.MANIFEST).write_text(json.dumps(doc))
    cache = ShmDatasetCache(session="dst", snapshot=snap)
    try:
        ds = cache.wrap(None)
        assert len(ds) == fmt.UNPROVEN_LENGTH_FLOOR
        assert np.array_equal(ds[5], np.full(32, 5, np.int64))
        assert _shm_bytes() < 4 * MiB, _shm_bytes()
    finally:
        cache.close()


_LENGTH_READER = """
import json, sys
from torch.utils.data import DataLoader
from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
how, snap, secret = sys.argv[1:4]
trust = {"secret": secret or None}
out = {}
try:
    if how == "import":
        cache = ShmDatasetCache.from_snapshot(snap, session="dst", allow_unsigned=bool(secret), **trust)
    else:
        cache = ShmDatasetCache(session="dst", snapshot=snap, snapshot_options={"allow_unsigned": bool(secret)},
                                **trust)
    try:
        ds = cache.wrap(None)
        out["len"] = len(ds)
        if len(ds) <= 1 << 20:  # what a sampler of it costs: 8 bytes an item
            out["batch"] = len(next(iter(DataLoader(ds, batch_size=8, shuffle=True, collate_fn=list))))
    finally:
        cache.close()
except SnapshotError as exc:
    out["error"] = str(exc)
print(json.dumps(out))
"""


def _read_length(how: str, snap, secret: str = "") -> dict:
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(_LENGTH_READER), how, str(snap), secret],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["import", pytest.param("read-through", marks=pytest.mark.slow)])
@pytest.mark.parametrize("secret", ["", "the-job-secret"], ids=["no-secret", "allow-unsigned"])
def test_wrap_none_refuses_a_length_that_no_secret_and_no_item_proves(tmp_path, how, secret):
    """`length` 2**40 over 64 items, unsigned (read without a secret, or with allow_unsigned):
    wrap(None) said len() == 2**40, and a DataLoader with shuffle=True then asked for 8 TiB (2**30
    over 64 items: 8 GiB, allocated). Now such a length may be at most 16 per item held, or 2**20:
    past it wrap(None) refuses, naming the length, the items and the fix; within it, it serves."""
    snap = tmp_path / "snap"
    m = _snapshot(snap)
    (snap / fmt.MANIFEST).write_bytes(dataclasses.replace(m, length=1 << 40).to_json())
    out = _read_length(how, snap, secret)
    assert "error" in out, out
    assert f"a dataset length of {1 << 40} over the 64 items" in out["error"], out
    assert "Export the snapshot with this job's secret" in out["error"] and "cache.wrap(dataset)" in out["error"]
    (snap / fmt.MANIFEST).write_bytes(dataclasses.replace(m, length=64).to_json())
    assert _read_length(how, snap, secret) == {"len": 64, "batch": 8}


@pytest.mark.parametrize("how", ["import", "read-through"])
def test_wrap_none_believes_a_length_the_jobs_secret_signed(tmp_path, how):
    """A manifest signed with the job's secret is the job's own: its length is not bounded by its
    items (len() only: nothing is allocated for it here)."""
    from shmcache.base.trust import Mac

    snap = tmp_path / "snap"
    m = _snapshot(snap)
    (snap / fmt.MANIFEST).write_bytes(dataclasses.replace(m, length=1 << 40).to_json(Mac(b"the-job-secret")))
    assert _read_length(how, snap, "the-job-secret") == {"len": 1 << 40}
