"""A new user's first hour, each step a fresh process as typed from the README: what the README
says a step prints or counts is what it prints or counts, and a setting given a value that means
nothing is refused, naming the values that mean something, never taken silently as one of them.

Every process runs in the test's ``$SHMCACHE_DIR`` (the conftest's), which the conftest empties."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _journey import env, run

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def test_the_quick_starts_table_names_the_caches_the_example_makes(tmp_path):
    """The quick start shows what `examples/train.py` prints, cache names included, and a user
    copies those names into `shmcache destroy default --cache NAME` or `name=`. Names are
    deterministic (NOTE [fingerprint]), so the table can be right; it named the digits' cache
    `Digits-fe6b8264f8c8`, a name the example no longer makes."""
    quick_start = README.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    shown = dict(re.findall(r"^default\s+((?:PhotoCrops|Digits))-(\w+)\s", quick_start, re.M))
    assert set(shown) == {"PhotoCrops", "Digits"}, quick_start
    # the datasets exactly as examples/train.py makes and wraps them (its defaults: 1,024 crops of 32 px)
    script = textwrap.dedent(f"""\
        import json, sys
        sys.path.insert(0, {str(ROOT / "examples")!r})
        from datasets import Digits, PhotoCrops
        from shmcache import ShmDatasetCache
        names = {{}}
        for source in (PhotoCrops(1024, size=32), Digits()):
            cache = ShmDatasetCache(session="quick")
            cache.wrap(source)
            names[type(source).__name__] = cache.name.split("-", 1)[1]
            cache.close()
        print(json.dumps(names))
    """)
    made = json.loads(run(["-c", script], tmp_path, env()).strip().splitlines()[-1])
    assert made == shown, f"README's quick start shows {shown}, the example makes {made}"


GET = textwrap.dedent("""\
    import json, sys, time
    from shmcache import ShmDatasetCache

    def slow(key):
        time.sleep(0.02)
        return key * key

    cache = ShmDatasetCache(session="pair", name="squares")
    go = float(sys.argv[1])
    time.sleep(max(0.0, go - time.time()))  # both processes start their gets together
    assert [cache.get(k, slow) for k in range(40)] == [k * k for k in range(40)]
    cache.close()
""")


def test_misses_counts_every_read_that_did_not_find_its_item_as_the_readme_says(tmp_path):
    """`cache.get(key, fn)` from two processes at once: one computes each key, the other waits for
    its value. The README defined `misses` as the reads that computed their item from the source,
    but a read that waited is a miss too (`misses` 80 here, `computed` 40): the definition must say
    so, and the numbers must add up as it says."""
    import time

    (tmp_path / "get.py").write_text(GET)
    go = str(time.time() + 3.0)
    procs = [subprocess.Popen([sys.executable, "get.py", go], cwd=tmp_path, env=env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for p in procs:
            out, err = p.communicate(timeout=90)
            assert p.returncode == 0, err
    finally:
        for p in procs:
            p.kill()
            p.wait()
    st = json.loads(run(["-m", "shmcache", "stat", "pair", "--json"], tmp_path, env()))[0]
    assert st["computed"] + st["claim_waits"] == st["misses"], st  # what a miss is, counted
    assert st["hits"] + st["misses"] == 80, st
    bullet = " ".join(README.split("- **`stats()`**", 1)[1].split("\n- ", 1)[0].split())
    misses = bullet.split("`misses` (", 1)[1].split("),", 1)[0]
    assert "claim_waits" in misses, f"the README's `misses` leaves out the reads that waited: {misses!r}"


CONSTRUCT = textwrap.dedent("""\
    from shmcache import ShmDatasetCache
    cache = ShmDatasetCache(session="flags", name="c", size=4)
    cache.get(1, lambda k: k)
    cache.close()
    print("made")
