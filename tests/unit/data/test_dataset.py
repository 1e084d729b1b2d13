"""ShmDatasetCache in one process: wrapping, the item and batch paths against the source, the
fingerprint (different datasets never share a cache silently, the same one finds its cache),
capacity as users see it, pickling, and bad arguments at every public entry point."""

from __future__ import annotations

import functools
import os
import pickle
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, default_collate

from shmcache import ShmDatasetCache
from shmcache.cache import codec
from shmcache.cache.store import STAT_KEYS
from shmcache.errors import CacheMismatch, EncodeError, InvalidArgument, ItemTooLarge, ShmcacheError

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration"))
from _workers import FixedDataset, TorchDataset, VarDataset, assert_same, fixed_sample  # noqa: E402


class Labelled(Dataset):
    """Samples (array, label) whose labels come from a list attribute (think: a label file)."""

    def __init__(self, labels):
        self.labels = list(labels)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return np.full(4, i, np.int32), self.labels[i]


class Stream(IterableDataset):
    def __init__(self, items):
        self.items = list(items)
        self.passes = 0

    def __iter__(self):
        self.passes += 1
        return iter(self.items)


class Unpicklable(Dataset):
    """Samples ``bad`` hold a lambda (not storable); wrap() reads samples 0, 5 and 9 itself."""

    def __init__(self, bad=(0,)):
        self.bad = set(bad)

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return (np.zeros(2), (lambda: i) if i in self.bad else i)


@__import__("dataclasses").dataclass
class Point:  # pickled (a dataclass is not a container the codec stores field by field)
    x: int
    y: int


def _cache(**kw):
    kw.setdefault("session", "ds")
    kw.setdefault("size", 64)
    return ShmDatasetCache(**kw)


# --- reading through the cache ---------------------------------------------------------------


def test_wrapped_map_dataset_equals_the_source():
    src = VarDataset(200, 10, 3000)
    with _cache() as cache:
        ds = cache.wrap(src)
        assert len(ds) == 200
        for epoch in range(2):
            for i in range(200):
                assert_same(ds[i], src[i], f"epoch {epoch} item {i}")
        assert_same(ds[-1], src[199])
        assert_same(ds[np.int64(3)], src[3])
        assert_same(ds[torch.tensor(4)], src[4])
        st = cache.stats()
        assert st["items_mem"] == 200
        assert st["hits"] == 200 + 3 + 3 and st["misses"] == 197  # the 3 probes were stored by wrap


class _Alternating(Dataset):
    """Samples of a few flat shapes in turn (the shapes a cache keeps between its batches for
    codec.encode_many), each unlike the first in one way only: its keys in another order, an
    array of another dtype, a str of another length, a transposed tensor, a numpy int or a bool
    where an int was."""

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        img = np.random.default_rng(i).integers(0, 255, (4, 4, 3), dtype=np.uint8)
        t = torch.arange(4.0).reshape(2, 2) + i
        sample = {"img": img, "s": f"row {i:02d}", "t": t, "lab": i}
        kind = i % 6
        if kind == 1:
            return dict(reversed(sample.items()))
        if kind == 2:
            sample["img"] = img.astype(np.float16)
        elif kind == 3:
            sample["s"] = f"row {i}!"
        elif kind == 4:
            sample["t"] = t.t()
        elif kind == 5:
            sample["lab"] = np.int64(i) if i // 6 % 2 else i % 4 == 1
        return sample

    def __getitems__(self, indices: list) -> list:
        return [self[i] for i in indices]


def _samples(batch: list) -> list:
    return batch


@pytest.mark.parametrize("workers", [0, 2])
def test_samples_of_alternating_shapes_through_a_dataloader_equal_the_sources(workers):
    src = _Alternating()
    order = np.random.default_rng(5).permutation(len(src)).tolist()

    def epoch(ds, workers: int) -> list:
        return list(DataLoader(ds, batch_size=6, sampler=order, collate_fn=_samples, num_workers=workers))

    want = epoch(src, 0)
    with _cache(name=f"alternating{workers}") as cache:
        ds = cache.wrap(src)
        for n in range(2):  # cold (each batch encoded through the cache's kept shapes), then warm
            assert_same(epoch(ds, workers), want, f"epoch {n}")
        assert cache.stats()["items_mem"] == len(src)


def test_a_cache_named_before_its_dataset_gets_an_index_sized_for_it():
    # as one wrap() makes for the dataset: misses never wait for a table growth (issue 31)
    src = FixedDataset(5000, 64)
    with _cache(name="sized") as cache:
        ds = cache.wrap(src)
        assert cache.store.view.refresh().index.capacity * 0.7 >= 5000
        batches = list(DataLoader(ds, batch_size=64, shuffle=True))
        assert cache.stats()["items_mem"] == 5000 and len(batches) == 79
        for i in (0, 1234, 4999):
            assert_same(ds[i], src[i])


def test_second_pass_reads_the_cache_not_the_source():
    src = FixedDataset(50, 64)
    with _cache() as cache:
        ds = cache.wrap(src)
        [ds[i] for i in range(50)]
        calls = src.calls
        [ds[i] for i in range(50)]
        ds.__getitems__(list(range(50)))
        ds.get_batch(list(range(50)))
        assert src.calls == calls


def test_transform_is_cached_and_called_once_per_item():
    calls = []

    def double(sample):
        calls.append(sample[1])
        return sample[0].astype(np.int32) * 2, sample[1]

    src = FixedDataset(30, 16)
    with _cache() as cache:
        ds = cache.wrap(src, transform=double)
        for _ in range(3):
            for i in range(30):
                arr, label = ds[i]
                want = fixed_sample(i, 16)
                assert np.array_equal(arr, want[0].astype(np.int32) * 2) and label == want[1]
        assert len(calls) == 30 + 1  # wrap() reads sample 0 twice (its randomness check)


