"""``--remote``: a Redis URL handed to the workers, or ``spawn[:MB]``; and its password kept out
of sight (messages, the summary, and the launcher's own process title).

The URL itself is the remote tier's to parse (shmcache.tiers.remote.parse_url, which the command line
calls, so that a typo fails at once on every node rather than in every worker).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from urllib.parse import quote

from ..base.urls import mask_url

__all__ = ["RemoteOption", "parse_remote", "shards_url", "hide_in_process_title"]


@dataclass(frozen=True)
class RemoteOption:
    """``--remote`` decided: ``url`` to pass on as it is, or ``spawn_mb`` for one server per node."""

    url: str | None = None
    spawn_mb: int | None = None

    @property
    def spawn(self) -> bool:
        return self.spawn_mb is not None


def parse_remote(text: str, default_mb: int) -> RemoteOption:
    """``spawn`` or ``spawn:MB`` (ValueError for a bad MB), else a URL, unchecked here."""
    if text == "spawn" or text.startswith("spawn:"):
        return RemoteOption(spawn_mb=_spawn_mb(text, default_mb))
    return RemoteOption(url=text)


def _spawn_mb(text: str, default_mb: int) -> int:
    if text == "spawn":
        return default_mb
    raw = text.split(":", 1)[1]
    try:
        mb = int(raw)
    except ValueError:
        mb = 0
    if mb < 1:
        raise ValueError(f"spawn:{raw}: the memory cap of each node's Redis is a whole number of "
                         f"MiB >= 1, e.g. spawn:4096 (spawn alone: {default_mb})")
    return mb


def shards_url(user: str, password: str, endpoints: list[str], local: tuple[int, str] | None = None) -> str:
    """``$SHMCACHE_REMOTE`` for the per-node servers: the remote tier shards keys over them by
    jump consistent hash, in this order (node rank), so every node must list them alike; ``user``
    is the workers' user on them; ``local``: this node's rank and its server's Unix socket, which
    this node's processes use instead of its TCP port (NOTE [spawned redis], 3-4)."""
    url = f"redis+shards://{user}:{password}@{','.join(endpoints)}"
    return url if local is None else f"{url}?socket={local[0]}:{quote(local[1], safe='')}"


def hide_in_process_title() -> None:
    """Overwrite every URL password in this process's command line (``ps``, /proc/PID/cmdline).

    The kernel shows the original ``argv`` memory, which the interpreter no longer reads once it
    has started; rewriting it in place, padded with NULs to the same length, is what
    ``setproctitle`` does. It closes the window from here on; what was visible between exec and
    this call was visible - hence the manual's advice to export ``$SHMCACHE_REMOTE`` instead.
    Linux only, best effort: nothing happens where /proc/self/stat lacks the argument bounds.
    """
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start, arg_end: fields 48, 49 of proc(5)
    except (OSError, IndexError, ValueError):
        return
    if not 0 < start < end or end - start > 1 << 20:
        return
    current = ctypes.string_at(start, end - start).decode("latin-1")
    updated = mask_url(current)
    if len(updated) > len(current):  # a password shorter than "***": stars of its own length
        updated = mask_url(current, keep_length=True)
    if updated != current:
        ctypes.memmove(start, updated.encode("latin-1").ljust(end - start, b"\0"), end - start)
