"""Named crash points for the crash tests: ``SHMCACHE_CRASH_AT=point[,point]`` in a process makes
it SIGKILL itself when it reaches one of them (``SHMCACHE_CRASH_AFTER=N`` skips the first N
hits). Unset - always, outside tests - a crash point costs one truth test of a module global.
"""

from __future__ import annotations

import os
import signal

from . import settings

__all__ = ["crash_point", "ARMED"]

_points = frozenset(p for p in settings.get(settings.ENV_CRASH_AT, "").split(",") if p)  # read at import
_skip = int(settings.get(settings.ENV_CRASH_AFTER, "0") or 0)
ARMED = bool(_points)


def crash_point(name: str) -> None:
    global _skip
    if name in _points:
        if _skip > 0:
            _skip -= 1
            return
        os.kill(os.getpid(), signal.SIGKILL)
