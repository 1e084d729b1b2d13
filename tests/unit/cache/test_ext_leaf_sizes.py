"""An extension leaf (a tensor, a PIL image) from a tier or a snapshot says its dtype, shape and
size in its meta, which anyone who writes the record chooses. Its handler built what the meta
said before it compared it with the leaf's bytes: a 4-byte image leaf saying 16000x16000 RGBA
made a 1 GiB image (Image.frombytes fills it, then finds the data short), and a tensor leaf of
"float32:0" (elements of 0 bytes) was served as torch.empty(shape) - any size, from no bytes.
Now the bytes must be exactly what the meta says, checked before anything of that size is made."""

from __future__ import annotations

import marshal
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from shmcache.cache import codec
from shmcache.tiers.tiered_store import decode_portable


def _forged(node, body: bytes) -> bytearray:
    layout = marshal.dumps(node, 4)
    return bytearray(codec.RECORD_HEADER.pack(codec.INLINE, 0, len(layout), 0) + body + layout)


def test_a_tensor_leaf_whose_itemsize_is_not_its_dtypes_is_refused():
    pytest.importorskip("torch")
    rec = _forged(("e", "torch", "float32:0", (1000, 1000), 64), bytes(48))
    # refused by the layout check, by name, before torch is asked about the meta (issue 24)
    assert "not one torch writes" in codec.check_layout(codec.inline_layout(rec)).problem
    with pytest.raises(ValueError, match="not one torch writes"):
        decode_portable(rec, trusted=False)
    rec = _forged(("e", "torch", "float64:4", (2,), 64), bytes(48) + bytes(8))
    with pytest.raises(ValueError):
        decode_portable(rec, trusted=False)


_CHILD = textwrap.dedent("""
    import marshal, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    from shmcache.cache import codec
    from shmcache.tiers.tiered_store import decode_portable
    layout = marshal.dumps(("e", "pil", "RGBA|16000x16000:1", (4,), 64), 4)
    rec = bytearray(codec.RECORD_HEADER.pack(codec.INLINE, 0, len(layout), 0) + bytes(48) + b"abcd"
                    + bytes(4) + layout)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        decode_portable(rec, trusted=False)
        print("served")
    except ValueError as exc:
        print("refused", exc)
    print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) >> 10, "MiB")
""")


def test_an_image_leaf_larger_than_its_bytes_is_refused_before_it_is_made():
    pytest.importorskip("PIL")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    verdict, grew = out.stdout.splitlines()
    # refused by the layout check (its meta against its bytes), before anything is allocated
    assert verdict.startswith("refused") and "says it is a 16000x16000 RGBA image" in verdict, verdict
    assert int(grew.split()[0]) < 100, f"decoding a 4-byte image leaf grew the process by {grew}"


def test_real_images_and_tensors_still_round_trip():
    Image = pytest.importorskip("PIL.Image")
    torch = pytest.importorskip("torch")
    from shmcache.data import images as _pil
    from shmcache.data import tensors as _torch

    _pil.register()
    _torch.register()
    rng = np.random.default_rng(0)
    for mode in sorted(_pil.MODES):
        img = Image.new(mode, (7, 3))
        img.frombytes(rng.integers(0, 256, len(img.tobytes()), dtype=np.uint8).tobytes())
        enc = codec.encode({"img": img})
        rec = bytearray(enc.record_len(0, True))
        enc.write(memoryview(rec), codec.INLINE, b"")
        back = decode_portable(rec, trusted=False)["img"]
        assert back.mode == mode and back.tobytes() == img.tobytes(), mode
    for t in (torch.arange(6, dtype=torch.int16).reshape(2, 3), torch.ones(3, dtype=torch.bool),
              torch.zeros(0, 4), torch.tensor(2.5, dtype=torch.float64)):
        enc = codec.encode(t)
        rec = bytearray(enc.record_len(0, True))
        enc.write(memoryview(rec), codec.INLINE, b"")
        assert torch.equal(decode_portable(rec, trusted=False), t)
