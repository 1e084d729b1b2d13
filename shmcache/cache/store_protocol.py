"""The surface every store shares: what the layers above call on a cache's store.

Three classes have it: ``CacheStore`` (shared memory, then a spill tier),
``UncachedStore`` (a cache that could not be made: every lookup misses) and
``TieredStore`` (a CacheStore or UncachedStore with remote or snapshot tiers behind it:
shmcache.tiers.tiered_store). ``Store`` declares it, so a reader and a type checker can follow a
call into any of them; ``LocalStore`` adds what only a store of this machine's own memory has
(its metadata, its lock, export and destroy), which callers reach after checking ``uncached``.
Typing only: nothing here runs, and this module imports nothing of shmcache but the
``IndexedTier`` protocol that ``spill`` is.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import numpy as np

from .indexed_tier import IndexedTier

__all__ = ["Store", "LocalStore"]


@runtime_checkable
class Store(Protocol):
    """A cache's store as the dataset layer and the tiers use it (see the module docstring)."""

    @property
    def session(self) -> str: ...

    @property
    def name(self) -> str: ...

    @property
    def uncached(self) -> bool:
        """True for a store that holds nothing (UncachedStore, or one behind tiers)."""
        ...

    @property
    def capacity_bytes(self) -> int: ...

    @property
    def spill(self) -> IndexedTier | None:
        """Where records go when shared memory is full (None: nowhere; an import bounds its items by it)."""
        ...

    @property
    def claim_timeout_s(self) -> float:
        """How long a miss waits on another's claim (NOTE [claims]); 0.0 when claims are off or
        nothing is shared (a remote lease lives as long: NOTE [remote leases])."""
        ...

    # reads: ``MISSING`` (store.MISSING) where a key is absent
    def lookup(self, key: Any, copy: bool = True, count: bool = True) -> Any: ...

    def lookup_batch(self, keys: Sequence, copy: bool = True, count: bool = True) -> tuple[list, list[int]]: ...

    def contains(self, key: Any) -> bool: ...

    def count_misses(self, n: int = 1) -> None: ...

    def count_computed(self, n: int = 1) -> None: ...

    def first_to_say(self, kind: str, notice: str) -> bool:
        """Whether this process is the first of its job to say ``notice`` of ``kind`` ("pickled",
        "too large"): a warning said once per job, marked said in the cache's root, a word per
        kind; True where nothing is shared."""
        ...

    # the vectorised batch path (gather.plan, gather.columns): int keys of one layout, all in memory
    def batch_layout(self, keys: np.ndarray) -> tuple | None: ...

    def absent_ints(self, keys: np.ndarray) -> np.ndarray: ...

    def all_in_memory(self, keys: np.ndarray) -> bool: ...

    def gather_ints(self, keys: np.ndarray, out: list | None = None) -> Any: ...

    def out_matches(self, layout: tuple, n: int, out: list, dtypes: list, shapes: list) -> bool: ...

    # writes: False where the value was not admitted (full, or the lock kept by a live process)
    def put(self, key: Any, value: Any, *, encoded: Any = None) -> bool: ...

    def put_many(self, items: Sequence[tuple[Any, Any]], *, too_large: list | None = None) -> list[bool]: ...

    def put_records(self, items: Sequence[tuple[Any, Any]]) -> list[bool]: ...

    # misses computed once by whichever process claims them (NOTE [claims])
    def fill(self, key: Any, compute: Callable[[Any], Any], publish: Callable[[Any, Any], Any],
             copy: bool = True) -> Any: ...

    def fill_batch(self, keys: list, compute_many: Callable[[list], list],
                   publish_many: Callable[[list], Any], copy: bool = True) -> list: ...

    # bookkeeping and lifecycle
    def bind_fingerprint(self, fingerprint: str) -> None: ...

    def reserve_entries(self, n: int) -> None: ...

    def stats(self) -> dict: ...

    def __len__(self) -> int: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class LocalStore(Store, Protocol):
    """A store with shared memory of its own (CacheStore; a TieredStore in front of one)."""

    @property
    def meta_path(self) -> Path: ...

    def read_meta(self) -> dict: ...

    def write_meta(self, meta: dict) -> None: ...

    def record_label(self, label: str) -> None: ...

    def locked(self) -> AbstractContextManager: ...

    def portable_records(self) -> Iterator[tuple[bytes, Any]]: ...

    def destroy(self) -> None: ...
