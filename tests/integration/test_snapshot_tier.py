"""The snapshot read-through tier (issue 12, item 4) with real parts: real caches in shared memory,
snapshots in real directories, behind file:// and memory:// (fsspec), and on S3 through s3fs against
moto's standalone server on 127.0.0.1; segments truncated, bit-flipped and deleted mid-run, the
server stopped mid-run. Every fault a counted miss with one log line, never a wrong value; a
snapshot of another dataset a clear error."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid

import pytest
import torch
from torch.utils.data import DataLoader

from shmcache import ShmDatasetCache
from shmcache.cache.store import CacheStore
from shmcache.cli.main import main as cli
from shmcache.errors import CacheMismatch, InvalidArgument, ItemNotCached, SnapshotError
from shmcache.snapshot import format as fmt
from shmcache.snapshot.tier import SnapshotTier, snapshot_tier
from shmcache.tiers import records as records

N = 60
IN_SNAPSHOT = 40  # items 0..39 are in the snapshot; 40..59 only in the source


class Source(torch.utils.data.Dataset):
    """Tensors and labels; ``seed`` makes another dataset (another fingerprint)."""

    def __init__(self, n=N, seed=0, item=2048):
        self.n, self.seed, self.item = n, seed, item

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(self.seed * 100_003 + i)
        return torch.randint(0, 256, (self.item,), dtype=torch.uint8, generator=g) // 8, i


class Counted:
    """A deterministic transform that counts its calls (the source's work)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, sample):
        self.calls += 1
        return sample[0].to(torch.int16) * 3, sample[1]


def _same(a, b):
    return torch.equal(a[0], b[0]) and a[1] == b[1]


def _expected(i, seed=0):
    return Counted()(Source(seed=seed)[i])


def _export(dest, n_cached=IN_SNAPSHOT, seed=0, segment_bytes=20_000, storage_options=None):
    """A snapshot of the cache of Source(seed) under Counted, holding items 0..n_cached-1 only
    (wrap() also stores its probes 30 and 59: those are dropped first)."""
    cache = ShmDatasetCache(session="src")
    ds = cache.wrap(Source(seed=seed), transform=Counted())
    cache.clear()
    for i in range(n_cached):
        ds[i]
    report = cache.export(dest, segment_bytes=segment_bytes, storage_options=storage_options)
    assert report.items == n_cached and not report.damaged
    cache.close()
    return report


@pytest.fixture(params=["local", "file", "memory"])
def snapshot_url(request, tmp_path):
    """A snapshot of items 0..39 (3+ segments) at a local path, a file:// URL, a memory:// URL."""
    if request.param == "memory":
        url = f"memory://snap-{uuid.uuid4().hex}"
    else:
        url = str(tmp_path / "snap") if request.param == "local" else f"file://{tmp_path}/snap"
    report = _export(url)
    assert report.segments >= 3
    yield url
    if request.param == "memory":
        import fsspec

        fsspec.filesystem("memory").rm(url[len("memory://"):], recursive=True)


def _job(url, session="dst", **kw):
    fn = Counted()
    cache = ShmDatasetCache(session=session, snapshot=url, **kw)
    ds = cache.wrap(Source(), transform=fn)
    fn.calls = 0  # wrap() computes its probes from the source: the job's own reads start here
    return cache, ds, fn


# --- reading through ----------------------------------------------------------------------------


def test_a_job_fills_shared_memory_from_the_snapshot_and_computes_only_what_it_lacks(snapshot_url):
    cache, ds, fn = _job(snapshot_url)
    assert all(_same(ds[i], _expected(i)) for i in range(N))
    # 40..58 are not in the snapshot (59 was stored by wrap()): the source computes those only
    assert fn.calls == N - IN_SNAPSHOT - 1
    st = cache.stats()
    assert st["snapshot"] == snapshot_url
    assert st["snapshot_hits"] == IN_SNAPSHOT - 2  # wrap() stored 0 and 30 as well
    assert st["snapshot_errors"] == st["snapshot_corrupt"] == 0 and st["snapshot_bytes_read"] > 0
    assert st["items_mem"] == N  # admitted into shared memory: a second epoch reads nothing more
    fn.calls = 0
    assert all(_same(ds[i], _expected(i)) for i in range(N))
    assert fn.calls == 0 and cache.stats()["snapshot_hits"] == IN_SNAPSHOT - 2
    cache.close()


def test_the_batch_path_reads_each_batch_in_one_call(tmp_path, monkeypatch):
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem

    url = f"memory://snap-{uuid.uuid4().hex}"
    _export(url, n_cached=N)
    calls = []
    real = MemoryFileSystem.cat_ranges
    monkeypatch.setattr(MemoryFileSystem, "cat_ranges",
                        lambda self, paths, *a, **k: calls.append(len(paths)) or real(self, paths, *a, **k))
    cache, ds, fn = _job(url)
    batches = list(DataLoader(ds, batch_size=8, shuffle=False))
    assert len(batches) == 8 and fn.calls == 0
    for b, batch in enumerate(batches):
        for j in range(len(batch[1])):
            want = _expected(8 * b + j)
            assert torch.equal(batch[0][j], want[0]) and int(batch[1][j]) == want[1]
    # one call loads every segment's index, then one call per batch: records and footers together
    assert len(calls) == 1 + 8, calls
    assert cache.stats()["snapshot_reads"] == 8
    cache.close()
    fsspec.filesystem("memory").rm(url[len("memory://"):], recursive=True)


def test_dataloader_workers_read_through_and_count_into_the_shared_counters(tmp_path):
    url = tmp_path / "snap"
    _export(url, n_cached=N)
    cache, ds, _ = _job(url)
    seen = {}
    for batch in DataLoader(ds, batch_size=10, shuffle=True, num_workers=2):
        for x, i in zip(batch[0], batch[1].tolist()):
            seen[i] = x
    assert len(seen) == N and all(torch.equal(seen[i], _expected(i)[0]) for i in range(N))
    st = cache.stats()  # the workers' counts, summed from their rows (NOTE [snapshot read-through])
    assert st["snapshot_hits"] == N - 3 and st["items_mem"] == N
    out = _cli_stat_json()
    row = next(r for r in out if r["session"] == "dst")
    assert row["snapshot"] == str(url) and row["snapshot_hits"] == N - 3
    cache.close()


def test_stats_and_stat_json_have_the_same_tier_keys_and_counts(tmp_path):
    """One place builds the tier keys (tiers.counts.stats_keys): stats() of the job, from its
    tiers, and `shmcache stat --json`, from the counts files, have the same keys and numbers -
    the seam's tier_* and tiers too, counted by the DataLoader's workers in their own rows, and
    read by the command in a fresh process that never imports torch."""
    url = tmp_path / "snap"
    _export(url)
    cache, ds, _ = _job(url)
    for _ in DataLoader(ds, batch_size=10, num_workers=2):
        pass
    st = cache.stats()
    row = next(r for r in _stat_json_in_a_fresh_process() if r["session"] == "dst")
    tier_keys = {k for k in st if k == "tiers" or k.startswith(("snapshot", "remote", "tier_"))}
    assert {"tiers", "tier_admitted", "tier_undecodable", "tier_pickle_refused", "snapshot_hits"} <= tier_keys
    assert {k: row.get(k) for k in tier_keys} == {k: st[k] for k in tier_keys}
    assert st["tier_admitted"] == st["snapshot_hits"] == st["tiers"]["snapshot"]["hits"] > 0
    cache.close()


def _stat_json_in_a_fresh_process():
    code = ("import sys\n"
            "from shmcache.cli import main\n"
            "rc = main(['stat', '--json'])\n"
            "assert 'torch' not in sys.modules, 'shmcache stat imported torch'\n"
            "sys.exit(rc)\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout)


def _cli_stat_json():
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert cli(["stat", "--json"]) == 0
    return json.loads(buf.getvalue())


def test_get_and_get_batch_read_through_a_named_cache(tmp_path):
    url = tmp_path / "snap"
    cache = ShmDatasetCache(session="src", name="plain")
    for k in range(10):
        cache.put(k, torch.full((100,), k))
    cache.put("a str key", "its value")
    cache.export(url)
    cache.close()
    got = ShmDatasetCache(session="dst", name="plain", snapshot=url)
    assert got.get("a str key") == "its value"
    assert torch.equal(got.get_batch(list(range(10))), torch.stack([torch.full((100,), k) for k in range(10)]))
    assert got.get(11, lambda k: "computed") == "computed"
    assert got.stats()["snapshot_hits"] == 11
    got.close()


# --- wrap(None): the snapshot's own cache, with no import and no source (issue 17, item 3) ---------


def test_wrap_none_serves_the_snapshot_named_and_sized_by_its_manifest(tmp_path):
    """torch_xla's CachedDataset(None, path) without an import: the name, identity and length come
    from manifest.json; items, get_batch and a DataLoader read through (it raised about get()/put())."""
    url = tmp_path / "snap"
    _export(url, n_cached=N)
    manifest = json.loads((url / "manifest.json").read_text())
    cache = ShmDatasetCache(session="dst", snapshot=url)
    ds = cache.wrap(None)
    assert cache.name == manifest["cache"]["name"] and len(ds) == N
    assert cache.store.read_meta()["fingerprint"] == manifest["cache"]["fingerprint"]
    assert all(_same(ds[i], _expected(i)) for i in range(0, N, 7))
    x, y = cache.get_batch([1, 2, 3])
    assert torch.equal(x, torch.stack([_expected(i)[0] for i in (1, 2, 3)])) and y.tolist() == [1, 2, 3]
    seen = {}
    for xb, yb in DataLoader(ds, batch_size=8, shuffle=True, num_workers=2):
        seen.update(zip(yb.tolist(), xb))
    assert len(seen) == N and all(torch.equal(seen[i], _expected(i)[0]) for i in range(N))
    st = cache.stats()
    assert st["snapshot_hits"] == N and st["items_mem"] == N and st["snapshot_errors"] == 0
    with pytest.raises(InvalidArgument, match="another dataset"):
        cache.wrap(Source(seed=1), transform=Counted())  # bound to the snapshot's dataset now
    cache.close()
    again = ShmDatasetCache(session="dst", snapshot=url)  # the cache it filled: the same one
    assert len(again.wrap(None)) == N and again.name == cache.name
    fn = Counted()
    same = ShmDatasetCache(session="dst", snapshot=url).wrap(Source(), transform=fn)  # the dataset itself
    fn.calls = 0
    assert all(_same(same[i], _expected(i)) for i in range(N)) and fn.calls == 0
    same.cache.close()
    again.close()


def test_wrap_none_with_a_name_takes_the_length_and_identity_of_the_snapshot(tmp_path):
    """With name=, wrap(None) said the cache does not record its length, though manifest.json holds
    it; items the snapshot lacks are ItemNotCached (no source to compute them)."""
    url = tmp_path / "snap"
    _export(url)  # items 0..39 of 60
    cache = ShmDatasetCache(session="dst", name="mine", snapshot=url)
    ds = cache.wrap(None)
    assert len(ds) == N and _same(ds[5], _expected(5))
    with pytest.raises(ItemNotCached, match="item 45 is not in cache dst/mine"):
        ds[45]
    fp = json.loads((url / "manifest.json").read_text())["cache"]["fingerprint"]
    assert cache.store.read_meta()["fingerprint"] == fp
    cache.close()
    held = ShmDatasetCache(session="dst", name="held")
    held.wrap(Source(seed=3))  # another dataset
    with pytest.raises(CacheMismatch, match="holds another dataset"):
        ShmDatasetCache(session="dst", name="held", snapshot=url).wrap(None)
    held.close()


def test_wrap_none_over_a_snapshot_of_get_put_values_says_what_to_use(tmp_path):
    url = tmp_path / "plain"
    cache = ShmDatasetCache(session="src", name="plain")
    cache.put(1, "one")
    cache.export(url)
    cache.close()
    got = ShmDatasetCache(session="dst", snapshot=url)
    with pytest.raises(InvalidArgument, match=r"holds get\(\)/put\(\) values.*cache.get\(key\)"):
        got.wrap(None)
    assert got.name == "plain" and got.get(1) == "one"  # the cache itself serves them by key
    got.close()
    with pytest.raises(InvalidArgument, match="name= .* or snapshot="):
        ShmDatasetCache(session="dst", snapshot="").wrap(None)


def test_without_a_snapshot_the_store_is_the_plain_store(monkeypatch):
    monkeypatch.delenv("SHMCACHE_SNAPSHOT", raising=False)
    cache = ShmDatasetCache(session="dst", name="x")
    assert type(cache.store) is CacheStore  # the hit path is unchanged: no TieredStore in front
    assert "snapshot" not in cache.stats()
    cache.close()


def test_the_environment_variable_names_the_snapshot(tmp_path, monkeypatch):
    url = tmp_path / "snap"
    _export(url)
    monkeypatch.setenv("SHMCACHE_SNAPSHOT", str(url))
    cache, ds, fn = _job(None)
    assert _same(ds[5], _expected(5)) and fn.calls == 0
    assert snapshot_tier(cache.store).url == str(url)
    cache.close()
    off = ShmDatasetCache(session="dst", name="y", snapshot="")  # "": none, whatever the environment says
    assert type(off.store) is CacheStore
    off.close()


def test_bad_arguments_are_refused():
    with pytest.raises(InvalidArgument, match="unknown key"):
        ShmDatasetCache(name="x", snapshot="/nowhere", snapshot_options={"timeout": 1})
    with pytest.raises(InvalidArgument, match="timeout_s"):
        ShmDatasetCache(name="x", snapshot="/nowhere", snapshot_options={"timeout_s": 0})
    with pytest.raises(InvalidArgument, match="snapshot must be a path"):
        ShmDatasetCache(name="x", snapshot=3)


def test_a_path_without_a_snapshot_is_a_clear_error(tmp_path):
    with pytest.raises(SnapshotError, match="manifest.json does not exist"):
        ShmDatasetCache(session="dst", name="x", snapshot=tmp_path / "nothing")


# --- identity -------------------------------------------------------------------------------------


def test_a_snapshot_of_another_dataset_is_refused_unless_forced(tmp_path):
    url = tmp_path / "other"
    _export(url, seed=1)  # the same type and transform, other data: another fingerprint
    with pytest.raises(CacheMismatch, match=r"holds another dataset \(fingerprint .*force"):
        _job(url)
    # a named cache is checked when it wraps its dataset
    cache = ShmDatasetCache(session="dst", name=None, snapshot=url, snapshot_options={"force": True})
    ds = cache.wrap(Source(), transform=Counted())
    assert _same(ds[3], _expected(3, seed=1))  # forced: what the snapshot holds, as asked
    cache.close()


def test_a_named_cache_checks_the_snapshot_when_it_wraps(tmp_path, caplog):
    url = tmp_path / "other"
    _export(url, seed=1)
    caplog.set_level(logging.WARNING, logger="shmcache")
    cache = ShmDatasetCache(session="dst", name="mine", snapshot=url)  # its dataset is not known yet
    assert cache.get(3, lambda k: "computed") == "computed"  # so the snapshot is not read
    assert [r for r in caplog.records if "not read until cache 'mine' wraps its dataset" in r.getMessage()]
    with pytest.raises(CacheMismatch, match="holds another dataset"):
        cache.wrap(Source(), transform=Counted())  # now the fingerprint is known: another dataset
    cache.close()
    cache = ShmDatasetCache(session="dst2", name="mine", snapshot=url)  # another name, the same dataset
    fn = Counted()
    ds = cache.wrap(Source(seed=1), transform=fn)
    fn.calls = 0
    assert _same(ds[7], _expected(7, seed=1)) and fn.calls == 0
    cache.close()


def test_a_snapshot_of_a_cache_without_a_dataset_is_checked_by_name(tmp_path):
    url = tmp_path / "plain"
    cache = ShmDatasetCache(session="src", name="plain")
    cache.put(1, "one")
    cache.export(url)
    cache.close()
    with pytest.raises(CacheMismatch, match="cache 'plain', not 'other'"):
        ShmDatasetCache(session="dst", name="other", snapshot=url)
    forced = ShmDatasetCache(session="dst", name="other", snapshot=url, snapshot_options={"force": True})
    assert forced.get(1) == "one"
    forced.close()


def test_an_unreadable_manifest_is_a_clear_error(tmp_path):
    url = tmp_path / "snap"
    _export(url)
    os.unlink(url / "manifest.json")
    os.mkdir(url / "manifest.json")  # read() fails with EISDIR, whoever the reader is (root too)
    with pytest.raises(SnapshotError, match="cannot read .*manifest.json: Is a directory; check the path"):
        ShmDatasetCache(session="dst", name="x", snapshot=url)


# --- faults mid-run -------------------------------------------------------------------------------


def _index(path):
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        data = f.read()
    footer = fmt.parse_footer(data[-fmt.FOOTER_BYTES:], size, str(path))
    return fmt.parse_index(data[footer.index_offset:size - fmt.FOOTER_BYTES], footer, str(path))


def test_truncated_bit_flipped_and_deleted_segments_mid_run_are_misses_with_right_values(tmp_path, caplog):
    url = tmp_path / "snap"
    report = _export(url, n_cached=N, segment_bytes=10_000)
    assert report.segments >= 4
    cache, ds, fn = _job(url)
    assert _same(ds[1], _expected(1)) and fn.calls == 0  # the indexes are loaded now
    segs = sorted(p for p in os.listdir(url) if p.endswith(".shms"))
    damaged = {int(h) for s in segs[:3] for h in _index(url / s)["hash"]}  # int keys: the hash is the key
    with open(url / segs[0], "r+b") as f:  # a bit flipped in the stored bytes of every record of seg 0
        for e in _index(url / segs[0]):
            f.seek(int(e["offset"]) + records.RECORD_HEADER_BYTES + 8 + 100)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0x10]))
    os.truncate(url / segs[1], os.path.getsize(url / segs[1]) // 2)
    os.unlink(url / segs[2])
    caplog.set_level(logging.WARNING, logger="shmcache")
    for _ in range(2):  # twice: the second pass reads shared memory, the log lines stay one each
        assert all(_same(ds[i], _expected(i)) for i in range(N))
    st = cache.stats()
    # what the damaged segments held is computed from the source, except what shared memory had
    # already (wrap()'s probes 0, 30, 59 and item 1, read before the damage)
    assert fn.calls == len(damaged - {0, 1, 30, 59}) > 0
    assert st["snapshot_hits"] == N - 3 - fn.calls  # item 1 included
    assert st["snapshot_corrupt"] >= 1 and st["snapshot_errors"] == 2, st
    lines = [r.getMessage() for r in caplog.records if "snapshot tier" in r.getMessage()]
    assert len(lines) == 3, lines  # one per condition: corrupt, seg 1 truncated, seg 2 deleted
    assert any(segs[1] in m and "truncated" in m for m in lines)
    assert any(segs[2] in m and "deleted" in m for m in lines)
    assert any("fails its checks" in m for m in lines)
    cache.close()


def test_a_segment_missing_at_the_start_costs_its_items_only(tmp_path, caplog):
    url = tmp_path / "snap"
    _export(url, n_cached=N, segment_bytes=10_000)
    segs = sorted(p for p in os.listdir(url) if p.endswith(".shms"))
    gone = len(_index(url / segs[-1]))
    os.unlink(url / segs[-1])
    caplog.set_level(logging.WARNING, logger="shmcache")
    cache, ds, fn = _job(url)
    assert all(_same(ds[i], _expected(i)) for i in range(N))
    assert 0 < fn.calls <= gone
    assert [m for m in (r.getMessage() for r in caplog.records) if "is missing" in m]
    cache.close()


def test_a_tier_is_never_pickled():
    import pickle

    with pytest.raises(TypeError, match="not pickled"):
        pickle.dumps(SnapshotTier.__new__(SnapshotTier))


def test_values_computed_under_a_read_only_tier_are_not_packed_for_it(tmp_path, monkeypatch):
    from shmcache.tiers import tiered_store as tiers

    url = tmp_path / "snap"
    _export(url)
    packed = []
    real = tiers.portable_record
    monkeypatch.setattr(tiers, "portable_record", lambda enc, key: packed.append(key) or real(enc, key))
    cache, ds, fn = _job(url)
    assert all(_same(ds[i], _expected(i)) for i in range(IN_SNAPSHOT, N))
    assert fn.calls == N - IN_SNAPSHOT - 1 and packed == []  # a copy of each value, for nobody
    cache.close()


def test_spawned_workers_open_the_snapshot_themselves(tmp_path):
    url = tmp_path / "snap"
    _export(url, n_cached=N)
    cache, ds, _ = _job(url)
    loader = DataLoader(ds, batch_size=20, num_workers=1, multiprocessing_context="spawn")
    got = [x for batch in loader for x in batch[0]]
    assert len(got) == N and all(torch.equal(got[i], _expected(i)[0]) for i in range(N))
    assert cache.stats()["snapshot_hits"] == N - 3  # counted by the worker, in its own row
    cache.close()


def test_a_snapshot_goes_in_front_of_a_tier_attached_before_it(tmp_path):
    from shmcache.cache.registry import SessionRegistry
    from shmcache.snapshot.tier import tiered
    from shmcache.tiers.tiered_store import TieredStore

    class Other:
        name = "remote"
        read_only = False
        leases = False
        max_batch_bytes = 1 << 30

    url = tmp_path / "snap"
    _export(url)
    local = CacheStore("dst", "x")
    store = tiered(TieredStore(local, [Other()]), url, "x", None, SessionRegistry(), {"force": True})
    assert [t.name for t in store.behind] == ["snapshot", "remote"]
    store.close()


def test_warmup_takes_what_the_snapshot_holds_and_computes_the_rest(tmp_path):
    url = tmp_path / "snap"
    _export(url)
    cache, ds, fn = _job(url)
    assert cache.warmup(ds, progress=False) == N - IN_SNAPSHOT - 1  # 59 was stored by wrap()
    assert fn.calls == N - IN_SNAPSHOT - 1 and cache.stats()["items_mem"] == N
    assert cache.stats()["snapshot_hits"] == IN_SNAPSHOT - 2
    cache.close()


def test_a_cache_destroyed_and_made_again_starts_its_tier_counts_at_zero(tmp_path):
    """`shmcache destroy SESSION --cache NAME` drops the cache's tier counts files with it (as its
    claims and stall counts): the cache made again under that name counts only its own reads,
    in a fresh process, as `shmcache stat --json` shows."""
    url = tmp_path / "snap"
    _export(url)
    cache, ds, _ = _job(url)
    for i in range(IN_SNAPSHOT):
        ds[i]
    assert cache.stats()["snapshot_hits"] > 0
    cache.close()
    assert cli(["destroy", "dst", "--cache", cache.name, "--force"]) == 0
    code = ("import sys\n"
            "from shmcache import ShmDatasetCache\n"
            f"sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "from test_snapshot_tier import Counted, Source\n"
            f"cache = ShmDatasetCache(session='dst', snapshot={str(url)!r})\n"
            "ds = cache.wrap(Source(), transform=Counted())\n"
            "st = cache.stats()\n"
            "print(st['snapshot_hits'], st['tier_admitted'])\n"
            "cache.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    hits, admitted = map(int, proc.stdout.split())
    assert hits <= 2 and admitted <= 2  # wrap()'s probes at most, none of the old cache's reads
