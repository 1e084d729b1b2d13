"""A clock a test moves by hand, for what takes ``clock=`` (the breakers, the remote tier): a
pause is waited out by advancing it, never by sleeping."""

from __future__ import annotations


class FakeClock:
    """Called like ``time.monotonic``; it stands still until :meth:`advance`."""

    def __init__(self, now: float = 1000.0):
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        assert seconds >= 0, "a monotonic clock never goes back"
        self.now += seconds
