"""Shared-memory segments: headers are checked on attach, objects are private (0600, whatever the
umask), memory is committed lazily, and a name is never unlinked unless it is still ours."""

from __future__ import annotations

import os
import stat
import struct

import posix_ipc
import pytest

from shmcache.base.shm import HEADER_BYTES, MAGIC, PAGE, VERSION, Segment
from shmcache.errors import CorruptSegment


@pytest.fixture
def name(shm_namespace):
    n = shm_namespace.segment_name("segtest", "one")
    yield n
    try:
        posix_ipc.unlink_shared_memory(n)
    except posix_ipc.ExistentialError:
        pass


def _raw(name: str, data: bytes, size: int | None = None) -> None:
    """A shared-memory object written by 'another program' (or a creator that died mid-way)."""
    shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
    try:
        os.ftruncate(shm.fd, len(data) if size is None else size)
        os.pwrite(shm.fd, data, 0)
    finally:
        shm.close_fd()


def _header(magic=MAGIC, version=VERSION, kind=3, size=PAGE, ready=0x5245414459) -> bytes:
    return struct.pack("QIIQQ", magic, version, kind, size, ready).ljust(PAGE, b"\0")


def test_create_attach_share_bytes(name):
    a = Segment.create(name, 3 * PAGE, kind=7, commit=PAGE)
    b = Segment.attach(name, kind=7)
    assert b.size == a.size == 3 * PAGE and b.kind == 7
    a.buf[HEADER_BYTES:HEADER_BYTES + 5] = b"hello"
    assert bytes(b.buf[HEADER_BYTES:HEADER_BYTES + 5]) == b"hello"
    a.close()
    b.close()


def test_attach_missing_raises_file_not_found(name):
    with pytest.raises(FileNotFoundError):
        Segment.attach(name)


def test_attach_with_wrong_kind_is_corrupt_and_leaves_the_segment_alone(name):
    a = Segment.create(name, PAGE, kind=2)
    with pytest.raises(CorruptSegment, match="kind 2"):
        Segment.attach(name, kind=3)
    b = Segment.attach(name, kind=2)  # still there, still valid
    assert b.kind == 2
    a.close()
    b.close()


@pytest.mark.parametrize("data,why", [
    (os.urandom(PAGE), "garbage"),
    (_header(magic=0x1234), "magic"),
    (_header(ready=0), "not ready"),
    (_header(version=VERSION + 1), "version"),
    (_header(size=2 * PAGE), "size mismatch"),
    (b"\0" * 10, "too small"),
    (b"", "empty"),
])
def test_attach_with_a_bad_header_is_corrupt_and_not_unlinked(name, data, why):
    _raw(name, data)
    with pytest.raises(CorruptSegment) as info:
        Segment.attach(name)
    assert name.lstrip("/") in str(info.value) or name in str(info.value), why
    path = "/dev/shm/" + name.lstrip("/")
    assert os.stat(path).st_size == len(data), "attach must never truncate or resize"


def test_create_over_an_existing_name_fails_and_keeps_it(name):
    a = Segment.create(name, PAGE, kind=1)
    a.buf[HEADER_BYTES] = 42
    with pytest.raises(FileExistsError, match="exists already"):
        Segment.create(name, 4 * PAGE, kind=1)
    b = Segment.attach(name, kind=1)
    assert b.size == PAGE and b.buf[HEADER_BYTES] == 42
    a.close()
    b.close()


def test_segments_are_mode_0600_whatever_the_umask(name):
    old = os.umask(0)
    try:
        seg = Segment.create(name, PAGE)
    finally:
        os.umask(old)
    mode = stat.S_IMODE(os.stat("/dev/shm/" + name.lstrip("/")).st_mode)
    assert mode == 0o600, oct(mode)
    seg.close()


def test_memory_is_committed_lazily(name):
    seg = Segment.create(name, 64 << 20, commit=PAGE)
    assert seg.size == 64 << 20
    resident = lambda: os.stat("/dev/shm/" + name.lstrip("/")).st_blocks * 512  # noqa: E731
    assert resident() <= 2 * PAGE, "a new segment must not commit its virtual size"
    seg.commit(1 << 20, 1 << 20)
    assert (1 << 20) <= resident() <= (1 << 20) + 2 * PAGE
    seg.buf[(1 << 20) + 5] = 7  # committed pages are writable
    seg.close()


def test_unlink_checks_the_inode(name):
    """A name recreated by someone else after we mapped it is not ours to unlink."""
    old = Segment.create(name, PAGE)
    posix_ipc.unlink_shared_memory(name)
    new = Segment.create(name, PAGE)
    assert old.unlink() is False
    assert os.path.exists("/dev/shm/" + name.lstrip("/"))
    assert new.unlink() is True
    assert not os.path.exists("/dev/shm/" + name.lstrip("/"))
    assert new.unlink() is False  # twice: harmless
    old.close()
    new.close()


