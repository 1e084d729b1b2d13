"""The compiled row copy (base.rowcopy, issue 27): the same bytes as numpy's fancy index, every
row checked against the source before the first byte moves, bad arguments refused by name; off
with ``SHMCACHE_NATIVE=0``, and built wherever CI can build it."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from shmcache.base import rowcopy

native = pytest.mark.skipif("not built" in rowcopy.unavailable_reason(),
                            reason=f"the compiled row copy: {rowcopy.unavailable_reason()}")


@native
@pytest.mark.parametrize(("stride", "offset", "nbytes"), [(64, 0, 64), (3136, 64, 3072), (200, 17, 9), (48, 8, 0)])
def test_each_row_is_the_sources_bytes(stride, offset, nbytes):
    rng = np.random.default_rng(stride + offset)
    src = rng.integers(0, 256, (50, stride), np.uint8)
    rows = rng.integers(0, 50, 40).astype(np.intp)
    rows[:3] = [0, 49, 0]  # the first and last rows, one twice
    dst = np.full((40, nbytes), 7, np.uint8)
    rowcopy.gather(src, offset, stride, nbytes, rows, dst)
    assert (dst == src[rows, offset:offset + nbytes]).all()


@native
def test_strided_indices_and_a_destination_of_another_dtype():
    src = np.arange(30 * 24, dtype=np.uint8).reshape(30, 24)
    words = np.zeros((5, 3), np.uint64)
    words[:, 2] = [4, 29, 0, 4, 11]  # the gather plan reads its chunk column in place
    dst = np.zeros(5, np.int64)
    rowcopy.gather(src, 8, 24, 8, words[:, 2].view(np.intp), dst)
    assert dst.tobytes() == src[[4, 29, 0, 4, 11], 8:16].tobytes()


@native
@pytest.mark.parametrize("bad", [[3, 10], [-1], [2, 9]])
def test_a_row_outside_the_source_raises_before_anything_is_copied(bad):
    src = np.ones((10, 16), np.uint8)
    dst = np.zeros((len(bad), 8), np.uint8)
    offset = 9 if bad == [2, 9] else 0  # row 9's bytes 9..17 end past the source
    with pytest.raises(IndexError, match="outside the source"):
        rowcopy.gather(src, offset, 16, 8, np.array(bad, np.intp), dst)
    assert not dst.any()


def _args(src=None, offset=0, stride=8, nbytes=8, rows=None, dst=None) -> tuple:
    src = np.zeros((4, 8), np.uint8) if src is None else src
    return (src, offset, stride, nbytes, np.zeros(1, np.intp) if rows is None else rows,
            np.zeros(16, np.uint8) if dst is None else dst)


@native
@pytest.mark.parametrize(("args", "error", "match"), [
    (_args(rows=np.zeros(2, np.int32)), TypeError, "8-byte integers"),
    (_args(rows=np.zeros((2, 1), np.intp)), TypeError, "one dimension"),
    (_args(rows=np.zeros(3, np.intp)), ValueError, "do not fit a destination"),
    (_args(stride=0), ValueError, "stride 0"),
    (_args(offset=30), ValueError, "do not fit a source"),
    (_args(src=np.zeros((4, 8), np.uint8)[:, :4], nbytes=4), ValueError, "contiguous"),
    (_args(dst=bytes(16)), BufferError, "writable"),
])
def test_bad_arguments_are_refused_by_name(args, error, match):
    with pytest.raises(error, match=match):
        rowcopy.gather(*args)


@native
@pytest.mark.parametrize("overlaps", ["the source", "the row indices"])
def test_a_destination_that_overlaps_the_source_or_the_indices_is_refused(overlaps):
    """memcpy of overlapping bytes is undefined, and row by row the copy would read rows it wrote
    itself (or indices it overwrote) where numpy's fancy index reads them all first: refused,
    with nothing written."""
    mem = np.arange(96, dtype=np.uint8)
    if overlaps == "the source":
        src, rows, dst = mem[:64], np.array([1, 0, 2], np.intp), mem[4:28]
    else:
        src, rows, dst = np.arange(64, dtype=np.uint8), mem[72:88].view(np.intp), mem[64:80]
        rows[:] = [3, 1]  # row 0's copy would overwrite rows[0], not rows[1]
    before = mem.copy()
    with pytest.raises(ValueError, match="overlaps"):
        rowcopy.gather(src, 0, 8, 8, rows, dst)
    assert (mem == before).all()


def _table(keys=(3, 0, 7), first=0x51, base=5 << 48, limit=10) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A table of 8 rows whose rows ``keys`` hold (first, key, base + chunk): chunk 2 * key % limit.
    The rows just outside it (before row 0, after row 7) hold the entries keys -1 and 8 would
    match: only the bounds checks keep them out (a bound off by one returns their chunk)."""
    around = np.zeros((10, 3), np.uint64)
    around[0], around[9] = (first, 2**64 - 1, base + 1), (first, 8, base + 1)
    words = around[1:9]
    keys = np.array(keys, np.int64)
    words[keys, 0], words[keys, 1], words[keys, 2] = first, keys, base + 2 * keys % limit
    return words, keys, np.full(len(keys), -1, np.intp)


