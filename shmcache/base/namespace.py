"""Where shmcache keeps its objects, how names are checked, and which directories are private.

Every name of a shared-memory object comes from :func:`segment_name`, so the CLI can list them and
tests can check for leaks. One environment variable, ``SHMCACHE_DIR``, moves the whole namespace:
the registry directory, the lock files and the prefix of every segment name. Parallel test runs and
parallel jobs therefore never collide (mosaicml/streaming#884).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import pwd
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidArgument, NotOwner
from . import ahead, settings
from .settings import ENV_DIR, ENV_SESSION, ENV_SIZE_MB, ENV_SPILL_DIR, ENV_SPILLING

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
    "SHM_ROOT",
    "make_private_dir",
    "squatter_error",
    "segment_dir",
    "segment_path",
    "user_name",
]

SHM_ROOT = "/dev/shm"
SEP = "+"  # joins the parts of segment names: a character session and cache names cannot contain



def segment_dir(name: str) -> str | None:
    """The directory segment ``name`` (or a prefix of names) lives in: None for a POSIX
    shared-memory name (``/shmcache-...``: /dev/shm, through shm_open), else the private
    directory that a session's memory directory names (``<dir>/shmcache-...``: ``memdir.private_dir``).
    Session and cache names cannot hold a '/', so the last one ends the directory."""
    return name.rpartition("/")[0] or None


def segment_path(name: str) -> str:
    """The file behind segment ``name`` (/dev/shm's for a POSIX name)."""
    return name if segment_dir(name) else os.path.join(SHM_ROOT, name.lstrip("/"))


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
        env = settings.get(ENV_SESSION)
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
        return Path(segment_path(name))

    def owned_segments(self, directory: str | None = None) -> list[str]:
        """Names of every shared-memory object of this namespace that exists now, in /dev/shm
        (``directory`` None) or in a session's private memory directory (segment_dir).

        Only regular files of our uid: a name is a claim anyone can make in /dev/shm (1777), so
        another user's file, FIFO or symlink that squats our prefix is never listed - hence never
        unlinked by gc, destroy or clear, which root could otherwise do to anyone's file.
        """
        where = directory or SHM_ROOT
        try:
            entries = os.listdir(where)
        except (FileNotFoundError, NotADirectoryError):
            return []
        head, lead = self.prefix + SEP, (directory or "") + "/"
        return sorted(lead + e for e in entries if e.startswith(head) and _ours(os.path.join(where, e)))

    def occupied_bytes(self, prefix: str) -> int:
        """Bytes of shared memory that the segments whose names start with ``prefix`` really
        occupy (allocated pages: sparse segments count what was committed, not their size)."""
        total = 0
        for name in self.owned_segments(segment_dir(prefix)):
            if name.startswith(prefix):
                try:
                    total += os.stat(self.shm_path(name)).st_blocks * 512
                except FileNotFoundError:  # removed meanwhile (a clear(), a destroy)
                    pass
        return total

    def unlink_segment(self, name: str) -> bool:
        """Unlink segment ``name`` if it is a file of ours; True if it was removed.

        The owner is checked with lstat first: /dev/shm is sticky, so once a file is ours nobody
        else can replace it before the unlink. The pages it backed ahead are let go (ahead.release)."""
        path = self.shm_path(name)
        if not _ours(path):
            return False
        try:
            os.unlink(path)
        except FileNotFoundError:
            return False
        except OSError as exc:  # a mount remounted read-only since (EROFS), an immutable file: kept,
            if exc.errno not in (errno.EROFS, errno.EPERM, errno.EACCES):  # the rest of a gc goes on
                raise
            _say_kept(path, exc)
            return False
        ahead.release()  # its mapping would keep the file's pages after the unlink
        return True

    @property
    def sessions_dir(self) -> Path:
        return self.root / "sessions"


_KEPT_SAID: set[str] = set()  # directories whose segments could not be removed, said once each


def _say_kept(path: Path, exc: OSError) -> None:
    """Say once per directory that a segment there could not be removed, and what to do."""
    where = str(path.parent)
    if where in _KEPT_SAID:
        return
    _KEPT_SAID.add(where)
    how = (f"make its filesystem writable again (`mount -o remount,rw` on its mount: `findmnt -T {where}` "
           f"names it)" if exc.errno == errno.EROFS
           else f"check its permissions and attributes (`lsattr {path}`)")
    logging.getLogger("shmcache").warning(
        "cannot remove shared-memory segment %s: %s; its memory stays taken until it is removed: %s, "
        "then run `shmcache gc`", path, "read-only file system" if exc.errno == errno.EROFS else exc.strerror, how)


def _ours(path: str | os.PathLike) -> bool:
    """A regular file of our uid (lstat: a symlink is never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid()


def squatter_error(path: str | os.PathLike, st: os.stat_result) -> NotOwner:
    """The error for a name of ours in /dev/shm that holds another user's file, FIFO or symlink."""
    kind = ("symlink" if stat.S_ISLNK(st.st_mode) else "FIFO" if stat.S_ISFIFO(st.st_mode)
            else "file" if stat.S_ISREG(st.st_mode) else "special file")
    return NotOwner(
        f"the shared-memory name {path} is taken by a {kind} of uid {st.st_uid} ({user_name(st.st_uid)}), "
        f"not by a segment shmcache made for you (uid {os.getuid()}): another user squats it - an "
        f"attack or a leftover of theirs; shmcache does not use, follow or remove it. Remove it "
        f"(as root, after checking it: rm {path}), or use another namespace: set ${ENV_DIR} to a "
        f"directory you own"
    )


def _default_root() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime) and os.access(runtime, os.W_OK):
        return Path(runtime) / "shmcache"
    return Path("/tmp") / f"shmcache-{os.getuid()}"


