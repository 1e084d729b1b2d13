"""Records from a stranger that pass the tier's checksum (anyone can recompute it) but name what
the decoder refuses (issue 24, items 2 and 5): an extension tag no handler has, a tensor meta that
is no dtype, a str leaf that is not UTF-8. The layout check (codec.check_layout, the one an import
and every tier read run) refuses what decode would refuse, before anything is imported for it;
and a record that still does not decode is a ValueError at the seam (a counted miss), never the
EncodeError that reached ``ds[i]``."""

from __future__ import annotations

import json
import marshal
import os
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from shmcache.cache import codec
from shmcache.tiers import records
from shmcache.tiers.tiered_store import PickleRefused, decode_portable, untrusted_problem


def _portable(layout_node: tuple, body: bytes, key: bytes = b"") -> bytes:
    """A portable record (codec.INLINE) of ``body`` (after the 16-byte header) and a layout."""
    layout = marshal.dumps(layout_node, 4)
    head = codec.RECORD_HEADER.pack(codec.INLINE, len(key), len(layout), 0)
    return head + body + layout + key


def _ext(tag: str, meta: str, shape: tuple = (4,)) -> bytes:
    return _portable(("T", (("e", tag, meta, shape, 64), ("i", 16))), bytes(48) + bytes(range(64)))


@pytest.mark.parametrize("tag", ["nope", "torch2", "TORCH", "x" * 32])
def test_an_extension_tag_no_handler_has_is_refused_by_the_layout_check(tag):
    """Was: passed check_layout, then decode raised EncodeError at ds[i] on every read."""
    rec = _ext(tag, "uint8:1")
    why = untrusted_problem(rec, allow_pickle=False)
    assert why is not None and tag[:20] in why and "registered" in why
    with pytest.raises(ValueError):  # not PickleRefused, not EncodeError: a counted undecodable miss
        decode_portable(bytearray(rec), trusted=False)


def test_a_record_that_does_not_decode_is_a_value_error_even_when_trusted():
    """An authenticated record (trusted: no layout check) whose tag this process cannot load: the
    seam counts a miss (ValueError) where the EncodeError escaped to the reader."""
    rec = _ext("nope", "uint8:1")
    with pytest.raises(ValueError) as got:
        decode_portable(bytearray(rec), trusted=True)
    assert not isinstance(got.value, PickleRefused) and "nope" in str(got.value)


@pytest.mark.parametrize("meta", ["_inductor:1", "float32:8", "Tensor:4", "float:4", "uint8:0", "cuda:1"])
def test_a_tensor_meta_that_is_no_dtype_torch_writes_is_refused_by_name(meta):
    why = untrusted_problem(_ext("torch", meta), allow_pickle=False)
    assert why is not None and meta in why


@pytest.mark.parametrize("meta,shape", [("RGB|2x2:1", (11,)), ("P|2x2:1", (4,)), ("RGB|2x2:1", (3, 4)),
                                        ("RGB|x:1", (12,)), ("1|9x2:1", (2,))])
def test_an_image_meta_that_does_not_fit_its_bytes_is_refused(meta, shape):
    why = untrusted_problem(_ext("pil", meta, shape), allow_pickle=False)
    assert why is not None, meta


def test_real_tensor_and_image_leaves_still_pass():
    for meta, shape in [("float32:4", (4,)), ("bfloat16:2", (2, 2)), ("bool:1", (64,)), ("complex128:16", (1,))]:
        assert untrusted_problem(_ext("torch", meta, shape), allow_pickle=False) is None, meta
    for meta, shape in [("RGB|2x2:1", (12,)), ("1|9x2:1", (4,)), ("I;16|2x2:1", (8,))]:
        assert untrusted_problem(_ext("pil", meta, shape), allow_pickle=False) is None, meta


def test_the_torch_allow_list_names_every_dtype_the_installed_torch_writes():
    torch = pytest.importorskip("torch")
    from shmcache.data import tensors

    for name in dir(torch):
        dtype = getattr(torch, name)
        if isinstance(dtype, torch.dtype):
            meta = f"{str(dtype).removeprefix('torch.')}:{dtype.itemsize}"
            assert meta in codec.TORCH_METAS, meta
            assert tensors._dtype_of(meta) is dtype


def test_the_image_pixel_sizes_are_what_pillow_writes():
    image = pytest.importorskip("PIL.Image")
    from shmcache.data import images

    assert set(codec.PIL_PIXEL_BYTES) == images.MODES
    for mode, size in codec.PIL_PIXEL_BYTES.items():
        if mode != "1":
            assert len(image.new(mode, (3, 1)).tobytes()) == 3 * size, mode


