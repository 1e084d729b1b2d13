"""Who else used the job's session while the job ran, for its closing summary.

A cache's counters are a row per liveness slot of its session, summed: every process attached to
the session adds to them, whichever job it belongs to. The closing summary subtracts the reading
at the job's start (``metrics_server.reading``), so the reads of another job that shares the
session at the same time (a sweep's runs on one node, an evaluation script beside training) count
in it too, and nothing in the counters tells them apart. ``Sharers`` looks, while the job runs,
at the processes attached to the session, and keeps those that are not the launch's: a process
of the launch carries ``$SHMCACHE_LAUNCH`` (this launcher, for good: its pid and start time) in
the environment it was started with, which its DataLoader workers and subprocesses inherit, and
which /proc shows whatever process group, session or parent it has since - or descends from the
launcher (a process that set its title with setproctitle shows the title in place of that
environment). The summary then says that its counts include theirs. A look every ``LOOK_S``
(half a second): a process attached for less than that may go unseen.
"""

from __future__ import annotations

import threading

from ..base.procs import parent_pid, start_time, started
from ..base.settings import ENV_LAUNCH
from ..cache.registry import SessionRegistry

__all__ = ["LOOK_S", "Sharers", "launch_mark"]

LOOK_S = 0.5
_ANCESTORS_MAX = 64  # a parent chain followed at most this far (a loop in a hostile /proc ends)
_ENVIRON_MAX = 1 << 20  # a process's environment read at most this far (Linux caps argv + env near 2 MiB)


def launch_mark(pid: int) -> str:
    """What ``$SHMCACHE_LAUNCH`` holds in the processes of the launch by launcher ``pid``."""
    return started(pid)


class Sharers:
    """The processes outside the launch ``mark`` seen attached to ``session`` between ``start``
    and ``stop``, looked at every LOOK_S on a daemon thread; ``stop`` returns their pids."""

    def __init__(self, registry: SessionRegistry, session: str, mark: str, own_pid: int):
        self._registry, self._session, self._own_pid = registry, session, own_pid
        self._needle = f"{ENV_LAUNCH}={mark}".encode()
        self._judged: dict[tuple[int, str], bool] = {}  # (pid, start time) -> outside the launch
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="shmcache-sharers", daemon=True)

    def start(self) -> None:
        self._look()  # another job attached before this one started
        self._thread.start()

    def stop(self) -> list[int]:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5 * LOOK_S)
        self._look()
        return sorted({pid for (pid, _), outside in list(self._judged.items()) if outside})

    def _loop(self) -> None:
        while not self._stop.wait(LOOK_S):
            self._look()

    def _look(self) -> None:
        try:
            pids = self._registry.live_pids(self._session)
        except OSError:  # the session's directory is gone (destroyed): nobody to see
            return
        for pid in pids:
            if pid <= 0 or pid == self._own_pid:
                continue
            key = (pid, start_time(pid))
            if key[1] and key not in self._judged:  # (no start time: gone already, or not ours to read)
                self._judged[key] = not self._of_launch(pid)

    def _of_launch(self, pid: int) -> bool:
        """Whether process ``pid`` was started with this launch's mark in its environment (one
        entry of the NUL-separated list /proc/PID/environ holds), or descends from the launcher: a
        process that set its title (setproctitle) shows the title there, not its environment."""
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                environ = f.read(_ENVIRON_MAX)
        except OSError:  # gone, or another user's: not this launch's by its environment
            environ = b""
        return self._needle in environ.split(b"\0") or self._descends(pid)

    def _descends(self, pid: int) -> bool:
        """Whether the launcher is an ancestor of ``pid`` (its rank's, a worker's parent chain)."""
        for _ in range(_ANCESTORS_MAX):
            pid = parent_pid(pid)
            if pid is None or pid <= 1:  # (a launcher that is a container's pid 1 has every orphan as its
                return False                 # child: its processes are known by their environment only)
            if pid == self._own_pid:
                return True
        return False