class Items(Dataset):
    """A dataset that indexes a list: the list takes or refuses each index."""

    def __init__(self, n):
        self.items = [np.full(2, i) for i in range(n)]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


@pytest.mark.parametrize("src", [Items(5), FixedDataset(5, 8)], ids=["list", "fixed"])
@pytest.mark.parametrize("bad", [3.0, "1", None, [[1]], (1, 2), True])
def test_indices_that_are_not_ints_are_the_datasets_to_take_or_refuse(bad, src):
    """The wrapper answers an index that is not an int as its dataset does (issue 30): the same
    error type where it refuses one, the same value where it takes one (FixedDataset takes 3.0)."""
    try:
        want = src[bad]
    except (TypeError, IndexError) as exc:
        want = type(exc)
    with _cache() as cache:
        ds = cache.wrap(src)
        if isinstance(want, type):
            with pytest.raises(want):
                ds[bad]
        else:
            assert_same(ds[bad], want)


@pytest.mark.parametrize("i", [5, 6, -6, 2**40])
def test_out_of_range_indices(i):
    with _cache() as cache:
        ds = cache.wrap(FixedDataset(5, 8))
        with pytest.raises(IndexError, match=str(i if i >= 0 else i + 5)):
            ds[i]


def test_getitems_returns_uncollated_samples():
    src = FixedDataset(20, 32)
    with _cache() as cache:
        ds = cache.wrap(src)
        got = ds.__getitems__([3, 0, 19, 3])
        assert isinstance(got, list) and len(got) == 4
        for g, i in zip(got, [3, 0, 19, 3]):
            assert_same(g, src[i])


@pytest.mark.parametrize("make", [FixedDataset, TorchDataset], ids=["numpy", "torch"])
def test_batch_path_equals_default_collate_of_the_source(make):
    """ds[list] / get_batch: "collated like default_collate" - same structure, container types,
    dtypes and values, whether the batch was a miss (computed) or a hit (gathered)."""
    src = make(40)
    idx = [7, 1, 39, 20, 7]
    want = default_collate([src[i] for i in idx])
    with _cache() as cache:
        ds = cache.wrap(src)
        for attempt in ("miss", "hit"):
            got = ds[idx]
            assert_same(got, want, attempt)
        assert_same(ds.get_batch(np.array(idx)), want)
        assert_same(ds[torch.tensor(idx)], want)


class _Named(Dataset):
    """Samples with a str field inside a tuple: default_collate gives that column as a tuple."""

    def __len__(self):
        return 12

    def __getitem__(self, i):
        return torch.full((3,), i), f"n{i}"


def test_get_batch_of_str_fields_has_default_collates_containers_on_a_hit_too():
    """A batch gathered from the cache (every key a hit) and one computed (misses) have the
    containers default_collate gives: the str column of tuple samples is a tuple, both times."""
    src, idx = _Named(), [4, 5, 6]
    want = default_collate([src[i] for i in idx])
    with _cache() as cache:
        ds = cache.wrap(src)
        for attempt in ("miss", "hit"):
            got = ds.get_batch(idx)
            assert type(got[1]) is type(want[1]) is tuple, (attempt, got[1])
            assert got[1] == want[1] and torch.equal(got[0], want[0]), attempt


def test_get_batch_gathers_into_out_buffers():
    src = FixedDataset(30, 48)
    idx = list(range(0, 30, 3))
    with _cache() as cache:
        ds = cache.wrap(src)
        [ds[i] for i in idx]
        out = [torch.empty((len(idx), 48), dtype=torch.uint8), torch.empty(len(idx), dtype=torch.int64)]
        got = cache.get_batch(idx, out=out)
        assert got is out
        want = default_collate([src[i] for i in idx])
        assert torch.equal(out[0], want[0]) and torch.equal(out[1], want[1])
        fresh = [torch.zeros_like(out[0]), torch.zeros_like(out[1])]
        ds.get_batch([i + 1 for i in idx], out=fresh)  # misses computed, then gathered into out
        want = default_collate([src[i + 1] for i in idx])
        assert torch.equal(fresh[0], want[0]) and torch.equal(fresh[1], want[1])


def test_get_batch_with_missing_keys_and_no_fn_names_them():
    with _cache(name="kv") as cache:
        cache.put(1, (np.zeros(3), 1))
        cache.put(2, (np.zeros(3), 2))
        with pytest.raises(KeyError) as info:
            cache.get_batch([1, 777, 2, 888])
        msg = str(info.value)
        assert "777" in msg and "888" in msg and "fn=" in msg
        with pytest.raises(KeyError, match="'nope'"):
            cache.get_batch(["nope", 1])
        got = cache.get_batch([1, 777], fn=lambda k: (np.ones(3), k))
        assert torch.equal(got[1], torch.tensor([1, 777]))
        assert 777 in cache


def test_get_put_getitem_contains_len():
    with _cache(name="kv") as cache:
        assert len(cache) == 0 and 5 not in cache
        with pytest.raises(KeyError):
            cache[5]
        assert cache.get(5, lambda k: {"k": k, "sq": k * k}) == {"k": 5, "sq": 25}
        assert cache.get(5, lambda k: pytest.fail("recomputed a cached key")) == {"k": 5, "sq": 25}
        assert cache[5] == {"k": 5, "sq": 25} and 5 in cache
        assert cache.put("s", [1, 2]) is True and cache["s"] == [1, 2]
        assert cache.put(b"s", "other") and cache[b"s"] == "other" and cache["s"] == [1, 2]
        assert len(cache) == 3


