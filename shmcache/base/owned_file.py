"""A small file of this user's beside a cache (its claims, its counters): opened never through a
symlink, refused unless it is a regular file this user owns, grown to the size its readers map."""

from __future__ import annotations

import os
import stat
from pathlib import Path

__all__ = ["open_owned"]


def open_owned(path: str | os.PathLike, nbytes: int) -> int:
    """A descriptor (the caller closes it) of the file at ``path``, made 0600 if missing, at least
    ``nbytes`` long. PermissionError for anything else at that name (a link, a FIFO, another
    user's file): the directories these files live in are the user's own, so that is tampering."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise PermissionError(f"{Path(path)} is not a regular file of this user")
        if st.st_size < nbytes:
            os.ftruncate(fd, nbytes)  # two makers at once truncate to one size: harmless
    except BaseException:
        os.close(fd)
        raise
    return fd
