"""Every cache's statistics on this node, read as a bystander: the rows of ``shmcache stat --json``
(and of ``stat --prometheus``, ``shmcache top``, the launcher's ``/metrics``). Each cache is opened
without creating anything, without taking a liveness slot or holding its use file (NOTE [cache
use]): reading the metrics neither keeps a session alive nor makes a cache look used."""

from __future__ import annotations

import time

from ..cache.registry import SessionRegistry
from ..errors import ShmcacheError
from . import assembly

__all__ = ["cache_rows", "node_rows"]


def cache_rows(registry: SessionRegistry, session: str) -> list[dict]:
    """One row per cache of ``session``: its ``stats()`` keys, ``label``, ``incarnation``,
    ``generation``, ``in_use``, ``last_opened``, ``idle_s``; a cache that cannot be opened is ``session``, ``name``
    and ``error``."""
    from ..cache.store import CacheStore  # numpy, no torch
    from .spill.tier import attach_existing

    out = []
    for name in registry.cache_names(session):
        try:
            store = CacheStore(session, name, ns=registry.ns, create=False, lock_timeout_s=5)
        except ShmcacheError as exc:
            out.append({"session": session, "name": name, "error": str(exc)})
            continue
        try:
            attach_existing(store)  # spilled items counted (no-op when the cache never spilled)
            st = store.stats()
            st["label"] = store.read_meta().get("label")  # wrap(label=), else the dataset's repr
            # which cache and generation these counters are of: hits and misses start again at zero
            # in a new generation (clear()), every counter in a new incarnation (destroyed, made again)
            st["incarnation"], st["generation"] = store.view.incarnation, store.view.refresh().gen
        finally:
            store.close()
        last = registry.cache_last_opened(session, name)  # None: open in a live process now
        st["in_use"] = last is None
        st["last_opened"] = None if last is None else round(last, 1)
        st["idle_s"] = 0.0 if last is None else round(max(0.0, time.time() - last), 1)
        # the tiers it has (had): their counters and the seam's, every process's - the keys stats() has
        st.update(assembly.stats_from_files(registry, session, name))
        out.append(st)
    return out


def node_rows(registry: SessionRegistry, session: str | None = None) -> list[dict]:
    """``cache_rows`` of ``session``, or of every session of the namespace (one vanishing meanwhile
    is left out)."""
    from ..errors import SessionNotFound

    sessions = [session] if session is not None else [s.name for s in registry.list()]
    rows: list[dict] = []
    for s in sessions:
        try:
            rows += cache_rows(registry, s)
        except (SessionNotFound, FileNotFoundError):
            if session is not None:
                raise
    return rows
