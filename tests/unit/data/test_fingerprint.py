"""The dataset fingerprint (shmcache/data/fingerprint.py, NOTE [fingerprint]): it separates datasets and
transforms that differ where the probe samples cannot see it, and it is the same in every process,
whatever the string hash seed, the process id or a call counter."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset

from shmcache import ShmDatasetCache
from shmcache.cache import codec
from shmcache.data.fingerprint import fingerprint

PROBES = (0, 2, 3)  # what wrap() reads of a 4-item dataset: 0, n // 2 and n - 1


class Private(Dataset):
    """Items come from a private list; the probes see items 0, 2 and 3 only."""

    def __init__(self, items, **state):
        self._items = list(items)
        self.__dict__.update(state)

    def __len__(self):
        return len(self._items)

    def __getitem__(self, i):
        return np.full(2, self._items[i])


def _fp(dataset, transform=None) -> str:
    samples = [codec.encode(transform(dataset[i]) if transform else dataset[i]) for i in PROBES]
    return fingerprint(dataset, transform, samples)


def test_private_data_attributes_separate_datasets_the_probes_cannot_tell_apart():
    assert _fp(Private([0, 1, 2, 3])) != _fp(Private([0, 99, 2, 3]))
    assert _fp(Private([0, 1, 2, 3])) == _fp(Private([0, 1, 2, 3]))


def test_private_numbers_do_not_split_one_dataset_into_per_process_caches():
    a = Private([0, 1, 2, 3], _pid=os.getpid(), _rank=0, _calls=7)
    b = Private([0, 1, 2, 3], _pid=os.getpid() + 1, _rank=1, _calls=0)
    assert _fp(a) == _fp(b)
    assert _fp(Private([0, 1, 2, 3], rank=0)) != _fp(Private([0, 1, 2, 3], rank=1))  # public: data


def test_objects_in_attributes_are_skipped_not_hashed_by_address():
    class Handle:
        pass

    assert _fp(Private([0, 1, 2, 3], _env=Handle(), files={"x": Handle()})) == \
        _fp(Private([0, 1, 2, 3], _env=Handle(), files={"x": Handle()}))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float16, torch.int64])
def test_tensor_attributes_of_any_dtype_count_by_value(dtype):
    emb = torch.zeros(4, dtype=dtype)
    other = emb.clone()
    other[1] = 1
    assert _fp(Private([0, 1, 2, 3], emb=emb)) == _fp(Private([0, 1, 2, 3], emb=emb.clone()))
    assert _fp(Private([0, 1, 2, 3], emb=emb)) != _fp(Private([0, 1, 2, 3], emb=other))


@pytest.mark.parametrize("tensor", [torch.zeros(3, 3).to_sparse(),
                                    torch.empty(3, device="meta"),
                                    torch.zeros(2, dtype=torch.complex64).conj()],
                         ids=["sparse", "meta", "conj"])
def test_tensor_attributes_the_codec_cannot_take_apart_still_wrap(tensor):
    with ShmDatasetCache(session="fp", size=16) as cache:
        ds = cache.wrap(Private([0, 1, 2, 3], extra=tensor))
        assert ds[1].tolist() == [1, 1]


def test_transforms_count_by_their_code_and_the_data_they_close_over():
    ds = Private([0, 1, 2, 3])
    first, second = (lambda x: x * 1 if x[0] != 1 else x * 5), (lambda x: x * 1 if x[0] != 1 else x * 7)
    assert _fp(ds, first) != _fp(ds, second)  # same probes (item 1 is not one), other code

    def scaled(k):
        return lambda x: x * k

    assert _fp(ds, scaled(2)) != _fp(ds, scaled(3))
    assert _fp(ds, scaled(2)) == _fp(ds, scaled(2))
    assert _fp(ds, functools.partial(np.multiply, 2)) != _fp(ds, functools.partial(np.multiply, 3))


class Holder:
    """A dataset whose identity lives in its attributes alone (no probe samples)."""

    def __init__(self, **state):
        self.__dict__.update(state)

    def __len__(self):
        return 4


def _fp_of(**state) -> str:
    return fingerprint(Holder(**state), None, [])


# past the 100,000 items the fingerprint once stopped at: an edit at EDIT and at the last item
N, EDIT = 120_000, 110_000


def _labels():
    return [i % 1000 for i in range(N)]


def _paths():
    return [f"/data/train/n{i % 1000:08d}/img_{i}.JPEG" for i in range(N)]


def _set(i, v):
    def edit(x):
        x[i] = v
    return edit


_P_EDIT = f"/data/train/n{EDIT % 1000:08d}/img_{EDIT}.JPEG"


@pytest.mark.parametrize("make, edit", [
    (_labels, _set(EDIT, 7)),
    (_labels, _set(N - 1, 7)),
    (lambda: [float(x) for x in _labels()], _set(EDIT, 0.5)),
    (_paths, _set(EDIT, "/data/train/n00000000/other.JPEG")),
    (lambda: list(zip(_paths(), _labels())), _set(EDIT, (_P_EDIT, 999))),
    (lambda: list(zip(_paths(), _labels())), _set(N - 1, ("/elsewhere.JPEG", 999))),
    (lambda: dict(zip(_paths(), _labels())), _set(_P_EDIT, 999)),
    (lambda: {i: [i, i + 1] for i in range(N)}, _set(EDIT, [0, 0])),
    (lambda: [[i, [i % 7, str(i)]] for i in range(N)], lambda x: x[EDIT][1].__setitem__(1, "x")),
    (lambda: [[i] * (i % 3) for i in range(N)], _set(EDIT, [1, 2])),
    (lambda: ["a\0b", "c"] * (N // 2), _set(EDIT, "a\0bc")),  # a separator inside an item
    (lambda: np.array(_paths(), dtype=object), _set(EDIT, "changed")),
    (lambda: set(_paths()), lambda x: x.add("one more")),
], ids=["ints", "ints-last", "floats", "paths", "path-label-pairs", "pairs-last", "dict-values",
        "dict-of-lists", "nested", "ragged", "nul-in-str", "object-array", "set"])
def test_an_edit_anywhere_in_a_large_container_changes_the_fingerprint(make, edit):
    """The fingerprint used to stop at 100,000 items: a relabelling past them reused the cache."""
    other = make()
    edit(other)
    assert _fp_of(labels=make()) == _fp_of(labels=make())
    assert _fp_of(labels=make()) != _fp_of(labels=other)


def test_an_edit_at_the_end_of_a_long_str_changes_the_fingerprint():
    text = "x" * 200_000  # was cut at 64 KiB
    assert _fp_of(labels=text) != _fp_of(labels=text[:-1] + "y")


def test_large_arrays_are_hashed_completely():
    arr = np.zeros(300 << 20, np.uint8)  # past the old 256 MiB budget, after which only dtype and shape counted
    before = _fp_of(x=arr)
    arr[-1] = 1
    assert _fp_of(x=arr) != before
    arr[-1] = 0
    assert _fp_of(x=arr) == before


def test_a_memmapped_array_counts_by_its_file_not_its_bytes(tmp_path):
    path = tmp_path / "images.u8"
    np.arange(1 << 20, dtype=np.uint8).tofile(path)
    a = np.memmap(path, np.uint8, "r")
    assert _fp_of(x=a) == _fp_of(x=np.memmap(path, np.uint8, "r"))
    assert _fp_of(x=a[:10]) != _fp_of(x=a[10:20])
    before = _fp_of(x=a)
    del a
    with open(path, "r+b") as f:  # rewritten: another modification time
        f.seek((1 << 20) - 1)
        f.write(b"\1")
    os.utime(path, ns=(os.stat(path).st_atime_ns, os.stat(path).st_mtime_ns + 10**9))
    assert _fp_of(x=np.memmap(path, np.uint8, "r")) != before


def test_objects_in_attributes_count_by_their_attributes():
    """A dataset over another dataset (a Subset, a wrapper) is told apart by the inner one's data."""
    assert _fp_of(inner=Holder(labels=[1, 2, 3])) != _fp_of(inner=Holder(labels=[1, 2, 4]))
    assert _fp_of(inner=Holder(labels=[1, 2, 3], _pid=1)) == _fp_of(inner=Holder(labels=[1, 2, 3], _pid=2))
    cyclic = Holder()
    cyclic.me = cyclic
    assert _fp_of(inner=cyclic) == _fp_of(inner=cyclic)


