"""A wrapped dataset stands in for its dataset (issue 30): namedtuple samples stored as containers
and returned as their own type, indices that are not ints meaning what the dataset makes of them,
``__getitems__`` datasets, bounded probes at wrap(), the dataset's errors raised where the
DataLoader reads (labelled), and a dataset that grows after wrap() noticed."""

from __future__ import annotations

import collections
import dataclasses
import marshal
import sys
import threading
import warnings
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from shmcache import ShmDatasetCache
from shmcache.cache import codec
from shmcache.data import probes
from shmcache.errors import InvalidArgument, ProbeTimeout

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _workers import assert_same  # noqa: E402

Batch = collections.namedtuple("Batch", "data label")


class Pair(NamedTuple):
    image: torch.Tensor
    meta: dict


class Batches(Dataset):
    def __init__(self, n=6):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return Batch(torch.full((3,), float(i)), i)


def _cache(**kw):
    kw.setdefault("session", "standin")
    kw.setdefault("size", 16)
    return ShmDatasetCache(**kw)


# --- namedtuples are containers ----------------------------------------------------------------


def test_a_deterministic_dataset_of_namedtuples_is_wrapped_and_served_as_namedtuples():
    src = Batches()
    with _cache() as cache, warnings.catch_warnings():
        warnings.simplefilter("error")  # stored field by field: no pickle warning
        ds = cache.wrap(src)
        for i in range(len(src)):
            assert_same(ds[i], src[i])
            assert_same(ds[i], src[i])  # a hit
        for batch_size in (None, 4):
            assert_same(list(DataLoader(ds, batch_size=batch_size)), list(DataLoader(src, batch_size=batch_size)))
        assert not cache.stats().get("pickled")


def test_a_namedtuple_class_pickle_cannot_find_is_stored_and_returned_as_itself():
    Local = collections.namedtuple("Local", ["x", "tags"])  # pickle cannot find it by name

    class Src(Dataset):
        def __len__(self):
            return 5

        def __getitem__(self, i):
            return Pair(torch.arange(i + 1), {"pt": Local(np.float32(i), ["a", str(i)])})

    with _cache() as cache:
        ds = cache.wrap(Src())
        for i in range(5):
            assert_same(ds[i], Src()[i])
            assert type(ds[i].meta["pt"]) is Local


def test_a_record_names_a_namedtuple_never_a_class_to_import():
    """A layout from a stranger names its class: decoding makes a namedtuple of those fields and
    imports nothing, resolves nothing by that name."""
    enc = codec.encode(Batch(np.arange(2), 7))
    node = marshal.loads(enc.layout)
    assert node[:3] == ("N", "Batch", ("data", "label"))
    forged = marshal.dumps(("N", "shmcache_never_imported.os.system", ("cmd", "label"), node[3]), 4)
    assert codec.check_layout(forged).problem is None
    buf = bytearray(enc.record_len(0, False))
    enc.write(memoryview(buf), 1, b"")
    got = codec.decode(buf, forged)
    assert "shmcache_never_imported" not in sys.modules
    assert got._fields == ("cmd", "label") and got.label == 7 and type(got) is not Batch
    assert type(got).__qualname__ == "shmcache_never_imported.os.system"
    import pickle

    again = pickle.loads(pickle.dumps(got))  # a made class pickles by its names
    assert type(again) is type(got) and again.cmd.tolist() == [0, 1]


@pytest.mark.parametrize(
    "name, fields, why",
    [
        ("Batch", ("data", "__class__"), "field"),
        ("Batch", ("data", "class"), "field"),
        ("Batch", ("data", "data"), "distinct"),
        ("Batch", ("data",), "differ in number"),
        ("a b", ("data", "label"), "qualified name"),
        ("B" * 300, ("data", "label"), "qualified name"),
        (("x",), ("data", "label"), "qualified name"),
    ],
)
def test_a_namedtuple_node_with_names_the_encoder_never_writes_is_refused(name, fields, why):
    node = marshal.loads(codec.encode(Batch(1, 2)).layout)
    bad = marshal.dumps(("N", name, fields, node[3]), 4)
    problem = codec.check_layout(bad).problem
    assert problem is not None and why in problem


@dataclasses.dataclass
class Sample:  # pickled (not a container the codec knows)
    data: torch.Tensor
    extra: dict


def test_samples_whose_encodings_differ_but_values_are_equal_are_not_called_random():
    """Keys in another order (a dict built from a set, a pickled object holding one) encode
    differently; the values are the same: not random."""

    class Src(Dataset):
        reads = 0

        def __len__(self):
            return 3

        def __getitem__(self, i):
            Src.reads += 1
            keys = ["a", "b"] if Src.reads % 2 else ["b", "a"]
            return {k: torch.full((2,), i) for k in keys}, Sample(torch.ones(1), {k: i for k in keys})

    with _cache() as cache, pytest.warns(UserWarning, match="stored with pickle"):
        ds = cache.wrap(Src())
        got = ds[1]
        assert torch.equal(got[0]["a"], torch.full((2,), 1)) and got[1].extra == {"a": 1, "b": 1}


