"""A dataset of file paths that reads lazily: one file edited after the cache was filled is served
stale (the fingerprint sees the paths, not the files); ``cache.verify_sample(ds, fraction=...)``
recomputes a sample and names the stale items (issue 25, item 6). As users run it: one script
fills the cache, the file is edited, another script verifies."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from shmcache import ShmDatasetCache
from shmcache.errors import CacheMismatch, InvalidArgument

N = 64

SCRIPT = """
import sys
import numpy as np
from shmcache import ShmDatasetCache
from shmcache.errors import CacheMismatch

class Files:
    def __init__(self, folder, n):
        self.paths = [f"{folder}/{i}.bin" for i in range(n)]
    def __len__(self):
        return len(self.paths)
    def __getitem__(self, i):
        with open(self.paths[i], "rb") as f:
            return np.frombuffer(f.read(), np.uint8).copy()

cache = ShmDatasetCache(session="files")
ds = cache.wrap(Files(sys.argv[1], N))
if sys.argv[2] == "fill":
    cache.warmup(ds, progress=False)
    print("filled", cache.name)
else:
    print("served", int(ds[EDITED][0]))  # what training reads: the cached copy
    try:
        cache.verify_sample(ds, fraction=1.0, progress=True)
    except CacheMismatch as exc:
        print("MISMATCH", exc)
    report = cache.verify_sample(ds, fraction=1.0, progress=False, raise_on_stale=False)
    print("REPORT", report.ok, report.checked, report.stale)
cache.close()
""".replace("N)", f"{N})")

EDITED = 37


def run(folder, step):
    code = SCRIPT.replace("EDITED", str(EDITED))
    proc = subprocess.run([sys.executable, "-c", code, str(folder), step], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, proc.stderr


def test_verify_names_the_item_whose_file_was_edited(tmp_path):
    for i in range(N):
        (tmp_path / f"{i}.bin").write_bytes(bytes([i % 256]) * 512)
    out, _ = run(tmp_path, "fill")
    assert out.startswith("filled")
    (tmp_path / f"{EDITED}.bin").write_bytes(bytes([200]) * 512)  # edited in place: same path, same size
    out, err = run(tmp_path, "check")
    lines = {ln.split()[0]: ln for ln in out.splitlines()}
    assert lines["served"] == f"served {EDITED}"  # stale: the fingerprint cannot see the file
    assert f"1 of {N} recomputed items differ from their cached copies" in lines["MISMATCH"]
    assert f"items {EDITED})" in lines["MISMATCH"] and "cache.clear()" in lines["MISMATCH"]
    assert "--cache" in lines["MISMATCH"]
    assert lines["REPORT"] == f"REPORT False {N} [{EDITED}]"
    assert "verify " in err  # the progress bar, on stderr


class Squares:
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return np.array([i * i], np.int64)


def test_verify_checks_the_fraction_asked_of_the_cached_items():
    cache = ShmDatasetCache(session="v")
    try:
        ds = cache.wrap(Squares())
        for i in range(500):
            ds[i]
        report = cache.verify_sample(ds, fraction=0.1, seed=1, progress=False)
        # wrap() cached its probes too: items 0, 500 and 999
        assert report.ok and report.cached == 502 and report.checked == 51  # 10%, rounded up
        assert "51 of 502 cached items recomputed, all equal" in str(report)
        assert cache.verify_sample(Squares(), fraction=0.001, progress=False).checked == 1  # at least one
        for bad in (0, 1.5, -0.1, True, "1%"):
            with pytest.raises(InvalidArgument, match="fraction="):
                cache.verify_sample(ds, fraction=bad)
    finally:
        cache.close()


def test_verify_on_an_unchanged_dataset_passes_and_a_changed_one_raises():
    class Shifted(Squares):
        def __getitem__(self, i):
            return np.array([i * i + (i == 7)], np.int64)

    cache = ShmDatasetCache(session="v", name="squares")
    try:
        ds = cache.wrap(Squares())
        cache.warmup(ds, progress=False)
        assert cache.verify_sample(ds, fraction=1.0, progress=False).ok
        with pytest.raises(CacheMismatch, match=r"1 of 1000 recomputed items differ .*items 7\)"):
            ds.dataset = Shifted()  # what an edited file does to a lazily reading dataset
            cache.verify_sample(ds, fraction=1.0, progress=False)
    finally:
        cache.close()
