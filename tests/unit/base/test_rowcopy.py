"""The compiled row copy (base.rowcopy, issue 27): the same bytes as numpy's fancy index, every
row checked against the source before the first byte moves, bad arguments refused by name; off
with ``SHMCACHE_NATIVE=0``, and built wherever CI can build it."""

from __future__ import annotations

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


def _run(code: str, **env) -> str:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env}, capture_output=True, text=True,
                          check=True, timeout=60).stdout


def test_shmcache_native_0_turns_it_off_and_says_how_to_turn_it_on():
    out = _run("from shmcache.base import rowcopy; print(rowcopy.NATIVE); print(rowcopy.unavailable_reason())",
               SHMCACHE_NATIVE="0")
    assert out.splitlines()[0] == "False"
    assert "SHMCACHE_NATIVE" in out and ("unset it" in out or "not built" in out)
    info = _run("from shmcache.cli import main; main(['info', '--json'])", SHMCACHE_NATIVE="0")
    assert '"batch_copy": "numpy: ' in info


def test_ci_builds_it_where_a_compiler_and_pythons_headers_are_present():
    """An install on a machine that can build it must: a failed build would quietly leave every
    batch on numpy's two-pass copy (the extension is optional, so pip says nothing)."""
    can = shutil.which(os.environ.get("CC", "cc")) and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()
    if not can:
        pytest.skip("no C compiler or Python headers here: the install runs on numpy's copy")
    if "turned off" in rowcopy.unavailable_reason():
        pytest.skip("turned off by SHMCACHE_NATIVE in this run")
    assert rowcopy.NATIVE, f"the compiled row copy was not built: {rowcopy.unavailable_reason()}"