def test_a_random_dataset_is_still_called_random_by_its_values():
    class Noisy(Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return Batch(torch.randn(2), i)

    with _cache() as cache, pytest.raises(InvalidArgument, match=r"Noisy\[0\] differs between two reads"):
        cache.wrap(Noisy())


# --- indices that are not ints -------------------------------------------------------------------


class ListIndexed(Dataset):
    """A dataset that takes a list of indices itself (the batch_size=None pattern)."""

    def __len__(self):
        return 6

    def __getitem__(self, i):
        if isinstance(i, list):
            return [10 * j for j in i]
        if isinstance(i, slice):
            return list(range(*i.indices(6)))
        return 10 * i


def test_a_list_index_means_what_the_dataset_makes_of_it():
    src = ListIndexed()
    with _cache() as cache:
        ds = cache.wrap(src)
        assert_same(ds[[1, 2, 3]], [10, 20, 30])
        assert_same(ds[1:4], [1, 2, 3])
        assert_same(ds[-1], 50)
        sampler = [[0, 1], [2, 3], [4, 5]]
        assert_same(
            list(DataLoader(ds, batch_size=None, sampler=sampler)),
            list(DataLoader(src, batch_size=None, sampler=sampler)),
        )


def test_a_list_index_the_dataset_refuses_is_a_batch_from_the_cache():
    with _cache() as cache:
        ds = cache.wrap(Batches())
        got = ds[[1, 2]]
        assert isinstance(got, Batch) and got.label.tolist() == [1, 2]
        with pytest.raises(ValueError, match="could not convert string to float"):
            ds["x"]  # the dataset's own error (Batches takes ints)


class WithGetitems(Dataset):
    def __init__(self):
        self.batches = []

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return {"x": torch.tensor([i, -i]), "y": i % 3}

    def __getitems__(self, indices):
        self.batches.append(list(indices))
        return [self[i] for i in indices]


def test_getitems_datasets_keep_torchs_contract_and_compute_misses_by_their_own_getitems():
    src = WithGetitems()
    with _cache() as cache:
        ds = cache.wrap(src)
        # wrap()'s probes (0, n/2, n-1, and 0 again) are read as the DataLoader reads: a row of
        # __getitems__, which can differ from the dataset's own ds[i] (Hugging Face's formats)
        assert src.batches == [[0], [4], [7], [0]]
        src.batches.clear()
        got = ds.__getitems__([1, 3, 5])
        assert isinstance(got, list) and len(got) == 3
        assert_same(got, [src[i] for i in (1, 3, 5)])
        assert src.batches == [[1, 3, 5]]
        assert_same(list(DataLoader(ds, batch_size=3)), list(DataLoader(WithGetitems(), batch_size=3)))


def test_getitems_that_breaks_torchs_contract_is_refused_clearly():
    class Broken(WithGetitems):
        def __getitems__(self, indices):
            return {"x": torch.stack([self[i]["x"] for i in indices])}

    with _cache() as cache:
        ds = cache.wrap(Broken())
        with pytest.raises(InvalidArgument, match=r"Broken.__getitems__ of 2 indices returned dict"):
            ds.__getitems__([1, 2])



def test_getitems_that_returns_a_tuple_of_samples_is_read_as_torch_reads_it():
    """A ``__getitems__`` returning a tuple of one sample per index: torch's DataLoader collates it
    as it does a list, and before the day's change the wrapped ds[i] read it fine. Since every
    value is read through __getitems__, every ds[i] raised 'returned tuple, not a list of 1
    samples ... return one sample per index' - which it did."""
    class Tuples(WithGetitems):
        def __getitems__(self, indices):
            return tuple(super().__getitems__(indices))

    with _cache() as cache:
        ds = cache.wrap(Tuples())
        assert_same(ds[1], Tuples()[1])
        assert_same(list(DataLoader(ds, batch_size=3)), list(DataLoader(Tuples(), batch_size=3)))


# --- probes at wrap() ---------------------------------------------------------------------------


class Waits(Dataset):
    """A __getitem__ that waits for an event (a barrier that only DataLoader workers pass)."""

    def __init__(self):
        self.go = threading.Event()
        self.reads = 0

    def __len__(self):
        return 4

    def __getitem__(self, i):
        self.reads += 1
        assert self.go.wait(30), "never released"
        return np.full(2, i)


def test_a_probe_that_does_not_return_is_abandoned_naming_the_dataset_and_fingerprint(monkeypatch):
    monkeypatch.setattr(probes, "PROBE_TIMEOUT_S", 0.2)
    src = Waits()
    try:
        with _cache() as cache:
            with pytest.raises(ProbeTimeout, match=r"Waits\[0\].*fingerprint="):
                cache.wrap(src)
        with _cache() as cache:
            reads = src.reads
            ds = cache.wrap(src, fingerprint="waits-v1")  # nothing read
            assert src.reads == reads
            src.go.set()
            assert ds[3].tolist() == [3, 3]
            assert cache.stats()["misses"] == 1
    finally:
        src.go.set()  # the abandoned probe thread ends


def test_fingerprint_names_the_contents_the_same_in_every_wrap():
    src = Batches()
    with _cache() as one, _cache() as two, _cache() as other:
        a = one.wrap(src, fingerprint="v1")
        b = two.wrap(Batches(), fingerprint="v1")
        c = other.wrap(src, fingerprint="v2")
        assert one.name == two.name != other.name
        a[2]
        assert b.cache.stats()["items_mem"] == 1 and c.cache.stats()["items_mem"] == 0
        with pytest.raises(InvalidArgument, match="fingerprint must be"):
            one.wrap(src, fingerprint="")


# --- errors of the dataset --------------------------------------------------------------------


class Raises(Dataset):
    def __len__(self):
        return 5

    def __getitem__(self, i):
        if i == 2:  # one of wrap()'s probes (0, 2, 4)
            raise ValueError(f"bad sample {i}")
        return np.full(2, i)


def test_a_dataset_that_raises_fails_where_the_dataloader_reads_with_its_own_error_labelled():
    with _cache() as cache:
        ds = cache.wrap(Raises())  # no error here: the DataLoader would not raise at this point
        assert ds[1].tolist() == [1, 1]
        with pytest.raises(ValueError, match="bad sample 2") as info:
            ds[2]
        if sys.version_info >= (3, 11):
            assert any("Raises[2]" in n and "cache miss" in n for n in info.value.__notes__)
        with pytest.raises(ValueError, match="bad sample 2"):
            list(DataLoader(ds, batch_size=2))
        with pytest.raises(ValueError, match="bad sample 2"):
            list(DataLoader(Raises(), batch_size=2))



class RaisesOneByOne(Raises):
    __getitems__ = None  # torch's fetcher then reads it one index at a time (it checks the hook's truth)


def test_the_note_on_an_error_names_the_call_that_raised():
    """A dataset that opts out of batched reads (``__getitems__ = None``) is read by ``ds[i]``,
    and its error's note said ``RaisesOneByOne.__getitems__([2])``: a call that was never made,
    which sent the user to a method the class does not have."""
    with _cache() as cache:
        ds = cache.wrap(RaisesOneByOne())
        with pytest.raises(ValueError, match="bad sample 2") as info:
            ds[2]
        if sys.version_info >= (3, 11):
            assert any("RaisesOneByOne[2]" in n for n in info.value.__notes__), info.value.__notes__


# --- a dataset that grows ------------------------------------------------------------------------


def test_a_dataset_that_grows_after_wrap_is_said_once():
    class Growing(Dataset):
        def __init__(self):
            self.items = [1, 2, 3, 4]

        def __len__(self):
            return len(self.items)

        def __getitem__(self, i):
            return self.items[i]

    src = Growing()
    with _cache() as cache:
        ds = cache.wrap(src)
        assert len(list(DataLoader(ds, batch_size=None))) == 4
        src.items.append(5)
        with pytest.warns(UserWarning, match=r"Growing has 5 items now, 4 when it was wrapped.*wrap it again"):
            assert len(list(DataLoader(ds, batch_size=None))) == 4
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            len(ds)  # said once


class Columns(Dataset):
    """Its columns reachable as attributes (``ds.labels``) through ``__getattr__``, which raises
    KeyError, not AttributeError, for any other name - as many such classes do."""

    def __init__(self):
        self.columns = {"labels": np.arange(6)}

    def __getattr__(self, name):
        return self.__dict__["columns"][name]

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return self.labels[i]


class FingerprintOfFiles(Dataset):
    """A fingerprint of itself computed from its files when asked (the files went away later)."""

    def __init__(self, folder: Path):
        self.folder = str(folder)

    @property
    def _fingerprint(self) -> str:
        return str(Path(self.folder, "index").stat().st_mtime_ns)

    def __len__(self):
        return 6

    def __getitem__(self, i):
        return float(i)


def test_the_check_for_a_dataset_changed_in_place_never_breaks_wrap_nor_an_epoch(tmp_path):
    """wrap() asks every dataset for ``_fingerprint`` (Hugging Face's), and each epoch's len()
    asks again: a ``__getattr__`` that raises KeyError for a name it lacks broke wrap() (it read
    its items fine before; asked for ``__getitems__`` the same way, its batch misses broke), and a
    ``_fingerprint`` that raised once its files were gone broke the DataLoader's len() - a check
    for a warning raising into the training loop."""
    with _cache() as cache:
        ds = cache.wrap(Columns())
        assert int(ds[3]) == 3 and len(ds) == 6
        assert torch.cat(list(DataLoader(ds, batch_size=4))).tolist() == list(range(6))
    with _cache() as cache:
        (tmp_path / "index").touch()
        ds = cache.wrap(FingerprintOfFiles(tmp_path))
        (tmp_path / "index").unlink()
        assert len(list(DataLoader(ds, batch_size=None))) == 6
