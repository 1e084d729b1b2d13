"""The snapshot read-through tier on S3 for real: s3fs against moto's standalone S3 server on
127.0.0.1 (as s3fs's own test suite does). Each test starts its own server, so one can stop it
mid-run: the job goes on, computing from the source, with one log line."""

from __future__ import annotations

import logging
import time
import uuid

import pytest
import torch
from torch.utils.data import DataLoader

from shmcache import ShmDatasetCache

pytest.importorskip("s3fs")  # the test extra installs s3fs and moto[server]: never skipped in CI
server_mod = pytest.importorskip("moto.server")

N = 48


class Source(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return torch.arange(i, i + 500, dtype=torch.int32), f"label {i}"


class Counted:
    def __init__(self):
        self.calls = 0

    def __call__(self, sample):
        self.calls += 1
        return sample


@pytest.fixture
def s3(monkeypatch):
    """A moto server of this test's own, a bucket, and the storage_options that reach it."""
    import s3fs

    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": f"http://{host}:{port}"},
            "skip_instance_cache": True}
    bucket = f"snap-{uuid.uuid4().hex[:12]}"  # moto's state is one per process: a bucket per test
    fs = s3fs.S3FileSystem(**opts)
    fs.mkdir(bucket)
    state = {"server": server, "running": True}
    yield opts, state, f"s3://{bucket}/run"
    if state["running"]:
        fs.rm(bucket, recursive=True)
        server.stop()


def _export(opts, url):
    cache = ShmDatasetCache(session="src")
    ds = cache.wrap(Source(), transform=Counted())
    for i in range(N):
        ds[i]
    report = cache.export(url, segment_bytes=20_000, storage_options=opts)
    assert report.items == N and report.segments >= 2
    cache.close()


def _job(url, opts, **options):
    fn = Counted()
    cache = ShmDatasetCache(session="dst", snapshot=url,
                            snapshot_options={"storage_options": opts, **options})
    ds = cache.wrap(Source(), transform=fn)
    fn.calls = 0  # wrap() computes its probes from the source: the job's own reads start here
    return cache, ds, fn


def _check(batch, first):
    for j, (x, label) in enumerate(zip(batch[0], batch[1])):
        assert torch.equal(x, torch.arange(first + j, first + j + 500, dtype=torch.int32))
        assert label == f"label {first + j}"


def test_a_job_reads_through_a_snapshot_on_s3_one_read_per_batch(s3):
    opts, _, url = s3
    _export(opts, url)
    cache, ds, fn = _job(url, opts)
    for b, batch in enumerate(DataLoader(ds, batch_size=8, shuffle=False)):
        _check(batch, 8 * b)
    assert fn.calls == 0  # every item came from the snapshot (or from wrap()'s probes)
    st = cache.stats()
    assert st["snapshot_hits"] == N - 3 and st["snapshot_reads"] == N // 8 and st["snapshot_errors"] == 0
    assert st["items_mem"] == N
    cache.close()


def test_a_stopped_server_mid_run_is_misses_and_one_log_line(s3, caplog):
    opts, state, url = s3
    _export(opts, url)
    cache, ds, fn = _job(url, opts, timeout_s=3)
    loader = iter(DataLoader(ds, batch_size=8, shuffle=False))
    _check(next(loader), 0)  # read through S3
    assert fn.calls == 0
    state["server"].stop()
    state["running"] = False
    caplog.set_level(logging.WARNING, logger="shmcache")
    started = time.monotonic()
    for b, batch in enumerate(loader, start=1):  # the job goes on: the source computes the rest
        _check(batch, 8 * b)
    assert time.monotonic() - started < 30  # one timeout at most, then the breaker answers at once
    assert fn.calls == N - 8 - 2  # 24 and 47 were stored by wrap()
    st = cache.stats()
    assert st["snapshot_errors"] >= 1 and st["snapshot_hits"] == 8 - 1
    lines = [r.getMessage() for r in caplog.records if "snapshot tier" in r.getMessage()]
    assert len(lines) == 1 and ("cannot be read" in lines[0] or "did not answer" in lines[0]), lines
    cache.close()


def test_a_server_down_at_open_is_read_again_later(s3, caplog):
    opts, state, url = s3
    _export(opts, url)
    state["server"].stop()
    state["running"] = False
    caplog.set_level(logging.WARNING, logger="shmcache")
    cache, ds, fn = _job(url, opts, timeout_s=3)  # the job starts: the snapshot is only an accelerator
    assert ds[5][1] == "label 5" and fn.calls == 1
    assert len([r for r in caplog.records if "snapshot tier" in r.getMessage()]) == 1
    cache.close()


def test_a_segment_replaced_by_a_shorter_object_mid_run_costs_its_items_only(s3, caplog):
    import s3fs

    opts, _, url = s3
    _export(opts, url)
    cache, ds, fn = _job(url, opts)
    assert ds[1][1] == "label 1" and fn.calls == 0  # the indexes are loaded now
    fs = s3fs.S3FileSystem(**opts)
    seg = f"{url[len('s3://'):]}/seg-00001.shms"
    lost = len(fs.cat_file(seg)) // 2
    fs.pipe_file(seg, fs.cat_file(seg)[:lost])  # the same name, half the bytes
    caplog.set_level(logging.WARNING, logger="shmcache")
    for b, batch in enumerate(DataLoader(ds, batch_size=8, shuffle=False)):
        _check(batch, 8 * b)
    st = cache.stats()
    assert 0 < fn.calls < N // 2 and st["snapshot_errors"] == 1, st  # that segment's items only
    assert st["snapshot_hits"] == N - 3 - fn.calls  # item 1 included; wrap() stored 3
    lines = [r.getMessage() for r in caplog.records if "snapshot tier" in r.getMessage()]
    assert len(lines) == 1 and "seg-00001.shms" in lines[0] and "truncated" in lines[0], lines
    cache.close()


def test_wrap_none_over_s3_serves_the_snapshot_and_says_when_its_manifest_cannot_be_read(s3, caplog):
    """wrap(None) takes the length from the manifest: with the store up it serves every item with no
    source; with it down, an unnamed cache and a named one each say that the manifest cannot be
    read now (not that the cache records no length)."""
    from shmcache.errors import SnapshotError

    opts, state, url = s3
    _export(opts, url)
    cache = ShmDatasetCache(session="up", snapshot=url, snapshot_options={"storage_options": opts})
    ds = cache.wrap(None)
    assert len(ds) == N and [ds[i][1] for i in (0, N - 1)] == ["label 0", f"label {N - 1}"]
    name = cache.name
    cache.close()
    state["server"].stop()
    state["running"] = False
    caplog.set_level(logging.WARNING, logger="shmcache")
    options = {"storage_options": opts, "timeout_s": 1}
    with pytest.raises(SnapshotError, match="manifest.json cannot be read now"):
        ShmDatasetCache(session="down", snapshot=url, snapshot_options=options).wrap(None)
    named = ShmDatasetCache(session="down", name=name, snapshot=url, snapshot_options=options)
    with pytest.raises(SnapshotError, match="the manifest cannot be read now"):
        named.wrap(None)
    named.close()
