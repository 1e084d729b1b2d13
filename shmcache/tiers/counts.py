"""The counters of a tier behind shared memory (remote, snapshot) and of the seam that reads
them (``tiers``: TieredStore's), shared by the processes of a session: one file per cache and
tier, ``caches/<cache>.<tier>``, beside the cache's metadata; ``stats_keys`` makes the keys of
``stats()`` and ``shmcache stat --json`` from them.

NOTE [tier counts]
    The file is MAX_SLOTS rows of ROW_WORDS uint64 words, then URL_BYTES of the tier's URL (its
    password already masked by the caller; the last process to open the file writes it). Each
    process writes only its own row - the row of its liveness slot in the session (NOTE [lock
    files]) - one aligned 8-byte store per counter, so no lock is needed, and readers (``stats()``,
    ``shmcache stat``) sum the rows. A slot taken over by a new process goes on from the totals
    there, as the store's counters do. A row holding garbage (a word at or above 2**62) is zeroed
    by its owner and left out of the sums by readers: a statistic is no reason to fail a read.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from ..base.owned_file import open_owned
from ..cache.registry import MAX_SLOTS

__all__ = ["ROW_WORDS", "COUNTERS", "counts_path", "process_row", "read_counts"]

log = logging.getLogger("shmcache")

ROW_WORDS = 16  # one 128-byte row per process slot (the remote tier counts 12 things)
URL_BYTES = 512  # after the rows: the URL the counts are of (for `shmcache stat`)
_ROWS_BYTES = MAX_SLOTS * ROW_WORDS * 8

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
    return registry.session_dir(session) / "caches" / f"{name}.{tier}"


def _map(path: Path, url: str) -> np.ndarray:
    """The (MAX_SLOTS, ROW_WORDS) words of a counts file, mapped shared; made (zeros) if missing."""
    fd = open_owned(path, _ROWS_BYTES + URL_BYTES)
    try:
        mm = mmap.mmap(fd, _ROWS_BYTES + URL_BYTES)
    finally:
        os.close(fd)
    raw = url.encode()[:URL_BYTES].ljust(URL_BYTES, b"\0")
    if mm[_ROWS_BYTES:] != raw:
        mm[_ROWS_BYTES:] = raw
    return np.ndarray((MAX_SLOTS, ROW_WORDS), np.uint64, mm)


def process_row(path: str | os.PathLike | None, url: str, slot: Callable[[], int] | None,
                what: str) -> np.ndarray:
    """This process's row of the counts file at ``path`` (``slot()``: its liveness slot); a row of
    its own memory when there is no file (an uncached store) or the file cannot be used, said once
    in the log naming ``what`` (the tier)."""
    if path is None or slot is None:
        return np.zeros(ROW_WORDS, np.uint64)
    try:
        row = _map(Path(path), url)[slot()]
    except Exception as exc:  # noqa: BLE001 - counting is no reason to fail a read
        log.warning("%s: this process's counts are kept in the process only (%s)", what, exc)
        return np.zeros(ROW_WORDS, np.uint64)
    if (row >= 1 << 62).any():  # garbage in the file: start the row again
        row[:] = 0
    return row


def read_counts(path: str | os.PathLike, names: Sequence[str]) -> dict | None:
    """The counters ``names`` (the first words of a row) summed over every process, and ``url``
    (None: no such tier was ever in force for the cache)."""
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        return None
    n = min(len(raw), _ROWS_BYTES) // (ROW_WORDS * 8) * (ROW_WORDS * 8)
    rows = np.frombuffer(raw[:n], np.uint64).reshape(-1, ROW_WORDS)
    rows = rows[(rows < 1 << 62).all(axis=1)]  # a garbage row is a stat, not worth failing over
    total = rows.sum(axis=0) if len(rows) else np.zeros(ROW_WORDS, np.uint64)
    out: dict = {name: int(total[i]) for i, name in enumerate(names)}
    out["url"] = raw[n:n + URL_BYTES].rstrip(b"\0").decode(errors="replace") or None
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
