"""The one place that assembles a cache's tiers (NOTE [tiers]): their order, their identity, the
keys of their statistics, and which of them take writes - all through the ``Tier`` protocol.

    store = assemble(local, [tier], name=name, fingerprint=fp, registry=registry)  # ordered, bound
    bind(store, name, fingerprint)    # the cache's dataset became known: every tier learns it
    stats(store)                      # == the tier keys of stats_from_files(...) (`shmcache stat`)

The tiers themselves are made by their layers (``remote.RedisTier`` here, the snapshot layer's
``SnapshotTier`` above) and handed in: this module imports nothing above ``tiers/``.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..cache.store_protocol import Store
from . import counts as tier_counts
from . import remote
from .protocol import Tier
from .tiered_store import TieredStore

__all__ = ["ORDER", "assemble", "tiers_of", "bind", "stats", "stats_from_files"]

# The order a miss in shared memory asks the tiers in (NOTE [tiers]): the snapshot (read-only,
# exact, the cheapest to reach), then the remote (shared and writable, a network round trip).
# A tier of another name goes after these, in the order it was handed in.
ORDER = ("snapshot", "remote")


def _rank(tier: Tier) -> int:
    return ORDER.index(tier.name) if tier.name in ORDER else len(ORDER)


def assemble(local: Store, tiers: Sequence[Tier], *, name: str | None, fingerprint: str | None,
             allow_pickle: bool = False, registry=None) -> TieredStore:
    """``local`` (a CacheStore, or a TieredStore already) with ``tiers`` behind it too, all in
    ORDER, each bound to the cache's identity (``name``, ``fingerprint``: Tier.bind; the tiers are
    closed and CacheMismatch raised for a snapshot of another dataset). The seam's counters go to
    the cache's ``tiers`` counts file (NOTE [tier counts]) when ``registry`` is given and the store
    is shared (an uncached store holds no liveness slot)."""
    try:
        for tier in tiers:
            tier.bind(name, fingerprint)
    except BaseException:
        for tier in tiers:
            tier.close()
        raise
    if isinstance(local, TieredStore):
        store = local
        store.allow_pickle = allow_pickle
    else:
        store = TieredStore(local, [], allow_pickle=allow_pickle, **_seam_counts(local, registry))
    store.set_tiers(sorted([*store.behind, *tiers], key=_rank))
    return store


def _seam_counts(local: Store, registry) -> dict:
    if registry is None or local.uncached:
        return {}
    from ..cache import process_slot

    session = local.session
    return {"counts_path": tier_counts.counts_path(registry, session, local.name, "tiers"),
            "slot": lambda: process_slot.slot(registry, session)}


def tiers_of(store: Store) -> list[Tier]:
    """The tiers behind ``store``, in the order they are asked (none for a store without tiers)."""
    return store.behind if isinstance(store, TieredStore) else []


def bind(store: Store, name: str | None, fingerprint: str | None) -> None:
    """Tell every tier behind ``store`` the cache's identity (``Tier.bind``): the dataset became known
    after the tiers were opened (a wrap() of a cache opened by name, an import). CacheMismatch from
    a snapshot of another dataset."""
    for tier in tiers_of(store):
        tier.bind(name, fingerprint)


def stats(store: Store) -> dict:
    """``store.stats()``: with tiers, the tier keys too (counts.stats_keys, summed over every
    process) - the keys ``shmcache stat --json`` reads from the counts files."""
    return store.stats()


def stats_from_files(registry, session: str, name: str) -> dict:
    """The tier keys of cache ``name`` as ``stats()`` has them, read from its counts files (NOTE
    [tier counts]) without opening any tier: a tier that was never in force for the cache has no
    file, and no keys; the seam's counters come with any tier."""
    found = {}
    for tier in ORDER:
        counts = (remote.read_counts if tier == "remote" else _reader(tier))(
            tier_counts.counts_path(registry, session, name, tier))
        if counts is not None:
            found[tier] = (tier_counts.COUNTERS[tier], counts)
    if not found:
        return {}
    seam = tier_counts.read_counts(tier_counts.counts_path(registry, session, name, "tiers"),
                                   tier_counts.COUNTERS["tiers"])
    return tier_counts.stats_keys(found, seam)


def _reader(tier: str):
    return lambda path: tier_counts.read_counts(path, tier_counts.COUNTERS[tier])