def test_a_str_leaf_that_is_not_utf8_is_refused_before_it_is_stored():
    """An import stored it (the layout is fine), then every local read of it raised."""
    rec = _portable(("s", 16, 4), b"\xff\xfe\xfd\xfc" + bytes(12))
    why = untrusted_problem(rec, allow_pickle=False)
    assert why is not None and "UTF-8" in why
    ok = _portable(("s", 16, 5), "été".encode() + bytes(11))
    assert untrusted_problem(ok, allow_pickle=False) is None
    assert decode_portable(bytearray(ok), trusted=False) == "été"


def test_a_layout_of_more_nodes_than_the_bound_is_refused():
    """A layout of 4 million shared nodes (~20 MB: marshal's back-references, 5 bytes each) passed
    the check (one node per byte) and cost seconds and GBs on every decode."""
    leaf = ("i", 16)
    big = marshal.dumps(("T", (leaf,) * 4_000_000), 4)
    assert len(big) > codec.MAX_LAYOUT_BYTES
    assert "bytes" in codec.check_layout(big).problem
    wide = marshal.dumps(("T", tuple(("i", 16) for _ in range(codec.MAX_LAYOUT_NODES))), 4)
    assert len(wide) <= codec.MAX_LAYOUT_BYTES
    assert "more than" in codec.check_layout(wide).problem
    fits = marshal.dumps(("T", tuple(("i", 16) for _ in range(codec.MAX_LAYOUT_NODES - 1))), 4)
    assert codec.check_layout(fits).problem is None


_FRESH = textwrap.dedent("""
    import json, sys
    import torch
    import shmcache.data.dataset  # noqa: F401 - the torch handler, as in a training process
    from shmcache.tiers.tiered_store import decode_portable
    sys.path.insert(0, sys.argv[1])
    from test_hostile_layouts import _ext
    out = {}
    for name in sys.argv[2:]:
        before = set(sys.modules)
        rec = _ext("torch", name + ":1")
        for trusted in (False, True):  # checked, and decoded as an authenticated record would be
            try:
                decode_portable(bytearray(rec), trusted=trusted)
                out[f"{name} {trusted}"] = "decoded"
            except ValueError as exc:
                out[f"{name} {trusted}"] = str(exc)
        out[f"{name} new"] = sorted(m for m in set(sys.modules) - before if m.startswith("torch."))
    print(json.dumps(out))
""")


