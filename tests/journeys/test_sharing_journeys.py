"""Two jobs on one session (a sweep's runs, an evaluation script beside training): each process
adds to the session's counters (a row per liveness slot, not per job), so the launcher's closing
summary of one job counts the other's reads too. It says so, naming the processes outside the job
that it saw attached - never the job's own ranks or their DataLoader workers."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest
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


@pytest.mark.slow  # the job's own ranks and workers: the test above counts them out too (1 process)
def test_a_job_alone_is_not_said_to_share_its_session(tmp_path):
    (tmp_path / "items.py").write_text(ITEMS)
    (tmp_path / "job.py").write_text(JOB)
    (tmp_path / "done").touch()
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--session", "alone", "job.py"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "cache alone/items" in done.stderr and "outside this job" not in done.stderr, done.stderr


# What setproctitle does (vLLM, Ray, gunicorn, celery use it; a training script may, for `ps`): the
# title takes the memory of the command line and the environment the process started with, after
# the environment's strings are copied elsewhere - /proc/PID/environ then shows the title, not them.
RETITLED = textwrap.dedent("""\
    import ctypes, os, time
    from items import Items
    from shmcache import ShmDatasetCache

    if __name__ == "__main__":
        for k, v in os.environ.items():
            os.putenv(k, v)  # copies of the strings: the C environment leaves the memory to clobber
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[48])  # arg_start .. env_end (proc(5) fields 48, 51)
        ctypes.memmove(start, b"trainer".ljust(end - start, b"\\0"), end - start)
        ds = ShmDatasetCache(name="items").wrap(Items())
        assert all(int(ds[i][0]) == i for i in range(100))
        time.sleep(1.5)  # attached through looks of the launcher
""")


@pytest.mark.slow  # ~5 s: a launch
def test_a_rank_that_retitles_itself_is_not_said_to_be_outside_the_job(tmp_path):
    """A rank that set its process title (setproctitle) no longer shows $SHMCACHE_LAUNCH in
    /proc/PID/environ: the closing summary said the job's own rank was a process outside it."""
    (tmp_path / "items.py").write_text(ITEMS)
    (tmp_path / "job.py").write_text(RETITLED)
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--session", "retitled", "--destroy-session",
                           "job.py"], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    assert "cache retitled/items" in done.stderr and "outside this job" not in done.stderr, done.stderr


NODE = textwrap.dedent("""\
    import time
    from items import Items
    from shmcache import ShmDatasetCache

    ds = ShmDatasetCache(name="items").wrap(Items())
    assert all(int(ds[i][0]) == i for i in range(100))
    time.sleep(1.5)  # attached through looks of both launchers
""")


@pytest.mark.slow  # ~5 s: two launches
@pytest.mark.xfail(strict=True, reason=(
    "a process of the launch is known by this launcher's mark or as its descendant: the other node's "
    "launcher and ranks on the same host are neither; the job's rendezvous as the mark would still "
    "leave the other launcher out (it does not carry it), or counting only processes whose counters "
    "moved: not built (nodes of one job are other hosts outside tests and benchmarks)"))
def test_the_nodes_of_one_job_on_one_host_are_not_said_to_be_outside_it(tmp_path):
    """Two nodes of one job (--nnodes 2, one launcher each, as test_launch's two_launchers and the
    benchmarks' simulated nodes) on one host, one session: each launcher's summary says the other
    node's launcher and rank are 2 processes outside this job."""
    (tmp_path / "items.py").write_text(ITEMS)
    (tmp_path / "node.py").write_text(NODE)
    port = "29771"
    nodes = [subprocess.Popen([sys.executable, "-m", "shmcache.launch", "--nnodes", "2", "--node-rank", str(k),
                               "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port", port,
                               "--session", "nodes", "node.py"], cwd=tmp_path, env=env(), stderr=subprocess.PIPE,
                              text=True) for k in (0, 1)]
    errs = []
    try:
        for node in nodes:
            errs.append(node.communicate(timeout=90)[1])
            assert node.returncode == 0, errs[-1]
    finally:
        for node in nodes:
            node.kill()
            node.wait()
        subprocess.run([sys.executable, "-m", "shmcache", "destroy", "nodes"], env=env(), capture_output=True,
                       timeout=60)
    for err in errs:
        assert "cache nodes/items" in err and "outside this job" not in err, err