def test_close_is_idempotent_and_leaves_the_object(name):
    seg = Segment.create(name, PAGE)
    seg.close()
    seg.close()
    again = Segment.attach(name)
    assert again.size == PAGE
    again.close()


def test_write_at_copies_many_buffers_in_order_past_one_call_of_them(name):
    # more buffers than one pwritev takes (IOV_MAX), of every size and kind, some empty
    import numpy as np

    a = Segment.create(name, 64 * PAGE, kind=3, commit=64 * PAGE)
    bufs = [bytes([i % 251]) * (i % 7) if i % 3 else np.full(i % 11, i % 13, np.uint8) for i in range(3000)]
    want = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    a.write_at(PAGE + 5, bufs)
    assert bytes(a.buf[PAGE + 5:PAGE + 5 + len(want)]) == want
    assert a.buf[PAGE + 5 + len(want)] == 0  # nothing past them
    a.unlink()


def test_write_at_in_one_call_counts_bytes_not_items(name):
    # below IOV_MAX buffers: one pwritev; buffers of wider items (int64, float32) count by bytes
    import numpy as np

    a = Segment.create(name, 16 * PAGE, kind=3, commit=16 * PAGE)
    bufs = [b"head", np.arange(5, dtype=np.int64), b"", memoryview(np.ones(3, np.float32)), np.zeros(0, np.int64),
            bytearray(b"tail")]
    want = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    a.write_at(PAGE, bufs)
    assert bytes(a.buf[PAGE:PAGE + len(want) + 1]) == want + b"\0"
    with pytest.raises(ValueError, match="past"):  # counted in bytes: 8 int64s are 64 of them
        a.write_at(16 * PAGE - 63, [np.arange(8, dtype=np.int64)])
    a.unlink()


@pytest.mark.parametrize("many", [False, True])
def test_write_at_takes_the_same_buffers_past_one_call_of_them(name, many):
    # one pwritev, or IOV_MAX buffers a call (and the copy through a hugetlbfs mapping, in
    # tests/integration/test_memory_dir.py): each takes what the other takes (0-d arrays,
    # complex, big-endian, float16, structured, 2-D memoryviews, empty arrays of any shape) and
    # writes exactly their concatenation
    import numpy as np

    odd = [np.array(5), np.array([1j, 2j]), np.arange(3, dtype=">i8"), np.full(2, 1.5, np.float16),
           np.ones(2, [("a", "<i4"), ("b", ">f8")]), np.array([True]), memoryview(b"abcdefgh").cast("i"),
           memoryview(np.arange(12, dtype=np.int16).reshape(3, 4)), bytearray(b"xyz"), b"", np.zeros((0, 3)),
           np.zeros((2, 0), np.int64)]
    bufs = odd * (300 if many else 1)
    want = b"".join(memoryview(b).tobytes() for b in bufs)
    a = Segment.create(name, 64 * PAGE, kind=3, commit=64 * PAGE)
    a.write_at(PAGE + 3, bufs)
    assert bytes(a.buf[PAGE:PAGE + 3 + len(want) + 1]) == bytes(3) + want + b"\0"
    a.unlink()


def test_write_at_takes_buffers_from_any_iterable(name):
    # a generator is read once: counted and written from the same buffers, never nothing written
    a = Segment.create(name, 4 * PAGE, kind=3, commit=4 * PAGE)
    a.write_at(PAGE, (bytes([i]) * 3 for i in range(1, 4)))
    assert bytes(a.buf[PAGE:PAGE + 10]) == b"\x01\x01\x01\x02\x02\x02\x03\x03\x03\0"
    a.unlink()


@pytest.mark.parametrize("offset,length", [(4 * PAGE - 4, 8), (4 * PAGE, 1), (8 * PAGE, PAGE), (0, 8), (-8, 8)])
def test_write_at_never_writes_past_the_segment_nor_over_its_header(name, offset, length):
    # pwritev past the object's end would grow it (pages no commit counted, a size the header
    # does not say); over the header it would destroy the segment: both refused, nothing written
    a = Segment.create(name, 4 * PAGE, kind=3, commit=4 * PAGE)
    path = "/dev/shm/" + name.lstrip("/")
    head = bytes(a.buf[:HEADER_BYTES])
    with pytest.raises(ValueError, match="past|header"):
        a.write_at(offset, [b"\xee" * length])
    assert os.stat(path).st_size == 4 * PAGE
    assert bytes(a.buf[:HEADER_BYTES]) == head and not any(a.buf[HEADER_BYTES:])
    a.write_at(4 * PAGE - 8, [b"\xee" * 8])  # the last bytes are its own
    assert bytes(a.buf[4 * PAGE - 8:]) == b"\xee" * 8
    a.unlink()
