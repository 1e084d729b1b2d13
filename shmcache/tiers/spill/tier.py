"""The spill tier: when a cache's memory is full, its records go to zstd spill files (``SpillStore``).

``SpillTier`` is the store's indexed tier (``cache.indexed_tier.IndexedTier``, NOTE [tiers]): it only
writes a record and says where it went (``write`` -> ``RecordLocation``), and reads a location back
(``read``); the store decides what to spill and publishes the location in its index (a spilled
entry has the SPILLED flag; its location word holds the spill file - the writer's liveness
slot - and the offset, and its length field the *stored* length, so any process reads any
spilled record with one ``pread``). The record is the codec's record (layout id, scalars,
buffers, key), exactly as it would be in memory; the spill files add their own key, lengths and
checksums around it, so a truncated or corrupted record is a miss, never wrong data.

Where spill files go: ``spill_dir`` given to the cache, else the session's (``shmcache new
--spill-dir``), else ``$SHMCACHE_SPILL_DIR``. Each cache spills into its own folder inside it,
named after the namespace, session and cache, so parallel jobs never share files.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import struct
import threading
from collections.abc import Callable
from pathlib import Path

from ...base import settings
from ...base.settings import ENV_SPILL_DIR
from ...cache import process_slot
from ...cache.index import LOCATION_MASK, entry_chunk, entry_class, location_word
from ...cache.indexed_tier import RecordLocation
from ...cache.registry import SEP
from ...cache.store import CacheStore
from ...errors import SpillError, SpillFull
from ..records import RECORD_HEADER_BYTES
from .files import SpillStore, check_spill_dir

__all__ = ["SpillTier", "resolve_spill_dir", "attach", "attach_existing", "remove_orphans"]

log = logging.getLogger("shmcache")


def resolve_spill_dir(spill_dir, session_spill_dir: str | None) -> Path:
    """The spill directory in force, checked (exists or is created, is a directory, is writable)."""
    chosen = spill_dir or session_spill_dir or settings.get(ENV_SPILL_DIR)
    if not chosen:
        raise SpillError(
            "spilling=True needs a spill directory: pass spill_dir=... (or `shmcache new NAME "
            f"--spill-dir DIR` for the session), or set ${ENV_SPILL_DIR}"
        )
    return check_spill_dir(chosen)


def _spill_path(store: CacheStore, base: Path) -> Path:
    return base / f"{store.ns.prefix}{SEP}{store.session}{SEP}{store.name}"


class SpillTier:
    """The spill files of one cache (an ``IndexedTier``): one folder, one file per writer slot."""

    name = "spill"

    def __init__(self, path: Path, *, registry, session: str, cache: str, incarnation: int,
                 level: int = 1):
        self.path = path
        self.where = str(path)
        self.level = level
        self.accepting = True  # False after a full disk or a write error: stop spilling, keep serving
        self._registry, self._session, self._cache = registry, session, cache
        self._incarnation = incarnation

    @property
    def files(self) -> SpillStore:
        """The process's SpillStore for this folder (shared by every handle of the process)."""
        return _shared_files(self.path, self.level, self._incarnation)

    def write(self, key: bytes, record) -> RecordLocation | None:
        """Append ``record`` to this process's spill file; None (and stop accepting) when the disk
        is full or fails."""
        if not self.accepting:
            return None
        slot = process_slot.slot(self._registry, self._session)
        try:
            loc = self.files.append(slot, key, record)
        except SpillFull as exc:
            self.accepting = False
            log.warning("cache %s/%s stops spilling: %s", self._session, self._cache, exc)
            return None
        except SpillError as exc:
            self.accepting = False
            log.warning("cache %s/%s stops spilling after a write error: %s", self._session, self._cache, exc)
            return None
        if loc.offset > LOCATION_MASK:  # the location word has 48 bits for the offset
            return None
        return RecordLocation(location_word(loc.file_id, loc.offset), loc.stored_len, loc.raw_len)

    def read(self, location: RecordLocation, key: bytes, stale: Callable[[], bool] | None = None) -> bytearray | None:
        word = location.word  # a spilled entry's class and chunk are the file id and offset
        return self.files.read((entry_class(word), entry_chunk(word), location.stored), key, stale)

    def counters(self) -> dict[str, int]:
        return self.files.stats()

    def key_of(self, location: RecordLocation, w1: int) -> bytes | None:
        """The key bytes of the record at ``location``, read from its header (a snapshot export
        walks entries whose str/bytes keys it does not know); None when no intact header of that
        index word ``w1`` is there. ``read`` then checks the whole record."""
        file_id, offset = entry_class(location.word), entry_chunk(location.word)
        try:
            with open(self.files.file_path(file_id), "rb", buffering=0) as f:
                head = os.pread(f.fileno(), RECORD_HEADER_BYTES, offset)
                if len(head) < RECORD_HEADER_BYTES:
                    return None
                key_len = struct.unpack_from("<H", head, 6)[0]  # NOTE [spill records]: the key length
                key = os.pread(f.fileno(), key_len, offset + RECORD_HEADER_BYTES)
        except OSError:
            return None
        return key[8:] if len(key) == key_len >= 8 and key[:8] == w1.to_bytes(8, "little") else None

    def clear(self) -> None:
        _drop_shared_files(self.path, destroy=True)
        self.reopen()

    def reopen(self) -> None:
        """Start afresh on the current spill folder (after a clear() here or in another process:
        appending to files that were deleted would write records nobody can find)."""
        _drop_shared_files(self.path)
        self.accepting = True

    def destroy(self) -> None:
        _drop_shared_files(self.path, destroy=True)

    def close(self) -> None:
        """This handle is done; the process's SpillStore stays for its other handles."""

    def collect_garbage(self) -> None:
        self.files.recover()


