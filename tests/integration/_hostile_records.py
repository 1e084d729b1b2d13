"""Mutated portable records for the fuzz tests of issue 24 (item 2): what anyone who writes to a
shared Redis or hands over a snapshot can make of a real record - other extension tags, metas,
shapes, offsets, node kinds, flipped layout bytes, header lengths, key trailers, cut bodies - with
the tier's own checksum recomputed, as an attacker would. Deterministic for a seed."""

from __future__ import annotations

import marshal
import random

import numpy as np

from shmcache.cache import codec

_TAGS = ["nope", "torch2", "TORCH", "pil", "torch", "", "x" * 33, "t\u00e9", 7]
_METAS = ["_inductor:1", "_dynamo:1", "float32:8", "float32:4", "uint8:1", "uint8:0", "x", "RGB|2x2:1",
          "RGB|64x8:1", "L|2048x1:1", "bool:1", "complex128:16", "int64:8", "a" * 70 + ":1", 3]
_DTYPES = ["<f4", ">f8", "|u1", "O", "V0", "S0", "U1", "<M8[s]", "f4,f4", "(2,)<f4", "|b1", "<c16", "x", 5]
_SHAPES = [(), (0,), (1,), (2048,), (4096,), (1 << 40,), (-1,), (2, 1024), (1,) * 65, (1 << 31, 1 << 31),
           (2048.0,), "2048", None]


def _split(rec: bytes) -> tuple[bytes, bytes, bytes]:
    """(body, layout, key) of a portable record."""
    _, key_len, layout_len, _ = codec.RECORD_HEADER.unpack_from(rec, 0)
    end = len(rec) - key_len
    return rec[:end - layout_len], rec[end - layout_len:end], rec[end:]


def _join(body: bytes, layout: bytes, key: bytes) -> bytes:
    return codec.RECORD_HEADER.pack(codec.INLINE, len(key), len(layout), 0) + body[16:] + layout + key


def _leaf(rng: random.Random, body_len: int) -> tuple:
    off = rng.choice([16, 24, 64, body_len - 1, body_len, body_len + 8, 1 << 40, -8])
    n = rng.choice([0, 1, 4, 2048, body_len, 1 << 33])
    return rng.choice([
        ("e", rng.choice(_TAGS), rng.choice(_METAS), rng.choice(_SHAPES), off),
        ("a", rng.choice(_DTYPES), rng.choice(_SHAPES), off),
        ("g", rng.choice(_DTYPES), rng.choice([(), (1,), (2,)]), off),
        ("s", off, n), ("y", off, n), ("p", off, n), ("i", off), ("f", off), ("b", off), ("n",),
        ("T", ()), ("L", (("n",),) * rng.choice([1, 3])), ("D", ((rng.choice(["k", 1, 1.5, True, None]), ("n",)),)),
        ("Z", off), ("i",), ("n", off), ("T", (("n",), None)),
    ])


def _edit(node, rng: random.Random, body_len: int):
    """``node`` with one random change somewhere in its tree."""
    if type(node) is tuple and node and node[0] in ("T", "L") and node[1] and rng.random() < 0.7:
        children = list(node[1])
        i = rng.randrange(len(children))
        children[i] = _edit(children[i], rng, body_len)
        return (node[0], tuple(children))
    if type(node) is tuple and node and node[0] == "e" and rng.random() < 0.8:
        field = rng.randrange(1, 5)
        new = [rng.choice(_TAGS), rng.choice(_METAS), rng.choice(_SHAPES),
               rng.choice([0, 63, 64, 65, body_len, 1 << 40, -1])][field - 1]
        return node[:field] + (new,) + node[field + 1:]
    if type(node) is tuple and node and node[0] == "i" and rng.random() < 0.5:
        return ("i", rng.choice([0, 8, body_len - 7, body_len, -8, "16"]))
    return _leaf(rng, body_len)


def mutate(rec: bytes, rng: random.Random) -> tuple[str, bytes]:
    """(kind, a mutated copy of the portable record ``rec``)."""
    body, layout, key = _split(rec)
    kind = rng.choice(["tree", "tree", "tree", "tag", "meta", "layout bytes", "layout cut", "lengths",
                       "trailer", "body cut", "layout grown"])
    if kind in ("tree", "tag", "meta"):
        node = marshal.loads(layout)
        if kind == "tree":
            node = _edit(node, rng, len(body))
        else:  # the ext leaf of a (tensor, label) sample
            ext = node[1][0]
            ext = (ext[0], rng.choice(_TAGS), *ext[2:]) if kind == "tag" else (*ext[:2], rng.choice(_METAS), *ext[3:])
            node = (node[0], (ext, *node[1][1:]))
        return kind, _join(body, marshal.dumps(node, 4), key)
    if kind == "layout bytes":
        lay = bytearray(layout)
        for _ in range(rng.randint(1, 3)):
            lay[rng.randrange(len(lay))] = rng.randrange(256)
        return kind, _join(body, bytes(lay), key)
    if kind == "layout cut":
        return kind, _join(body, layout[:rng.randrange(len(layout))], key)
    if kind == "layout grown":
        return kind, _join(body, layout + bytes(rng.randrange(1, 9)), key)
    if kind == "lengths":
        out = bytearray(rec)
        word = rng.randrange(4)
        value = rng.choice([0, 1, len(layout) + 1, len(key) + 1, len(rec), 1 << 31, codec.INLINE - 1])
        codec.RECORD_HEADER.pack_into(out, 0, *[value if i == word else v for i, v in
                                                 enumerate(codec.RECORD_HEADER.unpack_from(rec, 0))])
        return kind, bytes(out)
    if kind == "trailer":
        return kind, body + layout + bytes(rng.randrange(256) for _ in range(len(key))) if key else \
            _join(body, layout, b"zz")
    return kind, _join(body[:rng.randrange(16, len(body))], layout, key)  # body cut


def equal(a, b) -> bool:
    """Deep equality of decoded values (tensors and arrays by content, dtype and shape)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(equal(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if type(a).__name__ in ("Tensor", "Parameter"):
        return a.dtype == b.dtype and a.shape == b.shape and a.numpy().tobytes() == b.numpy().tobytes()
    if isinstance(a, float) and a != a:
        return b != b
    return a == b
