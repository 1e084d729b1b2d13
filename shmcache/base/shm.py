"""Shared-memory segments: posix_ipc objects in ``/dev/shm``, mapped with mmap.

NOTE [segment lifecycle]
    * Create: ``O_CREAT|O_EXCL`` with size 0 (posix_ipc truncates - and on failure unlinks - when
      given a size, even for an attacher), ``fchmod`` to 0600 (posix_ipc's mode is subject to the
      umask), ``ftruncate`` to the full virtual size (sparse: costs nothing), then
      ``posix_fallocate`` of every byte range *before* anything touches it. On a full tmpfs,
      ``ftruncate`` + ``mmap`` succeed and the first write kills the process with SIGBUS;
      ``posix_fallocate`` raises ENOSPC instead (PyTorch #5040, #108861). The header's ready word
      is written last.
    * Attach: open with size 0 and check the header (magic, version, size, ready); never
      truncate, resize or unlink what another process created.
    * Unlink: only after checking that the name still refers to the inode we mapped: a name can
      be recreated while old mappings live on, and unlinking the new one would split processes
      between two different segments.
    Creation and unlinking of a cache's segments happen under that cache's lock, so an attacher
    never sees a half-made segment unless its creator died - which the ready word tells.
    A session with a memory directory (``memdir``) keeps its segments as files of its private
    directory there, the name being the path: the same steps, with ``open(O_CREAT|O_EXCL|O_NOFOLLOW)``
    for shm_open; sizes are rounded to the mount's unit (a huge page on hugetlbfs and a huge tmpfs),
    and a mapping where huge pages come only when asked (``huge=advise``) asks (MADV_HUGEPAGE).
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import operator
import os
import platform
import stat
import struct
from collections.abc import Iterator

import posix_ipc

from ..errors import CorruptSegment, NotOwner, SharedMemoryFull
from . import ahead, memdir, ordering, rowcopy
from .namespace import segment_dir, segment_path, squatter_error

__all__ = ["Segment", "HEADER_BYTES", "PAGE", "WORD", "word_view"]

WORD = struct.Struct("Q")  # one aligned 8-byte word of a segment (every shared word is one)

MAGIC = 0x31484341434D4853  # b"SHMCACH1" little-endian
VERSION = 1
HEADER_BYTES = 64
PAGE = mmap.PAGESIZE
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 16
_NBYTES = operator.attrgetter("nbytes")
# mmap(2)'s MAP_NORESERVE (Python 3.11 lacks the name): 0x4000 in asm-generic, x86-64 and aarch64;
# other architectures number it otherwise (ppc64, mips, sparc), and go without it
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if platform.machine() in ("x86_64", "aarch64") else 0)


def _byte_views(buffers) -> list[memoryview]:
    """``buffers`` as non-empty byte memoryviews (write_at's slow paths). The empty ones are left
    out before the cast: memoryview casts no view with a 0 in its shape (np.zeros((0, 3)))."""
    return [v.cast("B") for v in map(memoryview, buffers) if v.nbytes]


# magic u64, version u32, kind u32, size u64, ready u64 (native order: 8-byte aligned stores)
_HEADER = struct.Struct("QIIQQ")
_READY = 0x5245414459  # "READY"


def word_view(buf) -> memoryview:
    """``buf`` as native 8-byte words: ``view[offset >> 3] = value`` is ONE aligned 8-byte store.

    Every word that another process reads without a lock (the root's epoch word, a meta segment's
    counts, a class's bump and committed count, an index entry's words) is written through such a
    view, never with ``struct.pack_into``: CPython's pack_into first zeroes its whole destination
    (a memset in _struct.c) and then stores the value, so a lock-free reader in another process
    can see a transient 0 - an epoch of no generation, "0 layouts", "75 chunks handed out of 0
    committed" - where NOTE [publish order] relies on one store (seen here: ~1 read in 3,000 of a
    word rewritten in a loop; 0 with this view)."""
    return memoryview(buf).cast("Q")


def _shm_hint(directory: str | None = None) -> str:
    root = directory or "/dev/shm"
    try:
        total, free = memdir.space(root)  # a hugetlbfs's pool, a tmpfs without a limit: memory's
        where = f"{root} has {free / 2**20:.0f} MiB free of {total / 2**20:.0f} MiB"
    except OSError:
        where = f"{root} is not available"
    grow = "in Docker raise --shm-size" if directory is None else "give that mount a larger size="
    return (f"{where}; free space there (`shmcache gc`, `shmcache destroy`), give the cache a smaller "
            f"size=, or {grow}")


class Segment:
    """One mapped shared-memory object. ``buf`` is the writable mmap of the whole segment.

    The mapping is never unmapped explicitly: another thread of the process may be reading it
    (through ``buf`` or an array over it) while this one moves on to a new generation. It goes
    when the last reference to it does. The descriptor is closed as soon as the mapping exists
    (mmap keeps a duplicate of its own): ``commit`` reopens the object by name when it needs one.
    """

    def __init__(self, name: str, fd: int, size: int, kind: int):
        ordering.register()  # before this process reads any mapping: NOTE [publish order]
        self.name = name
        self.size = size
        self.kind = kind
        self._inode = os.fstat(fd).st_ino
        back = memdir.backing(segment_dir(name))
        # a shared mapping of a hugetlbfs file reserves huge pages for ALL of it at mmap (its
        # sparse virtual size: a cap, or the whole pool); never asked for: each range is backed
        # by posix_fallocate before anything touches it, which says ENOSPC when the pool is short
        flags = mmap.MAP_SHARED | (_MAP_NORESERVE if back.fs == "hugetlbfs" else 0)
        self.buf = mmap.mmap(fd, size, flags=flags)
        if back.advise and size >= memdir.pmd_size():  # huge pages where the mount gives them when asked
            try:
                self.buf.madvise(mmap.MADV_HUGEPAGE)
            except (AttributeError, OSError):  # no THP in this kernel: base pages, as without
                pass
        self.words = word_view(self.buf)  # single-store writes of shared words (see word_view)
        # hugetlbfs takes no write(2): write_at copies through the mapping there (and wherever
        # a pwritev is refused as unsupported)
        self._no_pwrite = back.fs == "hugetlbfs"
        # a first store through this mapping faults on each base page, unless the mount gives it
        # huge pages (hugetlbfs, a tmpfs huge=always/within_size): one fault a huge page there, so
        # a write_at saves a writer nothing there (a record put on its own: CacheWriter._insert)
        self.base_pages = back.page_size <= PAGE
        self._ahead: tuple[int, int, int] | None = None  # commit_ahead's last range and request
        self._mapped: tuple[int, int, int] | None = None  # the last such range a commit used: write_at's
        self._ahead_pause = 0  # commit_ahead's calls left to skip: its last range went unused

    # --- creation and attachment -----------------------------------------------------------

    @classmethod
    def create(cls, name: str, size: int, *, kind: int = 0, commit: int = HEADER_BYTES) -> Segment:
        """Create ``name`` with a virtual ``size``; commit its first ``commit`` bytes."""
        directory = segment_dir(name)
        if directory is not None:
            return cls._create_file(name, directory, size, kind, commit)
        size = _round_up(max(size, HEADER_BYTES), PAGE)
        try:
            shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=0)
        except posix_ipc.ExistentialError:
            raise _taken(name) from None
        except OSError as exc:
            raise _no_file(exc, name) from None
        try:
            os.fchmod(shm.fd, 0o600)
            os.ftruncate(shm.fd, size)
            _fallocate(shm.fd, 0, _round_up(max(commit, HEADER_BYTES), PAGE), name)
            seg = cls(name, shm.fd, size, kind)
        except OSError as exc:
            shm.unlink()  # ours: created exclusively just above
            if exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):  # address space, descriptors
                raise SharedMemoryFull(f"cannot map segment {name} of {size / 2**30:.1f} GiB: "
                                       f"{exc.strerror}; give the cache a smaller size=") from None
            raise
        except BaseException:
            shm.unlink()
            raise
        finally:
            shm.close_fd()
        return seg._publish(kind, size)

    @classmethod
    def _create_file(cls, name: str, directory: str, size: int, kind: int, commit: int) -> Segment:
        """``create`` in a memory directory: the same steps on a file of its private directory."""
        unit = memdir.backing(directory).unit
        if size < unit and memdir.backing(directory).huge != "hugetlbfs":
            unit = PAGE  # a small segment (a root, a meta) on a huge tmpfs: base pages, not a huge one
        size = _round_up(max(size, HEADER_BYTES), unit)
        try:
            fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise _taken(name) from None
        except OSError as exc:
            raise _no_file(exc, name) from None
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, size)
            _fallocate(fd, 0, _round_up(max(commit, HEADER_BYTES), unit), name)
            seg = cls(name, fd, size, kind)
        except OSError as exc:
            os.unlink(name)  # ours: created exclusively just above
            if exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
                raise SharedMemoryFull(f"cannot map segment {name} of {size / 2**30:.1f} GiB: "
                                       f"{exc.strerror}; give the cache a smaller size=") from None
            if exc.errno == errno.EINVAL:  # hugetlbfs: a size its pages do not divide, no pages
                raise SharedMemoryFull(f"cannot size segment {name} ({size} bytes) in {directory}: "
                                       f"{exc.strerror}; {_shm_hint(directory)}") from None
            raise
        except BaseException:
            os.unlink(name)
            raise
        finally:
            os.close(fd)
        return seg._publish(kind, size)

    def _publish(self, kind: int, size: int) -> Segment:
        _HEADER.pack_into(self.buf, 0, MAGIC, VERSION, kind, size, 0)
        struct.pack_into("Q", self.buf, 24, _READY)  # published last
        return self

    @staticmethod
    def _open(name: str) -> int:
        """A descriptor of existing segment ``name`` (FileNotFoundError if absent)."""
        if segment_dir(name) is not None:
            try:
                return os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "no such shared-memory segment", name) from None
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EACCES, errno.EPERM):  # never follow a link
                    raise _foreign(name) from None
                raise
        try:
            shm = posix_ipc.SharedMemory(name, 0, size=0)
        except posix_ipc.ExistentialError:
            raise FileNotFoundError(errno.ENOENT, "no such shared-memory segment", name) from None
        except posix_ipc.PermissionsError:
            raise _foreign(name) from None
        except OSError as exc:  # ELOOP: shm_open never follows a symlink
            if exc.errno == errno.ELOOP:
                raise _foreign(name) from None
            raise
        fd = os.dup(shm.fd)
        shm.close_fd()
        return fd

    @classmethod
    def attach(cls, name: str, *, kind: int | None = None) -> Segment:
        """Map an existing segment, checking its header. Raises FileNotFoundError if absent."""
        fd = cls._open(name)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):  # root opens anyone's
                raise squatter_error(_path(name), st)
            if st.st_size < HEADER_BYTES:
                raise CorruptSegment(f"segment {name} is {st.st_size} bytes: its creator died before sizing it")
            seg = cls(name, fd, st.st_size, -1)
        except OSError as exc:
            if exc.errno in (errno.ENOMEM, errno.EMFILE, errno.ENFILE):
                raise SharedMemoryFull(f"cannot map segment {name}: {exc.strerror}; this process "
                                       f"has too many mappings or descriptors") from None
            raise
        finally:
            os.close(fd)
        magic, version, seg_kind, size, ready = _HEADER.unpack_from(seg.buf, 0)
        if magic != MAGIC or ready != _READY or size != st.st_size:
            seg.close()
            raise CorruptSegment(
                f"segment {name} has no valid shmcache header (magic {magic:#x}, ready {ready:#x}); "
                f"its creator died while making it or another program wrote it - run `shmcache gc`"
            )
        if version != VERSION:
            seg.close()
            raise CorruptSegment(f"segment {name} is format version {version}; this shmcache reads {VERSION}")
        if kind is not None and seg_kind != kind:
            seg.close()
            raise CorruptSegment(f"segment {name} is of kind {seg_kind}, expected {kind}")
        seg.kind = seg_kind
        return seg

    # --- memory ------------------------------------------------------------------------------

    def commit(self, offset: int, length: int) -> None:
        """Back ``[offset, offset+length)`` with real pages before anything touches it (no SIGBUS);
        where it starts at the last ``commit_ahead``'s range and that thread backed it, only the
        rest past that range."""
        asked, self._ahead = self._ahead, None
        if asked is not None:
            start, end, request = asked
            if offset == start and ahead.backed(request):
                self._mapped = asked  # write_at copies into it through the thread's mapping, if made
                offset, length = end, offset + length - end
                if length <= 0:
                    return
            elif offset > start:  # another process committed the range asked for (writers that take
                self._ahead_pause = AHEAD_PAUSE  # turns): a walk of its pages for nothing; stop asking a while
        with self._own_fd() as fd:
            _fallocate(fd, offset, length, self.name)

    def commit_ahead(self, offset: int, length: int) -> None:
        """Back ``[offset, offset+length)`` on a thread of its own (``ahead``), for a ``commit``
        of it to come: a hint, never an error (a commit backs what this did not). The pages count
        as the object's from then on (``st_blocks``, /dev/shm's use): a caller asks only for what
        its cap has room for. Nothing where the compiled part is not built, nor for AHEAD_PAUSE
        calls after a range that the next commit did not use."""
        if not ahead.NATIVE or length <= 0:
            return
        if self._ahead_pause:
            self._ahead_pause -= 1
            return
        try:
            with self._own_fd() as fd:
                self._ahead = (offset, offset + length, ahead.submit(fd, offset, length))
        except OSError:  # the name is gone, no descriptor left, no thread: the commit will tell
            self._ahead = None

    @contextlib.contextmanager
    def _own_fd(self) -> Iterator[int]:
        """A descriptor of this segment's object, opened again by name (mmap keeps its own) and
        closed after; FileNotFoundError if the name is gone or names another object now (never
        touch another object)."""
        try:
            fd = self._open(self.name)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "shared-memory segment was removed", self.name) from None
        try:
            if os.fstat(fd).st_ino != self._inode:
                raise FileNotFoundError(errno.ENOENT, "shared-memory segment was replaced", self.name)
            yield fd
        finally:
            os.close(fd)

    def write_at(self, offset: int, buffers) -> None:
        """Copy ``buffers`` (bytes-like objects, one after the other) into the segment from
        ``offset``, for a range that ``commit`` backed: inside a range backed ahead, through the
        mapping the ``ahead`` thread made of it (``ahead.copy_into``); else with pwritev: the kernel copies straight
        from them into the object's pages, with none of the page faults a first store through
        this mapping takes on each 4 KiB page (tmpfs: ~4-5 us a page, more than the copy) and no
        copy in between (a run of a publish group's records, CacheWriter.put_many)."""
        buffers = list(buffers)  # counted, then written: an iterator would be read once
        mapped = self._mapped
        if mapped is not None and mapped[0] <= offset < mapped[1] and offset >= HEADER_BYTES and ahead.COPY_MAPPED:
            # in a range backed ahead: through the mapping its thread made, with every page present
            # (no fault, no syscall), if it made one and the bytes lie inside the range
            try:
                if ahead.copy_into(mapped[2], offset, buffers, self.size):
                    return
            except ValueError:  # past the end (nothing copied): said below, as without it
                pass
        if rowcopy.NATIVE and not self._no_pwrite and offset >= HEADER_BYTES:
            # each buffer taken once, counted and written in C (a run has ~8 a record)
            try:
                with self._own_fd() as fd:
                    rowcopy.write_all(fd, offset, buffers, self.size)
                return
            except ValueError:  # past the end (nothing written): said below, as without it
                pass
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                self._no_pwrite = True  # hugetlbfs takes no write(2): through the mapping, as below
        # the byte count without a Python step per buffer: every loop in C
        end = offset + sum(map(_NBYTES, map(memoryview, buffers)))
        if offset < HEADER_BYTES or end > self.size:  # a pwritev past the end grows the object
            raise ValueError(f"write_at of bytes {offset}..{end} of segment {self.name}: past its "
                             f"{self.size} bytes or over its header (a writer's bug: nothing written)")
        if self._no_pwrite:
            self._copy_in(offset, _byte_views(buffers))
            return
        with self._own_fd() as fd:
            try:
                self._pwrite_all(fd, offset, buffers, end - offset)
            except OSError as exc:
                if exc.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                # hugetlbfs takes no write(2): through the mapping (all of it again: the same
                # bytes), now and from now on
                self._no_pwrite = True
                self._copy_in(offset, _byte_views(buffers))

    def _pwrite_all(self, fd: int, offset: int, buffers: list, nbytes: int) -> None:
        """``write_at``'s pwritev of ``buffers``, ``nbytes`` in all, at ``offset``."""
        if len(buffers) <= _IOV_MAX and os.pwritev(fd, buffers, offset) == nbytes:
            return  # the common case: one call copies it all
        # more than IOV_MAX buffers, or a short write (a signal): again, from the start, in steps
        # that go on where the last stopped (rewriting what was copied is harmless)
        views = _byte_views(buffers)
        i = 0
        while i < len(views):
            batch = views[i:i + _IOV_MAX]
            n = os.pwritev(fd, batch, offset)
            if n <= 0:  # bounded: a call that copies nothing would loop for ever
                raise OSError(errno.EIO, f"pwritev into segment {self.name} copied nothing")
            offset += n
            for v in batch:
                if n < v.nbytes:
                    views[i] = v[n:]
                    break
                n -= v.nbytes
                i += 1

    def _copy_in(self, offset: int, views: list) -> None:
        """``write_at``'s copy through the mapping, for a file system without write(2)."""
        for v in views:
            self.buf[offset:offset + v.nbytes] = v
            offset += v.nbytes

    # --- teardown ----------------------------------------------------------------------------

    def unlink(self) -> bool:
        """Unlink the name if it still refers to our inode (see NOTE [segment lifecycle]); the
        pages backed ahead are let go (``ahead.release``: its mapping would keep the file's pages)."""
        path = _path(self.name)
        try:
            if os.lstat(path).st_ino != self._inode:
                return False
            os.unlink(path)
        except FileNotFoundError:
            return False
        ahead.release()
        return True

    def close(self) -> None:
        """Nothing to release by hand: the mapping goes with the last reference to it (see the
        class docstring), the descriptor is closed already. Kept so that owners can say so."""


def _path(name: str) -> str:
    return segment_path(name)


def _squat(name: str) -> NotOwner | None:
    """NotOwner if ``name`` holds another user's file, FIFO or symlink (lstat: never followed)."""
    try:
        st = os.lstat(_path(name))
    except FileNotFoundError:
        return None
    if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
        return squatter_error(_path(name), st)
    return None


def _foreign(name: str) -> OSError:
    """Why ``name`` could not be opened (EACCES, ELOOP): a squat, or a segment of ours whose mode
    someone changed."""
    return _squat(name) or NotOwner(
        f"shared-memory segment {_path(name)} denies you access (its mode was changed); remove it "
        f"(`shmcache gc`), or set $SHMCACHE_DIR to a directory you own")


def _taken(name: str) -> OSError:
    """O_EXCL creation found ``name`` taken: another user's squat, or (never expected: creation
    happens under the cache's lock) a segment of ours."""
    return _squat(name) or FileExistsError(
        errno.EEXIST, "shared-memory segment exists already (run `shmcache gc`)", _path(name))


def _no_file(exc: OSError, name: str) -> OSError:
    """Why ``name`` could not be created: a mount out of files (its nr_inodes=, or a quota) is as
    full as one out of bytes (SharedMemoryFull: the item is rejected, never an error out of put)."""
    if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
        return exc
    root = segment_dir(name) or "/dev/shm"
    return SharedMemoryFull(
        f"no room in {root} for another segment ({name}): {exc.strerror} - it has no file (inode) left "
        f"(`df -i {root}`); free some there (`shmcache gc`, `shmcache destroy`), or give that mount more "
        f"(nr_inodes=)")


def _round_up(n: int, m: int) -> int:
    return -(-n // m) * m


# commit_ahead's calls skipped after a range the next commit did not use (another process's run
# committed it: DataLoader workers that take turns), so that a turn-taker walks no pages for nothing
AHEAD_PAUSE = 16


def _fallocate(fd: int, offset: int, length: int, name: str) -> None:
    if length <= 0:
        return
    try:
        os.posix_fallocate(fd, offset, length)
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
            raise SharedMemoryFull(
                f"no room in {segment_dir(name) or '/dev/shm'} for {length / 2**10:.0f} KiB more of "
                f"segment {name}: {_shm_hint(segment_dir(name))}"
            ) from None
        raise
