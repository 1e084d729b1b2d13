"""Where a snapshot lives: a local directory, or a prefix behind an fsspec URL.

A :class:`SnapshotLocation` gives export and import the few file operations they need - write a file,
rename it, list, read it whole or a byte range, remove - for a local path (plain ``os``, no extra
package) and for any fsspec URL (``file://``, ``memory://``, ``s3://``, ``gs://``...; the optional
extra ``shmcache[snapshot]``, and the protocol's own package, e.g. ``shmcache[s3]`` for s3fs).
Errors of the storage become SnapshotError naming the path and the fix.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Any, BinaryIO

from ..base.namespace import user_name
from ..base.urls import mask_url, scrub_secret
from ..errors import InvalidArgument, RangeNotHonored, SnapshotError

__all__ = ["SnapshotLocation", "open_location", "SPACE_ERRNOS", "open_regular", "check_stored", "with_timeouts"]

SPACE_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_WRITE_BUFFER = 8 << 20
# a snapshot's local files are input from a stranger: never follow a link at the name, never block
# on open (a FIFO), and fstat before any read
_READ_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC
_HTTP_PIECE = 1 << 20  # an HTTP body is read this much at a time, never more than the range asked for
_KINDS = {stat.S_IFIFO: "a FIFO", stat.S_IFCHR: "a character device", stat.S_IFBLK: "a block device",
          stat.S_IFSOCK: "a socket"}


def open_regular(path: str | os.PathLike) -> tuple[int, os.stat_result]:
    """A read-only descriptor of the regular file at ``path`` and its fstat: opened with
    O_NOFOLLOW|O_NONBLOCK (a symlink at the name, or a FIFO, never makes a read follow it or
    wait), and checked to be a regular file before anything is read; SnapshotError naming the
    path otherwise. FileNotFoundError passes through (the callers name a missing file)."""
    try:
        fd = os.open(path, _READ_FLAGS)
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        raise SnapshotError(f"{path} is a symbolic link: a snapshot's files are read only as regular files "
                            f"(a link may lead to /dev/zero, a FIFO or another user's file); copy the "
                            f"snapshot with the files themselves (cp -rL)") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(st.st_mode):
            raise SnapshotError(f"{path} is {_KINDS.get(stat.S_IFMT(st.st_mode), 'not a file')}, not a regular "
                                f"file: a snapshot's files are regular files (reading this one could block "
                                f"or never end); copy the snapshot again")
    except BaseException:
        os.close(fd)
        raise
    return fd, st


def check_stored(fd: int, start: int, end: int, where: str) -> None:
    """SnapshotError unless bytes [start, end) of the file at ``fd`` are really stored: a sparse
    file's apparent size is what it claims, and a hole reads as zeros for as long as it says. A
    count read from the file (an index's entries) sizes a read only after this (SEEK_HOLE; a file
    system without it reports no holes, and its blocks are counted instead)."""
    if end <= start:
        return
    try:
        hole = os.lseek(fd, start, os.SEEK_HOLE)
    except OSError as exc:
        if exc.errno != errno.ENXIO:  # ENXIO: start is past the end (a short file: the reader says so)
            hole = end if os.fstat(fd).st_blocks * 512 >= end - start else start
        else:
            return
    if hole < end:
        raise SnapshotError(f"{where} is a sparse file: bytes {hole}..{end} of it, which its index should "
                            f"fill, are a hole (nothing stored, {end - hole} bytes that read as zeros): it is "
                            f"not what `shmcache export` writes (damaged or hostile); copy the snapshot "
                            f"again (with its bytes, not a sparse copy), or export it again")


def _too_large(where: str, size: int, limit: int) -> SnapshotError:
    return SnapshotError(f"{where} is {size} bytes, more than the {limit} such a file may have: it is not "
                         f"what `shmcache export` writes (damaged or hostile); export the snapshot again")


def open_location(where: str | os.PathLike, storage_options: dict | None = None,
                  timeout_s: float | None = None) -> SnapshotLocation:
    """A local path (``/data/snap``, ``./snap``) or an fsspec URL (``s3://bucket/snap``).
    ``timeout_s``: the longest one read of an fsspec store may take (over HTTP and S3 it is then
    cancelled: a TimeoutError, which ``error`` names); None: no bound of shmcache's own."""
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
        fs, path = fsspec.core.url_to_fs(text, **(with_timeouts(text, storage_options, timeout_s) or {}))
    except (ImportError, ValueError) as exc:
        raise SnapshotError(f"cannot open {shown}: {scrub_secret(str(exc), text)}; install the package "
                            f"of its protocol (e.g. pip install 'shmcache[s3]' for s3://)") from None
    except Exception as exc:  # noqa: BLE001 - a backend that connects when made (ftp://, sftp://)
        raise SnapshotError(f"cannot open {shown}: {type(exc).__name__}: {scrub_secret(str(exc), text)}; "
                            f"check the URL, the network and your credentials") from None
    if type(fs).__name__ == "LocalFileSystem":  # file://: the local path, with mmap and fast reads
        return LocalLocation(Path(path))
    loc = FsspecLocation(fs, path.rstrip("/"), shown)
    loc.timeout_s = timeout_s
    return loc


def with_timeouts(url: str, storage_options: dict | None, timeout_s: float | None) -> dict | None:
    """s3fs retries a refused connection for minutes by default: bound it by ``timeout_s``
    (unless the caller configured it, or there is no bound)."""
    opts = dict(storage_options or {})
    if timeout_s is not None and url.startswith(("s3://", "s3a://")) and "config_kwargs" not in opts:
        opts["config_kwargs"] = {"connect_timeout": timeout_s, "read_timeout": timeout_s,
                                 "retries": {"max_attempts": 1}}
    return opts or None


class SnapshotLocation:
    """The operations on a snapshot's files; ``name`` is a file name inside the snapshot."""

    url: str

    def prepare_export(self) -> None:
        """Make the destination ready for an export's files (before anything is listed there)."""
        self.makedirs()

    def close(self) -> None:
        pass

    def where(self, name: str = "") -> str:
        return f"{self.url.rstrip('/')}/{name}" if name else self.url

    def export_left_files(self, first: str) -> bool:
        """Whether an export left data files here (``first``: the first one's name), or its
        temporary files: what to say of a snapshot without a manifest."""
        return any(n.endswith(".tmp") or n.endswith(".shms") for n in self.listdir())

    def error(self, exc: BaseException, what: str, name: str = "") -> SnapshotError:
        where = self.where(name)
        if isinstance(exc, OSError) and exc.errno in SPACE_ERRNOS:
            return SnapshotError(f"no space left to {what} {where} ({exc.strerror}); free space there "
                                 f"or choose another destination")
        if isinstance(exc, FileNotFoundError):
            return SnapshotError(f"cannot {what} {where}: it does not exist; check the path, or copy "
                                 f"the whole snapshot again")
        detail = exc.strerror if isinstance(exc, OSError) and exc.strerror else repr(exc)
        if isinstance(exc, TimeoutError):  # a read's own bound (timeout_s): the transfer is cancelled
            return SnapshotError(f"cannot {what} {where}: {detail}; the server is stalled or too slow: check "
                                 f"it, or give each read more time (timeout_s=, `shmcache import --timeout-s`)")
        return SnapshotError(f"cannot {what} {where}: {detail}; check the path and your access to it")


class LocalLocation(SnapshotLocation):
    def __init__(self, path: Path):
        self.path = path
        self.url = str(path)
        self._dir_fd: int | None = None  # the export's destination, checked (prepare_export)

    def prepare_export(self) -> None:
        """Make the destination directory, or accept an existing one only if it is ours and no one
        else can write to it; from then on every file is made, renamed and removed relative to the
        descriptor of what was checked (NOTE [snapshot format], Writing where no one else reaches).
        The destination is checked, not the parents of its path: a path through another user's
        directory goes where their links point, as ``cp`` does."""
        if self._dir_fd is not None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.mkdir(self.path, 0o755)
            except FileExistsError:
                pass
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileExistsError, NotADirectoryError):  # the path, or one of its parents, is a file
            if self.path.is_symlink():  # O_DIRECTORY|O_NOFOLLOW on a link: ENOTDIR
                raise SnapshotError(f"the export destination {self.path} is a symbolic link: an export never "
                                    f"writes through a link (another user may have planted it to make you "
                                    f"write where they point); pass the real directory") from None
            file = next((p for p in (self.path, *self.path.parents) if p.is_file()), self.path)
            raise SnapshotError(f"{file} is a file, not a directory: a snapshot is a directory of "
                                f"files; pass a new directory (or a URL such as s3://bucket/snap)") from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise SnapshotError(f"the export destination {self.path} is a symbolic link: an export never "
                                    f"writes through a link (another user may have planted it to make you "
                                    f"write where they point); pass the real directory") from None
            raise self.error(exc, "create the directory") from None
        st = os.fstat(fd)
        why = None
        if st.st_uid != os.getuid():
            why = f"belongs to uid {st.st_uid} ({user_name(st.st_uid)}), not to you (uid {os.getuid()})"
        elif st.st_mode & 0o022:
            who = "group and others" if st.st_mode & 0o002 else "its group"
            why = f"is writable by {who} (mode {stat.S_IMODE(st.st_mode):#o})"
        if why is not None:
            os.close(fd)
            raise SnapshotError(
                f"the export destination {self.path} {why}: someone else could plant a symlink at a name "
                f"the export writes (manifest.json.tmp) and make it overwrite a file they cannot write; "
                f"export into a new directory (it is created) or one of your own that only you can write "
                f"(chmod go-w)")
        self._dir_fd = fd

    def close(self) -> None:
        if self._dir_fd is not None:
            os.close(self._dir_fd)
            self._dir_fd = None

    def listdir(self) -> list[str]:
        try:
            if self._dir_fd is not None:
                return sorted(os.listdir(self._dir_fd))
            return sorted(os.listdir(self.path)) if self.path.is_dir() else []
        except OSError as exc:
            raise self.error(exc, "list") from None

    def open_write(self, name: str) -> BinaryIO:
        """A new file ``name`` (O_CREAT|O_EXCL|O_NOFOLLOW: never an existing file, never a link)."""
        self.prepare_export()
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666,
                         dir_fd=self._dir_fd)
        except FileExistsError:
            raise SnapshotError(f"{self.where(name)} appeared while the export ran (someone else made it: "
                                f"an export never writes into a file it did not create); export again into "
                                f"a directory only you can write") from None
        return os.fdopen(fd, "wb", buffering=_WRITE_BUFFER)

    def rename(self, src: str, dst: str) -> None:
        self.prepare_export()
        os.replace(src, dst, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)

    def remove(self, name: str) -> None:
        try:
            if self._dir_fd is not None:
                os.unlink(name, dir_fd=self._dir_fd)
            else:
                os.unlink(self.path / name)
        except FileNotFoundError:
            pass

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole file, which may have at most ``limit`` bytes (else SnapshotError)."""
        fd, st = open_regular(self.path / name)
        try:
            if st.st_size > limit:
                raise _too_large(self.where(name), st.st_size, limit)
            data = os.pread(fd, limit + 1, 0)
            if len(data) > limit:  # it grew since fstat
                raise _too_large(self.where(name), len(data), limit)
            return data
        finally:
            os.close(fd)

    def size(self, name: str) -> int:
        fd, st = open_regular(self.path / name)
        os.close(fd)
        return st.st_size

    def read_range(self, name: str, start: int, end: int, *, stored: bool = False) -> bytes:
        """Bytes [start, end) (fewer at the file's end); ``stored``: SnapshotError unless they are
        all really stored (check_stored), before a byte is read."""
        fd, _ = open_regular(self.path / name)
        try:
            if stored:
                check_stored(fd, start, end, self.where(name))
            return os.pread(fd, end - start, start)
        finally:
            os.close(fd)


class FsspecLocation(SnapshotLocation):
    """A prefix behind an fsspec URL. Over HTTP(S) (aiohttp) and S3 (s3fs) every read is
    shmcache's own streaming ranged GET (_HttpReader, _S3Reader): at most the bytes asked for are
    read, then the response is closed; other backends read through ``cat_file``/``cat_ranges``
    (their servers honour Range: GCS, Azure). ``timeout_s`` (None: none) bounds each call: past
    it an HTTP or S3 transfer is cancelled, its response closed."""

    def __init__(self, fs: Any, path: str, url: str):
        self.fs = fs
        self.path = path
        self.url = url
        self.timeout_s: float | None = None
        self._http = _HttpReader(fs, url) if _is_http(fs) else _S3Reader(fs, url) if _is_s3(fs) else None

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

    def export_left_files(self, first: str) -> bool:
        """Over HTTP and S3 one bounded read of ``first`` (or its temporary file), never a listing:
        fsspec's HTTP ``ls`` downloads and parses the whole page at the URL (a 256 MiB page took
        525 MiB), s3fs's follows every page of keys a server offers."""
        if self._http is None:
            return super().export_left_files(first)
        for name in (first, f"{first}.tmp"):
            try:
                self.read_range(name, 0, 1)
                return True
            except OSError:  # FileNotFoundError among them: not there (or not readable: said as such)
                continue
        return False

    def rename(self, src: str, dst: str) -> None:
        with _as_oserror():
            self.fs.mv(self._p(src), self._p(dst))

    def remove(self, name: str) -> None:
        try:
            with _as_oserror():
                self.fs.rm_file(self._p(name))
        except FileNotFoundError:
            pass

    def read_bytes(self, name: str, limit: int) -> bytes:
        """The whole object, which may have at most ``limit`` bytes (else SnapshotError)."""
        data = self.read_range(name, 0, limit + 1)
        if len(data) > limit:
            raise _too_large(self.where(name), len(data), limit)
        return data

    def size(self, name: str) -> int:
        if self._http is not None:  # a HEAD (HTTP) or HeadObject (S3): bounded like a read
            return self._http.size(self._p(name), self.timeout_s)
        with _as_oserror():
            return int(self.fs.size(self._p(name)))

    def read_range(self, name: str, start: int, end: int, *, stored: bool = False) -> bytes:
        """Bytes [start, end) (fewer at the object's end); what is read is what is stored."""
        if self._http is None:
            with _as_oserror():
                return _at_most(self.fs.cat_file(self._p(name), start=start, end=end), end - start, self.where(name))
        out = self.read_ranges([name], [start], [end])[0]
        if isinstance(out, BaseException):
            raise out
        return out

    def read_ranges(self, names: list[str], starts: list[int], ends: list[int]) -> list:
        """Bytes [start, end) of each named file, each result bytes or the exception that read
        raised (a fault of the whole call raises); none longer than asked for."""
        paths = [self._p(n) for n in names]
        if self._http is not None:
            return self._http.read(paths, starts, ends, self.timeout_s)
        with _as_oserror():
            got = self.fs.cat_ranges(paths, starts, ends, on_error="return")
        out = []
        for one, n, s, e in zip(got, names, starts, ends):
            try:
                out.append(one if isinstance(one, BaseException) else _at_most(one, e - s, self.where(n)))
            except OSError as exc:
                out.append(exc)
        return out


