"""Fixtures of the cache room's tests."""

from __future__ import annotations

import pytest

from shmcache.base import rowcopy


@pytest.fixture(params=["compiled", "numpy"])
def row_copy(request, monkeypatch):
    """Each test twice: the batch gather with the compiled row copy and with numpy's ways (what an
    install without a C compiler, or ``SHMCACHE_NATIVE=0``, runs). rowcopy's NATIVE is read at
    each gather, so the switch takes effect at once."""
    if request.param == "compiled" and not rowcopy.NATIVE and "not built" in rowcopy.unavailable_reason():
        pytest.skip(f"the compiled row copy: {rowcopy.unavailable_reason()}")
    monkeypatch.setattr(rowcopy, "NATIVE", request.param == "compiled")
    return request.param