def test_a_tensor_meta_naming_a_torch_submodule_imports_nothing():
    """``getattr(torch, "_inductor")`` imports it: a meta naming it imported 315 modules before it
    was refused. In a fresh process, sys.modules does not grow."""
    names = ["_inductor", "_dynamo", "distributed"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", _FRESH, os.path.dirname(__file__), *names], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        assert out[f"{name} new"] == [], (name, out[f"{name} new"][:10])
        assert "decoded" not in (out[f"{name} False"], out[f"{name} True"]), out


@pytest.mark.parametrize("value,want", [(None, 256 << 20), ("", 256 << 20), ("1", 1 << 20), ("0.5", 1 << 19)])
def test_max_item_bytes_reads_its_setting(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv("SHMCACHE_MAX_ITEM_MB", raising=False)
    else:
        monkeypatch.setenv("SHMCACHE_MAX_ITEM_MB", value)
    assert records.max_item_bytes() == want


@pytest.mark.parametrize("value", ["0", "-3", "lots", "1e9", "nan", "inf", "1e-9"])  # 1e-9: a bound of 0 bytes
def test_a_bad_max_item_setting_names_itself_and_the_fix(monkeypatch, value):
    from shmcache.errors import InvalidArgument

    monkeypatch.setenv("SHMCACHE_MAX_ITEM_MB", value)
    with pytest.raises(InvalidArgument, match="SHMCACHE_MAX_ITEM_MB.*unset it"):
        records.max_item_bytes()


def test_np_dtypes_the_decoder_cannot_build_are_refused():
    for dtype in ["S0", "V0", "U0", "O", "f4,f4", "(2,)f4"]:
        rec = _portable(("a", dtype, (1,), 64), bytes(48) + bytes(64))
        why = untrusted_problem(rec, allow_pickle=False)
        if why is None:  # passed the check: then it must decode
            decode_portable(bytearray(rec), trusted=False)
    np.testing.assert_array_equal(
        decode_portable(bytearray(_portable(("a", "<f4", (2,), 64), bytes(48) + bytes(64))), trusted=False),
        np.zeros(2, np.float32))


def test_a_leaf_in_the_record_header_is_refused():
    """A label at offset 8 read the header's layout length: 50 from the tier, 0 once stored in
    shared memory with its layout interned - two values for one key (found by the fuzz)."""
    for node in [("i", 8), ("s", 0, 4), ("a", "|u1", (4,), 12), ("e", "torch", "uint8:1", (4,), 0)]:
        why = untrusted_problem(_portable(node, bytes(64)), allow_pickle=False)
        assert why is not None and "header" in why, node
    assert untrusted_problem(_portable(("i", 16), bytes(64)), allow_pickle=False) is None


def test_what_the_encoder_writes_for_tensors_and_images_passes_the_check():
    """The allow-lists by name fit every tensor dtype and image mode the handlers store."""
    torch = pytest.importorskip("torch")
    image = pytest.importorskip("PIL.Image")
    from shmcache.data import images
    from shmcache.tiers.tiered_store import portable_record

    values = []
    for name in dir(torch):
        dtype = getattr(torch, name)
        if isinstance(dtype, torch.dtype):
            try:
                with warnings.catch_warnings():  # complex32: "experimental"
                    warnings.simplefilter("ignore", UserWarning)
                    values.append(torch.zeros(3, dtype=dtype))
            except (RuntimeError, TypeError):  # dtypes torch cannot make a tensor of here
                continue
    values += [image.new(mode, (5, 3)) for mode in sorted(images.MODES)]
    for value in values:
        enc = codec.encode(value)
        if enc.pickled:
            continue  # quantized and such: pickled, refused from outside anyway
        rec = portable_record(enc, 0)
        assert untrusted_problem(rec, allow_pickle=False) is None, getattr(value, "dtype", value)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            decode_portable(bytearray(rec), trusted=False)


def test_a_numpy_scalar_of_a_shape_is_refused():
    """Decoded alone it is a scalar, gathered in a batch an array of that shape: the encoder writes ()."""
    assert "not ()" in untrusted_problem(_portable(("g", "<f4", (1, 1), 64), bytes(48) + bytes(64)), False)
    assert decode_portable(bytearray(_portable(("g", "<f4", (), 64), bytes(48) + bytes(64))), trusted=False) == 0


def _named_layout(classes: int, nodes: int) -> bytes:
    """A record of ``nodes`` one-field namedtuple nodes of ``classes`` distinct class names."""
    node = tuple(("N", f"Made{i % classes}", ("x",), (("n",),)) for i in range(nodes))
    return _portable(("T", node), b"")


def test_a_layout_naming_thousands_of_namedtuple_classes_is_refused():
    """Found attacking issue 24: a record of 529 KB naming 20,000 namedtuple classes passed the
    check (within the node bound) and its first decode made a class for each - 9.3 s and +190
    MiB for one record, again for every such record a stranger writes. A layout from outside now
    names at most MAX_LAYOUT_NAMED classes; many namedtuples of one class count once."""
    why = untrusted_problem(_named_layout(20_000, 20_000), allow_pickle=False)
    assert why is not None and f"more than {codec.MAX_LAYOUT_NAMED} namedtuple classes" in why, why
    for classes, nodes in ((codec.MAX_LAYOUT_NAMED, codec.MAX_LAYOUT_NAMED), (1, 20_000)):
        rec = _named_layout(classes, nodes)
        assert untrusted_problem(rec, allow_pickle=False) is None
        value = decode_portable(bytearray(rec), trusted=False)
        assert len(value) == nodes and len({type(v) for v in value}) == classes


def test_a_strangers_namedtuples_never_evict_the_users_own_classes():
    """Found attacking issue 24: a value decoded from a stranger's record of a namedtuple class
    this process never saw is of a class the codec made; storing it again (a pipeline that puts
    what it read into another cache) registered that made class as if the user's, and 1,024 of
    them evicted the user's own classes from the registry: the user's records then decoded as a
    stand-in of the same name (``isinstance(x, TheirClass)`` false). Made classes are never
    registered: only the user's own."""
    import collections

    Mine = collections.namedtuple("Mine", "image label")
    codec.register_namedtuple(Mine)
    mine = codec.encode(Mine(1, 2))
    for i in range(codec.MAX_NAMED_TYPES + 8):  # a stranger's records, each of a class of its own
        value = decode_portable(bytearray(_portable(("N", f"Theirs{i}", ("x",), (("i", 16),)), bytes(8))),
                                trusted=False)
        assert type(value).__qualname__ == f"Theirs{i}"
        codec.encode(value)  # stored again by the user's pipeline
    assert codec.decode(_record_of(mine), mine.layout).__class__ is Mine
    assert all(getattr(t, "__qualname__", "").startswith("Theirs") is False for t in codec.registered_namedtuples())


def _record_of(enc) -> bytearray:
    buf = bytearray(enc.record_len(0, False))
    enc.write(memoryview(buf), 0, b"")
    return buf


def test_the_layout_checks_image_modes_are_the_ones_the_encoder_writes():
    """Two lists of one fact (codec.py cannot import the PIL layer above it): a mode the encoder
    writes and the check does not know would make every import refuse such records."""
    from shmcache.data import images

    assert set(codec.PIL_PIXEL_BYTES) == set(images.MODES)