# One SpillStore per spill folder and process: every cache handle of the process appends through
# it. Two stores would both append to the process's slot file and wait on each other's flock.
# Each is tagged with the incarnation of the cache it serves (``cache.store``'s docstring): when the
# cache (or its session) is destroyed and made again, the folder is deleted and made again too,
# and a store still holding descriptors of the deleted files would append records nobody can read
# back. attach() compares incarnation and folder identity, and replaces a store that is stale.
_FILES: dict[str, tuple[int, SpillStore]] = {}
_FILES_LOCK = threading.Lock()


def _new_files_lock_in_child() -> None:
    global _FILES_LOCK
    _FILES_LOCK = threading.Lock()  # another thread of the parent may have held it at the fork


os.register_at_fork(after_in_child=_new_files_lock_in_child)


def _shared_files(path: Path, level: int, incarnation: int, *, fresh: bool = False) -> SpillStore:
    """The process's store for ``path``; ``fresh``: first make sure it serves this incarnation of
    the cache and the folder that exists now (made here if missing, verified as ours)."""
    stale = None
    with _FILES_LOCK:
        tag, files = _FILES.get(str(path), (incarnation, None))
        if files is not None and fresh and not files.closed:
            if tag != incarnation or _folder_id(path) != files.folder_id:
                stale, files = files, None
        if files is None or files.closed:
            files = SpillStore(path, level=level)
            _FILES[str(path)] = (incarnation, files)
    if stale is not None:
        stale.close()  # its folder is gone: nothing to keep; handles of the old cache see misses
    return files


def _folder_id(path: Path) -> tuple[int, int] | None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


def _drop_shared_files(path: Path, destroy: bool = False) -> None:
    with _FILES_LOCK:
        files = _FILES.pop(str(path), (0, None))[1]
    if files is not None:
        files.destroy() if destroy else files.close()
    elif destroy:
        shutil.rmtree(path, ignore_errors=True)


def attach(store: CacheStore, spill_dir, *, level: int = 1) -> SpillTier:
    """Turn spilling on for ``store`` (``spill_dir`` None: the session's, then the environment's)."""
    base = resolve_spill_dir(spill_dir, store.registry.get(store.session).spill_dir)
    path = _spill_path(store, base)
    # the folder now, before anything records it: a planted symlink or another user's directory
    # there is refused at once (NotOwner), and a store left from a destroyed cache is replaced
    _shared_files(path, level, store.incarnation, fresh=True)
    _remember_base(store.ns, base)
    tier = _tier(store, path, level)
    store.spill_to(tier)
    return tier


def attach_existing(store: CacheStore) -> None:
    """Let a reader (``shmcache stat``, ``gc``) see a cache's spill files, if it ever spilled."""
    path = store.read_meta().get("spill_path")
    if path and Path(path).is_dir():
        store.spill_to(_tier(store, Path(path)), record=False)


def _tier(store: CacheStore, path: Path, level: int = 1) -> SpillTier:
    return SpillTier(path, registry=store.registry, session=store.session, cache=store.name,
                     incarnation=store.incarnation, level=level)


def _remember_base(ns, base: Path) -> None:
    """Note a spill directory in the namespace, so ``gc`` can look there after a session is gone."""
    listing = ns.root / "spill_dirs"
    known = set(listing.read_text().split("\n")) if listing.exists() else set()
    if str(base) not in known:
        fd = os.open(listing, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{base}\n")  # one short append: atomic for concurrent writers


def remove_orphans(ns, live_sessions: set[str]) -> list[str]:
    """Spill folders of this namespace whose session no longer exists (``shmcache gc``)."""
    listing = ns.root / "spill_dirs"
    bases = {Path(p) for p in listing.read_text().split("\n") if p} if listing.exists() else set()
    removed = []
    head = ns.prefix + SEP
    for base in sorted(bases):
        try:
            entries = list(base.iterdir())
        except OSError:
            continue
        for entry in entries:
            if entry.name.startswith(head) and entry.name[len(head):].split(SEP, 1)[0] not in live_sessions:
                if not _our_folder(entry):
                    continue  # another user's directory or symlink squatting our name: never touched
                shutil.rmtree(entry, ignore_errors=True)
                removed.append(str(entry))
    return removed


def _our_folder(path: Path) -> bool:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()

