"""PIL images as a codec type: stored as their raw pixels, returned as images (no pickle).

torchvision datasets return PIL images by default; pickled, a 224x224 RGB image took 5.7x its
pixels and a pickle round trip per read. Stored here as ``img.tobytes()`` with the mode and size
in the leaf's meta, and rebuilt with ``Image.frombytes``: equal pixel for pixel, in the same mode.
Palette images (modes P and PA) are pickled: their pixels mean nothing without the palette. The
image's ``info`` (EXIF, ICC profile, DPI) is not kept.

Pillow is optional: the codec names this module and loads it lazily, the first time it meets a type
from the ``PIL`` package (encoding) or a record that holds one (decoding), in any process.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from ..cache import codec

__all__ = ["TAG", "MODES", "register"]

TAG = "pil"
# Modes whose raw bytes (tobytes/frombytes) round-trip exactly; tests/unit/cache/test_codec.py tries each.
MODES = frozenset({"1", "L", "LA", "La", "I", "I;16", "I;16B", "I;16L", "F", "RGB", "RGBA", "RGBa",
                   "RGBX", "CMYK", "YCbCr", "LAB", "HSV"})


def _to_parts(img: Any) -> tuple[str, tuple, np.ndarray] | None:
    if img.mode not in MODES:
        return None  # pickled (a palette image)
    raw = np.frombuffer(img.tobytes(), np.uint8)
    width, height = img.size
    # meta ends with ":1" (codec: the itemsize), shape is the byte count
    return f"{img.mode}|{width}x{height}:1", (raw.size,), raw


def _from_parts(meta: str, shape: tuple, raw: np.ndarray) -> Any:
    from PIL import Image

    mode, size = meta.rsplit(":", 1)[0].split("|")
    width, height = map(int, size.split("x"))
    if mode not in MODES:
        raise ValueError(f"an image leaf names mode {mode!r}, not one the encoder writes")
    # Image.frombytes fills a whole image of the meta's size before it looks at the bytes: a leaf
    # from a tier or a snapshot saying 16000x16000 over 4 bytes cost 1 GiB. Its bytes must be
    # exactly the image's, checked with a 1-pixel image, before anything of that size is made.
    per_row = (width + 7) // 8 if mode == "1" else _pixel_bytes(mode) * width
    row_bytes = shape[-1] if len(shape) == 2 else raw.size
    if per_row * height != row_bytes:
        raise ValueError(f"an image leaf of {row_bytes} bytes says it is a {width}x{height} {mode} image "
                         f"({per_row * height} bytes): the record is damaged or forged")
    if len(shape) == 2:  # a column of the batch path: one image per row
        return [Image.frombytes(mode, (width, height), raw[i * shape[1]:(i + 1) * shape[1]].tobytes())
                for i in range(shape[0])]
    return Image.frombytes(mode, (width, height), raw.tobytes())  # a copy: never a view of the cache


@functools.lru_cache(maxsize=None)  # keys: the modes in MODES, checked before the call
def _pixel_bytes(mode: str) -> int:
    """Bytes of one pixel of ``mode`` (measured on a 1-pixel image once per mode, not per decode)."""
    from PIL import Image

    return len(Image.new(mode, (1, 1)).tobytes())


def register() -> None:
    """Register PIL images with the codec; the codec's lazy loader calls it (it names this module)."""
    from PIL import Image

    codec.register_type(Image.Image, TAG, _to_parts, _from_parts, subclasses=True, check=codec.pil_check)
