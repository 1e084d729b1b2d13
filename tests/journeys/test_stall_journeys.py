"""Input stall per rank (NOTE [stall counts]): training loops run as processes of their own, with
their own $RANK, and what `stats()` and `shmcache stat --json` say about their waits."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from _journey import env, run

LOOP = Path(__file__).with_name("_stall_loop.py")


def _loop(tmp_path: Path, mode: str, rank: int, source_s: float, step_s: float) -> dict:
    e = env()
    e["RANK"] = str(rank)
    return json.loads(run([LOOP, mode, source_s, step_s], tmp_path, e).splitlines()[-1])


def test_a_starved_rank_stalls_and_a_warm_rank_does_not(tmp_path):
    # rank 1 reads the cold cache from a slow source: 0.2 s per batch of 4, steps of no time
    cold = _loop(tmp_path, "timed", 1, 0.05, 0.0)
    starved = cold["ranks"]["1"]
    assert starved["stall_waits"] == 8
    assert starved["stall_share"] > 0.5, starved
    # rank 0 reads it warm, with steps of 50 ms: its wait is a gather of microseconds
    warm = _loop(tmp_path, "timed", 0, 0.05, 0.05)
    fed = warm["ranks"]["0"]
    assert fed["stall_waits"] == 8
    assert fed["stall_share"] < 0.2, fed
    assert warm["ranks"]["1"] == starved  # a rank's counts outlive its process
    assert warm["stall_waits"] == 16
    assert warm["stall_seconds"] == pytest.approx(starved["stall_seconds"] + fed["stall_seconds"])
    # the command line reads the same counts from the file
    listed = json.loads(run(["-m", "shmcache", "stat", "--json"], tmp_path, env()))
    (row,) = listed
    for key in ("stall_waits", "stall_seconds", "loop_seconds", "stall_share", "ranks"):
        assert row[key] == warm[key], key


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_each_loop_counts_its_waits(tmp_path):
    assert _loop(tmp_path, "timed", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 8
    assert _loop(tmp_path, "ring", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 16
    assert _loop(tmp_path, "ring_cache", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 24
    assert _loop(tmp_path, "sink", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 32
    plain = _loop(tmp_path, "plain", 0, 0.0, 0.0)  # a DataLoader loop not wrapped: not counted
    assert plain["ranks"]["0"]["stall_waits"] == 32
    assert plain["loop_seconds"] >= plain["stall_seconds"] > 0


def test_a_fresh_cache_has_no_ranks(tmp_path):
    code = ("import json; from shmcache import ShmDatasetCache; c = ShmDatasetCache(session='s', name='n', size=4); "
            "c.put(1, b'x'); print(json.dumps(c.stats())); c.close()")
    st = json.loads(run(["-c", code], tmp_path, env()).splitlines()[-1])
    assert (st["stall_waits"], st["stall_seconds"], st["stall_share"], st["ranks"]) == (0, 0.0, 0.0, {})


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_a_dropped_cache_made_again_starts_its_stall_counts_at_zero(tmp_path):
    assert _loop(tmp_path, "timed", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 8
    run(["-m", "shmcache", "destroy", "stall", "--cache", "data"], tmp_path, env())
    assert _loop(tmp_path, "timed", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 8


def test_a_cache_replaced_by_an_import_starts_its_stall_counts_at_zero(tmp_path):
    """`shmcache import --force` replaces a cache that holds another dataset (CacheStore.destroy,
    then a new cache under the name): as with `shmcache destroy --cache`, the new cache's stall
    counts start at 0, never with the waits of the loops that read the one replaced."""
    assert _loop(tmp_path, "timed", 0, 0.0, 0.0)["ranks"]["0"]["stall_waits"] == 8
    other = ("from shmcache import ShmDatasetCache; c = ShmDatasetCache(session='src', name='other', size=4); "
             "c.wrap(list(range(8)), fingerprint='other-v1'); [c.put(i, i) for i in range(8)]; c.close()")
    run(["-c", other], tmp_path, env())
    run(["-m", "shmcache", "export", "src", "other", tmp_path / "snap"], tmp_path, env())
    run(["-m", "shmcache", "import", tmp_path / "snap", "--session", "stall", "--name", "data", "--force"],
        tmp_path, env())
    (row,) = [r for r in json.loads(run(["-m", "shmcache", "stat", "--json"], tmp_path, env()))
              if (r["session"], r["name"]) == ("stall", "data")]
    assert (row["stall_waits"], row["ranks"]) == (0, {}), row


def test_a_process_that_counted_in_a_dropped_cache_counts_in_the_one_made_again(tmp_path):
    """One training script runs a loop, the cache is dropped (`shmcache destroy --cache`, its own
    process) and made again by the script's next ShmDatasetCache: the script's next loop counts its
    waits in the new cache's file, not in the dropped one's (unlinked, read by nobody)."""
    script = textwrap.dedent("""
        import json, subprocess, sys
        import torch
        from torch.utils.data import DataLoader
        import shmcache
        from shmcache import ShmDatasetCache

        def loop():
            c = ShmDatasetCache(session="stall", name="data", size=16)
            ds = c.wrap([torch.full((4,), float(i)) for i in range(32)], fingerprint="v1")
            for _ in shmcache.timed(DataLoader(ds, batch_size=4)):
                pass
            waits = c.stats()["stall_waits"]
            c.close()
            return waits

        first = loop()
        subprocess.run([sys.executable, "-m", "shmcache", "destroy", "stall", "--cache", "data"], check=True)
        print(json.dumps([first, loop()]))
    """)
    assert json.loads(run(["-c", script], tmp_path, env()).splitlines()[-1]) == [8, 8]
