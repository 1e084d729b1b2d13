"""Crash tests: each test gives up the liveness slots its own process took (the processes it kills
hold their own), so slot counts and `live_pids` start clean for the next test."""

import pytest

from shmcache.cache import process_slot


@pytest.fixture(autouse=True)
def _own_slots():
    yield
    process_slot.release_all()
