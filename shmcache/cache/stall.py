"""Input stall: how long each rank's training loop waits for its next batch, per cache, counted
in a file beside the cache's other counters (``caches/<cache>.stall``) and read by ``stats()``,
``shmcache stat``, ``shmcache top`` and the Prometheus exposition.

Who measures: a ``PrefetchRing``'s consumer (its wait for a filled slot), a
``sink_loop`` over a DataLoader of a wrapped dataset, and ``shmcache.timed(loader)`` (each
``next()`` on the loader's iterator). A ``Pass`` is one traversal: ``ask()`` when the loop asks
for a batch, ``got()`` when it has it. Between ``got()`` and the next ``ask()`` the loop works (a
step); from ``ask()`` to ``got()`` it waits. So per rank ``stall_seconds`` is the time spent
waiting, ``loop_seconds`` the time from a pass's first ask to its last batch (waits and steps),
and their ratio the stall share.

NOTE [stall counts]
    A slot rows file (NOTE [slot rows]) of ROW_WORDS words a row. Words: RANK (the process's
    $RANK + 1; 0: a row never used), WAITS (batches waited for), STALL_NS and LOOP_NS
    (nanoseconds, as above), WAITING_SINCE (CLOCK_MONOTONIC ns of the ask the loop is waiting on
    now, 0 when it is not waiting: one clock for every process of the machine, so ``shmcache
    top`` counts a wait still running), PID (the row's writer). (Two loops of one process over one
    cache at once share its row: their sums stay right only as long as they do not count at the
    same instant, a statistic's error, never a reader's.) A process that takes over a slot whose
    row is another rank's first carries that row's counts into the file's RETIRED rows (one per
    rank below RETIRED_RANKS, after the slot rows), under an flock of the file (held for a few
    word stores, taken within LOCK_WAIT_S or the counts are dropped with a log line), then starts
    the row again; one of its own rank goes on from its totals. So a rank's counts outlive its
    processes; a reader between the carry and the reset counts them twice for that instant (a
    statistic, not a snapshot). Readers sum the live and retired rows of each rank.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..base import settings
from . import process_slot
from .registry import MAX_SLOTS
from .slot_rows import SlotRows, is_garbage
from .store_protocol import Store

__all__ = ["ROW_WORDS", "StallCounts", "Pass", "stall_path", "counts_for_store", "read_ranks",
           "stats_keys", "this_rank"]

log = logging.getLogger("shmcache")

ROW_WORDS = 8  # two spare words per row
RANK, WAITS, STALL_NS, LOOP_NS, WAITING_SINCE, PID = range(6)
RETIRED_RANKS = 1024  # ranks whose counts outlive their processes (a larger rank's are dropped)
LOCK_WAIT_S = 1.0  # the longest a process waits for the file's flock to carry a row


def stall_path(meta_path: str | os.PathLike) -> Path:
    """The stall counts file of the cache whose metadata file is ``meta_path`` (``caches/<c>.json``)."""
    meta_path = Path(meta_path)
    return meta_path.with_name(meta_path.stem + ".stall")


def this_rank() -> int:
    """This process's rank: torchrun's $RANK (the launcher sets it), else 0."""
    try:
        return max(0, int(settings.get(settings.ENV_RANK, "0") or 0))
    except ValueError:
        return 0


class StallCounts:
    """This process's row of one cache's stall counts file (NOTE [stall counts]), mapped on first
    use in each process (a forked child maps its own row)."""

    def __init__(self, path: Path, slot: Callable[[], int]):
        self.path = Path(path)
        # row(): the words of this process's row (of its own memory when the file cannot be
        # used); SlotRows.row itself, not a method around it: each ask and got calls it
        self.row: Callable[[], Any] = _rows(self.path, slot).row


def _rows(path: Path, slot: Callable[[], int] | None = None) -> SlotRows:
    return SlotRows(path, ROW_WORDS, extra_rows=RETIRED_RANKS, slot=slot, what=f"stall counts {path}",
                    on_map=lambda row, fd, words: _start(row, fd, words, path))


def _start(row: Any, fd: int, words: Any, path: Path) -> None:
    """Make a freshly mapped row this process's (NOTE [stall counts]): another rank's is carried
    into its retired row and started again (``fd`` -1: a row of process memory)."""
    rank = this_rank() + 1
    if fd >= 0 and row[RANK] != rank:
        _carry(fd, words, row, path)
    if row[RANK] != rank:
        for i in range(ROW_WORDS):
            row[i] = 0
        row[RANK] = rank
    row[WAITING_SINCE] = 0  # a wait its previous owner died in is over
    row[PID] = os.getpid()


def _carry(fd: int, words: Any, row: Any, path: Path) -> None:
    """Add ``row`` (a dead process's of another rank) into its rank's retired row, under the
    file's flock (NOTE [stall counts]); the caller then starts the row again."""
    rank = row[RANK] - 1
    if row[RANK] == 0 or rank >= RETIRED_RANKS:
        return
    deadline = time.monotonic() + LOCK_WAIT_S
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() > deadline:
                log.warning("stall counts %s: rank %d's earlier counts are dropped (the file's lock "
                            "was busy for %.0f s)", path, rank, LOCK_WAIT_S)
                return
            time.sleep(0.001)
    try:
        base = (MAX_SLOTS + rank) * ROW_WORDS
        retired = words[base:base + ROW_WORDS]
        if is_garbage(retired):
            for i in range(ROW_WORDS):
                retired[i] = 0
        retired[RANK] = rank + 1
        for i in (WAITS, STALL_NS, LOOP_NS):
            retired[i] += row[i]
        row[RANK] = 0  # the caller starts it again
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


class Pass:
    """One traversal of batches by a training loop: ``asked = p.ask()`` before asking for a batch,
    ``p.got(asked)`` once it came (``batch=False``: the source ran out or failed; the wait still
    counts, as no batch)."""

    __slots__ = ("_counts", "_mark")

    def __init__(self, counts: StallCounts):
        self._counts = counts
        self._mark = 0  # when the last ask or got happened (0: this pass has not asked yet)

    def ask(self) -> int:
        now = time.monotonic_ns()
        row = self._counts.row()
        if self._mark:
            row[LOOP_NS] += now - self._mark  # the step since the last batch came
        self._mark = now
        row[WAITING_SINCE] = now
        return now

    def got(self, asked: int, batch: bool = True) -> None:
        now = time.monotonic_ns()
        row = self._counts.row()
        row[STALL_NS] += now - asked
        row[LOOP_NS] += now - self._mark
        if batch:
            row[WAITS] += 1
        row[WAITING_SINCE] = 0
        self._mark = now


_by_path: dict[tuple[str, int], StallCounts] = {}  # (file, the cache's incarnation)
_lock = threading.Lock()


def counts_for_store(store: Store) -> StallCounts | None:
    """The stall counts of ``store``'s cache (a CacheStore, or a TieredStore in front of one); None
    for an uncached store (no file: nothing to count into)."""
    local = getattr(store, "local", store)
    if getattr(local, "uncached", False) or getattr(local, "registry", None) is None:
        return None
    path = stall_path(local.meta_path)
    # and the incarnation: a cache dropped and made again has a new file under the same name, and
    # a row mapped in the old one (unlinked) would count where nobody reads
    key = (str(path), getattr(local, "incarnation", 0))
    with _lock:
        counts = _by_path.get(key)
        if counts is None:
            registry, session = local.registry, local.session
            counts = _by_path[key] = StallCounts(path, lambda: process_slot.slot(registry, session))
    return counts


def read_ranks(path: str | os.PathLike) -> dict[int, dict]:
    """Each rank's counts summed over its processes' rows: {rank: {"waits", "stall_ns", "loop_ns",
    "waiting_since" (the oldest wait running now, CLOCK_MONOTONIC ns; 0: none), "processes"}}."""
    got = _rows(Path(path)).read()
    if got is None:
        return {}
    rows = got[0]
    rows = rows[rows[:, RANK] > 0]
    out: dict[int, dict] = {}
    for row in rows:
        r = out.setdefault(int(row[RANK]) - 1, {"waits": 0, "stall_ns": 0, "loop_ns": 0,
                                                 "waiting_since": 0, "processes": 0})
        r["waits"] += int(row[WAITS])
        r["stall_ns"] += int(row[STALL_NS])
        r["loop_ns"] += int(row[LOOP_NS])
        r["processes"] += int(row[PID] != 0)  # a retired row has none
        since = int(row[WAITING_SINCE])
        if since and (not r["waiting_since"] or since < r["waiting_since"]):
            r["waiting_since"] = since
    return dict(sorted(out.items()))


def _share(stall_ns: int, loop_ns: int) -> float:
    return stall_ns / loop_ns if loop_ns else 0.0


def stats_keys(path: str | os.PathLike) -> dict:
    """The stall keys of ``stats()`` and ``shmcache stat --json`` (the README lists them): the cache's
    ``stall_waits``, ``stall_seconds``, ``loop_seconds``, ``stall_share`` over every rank, and
    ``ranks``: {str(rank): the same four for that rank}. Waits still running are not in them
    (``shmcache top`` adds those)."""
    ranks = read_ranks(path)
    per = {str(rank): {"stall_waits": r["waits"], "stall_seconds": r["stall_ns"] / 1e9,
                       "loop_seconds": r["loop_ns"] / 1e9, "stall_share": _share(r["stall_ns"], r["loop_ns"])}
           for rank, r in ranks.items()}
    stall_ns = sum(r["stall_ns"] for r in ranks.values())
    loop_ns = sum(r["loop_ns"] for r in ranks.values())
    return {"stall_waits": sum(r["waits"] for r in ranks.values()), "stall_seconds": stall_ns / 1e9,
            "loop_seconds": loop_ns / 1e9, "stall_share": _share(stall_ns, loop_ns), "ranks": per}
