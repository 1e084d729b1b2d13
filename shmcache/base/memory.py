"""How much memory there really is: MemAvailable, the cgroup's limit (v1 or v2) and /dev/shm's free
space, the smallest of which a cache can use (NOTE [memory limits])."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .memdir import backing, space
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


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    # cgroup v1 reports "no limit" as a huge number near 2**63.
    return None if value >= 1 << 60 else value


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# cgroup files: (limit, usage) under a v2 directory and a v1 memory-controller directory
_CGROUP_FILES = {"cgroup2": ("memory.max", "memory.current"),
                 "cgroup": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
_CGROUP_DEFAULT_MOUNTS = {"cgroup2": ("/", "/sys/fs/cgroup"), "cgroup": ("/", "/sys/fs/cgroup/memory")}


def _cgroup_paths(proc_self: str) -> dict[str, str]:
    """The process's own cgroup, per kind ("cgroup2": v2's ``0::/path``; "cgroup": the v1
    hierarchy that has the memory controller, ``N:...memory...:/path``)."""
    try:
        text = Path(proc_self, "cgroup").read_text()
    except OSError:
        return {}
    paths = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            paths["cgroup2"] = path
        elif "memory" in controllers.split(","):
            paths["cgroup"] = path
    return paths


def _cgroup_mounts(proc_self: str) -> dict[str, tuple[str, str]]:
    """Where each kind of cgroup tree is mounted: ``(root inside the hierarchy, mount point)``
    from mountinfo. A container without a cgroup namespace mounts its own cgroup (root
    ``/docker/<id>``) while /proc/self/cgroup names the full path: the root is cut off it."""
    mounts: dict[str, tuple[str, str]] = {}
    try:
        text = Path(proc_self, "mountinfo").read_text()
    except OSError:
        return dict(_CGROUP_DEFAULT_MOUNTS)
    for line in text.splitlines():
        left, _, right = line.partition(" - ")
        fields, fs = left.split(), right.split()
        if len(fields) < 5 or len(fs) < 3 or fs[0] not in _CGROUP_FILES or fs[0] in mounts:
            continue
        if fs[0] == "cgroup" and "memory" not in fs[2].split(","):
            continue
        mounts[fs[0]] = (_unescape(fields[3]), _unescape(fields[4]))
    return mounts or dict(_CGROUP_DEFAULT_MOUNTS)


def _unescape(field: str) -> str:
    """A mountinfo path: spaces and the like are written as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_limits(proc_self: str = "/proc/self") -> tuple[int | None, int | None, str | None]:
    """``(limit, free, file)`` of the tightest memory limit on this process: its own cgroup's
    and every ancestor's (v2 and v1), as a Slurm job or a container sets them. ``proc_self``:
    where ``cgroup`` and ``mountinfo`` are read (tests point it at a fake tree)."""
    paths, mounts = _cgroup_paths(proc_self), _cgroup_mounts(proc_self)
    best: tuple[int, int, str] | None = None
    for kind, (limit_name, usage_name) in _CGROUP_FILES.items():
        if kind not in mounts:
            continue
        root, point = mounts[kind]
        path = paths.get(kind, "/")
        inside = path == root or path.startswith(root.rstrip("/") + "/")
        rel = path[len(root):] if inside else ""  # outside the mount's view: its top is ours
        top = Path(point)
        here = top / rel.strip("/")
        for directory in (here, *here.parents):
            limit = _read_int(str(directory / limit_name))
            if limit is not None:
                free = max(0, limit - (_read_int(str(directory / usage_name)) or 0))
                if best is None or free < best[1]:
                    best = (limit, free, str(directory / limit_name))
            if directory == top:
                break
    if best is None:
        return None, None, None
    return best


def memory_limits(proc_self: str = "/proc/self", shm_root: str = SHM_ROOT) -> MemoryLimits:
    """The limits now; ``shm_root``: where the shared memory lives (/dev/shm, or a session's memory
    directory: its filesystem's size and free space are the ``shm_`` fields)."""
    limit, free, source = _cgroup_limits(proc_self)
    try:
        shm_total, shm_free = space(shm_root)
    except OSError:
        shm_total = shm_free = None
    pool = backing(shm_root).huge == "hugetlbfs" and not _hugetlb_charged(proc_self)
    return MemoryLimits(_mem_available(), limit, free, shm_total, shm_free, source, huge_pool=pool)


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
