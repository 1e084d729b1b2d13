"""Where a session's shared memory lives, and what backs it: /dev/shm, or a memory filesystem that
the user names (``$SHMCACHE_MEMORY_DIR``, the launcher's ``--memory-dir``, ``memory_dir=``).

Containers give /dev/shm 64 MiB by default and the room elsewhere: a Kubernetes ``emptyDir`` of
``medium: Memory`` or ``HugePages``, Docker's ``--tmpfs``, a tmpfs mounted ``huge=within_size``.
A session made with a memory directory keeps its segments there, as files of a private directory
of this user, ``<dir>/shmcache-<uid>`` (mode 0700); the segment's name is then that file's path
(``namespace.segment_dir``), so whatever holds a name knows where it lives.

The named directory is checked as /dev/shm's names are: never through a symlink (O_NOFOLLOW),
never one that another user could swap our private directory out of (owned by another user,
or writable by others without the sticky bit), and only a memory filesystem (statfs ``f_type``
tmpfs or hugetlbfs): a directory on disk would page to it, and a full disk under ``mmap`` is the
SIGBUS that ``posix_fallocate`` keeps away on tmpfs only.

``backing(directory)`` says what pages back a directory's memory: hugetlbfs's page size; a tmpfs
mounted ``huge=always``/``within_size`` (or shmem_enabled ``force``) is PMD-sized huge pages, one
mounted ``huge=advise`` gets them where a mapping asks (``madvise(MADV_HUGEPAGE)``: ``Segment``),
else base pages (``mmap.PAGESIZE``: 4 KiB on x86-64, often 64 KiB on aarch64).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument, NotOwner
from .cgroups import hugetlb_limit
from .namespace import SHM_ROOT, make_private_dir
from .settings import ENV_MEMORY_DIR

__all__ = ["TMPFS_MAGIC", "HUGETLBFS_MAGIC", "Backing", "backing", "private_dir", "private_path", "pmd_size",
           "meminfo", "mount_fix", "refusal", "space", "shmem_enabled"]

TMPFS_MAGIC = 0x01021994
HUGETLBFS_MAGIC = 0x958458F6
# a few filesystems a directory is commonly on, named in the refusal (statfs(2) magic numbers)
_FS_NAMES = {0xEF53: "ext4", 0x58465342: "xfs", 0x9123683E: "btrfs", 0x794C7630: "overlayfs",
             0x6969: "nfs", 0x65735546: "fuse", 0x01021997: "9p", 0x2FC12FC1: "zfs", 0x5346544E: "ntfs"}
_THP = "/sys/kernel/mm/transparent_hugepage"


def mount_fix(path: str | os.PathLike) -> str:
    """How to give ``path`` a memory filesystem (for the messages)."""
    return (f"mount one there (`mount -t tmpfs -o size=16g,huge=within_size tmpfs {path}`; Docker "
            f"`--tmpfs {path}:size=16g`; Kubernetes an emptyDir of medium: Memory), or name none "
            f"(--memory-dir, memory_dir=, ${ENV_MEMORY_DIR}) to use /dev/shm")


def private_path(directory: str) -> str:
    """Where ``private_dir`` puts this user's segments in memory directory ``directory`` (an
    absolute, normalised path): no check, no mkdir."""
    return os.path.join(directory, f"shmcache-{os.getuid()}")


def private_dir(directory: str | os.PathLike) -> str:
    """The private directory of this user's segments in memory directory ``directory``
    (``<directory>/shmcache-<uid>``, made mode 0700): checked as described above.

    Raises InvalidArgument (missing, not a directory, not a memory filesystem, read-only, not
    writable by you) or NotOwner (a symlink; another user's directory; one others can write into
    without the sticky bit)."""
    path = _checked(directory)
    private = Path(private_path(os.path.normpath(path)))
    if os.path.islink(private):  # even one of ours: it would lead out of the memory filesystem
        raise NotOwner(f"shmcache's directory in the memory directory, {private}, is a symlink (to "
                       f"{os.readlink(private)}); shmcache does not follow one there. Remove it "
                       f"(rm {private}), or {_FIX}")
    try:
        make_private_dir(private, "shmcache's directory in the memory directory", _FIX)
    except NotOwner:
        raise
    except PermissionError:  # a root's mount of mode 0755: not a squat, no room of ours
        raise InvalidArgument(_not_writable(path, private)) from None
    return str(private)


_FIX = f"name another memory directory (${ENV_MEMORY_DIR}, --memory-dir, memory_dir=)"


def _not_writable(path: Path, private: str | os.PathLike) -> str:
    return (f"cannot make shmcache's directory {private}: memory directory {path} is not writable by "
            f"you (uid {os.getuid()}); `chmod 1777 {path}` as its owner (as /dev/shm is; a tmpfs: mount "
            f"it with mode=1777), or {_FIX}")


def refusal(directory: str | os.PathLike) -> str | None:
    """Why ``private_dir`` would refuse ``directory`` (its message), or None: the checks alone,
    nothing made (``shmcache info``)."""
    try:
        path = _checked(directory)
    except (InvalidArgument, NotOwner) as exc:
        return str(exc)
    private = private_path(os.path.normpath(path))
    try:
        st = os.lstat(private)
    except FileNotFoundError:  # made at the first session: one the user may make
        return None if os.access(path, os.W_OK | os.X_OK) else _not_writable(path, private)
    except OSError as exc:
        return f"cannot look at {private}: {exc.strerror}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        return (f"{private} is not a directory of yours (uid {st.st_uid}, mode {st.st_mode:o}): a squat; "
                f"remove it, or name another memory directory")
    return None


def _checked(directory: str | os.PathLike) -> Path:
    """``directory`` as an absolute path, checked (``private_dir``'s refusals, but the private
    directory's own)."""
    path = Path(directory).expanduser().absolute()
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise InvalidArgument(f"memory directory {path} does not exist; {mount_fix(path)}") from None
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR) and os.path.islink(path):
            raise NotOwner(
                f"memory directory {path} is a symlink (to {os.readlink(path)}); shmcache does not follow "
                f"one there (whoever can change it could point your cache's memory elsewhere): name "
                f"the directory itself") from None
        if exc.errno == errno.ENOTDIR:
            raise InvalidArgument(f"memory directory {path} is not a directory; name the directory "
                                  f"a tmpfs or hugetlbfs is mounted on") from None
        raise InvalidArgument(f"cannot open memory directory {path}: {exc.strerror}; name a directory "
                              f"of a tmpfs or hugetlbfs you can write into") from None
    try:
        st = os.fstat(fd)
        magic = _fs_magic(fd)
        read_only = bool(os.fstatvfs(fd).f_flag & os.ST_RDONLY)
    finally:
        os.close(fd)
    if magic not in (TMPFS_MAGIC, HUGETLBFS_MAGIC):
        fs = _FS_NAMES.get(magic, f"filesystem of type {magic:#x}")
        raise InvalidArgument(
            f"memory directory {path} is on {fs}, not in memory (tmpfs or hugetlbfs): segments there "
            f"would be paged to that disk, and a full disk under a mapping kills the process "
            f"(SIGBUS); {mount_fix(path)}")
    if read_only:
        raise InvalidArgument(
            f"memory directory {path} is read-only (its mount is ro: a container's volume mounted :ro?); "
            f"shmcache writes its segments there: mount it read-write (`mount -o remount,rw {path}`), "
            f"or name another (--memory-dir, memory_dir=, ${ENV_MEMORY_DIR}; none: /dev/shm)")
    uid = os.getuid()
    if st.st_uid not in (uid, 0):
        raise NotOwner(
            f"memory directory {path} belongs to uid {st.st_uid}, not to you (uid {uid}) or root: its "
            f"owner could swap your segments' directory; name a directory of your own (or root's)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise NotOwner(
            f"memory directory {path} is writable by others (mode {stat.S_IMODE(st.st_mode):04o}) without "
            f"the sticky bit: anyone could rename your segments' directory away and plant another; "
            f"`chmod +t {path}` (as /dev/shm and /tmp are, 1777; a Kubernetes emptyDir is 0777: do it in "
            f"an initContainer), `chmod go-w {path}`, or name another")
    return path


