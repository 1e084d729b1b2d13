"""tiers/breaker.py: the circuit breaker of the remote tier (jittered) and the snapshot tier."""

from __future__ import annotations

import time

import pytest

from shmcache.tiers.breaker import Breaker


def test_closed_until_a_fault():
    b = Breaker(1.0, 30.0)
    assert not b.is_open() and b.pause_s == 0.0


def test_pauses_double_from_first_to_longest_without_jitter():
    b = Breaker(1.0, 30.0)
    pauses = []
    for _ in range(7):
        before = time.monotonic()
        b.trip()
        pauses.append(b.pause_s)
        assert b.is_open()
        assert before + b.pause_s <= b.retry_at <= time.monotonic() + b.pause_s
    assert pauses == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]


def test_reset_starts_again_at_first():
    b = Breaker(1.0, 30.0)
    b.trip()
    b.trip()
    b.reset()
    assert b.pause_s == 0.0
    b.trip()
    assert b.pause_s == 1.0


@pytest.mark.parametrize("jitter", [0.2, 0.5])
def test_jitter_draws_each_pause_around_the_doubling(jitter):
    b = Breaker(1.0, 30.0, jitter=jitter)
    seen = set()
    for _ in range(50):
        b.reset()
        b.trip()
        b.trip()  # a pause of 2 s, jittered
        now = time.monotonic()
        wait = b.retry_at - now
        assert 2.0 * (1 - jitter) - 0.1 <= wait <= 2.0 * (1 + jitter)
        seen.add(round(wait, 3))
    assert len(seen) > 1


def test_an_elapsed_pause_closes():
    b = Breaker(0.01, 0.01)
    b.trip()
    time.sleep(0.02)
    assert not b.is_open()
