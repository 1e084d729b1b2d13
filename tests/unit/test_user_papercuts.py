"""The smaller things a new user hits (issue 17): each where it starts."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from shmcache import ShmDatasetCache
from shmcache.cache.registry import SessionRegistry
from shmcache.cli.main import main as cli
from shmcache.errors import SessionNotFound, SpillError

ROOT = Path(__file__).resolve().parents[2]


class Squares(Dataset):
    def __init__(self, n: int = 64, stop_at: int | None = None):
        self.n, self.stop_at = n, stop_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.stop_at is not None and i == self.stop_at:
            raise KeyboardInterrupt
        return torch.tensor([i], dtype=torch.int64)


class Named(Squares):
    def __repr__(self):
        return f"Named(n={self.n}, root='/data/set-{self.n}')"


# --- the warm-up's progress bar -------------------------------------------------------------------


def test_warmup_bar_counts_items_as_they_are_stored_and_on_ctrl_c(capfd):
    """3,000 items (under the 4,096 of a chunk): the bar sat at 0 to the end, and Ctrl-C showed 0
    with 182 stored. Its last line must be the count stored."""
    cache = ShmDatasetCache(size=16)
    ds = cache.wrap(Squares(3000, stop_at=182 + 3))  # wrap() stores 3 probes: 0, 1500, 2999
    capfd.readouterr()
    with pytest.raises(KeyboardInterrupt):
        cache.warmup(ds, progress=True)
    err = capfd.readouterr().err
    stored = cache.stats()["items_mem"]
    assert stored == 185 + 2  # 0..184, and the probes 1500 and 2999 (wrap stored them)
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    assert re.search(r"\b187/3000\b", last), last  # the bar's last line: what is stored


# --- the README's feeding snippet ---------------------------------------------------------------


def test_readme_feeding_snippet_reshuffles_every_epoch():
    text = (ROOT / "README.md").read_text()
    block = text.split("### Feeding the device", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    cache = ShmDatasetCache(size=16)
    ds = cache.wrap(Squares(512))
    cache.warmup(ds, progress=False)
    firsts: list[list[int]] = []

    def step_fn(batch):
        if len(firsts) < 10 and (not firsts or len(firsts[-1]) == 512):
            firsts.append([])
        firsts[-1].extend(batch.reshape(-1).tolist())
        return torch.zeros(())

    env = {"ds": ds, "step_fn": step_fn}
    exec(compile(block.replace('device="cuda"', 'device="cpu"'), "README.md", "exec"), env)  # noqa: S102
    assert len(firsts) == 10 and all(sorted(f) == list(range(512)) for f in firsts)
    assert len({tuple(f) for f in firsts}) == 10, "every epoch saw the same order"


# --- session= -------------------------------------------------------------------------------------


def test_a_misspelled_session_is_said_once_and_create_false_refuses(caplog):
    SessionRegistry().create("imagenet")
    with caplog.at_level(logging.INFO, logger="shmcache"):
        ShmDatasetCache(session="imagnet", name="c").close()
        ShmDatasetCache(session="imagnet", name="d").close()
    said = [r for r in caplog.records if "imagnet" in r.getMessage()]
    assert len(said) == 1 and said[0].levelno == logging.WARNING
    assert "imagenet" in said[0].getMessage() and "create=False" in said[0].getMessage()
    with pytest.raises(SessionNotFound, match=r"'imagenett'.*imagenet.*imagnet"):
        ShmDatasetCache(session="imagenett", create=False)
    assert not SessionRegistry().exists("imagenett")
    ShmDatasetCache(session="imagenet", name="e", create=False).close()  # an existing one: fine


# --- shmcache import --spilling -------------------------------------------------------------------


def test_import_spilling_without_a_spill_dir_answers_in_cli_terms_and_leaves_nothing(tmp_path, capsys):
    cache = ShmDatasetCache("src", size=8)
    ds = cache.wrap(Squares(20))
    cache.warmup(ds, progress=False)
    cache.export(tmp_path / "snap")
    cache.close()
    code = cli(["import", str(tmp_path / "snap"), "--session", "fresh", "--spilling"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "--spill-dir DIR" in err and "spill_dir=" not in err
    assert not SessionRegistry().exists("fresh")


def test_import_snapshot_spilling_without_a_spill_dir_leaves_no_session(tmp_path):
    from shmcache.snapshot.load import import_snapshot

    cache = ShmDatasetCache("src", size=8)
    cache.warmup(cache.wrap(Squares(20)), progress=False)
    cache.export(tmp_path / "snap")
    cache.close()
    with pytest.raises(SpillError, match="spill directory"):
        import_snapshot(tmp_path / "snap", session="fresh", spilling=True)
    assert not SessionRegistry().exists("fresh")


# --- spill_dir on a filesystem that holds no files ------------------------------------------------


@pytest.mark.parametrize("where", ["/proc", "/sys"])
def test_spill_dir_on_a_kernel_filesystem_says_so(where):
    from shmcache.tiers.spill.files import check_spill_dir

    with pytest.raises(SpillError) as info:
        check_spill_dir(where)
    text = str(info.value)
    assert "No such file or directory" not in text and "chmod" not in text, text
    assert "filesystem of the kernel" in text and "spill_dir" in text


# --- telling caches apart in `shmcache stat` ------------------------------------------------------


def test_stat_shows_a_label_or_the_datasets_repr(capsys):
    a = ShmDatasetCache(size=8)
    a.wrap(Named(10))
    b = ShmDatasetCache(size=8)
    b.wrap(Named(20), label="validation split")
    c = ShmDatasetCache(size=8)
    c.wrap(Squares(30))  # object's own repr: the class name
    d = ShmDatasetCache(size=8)
    d.wrap(Named(40), label="x" * 500)
    assert cli(["stat", "--json"]) == 0
    labels = {row["name"]: row["label"] for row in json.loads(capsys.readouterr().out)}
    assert labels[a.name] == "Named(n=10, root='/data/set-10')"
    assert labels[b.name] == "validation split"
    assert labels[c.name] == "Squares"
    assert len(labels[d.name]) == 80 and labels[d.name].endswith("...")
    assert cli(["stat"]) == 0
    out = capsys.readouterr().out
    assert "validation split" in out and "Named(n=10" in out
    for cache in (a, b, c, d):
        cache.close()


# --- keys -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("key", [torch.tensor(3), np.int64(3), np.array(3), torch.tensor(3, dtype=torch.int32)])
def test_zero_d_integer_keys_are_int_keys(key):
    cache = ShmDatasetCache(size=8)
    ds = cache.wrap(Squares(8))
    assert ds[key].tolist() == [3]
    assert cache.get(key).tolist() == [3] == cache.get(3).tolist()
    cache.put(torch.tensor(5), "five")  # noqa - a put under a tensor key is the int key
    assert cache.get(5) == "five"


def test_float_and_bool_tensors_stay_invalid_keys():
    from shmcache.errors import InvalidKey

    cache = ShmDatasetCache(size=8, name="k")
    for key in (torch.tensor(3.0), torch.tensor(True), torch.tensor([3])):
        with pytest.raises(InvalidKey):
            cache.get(key)


# --- the launcher's -h ----------------------------------------------------------------------------


def test_launcher_help_example_has_no_stray_spaces():
    proc = subprocess.run([sys.executable, "-m", "shmcache.launch", "-h"], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ))
    assert proc.returncode == 0
    examples = proc.stdout.split("Examples:", 1)[1]
    assert not re.search(r"\S {2,}\S", examples), examples
    assert "--master-port 29500 \\\n        --nproc 8" in examples


# --- the read-through's damaged segment -----------------------------------------------------------


def test_a_damaged_segment_is_named_once_with_its_advice_once(tmp_path, caplog):
    src = ShmDatasetCache("src", size=8)
    src.warmup(src.wrap(Squares(20)), progress=False)
    src.export(tmp_path / "snap")
    src.close()
    [segment] = [p for p in (tmp_path / "snap").iterdir() if p.suffix != ".json"]
    with open(segment, "r+b") as f:  # its footer, damaged
        f.seek(-10, os.SEEK_END)
        f.write(b"X" * 10)
    reader = ShmDatasetCache("dst", size=8, snapshot=str(tmp_path / "snap"))
    ds = reader.wrap(Squares(20))
    with caplog.at_level(logging.WARNING, logger="shmcache"):
        assert ds[5].tolist() == [5]  # computed from the source
    [said] = [r.getMessage() for r in caplog.records if "snapshot tier: data file" in r.getMessage()]
    assert said.count(str(segment)) == 1, said
    assert said.count("copy the snapshot again") == 1, said
    reader.close()