@native
def test_match_gives_each_keys_chunk_when_every_row_is_as_expected():
    words, keys, chunks = _table()
    assert rowcopy.match(words, keys, 0x51, 5 << 48, 10, chunks) is True
    assert chunks.tolist() == [6, 0, 4]
    strided = np.repeat(keys, 2)[::2]  # keys read in place at any stride
    assert rowcopy.match(words, strided, 0x51, 5 << 48, 10, chunks) is True and chunks.tolist() == [6, 0, 4]
    assert rowcopy.match(words, keys[:0], 0x51, 5 << 48, 10, chunks[:0]) is True


@native
@pytest.mark.parametrize("change", ["first word", "key word", "chunk at the limit", "chunk below base",
                                    "another class", "negative key", "key past the rows"])
def test_match_is_false_for_any_row_that_differs(change):
    """The planned batch's checks (cache.gather.planned_chunks): any difference sends the batch the
    long way, which names damage; never an exception, never a chunk of another row."""
    words, keys, chunks = _table()
    if change == "first word":
        words[7, 0] ^= 1
    elif change == "key word":
        words[7, 1] = 6
    elif change == "chunk at the limit":
        words[7, 2] = (5 << 48) + 10
    elif change == "chunk below base":
        words[7, 2] = (5 << 48) - 1
    elif change == "another class":
        words[7, 2] = (6 << 48) + 1
    elif change == "negative key":
        keys[2] = -1  # numpy would wrap it to row 7, which holds key 7; the row before row 0 holds key -1
    else:
        keys[2] = 8  # the row after the last holds key 8
    assert rowcopy.match(words, keys, 0x51, 5 << 48, 10, chunks) is False


@native
@pytest.mark.parametrize(("change", "error", "match"), [
    ("words of int64", TypeError, "uint64"), ("words of 2 columns", TypeError, "uint64"),
    ("misaligned words", TypeError, "aligned"), ("keys of int32", TypeError, "8-byte integers"),
    ("chunks too short", ValueError, "room for 2"), ("chunks over the words", ValueError, "overlaps"),
    ("read-only chunks", ValueError, "read-only"),
])
def test_match_refuses_bad_arguments_by_name(change, error, match):
    words, keys, chunks = _table()
    if change == "words of int64":
        words = words.view(np.int64)
    elif change == "words of 2 columns":
        words = np.zeros((8, 2), np.uint64)
    elif change == "misaligned words":
        words = np.zeros(8 * 24 + 4, np.uint8)[4:].view(np.uint64).reshape(8, 3)
    elif change == "keys of int32":
        keys = keys.astype(np.int32)
    elif change == "chunks too short":
        chunks = chunks[:2]
    elif change == "chunks over the words":
        chunks = words[:1].reshape(-1).view(np.intp)
    else:
        chunks.flags.writeable = False
    with pytest.raises(error, match=match):
        rowcopy.match(words, keys, 0x51, 5 << 48, 10, chunks)


# --- write_all: a run's records pwritten from their buffers (shm.Segment.write_at)


@native
def test_write_all_writes_every_buffer_in_order_past_one_call_of_them(tmp_path):
    # more buffers than one pwritev takes (IOV_MAX), of every kind and size, some empty
    bufs = [bytes([i % 251]) * (i % 7) if i % 3 else np.full(i % 11, i % 13, np.uint8) for i in range(3000)]
    bufs += [memoryview(np.ones(3, np.float32)), np.arange(5, dtype=np.int64), bytearray(b"tail")]
    want = b"".join(bytes(memoryview(b).cast("B")) for b in bufs)
    path = tmp_path / "f"
    path.write_bytes(bytes(9))
    fd = os.open(path, os.O_RDWR)
    try:
        assert rowcopy.write_all(fd, 5, bufs, 5 + len(want)) == len(want)
    finally:
        os.close(fd)
    assert path.read_bytes() == bytes(5) + want


