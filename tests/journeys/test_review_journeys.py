"""What a review of the day's changes broke: an on/off variable set to a word it does not take
must be refused where the user reads it (the command line, the launcher, before any rank starts),
never as a traceback at import nor as a `shmcache gc` that silently repairs nothing; and a full
cache's one log line (RootLayout.SAID_FULL) must still reach a later job, or one that now spills.

Every process runs in the test's ``$SHMCACHE_DIR`` (the conftest's), which the conftest empties."""

from __future__ import annotations

import json
import re
import socket
import struct
import subprocess
import sys
import textwrap

import pytest
from _journey import PICKLED, env, run

from shmcache.cache.generation import MetaLayout
from shmcache.cache.store import CacheStore


def _made() -> None:
    """Cache sw/c with 20 items, made here (the commands under test run in processes of their own;
    a script that made it through ShmDatasetCache would import torch first: a second a case)."""
    store = CacheStore("sw", "c", capacity_bytes=4 << 20)
    try:
        for k in range(20):
            store.put(k, k * k)
    finally:
        store.close()


def _damaged() -> None:
    """Cache sw/c (``_made``) with the item counter a killed writer could leave: gc recounts it."""
    _made()
    store = CacheStore("sw", "c", create=False)
    try:
        struct.pack_into("Q", store.view.refresh().meta.buf, MetaLayout.ITEMS_MEM, (1 << 63) + 12345)
    finally:
        store.close()


def _bad(variable: str, value: str) -> dict:
    e = env()
    e[variable] = value
    return e


@pytest.mark.parametrize("command", [["ls"], ["stat", "sw"], ["gc"], ["destroy", "sw", "--cache", "c"]])
@pytest.mark.parametrize(("variable", "value"), [("SHMCACHE_NATIVE", "none"), ("SHMCACHE_CLAIMS", "disabled")])
def test_the_command_line_refuses_a_nonsense_switch_cleanly(tmp_path, variable, value, command):
    """`export SHMCACHE_NATIVE=none` (meant off), then `shmcache ls` or `shmcache destroy`, the
    cleanup a user reaches for: every command died in `import shmcache.cli` with a traceback
    (NATIVE is read at import). With SHMCACHE_CLAIMS=disabled, `shmcache stat` listed every cache
    as an error and `shmcache gc` repaired no cache and said so nowhere (each store's opening
    raised, which gc takes for 'gone meanwhile'). Each command says what is wrong and exits 2."""
    _made()
    done = subprocess.run([sys.executable, "-m", "shmcache", *command], cwd=tmp_path, env=_bad(variable, value),
                          capture_output=True, text=True, timeout=90)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, f"{command} exited {done.returncode}: {done.stdout}{done.stderr}"
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"shmcache {command[0]}: error: {variable}={value!r}"), last
    assert json.loads(run(["-m", "shmcache", "stat", "sw", "--json"], tmp_path, env()))[0]["name"] == "c"


def test_gc_with_a_nonsense_claims_switch_does_not_pass_over_a_damaged_cache(tmp_path):
    """gc's whole point: a cache whose counters a killed writer left wrong is recounted. With
    SHMCACHE_CLAIMS=disabled in the environment (the job's, exported) it said '0 ... reclaimed',
    exited 0 and recounted nothing: every cache's opening raised on the variable, which gc took for
    a cache gone meanwhile. It must refuse (and recount once the variable is fixed)."""
    _damaged()
    done = subprocess.run([sys.executable, "-m", "shmcache", "gc"], cwd=tmp_path,
                          env=_bad("SHMCACHE_CLAIMS", "disabled"), capture_output=True, text=True, timeout=90)
    assert done.returncode != 0, f"gc passed over the damaged cache and exited 0: {done.stdout}{done.stderr}"
    assert "recounted" in run(["-m", "shmcache", "gc"], tmp_path, env())


def test_gc_called_from_python_refuses_a_nonsense_claims_switch(monkeypatch):
    """The library call behind `shmcache gc` (tiers.namespace_gc.collect_garbage) took every cache
    that would not open under SHMCACHE_CLAIMS=disabled for one gone meanwhile and recounted nothing,
    silently: only the command line checked the switches first."""
    from shmcache.cache.registry import SessionRegistry
    from shmcache.errors import InvalidArgument
    from shmcache.tiers.namespace_gc import collect_garbage

    _damaged()
    monkeypatch.setenv("SHMCACHE_CLAIMS", "disabled")
    with pytest.raises(InvalidArgument, match="SHMCACHE_CLAIMS"):
        collect_garbage(SessionRegistry())
    monkeypatch.delenv("SHMCACHE_CLAIMS")
    assert collect_garbage(SessionRegistry()).recounted, "the damaged cache was not recounted once the switch is fixed"


NOTE_START = textwrap.dedent("""\
    import pathlib, sys
    pathlib.Path(sys.argv[1], "started").touch()
""")


@pytest.mark.parametrize(("variable", "value"), [("SHMCACHE_NATIVE", "none"), ("SHMCACHE_CLAIMS", "disabled"),
                                                 ("SHMCACHE_SPILLING", "enabled")])
