"""A wrapped stream whose source reorders each epoch (``set_epoch``, as Hugging Face's shuffled
``IterableDataset`` and HF's Trainer have it): the cache records one pass and replays it, so
without a word the model would see the first epoch's order for the whole run. The default says so
once the epoch moves; ``wrap(reshuffle=True)`` replays each epoch in an order drawn from it;
``reshuffle=False`` keeps the recorded order quietly."""

from __future__ import annotations

import random
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
from torch.utils.data import IterableDataset

from shmcache import ShmDatasetCache
from shmcache.errors import InvalidArgument

N = 24


class EpochShuffled(IterableDataset):
    """A stream in an order of its epoch's own, told by set_epoch (HF's shuffled stream: its
    ``epoch`` is public, its ``set_epoch`` what HF's Trainer calls)."""

    def __init__(self, n: int = N):
        self.n = n
        self.epoch = 0
        self.passes = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.passes += 1
        order = list(range(self.n))
        random.Random(self.epoch).shuffle(order)
        return iter(order)


class NoEpoch(IterableDataset):
    """A stream with no epoch of its own to read."""

    def __iter__(self):
        return iter(range(N))


def _cache(name: str) -> ShmDatasetCache:
    return ShmDatasetCache(session="epochs", name=name, size=16)


def _pass(ds) -> list[int]:
    return [int(x) for x in ds]


def _said(fn) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        out = fn()
    return out, [str(w.message) for w in said]


def test_a_stream_reordered_each_epoch_is_said_when_its_replay_keeps_the_first_order():
    src = EpochShuffled()
    with _cache("said") as cache:
        ds = cache.wrap(src)
        first, said = _said(lambda: _pass(ds))
        assert sorted(first) == list(range(N)) and not said, said  # the recording pass: nothing to say
        src.set_epoch(0)
        again, said = _said(lambda: _pass(ds))  # the same epoch: its order, rightly
        assert again == first and not said, said
        src.set_epoch(1)
        later, said = _said(lambda: _pass(ds))
        assert later == first, "the default keeps the recorded order (as before)"
        assert len(said) == 1 and "reshuffle=True" in said[0] and "epoch 1" in said[0], said
        src.set_epoch(2)
        _, said = _said(lambda: _pass(ds))
        assert not said, f"said again: {said}"  # once per job
        assert src.passes == 1


def _epochs(ds, set_epoch, n: int) -> list[list[int]]:
    """A pass of ``ds`` in each of ``n`` epochs, told by ``set_epoch``; none says anything."""
    orders = []
    for epoch in range(n):
        set_epoch(epoch)
        got, said = _said(lambda: _pass(ds))
        assert sorted(got) == list(range(N)) and not said, (epoch, said)
        orders.append(got)
    return orders


def test_reshuffle_replays_each_epoch_in_an_order_of_its_own():
    src = EpochShuffled()
    with _cache("reshuffled") as cache:
        ds = cache.wrap(src, reshuffle=True)
        orders = _epochs(ds, ds.set_epoch, 4)  # passed on to the source: recorded in epoch 0's order
        assert src.passes == 1 and src.epoch == 3
        assert orders[0] == _pass(EpochShuffled())  # recorded as the source gave it
        assert len({tuple(o) for o in orders}) == 4, orders
        ds.set_epoch(2)
        assert _pass(ds) == orders[2], "an epoch's order is drawn from the epoch: the same again"


def test_reshuffle_follows_the_sources_own_epoch():
    """The user calls set_epoch on the source (as HF's examples do), not on the wrapper."""
    src = EpochShuffled()
    with _cache("theirs") as cache:
        orders = _epochs(cache.wrap(src, reshuffle=True), src.set_epoch, 3)
        assert len({tuple(o) for o in orders}) == 3 and src.passes == 1


def test_reshuffle_false_keeps_the_recorded_order_quietly():
    src = EpochShuffled()
    with _cache("kept") as cache:
        ds = cache.wrap(src, reshuffle=False)
        first = _pass(ds)
        for epoch in (1, 2):
            ds.set_epoch(epoch)
            got, said = _said(lambda: _pass(ds))
            assert got == first and not said, said


def test_reshuffle_without_an_epoch_is_refused_at_the_first_pass_not_the_second():
    with _cache("noepoch") as cache:
        ds = cache.wrap(NoEpoch(), reshuffle=True)
        with pytest.raises(InvalidArgument, match=r"set_epoch\(epoch\)"):
            next(iter(ds))
        ds.set_epoch(0)
        assert sorted(_pass(ds)) == list(range(N))
        ds.set_epoch(1)
        assert sorted(_pass(ds)) == list(range(N))


class WithLarge(EpochShuffled):
    """Items 3 and 17 too large to cache (2.4 MB in a 1 MB cache): served, never stored, so every
    replay finds them missing."""

    def __iter__(self):
        for i in super().__iter__():
            yield np.full(300_000 if i in (3, 17) else 1, i, np.int64)


