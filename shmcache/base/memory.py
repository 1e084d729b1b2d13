"""How much memory there really is: MemAvailable, the cgroup's limit (v1 or v2) and /dev/shm's free
space, the smallest of which a cache can use (NOTE [memory limits])."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .cgroups import cgroup_limits
from .memdir import backing, meminfo, space
from .namespace import SHM_ROOT

__all__ = ["MemoryLimits", "memory_limits"]


@dataclass(frozen=True)
class MemoryLimits:
    """What limits the cache's memory, in bytes (None where that limit does not apply)."""

    mem_available: int | None
    cgroup_limit: int | None
    cgroup_free: int | None
    shm_total: int | None
    shm_free: int | None
    cgroup_file: str | None = None  # the file the binding cgroup limit was read from
    # the shared memory is a hugetlbfs's pool: memory set aside, in neither MemAvailable nor (unless
    # cgroup v2 charges it: memory_hugetlb_accounting) the memory cgroup; the pool alone bounds it
    huge_pool: bool = False

    @property
    def available(self) -> int:
        """The smallest of the limits that apply: what the cache can really use."""
        limits = (self.shm_free,) if self.huge_pool else (self.mem_available, self.cgroup_free, self.shm_free)
        known = [v for v in limits if v is not None]
        return max(0, min(known)) if known else 0

    def auto_capacity(self, held: int = 0) -> int:
        """``size=0``: 80% of what is really available (NOTE [memory limits]), counting as available
        the ``held`` bytes of shared memory that the caches it is for hold already."""
        return int((self.available + held) * 0.8)


def memory_limits(proc_self: str = "/proc/self", shm_root: str = SHM_ROOT) -> MemoryLimits:
    """The limits now; ``shm_root``: where the shared memory lives (/dev/shm, or a session's memory
    directory: its filesystem's size and free space are the ``shm_`` fields)."""
    limit, free, source = cgroup_limits(proc_self)
    try:
        shm_total, shm_free = space(shm_root)
    except OSError:
        shm_total = shm_free = None
    pool = backing(shm_root).huge == "hugetlbfs" and not _hugetlb_charged(proc_self)
    return MemoryLimits(meminfo().get("MemAvailable"), limit, free, shm_total, shm_free, source, huge_pool=pool)


def _hugetlb_charged(proc_self: str) -> bool:
    """Whether the memory cgroup charges huge pages of hugetlbfs (a cgroup2 mount with the
    memory_hugetlb_accounting option, Linux 6.6+): then its limit bounds them too."""
    try:
        text = Path(proc_self, "mountinfo").read_text()
    except OSError:
        return False
    for line in text.splitlines():
        fs = line.partition(" - ")[2].split()
        if len(fs) >= 3 and fs[0] == "cgroup2" and "memory_hugetlb_accounting" in fs[2].split(","):
            return True
    return False
