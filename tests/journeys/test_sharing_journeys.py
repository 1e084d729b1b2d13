"""Two jobs on one session (a sweep's runs, an evaluation script beside training): each process
adds to the session's counters (a row per liveness slot, not per job), so the launcher's closing
summary of one job counts the other's reads too. It says so, naming the processes outside the job
that it saw attached - never the job's own ranks or their DataLoader workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

from _journey import env

ITEMS = textwrap.dedent("""\
    import numpy as np
    from torch.utils.data import Dataset

    class Items(Dataset):
        def __len__(self):
            return 100
        def __getitem__(self, i):
            return np.full(16, i, dtype=np.int64)
""")

JOB = textwrap.dedent("""\
    import pathlib, time
    from torch.utils.data import DataLoader
    from items import Items
    from shmcache import ShmDatasetCache

    if __name__ == "__main__":
        ds = ShmDatasetCache(name="items").wrap(Items())
        for batch in DataLoader(ds, batch_size=10, num_workers=2, persistent_workers=True):
            pass
        pathlib.Path("ready").touch()
        deadline = time.monotonic() + 60
        while not pathlib.Path("done").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
""")

OTHER = textwrap.dedent("""\
    import time
    from items import Items
    from shmcache import ShmDatasetCache

    ds = ShmDatasetCache(session="shared", name="items").wrap(Items())
    assert all(int(ds[i][0]) == i for i in range(100))
    time.sleep(2.0)  # another job's process: it stays attached while it works
""")


def _wait_for(path, proc, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_the_closing_summary_says_which_processes_outside_the_job_shared_its_session(tmp_path):
    (tmp_path / "items.py").write_text(ITEMS)
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "other.py").write_text(OTHER)
    job = subprocess.Popen([sys.executable, "-m", "shmcache.launch", "--session", "shared", "job.py"],
                           cwd=tmp_path, env=env(), stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(tmp_path / "ready", job)
        other = subprocess.Popen([sys.executable, "other.py"], cwd=tmp_path, env=env(), stderr=subprocess.PIPE,
                                 text=True)
        other_err = other.communicate(timeout=90)[1]
        assert other.returncode == 0, other_err
        (tmp_path / "done").touch()
        err = job.communicate(timeout=90)[1]
    finally:
        job.kill()
        job.wait()
    assert job.returncode == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("shmcache.launch: ")]
    assert any("cache shared/items" in ln for ln in lines), err
    said = [ln for ln in lines if "outside this job" in ln]
    assert len(said) == 1 and f"pid {other.pid})" in said[0] and "1 process" in said[0], err


def test_a_job_alone_is_not_said_to_share_its_session(tmp_path):
    (tmp_path / "items.py").write_text(ITEMS)
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "done").touch()
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--session", "alone", "job.py"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "cache alone/items" in done.stderr and "outside this job" not in done.stderr, done.stderr