@pytest.mark.parametrize("reshuffle", [None, True])
def test_an_epoch_the_cache_lacks_items_of_is_read_from_the_source_in_its_own_order(reshuffle):
    """The recorded positions are epoch 0's: filling item k from the source in epoch 1 (what a
    replay in the recorded epoch does) gave epoch 1's k-th item, one twice and one never."""
    src = WithLarge()
    with ShmDatasetCache(session="epochs", name="gaps", size=1) as cache:
        ds = cache.wrap(src, reshuffle=reshuffle)
        orders = []
        for epoch in range(3):
            ds.set_epoch(epoch)
            got = [int(x[0]) for x in ds]
            assert sorted(got) == list(range(N)), (epoch, got)  # none twice, none lost
            orders.append(got)
        assert src.passes == 3  # each later epoch read the source: the cache lacks two items
        assert len({tuple(o) for o in orders}) == 3, orders
        st = cache.stats()
        assert st["rejected"] == 2 and st["computed"] == 3 * N, st  # read through: nothing stored again


@pytest.mark.parametrize("bad", [-1, 1.5, "1", True])
def test_a_bad_epoch_is_refused(bad):
    with _cache("bad") as cache:
        ds = cache.wrap(EpochShuffled(), reshuffle=True)
        with pytest.raises(InvalidArgument, match="epoch"):
            ds.set_epoch(bad)


def test_reshuffle_is_for_streams():
    with _cache("mapstyle") as cache:
        with pytest.raises(InvalidArgument, match="sampler"):
            cache.wrap(list(range(10)), reshuffle=True)
        with pytest.raises(InvalidArgument, match="sampler"):  # was taken and ignored
            cache.wrap(None, reshuffle=True)
        with pytest.raises(InvalidArgument, match="reshuffle"):
            cache.wrap(EpochShuffled(), reshuffle="yes")


_WORKERS = textwrap.dedent("""\
    import sys
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    from shmcache import ShmDatasetCache

    class Sharded(IterableDataset):  # one order, no epoch of its own: the wrapper's set_epoch decides
        def __iter__(self):
            info = get_worker_info()
            return iter(range(info.id, 40, info.num_workers))

    if __name__ == "__main__":
        cache = ShmDatasetCache(session="epochs", name="workers", size=16)
        ds = cache.wrap(Sharded(), reshuffle=True)
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=True,
                            multiprocessing_context=sys.argv[1])
        for epoch in range(3):
            ds.set_epoch(epoch)  # after the persistent workers started: they must see it
            print(" ".join(str(int(x)) for x in loader))
        cache.store.destroy()
        cache.close()
""")


@pytest.mark.parametrize("start", ["fork", pytest.param("spawn", marks=pytest.mark.slow)])  # spawn shares any tensor
def test_persistent_workers_replay_each_epoch_in_its_own_order(tmp_path, start):
    (tmp_path / "train.py").write_text(_WORKERS)
    done = subprocess.run([sys.executable, str(tmp_path / "train.py"), start], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    orders = [line.split() for line in done.stdout.splitlines()]
    assert len(orders) == 3 and all(sorted(map(int, o)) == list(range(40)) for o in orders), orders
    assert len({tuple(o) for o in orders}) == 3, "a persistent worker replayed the first epoch's order"
    assert np.all([len(o) == 40 for o in orders])


def test_a_replay_cleared_midway_records_the_next_epoch_whole():
    """A clear() during a reshuffled replay: the rest of that epoch comes from the source (said),
    and no marker is left for a pass whose first items are not in the cache - the next epoch
    records whole, the one after replays. (A marker there made every later epoch a read of the
    source, never cached again.)"""
    src = EpochShuffled()
    with _cache("cleared") as cache:
        ds = cache.wrap(src, reshuffle=True)
        ds.set_epoch(0)
        _pass(ds)
        ds.set_epoch(1)
        it = iter(ds)
        got = [int(next(it)) for _ in range(5)]
        cache.clear()
        _, said = _said(lambda: got.extend(int(x) for x in it))
        assert len(got) == N and any("was cleared during epoch 1" in w for w in said), said
        ds.set_epoch(2)
        assert sorted(_pass(ds)) == list(range(N))
        passes = src.passes
        for epoch in (3, 4):
            ds.set_epoch(epoch)
            assert sorted(_pass(ds)) == list(range(N)) and src.passes == passes, "not replayed from the cache"


@pytest.mark.parametrize("marker", [5, (5, -1), (5, -1, "0.main"), (5, -1, "0.main", True),
                                    (5, -1, "0.main", True, "a later field")])
def test_a_marker_of_every_known_shape_replays(marker):
    """Markers an older version wrote (a bare count, 2 and 3 fields) and one a later version may
    write (more fields) replay the stream; one of no known shape records it again, no error."""
    with _cache("shapes") as cache:
        store = cache.store
        for i in range(5):
            store.put(f"0.main:{i}", i * 10)
        store.put("__stream__:0.main", marker)
        assert [int(x) for x in cache.wrap(NoEpoch(), reshuffle=False)] == [0, 10, 20, 30, 40]


@pytest.mark.parametrize("marker", ["5", (5,), ("5", -1), (5, "x"), (5, -1, 7), (True, -1)])
def test_a_marker_of_no_known_shape_records_the_stream_again(marker):
    with _cache("noshape") as cache:
        cache.store.put("__stream__:0.main", marker)
        assert [int(x) for x in cache.wrap(NoEpoch(), reshuffle=False)] == list(range(N))
