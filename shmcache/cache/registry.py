"""The session registry: named sessions in a namespace directory, and the processes attached to them.

NOTE [session lifecycle]
    A session is a directory ``<root>/sessions/<name>/`` holding ``session.json``, ``caches/``
    (one ``<cache>.json`` and one ``<cache>.lock`` per cache) and ``slots/`` (one liveness lock per
    attached process, see NOTE [lock files]). Creation happens under ``<root>/registry.lock``: the
    creator builds the directory under a temporary name and renames it into place last, so nobody
    ever sees a half-made session. Sessions outlive their processes (the next run must find the
    cache) until ``destroy``, which unlinks every segment whose name carries the session's prefix,
    also under the registry lock. A session whose creator died mid-way leaves only a temporary
    directory, which ``gc`` removes; so do segments of caches or sessions that no longer exist.
    A session made with a memory directory (``memory_dir``: ``memdir``) records it in
    ``session.json``, and its segments' names are paths in its private directory there: every
    process finds them from the record alone. Each such directory is listed in ``<root>/memory_dirs``
    before a segment goes there, so ``gc`` sweeps it for the segments of sessions that are gone.

    Last use. ``<root>/sessions/<name>/last_used`` is an empty file whose mtime says when a
    process last used the session: every attach touches it, so does a clean exit (``process_slot``)
    and ``destroy_idle`` when it finds the session in use; while a process is attached the session
    is in use *now*. No lock guards it: it only ever moves forward, and a lost touch can only make
    a session look older, never make one with a live process go (``destroy_idle`` skips those).

    Attaching races with destroying. ``destroy`` checks for live slots, renames the directory away,
    then checks the slots again in the renamed directory: a process that took a slot in between
    is seen there, the directory goes back, and the destroy is refused (unless forced). A process
    that tries to take a slot while the directory is away finds no file; it then waits for the
    registry lock, which the destroy holds, and tries again: it attaches if the session is back,
    and gets FileNotFoundError (the session is gone) if not. So an attach either wins, or comes
    after the destroy's decision; never does a destroy pull a session from under an attached process.

NOTE [cache use]
    Sessions live long, and a dataset whose identity changes leaves its old cache there. So each
    cache has ``caches/<cache>.open``: every process that opens the cache to use it holds a shared
    flock on it (``SharedHold``) from before it maps the root until it closes the cache, and the
    file's mtime says when one last opened or closed it (``cache_last_opened``). Dropping a cache
    by age or by name (``drop_cache``) takes the file exclusively without waiting (``unless_held``):
    refused while any live process holds it; else, still holding it, it tombstones and unlinks the
    cache's segments and removes its metadata, spill folder and the file itself. An opener that
    came meanwhile waits for the exclusive hold to end, finds its file removed, takes the new one,
    and makes the cache again (empty); never does a drop pull a cache from under a process using it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import struct
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..base import memdir, ordering, settings
from ..base.locks import FlockLock, LivenessSlot, SharedHold, slot_is_alive, unless_held
from ..base.namespace import SEP, SHM_ROOT, Namespace, namespace, segment_dir, validate_name
from ..base.settings import ENV_MEMORY_DIR
from ..base.shm import Segment
from ..errors import (
    CacheInUse,
    CacheNotFound,
    CorruptSegment,
    InvalidArgument,
    LockTimeout,
    SessionExists,
    SessionInUse,
    SessionNotFound,
    ShmcacheError,
)
from .root import DESTROYED, RootLayout

__all__ = ["SessionInfo", "SessionRegistry", "GcReport", "IdleSession", "IdleCache", "SEP", "MAX_SLOTS", "retire_root",
           "unlink_segments", "CACHE_COUNT_FILES"]

log = logging.getLogger("shmcache")

# The files beside a cache's metadata that hold its claims and counts, ``caches/<cache>.<kind>``:
# its claims (NOTE [claims]), its loops' stall counts (NOTE [stall counts]) and its tiers' counts
# (NOTE [tier counts]: one per name of tiers.counts.COUNTERS, named here because the registry
# drops them and imports nothing above it; a test keeps the two in step). They go with the cache
# (drop_cache, CacheStore.destroy): a cache made again under its name counts from zero.
CACHE_COUNT_FILES = ("claims", "stall", "snapshot", "remote", "tiers")
MAX_SLOTS = 1024  # live processes per session (8 ranks x 32 DataLoader workers x 4)
_VERSION = 1


@dataclass
class SessionInfo:
    name: str
    created: float
    uid: int
    creator_pid: int
    spill_dir: str | None = None
    # the default remote tier of the session's caches (``RedisTier``); a URL that may carry a
    # password: session.json is the user's own (0700 directory), and it is never shown unmasked
    remote: str | None = field(default=None, repr=False)
    # the memory directory its segments live in (``memdir``); None: /dev/shm
    memory_dir: str | None = None
    version: int = _VERSION
    path: Path = field(default=Path(), compare=False)

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("path")
        return d


@dataclass
class GcReport:
    removed_segments: list[str] = field(default_factory=list)
    removed_dirs: list[str] = field(default_factory=list)
    removed_locks: list[str] = field(default_factory=list)
    reclaimed_entries: int = 0
    reclaimed_bytes: int = 0
    removed_spill_files: list[str] = field(default_factory=list)
    removed_caches: list[str] = field(default_factory=list)  # "session/cache" of caches never made


@dataclass
class IdleSession:
    """A session that ``destroy_idle`` destroyed: nobody had used it for ``idle_s`` seconds."""

    name: str
    last_used: float
    idle_s: float
    removed_segments: list[str] = field(default_factory=list)


@dataclass
class IdleCache:
    """A cache that ``drop_idle_caches`` dropped: no process had opened it for ``idle_s`` seconds."""

    session: str
    cache: str
    last_opened: float
    idle_s: float
    shm_bytes: int
    removed_segments: list[str] = field(default_factory=list)


class SessionRegistry:
    """Create, find, list and destroy sessions of one namespace (``$SHMCACHE_DIR``)."""

    def __init__(self, ns: Namespace | None = None, *, timeout_s: float = 60.0):
        self.ns = ns or namespace()
        if self.ns.root.is_dir():  # a namespace looked at only (namespace(create=False)) stays missing
            self.ns.sessions_dir.mkdir(mode=0o700, exist_ok=True)
        # taken rarely, by short-lived registries: no descriptor kept; destroy_idle calls destroy
        self._lock = FlockLock(self.ns.root / "registry.lock", timeout_s=timeout_s,
                               what="the session registry lock", keep_open=False, reentrant=True)

    # --- paths ------------------------------------------------------------------------------

    def session_dir(self, name: str) -> Path:
        return self.ns.sessions_dir / validate_name(name, "session")

    def segment_prefix(self, session: str) -> str:
        """Every segment of ``session`` has a name starting with this (see Namespace.segment_name)."""
        return self.segment_base(session) + SEP

    def segment_base(self, session: str, *parts: str) -> str:
        """``Namespace.segment_name(session, *parts)`` where the session's segments live: in its
        memory directory's private directory when it has one (a path), else in /dev/shm."""
        return (self.segment_dir(session) or "") + self.ns.segment_name(session, *parts)

    def segment_dir(self, session: str) -> str | None:
        """The private directory of the session's segments in its memory directory (None: /dev/shm,
        or a session that is gone); as recorded, unchecked (``check_memory_dir`` checks)."""
        try:
            raw = json.loads((self.session_dir(session) / "session.json").read_text())
        except (OSError, ValueError):
            return None
        where = raw.get("memory_dir") if isinstance(raw, dict) else None
        return _private_of(where) if isinstance(where, str) and where else None

    def check_memory_dir(self, session: str) -> str | None:
        """``segment_dir``, checked as when the session was made (``memdir.private_dir``): a mount gone
        since (the tmpfs unmounted, the container restarted) is refused, not written to disk."""
        info = self.get(session)
        if not info.memory_dir:
            return None
        try:
            return memdir.private_dir(info.memory_dir)
        except ShmcacheError as exc:
            raise type(exc)(f"session {session!r} keeps its shared memory in {info.memory_dir}, which "
                            f"is not usable now: {exc}") from None

    def memory_root(self, session: str) -> str:
        """The directory whose filesystem holds the session's shared memory (its size and free space
        bound the caches: NOTE [memory limits])."""
        return self.segment_dir(session) or SHM_ROOT

    # --- queries ----------------------------------------------------------------------------

    def exists(self, name: str) -> bool:
        return (self.session_dir(name) / "session.json").is_file()

    def get(self, name: str, *, fix: str | None = None) -> SessionInfo:
        """The session's record; SessionNotFound naming the sessions there are, and ``fix`` (what
        the caller can do: by default, in Python, how to create it or use the automatic one)."""
        path = self.session_dir(name)
        try:
            raw = json.loads((path / "session.json").read_text())
        except FileNotFoundError:
            known = ", ".join(s.name for s in self.list()) or "none"
            fix = fix or f"create it with `shmcache new {name}`, or use ShmDatasetCache(session='auto')"
            raise SessionNotFound(f"no session {name!r} in {self.ns.root} (sessions: {known}); {fix}") from None
        except (OSError, ValueError) as exc:
            raise ShmcacheError(
                f"session {name!r} has an unreadable {path / 'session.json'} ({exc}); remove it "
                f"with `shmcache destroy {name}`"
            ) from None
        return SessionInfo(**{k: raw[k] for k in raw if k in SessionInfo.__dataclass_fields__}, path=path)

    def list(self) -> list[SessionInfo]:
        out = []
        if not self.ns.sessions_dir.is_dir():  # a namespace never made (namespace(create=False))
            return out
        for entry in sorted(self.ns.sessions_dir.iterdir()):
            if entry.name.startswith(".") or not (entry / "session.json").is_file():
                continue  # a session being made or destroyed (names never start with '.')
            try:
                out.append(self.get(entry.name))
            except ShmcacheError:
                continue
        return out

    def live_pids(self, name: str) -> list[int]:
        """PIDs of the processes attached to session ``name`` right now (judged by their slot locks)."""
        return _live_pids_in(self.session_dir(name) / "slots")

    def last_used(self, name: str) -> float:
        """When a process last used session ``name`` (epoch seconds); now while one is attached
        (NOTE [session lifecycle], last use)."""
        if self.live_pids(name):
            return time.time()
        return self._recorded_use(self.get(name))

    def _recorded_use(self, info: SessionInfo) -> float:
        try:
            return os.stat(self.session_dir(info.name) / "last_used").st_mtime
        except FileNotFoundError:  # never attached (or made before last_used existed)
            return info.created

    def cache_meta_path(self, session: str, cache: str) -> Path:
        """The metadata file of cache ``cache`` (fingerprint, cap, spill folder)."""
        return self.session_dir(session) / "caches" / f"{cache}.json"

    def read_cache_meta(self, session: str, cache: str) -> dict:
        """The metadata of cache ``cache``; {} when it is missing or unreadable (being replaced,
        or its creator died before writing it)."""
        try:
            meta = json.loads(self.cache_meta_path(session, cache).read_text())
        except (OSError, ValueError):
            return {}
        return meta if isinstance(meta, dict) else {}

    def cache_use_path(self, session: str, cache: str) -> Path:
        """The file that every process using cache ``cache`` holds shared (NOTE [cache use])."""
        return self.session_dir(session) / "caches" / f"{cache}.open"

    def cache_claims_path(self, session: str, cache: str) -> Path:
        """The claims file of cache ``cache``: its claim locks and counters (NOTE [claims])."""
        return self.cache_file(session, cache, "claims")

    def cache_file(self, session: str, cache: str, kind: str) -> Path:
        """The ``kind`` file of cache ``cache`` (one of CACHE_COUNT_FILES)."""
        if kind not in CACHE_COUNT_FILES:
            raise ValueError(f"{kind!r} is not one of a cache's files {CACHE_COUNT_FILES}")
        return self.session_dir(session) / "caches" / f"{cache}.{kind}"

    def drop_cache_files(self, session: str, cache: str) -> None:
        """Remove every file of CACHE_COUNT_FILES of cache ``cache`` (the caller holds its lock)."""
        for kind in CACHE_COUNT_FILES:
            self.cache_file(session, cache, kind).unlink(missing_ok=True)

    def hold_cache(self, session: str, cache: str, timeout_s: float = 10.0) -> SharedHold:
        """Count this process as using cache ``cache`` until the hold's ``release()`` (NOTE [cache use])."""
        return SharedHold(self.cache_use_path(session, cache), timeout_s=timeout_s,
                          what=f"cache {session}/{cache}'s use lock (a drop of it in progress)")

    def cache_last_opened(self, session: str, cache: str) -> float | None:
        """When a process last opened or closed cache ``cache`` (epoch seconds); None while a live
        process has it open (NOTE [cache use]). A cache made before this was recorded: when its
        metadata was last written."""
        path = self.cache_use_path(session, cache)
        if slot_is_alive(path):
            return None
        for p in (path, self.cache_meta_path(session, cache)):
            try:
                return os.stat(p).st_mtime
            except FileNotFoundError:
                continue
        return time.time()  # gone meanwhile

    def cache_shm_bytes(self, session: str, cache: str) -> int:
        """What cache ``cache``'s segments occupy in shared memory."""
        return self.ns.occupied_bytes(self.segment_base(session, cache) + SEP)

    def drop_cache(self, session: str, cache: str, *, force: bool = False) -> list[str]:
        """Remove cache ``cache`` from ``session`` (segments, metadata, spill folder); CacheInUse
        while a live process has it open, unless ``force`` (their handles then miss: the root is
        tombstoned first). Returns the segment names removed (NOTE [cache use])."""
        if not self.cache_meta_path(session, cache).exists():
            known = ", ".join(self.cache_names(session)) or "none"
            raise CacheNotFound(f"no cache {cache!r} in session {session!r} (caches: {known}); "
                                f"`shmcache stat {session}` lists them")
        use = self.cache_use_path(session, cache)
        with unless_held(use) as free:
            if not (free or force):
                raise CacheInUse(
                    f"cache {session}/{cache} is open in a live process (find it with `fuser {use}`); "
                    f"stop it first, or drop the cache anyway with force (its handles then miss)")
            lock = self.cache_lock(session, cache)
            try:
                with lock:  # no writer is halfway through a put, a spill or the metadata
                    spill = self.read_cache_meta(session, cache).get("spill_path")
                    removed = unlink_segments(self.ns, self.segment_base(session, cache) + SEP)
                    if spill:
                        shutil.rmtree(spill, ignore_errors=True)
                    self.cache_meta_path(session, cache).unlink(missing_ok=True)
                    self.drop_cache_files(session, cache)  # a cache made again counts from zero
                    if free:
                        use.unlink(missing_ok=True)  # held by us: an opener waiting takes a new one
            finally:
                lock.close()
        return removed

    def drop_idle_caches(self, idle_for_s: float) -> list[IdleCache]:
        """Drop every cache that no live process has open and none opened for ``idle_for_s``
        seconds or more, in every session (NOTE [cache use]); returns them."""
        if not idle_for_s >= 0:
            raise InvalidArgument(f"idle_for_s={idle_for_s!r}: a duration in seconds is >= 0")
        dropped = []
        for info in self.list():
            for cache in self.cache_names(info.name):
                last = self.cache_last_opened(info.name, cache)
                if last is None or time.time() - last < idle_for_s:
                    continue
                size = self.cache_shm_bytes(info.name, cache)
                try:
                    removed = self.drop_cache(info.name, cache)
                except (CacheInUse, CacheNotFound, LockTimeout):  # opened, or dropped, just now
                    continue
                dropped.append(IdleCache(info.name, cache, last, time.time() - last, size, removed))
        return dropped

    def cache_names(self, name: str) -> list[str]:
        return sorted(p.stem for p in (self.session_dir(name) / "caches").glob("*.json"))

    # --- changes ----------------------------------------------------------------------------

    def mark_used(self, name: str) -> None:
        """Record that session ``name`` is used now (NOTE [session lifecycle], last use)."""
        path = self.session_dir(name) / "last_used"
        try:
            try:
                os.utime(path)
            except FileNotFoundError:
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600))
        except OSError:
            pass  # the session is gone, or its directory is read-only: a lost touch only ages it

    def create(self, name: str | None = None, *, spill_dir: str | os.PathLike | None = None,
               exist_ok: bool = False, remote: str | None = None,
               memory_dir: str | os.PathLike | None = None) -> SessionInfo:
        """Create a session (a random name when ``name`` is None) and return it. ``memory_dir``:
        the tmpfs or hugetlbfs directory of its segments (None: ``$SHMCACHE_MEMORY_DIR``, else
        /dev/shm; ``""``: /dev/shm)."""
        if name is None:
            name = "s-" + secrets.token_hex(4)
        validate_name(name, "session")
        if spill_dir is not None:
            spill_dir = str(Path(spill_dir).expanduser().absolute())
        memory = _memory_arg(memory_dir)
        with self._lock:
            if self.exists(name):
                if exist_ok:
                    return self._existing(name, memory_dir, memory)
                raise SessionExists(
                    f"session {name!r} already exists in {self.ns.root}; attach to it with "
                    f"session={name!r}, or `shmcache destroy {name}` first"
                )
            if memory is not None:
                self._note_memory_dir(memdir.private_dir(memory))  # checked, made, listed for gc
            info = SessionInfo(name=name, created=time.time(), uid=os.getuid(), creator_pid=os.getpid(),
                               spill_dir=spill_dir, remote=remote, memory_dir=memory)
            final = self.session_dir(name)
            tmp = self.ns.sessions_dir / f".{name}.tmp-{os.getpid()}-{secrets.token_hex(3)}"
            tmp.mkdir(mode=0o700)
            (tmp / "caches").mkdir(mode=0o700)
            (tmp / "slots").mkdir(mode=0o700)
            _write_json(tmp / "session.json", info.to_json())
            if final.exists():  # a directory without session.json: debris of a dead creator
                shutil.rmtree(final, ignore_errors=True)
            # segments under this name are debris of a destroy that was killed half-way: they
            # must not come back to life as caches of the new session
            unlink_segments(self.ns, (_private_of(memory) or "") + self.ns.segment_name(name) + SEP)
            os.rename(tmp, final)  # published: from here on, others see a complete session
            info.path = final
            return info

    def ensure(self, name: str, *, spill_dir: str | os.PathLike | None = None,
               memory_dir: str | os.PathLike | None = None) -> SessionInfo:
        """The session ``name``, created on first use (``memory_dir``: as ``create``'s; given for a
        session that keeps its memory elsewhere, an error)."""
        if self.exists(name):
            return self._existing(name, memory_dir, _memory_arg(memory_dir))
        return self.create(name, spill_dir=spill_dir, exist_ok=True, memory_dir=memory_dir)

    def _existing(self, name: str, given: str | os.PathLike | None, memory: str | None) -> SessionInfo:
        """Session ``name`` as it is: one whose memory lives elsewhere than ``memory_dir=`` says is
        refused; than ``$SHMCACHE_MEMORY_DIR`` says, said once (the variable is for new sessions)."""
        info = self.get(name)
        if (given is None and memory is None) or (memory or None) == (info.memory_dir or None):
            return info  # attached where it lives: no variable needed
        where = info.memory_dir or "/dev/shm"
        if given is not None:
            raise InvalidArgument(
                f"session {name!r} keeps its shared memory in {where} (set when it was made), not in "
                f"{memory or '/dev/shm'}; use another session, or `shmcache destroy {name}` first to "
                f"make it again there")
        if (str(self.ns.root), name) not in _MEMORY_SAID:
            _MEMORY_SAID.add((str(self.ns.root), name))
            log.warning("session %r keeps its shared memory in %s (set when it was made); $%s=%s applies to "
                        "sessions made from now on: `shmcache destroy %s` to make it again there",
                        name, where, ENV_MEMORY_DIR, memory, name)
        return info

    def memory_dirs(self) -> list[str]:
        """Every private memory directory that a session of this namespace ever used (gc sweeps them)."""
        try:
            text = (self.ns.root / "memory_dirs").read_text()
        except OSError:
            return []
        return sorted({p for p in text.split("\n") if p.startswith("/")})

    def _note_memory_dir(self, private: str) -> None:
        if private in self.memory_dirs():
            return
        fd = os.open(self.ns.root / "memory_dirs", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(f"{private}\n")  # one short append: atomic for concurrent writers

    def destroy(self, name: str, *, force: bool = False) -> list[str]:
        """Drop session ``name`` and everything in it; returns the segment names it unlinked.

        Crash-safe order: the session directory is renamed away first (the session is gone for
        everyone at once, and a half-removed directory is gc's to finish), then every cache's
        root segment is unlinked before its other segments (a cache without its root is debris
        that nobody opens and gc removes).
        """
        validate_name(name, "session")
        gone = "nothing to destroy; check the name (`shmcache ls` lists the sessions)"
        if not self.session_dir(name).exists():
            self.get(name, fix=gone)  # raises SessionNotFound with the list of sessions (no lock
        with self._lock:  # file made in a namespace that does not exist)
            if not self.session_dir(name).exists():
                self.get(name, fix=gone)
            pids = [p for p in self.live_pids(name) if p != os.getpid()]
            if pids and not force:
                raise _in_use(name, pids)
            spill_dirs = self._spill_dirs_of(name)
            prefix = self.segment_prefix(name)  # read from session.json before it goes away
            doomed = self.ns.sessions_dir / f".{name}.tmp-destroy-{os.getpid()}-{secrets.token_hex(3)}"
            held = self._hold_cache_locks(name)
            try:
                os.rename(self.session_dir(name), doomed)
                # NOTE [session lifecycle], attaching races with destroying: a slot taken since
                # the check above is seen here, and that process wins
                late = [p for p in _live_pids_in(doomed / "slots") if p != os.getpid()]
                if late and not force:
                    os.rename(doomed, self.session_dir(name))
                    raise _in_use(name, late)
                removed = unlink_segments(self.ns, prefix)
            finally:
                for lock in held:  # a writer waiting on one finds its lock file gone (FlockLock.acquire)
                    lock.release()
                    lock.close()
            for spill in spill_dirs:
                shutil.rmtree(spill, ignore_errors=True)
            shutil.rmtree(doomed, ignore_errors=True)
            return removed

    def _hold_cache_locks(self, session: str, timeout_s: float = 10.0) -> list[FlockLock]:
        """Every cache lock of ``session`` that can be had within ``timeout_s``: no write is in
        flight while the session goes (``force`` goes on without a lock whose holder is stuck)."""
        held, deadline = [], time.monotonic() + timeout_s
        for path in sorted((self.session_dir(session) / "caches").glob("*.lock")):
            lock = self.cache_lock(session, path.stem)
            try:
                lock.acquire(timeout_s=max(0.0, deadline - time.monotonic()))
            except (LockTimeout, FileNotFoundError):
                lock.close()
                continue
            held.append(lock)
        return held

    def cache_lock(self, session: str, cache: str, timeout_s: float = 5.0) -> FlockLock:
        """The lock of cache ``cache`` of ``session``: its writers, gc and destroy take it."""
        return FlockLock(self.session_dir(session) / "caches" / f"{cache}.lock", timeout_s=timeout_s,
                         what=f"the lock of cache {session}/{cache}")

    def auto_capacity(self, name: str, compute: Callable[[], int], floor: int) -> int:
        """The automatic cap (size=0) that the caches of session ``name`` share (NOTE [memory
        limits]): ``compute()`` by the first auto-sized cache, kept in the session's
        ``auto_capacity`` file, so that caches made later share it instead of each taking 80% of
        what is left. The first writer wins (a hard link fails if the name exists: no lock is
        needed, and none is taken under the cache lock our caller holds). A value below
        ``floor`` (memory full right now) is not kept: the next cache asks again."""
        path = self.session_dir(name) / "auto_capacity"
        try:
            return int(path.read_text())
        except (FileNotFoundError, ValueError):
            pass
        cap = compute()
        if cap < floor:
            return cap
        tmp = path.with_name(f".auto_capacity.{os.getpid()}.{secrets.token_hex(3)}.tmp")
        tmp.write_text(str(cap))
        try:
            os.link(tmp, path)
        except FileExistsError:  # another cache was first: its value is the session's
            try:
                return int(path.read_text())
            except ValueError:  # damaged (truncated, overwritten): what we measured replaces it
                os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return cap

    def raise_auto_capacity(self, name: str, cap: int) -> int:
        """Raise the automatic cap of session ``name`` to ``cap`` if that is more than it is; the
        cap in force after (NOTE [memory limits]: memory was short when it was set).
        Replaced atomically; two raisers at once both write what they measured a moment apart."""
        path = self.session_dir(name) / "auto_capacity"
        try:
            now = int(path.read_text())
        except (FileNotFoundError, ValueError):
            now = 0
        if cap <= now:
            return now
        tmp = path.with_name(f".auto_capacity.{os.getpid()}.{secrets.token_hex(3)}.tmp")
        tmp.write_text(str(cap))
        os.replace(tmp, path)
        return cap

    def attach_process(self, name: str) -> LivenessSlot:
        """Hold a liveness slot in session ``name`` for as long as this process uses it.

        FileNotFoundError: the session was destroyed (NOTE [session lifecycle], attaching races
        with destroying)."""
        slots = self.session_dir(name) / "slots"
        try:
            slot = LivenessSlot(slots, MAX_SLOTS)
        except FileNotFoundError:  # a destroy has the directory away: wait for its decision
            with self._lock:
                slot = LivenessSlot(slots, MAX_SLOTS)
        self.mark_used(name)
        return slot

    def destroy_idle(self, idle_for_s: float) -> list[IdleSession]:
        """Destroy every session that no live process is attached to and that nobody has used
        for ``idle_for_s`` seconds or more (NOTE [session lifecycle], last use); returns them.

        A session in use is never destroyed, however old: ``destroy`` checks again after taking
        the directory away, so a process attaching at that moment wins.
        """
        if not idle_for_s >= 0:
            raise InvalidArgument(f"idle_for_s={idle_for_s!r}: a duration in seconds is >= 0")
        destroyed = []
        with self._lock:
            for info in self.list():
                if self.live_pids(info.name):
                    self.mark_used(info.name)  # seen in use: idle from now at the earliest
                    continue
                last = self._recorded_use(info)
                idle_s = time.time() - last
                if idle_s < idle_for_s:
                    continue
                try:
                    removed = self.destroy(info.name)  # reentrant: we hold the registry lock
                except SessionInUse:
                    continue  # a process attached just now
                destroyed.append(IdleSession(info.name, last, idle_s, removed))
        return destroyed

    def gc(self) -> GcReport:
        """Remove what dead processes left behind: orphan segments, half-made or half-destroyed
        sessions, dead slot locks, unfinished metadata files."""
        report = GcReport()
        with self._lock:
            live = {s.name for s in self.list()}
            for entry in self.ns.sessions_dir.iterdir():
                if entry.name.startswith(".") and ".tmp-" in entry.name:
                    shutil.rmtree(entry, ignore_errors=True)
                    report.removed_dirs.append(str(entry))
            # roots first: each is tombstoned before anything of its cache goes (retire_root); in
            # /dev/shm and every memory directory, what is not where its live session keeps it
            homes = {name: self.segment_dir(name) for name in live}
            for where in [None, *self.memory_dirs()]:
                for seg in sorted(self.ns.owned_segments(where), key=lambda n: not n.endswith(SEP + "root")):
                    session = seg.rpartition("/")[2][len(self.ns.prefix) + 1:].split(SEP, 1)[0]
                    if session not in live or homes[session] != where:
                        report.removed_segments += unlink_segments(self.ns, seg)
            for name in live:
                sdir = self.session_dir(name)
                for path in (sdir / "slots").glob("*.lock"):
                    if not slot_is_alive(path, unlink_if_dead=True):
                        report.removed_locks.append(str(path))
                for path in (sdir / "caches").glob(".*.json.*.tmp"):  # a writer died in write_json
                    cache = path.name[1:].split(".json.", 1)[0]
                    lock = self.cache_lock(name, cache)
                    with lock:  # cache metadata is written under it: a live writer is not racing us
                        path.unlink(missing_ok=True)
                    lock.close()
                if not self._memory_visible(name):
                    continue  # its mount is not here (another mount namespace, unmounted): no root
                    # found is no proof of a cache gone, so nothing of its caches is touched
                report.removed_caches += self._remove_caches_without_root(name)
                report.removed_segments += self._remove_rootless_caches(name)
        return report

    def _memory_visible(self, session: str) -> bool:
        """The session keeps its memory in /dev/shm, or its memory directory is a memory
        filesystem here; False where it cannot be seen (gc judges nothing of it then)."""
        try:
            self.check_memory_dir(session)
        except ShmcacheError:
            return False
        return True

    def _remove_caches_without_root(self, session: str) -> list[str]:
        """The json of every cache that has no usable root - a creation that failed or was killed
        before it made its root, a destroy killed after its tombstone - and that nobody holds the
        lock of (a creator holds it from before its json until its cache is whole): such a json
        would be an error row in `shmcache stat` forever. Returns "session/cache" of each."""
        prefix, removed = self.segment_prefix(session), []
        for path in sorted((self.session_dir(session) / "caches").glob("*.json")):
            cache = path.stem
            root = f"{prefix}{cache}{SEP}root"
            if _root_in_use(root):
                continue
            lock = self.cache_lock(session, cache)
            try:
                lock.acquire(timeout_s=0)
            except (LockTimeout, FileNotFoundError):  # being created or written right now: not debris
                lock.close()
                continue
            try:
                # a process that holds the cache open (NOTE [cache use]) maps a root that this
                # process cannot see - its memory directory mounted over since, another mount
                # namespace's tmpfs at the same path: in use, whatever this process finds there
                with unless_held(self.cache_use_path(session, cache)) as free:
                    if free and not _root_in_use(root):
                        unlink_segments(self.ns, f"{prefix}{cache}{SEP}")
                        path.unlink(missing_ok=True)
                        removed.append(f"{session}/{cache}")
            finally:
                lock.release()
                lock.close()
        self.remove_stray_use_files(session)
        return removed

    def remove_stray_use_files(self, session: str) -> None:
        """The use file of each cache that is gone - its json removed by a destroy, a drop, or a
        creation cut short - and that no process holds (NOTE [cache use]); and its claims file
        (NOTE [claims]: a claim on a file nobody opens any more guards nothing)."""
        caches = self.session_dir(session) / "caches"
        for use in sorted(caches.glob("*.open")):
            if not self.cache_meta_path(session, use.stem).exists():
                with unless_held(use) as free:  # held: an opener is making the cache anew
                    if free and not self.cache_meta_path(session, use.stem).exists():
                        use.unlink(missing_ok=True)
                        # its claims go only with it: a cache being made keeps the file its
                        # open handles claim on (a new inode would split them into two groups)
                        (caches / f"{use.stem}.claims").unlink(missing_ok=True)
        for claims in sorted(caches.glob("*.claims")):  # no use file at all: nobody opens it
            if not (caches / f"{claims.stem}.open").exists() and not self.cache_meta_path(
                    session, claims.stem).exists():
                claims.unlink(missing_ok=True)

    def drop_cache_contents(self, session: str, cache: str) -> list[str]:
        """Remove every segment (roots tombstoned first) and the spill folder of cache ``cache``,
        keeping its metadata: for a cache whose segments no longer open (a damaged header). The
        next open makes it again, empty - it is a cache, its contents are recomputed on use.
        Returns the segment names removed."""
        lock = self.cache_lock(session, cache)
        try:
            with lock:
                prefix = self.segment_base(session, cache) + SEP
                removed = unlink_segments(self.ns, prefix)
                spill = self.read_cache_meta(session, cache).get("spill_path")
                if spill:
                    shutil.rmtree(spill, ignore_errors=True)
        finally:
            lock.close()
        return removed

    def _remove_rootless_caches(self, session: str) -> list[str]:
        """Segments of caches whose root is gone (a destroy or a creation cut short)."""
        prefix = self.segment_prefix(session)
        by_cache: dict[str, list[str]] = {}
        for seg in self.ns.owned_segments(segment_dir(prefix)):
            if seg.startswith(prefix):
                by_cache.setdefault(seg[len(prefix):].split(SEP, 1)[0], []).append(seg)
        removed = []
        for cache, segs in by_cache.items():
            root = f"{prefix}{cache}{SEP}root"
            if root in segs:
                continue
            lock = self.cache_lock(session, cache)
            with lock:  # a creator holds it while it makes the root: never race one
                if not self.ns.shm_path(root).exists():
                    removed += unlink_segments(self.ns, f"{prefix}{cache}{SEP}")
            lock.close()
        return removed

    # --- helpers ----------------------------------------------------------------------------

    def _spill_dirs_of(self, name: str) -> list[Path]:
        """Spill directories of every cache of the session (each cache spills into its own folder)."""
        out = []
        for cache in self.cache_names(name):
            spill = self.read_cache_meta(name, cache).get("spill_path")
            if spill:
                out.append(Path(spill))
        return out


_MEMORY_SAID: set[tuple[str, str]] = set()  # (namespace, session) told that $SHMCACHE_MEMORY_DIR is not its


def _memory_arg(memory_dir: str | os.PathLike | None) -> str | None:
    """The memory directory a new session gets: ``memory_dir``, else ``$SHMCACHE_MEMORY_DIR``; ""
    is /dev/shm (None). As an absolute path, unchecked (``memdir.private_dir`` checks it)."""
    if memory_dir is None:
        memory_dir = settings.get(ENV_MEMORY_DIR) or ""
    if not isinstance(memory_dir, (str, os.PathLike)):
        raise InvalidArgument(f"memory_dir must be a path (a tmpfs or hugetlbfs directory), got "
                              f"{type(memory_dir).__name__}")
    text = os.fspath(memory_dir)
    if not text:
        return None
    path = os.path.abspath(os.path.expanduser(text))
    return None if path == SHM_ROOT else path


def _private_of(memory: str | None) -> str | None:
    """The private directory of this user in memory directory ``memory`` (memdir.private_dir's)."""
    return memdir.private_path(memory) if memory else None


def _in_use(name: str, pids: list[int]) -> SessionInUse:
    # Library callers read this; the CLI words the fix its own way (cli.main.cmd_destroy).
    return SessionInUse(
        f"session {name!r} is in use by {len(pids)} live process(es) (pids "
        f"{', '.join(map(str, pids))}); stop them first, or pass force=True to destroy it anyway "
        f"(their caches vanish under them)"
    )


def _live_pids_in(slots: Path) -> list[int]:
    """PIDs of the live holders of the slot locks in ``slots``; -1 for one whose file is unreadable."""
    pids = []
    for path in sorted(slots.glob("*.lock")):
        if slot_is_alive(path):
            try:
                pids.append(int(path.read_text().split()[0]))
            except (OSError, ValueError, IndexError):
                pids.append(-1)
    return pids


def _root_in_use(name: str) -> bool:
    """Cache root ``name`` exists, finished and not tombstoned (retire_root)."""
    try:
        root = Segment.attach(name)
    except (FileNotFoundError, CorruptSegment):
        return False
    except (OSError, ShmcacheError):  # another user's, no memory to map it: cannot tell, keep it
        return True
    epoch = RootLayout.EPOCH
    in_use = root.size < epoch + 8 or struct.unpack_from("Q", root.buf, epoch)[0] != DESTROYED
    root.close()
    return in_use


def unlink_segments(ns: Namespace, prefix: str, *, keep: Collection[str] = ()) -> list[str]:
    """Unlink our segments whose names start with ``prefix``, but those in ``keep``; roots first,
    each tombstoned before it goes (retire_root: a process still mapping it misses from then on,
    NOTE [publish order], Destroying). Only files of ours: never another user's squat. Returns
    the names removed."""
    names = [seg for seg in ns.owned_segments(segment_dir(prefix)) if seg.startswith(prefix) and seg not in keep]
    roots = [seg for seg in names if seg.endswith(SEP + "root")]
    removed = []
    for seg in roots + [seg for seg in names if not seg.endswith(SEP + "root")]:
        if seg.endswith(SEP + "root"):
            retire_root(seg)
        if ns.unlink_segment(seg):
            removed.append(seg)
    return removed


def retire_root(name: str) -> None:
    """Write the tombstone into the epoch word of cache root ``name`` (before it is unlinked)."""
    try:
        root = Segment.attach(name)
    except (OSError, ShmcacheError):  # gone, or never finished (no reader maps it): unlink it
        return
    if root.size >= RootLayout.EPOCH + 8:
        root.words[RootLayout.EPOCH >> 3] = DESTROYED  # one store: readers compare it lock-free
        ordering.fence()  # retired for every reader before its spill files and name are reused
    root.close()


def _write_json(path: Path, data: dict, *, dir_fd: int | None = None) -> None:
    """Write ``path`` atomically (temporary file + rename), mode 0600. With ``dir_fd`` (a
    directory's descriptor: FlockLock.held_directory) ``path``'s name in that directory, wherever
    the path leads now."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    src, dst = (tmp.name, path.name) if dir_fd is not None else (tmp, path)
    fd = os.open(src, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.rename(src, dst, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)


write_json = _write_json
