"""A dataset that changes leaves its old cache in the session (issue 25, item 5): the wrap that
makes the new cache names the old one, its size and how to drop it; ``shmcache stat`` shows when
each cache was last opened; ``gc --cache-idle-for`` and ``destroy --cache`` drop old ones, never
one a live process has open (NOTE [cache use] in shmcache/cache/registry.py). As users run it:
two separate training scripts, then the CLI in a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from shmcache.cache.registry import SessionRegistry

# one training script: VERSION changes the dataset (as an edited label list would); it holds its
# cache open until its stdin closes, so the CLI meets a live process that has it open
TRAIN = """
import sys
import numpy as np
from shmcache import ShmDatasetCache

class Digits:
    version = VERSION
    def __len__(self):
        return 256
    def __getitem__(self, i):
        return np.full(4096, (i + self.version) % 256, dtype=np.uint8)

cache = ShmDatasetCache(session="journey")
ds = cache.wrap(Digits())
for i in range(len(ds)):
    ds[i]
print(cache.name, flush=True)
sys.stdin.readline()
cache.close()
"""

DAY = 86400


def train(version: int) -> subprocess.Popen:
    code = TRAIN.replace("VERSION", str(version))
    return subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def finish(proc: subprocess.Popen) -> str:
    _, err = proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, err[-3000:]
    return err


def cli(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "shmcache", *argv], capture_output=True, text=True, timeout=60)


def age(session: str, cache: str, seconds: float) -> None:
    path = SessionRegistry().cache_use_path(session, cache)
    t = time.time() - seconds
    os.utime(path, (t, t))


def test_a_changed_dataset_names_the_cache_it_leaves_and_gc_drops_it_by_age():
    first = train(1)
    old = first.stdout.readline().strip()
    err = finish(first)
    assert "earlier version" not in err, err  # the first cache of the dataset: nothing left behind
    second = train(2)
    try:
        new = second.stdout.readline().strip()  # the second script has its cache open from here
        assert new != old and new.startswith("Digits-") and old.startswith("Digits-")
        stat = cli("stat", "journey", "--json")
        assert stat.returncode == 0, stat.stderr
        rows = {r["name"]: r for r in json.loads(stat.stdout)}
        assert rows[new]["in_use"] and rows[new]["idle_s"] == 0 and rows[new]["last_opened"] is None
        assert not rows[old]["in_use"] and rows[old]["last_opened"] <= time.time()
        age("journey", old, 3 * DAY)
        age("journey", new, 30 * DAY)  # long ago too, but a live process has it open
        table = cli("stat", "journey")
        assert table.returncode == 0, table.stderr
        lines = {ln.split()[1]: ln for ln in table.stdout.splitlines()[2:]}
        assert "last opened" in table.stdout.splitlines()[0]
        assert lines[old].endswith("3d ago") and lines[new].endswith("in use"), table.stdout
        ls = cli("ls", "--json")
        assert ls.returncode == 0, ls.stderr
        idle = json.loads(ls.stdout)[0]["caches_idle_s"]
        assert idle[new] == 0 and 3 * DAY <= idle[old] < 3 * DAY + 600
        table = cli("ls")
        assert "oldest cache opened" in table.stdout and table.stdout.splitlines()[2].endswith("3d ago")
        gc = cli("gc", "--cache-idle-for", "1d", "--json")
        assert gc.returncode == 0, gc.stderr
        dropped = json.loads(gc.stdout)["dropped_idle_caches"]
        assert [d["cache"] for d in dropped] == [f"journey/{old}"]
        assert dropped[0]["idle_s"] >= 3 * DAY and dropped[0]["shm_bytes"] >= 256 * 4096
        assert SessionRegistry().cache_names("journey") == [new]
    finally:
        err = finish(second)
    said = [ln for ln in err.splitlines() if "earlier version" in ln]
    assert len(said) == 1, err
    assert f"journey/{new} is new" in said[0] and f"journey/{old}" in said[0]
    assert "MiB of shared memory" in said[0]
    assert f"`shmcache destroy journey --cache {old}`" in said[0]
    assert "`shmcache gc --cache-idle-for 1d`" in said[0]


def test_destroy_cache_drops_one_cache_and_refuses_one_that_is_open():
    first = train(1)
    old = first.stdout.readline().strip()
    finish(first)
    second = train(2)
    try:
        new = second.stdout.readline().strip()
        refused = cli("destroy", "journey", "--cache", new)
        assert refused.returncode == 1
        assert f"cache journey/{new} is open in a live process" in refused.stderr
        assert f"`shmcache destroy --force journey --cache {new}`" in refused.stderr
        done = cli("destroy", "journey", "--cache", old)
        assert done.returncode == 0, done.stderr
        assert f"destroyed cache journey/{old} (" in done.stdout and "of shared memory freed" in done.stdout
        assert SessionRegistry().cache_names("journey") == [new]
        missing = cli("destroy", "journey", "--cache", old)
        assert missing.returncode == 1 and f"no cache {old!r} in session 'journey'" in missing.stderr
    finally:
        finish(second)