@pytest.mark.parametrize("key", [1.5, True, (1,), None, [1], np.float64(2.0)])
def test_keys_of_the_wrong_type_name_the_type(key):
    with _cache(name="kv") as cache:
        for call in (lambda: cache.get(key, lambda k: 1), lambda: cache.put(key, 1),
                     lambda: cache[key], lambda: key in cache,
                     lambda: cache.get_batch([0, key], fn=lambda k: 1)):
            with pytest.raises(TypeError, match=type(key).__name__):
                call()
        assert len(cache) == 0


_NOT_INTEGERS = [
    np.array([1.0, 2.0]), np.array([True, False]), np.array([[1, 2]]), np.array(["1", "2"]),
    torch.tensor([1.0, 2.0]), torch.tensor([True, False]), torch.tensor([1 + 0j, 2 + 0j]),
]


@pytest.mark.parametrize("keys", _NOT_INTEGERS, ids=lambda k: f"{type(k).__name__}-{k.dtype}-{k.ndim}d")
def test_key_arrays_that_do_not_hold_integers_are_refused_not_truncated(keys):
    """A float or bool array read as ints would return other items (1.9 -> 1, True -> 1)."""
    with _cache(name="kv") as cache:
        cache.put(1, "one")
        cache.put(2, "two")
        with pytest.raises(InvalidArgument, match="must be (integers|a 1-D sequence)"):
            cache.get_batch(keys)


@pytest.mark.parametrize("keys", [np.array([2**64 - 1], np.uint64), torch.tensor([2**63], dtype=torch.uint64),
                                  np.array([1, 2**63], np.uint64)])
def test_uint64_keys_beyond_int64_are_refused_not_wrapped_to_negative_keys(keys):
    with _cache(name="kv") as cache:
        cache.put(-1, "minus one")  # 2**64-1 wrapped to int64 is -1
        cache.put(-(2**63), "min")  # 2**63 wrapped is -2**63
        cache.put(1, "one")
        with pytest.raises(InvalidArgument, match="does not fit"):
            cache.get_batch(keys)
    with _cache(name="kv2") as cache:
        cache.put(1, "one")
        assert cache.get_batch(np.array([1, 1], np.uint64)) == ["one", "one"]  # in range: fine


@pytest.mark.parametrize("indices", [[2**64 - 1], np.array([2**64 - 4], np.uint64),
                                     torch.tensor([2**63], dtype=torch.uint64)])
def test_batch_indices_beyond_int64_are_out_of_range_not_counted_from_the_end(indices):
    with _cache() as cache:
        ds = cache.wrap(Labelled(range(4)))
        for call in (lambda: ds[indices], lambda: ds.__getitems__(indices), lambda: ds.get_batch(indices)):
            with pytest.raises(IndexError, match="out of range"):
                call()


@pytest.mark.parametrize("index", [torch.tensor(True), torch.tensor([1.0]), torch.tensor([True, False])])
def test_bool_and_float_tensor_indices_are_not_cache_keys(index):
    """Never a cache key; the dataset's to take (a list takes a 0-d bool tensor as 1) or refuse."""
    with _cache() as cache:
        ds = cache.wrap(Items(4))
        try:
            want = Items(4)[index]
        except TypeError:
            with pytest.raises(TypeError):
                ds[index]
        else:
            assert_same(ds[index], want)
        assert cache.stats()["misses"] == 0 and cache.stats()["hits"] == 0
        with pytest.raises(TypeError):
            ds.get_batch([index])


def test_copy_false_returns_read_only_arrays_and_copy_true_private_ones():
    with _cache(name="cp", copy=False) as view_cache, _cache(name="cp") as copy_cache:
        view_cache.put(1, {"a": np.arange(5)})
        ro = view_cache[1]["a"]
        assert not ro.flags.writeable
        rw = copy_cache[1]["a"]
        rw[:] = 0
        assert np.array_equal(view_cache[1]["a"], np.arange(5))


def test_warmup_fills_everything_once():
    src = FixedDataset(300, 40)
    with _cache() as cache:
        ds = cache.wrap(src)
        calls = src.calls
        computed = cache.warmup(ds, progress=False)
        assert computed == 297  # the probes of wrap() were already there
        assert src.calls - calls == 297
        assert len(cache) == 300
        assert cache.warmup(ds, progress=False) == 0
        for i in (0, 150, 299):
            assert_same(ds[i], src[i])


@pytest.mark.parametrize("local_rank, bar", [(None, True), ("0", True), ("1", False), ("3", False)])
def test_only_local_rank_0_draws_the_warmup_progress_bar(monkeypatch, capfd, local_rank, bar):
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with _cache() as cache:
        cache.warmup(FixedDataset(50, 8), progress=True, desc="warming")
        assert len(cache) == 50
    err = capfd.readouterr().err
    assert ("warming" in err) == bar, err


def test_clear_drops_everything_for_every_handle():
    src = FixedDataset(20, 40)
    with _cache() as cache:
        ds = cache.wrap(src)
        [ds[i] for i in range(20)]
        other = _cache(name=cache.name)
        assert len(other) == 20
        cache.clear()
        assert len(other) == 0 and 3 not in other
        assert_same(ds[3], src[3])  # recomputed from the source
        assert len(other) == 1
        other.close()