def test_the_launcher_refuses_a_nonsense_switch_before_any_rank_starts(tmp_path, variable, value):
    """The launcher passed SHMCACHE_CLAIMS=disabled on to its ranks, which each died with the
    same traceback once they had started (and SHMCACHE_NATIVE=none killed the launcher in its
    imports, with a traceback). The launcher checks what its ranks would refuse, first."""
    (tmp_path / "note.py").write_text(NOTE_START)
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--nproc", "2", "--session", "sw", "note.py",
                           str(tmp_path)], cwd=tmp_path, env=_bad(variable, value), capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in done.stderr, done.stderr
    assert done.returncode == 2, f"exited {done.returncode}: {done.stderr}"
    assert f"{variable}={value!r}" in done.stderr.strip().splitlines()[-1], done.stderr
    assert not (tmp_path / "started").exists(), "a rank started"


def test_the_launchers_spilling_option_overrides_a_nonsense_spilling_variable(tmp_path):
    """`--spilling` sets SHMCACHE_SPILLING=1 for the ranks: a word in the launcher's own variable
    is then none of theirs, and the job runs."""
    (tmp_path / "note.py").write_text(NOTE_START)
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--spilling", "--spill-dir", str(tmp_path),
                           "--session", "sw", "note.py", str(tmp_path)], cwd=tmp_path,
                          env=_bad("SHMCACHE_SPILLING", "enabled"), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "started").exists()


FILL = textwrap.dedent("""\
    import sys
    import numpy as np
    from shmcache import ShmDatasetCache

    spill = sys.argv[1] == "spill"
    cache = ShmDatasetCache(session="full", name="big", size=1, spilling=spill,
                            spill_dir=sys.argv[2] if spill else None)
    ds = cache.wrap([np.full(8192, i % 251, np.uint8) for i in range(300)])
    for i in range(300):
        ds[i]
    cache.close()
""")


def _said(done: subprocess.CompletedProcess) -> list[str]:
    assert done.returncode == 0, done.stderr
    return [ln for ln in done.stderr.splitlines() if "stops growing in memory" in ln]


@pytest.mark.slow  # two launches (~3 s); a later job's warning is checked in the default run
def test_a_full_cache_that_now_spills_says_where_new_items_go(tmp_path):
    """A first run filled the 1 MiB cache and said 'new items are served from the source ...
    spilling=True would keep them on disk'. The user reruns with spilling=True, as told: new items
    go to disk now, which the log line says - but RootLayout.SAID_FULL (same generation, same
    cap) kept it quiet, and the run spilled 200 items without a word of where."""
    (tmp_path / "fill.py").write_text(FILL)
    (tmp_path / "spill").mkdir()
    first = _said(subprocess.run([sys.executable, "fill.py", "memory", ""], cwd=tmp_path, env=env(),
                                 capture_output=True, text=True, timeout=90))
    assert len(first) == 1 and "spilling=True would keep them on disk" in first[0], first
    second = _said(subprocess.run([sys.executable, "fill.py", "spill", str(tmp_path / "spill")], cwd=tmp_path,
                                  env=env(), capture_output=True, text=True, timeout=90))
    assert len(second) == 1 and "new items go to disk" in second[0], second


def test_a_later_job_on_a_full_cache_is_told_it_is_full(tmp_path):
    """RootLayout.SAID_FULL was meant to quiet 'the other processes of the job'; it quieted every
    later job too: the session outlives the job, and the cache stays full. Tomorrow's job on it
    rejected 200 items a pass (served from the source, its epochs cold) and never said why."""
    (tmp_path / "fill.py").write_text(FILL)
    for job in ("today", "tomorrow"):
        done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--session", "full", "fill.py", "memory",
                               ""], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
        said = _said(done)
        assert len(said) == 1 and "size=1 MiB" in said[0], f"{job}'s job: {said}"


EPOCHS = textwrap.dedent("""\
    import os, subprocess, sys
    import numpy as np
    from torch.utils.data import Dataset
    from shmcache import ShmDatasetCache

    class Items(Dataset):
        def __len__(self):
            return 100
        def __getitem__(self, i):
            return np.full(16, i, dtype=np.int64)

    cache = ShmDatasetCache(name="items")
    ds = cache.wrap(Items())
    if sys.argv[1] == "clear":
        cache.clear()  # a fresh start: every item computed again
    elif sys.argv[1] == "remake":  # destroyed (here, by the job itself) and made again
        cache.close()
        subprocess.run([sys.executable, "-m", "shmcache", "destroy", os.environ["SHMCACHE_SESSION"], "--cache",
                        "items"], check=True)
        cache = ShmDatasetCache(name="items")
        ds = cache.wrap(Items())
    for epoch in range(int(sys.argv[2])):
        for i in range(100):
            ds[i]
""")