def _at_most(data: bytes, n: int, where: str) -> bytes:
    if len(data) > n:
        raise OSError(errno.EIO, f"{where}: the store sent {len(data)} bytes for a range of {n}")
    return data


def _is_http(fs: Any) -> bool:
    return any(c.__name__ == "HTTPFileSystem" and c.__module__.startswith("fsspec.") for c in type(fs).__mro__)


def _is_s3(fs: Any) -> bool:
    return any(c.__name__ == "S3FileSystem" and c.__module__.startswith("s3fs") for c in type(fs).__mro__) \
        and callable(getattr(fs, "_call_s3", None)) and callable(getattr(fs, "split_path", None))


class _HttpReader:
    """Ranged GETs on fsspec's aiohttp session, each bounded by what it asks for (NOTE [snapshot
    format], Reading over HTTP; _S3Reader: the same over s3fs).

    A request asks for ``Range: bytes=a-b`` and ``Accept-Encoding: identity``. The body is read in
    pieces into one buffer until the range is complete, then the response is closed: an endless
    body costs the range and a piece. An encoded body (``Content-Encoding`` other than identity:
    aiohttp would inflate a gzip bomb) is refused unread. A whole body (200) to a range that does
    not start at 0 means the server ignores Range: refused unread (RangeNotHonored, naming the
    server's behaviour), and every later read of this location too, without a request. Until the
    server has answered one ranged read, a call's ranges go one at a time (a server that ignores
    Range costs one response, never one per data file); then concurrently. Past ``timeout_s`` the
    call is cancelled on the event loop: its responses are closed, nothing keeps downloading."""

    def __init__(self, fs: Any, url: str):
        self.fs, self.url = fs, url
        self.ranges_ok = False  # the server answered a ranged read with 206
        self.refused: str | None = None  # why this server's bodies are not read

    def read(self, paths: list[str], starts: list[int], ends: list[int], timeout_s: float | None) -> list:
        import asyncio

        async def some(at: int) -> list:  # ranges [at:] concurrently
            return await asyncio.gather(*(self._one(*a) for a in zip(paths[at:], starts[at:], ends[at:])),
                                        return_exceptions=True)

        async def run() -> list:
            out: list = []
            while len(out) < len(paths) and not self.ranges_ok:  # one at a time until Range is known
                try:
                    out.append(await self._one(paths[len(out)], starts[len(out)], ends[len(out)]))
                except Exception as exc:  # noqa: BLE001 - per range, as cat_ranges(on_error="return")
                    out.append(exc)
            return out + (await some(len(out)) if len(out) < len(paths) else [])

        got = self._bounded(run, timeout_s)
        # a range's own failure as an OSError too (aiohttp's ClientResponseError is not one)
        return [one if not isinstance(one, BaseException) or isinstance(one, OSError) else
                OSError(0, f"{type(one).__name__}: {scrub_secret(str(one), path)}") for one, path in zip(got, paths)]

    def size(self, path: str, timeout_s: float | None) -> int:
        """The size of the file at ``path``, as the store's metadata says (HEAD), within ``timeout_s``."""
        return int(self._bounded(lambda: self.fs._size(path), timeout_s))

    def _bounded(self, make: Any, timeout_s: float | None) -> Any:
        """``await make()`` on fsspec's event loop, cancelled past ``timeout_s`` (a TimeoutError
        naming the server); a backend's own error as an OSError."""
        import asyncio

        from fsspec.asyn import sync

        async def bounded() -> Any:
            return await (asyncio.wait_for(make(), timeout_s) if timeout_s else make())

        with _as_oserror():
            try:
                return sync(self.fs.loop, bounded)
            except asyncio.TimeoutError:  # (fsspec's FSTimeoutError; not the builtin one before 3.11)
                raise TimeoutError(errno.ETIMEDOUT, f"{self.url} did not answer within {timeout_s} s (the "
                                   f"transfer is cancelled)") from None

    async def _one(self, path: str, start: int, end: int) -> bytes | bytearray:
        if end <= start:
            return b""
        if self.refused is not None:
            raise RangeNotHonored(self.refused)
        kw = dict(self.fs.kwargs)  # the request options of storage_options (auth, headers, ...)
        headers = {k: v for k, v in (kw.pop("headers", None) or {}).items() if k.lower() != "accept-encoding"}
        headers.update({"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"})
        kw.pop("auto_decompress", None)
        session = await self.fs.set_session()
        url = getattr(self.fs, "encode_url", lambda u: u)(path)  # (fsspec before 2023.9 has none)
        async with session.get(url, headers=headers, **kw) as r:
            if r.status == 404:
                raise FileNotFoundError(errno.ENOENT, "not found", mask_url(path))
            if r.status == 416:  # the range starts past the end: the file is shorter than asked
                raise OSError(errno.EINVAL, f"{mask_url(path)}: range {start}-{end} is past its end")
            if r.status >= 400:
                r.raise_for_status()
            # every Content-Encoding the server said, not the first: aiohttp's parser inflates by the
            # last one ("identity" then "gzip" passed a check of headers.get and was inflated)
            coding = ", ".join(c for said in r.headers.getall("Content-Encoding", ()) for c in
                               (part.strip().lower() for part in said.split(",")) if c not in ("", "identity"))
            if coding:
                r.close()
                self.refused = (
                    f"the server at {self.url} sent a snapshot file with Content-Encoding: {coding:.40} "
                    f"although identity was asked for (a compressed body can inflate without bound): "
                    f"serve the snapshot's files as they are (no on-the-fly compression), or copy the "
                    f"snapshot and read the copy")
                raise RangeNotHonored(self.refused)
            if r.status != 206 and start > 0:
                r.close()
                raise self._ignored(r.status, path, start, end)
            if r.status == 206:
                self.ranges_ok = True
            buf = await _read_at_most(r.content.read, end - start)
            if not r.content.at_eof():
                r.close()  # the rest is never read: the connection goes, the transfer stops
        return buf  # not copied into bytes: a range costs its own size once

    def _ignored(self, status: int, path: str, start: int, end: int) -> RangeNotHonored:
        self.refused = (
            f"the server at {self.url} ignores HTTP Range requests (it answered {status} with the "
            f"whole file to a request for bytes {start}-{end - 1} of {mask_url(path)}): a snapshot is "
            f"read in byte ranges, never downloaded whole; serve it with a server that supports "
            f"Range (nginx, Apache, S3, GCS), or copy the snapshot to a local disk and read the copy")
        return RangeNotHonored(self.refused)


