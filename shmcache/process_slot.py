"""Per-process state that must not survive ``fork``: liveness slots held in each session.

After a fork the child shares its parent's open lock files, and so its slots (NOTE [lock files]).
``generation()`` changes in every forked child, so objects that cache per-process state (a
store's counter slot) notice and take their own; the inherited descriptors are closed without
releasing the parent's locks.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from .locks import LivenessSlot

__all__ = ["generation", "slot", "attach", "detach", "counters", "release_all"]

_generation = 0
_slots: dict[tuple[str, str], LivenessSlot] = {}
_registries: dict[tuple[str, str], Any] = {}  # the registry each slot was taken through
_users: dict[tuple[str, str], int] = {}  # open stores of this process per (namespace, session)
_counters: dict[str, list[int]] = {}
_lock = threading.Lock()


def generation() -> int:
    return _generation


def slot(registry, session: str) -> int:
    """This process's slot number in ``session`` (taken on first use, held until exit)."""
    key = (str(registry.ns.root), session)
    s = _slots.get(key)
    if s is None:
        with _lock:
            s = _slots.get(key)
            if s is None:
                s = registry.attach_process(session)
                _slots[key] = s
                _registries[key] = registry
    return s.index


def attach(registry, session: str) -> int:
    """``slot()``, counting one more open store of this process in ``session``: the slot is
    released when the last of them calls ``detach``."""
    index = slot(registry, session)
    key = (str(registry.ns.root), session)
    with _lock:
        _users[key] = _users.get(key, 0) + 1
    return index


def detach(registry, session: str) -> None:
    """One store of ``session`` closed; the last one gives up the process's slot, so the process
    no longer counts as attached (``shmcache destroy`` without ``--force`` then succeeds)."""
    key = (str(registry.ns.root), session)
    with _lock:
        left = _users.get(key, 0) - 1
        if left > 0:
            _users[key] = left
            return
        _users.pop(key, None)
        s = _slots.pop(key, None)
        if s is None:
            return
        _registries.pop(key, None)
        # the counter totals of the slot go with it: another process may take it and count on
        prefix, suffix = key[0] + registry.ns.segment_name(session, ""), f"+{s.index}"
        for k in [k for k in _counters if k.startswith(prefix) and k.endswith(suffix)]:
            del _counters[k]
    registry.mark_used(session)  # detaching is a use (NOTE [session lifecycle], last use)
    s.release()


def counters(key: str, initial) -> list[int]:
    """This process's counter totals for one cache generation, shared by every store object of
    the process (they write one slot: separate totals would overwrite each other)."""
    c = _counters.get(key)
    if c is None:
        c = _counters[key] = list(initial())
    return c


def release_all() -> None:
    """Give up every slot (tests, and processes that detach from all caches)."""
    _mark_used()
    for s in _slots.values():
        s.release()
    _slots.clear()
    _registries.clear()
    _users.clear()


def _mark_used() -> None:
    """Detaching is a use: ``gc --idle-for`` counts idle time from here, not from the attach
    (NOTE [session lifecycle] in registry.py, last use). Runs at a clean exit too."""
    for (_root, session), registry in list(_registries.items()):
        registry.mark_used(session)


def _after_fork_in_child() -> None:
    global _generation, _lock
    _generation += 1
    _lock = threading.Lock()
    for s in _slots.values():
        s.forget_after_fork()
    _slots.clear()
    _registries.clear()
    _users.clear()
    _counters.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_mark_used)
