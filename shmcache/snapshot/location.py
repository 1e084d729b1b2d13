"""Where a snapshot lives: a local directory, or a prefix behind an fsspec URL.

A :class:`Location` gives export and import the few file operations they need - write a file,
rename it, list, read it whole or a byte range, remove - for a local path (plain ``os``, no extra
package) and for any fsspec URL (``file://``, ``memory://``, ``s3://``, ``gs://``...; the optional
extra ``shmcache[snapshot]``, and the protocol's own package, e.g. ``shmcache[s3]`` for s3fs).
Errors of the storage become SnapshotError naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import InvalidArgument, SnapshotError

__all__ = ["Location", "open_location", "SPACE_ERRNOS", "mask_url", "scrub_secret"]

SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_WRITE_BUFFER = 8 << 20


def open_location(where: str | os.PathLike, storage_options: dict | None = None) -> Location:
    """A local path (``/data/snap``, ``./snap``) or an fsspec URL (``s3://bucket/snap``)."""
    if not isinstance(where, (str, os.PathLike)):
        raise InvalidArgument(f"a snapshot location is a path or a URL, got {type(where).__name__}")
    text = os.fspath(where)
    if not text:
        raise InvalidArgument("a snapshot location is a path or a URL, got an empty string")
    if "://" not in text:
        return LocalLocation(Path(text).expanduser().absolute())
    try:
        import fsspec
    except ImportError:
        raise SnapshotError(f"{text} is a URL, and URLs need fsspec: pip install 'shmcache[snapshot]' "
                            f"(and the protocol's package, e.g. 'shmcache[s3]' for s3://)") from None
    shown = mask_url(text)
    try:
        fs, path = fsspec.core.url_to_fs(text, **(storage_options or {}))
    except (ImportError, ValueError) as exc:
        raise SnapshotError(f"cannot open {shown}: {scrub_secret(str(exc), text)}; install the package "
                            f"of its protocol (e.g. pip install 'shmcache[s3]' for s3://)") from None
    except Exception as exc:  # noqa: BLE001 - a backend that connects when made (ftp://, sftp://)
        raise SnapshotError(f"cannot open {shown}: {type(exc).__name__}: {scrub_secret(str(exc), text)}; "
                            f"check the URL, the network and your credentials") from None
    if type(fs).__name__ == "LocalFileSystem":  # file://: the local path, with mmap and fast reads
        return LocalLocation(Path(path))
    return FsspecLocation(fs, path.rstrip("/"), shown)


def mask_url(text: str) -> str:
    """``text`` with the password of its user part as ``***`` (https://user:TOKEN@host/snap,
    ftp://user:PW@host/snap): what every message, stat and repr shows of a snapshot's URL. The
    user part is the authority (up to the first '/', '?' or '#') up to its last '@', as RFC 3986
    and the backends read it; one with no ':' may be a token, and is masked whole."""
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    end = min((i for i in (rest.find(c) for c in "/?#") if i >= 0), default=len(rest))
    userinfo, at, host = rest[:end].rpartition("@")
    if not at:
        return text
    user, colon, _ = userinfo.partition(":")
    return f"{scheme}://{user + ':***' if colon else '***'}@{host}{rest[end:]}"


def scrub_secret(message: str, url: str) -> str:
    """A backend's message with the URL's password (and the URL itself) masked."""
    message = message.replace(url, mask_url(url))
    userinfo = url.partition("://")[2].split("/", 1)[0].rpartition("@")[0]
    secret = userinfo.partition(":")[2] or userinfo
    return message.replace(secret, "***") if len(secret) >= 3 else message


class Location:
    """The operations on a snapshot's files; ``name`` is a file name inside the snapshot."""

    url: str

    def where(self, name: str = "") -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def error(self, exc: BaseException, what: str, name: str = "") -> SnapshotError:
        where = self.where(name)
        if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
            return SnapshotError(f"no space left to {what} {where} ({exc.strerror}); free space there "
                                 f"or choose another destination")
        if isinstance(exc, FileNotFoundError):
            return SnapshotError(f"cannot {what} {where}: it does not exist; check the path, or copy "
                                 f"the whole snapshot again")
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
        return SnapshotError(f"cannot {what} {where}: {detail}; check the path and your access to it")


class LocalLocation(Location):
    def __init__(self, path: Path):
        self.path = path
        self.url = str(path)

    def makedirs(self) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # the path, or one of its parents, is a file
            file = next((p for p in (self.path, *self.path.parents) if p.is_file()), self.path)
            raise SnapshotError(f"{file} is a file, not a directory: a snapshot is a directory of "
                                f"files; pass a new directory (or a URL such as s3://bucket/snap)") from None
        except OSError as exc:
            raise self.error(exc, "create the directory") from None

    def listdir(self) -> list[str]:
        try:
            return sorted(os.listdir(self.path)) if self.path.is_dir() else []
        except OSError as exc:
            raise self.error(exc, "list") from None

    def open_write(self, name: str) -> BinaryIO:
        return open(self.path / name, "wb", buffering=_WRITE_BUFFER)  # noqa: SIM115 - the caller closes

    def rename(self, src: str, dst: str) -> None:
        os.replace(self.path / src, self.path / dst)

    def remove(self, name: str) -> None:
        try:
            os.unlink(self.path / name)
        except FileNotFoundError:
            pass

    def read_bytes(self, name: str) -> bytes:
        with open(self.path / name, "rb") as f:
            return f.read()

    def size(self, name: str) -> int:
        return os.stat(self.path / name).st_size

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with open(self.path / name, "rb", buffering=0) as f:
            return os.pread(f.fileno(), end - start, start)


class FsspecLocation(Location):
    def __init__(self, fs: Any, path: str, url: str):
        self.fs = fs
        self.path = path
        self.url = url

    def _p(self, name: str) -> str:
        return f"{self.path}/{name}" if name else self.path

    def makedirs(self) -> None:
        try:
            with _as_oserror():
                self.fs.makedirs(self.path, exist_ok=True)
        except OSError as exc:
            raise self.error(exc, "create the directory") from None

    def listdir(self) -> list[str]:
        try:
            with _as_oserror():
                self.fs.invalidate_cache(self.path)  # another writer (or our own rm) changed it
                names = self.fs.ls(self.path, detail=False)
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise self.error(exc, "list") from None
        return sorted(n.rstrip("/").rsplit("/", 1)[-1] for n in names)

    def open_write(self, name: str) -> BinaryIO:
        with _as_oserror():
            return self.fs.open(self._p(name), "wb")

    def rename(self, src: str, dst: str) -> None:
        with _as_oserror():
            self.fs.mv(self._p(src), self._p(dst))

    def remove(self, name: str) -> None:
        try:
            with _as_oserror():
                self.fs.rm_file(self._p(name))
        except FileNotFoundError:
            pass

    def read_bytes(self, name: str) -> bytes:
        with _as_oserror():
            return self.fs.cat_file(self._p(name))

    def size(self, name: str) -> int:
        with _as_oserror():
            return int(self.fs.size(self._p(name)))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        with _as_oserror():
            return self.fs.cat_file(self._p(name), start=start, end=end)


@contextlib.contextmanager
def _as_oserror():
    """An fsspec backend's own error (botocore's NoCredentialsError, ClientError, ...) as an
    OSError, which every caller turns into a SnapshotError naming the file and the fix: they are
    not OSErrors, and escaped raw (the commonest S3 mistake, no credentials, among them)."""
    try:
        yield
    except OSError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the backend raises for a failed call
        raise OSError(0, f"{type(exc).__name__}: {exc}") from exc