def _fs_magic(fd: int) -> int:
    """statfs(2)'s ``f_type`` of the filesystem of ``fd`` (Python has statvfs only, which lacks it)."""
    buf = (ctypes.c_long * 32)()  # struct statfs: f_type is its first word, a long
    if _libc().fstatfs(fd, buf) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return buf[0] & 0xFFFFFFFF


_LIBC = None


def _libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


@dataclass(frozen=True)
class Backing:
    """What pages back the memory of a directory's segments."""

    fs: str  # "tmpfs" or "hugetlbfs" (or "unknown": no mount found for it)
    huge: str  # "hugetlbfs", "always", "within_size", "advise", "never" (the mount's huge= in force)
    page_size: int  # the page a mapping there gets: the huge page where the mount gives them

    @property
    def advise(self) -> bool:
        """Huge pages come only where a mapping asks for them (madvise(MADV_HUGEPAGE))."""
        return self.huge == "advise"

    @property
    def unit(self) -> int:
        """What segment sizes are rounded to: hugetlbfs's page (ftruncate refuses other sizes); a
        huge tmpfs's (a huge page is used only where a whole one fits below the file's size)."""
        return self.page_size if self.huge in ("hugetlbfs", "always", "within_size") else mmap.PAGESIZE

    def describe(self) -> str:
        """E.g. ``4 KiB pages (tmpfs huge=never)``, ``2 MiB pages (tmpfs huge=within_size)``."""
        how = "hugetlbfs" if self.huge == "hugetlbfs" else f"{self.fs} huge={self.huge}"
        if self.huge == "advise":
            return f"{_size(mmap.PAGESIZE)} pages, {_size(pmd_size())} where madvised ({how})"
        return f"{_size(self.page_size)} pages ({how})"


