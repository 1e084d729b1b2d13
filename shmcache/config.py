"""Where shmcache keeps its objects, how names are checked, and how much memory there really is.

Every name of a shared-memory object comes from :func:`segment_name`, so the CLI can list them and
tests can check for leaks. One environment variable, ``SHMCACHE_DIR``, moves the whole namespace:
the registry directory, the lock files and the prefix of every segment name. Parallel test runs and
parallel jobs therefore never collide (mosaicml/streaming#884).
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import InvalidArgument, NotOwner

__all__ = [
    "ENV_DIR",
    "ENV_SESSION",
    "ENV_SPILL_DIR",
    "ENV_SIZE_MB",
    "ENV_SPILLING",
    "Namespace",
    "namespace",
    "validate_name",
    "resolve_session_name",
    "MemoryLimits",
    "memory_limits",
    "SHM_ROOT",
]

ENV_DIR = "SHMCACHE_DIR"
ENV_SESSION = "SHMCACHE_SESSION"
ENV_SPILL_DIR = "SHMCACHE_SPILL_DIR"
ENV_SIZE_MB = "SHMCACHE_SIZE_MB"  # default size= of caches (the launcher's --size)
ENV_SPILLING = "SHMCACHE_SPILLING"  # "1": default spilling=True (the launcher's --spilling)
SHM_ROOT = "/dev/shm"
SEP = "+"  # joins the parts of segment names: a character session and cache names cannot contain

_NAME_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def validate_name(value: object, what: str = "session") -> str:
    """Return ``value`` if it is a valid session or cache name, else raise naming the rule."""
    if not isinstance(value, str):
        raise InvalidArgument(
            f"{what} name must be a str, got {type(value).__name__} {value!r}; "
            f"use 1-64 characters from A-Z a-z 0-9 _ . -"
        )
    if not _NAME_RE.fullmatch(value) or value.startswith((".", "-")):
        raise InvalidArgument(
            f"invalid {what} name {value!r}: use 1-64 characters from A-Z a-z 0-9 _ . - "
            f"(no '/', no spaces, not starting with '.' or '-')"
        )
    return value


def resolve_session_name(session: object) -> str:
    """``"auto"`` means ``$SHMCACHE_SESSION`` if set (the launcher sets it), else ``"default"``."""
    if session is None or session == "auto":
        env = os.environ.get(ENV_SESSION)
        if env:
            return validate_name(env, f"session (from ${ENV_SESSION})")
        return "default"
    return validate_name(session, "session")


@dataclass(frozen=True)
class Namespace:
    """One user's (or one test's) private world: a registry directory and a segment-name prefix."""

    root: Path
    prefix: str

    def segment_name(self, *parts: str) -> str:
        """The posix_ipc name ('/...') of a shared-memory object; ``parts`` are validated names.

        Parts are joined with '+', a character session and cache names cannot contain, so the
        prefix of one session never matches another's ('a' vs 'a-b').
        """
        return "/" + SEP.join((self.prefix, *parts))

    def shm_path(self, name: str) -> Path:
        return Path(SHM_ROOT) / name.lstrip("/")

    def owned_segments(self) -> list[str]:
        """Names of every shared-memory object of this namespace that exists now."""
        try:
            entries = os.listdir(SHM_ROOT)
        except FileNotFoundError:
            return []
        head = self.prefix + SEP
        return sorted("/" + e for e in entries if e.startswith(head))

    @property
    def sessions_dir(self) -> Path:
        return self.root / "sessions"


def _default_root() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "shmcache"
    return Path("/tmp") / f"shmcache-{os.getuid()}"


def namespace(root: str | os.PathLike | None = None) -> Namespace:
    """The namespace at ``root``, else the one in force now (``$SHMCACHE_DIR`` or a per-user
    default); its directory is created mode 0700."""
    raw = root if root is not None else os.environ.get(ENV_DIR)
    root = Path(raw).expanduser() if raw else _default_root()
    root = root.absolute()
    _ensure_private_dir(root)
    digest = hashlib.blake2b(str(root.resolve()).encode(), digest_size=4).hexdigest()
    return Namespace(root=root, prefix=f"shmcache-{os.getuid()}-{digest}")


def _ensure_private_dir(path: Path) -> None:
    if path.exists() and not path.is_dir():
        raise InvalidArgument(f"${ENV_DIR}={path} is not a directory; point it at a directory "
                              f"(it is created if missing)")
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
    except PermissionError as exc:
        raise NotOwner(
            f"cannot create the shmcache directory {path}: {exc.strerror}; "
            f"set ${ENV_DIR} to a directory you own"
        ) from None
    except OSError as exc:  # a parent that is a file, a read-only or pseudo filesystem (/proc)
        raise InvalidArgument(
            f"cannot create the shmcache directory {path} (${ENV_DIR}): {exc.strerror}; "
            f"point ${ENV_DIR} at a writable directory of your own"
        ) from None
    st = path.stat()
    if not stat.S_ISDIR(st.st_mode):
        raise InvalidArgument(f"${ENV_DIR}={path} is not a directory; point it at a directory")
    if st.st_uid != os.getuid():
        raise NotOwner(
            f"the shmcache directory {path} belongs to uid {st.st_uid}, not to you (uid "
            f"{os.getuid()}); set ${ENV_DIR} to a directory you own"
        )
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)


# --- memory -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MemoryLimits:
    """What limits the cache's memory, in bytes (None where that limit does not apply)."""

    mem_available: int | None
    cgroup_limit: int | None
    cgroup_free: int | None
    shm_total: int | None
    shm_free: int | None
    cgroup_file: str | None = None  # the file the binding cgroup limit was read from

    @property
    def available(self) -> int:
        """The smallest of the limits that apply: what the cache can really use."""
        known = [v for v in (self.mem_available, self.cgroup_free, self.shm_free) if v is not None]
        return max(0, min(known)) if known else 0

    def auto_capacity(self) -> int:
        """``size=0``: 80% of what is really available (DESIGN.md section 4)."""
        return int(self.available * 0.8)


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


def memory_limits(proc_self: str = "/proc/self") -> MemoryLimits:
    limit, free, source = _cgroup_limits(proc_self)
    try:
        st = os.statvfs(SHM_ROOT)
        shm_total, shm_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        shm_total = shm_free = None
    return MemoryLimits(_mem_available(), limit, free, shm_total, shm_free, source)
