"""Per-process state that must not survive ``fork``: liveness slots held in each session.

After a fork the child shares its parent's open lock files, and so its slots (NOTE [lock files]).
``fork_count()`` changes in every forked child, so objects that cache per-process state (a
store's counter slot) notice and take their own; the inherited descriptors are closed without
releasing the parent's locks.
"""

from __future__ import annotations

import atexit
import os
import threading
from dataclasses import dataclass
from typing import Any

from ..base.locks import LivenessSlot

__all__ = ["fork_count", "forks", "slot", "attach", "detach", "counters", "release_all"]

# one more in every forked child (_after_fork_in_child); read it, never write it: a hot path
# that cannot afford the call of fork_count() (CacheStore.lookup's hit) compares it directly
forks = 0


@dataclass
class _Held:
    """A liveness slot this process holds in one session (per namespace)."""

    slot: LivenessSlot
    registry: Any  # the registry it was taken through (marks the session used when detaching)
    users: int = 0  # open stores of this process in the session (attach/detach)


_held: dict[tuple[str, str], _Held] = {}  # (namespace root, session) -> what this process holds there
_counters: dict[str, list[int]] = {}
_lock = threading.Lock()


def fork_count() -> int:
    """How many forks separate this process from the one that imported shmcache: differs in
    every forked child, so a value kept beside per-process state says whether it is ours."""
    return forks


def slot(registry, session: str) -> int:
    """This process's slot number in ``session`` (taken on first use, held until exit)."""
    key = (str(registry.ns.root), session)
    held = _held.get(key)
    if held is None:
        with _lock:
            held = _held.get(key)
            if held is None:
                held = _held[key] = _Held(registry.attach_process(session), registry)
    return held.slot.index


def attach(registry, session: str) -> int:
    """``slot()``, counting one more open store of this process in ``session``: the slot is
    released when the last of them calls ``detach``."""
    key = (str(registry.ns.root), session)
    while True:  # again if another thread's detach gave the slot up between the two steps
        slot(registry, session)
        with _lock:
            held = _held.get(key)
            if held is not None:
                held.users += 1
                return held.slot.index


def detach(registry, session: str) -> None:
    """One store of ``session`` closed; the last one gives up the process's slot, so the process
    no longer counts as attached (``shmcache destroy`` without ``--force`` then succeeds)."""
    key = (str(registry.ns.root), session)
    with _lock:
        held = _held.get(key)
        if held is None:
            return
        held.users -= 1
        if held.users > 0:
            return
        del _held[key]
        # the counter totals of the slot go with it: another process may take it and count on
        # (a key names the segment, with its memory directory when the session has one)
        head, suffix = registry.ns.segment_name(session, ""), f"+{held.slot.index}"
        for k in [k for k in _counters if k.startswith(key[0]) and head in k and k.endswith(suffix)]:
            del _counters[k]
    registry.mark_used(session)  # detaching is a use (NOTE [session lifecycle], last use)
    held.slot.release()


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
    for held in _held.values():
        held.slot.release()
    _held.clear()


def _mark_used() -> None:
    """Detaching is a use: ``gc --idle-for`` counts idle time from here, not from the attach
    (NOTE [session lifecycle], last use). Runs at a clean exit too."""
    for (_root, session), held in list(_held.items()):
        held.registry.mark_used(session)


def _after_fork_in_child() -> None:
    global forks, _lock
    forks += 1
    _lock = threading.Lock()
    for held in _held.values():
        held.slot.forget_after_fork()
    _held.clear()
    _counters.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
atexit.register(_mark_used)
