"""A fuzz of hostile records through the real paths (issue 24, item 2): real records of a real
cache, mutated (_hostile_records.mutate: extension tags, metas, layouts, lengths, trailers), put
into an unsigned snapshot with their checksums recomputed, and read as users read - a snapshot
read-through (``ds[i]``, ``get_batch``, a DataLoader), an import then ``wrap(None)``. On main an
extension tag no handler has passed the layout check and raised EncodeError from ``ds[i]``,
``get_batch`` and the DataLoader on every read of that key, and an import stored it.

Asserted: no exception reaches the reader or the import; a value served is the source's or what
the record itself decodes to (an unsigned record is data from a stranger: one that decodes is
served as it says - the job's secret is what refuses those, test_snapshot_trust.py); every record
an import stored decodes. The Redis leg: tests/remote/test_remote_hostile_fuzz.py."""

from __future__ import annotations

import random

import pytest
import torch
import zstandard
from _hostile_records import equal, mutate
from test_snapshot import N, Source
from test_snapshot_hostile import _forge, real  # noqa: F401 - the fixture
from torch.utils.data import DataLoader

from shmcache import ShmDatasetCache
from shmcache.errors import ItemNotCached
from shmcache.snapshot.load import import_snapshot
from shmcache.tiers import records
from shmcache.tiers.tiered_store import decode_portable, portable_key

_UNSET = object()


def _own(rec: bytes):
    """What a record decodes to as a stranger's (checked first), or _UNSET when it is refused."""
    try:
        return decode_portable(bytearray(rec), trusted=False)
    except ValueError:  # PickleRefused is one: every refusal is a ValueError, nothing else
        return _UNSET


def _hostile_snapshot(made, dest, seed: int):
    """A snapshot like ``made`` (the ``real`` fixture) whose odd keys hold mutated records: (its
    path, {key: (kind, the record's own value)})."""
    _, manifest, recs = made
    rng = random.Random(seed)
    cctx = zstandard.ZstdCompressor()
    good, bad, own = [], [], {}
    for i in range(N):
        pkey = portable_key(i)
        if i % 2 == 0 or i == N - 1:  # (wrap() computes the last item itself: its fingerprint)
            good.append((pkey, recs[pkey]))
            continue
        kind, rec = mutate(recs[pkey], rng)
        own[i] = (kind, _own(rec))
        bad.append((pkey, records.pack_record(pkey, rec, cctx)))
    return _forge(dest, manifest, good, bad), own


def _served_right(i: int, value, own: dict, src) -> bool:
    return equal(value, src[i]) or (i in own and own[i][1] is not _UNSET and equal(value, own[i][1]))


def _read_through(made, tmp_path, seed: int) -> None:
    snap, own = _hostile_snapshot(made, tmp_path / f"snap{seed}", seed)
    src = Source()
    cache = ShmDatasetCache(session=f"rt{seed}", snapshot=snap)
    try:
        ds = cache.wrap(Source())
        first = [ds[i] for i in range(N)]  # a tier's read, then admitted
        wrong = [(i, own.get(i, ("good",))[0]) for i in range(N) if not _served_right(i, first[i], own, src)]
        assert not wrong, wrong
        again = [ds[i] for i in range(N)]  # from shared memory now: the same values
        changed = [(i, own.get(i, ("good",))[0], first[i], again[i]) for i in range(N) if not equal(first[i], again[i])]
        assert not changed, changed
        st = cache.stats()
        refused = sum(1 for _, v in own.values() if v is _UNSET)
        assert st["tier_undecodable"] + st["tier_pickle_refused"] + st["snapshot_corrupt"] >= refused, (st, refused)
    finally:
        cache.close()

    # the batch paths, each in a cache of its own (nothing admitted yet): only records that do not
    # decode are left hostile here, so every batch must be exactly the source's
    for how in ("get_batch", "DataLoader"):
        cache = ShmDatasetCache(session=f"{how.lower()}{seed}", snapshot=snap)
        try:
            ds = cache.wrap(Source())
            decodable = [i for i, (_, v) in own.items() if v is not _UNSET]
            keep = [i for i in range(N) if i not in decodable]
            if how == "get_batch":
                batches = [ds.get_batch(keep[j:j + 8]) for j in range(0, len(keep), 8)]
            else:
                batches = list(DataLoader(torch.utils.data.Subset(ds, keep), batch_size=8, shuffle=False))
            got_x = torch.cat([b[0] for b in batches])
            got_y = torch.cat([torch.as_tensor(b[1]) for b in batches])
            assert torch.equal(got_x, torch.stack([src[i][0] for i in keep])), how
            assert got_y.tolist() == keep, how
        finally:
            cache.close()


def _imported(made, tmp_path, seed: int) -> None:
    snap, own = _hostile_snapshot(made, tmp_path / f"imp{seed}", seed)
    report = import_snapshot(snap, session=f"imp{seed}")  # never raises for a hostile record
    src = Source()
    refused = {i for i, (_, v) in own.items() if v is _UNSET}
    cache = ShmDatasetCache(session=f"imp{seed}", name=report.name)
    try:
        for pkey, rec in cache.store.portable_records():  # whatever it stored decodes
            assert _own(bytes(rec)) is not _UNSET, pkey
        ds = cache.wrap(None)
        for i in range(N):
            try:
                value = ds[i]
            except ItemNotCached:
                assert i in refused, (i, own.get(i, ("good",))[0])
                continue
            assert i not in refused, (i, own[i][0])
            assert _served_right(i, value, own, src), (i, own.get(i, ("good",))[0])
        stored = sorted(set(range(N)) - refused)
        batch = ds.get_batch([i for i in stored if i % 2 == 0])
        assert torch.equal(batch[0], torch.stack([src[i][0] for i in stored if i % 2 == 0]))
        assert report.imported == len(stored), str(report)
    finally:
        cache.close()


SEEDS = [24]


@pytest.mark.parametrize("seed", SEEDS)
def test_hostile_records_through_a_snapshot_read_through_are_misses(real, tmp_path, seed):  # noqa: F811
    _read_through(real, tmp_path, seed)


@pytest.mark.parametrize("seed", SEEDS)
def test_hostile_records_through_an_import_are_never_stored_undecodable(real, tmp_path, seed):  # noqa: F811
    _imported(real, tmp_path, seed)


@pytest.mark.slow
def test_hostile_records_fuzz_many_seeds(real, tmp_path):  # noqa: F811
    for seed in range(100, 200):
        _read_through(real, tmp_path, seed)
        _imported(real, tmp_path, seed)