""")


@pytest.mark.parametrize(("variable", "value"), [
    ("SHMCACHE_SPILLING", "enabled"),  # meant on, taken as off: nothing spills, the cache just fills up
    ("SHMCACHE_SPILLING", "2"),
    ("SHMCACHE_CLAIMS", "disabled"),  # meant off, taken as on
    ("SHMCACHE_NATIVE", "none"),  # meant off, taken as on
])
def test_an_on_off_variable_set_to_nonsense_is_refused_naming_the_values(tmp_path, variable, value):
    """The README's variables that switch something: SHMCACHE_SIZE_MB=2GB, SHMCACHE_ORDERING=x and
    SHMCACHE_CLAIM_TIMEOUT_S=abc are refused, naming what they take; the on/off ones took any
    other word as their default, silently (SHMCACHE_SPILLING=enabled: not spilling)."""
    e = env()
    e[variable] = value
    e["SHMCACHE_SPILL_DIR"] = str(tmp_path)  # so that spilling, were it on, could start
    done = subprocess.run([sys.executable, "-c", CONSTRUCT], cwd=tmp_path, env=e, capture_output=True, text=True,
                          timeout=90)
    assert done.returncode != 0, f"{variable}={value!r} was taken as a setting: {done.stdout}{done.stderr}"
    last = done.stderr.strip().splitlines()[-1]
    assert f"{variable}={value!r}" in last and "1, true, yes, on" in last and "0, false, no, off" in last, last


# a map-style dataset of n items, item i sixteen int64s of i (each script below starts with it)
ITEMS = textwrap.dedent("""\
    import sys
    import numpy as np
    from torch.utils.data import DataLoader, Dataset
    from shmcache import ShmDatasetCache

    class Items(Dataset):
        def __init__(self, n):
            self.n = n
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            return np.full(16, i, dtype=np.int64)
""")

TRAIN_AND_VAL = ITEMS + textwrap.dedent("""\
    train = ShmDatasetCache(session="tv").wrap(Items(300))
    val = ShmDatasetCache(session="tv").wrap(Items(50))
    for i in range(50):
        assert int(train[i][0]) == i and int(val[i][0]) == i
    print("ok")
""")


def test_a_validation_split_of_the_training_type_is_not_called_an_earlier_version_to_drop(tmp_path):
    """The common script: train and validation splits of one dataset class, wrapped one after the
    other. The second wrap made its cache and logged that 'the Items dataset changed' and that the
    cache of an 'earlier version' - the training split's, open in this very process - should be
    dropped with `shmcache destroy tv --cache ...`: advice that throws away the cache in use. A
    cache that a live process has open is in use, not left behind."""
    (tmp_path / "tv.py").write_text(TRAIN_AND_VAL)
    done = subprocess.run([sys.executable, "tv.py"], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=90)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr
    assert "earlier version" not in done.stderr and "destroy" not in done.stderr, done.stderr


ONE_SPLIT = ITEMS + textwrap.dedent("""\
    ds = ShmDatasetCache(session="tv").wrap(Items(int(sys.argv[1])))
    assert int(ds[3][0]) == 3
""")


def test_an_eval_script_after_the_training_script_is_not_told_the_dataset_changed(tmp_path):
    """The training script ran and exited; an evaluation script then wraps the validation split of
    the same class. Nobody has the training cache open, so nothing tells it from an earlier version
    of the validation split - and the log said as fact that 'the Items dataset changed' and that
    the training cache was 'the cache of an earlier version' to drop. It may be either: the
    line says what it would be in each case."""
    (tmp_path / "split.py").write_text(ONE_SPLIT)
    run(["split.py", "300"], tmp_path, env())  # the training script, done
    done = subprocess.run([sys.executable, "split.py", "50"], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=90)
    assert done.returncode == 0, done.stderr
    said = [ln for ln in done.stderr.splitlines() if "tv/Items-" in ln]
    assert len(said) == 1, done.stderr
    assert "dataset changed" not in said[0] and "if it is an earlier version" in said[0], said[0]
    assert "keep it" in said[0], said[0]


EPOCH = ITEMS + textwrap.dedent("""\
    n = int(sys.argv[1])
    ds = ShmDatasetCache(name=f"items{n}").wrap(Items(n))
    for batch in DataLoader(ds, batch_size=10, shuffle=True):
        pass
