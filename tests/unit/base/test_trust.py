"""Issue 16, the pieces: the secret's semantics, the MAC, and layouts from outside checked without
decoding (object dtypes never built from bytes)."""

from __future__ import annotations

import marshal

import numpy as np
import pytest

from shmcache.base.trust import FORGED, SIGNED, Mac, resolve_secret
from shmcache.cache import codec
from shmcache.errors import EncodeError, InvalidArgument
from shmcache.tiers.tiered_store import PickleRefused, decode_portable, portable_record


def test_the_secret_comes_from_the_argument_else_the_environment(monkeypatch):
    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    assert resolve_secret() is None and resolve_secret("") is None
    monkeypatch.setenv("SHMCACHE_SECRET", "from-env")
    assert resolve_secret() == b"from-env"
    assert resolve_secret("") is None  # explicit: none, whatever the environment says
    assert resolve_secret("k\u00e9y") == "k\u00e9y".encode()
    assert resolve_secret(b"\x00raw") == b"\x00raw"
    with pytest.raises(InvalidArgument, match="secret must be"):
        resolve_secret(42)


def test_the_mac_binds_context_and_bytes():
    mac = Mac(b"s")
    value = b"record-bytes" + mac.trailer(b"ctx", b"record-", b"bytes")
    assert mac.open(b"ctx", value) == (memoryview(b"record-bytes"), SIGNED)
    assert mac.open(b"other", value)[1] == FORGED
    assert mac.open(b"ctx", b"Record-bytes" + value[12:])[1] == FORGED
    assert Mac(b"t").open(b"ctx", value)[1] == FORGED
    assert mac.open(b"ctx", b"record-bytes")[1] == FORGED  # no trailer


def _forged(layout_node, body: bytes, key: bytes = b"") -> bytearray:
    layout = marshal.dumps(layout_node, 4)
    head = codec.RECORD_HEADER.pack(codec.INLINE, len(key), len(layout), 0)
    return bytearray(head + body + layout + key)


def test_an_object_dtype_is_never_built_from_bytes():
    """np.ndarray(shape, object, buffer) builds Python objects out of raw pointers: a layout naming
    such a dtype (or a structured one holding objects) is refused by the check and the decoders."""
    for dtype in ("|O", "O"):
        rec = _forged(("a", dtype, (1,), 64), bytes(56))
        layout = codec.inline_layout(rec)
        assert "object" in codec.check_layout(layout).problem
        with pytest.raises(EncodeError, match="object"):
            codec.decoder_for(layout, private=True)
        with pytest.raises(ValueError):
            decode_portable(rec, trusted=False)
    with pytest.raises(EncodeError):
        codec.decoder_for(marshal.dumps(("a", [("f", "O")], (1,), 64), 4), private=True)


def test_a_layout_is_checked_without_unpickling():
    enc = codec.encode({"x": np.arange(4), "obj": {1, 2}})  # a set: pickled
    rec = bytearray(portable_record(enc, 3))
    check = codec.check_layout(codec.inline_layout(rec))
    assert check.problem is None and check.pickled
    with pytest.raises(PickleRefused):
        decode_portable(rec, trusted=False)
    assert decode_portable(rec, trusted=False, allow_pickle=True)["obj"] == {1, 2}
    # leaves beyond the record's body: refused before anything is read
    bad = _forged(("y", 16, 10_000), bytes(48))
    with pytest.raises(ValueError, match="span"):
        decode_portable(bad, trusted=False)
    for node in [("?", 1), ("i", "16"), ("a", "<f4", (-1,), 64), ("e", "torch", "float32", (1,), 64)]:
        assert codec.check_layout(marshal.dumps(node, 4)).problem is not None, node


class _RunsCode:
    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.mkdir, (self.marker,))


def test_check_locates_a_pickled_leaf_without_unpickling_it(tmp_path):
    """codec.check ("decode to check that they fit") unpickled a pickled leaf: checking a record
    ran its code. It only locates the leaf now, and a record too short for it still fails."""
    marker = tmp_path / "ran"
    enc = codec.encode({"obj": _RunsCode(marker), "x": np.arange(3)})
    rec = bytearray(portable_record(enc, 1))
    layout = codec.inline_layout(rec)
    codec.check(rec, layout)
    assert not marker.exists(), "check() unpickled the leaf"
    with pytest.raises(ValueError):
        codec.check(rec[:40], layout)
