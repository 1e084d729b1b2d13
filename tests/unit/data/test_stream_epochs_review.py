"""A review of the wrapped stream's epochs (data.stream, branch adv-stream): each test a defect
found by using it as a training script does - a pass cut short, a clear() from another process,
DataLoader workers, a resumed run, a full /dev/shm.

Each says what the user saw; the source is ``EpochShuffled`` (test_stream_epochs' model of a
Hugging Face shuffled stream) unless named."""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest
import torch
from test_stream_epochs import EpochShuffled, N, _said  # noqa: E402 - a sibling: the sources and the word
from torch.utils.data import IterableDataset

from shmcache import ShmDatasetCache


def _pass(ds) -> list[int]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [int(x) for x in ds]


@pytest.mark.parametrize("reshuffle", [None, False, True])
def test_a_pass_cut_short_then_read_whole_in_the_next_epoch_records_one_epoch(reshuffle):
    """Epoch 0 stopped after 10 items (a `break`, max_steps, a crash), epoch 1 read whole: its pass
    put only the keys the cut pass had not (put is put-unless-present), so the recording held epoch
    0's first 10 positions and epoch 1's other 14 under a marker naming epoch 1 - every later epoch
    replayed some items twice and never gave others (5 of 24 here, each epoch from then on)."""
    with ShmDatasetCache(session="review", name="cut", size=16) as cache:
        ds = cache.wrap(EpochShuffled(), reshuffle=reshuffle)
        ds.set_epoch(0)
        for k, _ in enumerate(ds):
            if k == 9:
                break
        for epoch in (1, 2, 3):
            ds.set_epoch(epoch)
            got = _pass(ds)
            assert sorted(got) == list(range(N)), (epoch, sorted(got))  # none twice, none lost


_CLEAR = ("from shmcache import ShmDatasetCache\n"
          "c = ShmDatasetCache(session='review', name={name!r})\nc.clear()\nc.close()\n")


@pytest.mark.parametrize("reshuffle", [pytest.param(None, marks=pytest.mark.slow), True])  # slow: as True, unshuffled
def test_a_clear_from_another_process_mid_replay_of_another_epoch_loses_nothing_silently(reshuffle):
    """A replay in epoch 1 of a pass recorded in epoch 0, `shmcache clear` (another process) after
    its 6th item: the replay went on with `_record(skip=6)` - the source's epoch 1 pass without
    its first 6 items, which are not the 6 it had yielded (those were epoch 0's positions, or a
    permutation of them) - 4 items twice, 4 never, without a word. Not every fix can be exact (the
    rest of a permuted epoch is gone with the clear), so saying so passes too."""
    name = f"clear{reshuffle}"
    with ShmDatasetCache(session="review", name=name, size=16) as cache:
        ds = cache.wrap(EpochShuffled(), reshuffle=reshuffle)
        ds.set_epoch(0)
        assert sorted(_pass(ds)) == list(range(N))
        ds.set_epoch(1)

        def replay() -> list[int]:
            got = []
            for k, x in enumerate(ds):
                got.append(int(x))
                if k == 5:
                    done = subprocess.run([sys.executable, "-c", _CLEAR.format(name=name)], capture_output=True,
                                          text=True, timeout=60)
                    assert done.returncode == 0, done.stderr[-2000:]
            return got

        got, said = _said(replay)
        said = [s for s in said if "reshuffle=True" not in s]  # the default's word about the order
        assert sorted(got) == list(range(N)) or said, (sorted(got), said)


# the sources of the scripts below: a stream in an order of its epoch's own (sharded by DataLoader
# worker), and Hugging Face's shuffled stream
_SOURCES = textwrap.dedent("""\
    import random, sys
    from torch.utils.data import DataLoader, IterableDataset, get_worker_info
    from shmcache import ShmDatasetCache

    class EpochShuffled(IterableDataset):
        def __init__(self):
            self.epoch = 0
        def set_epoch(self, epoch):
            self.epoch = epoch
        def __iter__(self):
            order = list(range(40))
            random.Random(self.epoch).shuffle(order)
            info = get_worker_info()
            return iter(order if info is None else order[info.id::info.num_workers])

    def hf():
        import datasets
        return datasets.Dataset.from_dict({"x": list(range(40))}).to_iterable_dataset(num_shards=4).shuffle(
            seed=0, buffer_size=8)
""")

