"""Portable snapshots (issue 12) with real parts: real caches in shared memory, real files, a tar
round trip, fsspec's file:// and memory://, the CLI in-process, a real small tmpfs for a full
disk; every fault a clear error or a counted miss, never a wrong value."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tarfile

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from shmcache import ShmDatasetCache
from shmcache.cli.main import main as cli
from shmcache.errors import CacheMismatch, InvalidArgument, ItemNotCached, SnapshotError
from shmcache.snapshot import format as fmt
from shmcache.snapshot.load import import_snapshot

N = 64


class Source(torch.utils.data.Dataset):
    """Tensors and labels; ``seed`` makes another dataset (another fingerprint)."""

    def __init__(self, n=N, seed=0, item=2048):
        self.n, self.seed, self.item = n, seed, item

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randint(0, 256, (self.item,), dtype=torch.uint8, generator=g) // 8, i


def _same(a, b):
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def _filled(session="src", n=N, seed=0, item=2048, **kw):
    cache = ShmDatasetCache(session=session, **kw)
    ds = cache.wrap(Source(n, seed, item))
    for i in range(n):
        ds[i]
    return cache, ds


@pytest.fixture
def snap(tmp_path):
    """A snapshot of a full cache (3+ segments), and the source it came from."""
    cache, _ = _filled()
    dest = tmp_path / "snap"
    report = cache.export(dest, segment_bytes=40_000)
    cache.close()
    assert report.items == N and report.segments >= 3 and not report.damaged
    return dest


def _segments(dest):
    return sorted(p for p in os.listdir(dest) if p.endswith(".shms"))


# --- round trips ---------------------------------------------------------------------------------


def test_import_then_wrap_none_serves_the_same_items_without_the_source(snap):
    cache = ShmDatasetCache.from_snapshot(snap, session="dst")
    assert cache.last_import.imported == N and cache.last_import.complete
    ds = cache.wrap(None)
    src = Source()
    assert len(ds) == N
    assert all(_same(ds[i], src[i]) for i in range(N))
    before = cache.stats()["misses"]
    batch = next(iter(DataLoader(ds, batch_size=16, shuffle=False)))  # the batch path
    assert torch.equal(batch[0], torch.stack([src[i][0] for i in range(16)]))
    assert batch[1].tolist() == list(range(16))
    assert cache.stats()["misses"] == before  # all hits: nothing computed
    cache.close()


def test_a_key_not_there_with_no_source_is_a_clear_error_naming_it(tmp_path):
    cache, ds = _filled(n=10)
    for i in range(10):
        ds[i]
    cache._source_len = 12  # the dataset had 12 items; 10 and 11 were never cached
    cache.export(tmp_path / "s")
    cache.close()
    imported = ShmDatasetCache.from_snapshot(tmp_path / "s", session="dst")
    ds = imported.wrap(None)
    assert len(ds) == 12
    with pytest.raises(ItemNotCached, match=r"item 11 is not in cache dst/.*no source") as err:
        ds[11]
    assert isinstance(err.value, KeyError)
    with pytest.raises(ItemNotCached, match="item 10"):
        ds.get_batch([0, 10])
    imported.close()


def test_wrap_none_of_a_cache_that_was_not_imported_says_why(tmp_path):
    cache = ShmDatasetCache(session="x", name="plain")
    cache.put(1, 1)
    with pytest.raises(InvalidArgument, match="does not record the length"):
        cache.wrap(None)
    with pytest.raises(InvalidArgument, match="transform"):
        cache.wrap(None, transform=lambda x: x)
    cache.close()


def test_a_snapshot_of_another_dataset_is_refused_by_wrap_and_by_import(snap):
    cache = ShmDatasetCache.from_snapshot(snap, session="dst")
    with pytest.raises(InvalidArgument, match="another dataset"):
        cache.wrap(Source(seed=1))
    assert _same(cache.wrap(Source())[3], Source()[3])  # the same dataset is welcome
    name = cache.name
    cache.close()
    other, _ = _filled(session="dst2", seed=1)  # another dataset in a cache of the snapshot's name
    other_name = other.name
    other.close()
    with pytest.raises(CacheMismatch, match="holds another dataset.*--force"):
        import_snapshot(snap, session="dst2", name=other_name)
    report = import_snapshot(snap, session="dst2", name=other_name, force=True)
    assert report.imported == N
    forced = ShmDatasetCache(session="dst2", name=other_name)
    ds = forced.wrap(None)
    assert _same(ds[5], Source()[5]) and not _same(ds[5], Source(seed=1)[5])
    forced.close()
    assert name != other_name


def test_str_and_bytes_keys_and_spilled_items_travel_too(tmp_path):
    cache = ShmDatasetCache(session="src", name="kv", size=1, spilling=True, spill_dir=tmp_path)
    values = {f"s{i}": np.full(20_000, i, np.uint8) for i in range(80)}  # 1.6 MB: more than 1 MiB
    values.update({b"b\x00": {"x": 1.5}, -7: "negative", 2**62: None})
    for k, v in values.items():
        cache.put(k, v)
    assert cache.stats()["items_disk"] > 0
    cache.export(tmp_path / "s")
    cache.close()
    got = ShmDatasetCache.from_snapshot(tmp_path / "s", session="dst", name="kv2")
    for k, v in values.items():
        out = got.get(k)
        assert np.array_equal(out, v) if isinstance(v, np.ndarray) else out == v, k
    got.close()


def test_a_tar_round_trip(snap, tmp_path):
    with tarfile.open(tmp_path / "snap.tar", "w") as tar:
        tar.add(snap, arcname="snap")
    with tarfile.open(tmp_path / "snap.tar") as tar:
        tar.extractall(tmp_path / "unpacked", filter="data")
    cache = ShmDatasetCache.from_snapshot(tmp_path / "unpacked" / "snap", session="dst")
    assert cache.last_import.complete
    assert _same(cache.wrap(None)[N - 1], Source()[N - 1])
    cache.close()


@pytest.mark.parametrize("scheme", ["file", "memory"])
def test_fsspec_urls_round_trip(scheme, tmp_path):
    import fsspec  # in the test extra: never skipped
    url = f"file://{tmp_path}/snapf" if scheme == "file" else f"memory://snap-{os.getpid()}-{id(tmp_path)}"
    cache, _ = _filled()
    report = cache.export(url, segment_bytes=40_000)
    cache.close()
    assert report.segments >= 3
    try:
        got = ShmDatasetCache.from_snapshot(url, session="dst")
        assert got.last_import.complete and _same(got.wrap(None)[7], Source()[7])
        got.close()
    finally:
        if scheme == "memory":
            fsspec.filesystem("memory").rm(url[len("memory://"):], recursive=True)


def test_the_cli_exports_and_imports(tmp_path, capsys):
    cache, _ = _filled(session="clisrc")
    name = cache.name
    cache.close()
    dest = str(tmp_path / "c")
    assert cli(["export", "clisrc", dest]) == 0  # the only cache of the session
    assert f"exported {N} items" in capsys.readouterr().out
    assert cli(["export", "clisrc", name, dest]) == 1  # exists
    assert "--overwrite" in capsys.readouterr().err
    assert cli(["export", "clisrc", name, dest, "--overwrite"]) == 0
    assert cli(["export", "clisrc", "nope", dest]) == 1
    assert "no cache 'nope'" in capsys.readouterr().err
    assert cli(["import", dest, "--session", "clidst", "--name", "copy"]) == 0
    assert f"imported {N} of {N} items into clidst/copy" in capsys.readouterr().out
    got = ShmDatasetCache(session="clidst", name="copy")
    assert _same(got.wrap(None)[9], Source()[9])
    got.close()


# --- the cap ----------------------------------------------------------------------------------------


def test_an_import_larger_than_the_cap_keeps_what_fits_and_says_so(tmp_path):
    cache, _ = _filled(n=200, item=16 << 10)  # 200 x 16 KiB, random-ish: 3.2 MiB
    cache.export(tmp_path / "s")
    cache.close()
    small = ShmDatasetCache.from_snapshot(tmp_path / "s", session="dst", size=1)
    r = small.last_import
    assert 0 < r.imported < 200 and r.imported + r.rejected == 200 and not r.spilled
    assert "did not fit" in str(r) and "size=" in str(r)
    assert small.stats()["items_mem"] == r.imported
    small.close()
    spilled = ShmDatasetCache.from_snapshot(tmp_path / "s", session="dst2", size=1, spilling=True,
                                            spill_dir=tmp_path)
    r = spilled.last_import
    assert r.imported == 200 and r.spilled > 0 and not r.rejected and "spilled" in str(r)
    ds = spilled.wrap(None)
    assert all(_same(ds[i], Source(200, 0, 16 << 10)[i]) for i in range(0, 200, 7))
    spilled.close()


# --- faults -----------------------------------------------------------------------------------------


def test_an_existing_destination_is_refused_unless_overwrite(snap, tmp_path):
    cache, _ = _filled(seed=2)
    with pytest.raises(SnapshotError, match="already holds a snapshot.*--overwrite"):
        cache.export(snap)
    report = cache.export(snap, overwrite=True)  # fewer, larger segments: the old ones must go
    assert _segments(snap) == ["seg-00000.shms"] and report.segments == 1
    other = tmp_path / "home"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(SnapshotError, match="1 file"):
        cache.export(other)
    with pytest.raises(SnapshotError, match="not a snapshot's.*notes.txt"):
        cache.export(other, overwrite=True)
    assert (other / "notes.txt").read_text() == "mine"
    cache.close()
    got = ShmDatasetCache.from_snapshot(snap, session="dst")
    assert _same(got.wrap(None)[1], Source(seed=2)[1])
    got.close()


def test_a_truncated_segment_is_refused_naming_it(snap):
    seg = snap / _segments(snap)[1]
    os.truncate(seg, seg.stat().st_size - 100)
    with pytest.raises(SnapshotError, match=f"{seg.name} is .* bytes, the manifest says .*truncated"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


def test_a_missing_segment_is_refused_naming_it(snap):
    name = _segments(snap)[-1]
    os.unlink(snap / name)
    with pytest.raises(SnapshotError, match=f"data file .*{name} is missing"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


def test_a_swapped_segment_is_refused(snap, tmp_path):
    cache, _ = _filled(session="other", seed=3)
    cache.export(tmp_path / "other", segment_bytes=40_000)
    cache.close()
    name = _segments(snap)[0]
    shutil.copy(tmp_path / "other" / name, snap / name)
    with pytest.raises(SnapshotError, match=f"{name}.*(manifest says|not the data file the manifest names)"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


def test_a_bit_flipped_record_is_skipped_and_counted_never_imported(snap):
    seg = snap / _segments(snap)[0]
    data = bytearray(seg.read_bytes())
    data[fmt.HEADER_BYTES + 200] ^= 0x04  # inside the first record's stored bytes
    seg.write_bytes(bytes(data))
    cache = ShmDatasetCache.from_snapshot(snap, session="dst")
    r = cache.last_import
    assert r.damaged == 1 and r.imported == N - 1 and not r.complete
    assert f"{seg.name} at offset {fmt.HEADER_BYTES}" in str(r)
    ds = cache.wrap(None)
    src = Source()
    missing = [i for i in range(N) if i not in cache]
    assert len(missing) == 1
    assert all(_same(ds[i], src[i]) for i in range(N) if i != missing[0])  # never a wrong value
    with pytest.raises(ItemNotCached, match=f"item {missing[0]}"):
        ds[missing[0]]
    cache.close()
    assert cli(["import", str(snap), "--session", "dst3"]) == 1  # the CLI says it was not whole


def test_a_manifest_of_another_version_is_refused(snap):
    doc = json.loads((snap / fmt.MANIFEST).read_text())
    doc["version"] = 2
    (snap / fmt.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(SnapshotError, match="version 2; this shmcache reads version 1"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


def test_a_half_written_snapshot_never_looks_whole(snap):
    os.unlink(snap / fmt.MANIFEST)  # what an export killed before its last rename leaves
    os.rename(snap / _segments(snap)[0], snap / (_segments(snap)[0] + ".tmp"))
    with pytest.raises(SnapshotError, match="did not finish.*export it again"):
        ShmDatasetCache.from_snapshot(snap, session="dst")
    with pytest.raises(SnapshotError, match="no snapshot there"):
        ShmDatasetCache.from_snapshot(snap.parent / "nothing", session="dst")


FULL_DISK = r"""
import json, os, sys
import numpy as np
from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
from shmcache.cache.registry import SessionRegistry
from shmcache.base.namespace import namespace
dest, out = sys.argv[1], sys.argv[2]
cache = ShmDatasetCache(session="full", name="noise")
rng = np.random.default_rng(0)
for i in range(40):
    cache.put(i, rng.integers(0, 256, 100_000, dtype=np.uint8))  # 4 MB, incompressible
