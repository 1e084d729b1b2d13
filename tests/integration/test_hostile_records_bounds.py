"""Bounds that fit the data (issue 24, item 5): a value from a source whose records are not
authenticated may decode to at most ``$SHMCACHE_MAX_ITEM_MB`` (256 MiB by default), not the
cache's cap (80% of RAM by default): three honest 1 GiB zstd bombs (32 KB frames each) in one
batch took 3.3 GiB and were counted ``tier_undecodable``; now each is refused before a byte is
allocated, counted ``snapshot_corrupt`` as the README says. Real frames, memory measured in a
subprocess (ru_maxrss)."""

from __future__ import annotations

import pytest
from test_snapshot import Source, _same
from test_snapshot_hostile import GiB, _forge, _measured, _record, _zeros_frame, real  # noqa: F401

from shmcache import ShmDatasetCache
from shmcache.tiers.tiered_store import portable_key


def _three_bombs(made, tmp_path):
    _, manifest, recs = made
    bombed = [1, 2, 3]
    good = [(k, r) for k, r in recs.items() if k not in {portable_key(i) for i in bombed}]
    bad = [(portable_key(i), _record(portable_key(i), _zeros_frame(GiB, True), GiB)) for i in bombed]
    return _forge(tmp_path / "bombs", manifest, good, bad)


def test_three_bombs_in_one_batch_of_a_default_cache_cost_no_gib(real, tmp_path):  # noqa: F811
    snap = _three_bombs(real, tmp_path)
    out = _measured("""
        import sys
        import torch
        from shmcache import ShmDatasetCache
        from test_snapshot import Source
        cache = ShmDatasetCache(session="rt", snapshot=sys.argv[1])  # the default cap: 80% of RAM
        ds = cache.wrap(Source())
        src = Source()
    """, """
        batch = ds.get_batch([1, 2, 3, 4])
        st = cache.stats()
        out = {"right": torch.equal(batch[0], torch.stack([src[i][0] for i in (1, 2, 3, 4)])),
               "corrupt": st["snapshot_corrupt"], "undecodable": st["tier_undecodable"]}
        cache.close()
    """, snap)
    assert out["right"] and out["corrupt"] == 3 and out["undecodable"] == 0, out
    assert out["grew_mib"] < 512, out


@pytest.mark.parametrize("max_mb,counted", [("1", "snapshot_corrupt"), ("3", "tier_undecodable")])
def test_max_item_mb_is_the_bound(real, tmp_path, monkeypatch, max_mb, counted):  # noqa: F811
    """The bound is a setting: a record of 2 MiB (of zeros: no record of this cache) is refused
    unread under 1 MiB (corrupt), and read, then refused by the layout check, under 3 MiB."""
    _, manifest, recs = real
    bad = [(portable_key(1), _record(portable_key(1), _zeros_frame(2 << 20, True), 2 << 20))]
    snap = _forge(tmp_path / "two", manifest, [(k, r) for k, r in recs.items() if k != portable_key(1)], bad)
    monkeypatch.setenv("SHMCACHE_MAX_ITEM_MB", max_mb)
    cache = ShmDatasetCache(session="rt", snapshot=snap)
    try:
        ds = cache.wrap(Source())
        assert _same(ds[1], Source()[1])
        st = cache.stats()
        assert st[counted] == 1 and st["snapshot_corrupt"] + st["tier_undecodable"] == 1, st
    finally:
        cache.close()