_ONCE = _SOURCES + textwrap.dedent("""\
    if __name__ == "__main__":
        kind, start = sys.argv[1], sys.argv[2]
        cache = ShmDatasetCache(session="review", name="once", size=16)
        ds = cache.wrap(hf() if kind == "hf" else EpochShuffled())
        loader = DataLoader(ds, batch_size=None, num_workers=2, persistent_workers=kind == "hf",
                            multiprocessing_context=start)
        for epoch in range(4):
            ds.set_epoch(epoch)
            got = [int(x["x"]) if isinstance(x, dict) else int(x) for x in loader]
            assert sorted(got) == list(range(40)), got
            print(f"EPOCH {epoch} DONE", file=sys.stderr, flush=True)
        cache.store.destroy()
        cache.close()
""")


@pytest.mark.parametrize("kind", ["workers", pytest.param("hf", marks=pytest.mark.slow)])  # hf: 2.5 s
def test_the_default_says_a_frozen_replay_once_per_job_with_dataloader_workers(tmp_path, kind):
    """The word's mark named the stream ("__stream__:0.0of2:0"): two workers (or ranks) each wrote
    their own mark into the one root word, overwriting the other's, so each worker said it again
    at every epoch - 6 warnings in 3 replayed epochs of 2 workers (3 with HF's persistent ones),
    for a warning that says it is "warned once per job". Two workers may both say it in the first
    epoch (the mark is a hint, not a lock); no later epoch may."""
    if kind == "hf":
        pytest.importorskip("datasets")
    (tmp_path / "train.py").write_text(_ONCE)
    done = subprocess.run([sys.executable, str(tmp_path / "train.py"), kind, "fork"], capture_output=True,
                          text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stderr.count("is replayed in the order the cache recorded")
    after_first = done.stderr.split("EPOCH 1 DONE", 1)[1].count("is replayed in the order the cache recorded")
    assert 1 <= said <= 2 and after_first == 0, done.stderr[-4000:]


class NoEpochWithLarge(IterableDataset):
    """One order, no epoch of its own (the wrapper's set_epoch tells it); item 3 too large for
    the cache (2.4 MB in a 1 MiB cache) - as any item of a stream larger than its cache is."""

    def __iter__(self):
        for i in range(N):
            yield np.full(300_000 if i == 3 else 1, i, np.int64)


def test_reshuffle_true_of_a_stream_the_cache_lacks_items_of_is_not_frozen_without_a_word():
    """wrap(reshuffle=True), ds.set_epoch(epoch) each epoch: the user asked for an order of each
    epoch's own. One item the cache could not hold (too large; or a stream larger than the cache,
    its items rejected) and every epoch was read through in the source's one order - the same
    order each epoch, and the only word said was about the item's size."""
    with ShmDatasetCache(session="review", name="large", size=1) as cache:
        ds = cache.wrap(NoEpochWithLarge(), reshuffle=True)
        orders, said = [], []
        for epoch in range(3):
            ds.set_epoch(epoch)
            got, words = _said(lambda: [int(x[0]) for x in ds])
            assert sorted(got) == list(range(N)), got
            orders.append(tuple(got))
            said += words
        assert len(set(orders)) == 3 or any("reshuffle" in s for s in said), (orders, said)


def test_a_first_pass_after_set_epoch_reads_that_epoch_of_an_unnamed_wrap():
    """A run resumed at epoch 3: wrap() (unnamed: it reads the stream's first 16 items to name
    the cache, in the epoch the source was in then - 0), ds.set_epoch(3), then the first pass. It
    went on with wrap()'s iterator: epoch 0's order, where the source alone gives epoch 3's (and
    set_epoch says "a first pass reads the source in that epoch's order"); recorded under a marker
    that names epoch 3, so every later run's epoch 3 replays epoch 0's order too."""
    want = EpochShuffled()
    want.set_epoch(3)
    with ShmDatasetCache(session="review", size=16) as cache:
        ds = cache.wrap(EpochShuffled())
        ds.set_epoch(3)
        assert _pass(ds) == list(want)
        cache.store.destroy()


class TensorEpoch(EpochShuffled):
    """Its epoch in a shared torch tensor, so its persistent DataLoader workers see set_epoch (the
    wrapper's own trick, and what HF's stream keeps behind its ``epoch`` property)."""

    def __init__(self):
        super().__init__()
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch: int) -> None:
        self.epoch.fill_(epoch)

    def __iter__(self):
        order = list(range(self.n))
        random.Random(int(self.epoch)).shuffle(order)
        return iter(order)


