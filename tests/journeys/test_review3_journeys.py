"""What a third review of the day's changes broke: the cache's lock (FlockLock) under a signal
handler or another thread that closes the cache while a put holds the lock, and who counts as one
job for a warning said once per job (Admission.first_to_say).

Every process runs in the test's ``$SHMCACHE_DIR`` (the conftest's), which the conftest empties."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from _journey import env

# a training script's preemption handler (SLURM, Kubernetes send SIGTERM first): close the cache,
# exit 0. The SIGTERM lands while a miss is stored under the cache's lock (sent from the put's
# refresh, under the lock, so that the test does not depend on timing).
SIGTERM_SCRIPT = textwrap.dedent("""\
    import os, signal, sys
    import numpy as np
    from shmcache import ShmDatasetCache
    from shmcache.cache import view

    cache = ShmDatasetCache(session="preempted", lock_timeout_s=2)
    armed = False
    refresh = view.CacheView.refresh


    def refresh_then_sigterm(self, *args, **kwargs):
        global armed
        if armed and cache.opened.lock._holds:
            armed = False
            os.kill(os.getpid(), signal.SIGTERM)
        return refresh(self, *args, **kwargs)


    view.CacheView.refresh = refresh_then_sigterm


    def on_sigterm(signum, frame):
        cache.close()
        print("closed", file=sys.stderr, flush=True)
        sys.exit(0)


    signal.signal(signal.SIGTERM, on_sigterm)


    class Rows:
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return np.full(64, i, np.float32)


    ds = cache.wrap(Rows(), fingerprint="rows-v1")  # a fingerprint: wrap() reads no sample
    armed = True
    ds[5]  # a miss: stored under the cache's lock - SIGTERM
    raise SystemExit("the SIGTERM was never sent")
""")


def test_a_sigterm_handler_that_closes_the_cache_mid_put_exits_cleanly(tmp_path):
    """A preemption handler that closes the cache and calls sys.exit(0), reached while a put held
    the cache's lock: close() closed the lock's descriptor under the hold (the file lock went with
    it, mid-write), and the put's release then unlocked descriptor -1: the job ended with status 1
    and "ValueError: file descriptor cannot be a negative integer (-1)" in place of its exit(0)."""
    (tmp_path / "train.py").write_text(SIGTERM_SCRIPT)
    done = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert "closed" in done.stderr, done.stderr
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr


# DDP without a launcher, as PyTorch's DDP tutorial starts it: torch.multiprocessing.spawn of the
# ranks, each with a DataLoader worker over its half of the samples (a DistributedSampler's split).
# Rank 1 starts reading once rank 0's worker has said the notice (no race of two first sayers: the
# root word is a hint, not a lock).
MP_SPAWN_SCRIPT = textwrap.dedent("""\
    import sys, time
    import torch.multiprocessing as mp
    from torch.utils.data import DataLoader
    from shmcache import ShmDatasetCache


    def rank_main(rank, world):
        cache = ShmDatasetCache(session="notes", name="sets")
        ds = cache.wrap([{i, i + 1} for i in range(40)], fingerprint="sets-v1")  # wrap() reads no sample
        time.sleep(1.5 * rank)
        for _ in DataLoader(ds, batch_size=4, num_workers=1, collate_fn=list, sampler=range(rank, 40, world)):
            pass
        cache.close()


    if __name__ == "__main__":
        mp.spawn(rank_main, args=(2,), nprocs=2)
""")


@pytest.mark.slow  # two spawned ranks importing torch, each with a worker: ~6 s
def test_the_workers_of_ranks_started_by_torch_multiprocessing_spawn_are_one_job(tmp_path):
    """The job of a DataLoader worker was its multiprocessing parent - the rank, when the ranks were
    started by torch.multiprocessing.spawn (PyTorch's DDP tutorial) rather than torchrun - so every
    rank's workers said the pickled-sample warning once more: once per rank, where the process
    group of the day before said it once."""
    (tmp_path / "ddp.py").write_text(MP_SPAWN_SCRIPT)
    e = env()
    e.pop("TORCHELASTIC_RUN_ID", None)
    e["TMPDIR"] = str(tmp_path)  # torch.multiprocessing.spawn's error files (pytorch-errorfile-*) go there
    done = subprocess.run([sys.executable, "ddp.py"], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr.count("are stored with pickle") == 1, done.stderr


# Two ranks of `python -m shmcache.launch --nproc 2`, each with a DataLoader worker that leaves the
# rank's process group (os.setpgrp in worker_init_fn: a terminal's Ctrl-C then reaches the rank
# alone, which stops its workers itself), over its half of the samples; rank 1 starts reading once
# rank 0's worker has said the notice.
SETPGRP_SCRIPT = textwrap.dedent("""\
    import os, time
    from torch.utils.data import DataLoader
    from shmcache import ShmDatasetCache


    def own_group(worker_id):
        os.setpgrp()


    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    cache = ShmDatasetCache(session="notes", name="sets")
    ds = cache.wrap([{i, i + 1} for i in range(40)], fingerprint="sets-v1")  # wrap() reads no sample
    time.sleep(1.5 * rank)
    for _ in DataLoader(ds, batch_size=4, num_workers=1, collate_fn=list, sampler=range(rank, 40, world),
                        worker_init_fn=own_group):
        pass
    cache.close()
""")


@pytest.mark.slow  # a launch of two ranks importing torch, each with a worker: ~5 s
def test_workers_in_a_process_group_of_their_own_are_of_their_ranks_job(tmp_path):
    """The launcher of a job was the parent of the process group's leader: a DataLoader worker that
    made a group of its own (os.setpgrp) led it, and its parent was its rank, not the launcher, so
    each rank's workers were a job of their own and said the pickled-sample warning once per rank.
    The launcher (torchrun's agent, ours) is the parent of the session's leader: each rank starts a
    session of its own, and a process group made in it stays in it."""
    (tmp_path / "rank.py").write_text(SETPGRP_SCRIPT)
    e = env()
    e.pop("TORCHELASTIC_RUN_ID", None)
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--nproc", "2", "rank.py"], cwd=tmp_path, env=e,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = done.stdout + done.stderr
    assert said.count("are stored with pickle") == 1, said
