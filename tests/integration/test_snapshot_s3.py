"""Snapshots on S3 for real: s3fs against moto's standalone S3 server on 127.0.0.1 (as s3fs's
own test suite does), started by a fixture; export, import, overwrite, a missing segment, and the
CLI configured the way users configure S3 (AWS_* environment variables)."""

from __future__ import annotations

import moto.server as server_mod  # the test extra installs s3fs and moto[server]: never skipped
import pytest
import s3fs
import torch

from shmcache import ShmDatasetCache
from shmcache.cli.main import main as cli
from shmcache.errors import SnapshotError

BUCKET = "snapshots"


class Source(torch.utils.data.Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        return torch.arange(i, i + 500, dtype=torch.int32), f"label {i}"


@pytest.fixture(scope="module")
def s3_endpoint():
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    yield f"http://{host}:{port}"
    server.stop()


@pytest.fixture
def s3(s3_endpoint, monkeypatch):
    """AWS_* variables pointing at the local server, a fresh bucket, and storage_options."""
    for var, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                       "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": s3_endpoint}.items():
        monkeypatch.setenv(var, value)
    opts = {"key": "testing", "secret": "testing", "client_kwargs": {"endpoint_url": s3_endpoint},
            "skip_instance_cache": True}
    fs = s3fs.S3FileSystem(**opts)
    if fs.exists(BUCKET):
        fs.rm(BUCKET, recursive=True)
    fs.mkdir(BUCKET)
    yield fs, opts
    fs.rm(BUCKET, recursive=True)


def _filled(session="src"):
    cache = ShmDatasetCache(session=session)
    ds = cache.wrap(Source())
    for i in range(len(ds)):
        ds[i]
    return cache


def test_export_to_s3_and_import_from_it(s3):
    fs, opts = s3
    cache = _filled()
    report = cache.export(f"s3://{BUCKET}/run1", segment_bytes=20_000, storage_options=opts)
    assert report.segments >= 2
    names = {p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/run1", refresh=True)}
    assert {"manifest.json", "seg-00000.shms", "seg-00001.shms"} <= names
    assert not [n for n in names if n.endswith(".tmp")]
    with pytest.raises(SnapshotError, match="already holds a snapshot"):
        cache.export(f"s3://{BUCKET}/run1", storage_options=opts)
    cache.close()
    got = ShmDatasetCache.from_snapshot(f"s3://{BUCKET}/run1", session="dst", storage_options=opts)
    assert got.last_import.complete
    ds = got.wrap(None)
    assert len(ds) == 40 and all(torch.equal(ds[i][0], Source()[i][0]) and ds[i][1] == f"label {i}"
                                 for i in range(40))
    got.close()


def test_a_missing_segment_on_s3_is_refused_naming_it(s3):
    fs, opts = s3
    cache = _filled()
    cache.export(f"s3://{BUCKET}/run2", segment_bytes=20_000, storage_options=opts)
    cache.close()
    fs.rm(f"{BUCKET}/run2/seg-00001.shms")
    with pytest.raises(SnapshotError, match="seg-00001.shms is missing"):
        ShmDatasetCache.from_snapshot(f"s3://{BUCKET}/run2", session="dst", storage_options=opts)


def test_the_cli_reads_s3_settings_from_the_environment(s3, capsys):
    cache = _filled(session="clis3")
    cache.close()
    assert cli(["export", "clis3", f"s3://{BUCKET}/cli"]) == 0, capsys.readouterr().err
    assert cli(["export", "clis3", f"s3://{BUCKET}/cli", "--overwrite"]) == 0, capsys.readouterr().err
    assert cli(["import", f"s3://{BUCKET}/cli", "--session", "clis3dst", "--name", "c"]) == 0, \
        capsys.readouterr().err
    got = ShmDatasetCache(session="clis3dst", name="c")
    assert got.wrap(None)[39][1] == "label 39"
    got.close()
