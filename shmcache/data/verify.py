"""``cache.verify_sample(ds, fraction=...)``: recompute a random sample of the cached items and compare.

The fingerprint sees a dataset's attributes, code and three probe samples, not the files its items
are read from: edit one image of a dataset that holds paths and the cache serves the old one.
``verify=`` in the constructor checks a fraction of the hits as training reads them; this checks a
sample of the whole cache up front, in one call, with a progress bar and a report - the strong
check to run after the data changed, or before a long job.
"""

from __future__ import annotations

import logging
import math
import random
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..cache.store import MISSING
from ..errors import CacheMismatch, InvalidArgument
from .wrapped import CachedDataset, compute_sample, same_sample

__all__ = ["VerifyReport", "verify_sample"]

log = logging.getLogger("shmcache")
_SHOWN = 10  # stale indices named in a message


@dataclass
class VerifyReport:
    """What ``verify_sample`` found: ``checked`` cached items recomputed, the ``stale`` ones (their
    indices, in order), of ``cached`` items in the cache; ``ok`` when none is stale."""

    cache: str
    cached: int
    checked: int
    stale: list[int] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.stale

    def __str__(self) -> str:
        if self.ok:
            return (
                f"cache {self.cache}: {self.checked} of {self.cached} cached items recomputed, "
                f"all equal to their cached copies"
            )
        shown = ", ".join(map(str, self.stale[:_SHOWN])) + (", ..." if len(self.stale) > _SHOWN else "")
        share = len(self.stale) / self.checked
        return (
            f"cache {self.cache}: {len(self.stale)} of {self.checked} recomputed items differ from "
            f"their cached copies ({share:.1%}; items {shown}), of {self.cached} cached: the dataset "
            f"changed since it was cached (a file edited or replaced?), or it is not deterministic; "
            f"drop the stale cache (cache.clear(), or `shmcache destroy SESSION --cache NAME`) and "
            f"it is computed again"
        )


def verify_sample(
    wrapped: Any, fraction: float, *, seed: int | None = None, progress: bool | None = None, raise_on_stale: bool = True
) -> VerifyReport:
    """Recompute ``fraction`` of the items cached for ``wrapped`` (a map-style ``CachedDataset``;
    at least one) from its dataset and compare them bit for bit; CacheMismatch naming the stale
    ones if any differ (``raise_on_stale=False``: the report says so instead)."""
    from ..base.progress import progress_bar

    if not isinstance(wrapped, CachedDataset):
        raise InvalidArgument(
            f"verify_sample() checks a map-style dataset wrapped by this cache (cache.wrap(ds)), "
            f"got {type(wrapped).__name__}"
        )
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
        raise InvalidArgument(f"fraction={fraction!r}: the share of cached items to recompute, in (0, 1] (0.01: 1%)")
    cache = wrapped.cache
    store = cache.store
    keys = np.arange(len(wrapped), dtype=np.int64)
    absent = store.absent_ints(keys)
    cached = np.setdiff1d(keys, absent, assume_unique=True) if absent.size else keys
    count = min(cached.size, max(1, math.ceil(fraction * cached.size))) if cached.size else 0
    picked = sorted(random.Random(seed).sample(range(cached.size), count))
    report = VerifyReport(f"{cache.session}/{cache.name}", int(cached.size), 0)
    bar = progress_bar(progress, count, f"verify {cache.name}")
    try:
        for j in picked:
            i = int(cached[j])
            value = store.lookup(i, True, count=False)
            if value is not MISSING:  # dropped meanwhile (a clear): nothing to compare
                report.checked += 1
                if not same_sample(value, compute_sample(wrapped.dataset, wrapped.transform, i)):
                    report.stale.append(i)
            bar.update(1)
    finally:
        bar.close()
    if report.ok:
        log.info("%s", report)
    elif raise_on_stale:
        raise CacheMismatch(str(report))
    else:
        log.warning("%s", report)
    return report
