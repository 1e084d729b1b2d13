"""Journeys across processes, run as a user runs them (issue 17, item 5): the README's quick start
through the launcher, and a warm-up script then a training script, each a process of its own with
its own environment (PYTHONPATH kept; ``$SHMCACHE_DIR`` in the test's directory, so the conftest's
clean-up sees what they leave).

The warm-up defines ``Expensive`` and runs as ``__main__``; the training script imports it from
the warm-up's module. Both must name the same cache (NOTE [fingerprint]), so training computes
nothing, and a snapshot of the warm-up's cache is accepted by the training script on another
"machine" (another ``$SHMCACHE_DIR``) - also when the code lives at another path there."""

from __future__ import annotations

import json
import re
import shutil
import textwrap
from pathlib import Path

import pytest
from _journey import env, run

ROOT = Path(__file__).resolve().parents[2]

WARM = textwrap.dedent('''\
    """Warm-up: fill the cache of Expensive (and export it when given a destination)."""
    import sys

    import torch
    from torch.utils.data import Dataset

    from shmcache import ShmDatasetCache


    class Expensive(Dataset):
        computed = 0  # items computed from the source in this process

        def __init__(self, n=64):
            self.n = n

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            Expensive.computed += 1
            return torch.arange(8, dtype=torch.float32) * i, i


    if __name__ == "__main__":
        cache = ShmDatasetCache(session="journey")
        ds = cache.wrap(Expensive())
        cache.warmup(ds, progress=False)
        if len(sys.argv) > 1:
            cache.export(sys.argv[1])
        print("NAME", cache.name)
        cache.close()
''')

TRAIN = textwrap.dedent('''\
    """Training: the warm-up's dataset, imported from it; one epoch through a DataLoader."""
    import json
    import sys

    import torch
    from torch.utils.data import DataLoader

    from shmcache import ShmDatasetCache
    from warm import Expensive

    cache = ShmDatasetCache(session="journey", snapshot=sys.argv[1] if len(sys.argv) > 1 else "")
    ds = cache.wrap(Expensive())
    Expensive.computed = 0  # wrap() reads its probes from the source: the epoch's reads start here
    before = cache.stats()
    seen = 0
    for x, y in DataLoader(ds, batch_size=16, shuffle=True):
        assert torch.equal(x, torch.arange(8, dtype=torch.float32)[None] * y[:, None].float())
        seen += len(y)
    after = cache.stats()
    print(json.dumps({"name": cache.name, "seen": seen, "computed": Expensive.computed,
                      "misses": after["misses"] - before["misses"],
                      "snapshot_hits": after.get("snapshot_hits", 0)}))
    cache.close()
''')




def _code(where: Path) -> Path:
    where.mkdir(parents=True)
    (where / "warm.py").write_text(WARM)
    (where / "train.py").write_text(TRAIN)
    return where



def test_warmup_script_then_training_script_share_one_cache(tmp_path):
    """The issue's journey: warm-up as __main__ named its cache Expensive-a802180e0acd, training
    (importing Expensive) Expensive-99e976f451d0 and computed 61 of 64 items again."""
    code = _code(tmp_path / "code")
    warm = run(["warm.py"], code, env())
    name = re.search(r"NAME (\S+)", warm).group(1)
    got = json.loads(run(["train.py"], code, env()))
    assert got["name"] == name and name.startswith("Expensive-")
    assert got["seen"] == 64
    assert got["computed"] == 0 and got["misses"] == 0, got


def test_a_snapshot_of_the_warmup_feeds_training_on_another_machine_with_the_code_elsewhere(tmp_path,
                                                                                             other_machine):
    """Machine A runs the warm-up as __main__ and exports; machine B (another $SHMCACHE_DIR, the
    code copied to another path) trains, reading the snapshot through: it is accepted (it was
    refused with CacheMismatch), and nothing is computed."""
    code_a = _code(tmp_path / "a" / "code")
    snap = tmp_path / "snap"
    name = re.search(r"NAME (\S+)", run(["warm.py", snap], code_a, env())).group(1)
    code_b = tmp_path / "b" / "elsewhere" / "project"
    shutil.copytree(code_a, code_b)
    got = json.loads(run(["train.py", snap], code_b, env(other_machine)))
    assert got["name"] == name
    assert got["seen"] == 64 and got["computed"] == 0, got
    assert got["snapshot_hits"] == 64 - 3  # all but wrap()'s probes, which it computed and stored


_NAMES_OF = textwrap.dedent('''\
    """The cache name of Expensive imported from each copy of warm.py given (each as module warm)."""
    import importlib.util
    import sys

    from shmcache import ShmDatasetCache

    for path in sys.argv[1:]:
        spec = importlib.util.spec_from_file_location("warm", path)
        module = importlib.util.module_from_spec(spec)
        sys.modules["warm"] = module
        spec.loader.exec_module(module)
        cache = ShmDatasetCache(session="ids")
        cache.wrap(module.Expensive())
        print(cache.name)
        cache.close()
''')


def test_the_same_class_at_another_path_or_run_as_main_gets_the_same_identity(tmp_path):
    """Defined in __main__ (`python warm.py`), and imported from two copies of the code at two
    paths: one name. Another __getitem__ (item 7 differs: not a probe) is another dataset."""
    one, two, edited = _code(tmp_path / "one"), _code(tmp_path / "two" / "deeper"), _code(tmp_path / "edited")
    (edited / "warm.py").write_text(WARM.replace("Expensive.computed += 1",
                                                 "Expensive.computed += 1\n        i = i if i != 7 else 8"))
    (tmp_path / "names_of.py").write_text(_NAMES_OF)
    as_main = re.search(r"NAME (\S+)", run(["warm.py"], one, env())).group(1)
    names = run(["names_of.py", one / "warm.py", two / "warm.py", edited / "warm.py"], tmp_path, env()).split()
    assert names[0] == names[1] == as_main, (as_main, names)
    assert names[2] != as_main


@pytest.mark.timeout(300)  # two launcher runs of 2 processes each: ~25 s on 2 loaded cores
def test_the_readme_quick_start_runs_and_its_second_run_is_warm(tmp_path):
    """The quick start's command (smaller: 64 photo crops), twice: the launcher, 2 processes, one
    cache; epoch 2 and the whole second run read it (no new misses)."""
    cmd = ["-m", "shmcache.launch", "--nproc", "2", str(ROOT / "examples" / "train.py"), "--tasks", "photos",
           "--photos", "64"]
    first = run(cmd, tmp_path, env(), timeout=110)
    lines = re.findall(r"\[photos\] epoch\s+(\d+).*cache: (\d+) items, (\d+) hits, (\d+) misses", first)
    assert [e for e, *_ in lines] == ["1", "2"], first
    (_, items, _, misses), (_, items2, hits2, misses2) = lines
    assert items == items2 == "64" and misses2 == misses and int(hits2) >= 64
    assert re.search(r"default\s+PhotoCrops-\w+\s+PhotoCrops\s+64\s", first), first  # the stat table it prints
    second = run(cmd[:-1] + ["64", "--photo-epochs", "1"], tmp_path, env(), timeout=110)
    (_, items3, _, misses3), = re.findall(r"\[photos\] epoch\s+(\d+).*cache: (\d+) items, (\d+) hits, "
                                          r"(\d+) misses", second)
    assert items3 == "64" and misses3 == misses, second  # the session outlived the first job
