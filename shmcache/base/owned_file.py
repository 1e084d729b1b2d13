"""A small file of this user's beside a cache (its claims, its counters): opened never through a
symlink, refused unless it is a regular file this user owns, grown to the size its readers map."""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

__all__ = ["grow", "open_owned", "read_owned"]


def open_owned(path: str | os.PathLike, nbytes: int) -> int:
    """A descriptor (the caller closes it) of the file at ``path``, made 0600 if missing, at least
    ``nbytes`` long, those bytes backed (``grow``). PermissionError for anything else at that name
    (a link, a FIFO, another user's file): the directories these files live in are the user's own,
    so that is tampering. OSError (ENOSPC) when the file system has no room for them."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{Path(path)} is not a regular file of this user")
        grow(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        raise
    return fd


def grow(fd: int, offset: int, nbytes: int) -> None:
    """Back ``[offset, offset + nbytes)`` of the file with blocks, growing it to reach that far and
    never shrinking it: another process may have grown it further and mapped what lies past (an
    ftruncate to the size this one found short cut that mapping off: SIGBUS there). Backed, not a
    hole: a store through a mapping into a hole of a full file system is a SIGBUS too; here it is
    an OSError (ENOSPC) before anything is mapped."""
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
        # a file system without fallocate (glibc's emulation refused): grow it as before
        if os.fstat(fd).st_size < offset + nbytes:
            os.ftruncate(fd, offset + nbytes)


def read_owned(path: str | os.PathLike, nbytes: int) -> bytes | None:
    """At most ``nbytes`` of the file at ``path`` that ``open_owned`` would open, for a reader that
    must not make it; None when there is none, or something else is at that name: a FIFO (a plain
    open would wait for a writer forever), a link (never followed), another user's file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # a link at that name: not ours to follow
            return None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return None
        return os.pread(fd, nbytes, 0)
    finally:
        os.close(fd)
