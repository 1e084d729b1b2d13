"""Size classes: every record fits its chunk, waste stays under 1/32 + 64 bytes, classes are
monotonic and dense, and fixed-shape samples fill their chunks; the class table round-trips."""

from __future__ import annotations

import numpy as np
import pytest

from shmcache.cache.allocator import MAX_CLASSES, ClassTable, commit_step_chunks, size_class
from shmcache.cache.store import CacheStore


def _sizes():
    yield from range(1, 70_000)
    for e in range(16, 41):
        for d in (-65, -64, -1, 0, 1, 63, 64, 4097):
            yield (1 << e) + d
    rng = np.random.default_rng(5)
    yield from rng.integers(1, 1 << 34, 2000).tolist()


def test_every_size_fits_with_bounded_waste_and_classes_are_monotonic():
    prev_cls, prev_chunk = 0, 0
    chunk_of: dict[int, int] = {}
    for n in sorted(set(_sizes())):
        cls, chunk = size_class(n)
        assert chunk >= max(n, 1), n
        assert chunk % 64 == 0, n
        assert chunk - n < n / 32 + 64, f"{n} bytes get a {chunk}-byte chunk"
        assert 1 <= cls < MAX_CLASSES
        assert cls >= prev_cls and chunk >= prev_chunk, f"not monotonic at {n}"
        assert chunk_of.setdefault(cls, chunk) == chunk, f"class {cls} has two chunk sizes"
        prev_cls, prev_chunk = cls, chunk
    assert size_class(0) == (1, 64)


def test_classes_are_dense_up_to_a_megabyte():
    seen = {size_class(n)[0] for n in range(1, 1 << 20, 16)}
    assert seen == set(range(1, max(seen) + 1))


def test_small_records_get_their_size_rounded_to_64_bytes():
    for n in range(1, 4097):
        assert size_class(n)[1] == -(-n // 64) * 64, n


def test_same_size_always_same_class():
    for n in (64, 3136, 4160, 150_592, 1 << 22):
        assert len({size_class(n) for _ in range(3)}) == 1


def test_largest_class_and_beyond():
    cls, chunk = size_class(1 << 40)
    assert cls < MAX_CLASSES and chunk >= 1 << 40
    with pytest.raises(OverflowError, match="bytes"):
        size_class(1 << 50)


def test_commit_steps_are_small_and_at_least_one_chunk():
    for chunk in (64, 3136, 65536, 65600, 1 << 22):
        step = commit_step_chunks(chunk)
        assert step >= 1
        assert step * chunk <= max(64 << 10, chunk)


def test_class_table_roundtrip():
    buf = bytearray(4096 + 32 * MAX_CLASSES)
    t = ClassTable(buf, 4096)
    assert t.get(5) == (0, 0, 0) and t.used_classes() == []
    t.create(5, 320)
    t.set_bump(5, 17)
    t.set_committed(5, 204)
    t.create(MAX_CLASSES - 1, 1 << 30)
    assert t.get(5) == (320, 17, 204)
    assert t.chunk_size(5) == 320
    assert t.used_classes() == [5, MAX_CLASSES - 1]
    assert bytes(buf[:4096]) == bytes(4096), "wrote outside its table"


@pytest.mark.parametrize("nbytes", [3072, 4000, 150528, 100_000])
def test_fixed_shape_records_get_an_exact_chunk(nbytes):
    """allocator.py: up to 4 KiB a record's chunk is its exact size rounded to 64 bytes; above,
    it wastes under 1/32. Checked on the chunk the store really uses for such records."""
    s = CacheStore("alloc", f"fixed{nbytes}", capacity_bytes=64 << 20)
    try:
        for k in range(3):
            s.put(k, (np.full(nbytes, k, np.uint8), k))
        g = s.view.refresh()
        (cls,) = g.classes.used_classes()
        record = s.stats()["bytes_mem"] // 3
        chunk = g.classes.chunk_size(cls)
        if record <= 4096:
            assert chunk == -(-record // 64) * 64, f"a {record}-byte record lives in a {chunk}-byte chunk"
        else:
            assert record <= chunk < record * (1 + 1 / 32), f"a {record}-byte record lives in a {chunk}-byte chunk"
    finally:
        s.close()


def test_a_word_rewritten_in_shared_memory_is_never_seen_as_zero():
    """Lock-free readers in other processes read a class's bump and committed count (and the
    epoch word, the layout count, the counters) while a writer rewrites them. struct.pack_into
    zeroes its destination before it stores, so readers saw a transient 0 - "75 chunks handed out
    of 0 committed", a false CorruptSegment under normal concurrency (found by the batch stress
    test). Every such word is one aligned store (segment.word_view)."""
    import os
    import time

    from shmcache.base.shm import Segment

    seg = Segment.create("/shmcache-test-words-" + str(os.getpid()), 64 << 10, commit=64 << 10)
    try:
        table = ClassTable(seg.buf, 4096)
        table.create(5, 320)
        table.set_committed(5, 1)
        pid = os.fork()
        if pid == 0:  # the writer: rewrite the word for a while, never to 0
            try:
                end, i = time.monotonic() + 1.5, 1
                while time.monotonic() < end:
                    i = i % 1_000_000 + 1
                    table.set_committed(5, i)
            finally:
                os._exit(0)
        zeros = reads = 0
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            for _ in range(2000):
                zeros += table.get(5)[2] == 0
            reads += 2000
        os.waitpid(pid, 0)
        assert zeros == 0, f"{zeros} of {reads} lock-free reads saw a transient 0"
    finally:
        seg.unlink()
