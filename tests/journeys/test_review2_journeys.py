"""What a second review of the day's changes broke: a warning said once per job (Store.first_to_say,
RootLayout.SAID_PICKLED) must still reach every later job's log, and each notice must be said once
by the job, whichever other notice its processes said in between.

Every process runs in the test's ``$SHMCACHE_DIR`` (the conftest's), which the conftest empties."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
from _journey import PICKLED, env

BOTH = textwrap.dedent("""\
    import numpy as np
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="notes", name="both", size=1)
    # each sample holds a set (stored with pickle) and 2.4 MB of numbers (never fits 1 MiB)
    ds = cache.wrap([{"x": np.full(300_000, i, np.int64), "tags": {i}} for i in range(4)])
    [ds[i] for i in range(4)]
    cache.close()
""")


def _script(args: list, e: dict) -> str:
    done = subprocess.run([sys.executable, *args], env=e, capture_output=True, text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    return done.stderr


def test_the_second_run_of_a_script_is_told_again(tmp_path):
    """`python train.py --lr 0.1; python train.py --lr 0.01` in a shell script (no job control: one
    process group), a Makefile, CI step or a sweep driver's subprocess.run: each run is a job of its
    own with a log of its own, and the second run's log said nothing of its samples being pickled -
    the process group was taken for the job, and the first run had marked it said."""
    (tmp_path / "train.py").write_text(PICKLED)
    e = env()
    e.pop("TORCHELASTIC_RUN_ID", None)
    assert _script([tmp_path / "train.py"], e).count("are stored with pickle") == 1
    assert _script([tmp_path / "train.py"], e).count("are stored with pickle") == 1, "the second run was not told"


def test_two_notices_of_one_job_are_each_said_once(tmp_path):
    """A sample both stored with pickle and too large to cache: each process said the one notice,
    then the other, in the one root word they share (then RootLayout.SAID_NOTICE), so every rank and
    worker found the other notice's mark there and said both again - 64 times each for 8 ranks of 8
    workers, what said-once-per-job was made to stop."""
    (tmp_path / "both.py").write_text(BOTH)
    e = env()
    e["TORCHELASTIC_RUN_ID"] = "job-both"
    said = _script([tmp_path / "both.py"], e) + _script([tmp_path / "both.py"], e)  # two ranks of one job
    assert said.count("are stored with pickle") == 1, said
    assert said.count("served from the source, not cached") == 1, said


@pytest.mark.slow  # two torchruns, 3 s each
def test_the_next_torchrun_with_the_tutorials_fixed_rdzv_id_is_told_again(tmp_path):
    """PyTorch's multinode tutorial launches with a fixed `--rdzv-id=456` (c10d rendezvous), and a
    script launched that way every day is one run id every day: each launch after the first said
    nothing of its samples being pickled while its cache lived (the session outlives the jobs)."""
    import socket

    (tmp_path / "rank.py").write_text(PICKLED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    e = env()
    e.pop("TORCHELASTIC_RUN_ID", None)
    e["TMPDIR"] = str(tmp_path)  # torchrun leaves its log directory (torchelastic_*) in it
    args = ["-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "456", tmp_path / "rank.py"]
    assert _script(args, e).count("are stored with pickle") == 1
    assert _script(args, e).count("are stored with pickle") == 1, "the next torchrun was not told"


TOO_LARGE = textwrap.dedent("""\
    import numpy as np
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="notes", name="big", size=1)
    ds = cache.wrap([np.full(300_000, i, np.int64) for i in range(4)])  # 2.4 MB each
    [ds[i] for i in range(4)]
    cache.close()
""")
# what many training scripts do on every rank but the first (DeiT's, MAE's setup_for_distributed;
# logging.basicConfig(level=INFO if rank == 0 else ERROR)): its warnings and log lines silenced
SILENCED = "import logging, warnings\nwarnings.filterwarnings('ignore')\nlogging.disable(logging.WARNING)\n"


@pytest.mark.parametrize(("script", "said"), [
    (PICKLED, "are stored with pickle"),
    pytest.param(TOO_LARGE, "served from the source, not cached", marks=pytest.mark.slow)])  # logging's rule
def test_a_silenced_rank_does_not_take_the_notice_from_the_job(tmp_path, script, said):
    """Rank 1 (warnings and logging off, as on every rank but the first in many training scripts)
    met the pickled or too-large samples first - wrap()'s probes race on every rank - and marked the
    notice said for the job, without showing it; rank 0 then said nothing: the job's log never told
    the user. Before the notices were said once per job, rank 0 said it."""
    e = env()
    e["TORCHELASTIC_RUN_ID"] = "job-silenced"
    rank1 = _script(["-c", SILENCED + script], e)
    rank0 = _script(["-c", script], e)
    assert said not in rank1, rank1
    assert rank0.count(said) == 1, f"no rank said it: {rank0}"


def test_gc_does_not_pass_over_a_damaged_cache_under_a_nonsense_claim_timeout(tmp_path):
    """The day's fix refused an on/off variable of nonsense before gc (SHMCACHE_CLAIMS=disabled);
    SHMCACHE_CLAIM_TIMEOUT_S=soon (exported for the job) fails each cache's opening the same way,
    and gc took every cache for one gone meanwhile: '0 reclaimed', exit 0, the damaged counter left."""
    import struct

    from shmcache.cache.generation import MetaLayout
    from shmcache.cache.store import CacheStore

    store = CacheStore("sw", "c", capacity_bytes=4 << 20)
    try:
        for k in range(20):
            store.put(k, k * k)
        # the item counter a killed writer could leave: gc recounts it
        struct.pack_into("Q", store.view.refresh().meta.buf, MetaLayout.ITEMS_MEM, (1 << 63) + 12345)
    finally:
        store.close()
    e = env()
    e["SHMCACHE_CLAIM_TIMEOUT_S"] = "soon"
    done = subprocess.run([sys.executable, "-m", "shmcache", "gc"], cwd=tmp_path, env=e, capture_output=True,
                          text=True, timeout=90)
    assert done.returncode != 0 and "SHMCACHE_CLAIM_TIMEOUT_S" in done.stderr, \
        f"gc passed over the damaged cache: {done.stdout}{done.stderr}"
    e.pop("SHMCACHE_CLAIM_TIMEOUT_S")
    fixed = subprocess.run([sys.executable, "-m", "shmcache", "gc"], cwd=tmp_path, env=e, capture_output=True,
                           text=True, timeout=90)
    assert fixed.returncode == 0 and "recounted" in fixed.stdout, fixed.stdout + fixed.stderr
