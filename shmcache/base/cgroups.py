"""This process's cgroup limits as the kernel tells them (v1 and v2, its own cgroup's and every
ancestor's): the memory controller's (``base.memory``: what a cache can use) and the hugetlb
controller's (``base.memdir``: a container's share of a huge-page pool). Nothing here decides
anything; it reads files under /proc and the cgroup mounts, and a file that cannot be read is no
limit."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["cgroup_limits", "hugetlb_limit"]


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


# cgroup files: (limit, usage) under a v2 directory and a v1 memory-controller directory
_CGROUP_FILES = {"cgroup2": ("memory.max", "memory.current"),
                 "cgroup": ("memory.limit_in_bytes", "memory.usage_in_bytes")}
_CGROUP_DEFAULT_MOUNTS = {"cgroup2": ("/", "/sys/fs/cgroup"), "cgroup": ("/", "/sys/fs/cgroup/memory")}


def _cgroup_paths(proc_self: str, controller: str = "memory") -> dict[str, str]:
    """The process's own cgroup, per kind ("cgroup2": v2's ``0::/path``; "cgroup": the v1
    hierarchy that has ``controller``, ``N:...memory...:/path``)."""
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
        elif controller in controllers.split(","):
            paths["cgroup"] = path
    return paths


def _cgroup_mounts(proc_self: str, controller: str = "memory") -> dict[str, tuple[str, str]]:
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
        if fs[0] == "cgroup" and controller not in fs[2].split(","):
            continue
        mounts[fs[0]] = (_unescape(fields[3]), _unescape(fields[4]))
    if mounts or controller != "memory":
        return mounts
    return dict(_CGROUP_DEFAULT_MOUNTS)


def _unescape(field: str) -> str:
    """A mountinfo path: spaces and the like are written as octal escapes (``\\040``)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def cgroup_limits(proc_self: str = "/proc/self", controller: str = "memory",
                   files: dict[str, tuple[str, str]] = _CGROUP_FILES) -> tuple[int | None, int | None, str | None]:
    """``(limit, free, file)`` of the tightest memory limit on this process: its own cgroup's
    and every ancestor's (v2 and v1), as a Slurm job or a container sets them. ``proc_self``:
    where ``cgroup`` and ``mountinfo`` are read (tests point it at a fake tree); ``controller``
    and its ``files`` (limit, usage) per kind: another controller's (hugetlb_limit)."""
    paths, mounts = _cgroup_paths(proc_self, controller), _cgroup_mounts(proc_self, controller)
    best: tuple[int, int, str] | None = None
    for kind, (limit_name, usage_name) in files.items():
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


def hugetlb_limit(page_size: int, proc_self: str = "/proc/self") -> tuple[int | None, int | None]:
    """``(limit, free)`` bytes of huge pages of ``page_size`` that the hugetlb cgroup lets this
    process have (its own and every ancestor's; a Kubernetes pod's resources.limits.hugepages-2Mi),
    or Nones: a page past it is refused (ENOSPC), whatever the pool has."""
    name = (f"{page_size >> 30}GB" if page_size >= 1 << 30 else f"{page_size >> 20}MB" if page_size >= 1 << 20
            else f"{page_size >> 10}KB")  # the kernel's names: hugetlb.2MB.max, hugetlb.1GB.max
    files = {"cgroup2": (f"hugetlb.{name}.max", f"hugetlb.{name}.current"),
             "cgroup": (f"hugetlb.{name}.limit_in_bytes", f"hugetlb.{name}.usage_in_bytes")}
    limit, free, _ = cgroup_limits(proc_self, "hugetlb", files)
    return limit, free