@native
@pytest.mark.parametrize(("bufs", "offset", "end", "error", "match"), [
    ([b"abc", b"de"], 4, 8, ValueError, "end past 8"),  # one byte too many: the file would grow
    ([b"abc"], -1, 8, ValueError, "past"),
    ([b"abc", np.arange(8, dtype=np.uint8)[::2]], 0, 64, ValueError, "contiguous"),
    ([b"abc", 7], 0, 64, TypeError, "bytes-like"),
    # an end below the offset: end - offset overflows a long long (signed overflow, undefined) and
    # came out a large positive room, so a pwritev at 2**62 was tried (tmpfs takes it: a huge sparse file)
    ([b"abc"], 2**62, -2**63, ValueError, "past"),
    ([b"abc"], 8, 0, ValueError, "past"),
])
def test_write_all_refuses_before_it_writes_anything(tmp_path, bufs, offset, end, error, match):
    path = tmp_path / "f"
    path.write_bytes(b"\xee" * 8)
    fd = os.open(path, os.O_RDWR)
    try:
        with pytest.raises(error, match=match):
            rowcopy.write_all(fd, offset, bufs, end)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"\xee" * 8


@native
def test_write_all_says_pwritevs_error():
    r, w = os.pipe()
    os.close(r)
    os.close(w)
    with pytest.raises(OSError) as err:
        rowcopy.write_all(w, 0, [b"x"], 64)
    assert err.value.errno == errno.EBADF


# A child that loads _rowcopy.c built with AddressSanitizer and UBSan (-fno-sanitize-recover: the
# first finding aborts it) and runs the arguments at the edges: every row's last byte at the end
# of the source, indices misaligned, strided backwards or not at all, bounds that overflow.
_SANITIZED = """
import importlib.util, sys
import numpy as np
from numpy.lib.stride_tricks import as_strided
spec = importlib.util.spec_from_file_location("_rowcopy", sys.argv[1])
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)
src = np.arange(93, dtype=np.uint8)  # row 10's 12 bytes from 1 + 10 * 8 end at its last byte
for rows in (np.array([0, 10, 5], np.intp), np.array([5, 0, 10], np.intp)[::-1],
             np.zeros(25, np.uint8)[1:25].view(np.intp), np.zeros(36, np.uint8)[3:27].view(np.intp)):
    rows[...] = [0, 10, 5]
    dst = np.zeros(3 * 12, np.uint8)
    rc.gather(src, 1, 8, 12, rows, dst)
    assert dst.tobytes() == b"".join(src[1 + r * 8:13 + r * 8].tobytes() for r in (0, 10, 5))
dst = np.zeros(3 * 12, np.uint8)
rc.gather(src, 1, 8, 12, as_strided(np.array([10], np.intp), (3,), (0,)), dst)
assert dst.tobytes() == src[81:93].tobytes() * 3
rc.gather(src, 1, 8, 12, as_strided(np.array([10], np.intp), (1,), (-2**63,)), dst)  # one index: any stride
assert dst[:12].tobytes() == src[81:93].tobytes()
# rows of 256 bytes and more: the next row's first KiB asked for ahead, up to the source's last row
# (whose last byte ends it), indices walked backwards; rows of 256, 1000 and 1500 bytes
for stride, nbytes in ((256, 256), (1003, 1000), (1501, 1500)):
    big = np.arange(3 + 6 * stride, dtype=np.uint32).astype(np.uint8)[:3 + 5 * stride + nbytes]
    rows = np.array([5, 0, 5, 2, 4, 5], np.intp)[::-1]
    dst = np.zeros(6 * nbytes, np.uint8)
    rc.gather(big, 3, stride, nbytes, rows, dst)
    assert dst.tobytes() == b"".join(big[3 + r * stride:3 + r * stride + nbytes].tobytes() for r in rows)
for bad in ((2**62, 8, 8), (0, 2**62, 8), (0, 8, 2**62), (0, 2**63 - 1, 1)):
    try:
        rc.gather(src, *bad, np.array([11, 2**61], np.intp), np.zeros(64, np.uint8))
    except (IndexError, ValueError):
        pass
mem = np.zeros(96, np.uint8)
for s, d in ((mem[:64], mem[8:32]), (mem[8:72], mem[:24]), (mem, mem)):
    try:
        rc.gather(s, 0, 8, 8, np.array([1, 0, 2], np.intp), d)
    except ValueError:
        pass
words = np.zeros((8, 3), np.uint64)
words[[3, 7], 0], words[[3, 7], 1], words[[3, 7], 2] = 9, [3, 7], [2, 5]
chunks = np.zeros(4, np.intp)
for keys in (np.array([7, 3], np.int64), np.array([7], np.int64), np.zeros(25, np.uint8)[1:25].view(np.int64)):
    rc.match(words, keys, 9, 0, 6, chunks)
# each edge key the first that fails (one bad key ends the pass): rows 8 and -1 lie just outside
# the words' allocation; 3 * -2**63 wraps around to row 0, so it alone would touch nothing
for bad in (8, -1, 2**63 - 1, -2**63, -2**62):
    assert not rc.match(words, np.array([7, 3, bad], np.int64), 9, 0, 6, chunks)
assert rc.match(words, np.array([7, 3], np.int64), 9, 0, 6, chunks) and chunks[:2].tolist() == [5, 2]
# write_all: past IOV_MAX buffers, empty ones among them, the last byte at the end; then one past it
import os, tempfile
with tempfile.TemporaryFile() as f:
    bufs = [bytes([i % 251]) * (i % 5) for i in range(2500)] + [np.arange(7, dtype=np.uint8)]
    n = sum(map(len, bufs))
    assert rc.write_all(f.fileno(), 3, bufs, 3 + n) == n
    try:
        rc.write_all(f.fileno(), 4, bufs, 3 + n)
    except ValueError:
        pass
    os.lseek(f.fileno(), 0, 0)
    assert os.read(f.fileno(), n + 10) == bytes(3) + b"".join(bytes(b) for b in bufs)
print("clean")
"""


