"""How a user's training job ends, or is interrupted, with a cache in use: each step a process of
its own, started as a user starts it (a script with a DataLoader over a wrapped dataset), stopped
as a terminal stops it (Ctrl-C reaches the whole foreground process group: the script and its
DataLoader workers). What the user sees afterwards: the exit status, how long the exit took, and
a rerun that gets the dataset's values without waiting for anything the interrupted run held."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from _journey import env

# a slow cold epoch through a PrefetchRing over a DataLoader with workers, the way the README and
# the module's docstring use it (`with PrefetchRing(loader) as ring: for batch in ring: ...`);
# READY is written once the first batch reached the loop, so a signal lands mid-epoch
RING_SCRIPT = textwrap.dedent("""\
    import os, sys, time
    from pathlib import Path

    import torch
    from torch.utils.data import DataLoader, Dataset

    from shmcache import PrefetchRing, ShmDatasetCache


    class Slow(Dataset):
        def __len__(self):
            return 400

        def __getitem__(self, i):
            time.sleep(0.05)
            return torch.full((8,), float(i)), i


    if __name__ == "__main__":
        cache = ShmDatasetCache(session="exits")
        ds = cache.wrap(Slow(), fingerprint="slow-v1")
        loader = DataLoader(ds, batch_size=16, shuffle=True, num_workers=2)
        with PrefetchRing(loader, device="cpu") as ring:
            for x, y in ring:
                assert torch.equal(x, y.float()[:, None].expand_as(x))
                Path(sys.argv[1]).touch()
        print("finished")
