"""Garbage collection of a namespace (``shmcache gc``): what is repaired, dropped, skipped and
removed, as a report; the command line only prints it.

The session registry removes what no session owns any more (``SessionRegistry.gc``: half-made
sessions, dead slot files, segments of caches or sessions that are gone); each cache that still
exists repairs itself under its own lock (``CacheStore.collect_garbage``: a dead writer's entry,
stale generations and table versions, damaged shared memory dropped, counters recounted, the
torn tails of its spill files cut); spill folders of sessions that are gone are removed last.
A cache whose lock a live process keeps (stopped, in a debugger) is skipped and reported, never
waited for: the other caches are still gc's to do.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..base import settings
from ..cache import claims
from ..cache.registry import GcReport, IdleCache, IdleSession, SessionRegistry
from ..cache.store import CacheStore
from ..errors import CacheNotFound, CorruptSegment, LockTimeout, ShmcacheError
from .spill.tier import attach_existing, remove_orphans

__all__ = ["GcResult", "collect_garbage"]


@dataclass
class GcResult:
    """What ``collect_garbage`` did; ``to_json`` is ``shmcache gc --json``."""

    registry: GcReport
    idle: list[IdleSession] = field(default_factory=list)  # sessions destroyed for --idle-for
    idle_caches: list[IdleCache] = field(default_factory=list)  # caches dropped for --cache-idle-for
    stale_segments: list[str] = field(default_factory=list)  # of caches that exist
    reclaimed: int = 0  # half-written entries of dead writers
    dropped: list[dict] = field(default_factory=list)  # {"cache", "reason"}: damaged, now empty
    recounted: list[dict] = field(default_factory=list)  # {"cache", "counters"}
    skipped: list[dict] = field(default_factory=list)  # {"cache", "reason"}: a live process holds its lock

    def to_json(self) -> dict:
        r = self.registry
        return {"removed_segments": r.removed_segments + self.stale_segments,
                "removed_dirs": r.removed_dirs, "removed_locks": r.removed_locks,
                "reclaimed_entries": self.reclaimed, "removed_spill_files": r.removed_spill_files,
                "removed_caches": r.removed_caches, "dropped_caches": self.dropped,
                "recounted_caches": self.recounted, "skipped_caches": self.skipped,
                "destroyed_idle_sessions": [{"session": s.name, "last_used": round(s.last_used, 1),
                                             "idle_s": round(s.idle_s, 1),
                                             "removed_segments": s.removed_segments} for s in self.idle],
                "dropped_idle_caches": [{"cache": f"{c.session}/{c.cache}", "last_opened": round(c.last_opened, 1),
                                         "idle_s": round(c.idle_s, 1), "shm_bytes": c.shm_bytes,
                                         "removed_segments": c.removed_segments} for c in self.idle_caches]}


def collect_garbage(registry: SessionRegistry, idle_for_s: float | None = None,
                    cache_idle_for_s: float | None = None) -> GcResult:
    """``shmcache gc`` on ``registry``'s namespace; ``idle_for_s``: first destroy the sessions
    nobody used for that long (NOTE [session lifecycle], last use); ``cache_idle_for_s``: then
    drop the caches no process opened for that long (NOTE [cache use]). A setting that every
    cache's opening reads and refuses (an on/off variable set to another word, a claim timeout
    that is no number) is refused first (InvalidArgument): a cache that does not open is taken
    for one gone meanwhile - gc would recount nothing."""
    settings.check_switches()
    claims.timeout_setting()  # SHMCACHE_CLAIM_TIMEOUT_S=soon: the same
    idle = registry.destroy_idle(idle_for_s) if idle_for_s is not None else []
    idle_caches = registry.drop_idle_caches(cache_idle_for_s) if cache_idle_for_s is not None else []
    result = GcResult(registry.gc(), idle, idle_caches=idle_caches)
    for info in registry.list():
        for name in registry.cache_names(info.name):
            _collect_cache(registry, info.name, name, result)
        registry.remove_stray_use_files(info.name)  # of caches that opening found never made
    result.registry.removed_spill_files += remove_orphans(registry.ns, {s.name for s in registry.list()})
    return result


def _collect_cache(registry: SessionRegistry, session: str, name: str, result: GcResult) -> None:
    cache = f"{session}/{name}"
    try:
        store = CacheStore(session, name, ns=registry.ns, create=False, lock_timeout_s=10)
    except CorruptSegment as exc:  # a segment header is damaged: the cache cannot open
        try:
            registry.drop_cache_contents(session, name)
        except LockTimeout as exc2:
            result.skipped.append({"cache": cache, "reason": str(exc2)})
            return
        result.dropped.append({"cache": cache, "reason": str(exc)})
        return
    except ShmcacheError:  # gone meanwhile, or never made: the registry's gc handles it
        return
    done: dict = {}
    try:
        attach_existing(store)  # so its spill files' torn tails are cut too
        reclaimed, removed = store.collect_garbage(done)  # repairs, or drops a damaged generation
    except (LockTimeout, CacheNotFound) as exc:
        # a live process keeps its lock (stopped, in a debugger), or it was destroyed just now
        result.skipped.append({"cache": cache, "reason": str(exc)})
        return
    finally:
        store.close()
    result.reclaimed += reclaimed
    result.stale_segments += removed
    if done.get("dropped"):
        result.dropped.append({"cache": cache, "reason": done["dropped"]})
    if done.get("recounted"):
        result.recounted.append({"cache": cache, "counters": done["recounted"]})
