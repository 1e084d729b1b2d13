"""The training side end to end: real cache -> PrefetchRing -> sink_loop, and examples/train.py
under both launchers."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from shmcache import PrefetchRing, ShmDatasetCache, sink_loop

ROOT = Path(__file__).resolve().parents[2]


class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 103

    def __getitem__(self, i):
        return np.full((4, 5), i * i, dtype=np.int64), i


def test_ring_from_real_cache_cold_then_warm():
    cache = ShmDatasetCache(session="ring", size=16)
    ds = cache.wrap(Squares())
    key_batches = [list(range(lo, min(lo + 16, 103))) for lo in range(0, 103, 16)]  # short last batch
    with PrefetchRing.from_cache(ds, key_batches, depth=2) as ring:
        for _epoch in range(2):  # cold (computed through fn), then warm (gathered from memory)
            seen = []
            for x, y in ring:
                assert torch.equal(x, (y * y).view(-1, 1, 1).expand(-1, 4, 5))
                seen += y.tolist()
            assert seen == list(range(103))
    st = cache.stats()
    assert st["items_mem"] == 103
    assert st["misses"] == 100  # the three wrap() probed were stored already
    assert st["hits"] >= 103 + 3
    cache.close()


def test_sink_loop_over_ring_trains():
    torch.manual_seed(0)
    cache = ShmDatasetCache(session="ring", size=16)
    ds = cache.wrap(Squares())
    model = torch.nn.Linear(20, 1)
    opt = torch.optim.SGD(model.parameters(), lr=1e-9)

    def step(batch):
        x, y = batch
        loss = ((model(x.float().flatten(1)).squeeze(1) - y.float()) ** 2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss.detach()

    batches = [list(range(lo, lo + 10)) for lo in range(0, 100, 10)]
    with PrefetchRing.from_cache(ds, batches) as ring:
        results = sink_loop(step, ring, epochs=3, sink_size=4)
    assert [r.global_step for r in results] == [4, 8, 12]
    assert all(np.isfinite(r.loss) for r in results)
    cache.close()


def _run(cmd: list[str], timeout: int = 240, tmpdir: Path | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", **({"TMPDIR": str(tmpdir)} if tmpdir else {})}
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


TRAIN_ARGS = ["examples/train.py", "--photos", "64", "--digit-epochs", "4", "--batch-size", "32"]


def test_example_trains_under_the_launcher_with_one_shared_cache():
    pytest.importorskip("PIL")
    r = _run([sys.executable, "-m", "shmcache.launch", "--nproc", "2", "--session", "quick",
              "--destroy-session", *TRAIN_ARGS])
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "2 process(es)" in out
    assert "[photos] epoch  2" in out and "[digits] epoch  4" in out
    acc = float(out.split("test accuracy ")[1].split("%")[0])
    assert acc > 80.0, out
    # one cache per dataset for both ranks: each item stored once
    stat_rows = [line.split() for line in out.splitlines() if line.startswith("quick ")]
    items = {row[1].split("-")[0]: int(row[3]) for row in stat_rows}  # session, cache, dataset, items
    assert items["PhotoCrops"] == 64, out
    # 1500 training digits, plus the (up to 3) items wrap() reads to fingerprint the dataset
    assert 1500 <= items["Digits"] <= 1503, out


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_example_runs_unchanged_under_torchrun(tmp_path):
    pytest.importorskip("PIL")
    # torchrun keeps its logs in a folder of its own in $TMPDIR, and leaves it: the test's folder
    r = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
              *TRAIN_ARGS, "--tasks", "digits"], tmpdir=tmp_path)
    try:
        assert r.returncode == 0, r.stderr[-3000:]
        assert "test accuracy" in r.stdout
    finally:
        subprocess.run([sys.executable, "-m", "shmcache", "destroy", "--force", "default"],
                       capture_output=True)