""")


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, f"the script exited {proc.returncode} early:\n{proc.communicate()[1]}"
        assert time.monotonic() < deadline, f"{path.name} not written within {timeout} s"
        time.sleep(0.01)


def _ctrl_c(script: Path, ready: Path, cwd: Path) -> tuple[int, float, str]:
    """Start ``script READY`` in a process group of its own, press Ctrl-C (SIGINT to the group)
    once READY exists; the exit status, the seconds from the signal to the exit, stderr."""
    proc = subprocess.Popen([sys.executable, str(script), str(ready)], cwd=cwd, env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_for(ready, proc, 60)
        os.killpg(proc.pid, signal.SIGINT)
        pressed = time.monotonic()
        _, err = proc.communicate(timeout=30)
        return proc.returncode, time.monotonic() - pressed, err
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()


@pytest.mark.slow  # 2 x 5 s (torch's worker-status check)
@pytest.mark.xfail(strict=True, reason=(
    "on an interrupt the ring joins its producer (up to 10 s), which sits in the DataLoader's next() "
    "until torch's 5 s worker-status check notices the workers the SIGINT killed. Not joining is no "
    "fix: a producer left inside torch's C++ code (a source without workers) dies with the "
    "interpreter by SIGABRT (the test below). A fix: when the source is a multiprocessing DataLoader "
    "iterator, have its next() return at once (e.g. the consumer shuts its workers down, or the "
    "producer polls the worker processes' liveness itself), and keep joining"))
def test_ctrl_c_of_a_prefetch_ring_over_a_dataloader_with_workers_exits_at_once(tmp_path):
    """Ctrl-C in a terminal, mid-epoch, with the loop waiting for its next batch: the script left
    5.4 s later (the DataLoader alone leaves in about 0.5 s). The workers die of the SIGINT, the
    ring's producer thread sits in the DataLoader's next() until torch notices (its 5 s status
    check), and the consumer's KeyboardInterrupt, then the `with` block's close(), joined that
    thread (up to 10 s each) before letting the interrupt through."""
    script = tmp_path / "train.py"
    script.write_text(RING_SCRIPT)
    # twice: now and then a worker dies of the SIGINT itself (not of a KeyboardInterrupt it
    # catches), and torch's SIGCHLD handler raises in the main thread, cutting the join short
    for attempt in range(2):
        rc, took, err = _ctrl_c(script, tmp_path / f"ready{attempt}", tmp_path)
        assert rc in (-signal.SIGINT, 130), f"exit status {rc}:\n{err}"
        assert "KeyboardInterrupt" in err, err
        assert took < 3.0, f"attempt {attempt}: Ctrl-C took {took:.1f} s to end the script:\n{err[-2000:]}"


# the ring's producer busy inside torch (a long op per sample, no workers) as Ctrl-C arrives
RING_TORCH_SCRIPT = RING_SCRIPT.replace("time.sleep(0.05)", "torch.randn(256, 256) @ torch.randn(256, 256)").replace(
    "num_workers=2", "num_workers=0")


@pytest.mark.slow  # three Ctrl-Cs (~5 s); it guards a fix of the xfail above
def test_ctrl_c_of_a_prefetch_ring_whose_producer_is_inside_torch_never_aborts(tmp_path):
    """The other side of the test above: a producer thread still inside torch's C++ code when the
    interpreter finalizes is killed there (a daemon thread), and the process dies of SIGABRT
    ("terminate called without an active exception") instead of the KeyboardInterrupt. Joining
    the producer on an interrupt avoids that; a fix that stops waiting for it must keep this."""
    script = tmp_path / "train.py"
    script.write_text(RING_TORCH_SCRIPT)
    for attempt in range(3):  # each Ctrl-C lands elsewhere in the producer's work
        ready = tmp_path / f"ready{attempt}"
        rc, _, err = _ctrl_c(script, ready, tmp_path)
        assert rc in (-signal.SIGINT, 130), f"attempt {attempt}: exit status {rc}:\n{err[-2000:]}"
        assert "terminate called" not in err, err[-2000:]


# A notebook's kernel: a cell fills the cache and is interrupted (Ctrl-C) just as a put takes or
# lets go of the cache's lock; the next cell reads the dataset on, in the same process. A Ctrl-C
# that arrives while a call into C runs is raised when that call returns: here, as the lock's
# thread lock is taken (``acquire``) or as its file lock is let go (``release``), the two calls
# after which FlockLock has no ``try`` yet (or no more) to undo the hold. The script makes the
# signal arrive there (it sends itself SIGINT from inside that call), once.
NOTEBOOK_SCRIPT = textwrap.dedent("""\
    import json, os, signal, sys, time
    import fcntl as real_fcntl

    import numpy as np

    from shmcache import ShmDatasetCache
    from shmcache.base import locks

    window = sys.argv[1]
    armed = False


    def ctrl_c_now():
        global armed
        armed = False
        os.kill(os.getpid(), signal.SIGINT)  # handled as this call returns: KeyboardInterrupt


    if window == "release":
        class Fcntl:
            def __getattr__(self, name):
                return getattr(real_fcntl, name)

            @staticmethod
            def flock(fd, op):
                real_fcntl.flock(fd, op)
                if armed and op == real_fcntl.LOCK_UN:
                    ctrl_c_now()

        locks.fcntl = Fcntl()
    else:
        make = locks.FlockLock._new_thread_lock

        class ThreadLock:
            def __init__(self, inner):
                self.inner = inner

            def acquire(self, *args, **kwargs):
                got = self.inner.acquire(*args, **kwargs)
                if armed and got:
                    ctrl_c_now()
                return got

            def __getattr__(self, name):
                return getattr(self.inner, name)

        locks.FlockLock._new_thread_lock = lambda self: ThreadLock(make(self))


    class Rows:
        def __len__(self):
            return 16

        def __getitem__(self, i):
            return np.full(64, i, np.float32)


    cache = ShmDatasetCache(session="notebook", lock_timeout_s=2)
    ds = cache.wrap(Rows(), fingerprint="rows-v1")  # a fingerprint: wrap() reads no sample
    armed = True
    try:
        ds[5]  # cell 1: a miss, stored under the cache's lock - Ctrl-C
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
    assert not armed, "the Ctrl-C was never sent"
    started = time.monotonic()
    for i in range(len(ds)):  # cell 2
        assert (ds[i] == i).all()
    stats = cache.stats()
    print(json.dumps({"took": time.monotonic() - started, "rejected": stats["rejected"],
                      "items": stats["items_mem"]}))
