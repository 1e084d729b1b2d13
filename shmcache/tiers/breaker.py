"""The circuit breaker of a tier behind a network (the remote tier, a snapshot on a store): after a
fault, reads miss at once and writes are dropped for a pause that doubles with each fault in a row,
from ``first_s`` to ``longest_s``; the first call after the pause tries the store again.

``jitter``: each pause is drawn from ``pause * (1 +- jitter)``, so that the processes of a job,
which meet the same fault at the same moment, do not all come back at the same moment either (the
remote tier: 0.2; a snapshot's reads: none). Not thread-safe on its own: its owner calls it under
the lock that guards its counters.

``clock``: where the time comes from (``time.monotonic``); a test passes a clock it moves by hand,
so a pause is waited out without sleeping. ``retry_at`` is a time of that clock.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

__all__ = ["Breaker"]


class Breaker:
    """One tier's breaker, per process (a forked child makes its own)."""

    __slots__ = ("first_s", "longest_s", "jitter", "clock", "pause_s", "retry_at")

    def __init__(self, first_s: float, longest_s: float, jitter: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.first_s, self.longest_s, self.jitter = first_s, longest_s, jitter
        self.clock = clock
        self.pause_s = 0.0  # the last pause; 0: no fault since the last success
        self.retry_at = 0.0  # clock() when the store may be tried again

    def is_open(self) -> bool:
        """True during a pause: the caller misses at once, without asking the store."""
        return self.clock() < self.retry_at

    def trip(self) -> None:
        """A fault: the next pause, twice the last one (``first_s`` at first, ``longest_s`` at most)."""
        self.pause_s = min(max(self.pause_s * 2, self.first_s), self.longest_s)
        pause = self.pause_s * random.uniform(1 - self.jitter, 1 + self.jitter) if self.jitter else self.pause_s
        self.retry_at = self.clock() + pause

    def reset(self) -> None:
        """The store answered: the next fault pauses ``first_s`` again."""
        self.pause_s = 0.0
