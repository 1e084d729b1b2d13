"""Another process as /proc tells it: its parent and when it started (Linux; nothing raises).

A pid alone names another process once its own has exited; a pid and its start time (clock ticks
since boot) name one process for good - what the launcher's directory guard and a job's identity
(``cache.admission``: a warning said once per job) compare.
"""

from __future__ import annotations

__all__ = ["parent_pid", "start_time", "started"]


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the state on (the name in parentheses before them may hold
    anything, ')' and spaces included)."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rpartition(b")")[2].decode("ascii", "replace").split()


def parent_pid(pid: int) -> int | None:
    """The parent of process ``pid``, or None where /proc does not say."""
    try:
        return int(_stat_fields(pid)[1])
    except (OSError, ValueError, IndexError):
        return None


def start_time(pid: int) -> str:
    """When process ``pid`` started (clock ticks since boot, field 22), or "" where /proc does not
    say."""
    try:
        return _stat_fields(pid)[19]
    except (OSError, IndexError):
        return ""


def started(pid: int | None) -> str:
    """``"<pid>@<start time>"``: one process for good ("?" for none; the pid alone where /proc does
    not say when it started)."""
    if pid is None:
        return "?"
    when = start_time(pid)
    return f"{pid}@{when}" if when else str(pid)