""")


def _notebook(tmp_path: Path, window: str) -> dict:
    script = tmp_path / "notebook.py"
    script.write_text(NOTEBOOK_SCRIPT)
    done = subprocess.run([sys.executable, str(script), window], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "interrupted" in done.stderr, done.stderr
    return {**json.loads(done.stdout), "log": done.stderr}


def test_ctrl_c_as_a_put_lets_go_of_the_cache_lock_leaves_the_lock_usable(tmp_path):
    """The Ctrl-C arrived as the put's file lock was let go: FlockLock.release never reached its
    thread lock's release, so every later put of the process waited lock_timeout_s (60 s by
    default) for "another thread" and the rest of the notebook's values went uncached (rejected)."""
    got = _notebook(tmp_path, "release")
    assert got["rejected"] == 0 and got["items"] == 16, got
    assert got["took"] < 1.5, got


def test_ctrl_c_as_a_put_takes_the_cache_lock_leaves_the_lock_usable(tmp_path):
    """The Ctrl-C arrived as the put took the lock's thread lock, before FlockLock.acquire's try:
    the thread lock stayed held, so every later put of the process waited lock_timeout_s for
    "another thread" and was served uncached. Seen without any injection too (this window or
    release's): in about 300 random Ctrl-Cs of cold epochs in a notebook-like loop, once the next
    cache.clear() waited 60 s, then raised LockTimeout "(another thread holds it)"."""
    got = _notebook(tmp_path, "acquire")
    assert got["rejected"] == 0 and got["items"] == 16, got
    assert got["took"] < 1.5, got


# The same notebook, interrupted as the put's file lock was taken (the flock call returns and the
# Ctrl-C is raised there), then left idle while another process clears the cache. GO tells the
# notebook to exit.
IDLE_NOTEBOOK_SCRIPT = NOTEBOOK_SCRIPT.split("\ncache = ShmDatasetCache(")[0].replace(
    'if window == "release":', 'if window == "take":').replace(
    "if armed and op == real_fcntl.LOCK_UN:", "if armed and op & real_fcntl.LOCK_EX:") + textwrap.dedent("""\

    cache = ShmDatasetCache(session="notebook", lock_timeout_s=2)
    ds = cache.wrap(Rows(), fingerprint="rows-v1")
    armed = True
    try:
        ds[5]
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr, flush=True)
    assert not armed, "the Ctrl-C was never sent"
    go = sys.argv[2]
    open(go + ".idle", "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:  # the notebook sits idle
        time.sleep(0.02)
""")

CLEAR_SCRIPT = textwrap.dedent("""\
    import json, time
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="notebook", name=sys_name, lock_timeout_s=2)
    started = time.monotonic()
    try:
        cache.clear()
        print(json.dumps({"error": None, "took": time.monotonic() - started}))
    except Exception as exc:
        print(json.dumps({"error": f"{type(exc).__name__}: {exc}", "took": time.monotonic() - started}))
""")


def test_ctrl_c_as_a_put_takes_the_file_lock_leaves_it_to_other_processes(tmp_path):
    """The Ctrl-C was raised as the flock call returned, inside FlockLock._flock_until: its
    ``except`` lets the file lock go (closing the descriptor) only for locks that do not keep
    their descriptor open, and a cache's lock keeps it. The interrupted process went on holding
    the cache's file lock with no hold recorded: while that notebook sat idle, another process's
    ``clear()`` raised LockTimeout ("a live process holds it"), and ``shmcache gc`` waited 10 s
    and skipped the cache."""
    (tmp_path / "notebook.py").write_text(IDLE_NOTEBOOK_SCRIPT)
    go = tmp_path / "go"
    notebook = subprocess.Popen([sys.executable, "notebook.py", "take", str(go)], cwd=tmp_path, env=env(),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(Path(f"{go}.idle"), notebook, 60)
        name = next((tmp_path / "shmcache-ns" / "sessions" / "notebook" / "caches").glob("Rows-*.lock")).stem
        other = subprocess.run([sys.executable, "-c", CLEAR_SCRIPT.replace("sys_name", repr(name))], cwd=tmp_path,
                               env=env(), capture_output=True, text=True, timeout=60)
    finally:
        go.touch()
        _, log = notebook.communicate(timeout=60)
    assert notebook.returncode == 0 and "interrupted" in log, log
    assert other.returncode == 0, other.stderr
    got = json.loads(other.stdout)
    assert got["error"] is None and got["took"] < 1.5, got