def test_every_use_after_close_raises_naming_the_cache():
    """close() used to leave the handle working (it re-attached silently) and the process attached."""
    cache = _cache(name="closing")
    cache.put(1, "one")
    ds = cache.wrap(Labelled(range(4)))
    it = _cache(name="closing-it").wrap(Stream([1, 2, 3]))
    it.cache.close()
    cache.close()
    cache.close()  # twice: fine
    calls = [lambda: cache[1], lambda: cache.get(1, str), lambda: cache.put(2, "two"),
             lambda: 1 in cache, lambda: len(cache), lambda: cache.stats(), lambda: cache.clear(),
             lambda: cache.get_batch([1]), lambda: cache.wrap(Labelled(range(4))),
             lambda: cache.warmup(ds, progress=False), lambda: cache.store, lambda: ds[1],
             lambda: ds.__getitems__([1, 2]), lambda: ds.get_batch([1]), lambda: list(it)]
    for call in calls:
        with pytest.raises(InvalidArgument, match=r"ds/closing(-it)?\) was closed; create a new one"):
            call()
    with _cache(name="closing") as again:  # a new handle finds the cache
        assert again[1] == "one"
    with pytest.raises(InvalidArgument, match="was closed"):
        again.put(3, "three")  # the context manager closed it


def test_close_detaches_the_process_when_its_last_cache_of_the_session_closes():
    from shmcache.cache.registry import SessionRegistry

    registry = SessionRegistry()
    a, b = _cache(name="a"), _cache(name="b")
    other = _cache(session="elsewhere", name="c")
    assert os.getpid() in registry.live_pids("ds")
    a.close()
    assert os.getpid() in registry.live_pids("ds"), "b still uses the session"
    b.put(1, 1)
    b.close()
    assert os.getpid() not in registry.live_pids("ds")
    assert os.getpid() in registry.live_pids("elsewhere")
    other.close()
    assert os.getpid() not in registry.live_pids("elsewhere")
    with _cache(name="b") as again:  # attached again, counting on from the totals in memory
        assert again[1] == 1
        assert os.getpid() in registry.live_pids("ds")
        assert again.stats()["hits"] == 1


def test_unnamed_caches_refuse_get_and_put_instead_of_sharing_one_cache():
    """Both used to be cache "default": val.get(0, f_val) returned train's value."""
    train, val = ShmDatasetCache(session="ds", size=16), ShmDatasetCache(session="ds", size=16)
    calls = [lambda c: c.get(0, lambda k: "train"), lambda c: c.put(0, "x"), lambda c: c[0],
             lambda c: 0 in c, lambda c: len(c), lambda c: c.stats(),
             lambda c: c.get_batch([0], fn=lambda k: k), lambda c: c.clear()]
    for cache in (train, val):
        for call in calls:
            with pytest.raises(InvalidArgument, match=r"has no name.*ShmDatasetCache\(name="):
                call(cache)
        cache.close()
    with ShmDatasetCache(session="ds", size=16) as named_by_wrap:  # wrap() names it: then get works
        named_by_wrap.wrap(Labelled(range(4)))
        assert named_by_wrap.get(2)[1] == 2
        assert named_by_wrap.get(100, lambda k: "extra") == "extra"
    assert not (Path(os.environ["SHMCACHE_DIR"]) / "sessions" / "ds" / "caches" / "default.json").exists()


def test_stats_have_the_designed_keys():
    with _cache(name="st") as cache:
        cache.put(1, np.zeros(10))
        st = cache.stats()
        assert set(STAT_KEYS) <= set(st)
        assert st["items_mem"] == 1 and st["session"] == "ds" and st["name"] == "st"
        assert st["capacity_bytes"] == 64 << 20


def test_iterable_dataset_records_then_replays():
    src = Stream([np.full(3, i) for i in range(10)])
    with _cache() as cache:
        it = cache.wrap(src)
        first = list(it)
        assert src.passes == 1, "wrap() and the first pass read the source once in all"
        second = list(it)
        assert src.passes == 1, "the second pass read the source again"
        for a, b, c in zip(first, second, src.items):
            assert_same(a, c)
            assert_same(b, c)
        assert len(second) == 10


class Queue(IterableDataset):
    """A stream that cannot be read twice: every iterator takes items off one shared queue."""

    def __init__(self, items):
        self.queue = list(items)
        self.opened = 0

    def __iter__(self):
        self.opened += 1
        while self.queue:
            yield self.queue.pop(0)


def test_a_named_cache_does_not_read_the_stream_at_wrap():
    src = Queue(range(40))
    with _cache(name="stream") as cache:
        it = cache.wrap(src)
        assert src.opened == 0 and len(src.queue) == 40, "wrap() read the stream"
        assert list(it) == list(range(40))
        assert list(it) == list(range(40))  # replayed: the queue is empty now


def test_the_items_an_unnamed_wrap_reads_come_first_in_the_first_pass():
    """wrap() reads 16 items to name the cache; a stream that cannot be read twice lost them."""
    src = Queue(range(40))
    with _cache() as cache:
        it = cache.wrap(src)
        assert list(it) == list(range(40))
        assert list(it) == list(range(40))
        assert src.opened == 1


def test_a_named_one_shot_iterator_is_recorded_once_and_replayed():
    with _cache(name="once") as cache:
        it = cache.wrap(iter([np.full(2, i) for i in range(5)]))
        for _ in range(2):
            got = list(it)
            assert [g.tolist() for g in got] == [[i, i] for i in range(5)]
    with _cache(name="cut") as cache:
        it = cache.wrap(x for x in range(5))
        assert next(iter(it)) == 0  # a first pass that stops early
        with pytest.raises(InvalidArgument, match="one-shot iterator.*read once already"):
            list(it)


