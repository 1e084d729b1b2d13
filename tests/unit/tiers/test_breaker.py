"""tiers/breaker.py: the circuit breaker of the remote tier (jittered) and the snapshot tier, on a
clock the test moves by hand (no sleeping out a pause)."""

from __future__ import annotations

import time

import pytest
from _clock import FakeClock

from shmcache.tiers.breaker import Breaker


def test_closed_until_a_fault():
    b = Breaker(1.0, 30.0, clock=FakeClock())
    assert not b.is_open() and b.pause_s == 0.0


def test_pauses_double_from_first_to_longest_without_jitter():
    clock = FakeClock()
    b = Breaker(1.0, 30.0, clock=clock)
    pauses = []
    for _ in range(7):
        b.trip()
        pauses.append(b.pause_s)
        assert b.is_open() and b.retry_at == clock.now + b.pause_s
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_open_for_exactly_the_pause():
    clock = FakeClock()
    b = Breaker(1.0, 30.0, clock=clock)
    b.trip()
    b.trip()  # 2 s
    clock.advance(1.999)
    assert b.is_open()
    clock.advance(0.001)
    assert not b.is_open()  # the first call after the pause tries the store again


def test_reset_starts_again_at_first():
    b = Breaker(1.0, 30.0, clock=FakeClock())
    b.trip()
    b.trip()
    b.reset()
    assert b.pause_s == 0.0
    b.trip()
    assert b.pause_s == 1.0


@pytest.mark.parametrize("jitter", [0.2, 0.5])
def test_jitter_draws_each_pause_around_the_doubling(jitter):
    clock = FakeClock()
    b = Breaker(1.0, 30.0, jitter=jitter, clock=clock)
    seen = set()
    for _ in range(50):
        b.reset()
        b.trip()
        b.trip()  # a pause of 2 s, jittered
        wait = b.retry_at - clock.now
        assert 2.0 * (1 - jitter) <= wait <= 2.0 * (1 + jitter)
        seen.add(round(wait, 6))
    assert len(seen) > 1


def test_the_real_clock_by_default():
    b = Breaker(30.0, 30.0)
    before = time.monotonic()
    b.trip()
    assert b.clock is time.monotonic
    assert before + 30.0 <= b.retry_at <= time.monotonic() + 30.0 and b.is_open()