class Scale:
    def __init__(self, k):
        self.k = k

    def __call__(self, x):
        return x * self.k


class Compose:
    def __init__(self, transforms):
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


def test_callable_objects_count_by_type_and_attributes_through_a_compose():
    ds = Private([0, 0, 0, 0])  # every item is 0: the probes agree whatever the scale
    assert _fp(ds, Compose([Scale(2), Scale(3)])) != _fp(ds, Compose([Scale(2), Scale(4)]))
    assert _fp(ds, Compose([Scale(2), Scale(3)])) == _fp(ds, Compose([Scale(2), Scale(3)]))


_OTHER_PROCESS = textwrap.dedent("""
    import sys
    import numpy as np
    from torch.utils.data import Dataset
    from shmcache.cache import codec
    from shmcache.data.fingerprint import fingerprint

    class Tagged(Dataset):
        def __init__(self):
            self.vocab = {"cat", "dog", "emu", "yak"}
            self.meta = {"cat": 1, "dog": 2}

        def __len__(self):
            return 4

        def __getitem__(self, i):
            return {"x": np.arange(3) + i, "tags": {"a", "b", "c", str(i)}}  # a set: pickled

    def keep(sample):
        return sample if sample["x"][0] not in {"no", "nope", "nah", "nix", "nil", "non", "nein", "njet"} else None

    ds = Tagged()
    print(fingerprint(ds, keep, [codec.encode(keep(ds[i])) for i in (0, 2, 3)]))
""")


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_the_same_dataset_gets_the_same_fingerprint_whatever_the_string_hash_seed(tmp_path):
    """Sets in samples (pickled), in attributes and in a transform's constants are ordered by the
    hash seed, which differs per process: the name of the cache must not."""
    script = tmp_path / "fp.py"
    script.write_text(_OTHER_PROCESS)
    seen = set()
    for seed in ("1", "2", "3"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        seen.add(subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                                check=True, timeout=120).stdout.strip())
    assert len(seen) == 1, seen