result = {}
try:
    cache.export(dest, segment_bytes=1 << 20)
    result["error"] = None
except SnapshotError as exc:
    result["error"] = str(exc)
result["left"] = sorted(os.listdir(dest)) if os.path.isdir(dest) else []
cache.close()
SessionRegistry(namespace()).destroy("full", force=True)
json.dump(result, open(out, "w"))
"""


def test_a_full_disk_during_export_is_a_clean_error_and_no_snapshot(tmp_path, private_mounts):
    small, out, script = tmp_path / "small", tmp_path / "result.json", tmp_path / "full.py"
    small.mkdir()
    script.write_text(FULL_DISK)
    proc = private_mounts(f"mount -t tmpfs -o size=2m tmpfs {small} || exit 99; "
                          f"exec {sys.executable} {script} {small}/snap {out}", timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["error"] and "no space left" in result["error"] and "snap" in result["error"]
    assert fmt.MANIFEST not in result["left"] and not [n for n in result["left"] if n.endswith(".tmp")]
    assert not os.listdir(small)  # the tmpfs was the namespace's: nothing of it is mounted here


def test_the_store_admits_portable_records_undecoded_and_gives_them_back():
    from shmcache.cache import codec
    from shmcache.tiers.tiered_store import portable_key, portable_record

    cache = ShmDatasetCache(session="st", name="recs")
    store = cache.store
    values = {3: (np.arange(10), 2.5), "k": {"a": b"xyz"}, b"b": [1, "two"]}
    recs = [(k, portable_record(codec.encode(v), k)) for k, v in values.items()]
    assert store.put_records(recs) == [True] * 3
    got = dict(store.portable_records())
    assert got == {portable_key(k): r for k, r in recs}
    assert store.lookup("k") == {"a": b"xyz"} and store.lookup(3)[1] == 2.5
    with pytest.raises(InvalidArgument, match="key 4 .* not a portable record"):
        store.put_records([(5, portable_record(codec.encode(1), 5)), (4, b"\x00" * 40)])
    assert not store.contains(5)  # refused before anything was stored
    cache.close()


def test_progress_bars_go_to_stderr_when_asked(tmp_path, capsys):
    cache, _ = _filled(n=8)
    cache.export(tmp_path / "s", progress=True)
    cache.close()
    assert "export src/" in capsys.readouterr().err
    got = ShmDatasetCache.from_snapshot(tmp_path / "s", session="dst", progress=True)
    err = capsys.readouterr().err
    assert "import dst/" in err and "B/s" in err
    got.close()
    got = ShmDatasetCache.from_snapshot(tmp_path / "s", session="dst")  # not a terminal: no bar
    assert capsys.readouterr().err == ""
    got.close()


def test_exporting_onto_a_file_says_it_is_a_file(tmp_path):
    """export(dest) with dest an existing file said "cannot replace the snapshot at DEST:
    SnapshotError('cannot create the directory DEST: File exists; ...'); check the path and your
    access to it": a snapshot that is not there, an error inside an error, two fixes neither of
    which applies. It now says that DEST is a file and what to pass instead."""
    afile = tmp_path / "weights.bin"
    afile.write_bytes(b"not a snapshot")
    cache, _ = _filled(n=4)
    try:
        for dest in (afile, afile / "snap"):
            with pytest.raises(SnapshotError) as err:
                cache.export(dest)
            text = str(err.value)
            assert f"{afile} is a file" in text and "directory" in text, text
            assert "SnapshotError(" not in text and "replace the snapshot" not in text, text
        assert afile.read_bytes() == b"not a snapshot"
    finally:
        cache.close()
