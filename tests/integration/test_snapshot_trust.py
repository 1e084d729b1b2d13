"""Issue 16, snapshots: a snapshot someone hands you is input from a stranger. A planted pickle runs
nothing - not at import, not at a wrap(None) read, not through the read-through; with the job's
secret a snapshot signed with it is trusted (pickled objects included), a changed record is a
counted miss, an unsigned one needs --allow-unsigned, and a forged manifest is refused. Real
caches, real snapshot files, the CLI in-process."""

from __future__ import annotations

import json
import logging
import shutil

import numpy as np
import pytest
import torch
from _planted import Evil, Thing

from shmcache import ShmDatasetCache
from shmcache.cli.main import main as cli
from shmcache.errors import ItemNotCached, SnapshotError
from shmcache.snapshot.load import import_snapshot

N = 16
EVIL = 7  # the key whose value holds the planted (or the job's own) pickled object
SECRET = "job-secret-5e1d"
pytestmark = pytest.mark.filterwarnings("ignore:.*stored with pickle:UserWarning")




def _value(i):
    return {"a": np.full(64, i, np.int32), "i": i}


def _export(dest, obj, secret=None):
    """A named cache of N items, key EVIL holding ``obj``, exported to ``dest``."""
    cache = ShmDatasetCache(session="src", name="c", **({} if secret is None else {"secret": secret}))
    for i in range(N):
        cache.put(i, {"obj": obj, "i": i} if i == EVIL else _value(i))
    report = cache.export(dest)
    cache.clear()
    cache.close()
    assert report.items == N
    return dest


def test_a_planted_pickle_runs_nothing_at_import_read_or_read_through(tmp_path, caplog):
    """The import decoded the first record of each layout (the planted one ran at `shmcache
    import`), and every wrap(None) or read-through read unpickled it again."""
    caplog.set_level(logging.WARNING, "shmcache")
    marker = tmp_path / "ran"
    snap = _export(tmp_path / "snap", Evil(marker))
    report = import_snapshot(snap, session="dst")
    assert not marker.exists(), "the planted pickle ran at import"
    assert (report.imported, report.pickled, report.items) == (N - 1, 1, N)
    assert "allow_pickle=True" in str(report) and "--allow-pickle" in str(report)

    cache = ShmDatasetCache.from_snapshot(snap, session="dst2")
    ds = cache.wrap(None)
    assert ds[3]["i"] == 3
    with pytest.raises(ItemNotCached):
        ds[EVIL]
    assert not marker.exists()
    cache.close()

    rt = ShmDatasetCache(session="rt", name="c", snapshot=snap)
    assert rt.get(3)["i"] == 3  # read through
    assert rt.get(EVIL, lambda k: "from the source") == "from the source"
    assert not marker.exists(), "the planted pickle ran through the read-through"
    assert rt.stats()["tier_pickle_refused"] == 1
    assert "allow_pickle=True" in "\n".join(r.getMessage() for r in caplog.records)
    rt.close()


def test_the_import_cli_takes_allow_pickle(tmp_path, capsys):
    snap = _export(tmp_path / "snap", Thing(7))
    assert cli(["import", str(snap), "--session", "dst"]) == 1  # not every item: says why
    assert "--allow-pickle" in capsys.readouterr().out
    assert cli(["import", str(snap), "--session", "dst2", "--allow-pickle"]) == 0
    cache = ShmDatasetCache(session="dst2", name="c")
    assert cache.get(EVIL)["obj"] == Thing(7)
    cache.close()
    rt = ShmDatasetCache(session="rt", name="c", snapshot=snap, allow_pickle=True)
    assert rt.get(EVIL)["obj"] == Thing(7)
    rt.close()
    cache = ShmDatasetCache.from_snapshot(snap, session="dst3", allow_pickle=True)
    assert cache.last_import.complete and cache.wrap(None)[EVIL]["obj"] == Thing(7)
    cache.close()


