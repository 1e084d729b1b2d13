"""Snapshots as files from a stranger (issue 16, items 4-7): decompression bombs, FIFOs, links to
/dev/zero, sparse files, forged counts and index entries, export into a directory another user
can write, and import --force under live readers. Real bombs (1 GiB of zeros, streamed through
zstd: 32 KB), real FIFOs, symlinks and sparse files; memory is measured in a subprocess."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pwd
import shutil
import struct
import subprocess
import sys
import textwrap

import pytest
import zstandard
from test_hostile_user import ATTACKER, _isolated
from test_snapshot import N, Source, _filled, _same

from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt
from shmcache.snapshot.load import import_snapshot
from shmcache.tiers import records as records
from shmcache.tiers.tiered_store import portable_key

GiB = 1 << 30


@functools.lru_cache(maxsize=4)
def _zeros_frame(n: int, content_size: bool) -> bytes:
    """A zstd frame of ``n`` zero bytes, made in 1 MiB steps (never ``n`` bytes in memory): 1 GiB
    is a 32 KB frame."""
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    obj = cctx.compressobj(size=n if content_size else -1)
    step = bytes(1 << 20)
    parts = [obj.compress(step) for _ in range(n >> 20)]
    return b"".join(parts) + obj.flush()


def _claiming_frame(n: int) -> bytes:
    """An 18-byte zstd frame whose header claims ``n`` bytes (single segment, 8-byte content size),
    holding one RLE block of 1 byte."""
    block = (1 | 1 << 1 | 1 << 3).to_bytes(3, "little")  # last block, RLE, 1 byte
    return b"\x28\xb5\x2f\xfd" + bytes([0xE0]) + struct.pack("<Q", n) + block + b"\x00"


def _record(pkey: bytes, stored: bytes, raw_len: int) -> list[bytes]:
    """A spill record of ``stored`` as a zstd frame that says it decodes to ``raw_len`` bytes."""
    head = records.pack_head(records.FLAG_ZSTD, pkey, raw_len, stored)
    pad = bytes(-len(pkey) % 8)
    return [head, pkey, pad, stored, bytes(-len(stored) % 8)]


def _forge(dest, like: fmt.Manifest, good=(), bad=(), aliases=(), hole=None):
    """A one-segment snapshot at ``dest``: ``good`` (pkey, portable record) pairs written the way
    an export does, ``bad`` (pkey, record parts) appended as they are, ``aliases``: index entries
    for the named keys pointing at the record of another (pkey, aliased pkey), and ``hole``:
    (pkey, n) an index entry for a "record" of n bytes that is a hole in a sparse file."""
    dest.mkdir()
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    with open(dest / fmt.data_file_name(0), "wb") as f:
        w = fmt.DataFileWriter(f, 0, cctx)
        where = {}
        for pkey, rec in good:
            where[pkey] = (w.size, w.add(pkey, rec))
        for pkey, parts in bad:
            w._hashes.append(fmt.key_hash(pkey))
            w._entries.append((w.size, sum(map(len, parts)), struct.unpack_from("<I", parts[0], 28)[0]))
            for p in parts:
                w._write(p)
        for pkey, target in aliases:
            off, length = where[target]
            w._hashes.append(fmt.key_hash(pkey))
            w._entries.append((off, length, w._entries[[e[0] for e in w._entries].index(off)][2]))
        if hole is not None:
            w._hashes.append(fmt.key_hash(hole[0]))
            w._entries.append((w.size, hole[1], 0))
            f.seek(hole[1], os.SEEK_CUR)
            w.size += hole[1]
        info = w.finish()
    m = dataclasses.replace(like, items=info.items, stored_bytes=info.size, data_files=[info])
    (dest / fmt.MANIFEST).write_bytes(m.to_json())
    return dest


@pytest.fixture
def real(tmp_path):
    """A real snapshot of Source(), its manifest and its portable records by key."""
    cache, _ = _filled()
    cache.export(tmp_path / "real")
    recs = dict(cache.store.portable_records())
    cache.close()
    manifest = fmt.Manifest.from_json((tmp_path / "real" / fmt.MANIFEST).read_bytes(), "m")
    return tmp_path / "real", manifest, recs


def _bombs(keys) -> list:
    """For each key a hostile record: an honest 1 GiB bomb, one that says 1 MiB but is 1 GiB of
    frame with no size, one whose frame says 1 GiB and the record 1 MiB, and one 18-byte frame
    claiming 64 GiB (in turn)."""
    kinds = [lambda k: _record(k, _zeros_frame(GiB, True), GiB),
             lambda k: _record(k, _zeros_frame(GiB, False), 1 << 20),
             lambda k: _record(k, _zeros_frame(GiB, True), 1 << 20),
             lambda k: _record(k, _claiming_frame(64 * GiB), 64 * GiB)]
    return [(k, kinds[i % len(kinds)](k)) for i, k in enumerate(keys)]


_MEASURED = """
import json, resource, sys
{setup}
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
{work}
grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10
print(json.dumps(dict(grew_mib=grew, **out)))
"""


def _measured(setup: str, work: str, *args) -> dict:
    code = _MEASURED.format(setup=textwrap.dedent(setup), work=textwrap.dedent(work))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_unpack_record_never_decodes_past_the_declared_length_or_the_limit():
    """A record's raw length was trusted: a 32 KB frame that expands to 1 GiB took 1.25-4.3 GiB,
    an 18-byte frame claiming 64 GiB raised a bare MemoryError. Each is now (None, why) with
    memory bounded by what the record declared, within the limit."""
    out = _measured("""
        from shmcache.tiers import records as records
        import zstandard
        from test_snapshot_hostile import _bombs, GiB
        bombs = [parts for _, parts in _bombs([b"k" * 8] * 4)]
        dctx = zstandard.ZstdDecompressor()
    """, """
        whys = []
        for parts in bombs:
            payload, why = records.unpack_record(b"".join(parts), b"k" * 8, dctx, limit=64 << 20)
            whys.append(why if payload is None else "a value")
        out = {"whys": whys}
    """)
    assert "a value" not in out["whys"], out
    assert "claims 1073741824 bytes" in out["whys"][0] and "claims 68719476736" in out["whys"][3], out
    assert out["grew_mib"] < 64, out


def test_an_import_of_bombs_counts_them_damaged_in_bounded_memory(real, tmp_path):
    """`shmcache import` of a snapshot holding bombs: on main a MemoryError (the 64 GiB claim) and
    GiBs of memory; now each is a damaged record, the good items are imported, and memory stays
    bounded (the cache's cap of 64 MiB bounds every record)."""
    _, manifest, recs = real
    good = [(k, r) for k, r in recs.items() if k != portable_key(0)][:N - 8]
    bad = _bombs([portable_key(i) for i in range(1000, 1008)])
    snap = _forge(tmp_path / "bombs", manifest, good, bad)
    out = _measured("""
        import sys
        import shmcache.data.dataset  # noqa: F401 - registers the torch handler (the records hold tensors)
        from shmcache.snapshot.load import import_snapshot
    """, """
        r = import_snapshot(sys.argv[1], session="dst", size_mb=64)
        out = {"imported": r.imported, "damaged": r.damaged, "items": r.items, "text": str(r)}
    """, snap)
    assert out["damaged"] == 8 and out["imported"] == len(good) and out["items"] == len(good) + 8, out["text"]
    assert "8 record(s) failed their checks" in out["text"], out
    assert out["grew_mib"] < 256, out


def test_a_batch_of_bombed_keys_through_the_read_through_does_not_multiply(real, tmp_path):
    """snapshot= read-through: a batch of bombed keys decoded every one (GiBs each, kept for the
    whole batch); now a value is bounded by the cache's cap and a batch by what is left of it, so
    the keys are counted corrupt and computed from the source: right values, bounded memory."""
    _, manifest, recs = real
    bombed = [1, 2, 3, 4]
    good = [(k, r) for k, r in recs.items() if k not in {portable_key(i) for i in bombed}]
    snap = _forge(tmp_path / "bombs", manifest, good, _bombs([portable_key(i) for i in bombed]))
    out = _measured("""
        import sys
        from shmcache import ShmDatasetCache
        from test_snapshot import Source, _same, N
        cache = ShmDatasetCache(session="rt", size=64, snapshot=sys.argv[1])
        ds = cache.wrap(Source())
        src = Source()
    """, """
        batch = ds.get_batch(list(range(8)))
        import torch
        want = torch.stack([src[i][0] for i in range(8)])
        out = {"right": int(torch.equal(batch[0], want)) * 8,
               "corrupt": cache.stats()["snapshot_corrupt"], "hits": cache.stats()["snapshot_hits"]}
        cache.close()
    """, snap)
    assert out["right"] == 8 and out["corrupt"] == 4 and out["hits"] == 3, out  # key 0: wrap() computed it
    assert out["grew_mib"] < 256, out



# --- hostile files: FIFOs, links, sparse files, forged counts ---------------------------------------

_WITHIN = """
import sys
import shmcache.data.dataset  # noqa: F401
from test_snapshot import Source, _same
from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
how, url = sys.argv[1], sys.argv[2]
try:
    if how == "import":
        ShmDatasetCache.from_snapshot(url, session="dst").close()
        print("imported")
    else:
        cache = ShmDatasetCache(session="rt", snapshot=url)
        ds = cache.wrap(Source())
        print("right" if all(_same(ds[i], Source()[i]) for i in range(4)) else "wrong")
        print("snapshot_hits", cache.stats()["snapshot_hits"])
        cache.close()
except SnapshotError as exc:
    print("SnapshotError:", exc)
"""


def _run_within(how: str, url, seconds: float = 30) -> str:
    """An import (or a read-through job) of ``url`` in a subprocess that must end within
    ``seconds`` (a FIFO hung it for good); its stdout."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    try:
        proc = subprocess.run([sys.executable, "-c", _WITHIN, how, str(url)], capture_output=True, text=True,
                              timeout=seconds, env=env)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{how} of {url} still ran after {seconds} s (it waits on a FIFO, or reads without end)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _plant(path, what: str) -> None:
    os.unlink(path)
    if what == "a FIFO":
        os.mkfifo(path)
    elif what == "a link to /dev/zero":
        os.symlink("/dev/zero", path)
    else:  # a 6 GiB sparse file
        with open(path, "wb") as f:
            f.truncate(6 * GiB)


# each file and each way in the default run; the other three pairs with -m slow
@pytest.mark.parametrize("how, what", [
    ("import", "a FIFO"), ("read-through", "a link to /dev/zero"), ("import", "a 6 GiB sparse file"),
    pytest.param("read-through", "a FIFO", marks=pytest.mark.slow),
    pytest.param("import", "a link to /dev/zero", marks=pytest.mark.slow),
    pytest.param("read-through", "a 6 GiB sparse file", marks=pytest.mark.slow),
])
def test_a_manifest_that_is_not_a_small_regular_file_is_refused_unread(real, tmp_path, what, how):
    """manifest.json as a FIFO hung `shmcache import` and snapshot= for good; linked to /dev/zero
    or a 6 GiB sparse file it was read whole. Now it is opened O_NOFOLLOW|O_NONBLOCK, fstat'ed and
    refused, naming the file, before any read."""
    snap = tmp_path / "snap"
    os.rename(real[0], snap)
    _plant(snap / fmt.MANIFEST, what)
    out = _run_within(how, snap)
    assert out.startswith("SnapshotError:") and str(snap / fmt.MANIFEST) in out, out
    assert {"a FIFO": "is a FIFO, not a regular file", "a link to /dev/zero": "is a symbolic link",
            "a 6 GiB sparse file": "is 6442450944 bytes, more than"}[what] in out, out


@pytest.mark.parametrize("how", ["import", "read-through"])
def test_a_segment_that_is_a_fifo_is_a_clear_error_never_a_hang(tmp_path, how):
    """A segment replaced by a FIFO hung the read-through on its first miss (and the import).
    Now the import is a SnapshotError naming it; the read-through drops that segment and computes
    its items from the source."""
    cache, _ = _filled()
    snap = tmp_path / "snap"
    cache.export(snap, segment_bytes=40_000)
    cache.close()
    seg = sorted(p for p in os.listdir(snap) if p.endswith(".shms"))[0]
    os.unlink(snap / seg)
    os.mkfifo(snap / seg)
    out = _run_within(how, snap)
    if how == "import":
        assert out.startswith("SnapshotError:") and f"{snap / seg} is a FIFO" in out, out
    else:
        assert out.startswith("right"), out


@pytest.mark.parametrize("length", [2**62, 2**40 + 1])
def test_a_manifest_length_beyond_any_dataset_is_refused_naming_the_field(real, tmp_path, length):
    """A manifest `length` of 2**62 was accepted: wrap(None) then said len() == 2**62 and a
    shuffled DataLoader failed allocating its permutation."""
    snap = tmp_path / "snap"
    os.rename(real[0], snap)
    doc = json.loads((snap / fmt.MANIFEST).read_text())
    doc["length"] = length
    (snap / fmt.MANIFEST).write_text(json.dumps(doc))
    with pytest.raises(SnapshotError, match=f"the dataset's length is {length}, beyond"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


# --- export where another user can reach ---------------------------------------------------------

_EXPORT_RACE = r'''
import time
from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
secret = "/tmp/secret"
with open(secret, "w") as f:
    f.write("root's own 0600 file")
os.chmod(secret, 0o600)
dest = "/tmp/dest"
SETUP
# the attacker plants links at the names an export writes, again and again (an export removes
# what it finds with --overwrite, then writes for a while: long enough to plant them again)
plant = ("end=$(($(date +%s) + 3)); while [ $(date +%s) -lt $end ]; do "
         "ln -s /tmp/secret /tmp/dest/manifest.json.tmp 2>/dev/null; "
         "ln -s /tmp/secret /tmp/dest/seg-00000.shms.tmp 2>/dev/null; done")
racer = subprocess.Popen(["runuser", "-u", "shmcache-attacker", "--", "sh", "-c", plant])
time.sleep(0.3)
cache = ShmDatasetCache(session="s", name="c")
for i in range(256):
    cache.put(i, os.urandom(16384))
try:
    cache.export(dest, overwrite=True)
    err = None
except SnapshotError as exc:
    err = str(exc)
cache.close()
racer.wait()
print(json.dumps({"err": err, "secret": open(secret).read(), "mode": mode(secret)}))
'''


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare") or not shutil.which("runuser"),
                    reason="needs root, unshare and runuser: a real second user plants the links")
@pytest.mark.parametrize("setup", [pytest.param("others-writable", marks=pytest.mark.slow), "squatted"])
def test_export_into_a_directory_another_user_can_write_is_refused(setup):
    """Export wrote with open(path, "wb"): in a destination another user can write (here
    root's own 0777 directory, with --overwrite) or one they squatted, their link at
    manifest.json.tmp or seg-00000.shms.tmp made root overwrite a root-owned 0600 file. Now such a
    destination is refused, naming it and the attack, and the target is untouched."""
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:  # the real second user (as tests/integration/test_hostile_user.py makes it)
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True, capture_output=True)
    setup_code = {"others-writable": "os.mkdir(dest); os.chmod(dest, 0o777)",
                  "squatted": "attacker('mkdir', '-m', '777', dest)"}[setup]
    out = _isolated(_EXPORT_RACE.replace("SETUP", setup_code))
    assert out["secret"] == "root's own 0600 file" and out["mode"] == "0o600", out
    assert out["err"] and "/tmp/dest" in out["err"] and "plant a symlink" in out["err"], out
    assert ("writable by group and others" if setup == "others-writable" else "belongs to uid") in out["err"], out


def test_export_creates_its_files_exclusively_in_its_own_directory(tmp_path):
    """The destination is made by the export (or is the user's own, writable by no one else);
    a name that appears meanwhile is never written through; a link at the destination is refused."""
    cache, _ = _filled()
    try:
        cache.export(tmp_path / "new" / "snap")
        assert os.stat(tmp_path / "new" / "snap").st_mode & 0o022 == 0
        own = tmp_path / "own"
        own.mkdir(mode=0o755)
        cache.export(own)
        cache.export(own, overwrite=True)
        os.symlink(own, tmp_path / "link")
        with pytest.raises(SnapshotError, match="is a symbolic link: an export never writes through a link"):
            cache.export(tmp_path / "link", overwrite=True)
        (tmp_path / "open").mkdir()
        os.chmod(tmp_path / "open", 0o775)
        with pytest.raises(SnapshotError, match=r"open is writable by its group \(mode 0o775\)"):
            cache.export(tmp_path / "open")
    finally:
        cache.close()
    assert ShmDatasetCache.from_snapshot(own, session="dst").last_import.complete


# --- import --force under live readers --------------------------------------------------------------

_READER = """
import sys, time
import shmcache.data.dataset  # noqa: F401
from test_snapshot import Source, _same, N
from shmcache import ShmDatasetCache
from shmcache.errors import CacheMismatch, CacheNotFound
cache = ShmDatasetCache(session="live", name="c")
ds = cache.wrap(Source(seed=0))
src = Source(seed=0)
right = wrong = refused = 0
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
i = 0
while time.monotonic() < end:
    try:
        if _same(ds[i % N], src[i % N]):
            right += 1
        else:
            wrong += 1
    except (CacheNotFound, CacheMismatch):
        refused += 1
    i += 1
print("counts", right, wrong, refused, flush=True)
"""


@pytest.mark.parametrize("via", ["cli", pytest.param("from_snapshot", marks=pytest.mark.slow)])
def test_import_force_of_another_dataset_never_serves_it_to_live_readers(tmp_path, via):
    """`shmcache import --force` of another dataset into a cache that a live process reads:
    the cache was clear()ed and refilled, and the reader took the other dataset's values for its
    own (2,183,114 of 2,822,493 reads wrong). Now the old cache is tombstoned first: the reader's
    handle misses (it recomputes from its source) or raises CacheNotFound; wrong values: 0."""
    from shmcache.cli.main import main as cli

    for seed, where in ((0, "a"), (1, "b")):
        cache, _ = _filled(session=f"src{seed}", seed=seed)
        cache.export(tmp_path / where)
        cache.close()
    ShmDatasetCache.from_snapshot(tmp_path / "a", session="live", name="c").close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")]))
    reader = subprocess.Popen([sys.executable, "-c", _READER, "4"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert reader.stdout.readline().strip() == "ready"
        import time

        time.sleep(0.5)  # the reader serves dataset a from shared memory
        if via == "cli":
            assert cli(["import", str(tmp_path / "b"), "--session", "live", "--name", "c", "--force"]) == 0
        else:
            ShmDatasetCache.from_snapshot(tmp_path / "b", session="live", name="c", force=True).close()
        out, _ = reader.communicate(timeout=60)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    right, wrong, refused = map(int, out.split("counts")[1].split())
    assert wrong == 0 and right > 0, (right, wrong, refused)
    fresh = ShmDatasetCache(session="live", name="c")
    ds = fresh.wrap(None)
    assert all(_same(ds[i], Source(seed=1)[i]) for i in range(N))  # the import itself went in whole
    fresh.close()


# --- honest reports ----------------------------------------------------------------------------------


def test_a_duplicate_key_is_reported_and_not_counted_as_imported(real, tmp_path):
    """A second index entry for a key (its own record again) gave "imported 65 of 65" for 64
    items. Now: 64 of 65, one duplicate entry reported as such, and the import is not complete."""
    _, manifest, recs = real
    cctx = zstandard.ZstdCompressor(level=1, write_content_size=True)
    dup = (portable_key(5), records.pack_record(portable_key(5), recs[portable_key(5)], cctx))
    snap = _forge(tmp_path / "dup", manifest, list(recs.items()), [dup])
    report = import_snapshot(snap, session="dst")
    assert (report.items, report.imported, report.duplicates) == (N + 1, N, 1), str(report)
    assert not report.complete and "1 index entry named a key already imported (a duplicate" in str(report)


def test_overlapping_index_entries_are_reported_and_not_counted_as_imported(real, tmp_path):
    """Key 63's index entry pointed into key 62's record: "imported 64 of 64" with item 63 not
    there. Now entries that share bytes are reported as overlapping, and only what can really be
    read is counted: 63 of 64."""
    _, manifest, recs = real
    good = [(k, r) for k, r in recs.items() if k != portable_key(N - 1)]
    snap = _forge(tmp_path / "overlap", manifest, good, aliases=[(portable_key(N - 1), portable_key(N - 2))])
    report = import_snapshot(snap, session="dst")
    assert (report.items, report.imported, report.overlapping) == (N, N - 1, 1), str(report)
    assert not report.complete and "1 index entry shared bytes with another (overlapping" in str(report)
    cache = ShmDatasetCache(session="dst", name=manifest.name)
    assert len(cache) == N - 1
    cache.close()


def test_an_index_entry_longer_than_any_record_is_never_read(real, tmp_path):
    """An index entry of 2 GiB (a hole in a sparse segment) made the import read 2 GiB in one
    chunk and the read-through read it for one key. Now an entry longer than any record the cache
    can take is damaged (import) or corrupt (read-through) with none of it read."""
    _, manifest, recs = real
    good = [(k, r) for k, r in recs.items() if k != portable_key(5)]
    snap = _forge(tmp_path / "hole", manifest, good, hole=(portable_key(5), 2 * GiB))
    out = _measured("""
        import sys
        import shmcache.data.dataset  # noqa: F401
        from shmcache import ShmDatasetCache
        from shmcache.snapshot.load import import_snapshot
        from test_snapshot import Source, _same
    """, """
        r = import_snapshot(sys.argv[1], session="dst", size_mb=64)
        cache = ShmDatasetCache(session="rt", size=64, snapshot=sys.argv[1])
        ds = cache.wrap(Source())
        out = {"damaged": r.damaged, "imported": r.imported, "right": bool(_same(ds[5], Source()[5])),
               "corrupt": cache.stats()["snapshot_corrupt"]}
        cache.close()
    """, snap)
    assert out["damaged"] == 1 and out["imported"] == N - 1, out
    assert out["right"] and out["corrupt"] == 1, out
    assert out["grew_mib"] < 256, out