def test_the_c_is_clean_under_address_and_undefined_behaviour_sanitizers(sanitized):
    done = sanitized(Path(rowcopy.__file__).with_name("_rowcopy.c"), _SANITIZED)
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


# write_all's bounds at the edges of a long long: an end below the offset, an offset at the top
# (the message's offset + total must not overflow either)
_WRITE_EDGES = """
import importlib.util, sys, tempfile
spec = importlib.util.spec_from_file_location("_rowcopy", sys.argv[1])
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)
with tempfile.TemporaryFile() as f:
    for offset, end in ((2**62, -2**63), (2**63 - 1, 2**63 - 1), (2**63 - 2, 2**63 - 1), (0, -1)):
        try:
            rc.write_all(f.fileno(), offset, [b"abc"], end)
            raise SystemExit(f"{offset}, {end}: written")
        except ValueError:
            pass
print("clean")
"""


@native
def test_write_alls_bounds_at_the_edges_of_a_long_long_are_clean_under_the_sanitizers(sanitized):
    done = sanitized(Path(rowcopy.__file__).with_name("_rowcopy.c"), _WRITE_EDGES)
    assert done.returncode == 0 and done.stdout == "clean\n", (done.stdout, done.stderr[-3000:])


# A thread writes indices past the source and back while the copy runs (without the GIL): the
# next row asked for ahead is read apart from the row copied, and must be checked on its own
# (UBSan's overflow check aborts on an address computed from such an index). Every other index of
# a stretch goes bad at once: wherever the copy is in it, the row it copies is good and the next
# one is not, so each race asks for a bad row ahead (one index at a time took 500-2000 copies of
# 15 MB for three races, 5-17 s under ASan; without the bound, this aborts on 20 runs of 20).
_RACED = """
import importlib.util, random, sys, threading
import numpy as np
spec = importlib.util.spec_from_file_location("_rowcopy", sys.argv[1])
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)
src = np.zeros((64, 300), np.uint8)
src[3] = 7
rows = np.full(50000, 3, np.intp)
dst = np.zeros(50000 * 300, np.uint8)
stop = False
sys.setswitchinterval(1e-5)
def flip():
    r = random.Random(0)
    while not stop:
        k = r.randrange(1, len(rows) - 1024)
        rows[k + 1:k + 1024:2] = 2**61
        rows[k + 1:k + 1024:2] = 3
thread = threading.Thread(target=flip)
thread.start()
changed = 0
for _ in range(2000):
    try:
        rc.gather(src, 0, 300, 300, rows, dst)
        assert (dst == 7).all()
    except RuntimeError:  # the index changed under the copy: said, and nothing outside was read
        changed += 1
        if changed == 20:
            break
    except IndexError:  # past the source before the copy began
        pass
stop = True
thread.join()
print("clean" if changed else "no race")
"""