def test_a_sources_epoch_in_a_tensor_is_its_epoch():
    """source.set_epoch(epoch) each epoch, as HF's examples do: the wrapper read only an int (or
    numpy int) ``epoch``, so a 0-d integer tensor was no epoch at all - the replays kept epoch 0's
    order every epoch, without the word the default promises."""
    src = TensorEpoch()
    with ShmDatasetCache(session="review", name="tensor", size=16) as cache:
        ds = cache.wrap(src)
        first = _pass(ds)
        src.set_epoch(1)
        got, said = _said(lambda: [int(x) for x in ds])
        assert got == first and len(said) == 1 and "reshuffle=True" in said[0], said
    src = TensorEpoch()
    with ShmDatasetCache(session="review", name="tensor-reshuffled", size=16) as cache:
        ds = cache.wrap(src, reshuffle=True)
        first = _pass(ds)
        src.set_epoch(1)
        got = _pass(ds)
        assert sorted(got) == list(range(N)) and got != first


_FULL = textwrap.dedent("""\
    import os
    from torch.utils.data import IterableDataset
    from shmcache import ShmDatasetCache

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(10))

    with open("/dev/shm/filler", "wb") as f:  # /dev/shm full (a tmpfs of this namespace's own)
        while True:
            try:
                f.write(bytes(1 << 20))
                f.flush()
            except OSError:
                break
    cache = ShmDatasetCache(session="review", name="full", size=4)
    ds = cache.wrap(Stream())
    assert list(ds) == list(range(10))
    assert list(ds) == list(range(10))
    cache.close()
    print("SERVED")
""")


def test_wrap_of_a_stream_on_a_full_dev_shm_serves_the_source(tmp_path):
    """Before the epochs commit a stream wrapped on a full /dev/shm was served from the source
    (the cache uncached, said once - README: "items are computed from the source"); the wrapper's
    shared epoch tensor made wrap() raise torch's RuntimeError "unable to allocate shared memory"."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): mounts a tmpfs over /dev/shm in a private mount namespace")
    (tmp_path / "full.py").write_text(_FULL)
    steps = f"mount -t tmpfs -o size=8m tmpfs /dev/shm || exit 99; exec {sys.executable} {tmp_path / 'full.py'}"
    done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", steps], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    if done.returncode == 99 or "unshare failed" in done.stderr:
        pytest.skip(f"cannot mount a private tmpfs over /dev/shm here: {done.stderr.strip()[-300:]}")
    assert done.returncode == 0 and "SERVED" in done.stdout, done.stderr[-3000:]


_RESUME = _SOURCES + textwrap.dedent("""\
    if __name__ == "__main__":
        kind, epoch, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
        source = hf() if kind == "hf" else EpochShuffled()
        source.set_epoch(epoch)  # a run resumed at this epoch (HF's Trainer from a checkpoint)
        cache = ShmDatasetCache(session="review", name=None if name == "-" else name, size=16)
        ds = cache.wrap(source, reshuffle=True)
        got = sorted(int(x["x"]) if isinstance(x, dict) else int(x) for x in ds)
        assert got == list(range(40)), got
        print("NAME", cache.name)
        print("COMPUTED", cache.stats()["computed"])
        cache.close()