def test_a_signed_snapshot_is_trusted_and_an_unsigned_one_needs_the_flag(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SHMCACHE_SECRET", SECRET)
    signed = _export(tmp_path / "signed", Thing(7))
    assert json.loads((signed / "manifest.json").read_text())["mac"]["alg"] == "hmac-sha256"
    report = import_snapshot(signed, session="dst")  # the job's own values: pickled ones too
    assert report.complete and report.forged == report.pickled == 0
    cache = ShmDatasetCache(session="dst", name="c")
    assert cache.get(EVIL)["obj"] == Thing(7)
    cache.close()
    rt = ShmDatasetCache(session="rt", name="c", snapshot=signed)
    assert rt.get(EVIL)["obj"] == Thing(7) and rt.stats()["snapshot_forged"] == 0
    rt.close()

    unsigned = _export(tmp_path / "unsigned", Thing(7), secret="")
    assert "mac" not in json.loads((unsigned / "manifest.json").read_text())
    with pytest.raises(SnapshotError, match="is not signed.*allow_unsigned=True"):
        import_snapshot(unsigned, session="dst3")
    with pytest.raises(SnapshotError, match="allow_unsigned"):
        ShmDatasetCache(session="rt2", name="c", snapshot=unsigned)
    with pytest.raises(SnapshotError, match="allow_unsigned"):
        ShmDatasetCache.from_snapshot(unsigned, session="dst4")
    assert cli(["import", str(unsigned), "--session", "dst5"]) == 1
    assert "--allow-unsigned" in capsys.readouterr().err
    assert cli(["import", str(unsigned), "--session", "dst5", "--allow-unsigned"]) == 1  # the pickle: no
    assert cli(["import", str(unsigned), "--session", "dst6", "--allow-unsigned", "--allow-pickle"]) == 0
    rt = ShmDatasetCache(session="rt3", name="c", snapshot=unsigned, snapshot_options={"allow_unsigned": True})
    assert rt.get(3)["i"] == 3 and rt.get(EVIL, lambda k: "computed") == "computed"
    rt.close()
    # a snapshot signed with another secret is no better than an unsigned one
    monkeypatch.setenv("SHMCACHE_SECRET", "another-job")
    with pytest.raises(SnapshotError, match="another secret"):
        import_snapshot(signed, session="dst7")


def _records(seg):
    """(offset, length) of every record of a segment file, from its index."""
    from shmcache.snapshot import format as fmt

    data = seg.read_bytes()
    footer = fmt.parse_footer(data[-fmt.FOOTER_BYTES:], len(data), str(seg))
    index = fmt.parse_index(data[footer.index_offset:footer.index_offset + footer.index_bytes], footer, str(seg))
    return sorted(zip(index["offset"].tolist(), index["length"].tolist()))


def test_a_changed_record_of_a_signed_snapshot_is_a_counted_miss(tmp_path, monkeypatch, capsys):
    """The index and manifest bind each record's header; its bytes after that are bound by its
    MAC: one changed byte is a forged record, skipped by the import and a miss of the read-through."""
    monkeypatch.setenv("SHMCACHE_SECRET", SECRET)
    snap = _export(tmp_path / "snap", Thing(7))
    seg = snap / "seg-00000.shms"
    offset, length = _records(seg)[0]
    data = bytearray(seg.read_bytes())
    data[offset + length - 41] ^= 0xFF  # the record's last byte before its MAC trailer
    seg.write_bytes(bytes(data))
    report = import_snapshot(snap, session="dst")
    assert (report.imported, report.forged) == (N - 1, 1) and "MAC" in str(report)
    rt = ShmDatasetCache(session="rt", name="c", snapshot=snap)
    got = [rt.get(i, lambda k: "computed") for i in range(N)]
    assert got.count("computed") == 1 and rt.stats()["snapshot_forged"] == 1
    rt.close()
    capsys.readouterr()
    assert cli(["stat", "rt", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["snapshot_forged"] == 1
    assert cli(["stat", "rt"]) == 0
    assert "snap forged" in capsys.readouterr().out


class Source(torch.utils.data.Dataset):
    def __init__(self, seed):
        self.seed = seed

    def __len__(self):
        return 32

    def __getitem__(self, i):
        return torch.full((16,), self.seed * 1000 + i, dtype=torch.int32)


def test_a_forged_manifest_over_another_datasets_segments_is_refused(tmp_path, monkeypatch):
    """Anyone can rewrite a manifest to name another dataset over these segments (their sha256
    recomputed): served 64/64 wrong values. With a secret the manifest is signed, and a changed
    one - or one with its MAC removed - is refused."""
    monkeypatch.setenv("SHMCACHE_SECRET", SECRET)
    for seed in (0, 1):
        cache = ShmDatasetCache(session=f"s{seed}")
        ds = cache.wrap(Source(seed))
        for i in range(32):
            ds[i]
        cache.export(tmp_path / f"snap{seed}")
        cache.close()
    theirs = json.loads((tmp_path / "snap1" / "manifest.json").read_text())
    forged = tmp_path / "forged"
    shutil.copytree(tmp_path / "snap0", forged)
    doc = json.loads((forged / "manifest.json").read_text())
    doc["cache"] = theirs["cache"]  # dataset 1's name and fingerprint over dataset 0's segments
    (forged / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(SnapshotError, match="another secret, or was changed"):
        import_snapshot(forged, session="victim")
    del doc["mac"]
    (forged / "manifest.json").write_text(json.dumps(doc))
    with pytest.raises(SnapshotError, match="is not signed"):
        import_snapshot(forged, session="victim")
    # the real one of dataset 1 is welcome, and serves dataset 1
    cache = ShmDatasetCache(session="victim")
    ds = cache.wrap(Source(1))
    cache.close()
    del ds
    report = import_snapshot(tmp_path / "snap1", session="victim", name=theirs["cache"]["name"])
    assert report.complete
