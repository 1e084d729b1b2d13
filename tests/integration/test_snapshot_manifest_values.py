"""A manifest is JSON from a stranger: JSON nested deeper than the parser recurses, or a count
written as 1e999 (a float infinity, which int() cannot take), escaped as a bare RecursionError or
OverflowError from `shmcache import` and from_snapshot. Both are a SnapshotError naming the file.
So is a manifest whose counts do not fit its files (forged), for an import and for the
read-through tier."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest
from test_snapshot import N, Source, _filled, _same

from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt


@pytest.fixture
def snap(tmp_path):
    cache, _ = _filled()
    cache.export(tmp_path / "snap")
    cache.close()
    return tmp_path / "snap"


@pytest.fixture
def snap_in_parts(tmp_path):
    """A snapshot of several data files (a forged count then names one of them)."""
    cache, _ = _filled()
    dest = tmp_path / "snap"
    cache.export(dest, segment_bytes=40_000)
    cache.close()
    return dest


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


def _forge(src, dest, change):
    shutil.copytree(src, dest)
    doc = json.loads((dest / fmt.MANIFEST).read_text())
    change(doc)
    (dest / fmt.MANIFEST).write_text(json.dumps(doc))
    return dest


def _items(n):
    def change(doc):  # a segment's count, and the total with it (so the sum still agrees)
        doc["items"] += n - doc["segments"][0]["items"]
        doc["segments"][0]["items"] = n
    return change


FORGERIES = {
    "items beyond the file": _items(10**12),
    "negative items": _items(-3),
    "a dataset length beyond 2**63": lambda d: d.update(length=2**70),
    "a negative dataset length": lambda d: d.update(length=-5),
    "a negative segment size": lambda d: d["segments"][0].update(size=-1),
}


@pytest.mark.parametrize("what", FORGERIES)
def test_a_manifest_whose_counts_do_not_fit_is_refused_naming_the_field(snap_in_parts, tmp_path, what):
    """The manifest's numbers were taken as they were: a dataset length of 2**70 was imported
    (then len() of wrap(None) raised a raw OverflowError), and a segment said to hold 10**12
    items made the read-through tier allocate 32 TB for its index (a MemoryError from every
    batch). Each number is now checked against what a segment of its size can hold."""
    bad = _forge(snap_in_parts, tmp_path / "bad", FORGERIES[what])
    with pytest.raises(SnapshotError) as err:
        fmt.Manifest.from_json((bad / fmt.MANIFEST).read_bytes(), str(bad / fmt.MANIFEST))
    text = str(err.value)
    assert str(bad / fmt.MANIFEST) in text and "export the snapshot again" in text, text
    with pytest.raises(SnapshotError):
        ShmDatasetCache.from_snapshot(bad, session="dst")


def test_the_tier_refuses_a_forged_manifest_at_once(snap_in_parts, tmp_path, caplog):
    """A snapshot= whose manifest does not fit its files is refused when the cache is made (a
    clear SnapshotError), rather than a MemoryError logged from the first batch."""
    caplog.set_level(logging.WARNING, "shmcache")
    snap = snap_in_parts
    bad = _forge(snap, tmp_path / "bad", _items(10**12))
    cache = ShmDatasetCache(session="rt", snapshot=str(bad))
    try:
        with pytest.raises(SnapshotError, match="items"):
            cache.wrap(Source())
    finally:
        cache.close()
    good = ShmDatasetCache(session="rt2", snapshot=str(snap))
    try:
        ds = good.wrap(Source())
        assert all(_same(ds[i], Source()[i]) for i in range(N))
        assert good.stats()["snapshot_hits"] > 0
    finally:
        good.close()
    assert "MemoryError" not in caplog.text