""")


# slow: 4-8 s each; by default the unnamed resumed run covers both (its name is the fingerprint, made
# in two processes at two epochs)
@pytest.mark.slow
@pytest.mark.parametrize("kind", ["plain", "hf"])
def test_a_run_resumed_at_a_later_epoch_finds_the_cache_its_warm_up_made(tmp_path, kind):
    """A warm-up script read the stream in epoch 0 into cache "resumed"; the training run resumed
    at epoch 2 (source.set_epoch(2), then wrap): the fingerprint hashed the source's epoch (HF's
    ``_epoch`` tensor, a public ``epoch`` int), so the same stream was "another dataset" -
    CacheMismatch for the named cache (an unnamed one would be recorded again, twice the memory)."""
    if kind == "hf":
        pytest.importorskip("datasets")
    (tmp_path / "run.py").write_text(_RESUME)

    assert "COMPUTED 40" in _run(tmp_path, kind, 0, "resumed")  # the warm-up
    # replayed, in epoch 2's order
    assert "COMPUTED 40" in _run(tmp_path, kind, 2, "resumed"), "the resumed run read the stream again"


def _run(tmp_path, kind: str, epoch: int, name: str) -> str:
    done = subprocess.run([sys.executable, str(tmp_path / "run.py"), kind, str(epoch), name], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.mark.slow
def test_an_hf_stream_is_one_dataset_in_every_process(tmp_path):
    """A warm-up script and a training script (the same epoch, nothing resumed) wrapping the same
    Hugging Face stream: its ``_IterableDataset__hffs_cache`` attribute (HF keeps fsspec's
    instance cache on the stream for its DataLoader workers) is a dict keyed by fsspec tokens,
    which hash the process id - so the fingerprint differed in every process: a named cache said
    CacheMismatch to the training script, an unnamed one was another cache (recorded again, twice
    the memory, never shared)."""
    pytest.importorskip("datasets")
    (tmp_path / "run.py").write_text(_RESUME)
    assert "COMPUTED 40" in _run(tmp_path, "hf", 0, "hf")
    assert "COMPUTED 40" in _run(tmp_path, "hf", 0, "hf")  # CacheMismatch
    names = {line for line in _run(tmp_path, "hf", 0, "-").splitlines() + _run(tmp_path, "hf", 0, "-").splitlines()
             if line.startswith("NAME")}
    assert len(names) == 1, names


@pytest.mark.parametrize("kind", [pytest.param("plain", marks=pytest.mark.slow), "hf"])  # 3 s each: HF by default
def test_an_unnamed_cache_of_a_run_resumed_at_a_later_epoch_is_its_warm_ups(tmp_path, kind):
    """The same without a name: wrap() names the cache after the stream's first 16 items, read in
    the source's epoch of the moment - a run resumed at epoch 2 read epoch 2's and got a cache of
    its own, the whole stream recorded again beside the warm-up's (twice the memory, cold)."""
    if kind == "hf":
        pytest.importorskip("datasets")
    (tmp_path / "run.py").write_text(_RESUME)
    warm, resumed = _run(tmp_path, kind, 0, "-"), _run(tmp_path, kind, 2, "-")
    assert [x for x in warm.splitlines() if x.startswith("NAME")] == [
        x for x in resumed.splitlines() if x.startswith("NAME")], (warm, resumed)
    assert "COMPUTED 40" in resumed, resumed


def _pass_cleared_at(ds, name: str, k: int) -> None:
    """A pass of ``ds`` with `shmcache clear` (another process) after its item ``k``: each item once."""
    got = []
    for n, x in enumerate(ds):
        got.append(int(x))
        if n == k:
            done = subprocess.run([sys.executable, "-c", _CLEAR.format(name=name)], capture_output=True,
                                  text=True, timeout=60)
            assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(got) == list(range(N))