# --- identity across processes and checkouts (issue 17, item 2; NOTE [fingerprint]) ---------------


def test_a_class_of_a_script_run_as_main_is_named_as_the_module_it_is_imported_as(monkeypatch):
    """`python warm.py` (module __main__, file warm.py), `python -m pkg.warm` (its spec) and `from
    pkg.warm import Expensive` name one type; no path counts."""
    import types

    from shmcache.data.fingerprint import type_name

    def cls(module):
        return type("Expensive", (Dataset,), {"__module__": module})

    script = types.ModuleType("__main__")
    script.__file__, script.__spec__ = "/home/me/checkout-1/warm.py", None
    monkeypatch.setitem(sys.modules, "__main__", script)
    assert type_name(cls("__main__")) == "warm.Expensive"
    script.__file__ = "/elsewhere/checkout-2/warm.py"
    assert type_name(cls("__main__")) == "warm.Expensive"
    script.__spec__ = types.SimpleNamespace(name="pkg.warm")  # python -m pkg.warm
    assert type_name(cls("__main__")) == "warm.Expensive"
    assert type_name(cls("pkg.warm")) == type_name(cls("warm")) == "warm.Expensive"


_CLASS = '''
class Items(Dataset):
    def __init__(self):
        self.n = 4

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(2, {value})
'''


def _exec_class(value: str):
    """A class defined by exec (no file: inspect.getsource cannot read it), in module ``data``."""
    scope = {"Dataset": Dataset, "np": np, "__name__": "data"}
    exec(_CLASS.format(value=value), scope)  # noqa: S102 - the test's own text
    return scope["Items"]


def test_the_class_code_counts_where_the_probes_cannot_see_it():
    """Two versions of a class that agree on name, attributes and probe samples (items 0, 2, 3)
    but compute item 1 differently are two datasets; the same code twice is one."""
    a, b, c = _exec_class("i"), _exec_class("i"), _exec_class("i if i != 1 else 7")
    assert _fp(a()) == _fp(b())
    assert all(np.array_equal(a()[i], c()[i]) for i in PROBES)
    assert _fp(a()) != _fp(c())
