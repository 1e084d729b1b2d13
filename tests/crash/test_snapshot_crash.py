"""Snapshots under SIGKILL (issue 12): an export killed after some segments or before its manifest's
rename leaves nothing that looks whole (import refuses it, naming why; a new export needs
--overwrite and then works), and an import killed between two blocks leaves a cache that a second
import completes with every value right and nothing for gc to repair."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest

from shmcache import ShmDatasetCache
from shmcache.errors import SnapshotError
from shmcache.snapshot import format as fmt

SCRIPT = r"""
import sys
import numpy as np
from shmcache import ShmDatasetCache
what, dest = sys.argv[1], sys.argv[2]
if what == "export":
    cache = ShmDatasetCache(session="crash", name="noise")
    for i in range(64):
        cache.put(i, np.random.default_rng(i).integers(0, 256, 100_000, dtype=np.uint8))
    cache._source_len = 64
    cache.export(dest, segment_bytes=1 << 20)
else:
    ShmDatasetCache.from_snapshot(dest, session="crash2", name="copy")
"""


def _value(i):
    return np.random.default_rng(i).integers(0, 256, 100_000, dtype=np.uint8)


def _run(tmp_path, what, dest, crash_at=None):
    script = tmp_path / "scenario.py"
    script.write_text(SCRIPT)
    env = dict(os.environ)
    if crash_at:
        env["SHMCACHE_CRASH_AT"] = crash_at
    proc = subprocess.run([sys.executable, str(script), what, str(dest)], env=env, capture_output=True,
                          text=True, timeout=100)
    return proc


@pytest.mark.parametrize("point", ["snapshot_segment", "snapshot_manifest"])
def test_an_export_killed_half_way_never_looks_whole(tmp_path, point):
    dest = tmp_path / "snap"
    proc = _run(tmp_path, "export", dest, point)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    names = os.listdir(dest)
    assert fmt.MANIFEST not in names and names  # segments (or the manifest's .tmp), no manifest
    with pytest.raises(SnapshotError, match="did not finish.*export it again"):
        ShmDatasetCache.from_snapshot(dest, session="dst")
    cache = ShmDatasetCache(session="crash", name="noise")
    cache._source_len = 64
    with pytest.raises(SnapshotError, match="--overwrite"):  # what is there is not taken over
        cache.export(dest)
    report = cache.export(dest, overwrite=True, segment_bytes=1 << 20)
    cache.close()
    assert report.items == 64 and not [n for n in os.listdir(dest) if n.endswith(".tmp")]
    got = ShmDatasetCache.from_snapshot(dest, session="dst")
    assert got.last_import.complete and np.array_equal(got.wrap(None)[63], _value(63))
    got.close()


def test_an_import_killed_between_blocks_is_completed_by_the_next(tmp_path):
    dest = tmp_path / "snap"
    cache = ShmDatasetCache(session="crash", name="noise")
    for i in range(64):
        cache.put(i, _value(i))
    cache._source_len = 64
    cache.export(dest)
    cache.close()
    proc = _run(tmp_path, "import", dest, "snapshot_block")  # 6.4 MB: more than one 4 MiB block
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    partial = ShmDatasetCache(session="crash2", name="copy")
    held = len(partial)
    assert 0 < held < 64
    partial.close()
    got = ShmDatasetCache.from_snapshot(dest, session="crash2", name="copy")
    assert got.last_import.complete and len(got) == 64
    ds = got.wrap(None)
    assert all(np.array_equal(ds[i], _value(i)) for i in range(64))
    got.close()
    from shmcache.cli.main import main as cli

    assert cli(["gc"]) == 0
