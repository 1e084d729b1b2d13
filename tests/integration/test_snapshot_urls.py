"""Snapshots at URLs that go wrong: an S3 server that stopped answering (an import; a job reading
through at exit), S3 without credentials, and a password in a snapshot's URL, never shown."""

from __future__ import annotations

import logging
import os

import pytest
from test_snapshot import Source, _filled, _same

from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError

_BLACKHOLE_IMPORT = """
import sys, time
from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
opts = {"key": "k", "secret": "s", "client_kwargs": {"endpoint_url": sys.argv[1]}, "skip_instance_cache": True}
t0 = time.monotonic()
try:
    ShmDatasetCache.from_snapshot("s3://bucket/snap", session="dst", storage_options=opts, timeout_s=5)
except SnapshotError as exc:
    print(f"{time.monotonic() - t0:.1f} {exc}")
"""


@pytest.mark.slow
def test_an_import_from_an_s3_server_that_stopped_answering_fails_within_a_minute(tmp_path):
    """A SIGSTOPped S3 server, as the client sees it: a socket that accepts and never answers.
    `shmcache import` / from_snapshot must end with a clear SnapshotError, not wait minutes: it
    took ~408 s (botocore's 60 s read timeout x its retries x s3fs's 5 retries). Now each read of
    an import is bounded by timeout_s (60 s by default, 5 here), retries included."""
    import socket
    import subprocess
    import sys

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # never accepted: the kernel completes the handshakes, nothing answers
    env = dict(os.environ, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1")
    try:
        proc = subprocess.run([sys.executable, "-c", _BLACKHOLE_IMPORT,
                               f"http://127.0.0.1:{hole.getsockname()[1]}"],
                              capture_output=True, text=True, env=env, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("the import still waited after 60 s")
    finally:
        hole.close()
    assert proc.returncode == 0 and proc.stdout, proc.stderr[-2000:]
    assert "s3://bucket/snap" in proc.stdout and "did not answer within 5" in proc.stdout, proc.stdout


_TIER_JOB = """
import sys, time
import numpy as np
from shmcache import ShmDatasetCache

class D:
    def __len__(self):
        return 8
    def __getitem__(self, i):
        return np.full(4, i)

opts = {"timeout_s": 0.5, "storage_options": {"key": "k", "secret": "s", "skip_instance_cache": True,
                                               "client_kwargs": {"endpoint_url": sys.argv[1]}}}
cache = ShmDatasetCache(session="job", snapshot="s3://bucket/snap", snapshot_options=opts)
ds = cache.wrap(D())
assert [int(ds[i][0]) for i in range(8)] == list(range(8))
cache.close()
print("done", flush=True)
"""


def test_a_job_whose_s3_snapshot_stopped_answering_exits_at_once(tmp_path):
    """The read-through tier bounds a read by timeout_s, but the read went on in a
    ThreadPoolExecutor thread, which the interpreter joins at exit: a job whose S3 stopped
    answering trained on (misses) and then hung at exit for every retry s3fs makes (15 s with
    timeout_s=1; about a minute at the default 10 s). Its reads now run in daemon threads."""
    import socket
    import subprocess
    import sys
    import time

    hole = socket.socket()
    hole.bind(("127.0.0.1", 0))
    hole.listen(64)  # accepts (the kernel does), never answers: a SIGSTOPped server
    env = dict(os.environ, AWS_ACCESS_KEY_ID="k", AWS_SECRET_ACCESS_KEY="s", AWS_DEFAULT_REGION="us-east-1")
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", _TIER_JOB, f"http://127.0.0.1:{hole.getsockname()[1]}"],
                              capture_output=True, text=True, env=env, timeout=60)
    finally:
        hole.close()
    took = time.monotonic() - t0
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr[-2000:]
    assert "did not answer within 0.5 s" in proc.stderr
    assert took < 6, f"the job took {took:.1f} s, most of it waiting at exit for a stuck read"


def test_s3_without_credentials_is_a_snapshot_error_naming_the_url(monkeypatch):
    """The commonest S3 mistake, no credentials, reached the user as a raw
    botocore.exceptions.NoCredentialsError from both import and export: the location wrapped
    only OSError, and botocore's errors are not OSErrors."""
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    for var, value in {"AWS_SHARED_CREDENTIALS_FILE": "/nonexistent", "AWS_CONFIG_FILE": "/nonexistent",
                       "AWS_EC2_METADATA_DISABLED": "true", "AWS_DEFAULT_REGION": "us-east-1"}.items():
        monkeypatch.setenv(var, value)
    opts = {"client_kwargs": {"endpoint_url": "http://127.0.0.1:9"}, "skip_instance_cache": True}
    with pytest.raises(SnapshotError, match=r"s3://bucket/snap.*credentials.*access"):
        ShmDatasetCache.from_snapshot("s3://bucket/snap", session="dst", storage_options=opts)
    cache, _ = _filled(n=4)
    try:
        with pytest.raises(SnapshotError, match=r"s3://bucket/out.*credentials"):
            cache.export("s3://bucket/out", storage_options=opts)
    finally:
        cache.close()


SECRET = "Sup3rSecret-Tok3n"


def test_a_snapshot_urls_password_is_never_shown(tmp_path, caplog, capsys):
    """A snapshot behind HTTP basic auth or FTP carries its password in the URL
    (https://user:TOKEN@host/snap): the read-through tier showed it whole in its log lines,
    stats()['snapshot'], `shmcache stat` and its repr; an ftp:// URL whose server refused the
    connection raised a raw ConnectionRefusedError. The remote tier masks its URLs; now the
    snapshot's are masked the same way, and a URL that cannot be opened is a SnapshotError."""
    from shmcache.cli.main import main as cli

    caplog.set_level(logging.WARNING, "shmcache")
    url = f"http://reader:{SECRET}@127.0.0.1:9/snap"
    cache = ShmDatasetCache(session="sec", snapshot=url, snapshot_options={"timeout_s": 2})
    try:
        ds = cache.wrap(Source())
        assert all(_same(ds[i], Source()[i]) for i in range(4))
        st = cache.stats()
        assert st["snapshot"] == "http://reader:***@127.0.0.1:9/snap" and st["snapshot_errors"] >= 1
        shown = [repr(cache.store.behind), str(st)]
        cli(["stat", "sec"])
        shown.append(capsys.readouterr().out)
    finally:
        cache.close()
    shown.append(caplog.text)
    assert "cannot be read" in caplog.text
    for text in shown:
        assert SECRET not in text, text
    with pytest.raises(SnapshotError) as err:
        ShmDatasetCache.from_snapshot(f"ftp://reader:{SECRET}@127.0.0.1:9/snap", session="dst")
    assert SECRET not in str(err.value) and "ftp://reader:***@127.0.0.1:9/snap" in str(err.value)