_BACKINGS: dict[tuple[str, int], Backing] = {}


def backing(directory: str | None = None) -> Backing:
    """What backs the segments of ``directory`` (None: /dev/shm); looked up once per process."""
    where = directory or SHM_ROOT
    try:
        dev = os.stat(where).st_dev
    except OSError:
        return Backing("unknown", "never", mmap.PAGESIZE)
    key = (where, dev)
    found = _BACKINGS.get(key)
    if found is None:
        found = _BACKINGS[key] = _backing_of(where, dev)
    return found


def _backing_of(where: str, dev: int) -> Backing:
    fs, opts = _mount_of(dev)
    if fs == "hugetlbfs":
        try:
            return Backing(fs, "hugetlbfs", os.statvfs(where).f_bsize)
        except OSError:
            return Backing(fs, "hugetlbfs", pmd_size())
    huge = opts.get("huge", "never")
    forced = shmem_enabled()
    if forced == "force":
        huge = "always"
    elif forced == "deny":
        huge = "never"
    page = pmd_size() if huge in ("always", "within_size") else mmap.PAGESIZE
    return Backing(fs or "unknown", huge, page)


def _mount_of(dev: int) -> tuple[str, dict[str, str]]:
    """``(fstype, superblock options)`` of the mount of device ``dev`` (/proc/self/mountinfo)."""
    want = f"{os.major(dev)}:{os.minor(dev)}"
    found: tuple[str, dict[str, str]] = ("", {})
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields, fs = left.split(), right.split()
                if len(fields) < 5 or len(fs) < 3 or fields[2] != want:
                    continue
                opts = dict(o.partition("=")[::2] for o in fs[2].split(","))
                found = (fs[0], opts)  # the last: a later mount hides an earlier one
    except OSError:
        pass
    return found


def shmem_enabled() -> str:
    """The bracketed choice of shmem_enabled (``force`` and ``deny`` override every tmpfs mount)."""
    try:
        text = Path(_THP, "shmem_enabled").read_text()
    except OSError:
        return "never"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else "never"


def space(directory: str) -> tuple[int, int]:
    """``(total, free)`` bytes of the filesystem of ``directory`` (statvfs). A hugetlbfs has its
    pool of huge pages of its size (nr_hugepages; free: free_hugepages less those promised to a
    mapping already, resv_hugepages), within its size= if it has one and the hugetlb cgroup's
    limit; a tmpfs mounted without a limit (size=0) reports no blocks and holds what memory does
    (MemTotal, MemAvailable)."""
    st = os.statvfs(directory)
    total, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    back = backing(directory)
    if back.huge == "hugetlbfs":
        pool = Path("/sys/kernel/mm/hugepages", f"hugepages-{st.f_bsize >> 10}kB")
        try:
            pages = int((pool / "nr_hugepages").read_text())
            usable = int((pool / "free_hugepages").read_text()) - int((pool / "resv_hugepages").read_text())
        except (OSError, ValueError):
            return total, free
        pool_total, pool_free = pages * st.f_bsize, max(0, usable) * st.f_bsize
        limit, limit_free = hugetlb_limit(st.f_bsize)  # a container's share of the pool (hugepages-2Mi)
        if limit is not None:
            pool_total, pool_free = min(pool_total, limit), min(pool_free, limit_free)
        return (pool_total, pool_free) if total == 0 else (min(total, pool_total), min(free, pool_free))
    if total == 0 and back.fs == "tmpfs":
        memory = meminfo()
        total, free = memory.get("MemTotal", 0), memory.get("MemAvailable", 0)
    return total, free


def meminfo() -> dict[str, int]:
    """/proc/meminfo's fields, in bytes (none where it cannot be read): MemAvailable for the
    automatic cap (base.memory), MemTotal for a tmpfs without a size limit."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                name, _, rest = line.partition(":")
                fields = rest.split()
                if fields and fields[0].isdigit():
                    out[name] = int(fields[0]) * (1024 if fields[1:] == ["kB"] else 1)
    except OSError:
        pass
    return out


def pmd_size() -> int:
    """The size of a PMD huge page: 2 MiB on x86-64 (4 KiB pages), 512 MiB with 64 KiB pages."""
    try:
        return int(Path(_THP, "hpage_pmd_size").read_text())
    except (OSError, ValueError):
        return mmap.PAGESIZE * (mmap.PAGESIZE // 8)  # a page of 8-byte entries, each a page


def _size(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
