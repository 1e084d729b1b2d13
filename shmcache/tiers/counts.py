"""The counters of a tier behind shared memory (remote, snapshot) and of the seam that reads
them (``tiers``: TieredStore's), shared by the processes of a session: one file per cache and
tier, ``caches/<cache>.<tier>``, beside the cache's metadata; ``stats_keys`` makes the keys of
``stats()`` and ``shmcache stat --json`` from them.

NOTE [tier counts]
    A slot rows file (NOTE [slot rows]) of ROW_WORDS words a row (the words of COUNTERS[tier], in
    order), then URL_BYTES of the tier's URL (its password already masked by the caller; the last
    process to open the file writes it, for ``shmcache stat``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..cache.slot_rows import SlotRows

__all__ = ["ROW_WORDS", "COUNTERS", "counts_path", "process_row", "read_counts"]

ROW_WORDS = 16  # one 128-byte row per process slot (the remote tier counts 12 things)
URL_BYTES = 512  # after the rows: the URL the counts are of (for `shmcache stat`)

# the words of a row of each counts file, in order: one file per tier (its name), and ``tiers``
# for the seam's own (tiered_store.TieredStore: tier hits admitted, records refused)
COUNTERS = {
    "snapshot": ("hits", "misses", "bytes_read", "reads", "errors", "corrupt", "forged"),
    "remote": ("hits", "misses", "bytes_read", "bytes_written", "errors", "corrupt", "dropped", "backlog",
               "forged", "leases", "lease_waits", "lease_timeouts"),
    "tiers": ("admitted", "undecodable", "pickle_refused"),
}


def counts_path(registry, session: str, name: str, tier: str) -> Path:
    """The counts file of cache ``name``'s tier ``tier`` ("remote", "snapshot"; "tiers": the seam's)."""
    return registry.cache_file(session, name, tier)


def _rows(path: str | os.PathLike, slot: Callable[[], int] | None = None, what: str = "") -> SlotRows:
    return SlotRows(path, ROW_WORDS, tail=URL_BYTES, slot=slot, what=what)


def process_row(path: str | os.PathLike | None, url: str, slot: Callable[[], int] | None,
                what: str) -> np.ndarray:
    """This process's row of the counts file at ``path`` (``slot()``: its liveness slot); a row of
    its own memory when there is no file (an uncached store) or the file cannot be used, said once
    in the log naming ``what`` (the tier)."""
    if path is None or slot is None:
        return np.zeros(ROW_WORDS, np.uint64)
    return np.frombuffer(_rows(path, slot, what).own_row(tail=url.encode()), np.uint64)  # writable, uint64 (not Q)


def read_counts(path: str | os.PathLike, names: Sequence[str]) -> dict | None:
    """The counters ``names`` (the first words of a row) summed over every process, and ``url``
    (None: no such tier was ever in force for the cache)."""
    got = _rows(path).sum()
    if got is None:
        return None
    total, tail = got
    out: dict = {name: total[i] for i, name in enumerate(names)}
    out["url"] = tail.rstrip(b"\0").decode(errors="replace") or None
    return out


def stats_keys(tiers: dict[str, tuple[Sequence[str], dict | None]], seam: dict | None) -> dict:
    """The tier keys of ``stats()`` and ``shmcache stat --json``, built here alone so the two agree:
    for each tier (name -> (its COUNTERS, its counts summed over every process with ``url``, or
    None)) ``<name>`` (its URL, password masked) and ``<name>_<counter>``; then ``tiers`` ({name:
    its counters}) and, from the seam's counters (``seam``), ``tier_admitted``,
    ``tier_undecodable`` and ``tier_pickle_refused``."""
    out: dict = {}
    grouped: dict = {}
    for name, (names, counts) in tiers.items():
        counts = counts or {}
        out[name] = counts.get("url")
        grouped[name] = {k: counts.get(k, 0) for k in names}
        out.update({f"{name}_{k}": v for k, v in grouped[name].items()})
    out["tiers"] = grouped
    out.update({f"tier_{k}": (seam or {}).get(k, 0) for k in COUNTERS["tiers"]})
    return out