class _S3Reader(_HttpReader):
    """Ranged GetObject calls through s3fs, each read in pieces up to the range and then closed,
    as _HttpReader does over HTTP: s3fs's own ``cat_file`` reads a whole response body, so an
    S3 endpoint that ignored Range (or sent without end) cost the whole body in memory (512 MiB
    for a manifest read). aiobotocore never inflates a body (its session does not decompress)."""

    async def _one(self, path: str, start: int, end: int) -> bytes | bytearray:
        if end <= start:
            return b""
        if self.refused is not None:
            raise RangeNotHonored(self.refused)
        bucket, key, version = self.fs.split_path(path)
        resp = await self.fs._call_s3("get_object", Bucket=bucket, Key=key, Range=f"bytes={start}-{end - 1}",
                                      **({"VersionId": version} if version else {}))
        body = resp["Body"]
        try:
            status = resp.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if status != 206 and start > 0:
                raise self._ignored(status, path, start, end)
            if status == 206:
                self.ranges_ok = True
            return await _read_at_most(body.read, end - start)
        finally:
            body.close()  # the rest is never read: the transfer stops


async def _read_at_most(read: Any, want: int) -> bytearray:
    """At most ``want`` bytes of a body, read a piece at a time (never sized by a header)."""
    buf = bytearray()
    while len(buf) < want:
        piece = await read(min(_HTTP_PIECE, want - len(buf)))
        if not piece:
            break
        buf += piece
    return buf


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