@pytest.mark.parametrize("how", ["clear", pytest.param("remake", marks=pytest.mark.slow)])  # slow: a launch, ~4 s
def test_the_closing_summary_of_a_job_that_starts_its_cache_afresh(tmp_path, how):
    """The closing summary subtracts each cache's counters at the job's start. A job that clears
    its cache (`cache.clear()`: a new generation, new hit and miss counters) or destroys it and
    makes it again (a new incarnation: every counter new) then reads two epochs: about 100
    misses, 100 hits, 100 computed. Its summary subtracted the earlier generation's counters from
    the new one's: `(97 hits, 3 misses) ... computed 104` after a clear, `(100 hits, 0 misses)
    ... computed 0` after a remake - a job that computed everything summed up as one that
    computed nothing. Counters of another generation or incarnation are not the job's to subtract."""
    (tmp_path / "epochs.py").write_text(EPOCHS)

    def closing(*args: str) -> tuple[int, int, int]:
        done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--session", "job", "epochs.py", *args],
                              cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        lines = [ln for ln in done.stderr.splitlines() if ln.startswith("shmcache.launch: cache job/items")]
        assert len(lines) == 1, done.stderr
        got = re.search(r"\((\d+) hits, (\d+) misses\).* computed (\d+),", lines[0])
        assert got, lines[0]
        return int(got[1]), int(got[2]), int(got[3])

    first = closing("keep", "1")
    assert first[0] + first[1] == 100 and first[1] >= 90, first
    hits, misses, computed = closing(how, "2")
    assert hits + misses == 200 and 97 <= misses <= 100 and 97 <= computed <= 104, (hits, misses, computed)


STREAM_TOO_BIG = textwrap.dedent("""\
    import json
    import numpy as np
    from torch.utils.data import IterableDataset
    from shmcache import ShmDatasetCache

    class Stream(IterableDataset):
        def __iter__(self):
            return (np.full(16384, i % 251, np.uint8) for i in range(100))

    cache = ShmDatasetCache(session="stream", size=1)  # holds about half of the stream
    ds = cache.wrap(Stream())
    for x in ds:
        pass
    for x in ds:  # replays what the cache holds, then records the rest again
        pass
    print(json.dumps(cache.stats()))
""")


def test_a_replay_that_records_again_counts_each_miss_once(tmp_path):
    """README: `misses` counts the reads that computed their item plus those that waited for
    another process's (claim_waits). A replay that finds item k missing (the cache was full) looks
    it up - a miss - and records the rest from k, counting item k's miss again: misses 149 for 148
    computed. Each item is one miss."""
    st = json.loads(run(["-c", STREAM_TOO_BIG], tmp_path, env()).strip().splitlines()[-1])
    assert st["rejected"] > 0, st  # the cache was full: the replay did record again
    assert st["misses"] == st["computed"] + st["claim_waits"], st




TOO_LARGE = textwrap.dedent("""\
    import numpy as np
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="notes", name="big", size=1)
    ds = cache.wrap([np.full(300_000, i, np.int64) for i in range(8)])  # 2.4 MB each
    [ds[i] for i in range(8)]
    cache.close()
""")


@pytest.mark.slow  # two ranks and a later job, 3 s a case; the default run: test_review2_journeys' two notices
@pytest.mark.parametrize(("script", "said"), [(PICKLED, "are stored with pickle"),
                                              (TOO_LARGE, "served from the source, not cached")])
def test_a_warning_about_the_samples_is_said_once_per_job(tmp_path, script, said):
    """Samples stored with pickle, or too large to cache, were warned about once per cache object:
    once in every process (8 ranks with 8 DataLoader workers each said it 64 times). Two ranks of
    a job say it once; a later job is told again."""
    def ranks(job: str, n: int) -> str:
        e = env()
        e["TORCHELASTIC_RUN_ID"] = job
        procs = [subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, env=e, stderr=subprocess.PIPE,
                                  text=True) for _ in range(n)]
        out = [p.communicate(timeout=90)[1] for p in procs]
        assert all(p.returncode == 0 for p in procs), out
        return "".join(out)

    out = ranks("job-a", 2)
    assert out.count(said) == 1, out
    assert ranks("job-b", 1).count(said) == 1, "a later job was not told"


@pytest.mark.slow  # 3 s a torchrun; a launch's ranks as one job: test_review2_journeys' two notices
@pytest.mark.parametrize("rerun", [False, True])
def test_a_warning_is_said_once_by_the_ranks_of_a_plain_torchrun(tmp_path, rerun):
    """torchrun's static rendezvous (a fixed --master-port) gives every rank the run id "none" and
    a process group of its own, so each rank counted as a job and said the warning again. The
    ranks of one torchrun are one job; the next torchrun is told again."""
    (tmp_path / "rank.py").write_text(PICKLED)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]

    e = env()
    e["TMPDIR"] = str(tmp_path)  # torchrun leaves its log directory (torchelastic_*) in it

    def torchrun() -> str:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                               "--master-port", str(port), str(tmp_path / "rank.py")], cwd=tmp_path, env=e,
                              capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        return done.stderr

    said = torchrun()
    assert said.count("are stored with pickle") == 1, said
    if rerun:
        assert torchrun().count("are stored with pickle") == 1, "the next torchrun was not told"