def namespace(root: str | os.PathLike | None = None, *, create: bool = True) -> Namespace:
    """The namespace at ``root``, else the one in force now (``$SHMCACHE_DIR`` or a per-user
    default); its directory is created mode 0700 (``create=False``, for a read-only look: left
    missing if it is, checked if it is there)."""
    from_env = root is None
    raw = root if root is not None else settings.get(ENV_DIR)
    root = Path(raw).expanduser() if raw else _default_root()
    if from_env and raw and not root.is_absolute():
        # each process would take it from its own working directory: a warm-up script started in
        # one directory and a training script in another would each have a namespace of its own
        raise InvalidArgument(f"${ENV_DIR}={raw} is a relative path, which each process would take from its "
                              f"own working directory (another namespace, other caches); give an absolute "
                              f"one, e.g. ${ENV_DIR}={Path(raw).expanduser().absolute()}")
    root = root.absolute()
    if create or os.path.lexists(root):
        _ensure_private_dir(root)
    digest = hashlib.blake2b(str(root.resolve()).encode(), digest_size=4).hexdigest()
    return Namespace(root=root, prefix=f"shmcache-{os.getuid()}-{digest}")


def _ensure_private_dir(path: Path) -> None:
    fix = f"set ${ENV_DIR} (or $XDG_RUNTIME_DIR) to a directory you own"
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)  # the user's own path: as given
        make_private_dir(path, "the shmcache directory", fix)
    except NotADirectoryError:
        raise InvalidArgument(f"${ENV_DIR}={path} is not a directory; point it at a directory "
                              f"(it is created if missing)") from None
    except NotOwner:
        raise
    except PermissionError as exc:
        raise NotOwner(f"cannot create the shmcache directory {path}: {exc.strerror}; {fix}") from None
    except OSError as exc:  # a parent that is a file, a read-only or pseudo filesystem (/proc)
        raise InvalidArgument(
            f"cannot create the shmcache directory {path} (${ENV_DIR}): {exc.strerror}; "
            f"point ${ENV_DIR} at a writable directory of your own"
        ) from None


def make_private_dir(path: Path, what: str, fix: str) -> None:
    """Create ``path`` mode 0700, or accept it if it already is a directory of ours; never follow
    a symlink there, never chmod by path.

    Why so careful: the path is predictable (``/tmp/shmcache-0``, ``<spill_dir>/<prefix>+s+c``)
    and its parent may be shared (sticky /tmp, a 1777 scratch disk). Another user can plant a
    symlink there before we come, so that root chmods /tmp to 0700 and writes into it. mkdir never
    follows a symlink; an existing entry is opened with O_NOFOLLOW (only a symlink that our own uid
    made is followed) and judged by fstat of what was opened, and a mode that is too open is fixed
    with fchmod on that descriptor. Once verified, the directory is ours in a sticky parent, so
    nobody else can rename or replace it.

    Raises NotOwner (a symlink, or a directory of another user: named as a likely attack, with
    ``fix``), NotADirectoryError (something else is there), or the OSError of mkdir.
    """
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        if not _own_symlink(path):
            raise _not_a_dir(path, what, fix) from None
        fd = os.open(path, flags)  # a symlink of our own making (`ln -s /scratch/me ~/ns`): followed
    try:
        st = os.fstat(fd)
        if st.st_uid != os.getuid():
            raise NotOwner(
                f"{what} {path} belongs to uid {st.st_uid} ({user_name(st.st_uid)}), not to you (uid "
                f"{os.getuid()}): another user made it - a squat or an attack; shmcache does not use, "
                f"chmod or remove it. Remove it (as root, after checking it), or {fix}"
            )
        if st.st_mode & 0o077:
            os.fchmod(fd, 0o700)  # the descriptor we checked, not a path that could be swapped
    finally:
        os.close(fd)


def _own_symlink(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISLNK(st.st_mode) and st.st_uid == os.getuid()


def _not_a_dir(path: Path, what: str, fix: str) -> OSError:
    """The error for something at ``path`` that is not a directory (lstat: never followed)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:  # gone meanwhile: say what we were told
        return NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.readlink(path)
        except OSError:
            target = "?"
        return NotOwner(
            f"{what} {path} is a symlink (to {target}, made by uid {st.st_uid} ({user_name(st.st_uid)})); "
            f"shmcache never follows a symlink it did not make: one planted there is an attack to "
            f"make shmcache chmod or write into its target. Remove it (rm {path}), or {fix}"
        )
    if st.st_uid != os.getuid():
        return NotOwner(
            f"{what} {path} is not a directory but a file of uid {st.st_uid} ({user_name(st.st_uid)}): "
            f"another user put it there (a squat or an attack). Remove it (as root), or {fix}"
        )
    return NotADirectoryError(errno.ENOTDIR, "not a directory", str(path))


def user_name(uid: int) -> str:
    """The login name of ``uid``, for messages (or "no such user")."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"