def test_an_unnamed_one_shot_iterator_is_refused_naming_name():
    with _cache() as cache:
        with pytest.raises(InvalidArgument, match=r"one-shot iterator.*name="):
            cache.wrap(iter([1, 2, 3]))


class Photos(Dataset):
    """torchvision's default: samples are (PIL image, label)."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        from PIL import Image

        pixels = np.random.default_rng(i).integers(0, 256, (224, 224, 3), dtype=np.uint8)
        return Image.fromarray(pixels), i


def test_pil_samples_are_stored_as_pixels_and_come_back_as_images():
    """A 224x224 RGB image was pickled at 5.7x its pixels (and read back through pickle)."""
    from PIL import Image

    src = Photos()
    with _cache() as cache:
        ds = cache.wrap(src)
        for i in range(8):
            img, label = ds[i]
            want = src[i][0]
            assert isinstance(img, Image.Image) and (img.mode, img.size, label) == ("RGB", (224, 224), i)
            assert img.tobytes() == want.tobytes()
        per_item = cache.stats()["bytes_mem"] / 8
        assert per_item <= 1.02 * 224 * 224 * 3, per_item


def test_samples_that_fall_back_to_pickle_warn_once_per_cache_naming_the_type_and_the_fix():
    import warnings

    with _cache(name="pickled") as cache:
        with pytest.warns(UserWarning, match=r"ds/pickled: samples holding set are stored with pickle.*np\.asarray"):
            cache.put(1, {"tags": {"a", "b"}})
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # once per cache: no second warning
            cache.put(2, {"tags": {"c"}})
            cache.get(3, lambda k: {"tags": {"d"}})
            cache.put(4, np.zeros(3))
        assert cache[1] == {"tags": {"a", "b"}}
    with _cache() as cache:  # another cache warns again, also through a wrapped dataset
        with pytest.warns(UserWarning, match=r"samples holding test_dataset.Point are stored with pickle"):
            ds = cache.wrap(Labelled([Point(i, i) for i in range(4)]))
        assert ds[2][1] == Point(2, 2)


@pytest.mark.parametrize("make, named", [
    (lambda: np.array([1, "a", None], dtype=object), "numpy.ndarray of dtype object"),
    (lambda: np.zeros(2, dtype=[("x", "i4"), ("y", "f4")]), "numpy.ndarray of a structured dtype"),
    (lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]), "torch.Tensor (nested)"),
    (lambda: torch.zeros(3, 3).to_sparse(), "torch.Tensor (sparse"),
    (lambda: functools.reduce(lambda v, _: [v], range(codec.MAX_NESTING + 1), 0),
     f"dict nested deeper than {codec.MAX_NESTING} containers"),
])
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_the_pickle_warning_names_what_is_unsupported(make, named):
    """Issue 31: an object-dtype array or a nested tensor was warned about as "samples holding
    numpy.ndarray / torch.Tensor ... return numpy arrays or tensors": odd advice for a sample that
    is one. The warning names the dtype or kind that is not stored natively."""
    with _cache(name="unsupported") as cache:
        with pytest.warns(UserWarning) as got:
            cache.put(0, {"x": make()})
    text = str(next(w.message for w in got if "pickle" in str(w.message)))
    assert named in text, text
    assert "return numpy arrays or tensors" not in text, text


# --- capacity as users see it ---------------------------------------------------------------------


def test_tiny_cache_stops_admitting_but_still_returns_values():
    src = FixedDataset(2000, 1024)
    with _cache(size=1) as cache:
        ds = cache.wrap(src)
        for i in range(2000):
            assert_same(ds[i], src[i])
        st = cache.stats()
        assert 0 < st["items_mem"] < 1000
        assert st["rejected"] == 2000 - st["items_mem"]
        for i in range(1990, 2000):
            assert_same(ds[i], src[i])  # still served (from the source)
        assert cache.get(10**6, lambda k: "fresh") == "fresh"


def test_item_larger_than_the_cap_raises_from_put_and_is_served_by_get(caplog):
    """An explicit put says it cannot store the item; get(key, fn) serves it like any overflow:
    counted as rejected, said once (issue 25, item 3)."""
    with _cache(size=1, name="small") as cache:
        with pytest.raises(ItemTooLarge, match=r"\b3(\.0+)? MiB"):
            cache.put(1, np.zeros(3 << 20, np.uint8))
        for k in (2, 3):
            assert len(cache.get(k, lambda k: np.zeros(3 << 20, np.uint8))) == 3 << 20
        assert cache.stats()["rejected"] == 3 and 2 not in cache
        said = [r.getMessage() for r in caplog.records if "can never fit" in r.getMessage()]
        assert len(said) == 1 and "size=" in said[0], said


# --- fingerprints -------------------------------------------------------------------------------


def test_different_datasets_get_different_caches():
    a, b = FixedDataset(100, 16, seed=1), FixedDataset(100, 16, seed=2)
    ca, cb = _cache(), _cache()
    da, db = ca.wrap(a), cb.wrap(b)
    assert ca.name != cb.name
    for i in (0, 5, 99):
        assert_same(da[i], a[i])
        assert_same(db[i], b[i])
    assert_same(_cache().wrap(FixedDataset(101, 16, seed=1))[5], FixedDataset(101, 16, seed=1)[5])
    ca.close()
    cb.close()


def test_same_dataset_in_a_new_cache_object_finds_its_cache():
    src = FixedDataset(100, 16)
    first = _cache()
    ds = first.wrap(src)
    [ds[i] for i in range(100)]
    first.close()
    again_src = FixedDataset(100, 16)
    second = _cache()
    ds2 = second.wrap(again_src)
    assert second.name == first.name
    for i in range(100):
        assert_same(ds2[i], src[i])
    assert again_src.calls == 4  # only wrap()'s probes and its randomness check
    assert second.stats()["items_mem"] == 100
    second.close()


def test_same_explicit_name_for_another_dataset_is_a_mismatch():
    with _cache(name="explicit") as c1:
        c1.wrap(FixedDataset(10, 16, seed=1))
    with _cache(name="explicit") as c2:
        with pytest.raises(CacheMismatch, match="name="):
            c2.wrap(FixedDataset(10, 16, seed=2))
    with _cache(name="explicit") as c3:  # the right dataset still binds
        assert_same(c3.wrap(FixedDataset(10, 16, seed=1))[4], FixedDataset(10, 16, seed=1)[4])


def test_one_cache_object_refuses_a_second_dataset():
    with _cache() as cache:
        cache.wrap(FixedDataset(10, 16, seed=1))
        with pytest.raises(InvalidArgument, match="another dataset"):
            cache.wrap(FixedDataset(10, 16, seed=2))


def test_different_transforms_get_different_caches():
    src = FixedDataset(10, 16)
    c1, c2 = _cache(), _cache()
    d1 = c1.wrap(src, transform=lambda s: (s[0], s[1] + 1))
    d2 = c2.wrap(src, transform=lambda s: (s[0], s[1] + 2))
    assert c1.name != c2.name
    assert d1[3][1] + 1 == d2[3][1]
    c1.close()
    c2.close()


def test_relabelled_dataset_does_not_reuse_the_old_cache():
    """Version 2 of a dataset fixes a few labels in the middle (same class, same length, same
    first/middle/last samples): it must not be served version 1's cached labels."""
    v1 = Labelled([i % 10 for i in range(100)])
    fixed = [i % 10 for i in range(100)]
    fixed[17], fixed[63] = 99, 99
    v2 = Labelled(fixed)
    c1 = _cache()
    d1 = c1.wrap(v1)
    [d1[i] for i in range(100)]
    c2 = _cache()
    d2 = c2.wrap(v2)
    assert d2[17][1] == 99 and d2[63][1] == 99, "served the labels of another dataset"
    c1.close()
    c2.close()


