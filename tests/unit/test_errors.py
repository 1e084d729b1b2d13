"""The error taxonomy (shmcache/errors.py): each error is a ShmcacheError and the builtin it
refines, pickles with its message, and CacheFull is the base of the errors that mean the cache's
memory cannot take an item."""

from __future__ import annotations

import pickle

import pytest

import shmcache
from shmcache import CacheFull, ItemTooLarge, SharedMemoryFull, ShmcacheError
from shmcache.errors import SpillFull


@pytest.mark.parametrize("cls", [ItemTooLarge, SharedMemoryFull])
def test_except_cache_full_catches_each_cache_full_error(cls):
    with pytest.raises(CacheFull) as info:
        raise cls("no room")
    assert type(info.value) is cls
    for base in (ShmcacheError, MemoryError):  # the bases each had before CacheFull was theirs
        assert isinstance(info.value, base)
    again = pickle.loads(pickle.dumps(info.value))
    assert type(again) is cls and str(again) == "no room"


def test_cache_full_is_public_and_a_memory_error():
    assert shmcache.CacheFull is CacheFull and "CacheFull" in shmcache.__all__
    assert issubclass(CacheFull, ShmcacheError) and issubclass(CacheFull, MemoryError)


def test_a_full_spill_disk_is_a_disk_error_not_a_full_cache():
    """SpillFull never leaves the spill tier (the store stops spilling); it is an OSError."""
    assert issubclass(SpillFull, OSError) and not issubclass(SpillFull, MemoryError)
    assert not issubclass(SpillFull, CacheFull)


def test_every_error_pickles_and_refines_a_builtin():
    for name in shmcache.errors.__all__:
        cls = getattr(shmcache.errors, name)
        assert issubclass(cls, ShmcacheError)
        if cls is not ShmcacheError:
            assert any(b.__module__ == "builtins" and b is not Exception for b in cls.__mro__), name
        exc = pickle.loads(pickle.dumps(cls("message")))
        assert type(exc) is cls and str(exc) == "message"
