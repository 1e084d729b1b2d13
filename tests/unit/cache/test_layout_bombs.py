"""A record's layout is marshal bytes that anyone who writes to a shared Redis or hands over a
snapshot chooses. marshal trusts the counts it reads (a tuple of 2**31 items is allocated before a
single item is read), and its back-references let a few hundred bytes name a tree of 2**40 nodes:
``codec.check_layout`` must refuse both in time and memory proportional to the layout's bytes.

Each attack runs in a child process with a 2 GiB address-space limit and a time limit, so a
regression is a failure, never a machine brought down or a hung run."""

from __future__ import annotations

import marshal
import os
import struct
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))
    from shmcache.cache import codec
    layout = bytes.fromhex(sys.argv[1])
    t = time.monotonic()
    try:
        found = codec.check_layout(layout)
    except BaseException as exc:
        print(f"raised {type(exc).__name__}: {exc}")
        sys.exit(1)
    print(f"problem={found.problem!r} in {time.monotonic() - t:.2f} s")
    sys.exit(0 if found.problem else 2)
""")


def _shared_tree(levels: int) -> bytes:
    """A layout of ``2**levels`` leaves in about 14 bytes per level: each level names the one
    below twice, the second time by marshal's back-reference."""
    node = ("n",)
    for _ in range(levels):
        node = ("T", (node, node))
    return marshal.dumps(node, 4)


_ATTACKS = {
    "shared nodes (2**40 leaves)": _shared_tree(40),
    "a tuple of 2**31-1 items": b"(" + struct.pack("<I", 2**31 - 1),
    "a small tuple holding a huge one": b")\x02\xfa\x01T(" + struct.pack("<I", 2**30),
    "a list of 2**31-1 items": b"[" + struct.pack("<I", 2**31 - 1),
    "an int of 2**31-1 digits": b"l" + struct.pack("<i", 2**31 - 1),
    "a str of 2**31-1 bytes": b"u" + struct.pack("<I", 2**31 - 1),
}


@pytest.mark.parametrize("name", list(_ATTACKS))
def test_a_hostile_layout_is_refused_in_bounded_time_and_memory(name):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, _ATTACKS[name].hex()], env=env, capture_output=True,
                             text=True, timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail(f"check_layout of {name} ran for more than 10 s")
    assert out.returncode == 0, f"{name}: {out.stdout}{out.stderr[-2000:]}"


def test_real_layouts_still_pass():
    import numpy as np

    from shmcache.cache import codec

    values = [{"a": np.zeros((3, 4), np.float32), "b": "x", "c": (1, 2.0, None, True), "d": b"z"},
              (np.arange(5), 7), [np.float32(1.5), {1: "one", 2**40: "two", -3: "été"}],
              {"clé": b"", "ключ": 2**70},
              {f"k{i}": (np.zeros(i + 1), i) for i in range(300)}]
    for value in values:
        check = codec.check_layout(codec.encode(value).layout)
        assert check.problem is None, check.problem
    # offsets past 2**31 (marshal's "l" ints), shared strings (back-references), a tuple of 300 items
    for node in [("a", "<f4", (1,), 3_000_000_000), ("T", tuple(("s", 16 + i, 1) for i in range(300)))]:
        check = codec.check_layout(marshal.dumps(node, 4))
        assert check.problem is None, check.problem


def _retained(fn) -> int:
    """Bytes still allocated (tracemalloc) after ``fn()`` returned and garbage was collected."""
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        fn()
        gc.collect()
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def test_refused_layouts_are_not_kept_whole():
    """check_layout kept every layout it saw, refused ones included, as its cache's key: 100
    distinct 1 MiB layouts from a Redis anyone with its password writes held 100 MiB."""
    from shmcache.cache import codec

    def check_many():
        for j in range(100):
            codec.check_layout(bytes([j]) + b"\xff" * (1 << 20))
    assert _retained(check_many) < 4 << 20


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_decoders_of_large_layouts_are_kept_within_a_byte_budget(monkeypatch):
    """1024 decoders were kept whatever their layouts' size, and a decoder holds ~16x its layout:
    1 MiB layouts from a tier held 17 MiB each (12 of them: 211 MiB). Now the layouts kept are
    bounded in bytes too (MAX_DECODER_BYTES; 128 KiB here, for a fast test)."""
    from shmcache.cache import codec
    from shmcache.tiers.tiered_store import decode_portable

    monkeypatch.setattr(codec, "MAX_DECODER_BYTES", 128 << 10, raising=False)
    codec.clear_decoders()

    def decode_many():
        for j in range(10):
            layout = marshal.dumps(("D", tuple((f"k{j}_{i}", ("n",)) for i in range(6000))), 4)
            rec = bytearray(codec.RECORD_HEADER.pack(codec.INLINE, 0, len(layout), 0) + bytes(48) + layout)
            assert len(decode_portable(rec, trusted=False)) == 6000
    try:
        grew = _retained(decode_many)
    finally:
        codec.clear_decoders()
    assert grew < 5 << 20, f"10 decoders of ~70 KiB layouts held {grew / 2**20:.1f} MiB (all kept: ~13 MiB)"