def test_dataset_relabelled_past_item_100000_does_not_reuse_the_old_cache():
    """The fingerprint used to stop at 100,000 list items: a fix at item 250,000 was served stale."""
    labels = [i % 10 for i in range(300_000)]
    with _cache() as c1:
        assert c1.wrap(Labelled(labels))[250_000][1] == 0
    labels[250_000] = 99
    with _cache() as c2:
        assert c2.wrap(Labelled(labels))[250_000][1] == 99, "served the labels of another dataset"


def test_iterable_datasets_with_the_same_first_item_do_not_share_a_cache():
    """Two streams that start alike (a CSV header line, a BOS token) are still different data."""
    c1, c2 = _cache(), _cache()
    s1 = c1.wrap(Stream(["header", "a", "b"]))
    assert list(s1) == ["header", "a", "b"]
    s2 = c2.wrap(Stream(["header", "x", "y", "z"]))
    assert list(s2) == ["header", "x", "y", "z"]
    c1.close()
    c2.close()


def test_random_datasets_are_refused_at_wrap():
    class Noisy(Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.random.rand(3)

    with _cache() as cache:
        with pytest.raises(InvalidArgument, match="random"):
            cache.wrap(Noisy())


# --- pickling -------------------------------------------------------------------------------------


def test_wrapped_dataset_pickles_by_name_and_reattaches():
    src = FixedDataset(50, 16)
    with _cache() as cache:
        ds = cache.wrap(src)
        [ds[i] for i in range(50)]
        blob = pickle.dumps(ds)
        assert len(blob) - len(pickle.dumps(src)) < 2048, "the wrapper pickles more than names"
        clone = pickle.loads(blob)
        assert clone.cache.opened is None  # attaches lazily
        hits, calls = cache.stats()["hits"], clone.dataset.calls
        for i in range(50):
            assert_same(clone[i], fixed_sample(i, 16))
        assert cache.stats()["hits"] == hits + 50
        assert clone.dataset.calls == calls  # nothing recomputed in the clone
        clone.cache.close()


def test_unpickled_wrapper_finds_its_cache_whatever_shmcache_dir_says(monkeypatch, tmp_path):
    """A wrapped dataset "pickles by name": a worker whose $SHMCACHE_DIR differs from its parent's
    (a forkserver started before the variable was set) must reach the same cache, not build an
    empty twin in another namespace."""
    from shmcache.base.namespace import ENV_DIR, namespace

    src = FixedDataset(20, 16)
    cache = _cache()
    ds = cache.wrap(src)
    [ds[i] for i in range(20)]
    blob = pickle.dumps(ds)
    home = os.environ[ENV_DIR]
    monkeypatch.setenv(ENV_DIR, str(tmp_path / "elsewhere"))
    other = namespace()
    try:
        clone = pickle.loads(blob)
        calls = clone.dataset.calls
        for i in range(20):
            assert_same(clone[i], fixed_sample(i, 16))
        clone.cache.close()
        assert clone.dataset.calls == calls, "the clone recomputed what the cache holds"
        assert other.owned_segments() == [], "an empty twin of the cache appeared elsewhere"
    finally:
        from shmcache.cache.registry import SessionRegistry

        for info in SessionRegistry(other).list():
            SessionRegistry(other).destroy(info.name, force=True)
        monkeypatch.setenv(ENV_DIR, home)
        cache.close()


# --- bad arguments ----------------------------------------------------------------------------


@pytest.mark.parametrize("size", [-1, True, False, "10", 1.5, None, 2**31, 10**12])
def test_bad_size_is_refused_naming_size(size):
    with pytest.raises(InvalidArgument, match="size"):
        ShmDatasetCache(session="ds", name="x", size=size)


def test_a_byte_count_given_as_size_is_a_clear_error():
    """size is in MB; size=10**9 (someone meant bytes) must give an error naming size, not an
    OSError from mmap at the first put."""
    with pytest.raises(ShmcacheError, match="size"):
        cache = ShmDatasetCache(session="ds", name="bytes-meant", size=10**9)
        cache.put(1, np.zeros(10))


def test_bad_size_from_the_environment_names_the_variable(monkeypatch):
    for env in ("lots", "1.5", "-3"):
        monkeypatch.setenv("SHMCACHE_SIZE_MB", env)
        with pytest.raises(InvalidArgument, match="SHMCACHE_SIZE_MB"):
            ShmDatasetCache(session="ds", name="envsize")
    monkeypatch.setenv("SHMCACHE_SIZE_MB", "3")
    with ShmDatasetCache(session="ds", name="envsize") as cache:
        cache.put(1, 1)
        assert cache.stats()["capacity_bytes"] == 3 << 20


@pytest.mark.parametrize("session", ["a/b", "..", "", "x" * 65, 5, b"s", "a b"])
def test_bad_session_is_refused_naming_session(session, shm_namespace):
    with pytest.raises(InvalidArgument, match="session"):
        ShmDatasetCache(session=session, name="x")
    assert shm_namespace.owned_segments() == []


@pytest.mark.parametrize("name", ["a/b", "..", "", "x" * 65, 5, b"s", "a+b"])
def test_bad_cache_name_is_refused_naming_cache(name, shm_namespace):
    with pytest.raises(InvalidArgument, match="cache"):
        ShmDatasetCache(session="ds", name=name)
    assert shm_namespace.owned_segments() == []


@pytest.mark.parametrize("kw", [{"copy": "no"}, {"copy": 0}, {"copy": None}, {"lock_timeout_s": "x"},
                                {"lock_timeout_s": None}, {"lock_timeout_s": 0}, {"lock_timeout_s": -1},
                                {"lock_timeout_s": float("nan")}, {"lock_timeout_s": True}])
def test_bad_copy_and_lock_timeout_are_refused_naming_them(kw, shm_namespace):
    with pytest.raises(InvalidArgument, match=next(iter(kw))):
        ShmDatasetCache(session="ds", name="x", **kw)
    assert shm_namespace.owned_segments() == []


def test_values_nested_too_deep_for_the_layout_are_pickled_or_refused_clearly():
    with _cache(name="deep") as cache:
        for depth, storable in ((450, True), (5000, False)):
            value = 1
            for _ in range(depth):
                value = [value]
            if storable:  # pickled whole: past codec.MAX_NESTING containers (said once)
                with pytest.warns(UserWarning, match=f"nested deeper than {codec.MAX_NESTING} containers"):
                    assert cache.put(depth, value)
                assert cache[depth] == value
            else:
                with pytest.raises(EncodeError, match=f"key {depth}"):
                    cache.put(depth, value)


def test_session_auto_comes_from_the_environment(monkeypatch):
    monkeypatch.setenv("SHMCACHE_SESSION", "from-env")
    with ShmDatasetCache(name="x", size=8) as cache:
        cache.put(1, 1)
        assert cache.stats()["session"] == "from-env"
    monkeypatch.setenv("SHMCACHE_SESSION", "bad/name")
    with pytest.raises(InvalidArgument, match="SHMCACHE_SESSION"):
        ShmDatasetCache(name="x")


@pytest.mark.parametrize("transform", [5, "upper", [len]])
def test_transform_must_be_callable(transform):
    with _cache() as cache:
        with pytest.raises(InvalidArgument, match="transform"):
            cache.wrap(FixedDataset(3, 8), transform=transform)


@pytest.mark.parametrize("thing", [5, None, object(), 3.5])
def test_wrap_of_a_non_dataset_is_refused(thing):
    with _cache() as cache:
        with pytest.raises(InvalidArgument, match="dataset"):
            cache.wrap(thing)


def test_unpicklable_samples_name_the_sample():
    with _cache() as cache:
        ds = cache.wrap(Unpicklable(bad=(7, 8)))
        with pytest.raises(EncodeError, match=r"sample 7\b.*Unpicklable"):
            ds[7]
        with pytest.raises(EncodeError, match=r"sample 8\b"):
            ds.__getitems__([1, 8])
    with _cache() as cache:
        with pytest.raises(EncodeError) as info:
            cache.wrap(Unpicklable(bad=(0,)))  # wrap() reads sample 0 itself
        assert "sample 0" in str(info.value) and "Unpicklable" in str(info.value)


# --- out buffers and zero-copy tensors --------------------------------------------------------


def test_get_batch_into_out_buffers_of_another_dtype_converts_or_refuses():
    """Gathering int labels into a float64 buffer must give 0., 1., 2. (like tensor.copy_, which
    the non-vectorised path uses) or raise - never the int64 bits reinterpreted as doubles."""
    with _cache(name="out-dtype") as cache:
        for k in range(4):
            cache.put(k, (np.full(3, k, np.uint8), k))
        out = [torch.empty((4, 3), dtype=torch.uint8), torch.zeros(4, dtype=torch.float64)]
        try:
            cache.get_batch([0, 1, 2, 3], out=out)
        except (InvalidArgument, TypeError, ValueError):
            return
        assert out[1].tolist() == [0.0, 1.0, 2.0, 3.0], f"labels came out as {out[1].tolist()}"


def test_dict_out_buffers_are_matched_by_key_not_by_position():
    """An out= dict built in another key order than the samples must still get each field."""
    with _cache(name="out-dict") as cache:
        for k in range(4):
            cache.put(k, {"a": np.full(3, k, np.float32), "b": np.full(3, -k, np.float32)})
        out = {"b": torch.zeros(4, 3), "a": torch.zeros(4, 3)}
        got = cache.get_batch([0, 1, 2, 3], out=out)
        assert got is out
        assert out["a"][:, 0].tolist() == [0, 1, 2, 3] and out["b"][:, 0].tolist() == [0, -1, -2, -3]


@pytest.mark.parametrize("out, where", [
    (lambda: [torch.zeros(4, 2, 3, dtype=torch.uint8)], "out is a list of 1"),  # the labels would stay unfilled
    (lambda: [torch.zeros(4, 2, 3, dtype=torch.uint8), torch.zeros(4, dtype=torch.int64), torch.zeros(1)],
     "out is a list of 3"),
    (lambda: torch.zeros(4, 2, 3), "out is a Tensor"),
    (lambda: {"img": torch.zeros(4, 2, 3)}, "out is a dict"),
    (lambda: [np.zeros((4, 2, 2), np.uint8), np.zeros(4, np.int64)], r"out\[0\] has shape \(4, 2, 2\)"),
    (lambda: [torch.zeros(4, 2, 3), torch.zeros(5)], r"out\[1\] has shape \(5,\)"),
], ids=["too-few", "too-many", "one-tensor", "dict-for-tuple", "numpy-shape", "converted-shape"])
def test_out_shaped_unlike_the_batch_names_the_place(out, where):
    with _cache(name="out-shape") as cache:
        for k in range(4):
            cache.put(k, (np.full((2, 3), k, np.uint8), k))
        for keys in ([0, 1, 2, 3], [0, 1, 2, 9]):  # the vectorised path, then the per-item one
            with pytest.raises(InvalidArgument, match=where):
                cache.get_batch(keys, out=out(), fn=lambda k: (np.full((2, 3), k, np.uint8), k))


_WRITE_INTO_VIEW = r"""
import torch
from shmcache import ShmDatasetCache
view = ShmDatasetCache(session="ds", name="zc", copy=False)
t = view[1]
print("got", type(t).__name__, flush=True)
try:
    t.add_(100)      # a user normalising a batch in place
except Exception as exc:
    print("refused", type(exc).__name__, flush=True)
"""


def test_writing_into_a_zero_copy_tensor_cannot_change_the_cache():
    """copy=False promises "zero-copy read-only views"; torch has no read-only tensors, so an
    in-place op on a hit must fail (an exception, or even a crash of that process) rather than
    silently change the sample for every process of the machine."""
    import subprocess

    with _cache(name="zc") as cache:
        cache.put(1, torch.arange(4))
        proc = subprocess.run([sys.executable, "-c", _WRITE_INTO_VIEW], capture_output=True,
                              text=True, timeout=60)
        assert "got Tensor" in proc.stdout, proc.stderr[-2000:]
        assert torch.equal(cache[1], torch.arange(4)), f"the cache now holds {cache[1].tolist()}"


# --- verify= ------------------------------------------------------------------------------------


class Drifting(Dataset):
    """Deterministic until told otherwise: then item 5 changes (a stale cache)."""

    def __init__(self):
        self.shift = 0

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return np.full(4, i + (self.shift if i == 5 else 0)), i


def test_verify_recomputes_hits_and_catches_a_stale_cache():
    src = Drifting()
    with _cache(name="verify", verify=1.0) as cache:
        ds = cache.wrap(src)
        for i in range(10):
            ds[i]
        for i in range(10):  # hits, all recomputed and equal
            assert ds[i][1] == i
        src.shift = 7  # the source changed under the cache
        with pytest.raises(CacheMismatch, match=r"sample 5 .*clear\(\)"):
            ds[5]
        assert ds[4][1] == 4


def test_verify_also_checks_the_dataloader_batch_hook():
    """A DataLoader fetches through __getitems__, not __getitem__: verify= must run there too."""
    src = Drifting()
    with _cache(name="verify-batch", verify=1.0) as cache:
        ds = cache.wrap(src)
        list(DataLoader(ds, batch_size=5))  # fills
        src.shift = 7
        with pytest.raises(CacheMismatch, match="sample 5"):
            list(DataLoader(ds, batch_size=5))


def test_verify_off_by_default_and_validated():
    with pytest.raises(InvalidArgument, match="verify"):
        ShmDatasetCache(session="ds", verify=2)
    with pytest.raises(InvalidArgument, match="verify"):
        ShmDatasetCache(session="ds", verify=True)
    src = Drifting()
    with _cache(name="noverify") as cache:
        ds = cache.wrap(src)
        ds[5]
        src.shift = 7
        assert ds[5][0][0] == 5  # no check: the cached value


def test_one_shot_iterators_are_refused():
    with ShmDatasetCache(session="rr") as cache:
        with pytest.raises(InvalidArgument, match="one-shot iterator"):
            cache.wrap(iter([1, 2, 3]))