def _cached_again(cache, ds, epochs) -> None:
    """``ds`` in each of ``epochs``: each item once, no clear said, and the last epoch a replay."""
    for epoch in epochs:
        ds.set_epoch(epoch)
        hits = cache.stats()["hits"]
        got, said = _said(lambda: [int(x) for x in ds])
        assert sorted(got) == list(range(N)), (epoch, sorted(got))
        assert not [s for s in said if "was cleared during" in s], (epoch, said)
    assert cache.stats()["hits"] - hits == N  # cached again: the last epoch a replay, not the source


@pytest.mark.parametrize("reshuffle", [pytest.param(None, marks=pytest.mark.slow), True])  # slow: as True, unshuffled
def test_a_clear_from_another_process_mid_recording_pass_is_not_a_whole_recording(reshuffle):
    """`shmcache clear` (another process) after the 6th item of the recording pass in epoch 0: the
    pass went on putting items 6.. and then wrote its marker saying every put stored its item
    (``whole``), though the clear took items 0..5. Epoch 1, trusting ``whole``, skipped the check
    of each key and met the missing items mid-replay: with reshuffle=True some items twice and
    others never; in either case "the cache was cleared during epoch 1", which it was not. (Before
    ``whole``, the check found the gap and read epoch 1 from the source, each item once - and so
    every epoch after it: the marker stayed, and the cache was never used again.)"""
    name = f"clearrec{reshuffle}"
    with ShmDatasetCache(session="review", name=name, size=16) as cache:
        ds = cache.wrap(EpochShuffled(), reshuffle=reshuffle)
        ds.set_epoch(0)
        _pass_cleared_at(ds, name, 5)
        _cached_again(cache, ds, (1, 2, 3, 4))
        cache.store.destroy()


def test_a_clear_mid_replay_of_the_recorded_epoch_is_not_a_whole_recording():
    """Epoch 0 recorded, then read again in epoch 0 (an evaluation pass, set_epoch not called),
    `shmcache clear` after its 6th item: the pass recorded items 6.. again and wrote a marker
    saying every item was stored, though items 0..5 went with the clear. Epoch 1 (reshuffle=True)
    trusted it: a clear "during epoch 1" said, and items of epoch 1 twice and lost. A marker that
    says the items are not all stored is no better: every later epoch read the source, never cached
    again (a replay in another epoch does not fill in another epoch's positions)."""
    name = "clearsame"
    with ShmDatasetCache(session="review", name=name, size=16) as cache:
        ds = cache.wrap(EpochShuffled(), reshuffle=True)
        ds.set_epoch(0)
        assert sorted(_pass(ds)) == list(range(N))
        _pass_cleared_at(ds, name, 5)
        _cached_again(cache, ds, (1, 2, 3))
        cache.store.destroy()


@pytest.mark.xfail(strict=True, reason=(
    "a stream's marker cannot be replaced (a put keeps what is there): one that says a pass was not "
    "whole makes every later epoch of a set_epoch source a read of the source, though the refusal "
    "(a lock timeout) was passing; telling a passing refusal from a lasting one (an item too large) "
    "or a marker per recording is not built"))
def test_one_put_rejected_once_in_the_recording_pass_does_not_end_caching_for_good():
    """One put of the recording pass in epoch 0 refused once (the write lock held past its timeout
    by a stopped process, here simulated): the marker says the pass is not whole, and every later
    epoch of a set_epoch source finds the item missing and reads the source - for the rest of the
    run, though the cache has room and the lock is free again. Not fixed on this branch (the
    marker cannot be replaced: put keeps what is there)."""
    with ShmDatasetCache(session="review", name="refused", size=16) as cache:
        refused = []

        def put_computed(store, key, value, *args, **kwargs):
            if key.endswith(":3") and not refused:
                refused.append(key)
                return False
            return type(cache).put_computed(cache, store, key, value, *args, **kwargs)

        cache.put_computed = put_computed
        ds = cache.wrap(EpochShuffled())
        for epoch in range(5):
            ds.set_epoch(epoch)
            hits = cache.stats()["hits"]
            assert sorted(_pass(ds)) == list(range(N)), epoch
        assert refused and cache.stats()["hits"] - hits == N  # the last epoch a replay
        cache.store.destroy()
