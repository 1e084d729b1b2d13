"""A manifest is JSON from a stranger: JSON nested deeper than the parser recurses, or a count
written as 1e999 (a float infinity, which int() cannot take), escaped as a bare RecursionError or
OverflowError from `shmcache import` and from_snapshot. Both are a SnapshotError naming the file."""

from __future__ import annotations

import json
import os

import pytest
from test_snapshot import _filled

from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt


@pytest.fixture
def snap(tmp_path):
    cache, _ = _filled()
    cache.export(tmp_path / "snap")
    cache.close()
    return tmp_path / "snap"


def _edit(snap, change) -> None:
    doc = json.loads((snap / fmt.MANIFEST).read_text())
    text = change(doc)
    (snap / fmt.MANIFEST).write_text(text)


@pytest.mark.parametrize("how", ["nested", "inf-items", "inf-size"])
def test_a_hostile_manifest_value_is_a_snapshot_error(snap, how):
    if how == "nested":
        _edit(snap, lambda doc: json.dumps(doc)[:-1] + ', "x": ' + "[" * 100_000 + "]" * 100_000 + "}")
    elif how == "inf-items":
        _edit(snap, lambda doc: json.dumps({**doc, "items": 7}).replace('"items": 7', '"items": 1e999'))
    else:
        _edit(snap, lambda doc: json.dumps(doc).replace('"size": ', '"size": 1e999, "_": ', 1))
    with pytest.raises(SnapshotError, match=os.fspath(snap / fmt.MANIFEST).replace("/", ".")):
        ShmDatasetCache.from_snapshot(snap, session="dst")


def test_a_manifest_mac_with_non_ascii_characters_is_refused_as_forged(snap, monkeypatch):
    """hmac.compare_digest raises TypeError for a str with non-ASCII characters: a manifest whose
    "mac" tag held one escaped from import and from_snapshot under a secret as a bare TypeError."""
    monkeypatch.setenv("SHMCACHE_SECRET", "a-job-secret-0123")
    _edit(snap, lambda doc: json.dumps({**doc, "mac": {"alg": "hmac-sha256", "tag": "\u00e9" * 64}}))
    with pytest.raises(SnapshotError, match="signed with another secret, or was changed"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


@pytest.mark.parametrize("fp", [{"a": 1}, ["x"], 12, True, "../../x", "f" * 100_000])
def test_a_fingerprint_that_is_not_a_digest_is_refused(snap, fp):
    """The manifest's fingerprint becomes the cache's identity (its meta, the remote tier's key
    prefix: ``fingerprint[:32]``): any JSON value was taken, a dict then failed with TypeError
    when a remote was attached, a 100 KB string filled every message."""
    _edit(snap, lambda doc: json.dumps({**doc, "cache": {**doc["cache"], "fingerprint": fp}}))
    with pytest.raises(SnapshotError, match="fingerprint is .*not a hex digest"):
        ShmDatasetCache.from_snapshot(snap, session="dst")


@pytest.mark.parametrize("field", ["format", "version"])
def test_a_refused_manifest_quotes_its_values_short(snap, field):
    """A manifest of another format or version was quoted whole in the error: a 10 MB "version"
    made a 10 MB message."""
    _edit(snap, lambda doc: json.dumps({**doc, field: "v" * 10_000_000}))
    with pytest.raises(SnapshotError) as err:
        ShmDatasetCache.from_snapshot(snap, session="dst")
    assert len(str(err.value)) < 1000
