"""Fixtures of the journey tests (helpers to run a step: _journey.py)."""

from __future__ import annotations

import pytest

from shmcache.base.namespace import namespace
from shmcache.cache.registry import SessionRegistry


@pytest.fixture
def other_machine(tmp_path):
    """A second ``$SHMCACHE_DIR``: another machine's shared memory, emptied at the end."""
    root = tmp_path / "machine-b"
    yield root
    ns = namespace(str(root))
    registry = SessionRegistry(ns)
    for info in registry.list():
        registry.destroy(info.name, force=True)
    assert not ns.owned_segments()