""")


def test_the_launchers_closing_summary_counts_this_job_only(tmp_path):
    """The session outlives the job (the README's quick start: "run it again and epoch 1 is warm
    too"), and so do its counters. The closing summary of a second, warm run said `hit ratio 50.0%
    (100 hits, 100 misses) ... computed 100` of a job that computed nothing and missed nothing,
    and listed every other cache of the session too, jobs' ago included: a new user reads that
    the cache did not work. It sums up this job: what its processes read and computed."""
    (tmp_path / "epoch.py").write_text(EPOCH)
    launch = ["-m", "shmcache.launch", "--session", "job"]

    def closing(args) -> dict:
        done = subprocess.run([sys.executable, *launch, "epoch.py", *args], cwd=tmp_path, env=env(),
                              capture_output=True, text=True, timeout=90)
        assert done.returncode == 0, done.stderr
        return {ln.split(":", 2)[1].strip(): ln for ln in done.stderr.splitlines()
                if ln.startswith("shmcache.launch: cache job/")}

    first = closing(["100"])  # fills items100 (wrap()'s 3 probes stored first: 97 misses)
    assert set(first) == {"cache job/items100"} and "(3 hits, 97 misses)" in first["cache job/items100"], first
    closing(["30"])  # another cache of the session, another job
    again = closing(["100"])  # warm: every read a hit; computed: wrap()'s 4 probe reads only
    assert set(again) == {"cache job/items100"}, f"a cache this job never opened is summed up: {again}"
    line = again["cache job/items100"]
    assert "hit ratio 100.0% (100 hits, 0 misses)" in line and "computed 4," in line, line


STREAM = textwrap.dedent("""\
    import json
    import torch
    from torch.utils.data import IterableDataset
    from shmcache import ShmDatasetCache

    class Stream(IterableDataset):
        def __iter__(self):
            return (torch.tensor([i, i * i]) for i in range(50))

    cache = ShmDatasetCache(session="stream")
    ds = cache.wrap(Stream())
    assert [int(x[0]) for x in ds] == list(range(50))  # records
    first = cache.stats()
    assert [int(x[0]) for x in ds] == list(range(50))  # replays
    second = cache.stats()
    print(json.dumps({k: [first[k], second[k]] for k in ("hits", "misses", "computed")}))
""")


def test_an_iterable_datasets_recording_pass_counts_its_misses(tmp_path):
    """`cache.wrap(iterable)` records the first pass and replays later ones (README, Iterable
    datasets). The recording pass computed 50 items and counted 0 misses: `shmcache stat`, `top`
    and the launcher's summary showed a cold first epoch as 0 misses (hit ratio '-', then 100%).
    Each item the pass computes is a miss, as a warm-up's are."""
    counts = json.loads(run(["-c", STREAM], tmp_path, env()).strip().splitlines()[-1])
    assert counts["computed"] == [50, 50], counts
    assert counts["misses"] == [50, 50] and counts["hits"] == [0, 50], counts


FULL = textwrap.dedent("""\
    import numpy as np
    from torch.utils.data import DataLoader, Dataset
    from shmcache import ShmDatasetCache

    class Big(Dataset):
        def __len__(self):
            return 400
        def __getitem__(self, i):
            return np.full(8192, i % 251, dtype=np.uint8)

    ds = ShmDatasetCache(size=1).wrap(Big())
    for batch in DataLoader(ds, batch_size=20, num_workers=2):
        pass
""")


def test_a_full_cache_says_so_once_per_job_not_once_per_process(tmp_path):
    """README, When memory is full: "one log line says so, naming the cap and the fix". A job of 2
    ranks with 2 DataLoader workers each said it 4 times (each process once); 8 GPUs with 8
    workers each would say it 64 times. Once per cache: every process reads the same cap."""
    (tmp_path / "full.py").write_text(FULL)
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--nproc", "2", "--session", "full", "full.py"],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    said = [ln for ln in done.stderr.splitlines() if "stops growing in memory" in ln]
    assert len(said) == 1, "\n".join(said)
    assert "size=1 MiB" in said[0], said[0]


def test_a_memory_directory_given_on_the_command_line_is_not_refused_as_the_variable(tmp_path):
    """`shmcache new NAME --memory-dir DIR` with DIR on a disk is refused (right), with the fix
    'or unset $SHMCACHE_MEMORY_DIR to use /dev/shm' - a variable the user never set. The fix names
    where a memory directory can come from."""
    on_disk = tmp_path / "cache"
    on_disk.mkdir()
    if _on_tmpfs(on_disk):
        pytest.skip(f"{tmp_path} is on a tmpfs here: no disk directory to name")
    e = env()
    e.pop("SHMCACHE_MEMORY_DIR", None)
    done = subprocess.run([sys.executable, "-m", "shmcache", "new", "disk", "--memory-dir", str(on_disk)],
                          cwd=tmp_path, env=e, capture_output=True, text=True, timeout=60)
    assert done.returncode != 0 and "not in memory" in done.stderr, done.stderr
    assert "unset $SHMCACHE_MEMORY_DIR" not in done.stderr, done.stderr
    assert "--memory-dir" in done.stderr and "/dev/shm" in done.stderr, done.stderr


def _on_tmpfs(path: Path) -> bool:
    """Whether ``path`` lies on a tmpfs (the longest mount point of /proc/mounts above it)."""
    best, fs = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        _, point, kind = line.split()[:3]
        if str(path).startswith(point.rstrip("/") + "/") and len(point) > len(best):
            best, fs = point, kind
    return fs == "tmpfs"


WARM_SPLIT = textwrap.dedent("""\
    import json, os, sys, time
    from pathlib import Path
    import numpy as np
    from torch.utils.data import Dataset
    from shmcache import ShmDatasetCache

    class Slow(Dataset):
        def __len__(self):
            return 300
        def __getitem__(self, i):
            time.sleep(0.01)  # a decode
            return np.full(16, i, dtype=np.int64)

    cache = ShmDatasetCache(session="warm")
    ds = cache.wrap(Slow())
    here = Path(sys.argv[1])
    (here / f"ready-{os.environ['RANK']}").touch()
    deadline = time.monotonic() + 60
    while len(list(here.glob("ready-*"))) < 2 and time.monotonic() < deadline:  # warm up together
        time.sleep(0.01)
    computed = cache.warmup(ds, progress=False)
    (here / f"computed-{os.environ['RANK']}").write_text(json.dumps(computed))
""")


def test_two_ranks_warming_up_a_small_dataset_split_the_work(tmp_path):
    """README: `cache.warmup(ds)` - "ranks split the work": each local rank starts at its own
    offset. But a warm-up claims 256 misses at a time, so over 300 items the first rank to claim
    took 256 of them (its offset's 150 and the other rank's first 106) and the other rank
    computed 44 and waited: no faster than one process. Each rank's batches stay within its share."""
    (tmp_path / "warm.py").write_text(WARM_SPLIT)
    done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--nproc", "2", "--session", "warm", "warm.py",
                           str(tmp_path)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    computed = [json.loads((tmp_path / f"computed-{rank}").read_text()) for rank in (0, 1)]
    assert sum(computed) == 297 and max(computed) <= 200, computed  # (wrap() stored its 3 probes)


@pytest.mark.parametrize("tasks", ["foo", "digit", ","])
def test_the_examples_tasks_refuse_a_task_it_does_not_have(tmp_path, tasks):
    """`examples/train.py --tasks foo` (a typo: `digit`) trained nothing and exited 0: a job that
    did nothing looked like one that worked. It must say which task is unknown and what it takes,
    before any process trains."""
    done = subprocess.run([sys.executable, str(ROOT / "examples" / "train.py"), "--tasks", tasks], cwd=tmp_path,
                          env=env(), capture_output=True, text=True, timeout=90)
    assert done.returncode == 2, f"--tasks {tasks!r} exited {done.returncode}: {done.stdout}{done.stderr}"
    last = done.stderr.strip().splitlines()[-1]
    assert repr(tasks) in last and "photos, digits or photos,digits" in last, last
    assert "process(es)" not in done.stdout, done.stdout  # refused before it set anything up


def test_a_relative_shmcache_dir_is_refused_not_taken_from_each_working_directory(tmp_path):
    """`export SHMCACHE_DIR=.shm`, then a warm-up script run in one directory and the training
    script in another: each process took the path from its own working directory, so each had a
    namespace (and caches) of its own, and the training epoch computed everything again, silently.
    A relative path is refused, naming the absolute one it would have been here."""
    for where in ("one", "two"):
        (tmp_path / where).mkdir()
    e = env()
    e["SHMCACHE_DIR"] = ".shm"
    for args in (["-m", "shmcache", "ls"], ["-c", CONSTRUCT]):
        done = subprocess.run([sys.executable, *args], cwd=tmp_path / "one", env=e, capture_output=True, text=True,
                              timeout=90)
        assert done.returncode != 0, f"{args}: {done.stdout}{done.stderr}"
        last = done.stderr.strip().splitlines()[-1]
        assert "$SHMCACHE_DIR=.shm is a relative path" in last and str(tmp_path / "one" / ".shm") in last, last
    assert not (tmp_path / "one" / ".shm").exists() and not (tmp_path / "two" / ".shm").exists()


def test_an_import_with_a_bad_max_item_size_is_refused_before_it_makes_anything(tmp_path):
    """`SHMCACHE_MAX_ITEM_MB=1GB shmcache import SNAPSHOT`: the import made its session and cache,
    then failed on the variable and left the session behind. The variable is checked first."""
    run(["-c", CONSTRUCT], tmp_path, env())  # cache flags/c, one item
    run(["-m", "shmcache", "export", "flags", "c", str(tmp_path / "snap")], tmp_path, env())
    e = env()
    e["SHMCACHE_MAX_ITEM_MB"] = "1GB"
    done = subprocess.run([sys.executable, "-m", "shmcache", "import", str(tmp_path / "snap"), "--session", "imp"],
                          cwd=tmp_path, env=e, capture_output=True, text=True, timeout=90)
    assert done.returncode != 0
    assert "$SHMCACHE_MAX_ITEM_MB='1GB'" in done.stderr, done.stderr
    listed = json.loads(run(["-m", "shmcache", "ls", "--json"], tmp_path, env()))
    assert [s for s in listed if s["session"] == "imp"] == [], listed
