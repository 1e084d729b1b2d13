"""Slot rows: counters shared by the processes of a session without a lock, one row of a file per
liveness slot, each process writing only its own. The claims, stall and tier counters are its
users; each names its file, its row's words and what it keeps after the rows.

NOTE [slot rows]
    The file is MAX_SLOTS rows of ``words`` uint64 words, one row per liveness slot of the session
    (NOTE [lock files]), then the rows a user adds (``extra_rows``), then a tail of ``tail`` bytes
    of its user's. Each process writes only the row of its own slot, one aligned 8-byte store per
    word (a memoryview 'Q' item, or a uint64 element of an array over it), so no lock is needed and
    a reader never sees a torn word; readers read the file (never more than its size; never a FIFO,
    a link or another user's file: ``read_owned``) and sum the rows. A slot taken over by a new
    process goes on from the totals in its row, as the store's counters do. A row holding garbage (a
    word at or above 2**62: a torn or tampered file, a counter run wild) is zeroed by its owner when
    it maps the row and left out by readers: a statistic is no reason to fail a read. The file is
    opened with ``open_owned`` (never through a symlink, only a regular file of this user's) and
    grown to its size, so two makers agree; when it cannot be used (refused, no slot free, an error)
    the process counts in a row of its own memory, said once in the log, and no reader sees those
    counts. A forked child maps its own slot's row on its first count: ``process_slot.fork_count``
    tells it the row it inherited is its parent's.
"""

from __future__ import annotations

import logging
import mmap
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..base.owned_file import open_owned, read_owned
from . import process_slot
from .registry import MAX_SLOTS

__all__ = ["GARBAGE", "SlotRows", "is_garbage"]

log = logging.getLogger("shmcache")

GARBAGE = 1 << 62  # a word at or above it marks its row as garbage (NOTE [slot rows])

# on_map(row, fd, words): a user's start of a freshly mapped row; fd and words (the file's
# descriptor and all its rows' words) are -1 and None for a row of process memory
OnMap = Callable[[Any, int, Any], None]


def is_garbage(row: Any) -> bool:
    """Whether a row (its words) holds garbage: a word at or above GARBAGE."""
    return any(w >= GARBAGE for w in row)


class SlotRows:
    """A slot rows file (NOTE [slot rows]): ``MAX_SLOTS + extra_rows`` rows of ``words`` uint64,
    then ``tail`` bytes. Writers: ``row()`` (this process's row, mapped once per process) or
    ``own_row()`` (mapped now); ``open`` and ``row_in`` for a user that keeps the descriptor.
    Readers: ``read`` and ``sum``. ``slot()`` gives this process's liveness slot; ``what`` names
    the counters in the log; ``on_map`` starts each row this process maps."""

    def __init__(self, path: str | os.PathLike, words: int, *, extra_rows: int = 0, tail: int = 0,
                 slot: Callable[[], int] | None = None, what: str = "", on_map: OnMap | None = None):
        self.path = Path(path)
        self.words = words
        self.rows = MAX_SLOTS + extra_rows
        self.rows_bytes = self.rows * words * 8
        self.tail = tail
        self.nbytes = self.rows_bytes + tail
        self._slot = slot
        self.what = what or f"counters {self.path}"
        self._on_map = on_map
        self._gen = -1  # process_slot.fork_count() when _row was mapped
        self._row: Any = None

    # --- writers -----------------------------------------------------------------------------

    def row(self) -> Any:
        """This process's row (``own_row``), mapped on first use in each process: a forked child
        maps its own slot's row."""
        if self._gen != process_slot.fork_count():
            self._row, self._gen = self.own_row(), process_slot.fork_count()
        return self._row

    def own_row(self, tail: bytes | None = None) -> Any:
        """This process's row mapped now, ``tail`` (if given) written after the rows; a row of
        process memory when the file cannot be used, said in the log."""
        try:
            fd, mm = self.open()
        except Exception as exc:  # noqa: BLE001 - counting is no reason to fail the caller
            return self.memory_row(exc)
        try:
            if tail is not None:
                raw = tail[:self.tail].ljust(self.tail, b"\0")
                if mm[self.rows_bytes:] != raw:  # every process writes it: only when it differs
                    mm[self.rows_bytes:] = raw
            return self.row_in(mm, fd)
        finally:
            os.close(fd)

    def open(self) -> tuple[int, mmap.mmap]:
        """The file's descriptor (the caller closes it) and a shared mapping of all of it; made
        (zeros) and grown to ``nbytes`` if it is missing or short. OSError when it is refused."""
        fd = open_owned(self.path, self.nbytes)
        try:
            return fd, mmap.mmap(fd, self.nbytes)
        except BaseException:
            os.close(fd)
            raise

    def row_in(self, mm: mmap.mmap, fd: int = -1) -> Any:
        """This process's row of the mapping ``mm`` of the file (``fd``: its descriptor, for
        ``on_map``), garbage zeroed; a row of process memory when there is no slot for it."""
        try:
            words = memoryview(mm)[:self.rows_bytes].cast("Q")
            slot = self._slot() if self._slot is not None else -1
            if not 0 <= slot < MAX_SLOTS:
                raise ValueError(f"no liveness slot {slot} among {MAX_SLOTS}")
            row = words[slot * self.words:(slot + 1) * self.words]
            if is_garbage(row):  # a statistic starts again, reads go on
                row[:] = memoryview(bytes(8 * self.words)).cast("Q")
            if self._on_map is not None:
                self._on_map(row, fd, words)
        except Exception as exc:  # noqa: BLE001 - counting is no reason to fail the caller
            return self.memory_row(exc)
        return row

    def memory_row(self, exc: BaseException | None = None) -> Any:
        """A row of this process's memory, started by ``on_map``; ``exc`` (why the file is not
        used) is logged."""
        if exc is not None:
            log.warning("%s: this process's counts are kept in the process only (%s)", self.what, exc)
        row = memoryview(bytearray(8 * self.words)).cast("Q")
        if self._on_map is not None:
            self._on_map(row, -1, None)
        return row

    # --- readers -----------------------------------------------------------------------------

    def read(self) -> tuple[np.ndarray, bytes] | None:
        """The file's rows (an array of ``words`` columns) less its garbage rows, and its tail;
        None when there is no file, or anything but a regular file of this user's at its name."""
        raw = read_owned(self.path, self.nbytes)
        if raw is None:
            return None
        width = self.words * 8
        n = min(len(raw), self.rows_bytes) // width * width
        rows = np.frombuffer(raw[:n], np.uint64).reshape(-1, self.words)
        return rows[(rows < GARBAGE).all(axis=1)], raw[self.rows_bytes:]

    def sum(self) -> tuple[list[int], bytes] | None:
        """Each word summed over the rows that are not garbage, and the tail; None when there is
        no file."""
        got = self.read()
        if got is None:
            return None
        rows, tail = got
        total = rows.sum(axis=0) if len(rows) else np.zeros(self.words, np.uint64)
        return [int(w) for w in total], tail