def test_the_next_row_is_asked_for_only_inside_the_source_while_another_thread_changes_it(sanitized):
    done = sanitized(Path(rowcopy.__file__).with_name("_rowcopy.c"), _RACED)
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


def test_shmcache_native_0_turns_it_off_and_says_how_to_turn_it_on(compiled_part):
    compiled_part.turned_off_by_env("from shmcache.base import rowcopy; print(rowcopy.NATIVE); "
                                    "print(rowcopy.unavailable_reason())", '"batch_copy": "numpy: ')


def test_ci_builds_it_where_a_compiler_and_pythons_headers_are_present(compiled_part):
    """An install on a machine that can build it must: a failed build would quietly leave every
    batch on numpy's two-pass copy (the extension is optional, so pip says nothing)."""
    compiled_part.built_where_it_can(rowcopy.NATIVE, rowcopy.unavailable_reason(),
                                     "the compiled row copy was not built", "the install runs on numpy's copy")


def _unbuilt(tmp_path: Path) -> Path:
    """A copy of shmcache without the built extension, for a child's PYTHONPATH."""
    pkg = Path(rowcopy.__file__).parents[1]
    shutil.copytree(pkg, tmp_path / "shmcache", ignore=shutil.ignore_patterns("*.so", "__pycache__"))
    return tmp_path


# the tests of shmcache's compiled parts: this file's (base._rowcopy), base._ahead's, cache._hit's,
# cache._codec's and cache._index's
COMPILED_TESTS = [__file__, str(Path(__file__).with_name("test_ahead.py")),
                  *(str(Path(__file__).parents[1] / "cache" / name)
                    for name in ("test_hit.py", "test_codec_native.py", "test_index_native.py"))]


def _pytest_unbuilt(tmp_path: Path, cc: str, select: str) -> subprocess.CompletedProcess:
    """The tests ``select`` of the compiled parts in a child pytest whose shmcache (and its
    children's) was not built, with ``CC`` set to ``cc``. The unbuilt copy goes ahead of the
    caller's own PYTHONPATH, which may hold the dependencies (a machine where they travel as a
    folder of wheels): only ``shmcache`` must resolve to the copy."""
    path = os.pathsep.join(p for p in (str(_unbuilt(tmp_path)), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "CC": cc, "ROWCOPY_UNBUILT_CHILD": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", *COMPILED_TESTS, "-q", "-p", "no:cacheprovider",
                           "-k", select], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_these_tests_pass_where_it_was_not_built(tmp_path):
    """An install without a C compiler runs the tests of the compiled parts too: they must skip
    or pass there."""
    if os.environ.get("ROWCOPY_UNBUILT_CHILD"):
        pytest.skip("the child run itself")
    done = _pytest_unbuilt(tmp_path, str(tmp_path / "no-compiler"), "not sanitizers")
    assert done.returncode == 0 and " failed" not in done.stdout, done.stdout[-4000:]
    # the skips say why: each ran without its extension
    assert "the compiled row copy: not built at install" in done.stdout, done.stdout[-4000:]
    assert "the compiled hit: not built at install" in done.stdout, done.stdout[-4000:]
    assert "pages backed ahead: not built at install" in done.stdout, done.stdout[-4000:]
    assert "the compiled pack: not built at install" in done.stdout, done.stdout[-4000:]
    assert "the compiled batch probe: not built at install" in done.stdout, done.stdout[-4000:]


@pytest.mark.parametrize("flags", ["", " -O2"])
def test_the_build_guard_fails_an_unbuilt_install_whatever_flags_cc_carries(tmp_path, flags):
    """CC may name the compiler with flags (``gcc -O2``, ``ccache gcc``), as setuptools takes it:
    the guard must still see a compiler and fail, not skip."""
    if os.environ.get("ROWCOPY_UNBUILT_CHILD"):
        pytest.skip("the child run itself")
    gcc = shutil.which("gcc")
    if not gcc or not (Path(sysconfig.get_paths()["include"]) / "Python.h").exists():
        pytest.skip("no gcc or Python headers here")
    done = _pytest_unbuilt(tmp_path, gcc + flags, "ci_builds")
    assert "5 failed" in done.stdout, done.stdout[-4000:]
    assert "the compiled row copy was not built" in done.stdout, done.stdout[-4000:]
    assert "the compiled hit was not built" in done.stdout, done.stdout[-4000:]
    assert "pages backed ahead were not built" in done.stdout, done.stdout[-4000:]
    assert "the compiled pack was not built" in done.stdout, done.stdout[-4000:]
    assert "the compiled batch probe was not built" in done.stdout, done.stdout[-4000:]
