"""Progress bars: one tqdm bar on stderr, or nothing at all (tqdm is imported only when a bar is
drawn, so a process that draws none never imports it).

Export and import draw theirs with ``tqdm.tqdm`` (bytes scaled by 1024); a warm-up with
``tqdm.auto`` (``notebook=True``: a widget in Jupyter, the same text bar elsewhere).
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

__all__ = ["progress_bar", "NoBar"]


class NoBar:
    """The bar that is not drawn: ``update`` and ``close`` do nothing."""

    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(progress: bool | None, total: int | None, desc: str, unit: str = "item",
                 iterable: Iterable | None = None, notebook: bool = False) -> Any:
    """A tqdm bar of ``total`` (``unit="B"``: bytes, scaled by 1024) on stderr; ``progress`` None:
    when stderr is a terminal. No bar: ``iterable`` itself, or a :class:`NoBar`. With ``iterable``
    the bar wraps it (iterate the bar)."""
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return NoBar() if iterable is None else iterable
    scale = unit == "B"
    options: dict[str, Any] = dict(total=total, desc=desc, unit=unit, dynamic_ncols=True)
    if scale:
        options.update(unit_scale=True, unit_divisor=1024)
    if notebook:
        from tqdm.auto import tqdm
    else:
        from tqdm import tqdm

        options["file"] = sys.stderr
    return tqdm(**options) if iterable is None else tqdm(iterable, **options)
