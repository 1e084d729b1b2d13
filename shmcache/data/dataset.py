"""``ShmDatasetCache``: the public face of shmcache for PyTorch (docs/design.md §1).

It binds one named cache of a session (``store.CacheStore``) and adds what PyTorch users need:
wrapping map-style and iterable datasets, batches collated like ``default_collate`` (gathered
straight into caller buffers such as pinned memory), warm-up with a progress bar, and tensors as a
first-class sample type (shmcache.data.tensors, which the codec loads lazily where a process meets a tensor).
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import secrets
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate, get_worker_info
from torch.utils.data._utils.collate import default_collate_fn_map
from torch.utils.data._utils.fetch import _MapDatasetFetcher

from ..base import settings
from ..base.namespace import namespace, resolve_session_name, validate_name
from ..base.progress import progress_bar
from ..base.settings import ENV_REMOTE, ENV_SIZE_MB, ENV_SNAPSHOT, ENV_SPILLING
from ..base.trust import resolve_secret
from ..cache import codec
from ..cache.store import MISSING, CacheStore, UncachedStore
from ..errors import (
    CacheMismatch,
    EncodeError,
    InvalidArgument,
    InvalidKey,
    ItemNotCached,
    SessionNotFound,
    SharedMemoryFull,
    SnapshotError,
)
from ..tiers.remote import resolve as resolve_remote
from . import tensors as _torch
from .fingerprint import fingerprint, length_or_none

__all__ = ["ShmDatasetCache", "CachedDataset", "CachedIterableDataset"]

_torch.register()  # torch is imported here anyway: tensors are encoded without a lookup

log = logging.getLogger("shmcache")
_MAX_SIZE_MB = 1 << 26  # 64 TiB: anything larger is a unit mistake (bytes given as MiB)


# --- arguments ------------------------------------------------------------------------------------

_SESSIONS_SAID: set[tuple[str, str]] = set()  # (namespace, session): a new session is logged once


def _check_session(session: str, create: bool) -> None:
    """A session that does not exist: an error with create=False, else said once in the log (a
    misspelled ``session=`` would otherwise silently start an empty one)."""
    from ..cache.registry import SessionRegistry

    registry = SessionRegistry(namespace())
    if registry.exists(session):
        return
    known = ", ".join(sorted(s.name for s in registry.list()))
    if not create:
        raise SessionNotFound(f"no session {session!r} in {registry.ns.root} (sessions there: {known or 'none'}) "
                              f"and create=False; check the name, or create it (`shmcache new {session}`, "
                              f"or create=True)")
    if (str(registry.ns.root), session) in _SESSIONS_SAID:
        return
    _SESSIONS_SAID.add((str(registry.ns.root), session))
    if known:
        log.warning("session %r does not exist in %s: it is created now (sessions there: %s); if the "
                    "name is misspelled, fix it - create=False makes a missing session an error",
                    session, registry.ns.root, known)
    else:
        log.info("session %r does not exist in %s: it is created now", session, registry.ns.root)



_LABEL_CHARS = 80


def _label(dataset: Any, label: str | None) -> str:
    """``label``, else a bounded ``repr`` of the dataset (its class where the repr is object's)."""
    if label is None:
        try:
            label = repr(dataset)
        except Exception:  # noqa: BLE001 - a repr that fails must not fail wrap()
            label = ""
        if not label or type(dataset).__repr__ is object.__repr__:
            label = type(dataset).__qualname__
    label = " ".join(label.split())  # one line in a table
    return label if len(label) <= _LABEL_CHARS else label[:_LABEL_CHARS - 3] + "..."


def _check_size(size: Any, what: str = "size") -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise InvalidArgument(f"{what} must be an int number of MiB (0 = automatic), got "
                              f"{type(size).__name__} {size!r}")
    if size < 0 or size > _MAX_SIZE_MB:
        raise InvalidArgument(f"{what}={size} MiB is out of range: give 0 (80% of the memory really "
                              f"available) or a number of MiB up to {_MAX_SIZE_MB} "
                              f"(size is in MiB, not bytes)")
    return int(size)


def _size_from_env() -> int:
    raw = settings.get(ENV_SIZE_MB, "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"${ENV_SIZE_MB}={raw!r} is not an int number of MiB; set it to e.g. "
                              f"4096, or unset it") from None
    return _check_size(value, f"${ENV_SIZE_MB}")


_VERIFY_RNG = random.Random()  # its own: verify= must not shift the user's seeded random streams


def _same(a: Any, b: Any) -> bool:
    """Bit-for-bit equality of two samples (or their encodings), through the codec."""
    ea = a if isinstance(a, codec.Encoded) else codec.encode(a)
    eb = b if isinstance(b, codec.Encoded) else codec.encode(b)
    if ea.layout != eb.layout or ea.scalars != eb.scalars:
        return False
    return all(memoryview(x).cast("B") == memoryview(y).cast("B")
               for (_, x), (_, y) in zip(ea.pieces, eb.pieces))


def _default_name(dataset: Any, fingerprint: str) -> str:
    base = "".join(c if c.isalnum() or c in "_.-" else "_" for c in type(dataset).__name__)[:40]
    return validate_name(f"{base}-{fingerprint[:12]}", "cache")


# --- the cache ------------------------------------------------------------------------------------


class ShmDatasetCache:
    """One cache in shared memory, shared by every process of the machine that opens it.

    Args:
        session: ``"auto"`` (``$SHMCACHE_SESSION``, else ``"default"``) or a session name.
        name: the cache's name in the session; None: a fingerprint of the wrapped dataset, so an
            unnamed cache must ``wrap()`` a dataset before ``get``/``put``/``[]`` (which refuse
            otherwise: two unnamed caches of different functions must not share one cache).
        size: memory cap in MiB; 0 (``$SHMCACHE_SIZE_MB`` if set): the automatic cap, 80% of the
            memory really available when the session's first such cache is made, shared by
            every cache of the session made with size=0.
        spilling: when memory is full, spill to zstd files on disk (True) or stop admitting.
        spill_dir: where spill files live (default: the session's, then ``$SHMCACHE_SPILL_DIR``).
        copy: hits return private, writable copies (True, safe) or zero-copy read-only views.
        verify: the fraction of hits of a wrapped map-style dataset that are recomputed from the
            source and compared bit for bit (0: never); a difference raises CacheMismatch. An
            opt-in check that the dataset is deterministic and the cache is not stale.
        remote: a Redis tier shared by several nodes behind the shared memory (remote.py):
            ``redis://[:password@]host:port[/db]``, ``rediss://...``, ``redis+cluster://h1:p1,...``,
            ``redis+shards://h1:p1,h2:p2,...``; None: ``$SHMCACHE_REMOTE``, else the session's
            (``shmcache new NAME --remote URL``); ``""``: none.
        snapshot: a snapshot (a path, or an fsspec URL such as ``s3://bucket/snap``) read through
            on a miss before the source (snapshot/tier.py): the records a miss needs are read
            from it and admitted into shared memory. None: ``$SHMCACHE_SNAPSHOT``; ``""``: none.
            A snapshot of another dataset is refused (CacheMismatch).
        snapshot_options: ``force`` (serve a snapshot that names another dataset), ``timeout_s``
            (the longest a read may take, default 10), ``storage_options`` (for fsspec),
            ``allow_unsigned`` (with a secret: read a snapshot not signed with it, as untrusted data).
        secret: the job's secret (None: ``$SHMCACHE_SECRET``; ``""``: none; a string is used as its
            UTF-8 bytes): every value written to the remote tier carries its MAC, and only values
            with it are read from the remote tier or a snapshot (NOTE [record authentication]).
        allow_pickle: read pickled objects from a remote tier or snapshot whose values are not
            authenticated by the secret (False: such a value is a miss, computed from the source).
        create: a session that does not exist is created (True: logged once, naming the sessions
            there are, as a misspelled name would create one) or is an error (False:
            SessionNotFound, naming them).
    """

    def __init__(self, session: str = "auto", name: str | None = None, size: int = 0,
                 spilling: bool = False, spill_dir: str | os.PathLike | None = None, *,
                 copy: bool = True, verify: float = 0.0, lock_timeout_s: float = 60.0,
                 remote: str | None = None, snapshot: str | os.PathLike | None = None,
                 snapshot_options: dict | None = None, secret: str | bytes | None = None,
                 allow_pickle: bool = False, create: bool = True):
        self.session = resolve_session_name(session)
        self._secret = resolve_secret(secret)  # travels to DataLoader workers with the cache
        if not isinstance(allow_pickle, bool):
            raise InvalidArgument(f"allow_pickle must be True or False, got {allow_pickle!r}")
        self.allow_pickle = allow_pickle
        if not isinstance(create, bool):
            raise InvalidArgument(f"create must be True or False, got {create!r}")
        _check_session(self.session, create)
        if name is not None:
            validate_name(name, "cache")
        size = _check_size(size)
        if size == 0 and settings.get(ENV_SIZE_MB):
            size = _size_from_env()
        if not isinstance(spilling, bool):
            raise InvalidArgument(f"spilling must be True or False, got {spilling!r}")
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise InvalidArgument(f"spill_dir must be a path, got {type(spill_dir).__name__}")
        self.size_mb = size
        self.spilling = spilling or settings.flag(ENV_SPILLING)
        self.spill_dir = spill_dir  # None: the session's, then $SHMCACHE_SPILL_DIR (spill/tier.py)
        if spill_dir is not None and not self.spilling:  # a forgotten spilling=True: say so once
            warnings.warn(f"spill_dir={os.fspath(spill_dir)!r} has no effect without spilling=True "
                          f"(or $SHMCACHE_SPILLING=1): nothing is spilled; pass spilling=True, or drop "
                          f"spill_dir", UserWarning, stacklevel=2)
        if not isinstance(copy, bool):
            raise InvalidArgument(f"copy must be True or False, got {copy!r}")
        self.copy = copy
        if isinstance(verify, bool) or not isinstance(verify, (int, float)) or not 0 <= verify <= 1:
            raise InvalidArgument(f"verify must be a fraction of hits between 0 and 1 (e.g. 0.01), "
                                  f"got {verify!r}")
        self.verify = float(verify)
        if isinstance(lock_timeout_s, bool) or not isinstance(lock_timeout_s, (int, float)) \
                or not 0 < lock_timeout_s < float("inf"):
            raise InvalidArgument(f"lock_timeout_s must be a positive number of seconds (e.g. 60), "
                                  f"got {lock_timeout_s!r}")
        self.lock_timeout_s = float(lock_timeout_s)
        self.name = name
        self._store: CacheStore | None = None
        self._fingerprint: str | None = None
        self._closed = False
        self._warned_pickle = False  # one warning per cache object when samples are pickled
        self._source_len: int | None = None  # len() of the map-style dataset wrapped: export() records it
        self.last_import = None  # from_snapshot(): what the import stored (snapshot.load.ImportReport)
        # the namespace travels with the cache (pickled to workers): a forkserver or spawn child
        # may see another $SHMCACHE_DIR, and would otherwise build an empty twin of the cache
        self._ns_root = str(namespace().root)
        self._remote_arg = remote  # resolved with the session's when the store is opened (_open)
        if remote or (remote is None and settings.get(ENV_REMOTE)):  # a bad URL fails here
            resolve_remote(remote, None)
        self._snapshot = _snapshot_arg(snapshot, snapshot_options)  # (url, options) or None
        if self.spilling:  # a missing or unusable spill directory is an error now, not later
            from ..cache.registry import SessionRegistry
            from ..tiers.spill.tier import resolve_spill_dir

            registry = SessionRegistry(namespace())
            resolve_spill_dir(self.spill_dir, registry.ensure(self.session).spill_dir)
        if name is not None:
            self._open(name, None, 0)

    # --- binding to a store --------------------------------------------------------------------

    def _open(self, name: str, fingerprint: str | None, table_hint: int) -> CacheStore:
        if self._closed:
            raise self._closed_error()
        try:
            self._store = CacheStore(self.session, name, capacity_bytes=self.size_mb << 20,
                                     fingerprint=fingerprint, table_hint=table_hint,
                                     lock_timeout_s=self.lock_timeout_s, ns=self._ns_root)
        except SharedMemoryFull as exc:  # not even the cache's own segments fit: serve uncached
            self._store = UncachedStore(self.session, name, exc)
        self.name, self._fingerprint = name, fingerprint
        if self.spilling and not self._store.uncached:
            from ..tiers.spill import tier as spilling

            spilling.attach(self._store, self.spill_dir)
        self._attach_remote(fingerprint)
        if self._snapshot is not None:  # assembly.ORDER puts it in front of the remote tier
            self._attach_snapshot(name, fingerprint)
        return self._store

    def _attach_remote(self, fingerprint: str | None) -> None:
        """With a remote in force, the store becomes ``TieredStore(local, [RedisTier])``; without
        one it stays the local store itself (no extra call on a hit)."""
        if self._remote_arg == "":
            return
        from ..cache.registry import SessionRegistry

        registry = SessionRegistry(namespace(self._ns_root))
        session_remote = None
        if self._remote_arg is None and not settings.get(ENV_REMOTE):
            try:
                session_remote = registry.get(self.session).remote
            except SessionNotFound:  # destroyed under us: the store's next use says so
                pass
        url = resolve_remote(self._remote_arg, session_remote)
        if url is not None:
            from ..tiers import assembly, remote

            if fingerprint is None and not self._store.uncached:  # a named cache bound earlier
                fingerprint = self._store.read_meta().get("fingerprint")
            tier = remote.open_tier(self._store, url, fingerprint, registry, self._secret)
            self._store = assembly.assemble(self._store, [tier], name=self._store.name, fingerprint=fingerprint,
                                            allow_pickle=self.allow_pickle, registry=registry)

    def _attach_snapshot(self, name: str, fingerprint: str | None) -> None:
        """With a snapshot, the store becomes ``TieredStore(local, [SnapshotTier, ...])``; without
        one it stays the local store itself (no extra call on a hit)."""
        from ..cache.registry import SessionRegistry
        from ..snapshot.tier import open_tier
        from ..tiers import assembly

        if fingerprint is None and not self._store.uncached:  # a named cache bound earlier
            fingerprint = self._store.read_meta().get("fingerprint")
        local = self._store
        registry = SessionRegistry(namespace(self._ns_root))
        try:
            tier = open_tier(local, self._snapshot[0], registry, self._snapshot[1], self._secret)
            self._store = assembly.assemble(local, [tier], name=name, fingerprint=fingerprint,
                                            allow_pickle=self.allow_pickle, registry=registry)
        except BaseException:
            self._store = None
            local.close()
            raise

    @property
    def store(self) -> CacheStore:
        """The underlying store (opened on first use; see ``_ensure_open``)."""
        return self._ensure_open()

    # --- wrapping datasets ----------------------------------------------------------------------

    def wrap(self, dataset: Any, transform: Callable | None = None, *, label: str | None = None):
        """A dataset that reads through this cache: map-style or iterable, same items as ``dataset``.
        ``dataset=None``: the cache alone (imported from a snapshot), with no source behind it.
        ``label``: what `shmcache stat` shows to tell this cache from others (default: the
        dataset's ``repr``, cut to 80 characters; its class name where the repr is Python's own)."""
        if dataset is None:
            return self._wrap_without_source(transform)
        if transform is not None and not callable(transform):
            raise InvalidArgument(f"transform must be callable, got {type(transform).__name__}")
        if label is not None and not isinstance(label, str):
            raise InvalidArgument(f"label must be a str, got {type(label).__name__}")
        wrapped = self._wrap(dataset, transform)
        store = self._store
        if store is not None and not store.uncached:
            store.record_label(_label(dataset, label))
        return wrapped

    def _wrap(self, dataset: Any, transform: Callable | None):
        if isinstance(dataset, IterableDataset) or (not hasattr(dataset, "__getitem__")
                                                    and isinstance(dataset, Iterable)):
            return self._wrap_iterable(dataset, transform)
        if not hasattr(dataset, "__getitem__") or length_or_none(dataset) is None:
            raise InvalidArgument(
                f"wrap() takes a map-style dataset (with __getitem__ and __len__) or an iterable "
                f"dataset, got {type(dataset).__name__}"
            )
        n = len(dataset)
        probe = sorted({0, n // 2, n - 1}) if n else []
        samples = []  # encoded once: to check them, to fingerprint the dataset, to store them
        for i in probe:
            try:
                samples.append(codec.encode(_compute(dataset, transform, i)))
            except EncodeError as exc:
                raise EncodeError(f"sample {i} of {type(dataset).__name__}: {exc}") from None
        if samples and not _same(samples[0], _compute(dataset, transform, probe[0])):
            raise InvalidArgument(
                f"{type(dataset).__name__}[0] differs between two reads: the dataset (or transform) "
                f"is random, and a cache would freeze one draw; cache the deterministic part "
                f"(cache.wrap(ds, transform=decode)) and apply random augmentation on top"
            )
        self._bind(dataset, transform, samples, table_hint=n)
        self._source_len = n
        for i, enc in zip(probe, samples):  # computed anyway: keep them
            self._put(self._store, i, None, enc)
        return CachedDataset(self, dataset, transform)

    def _wrap_without_source(self, transform: Callable | None) -> CachedDataset:
        """``wrap(None)``: a map-style dataset of what the cache holds, as long as the dataset it
        was made from (recorded by the snapshot import, or in the manifest of ``snapshot=``, which
        also names an unnamed cache and gives it the snapshot's identity); an item in neither is
        ItemNotCached."""
        if transform is not None:
            raise InvalidArgument("wrap(None, transform=...) has no source for the transform to apply "
                                  "to; the cache's items are served as stored: drop transform=")
        manifest = None
        if self._store is None and self.name is None:
            if self._snapshot is None:
                raise InvalidArgument(
                    f"wrap(None) serves a cache without its source dataset, but this ShmDatasetCache in "
                    f"session {self.session!r} names none: give name= of the cache (as `shmcache import` "
                    f"named it), or snapshot=URL to serve a snapshot read through")
            from ..snapshot.tier import manifest_of

            manifest = manifest_of(*self._snapshot, secret=self._secret)
            self._open(manifest.name, manifest.fingerprint, manifest.length or manifest.items)
        store = self._ensure_open()
        meta = store.read_meta() if not store.uncached else {}
        length = meta.get("length")
        if manifest is None and self._snapshot is not None:
            from ..snapshot.tier import snapshot_tier

            tier = snapshot_tier(store)
            manifest = tier.manifest if tier is not None else None
        if manifest is not None and not (isinstance(length, int) and not isinstance(length, bool)):
            if manifest.length is None:
                from ..base.urls import mask_url

                raise InvalidArgument(
                    f"wrap(None) serves a dataset of the snapshot's length, but the snapshot at "
                    f"{mask_url(self._snapshot[0])} holds get()/put() values (exported from "
                    f"{manifest.session}/{manifest.name}, no wrapped dataset, no length): read them "
                    f"by key, cache.get(key) and cache.get_batch(keys)")
            length = manifest.length
            if self._fingerprint is None and manifest.fingerprint and meta.get("fingerprint") is None:
                store.bind_fingerprint(manifest.fingerprint)  # this cache holds the snapshot's dataset
            meta = {**meta, "fingerprint": meta.get("fingerprint") or manifest.fingerprint}
        if not isinstance(length, int) or isinstance(length, bool) or length < 0:
            if self._snapshot is not None and manifest is None:
                from ..base.urls import mask_url

                raise SnapshotError(
                    f"wrap(None) serves cache {self.session}/{self.name} at the length that the manifest "
                    f"of snapshot={mask_url(self._snapshot[0])} records, but the manifest cannot be read "
                    f"now (the store does not answer: see the log); try again when it answers")
            raise InvalidArgument(
                f"wrap(None) serves cache {self.session}/{self.name} without its source, but the cache "
                f"does not record the length of its dataset (it was not imported from a snapshot of a "
                f"wrapped map-style dataset); import one (ShmDatasetCache.from_snapshot, `shmcache "
                f"import`), pass snapshot=URL of one, or wrap the dataset itself")
        if self._fingerprint is None and meta.get("fingerprint"):
            self._tiers_learn(meta["fingerprint"])  # imported by another process since we opened it
            self._fingerprint = meta["fingerprint"]  # wrap(another dataset) later is refused
        self._source_len = length  # export() records it
        return CachedDataset(self, _NoSource(self.session, self.name, length), None)

    @classmethod
    def from_snapshot(cls, src: str | os.PathLike, session: str = "auto", name: str | None = None,
                      size: int = 0, spilling: bool = False, spill_dir: str | os.PathLike | None = None, *,
                      force: bool = False, threads: int | None = None, progress: bool | None = None,
                      storage_options: dict | None = None, allow_unsigned: bool = False,
                      **kwargs: Any) -> ShmDatasetCache:
        """A cache filled from the snapshot at ``src`` (a path or an fsspec URL, e.g. ``s3://b/snap``):
        named as the exported cache unless ``name=`` is given; ``wrap(None)`` then serves it with no
        source. A cache of that name holding another dataset is refused (CacheMismatch) unless
        ``force=True``, which replaces its contents. ``last_import`` says what was stored: items that
        did not fit the cap (spilled with ``spilling=True``, else left out), records skipped as
        damaged. With a secret (``secret=``, ``$SHMCACHE_SECRET``) only a snapshot signed with it is
        imported unless ``allow_unsigned=True``; pickled objects of a snapshot that is not signed are
        skipped unless ``allow_pickle=True`` (NOTE [record authentication]). Other keyword arguments
        go to ShmDatasetCache."""
        from ..snapshot.load import import_into, read_manifest, replace_other_dataset

        loc, manifest = read_manifest(src, storage_options)
        from ..snapshot.format import MANIFEST, authenticate

        # refused before a cache is made: a snapshot not signed with the job's secret
        authenticate(manifest, resolve_secret(kwargs.get("secret")), allow_unsigned, loc.where(MANIFEST))
        cache = cls(session, name or manifest.name, size, spilling, spill_dir, **kwargs)
        try:
            if replace_other_dataset(cache.store, manifest, force):  # destroyed: a new incarnation
                cache.close()
                cache = cls(session, name or manifest.name, size, spilling, spill_dir, **kwargs)
            cache.last_import = import_into(cache.store, loc, manifest, force=force, threads=threads,
                                            progress=progress, secret=cache._secret or "",
                                            allow_pickle=cache.allow_pickle, allow_unsigned=allow_unsigned)
            if manifest.fingerprint:  # the tiers were opened before the import named the dataset
                cache._tiers_learn(manifest.fingerprint)
                cache._fingerprint = manifest.fingerprint
        except BaseException:
            cache.close()
            raise
        return cache

    def export(self, dest: str | os.PathLike, *, overwrite: bool = False, segment_bytes: int | None = None,
               progress: bool | None = None, storage_options: dict | None = None):
        """Write this cache's items to a snapshot at ``dest`` (a new directory, or an fsspec URL such
        as ``s3://bucket/snap``); ``overwrite=True`` replaces a snapshot there. Returns a report
        (items, bytes, seconds). Import it anywhere with ``ShmDatasetCache.from_snapshot(dest)`` or
        ``shmcache import``."""
        from ..snapshot import format as snapshot_format
        from ..snapshot.export import export_cache

        return export_cache(self.store, dest, overwrite=overwrite, length=self._source_len,
                            segment_bytes=segment_bytes or snapshot_format.DEFAULT_SEGMENT_BYTES,
                            progress=progress, storage_options=storage_options, secret=self._secret or "")

    def _wrap_iterable(self, dataset: Iterable, transform: Callable | None) -> CachedIterableDataset:
        """With a name, the stream is not read here. Without one, its first 16 items name the
        cache (with the dataset's attributes, NOTE [fingerprint]); they are read from the
        iterator the first pass then goes on with, so a stream that cannot be read twice (a
        queue, a socket behind ``__iter__``) loses nothing."""
        one_shot = isinstance(dataset, Iterator)  # (calling iter() would open a stream)
        if self.name is not None or self._fingerprint is not None:
            self._bind(dataset, transform, [], table_hint=0)
            return CachedIterableDataset(self, dataset, transform, one_shot=one_shot)
        if one_shot:
            raise InvalidArgument(
                f"wrap() of a one-shot iterator ({type(dataset).__name__}) needs a name: without "
                f"one the cache would be named after its first items, which two different streams "
                f"can share; give ShmDatasetCache(name=...) (the stream is then not read until the "
                f"first pass), or wrap a re-iterable dataset (an IterableDataset or a container)"
            )
        it = iter(dataset)
        head = list(itertools.islice(it, 16))
        samples = [codec.encode(transform(x) if transform else x) for x in head]
        self._bind(dataset, transform, samples, table_hint=0)
        wrapped = CachedIterableDataset(self, dataset, transform)
        wrapped._pending = (os.getpid(), head, it)  # the first pass of this process starts with them
        return wrapped

    def _bind(self, dataset, transform, samples, table_hint: int) -> None:
        fp = fingerprint(dataset, transform, samples)
        if self._store is None:
            self._open(self.name or _default_name(dataset, fp), fp, table_hint)
        elif self._fingerprint is None:  # opened by name before any dataset: this one is its dataset
            self._tiers_learn(fp)  # a snapshot of another dataset: refused
            self._store.bind_fingerprint(fp)
            self._fingerprint = fp
        elif self._fingerprint != fp:
            raise InvalidArgument(
                f"this ShmDatasetCache already caches another dataset in {self.session}/"
                f"{self.name}; wrap each dataset with its own ShmDatasetCache(...)"
            )

    def _tiers_learn(self, fp: str) -> None:
        """The cache's dataset became known after its tiers were opened (a wrap() of a cache
        opened by name, an import): a snapshot tier checks it (CacheMismatch), and a remote tier
        takes the identity every other process of this dataset uses (NOTE [remote tier]) - under
        the bare name it would share nothing with them, and meet another dataset of that name."""
        from ..tiers import assembly

        assembly.bind(self._store, self.name, fp)

    # --- single items ----------------------------------------------------------------------------

    def get(self, key: int | str | bytes, fn: Callable | None = None) -> Any:
        """The cached value of ``key``; on a miss ``fn(key)``, stored (KeyError if ``fn`` is None)."""
        store = self._store
        if store is None:
            store = self._ensure_open()
        value = store.lookup(key, self.copy)
        if value is not MISSING:
            return value
        if fn is None:
            raise KeyError(key)
        value = fn(key)
        self.put(key, value)
        return value

    def put(self, key: int | str | bytes, value: Any) -> bool:
        """Store ``value`` under ``key`` (kept if present). False if the cache was full."""
        return self._put(self.store, key, value)

    def _put(self, store: CacheStore, key: Any, value: Any, enc: codec.Encoded | None = None) -> bool:
        """``store.put``, warning once per cache when a sample had to be pickled."""
        if enc is None:
            enc = codec.encode(value, f"the value of key {key!r}")
        if enc.pickled and not self._warned_pickle:
            self._warn_pickled(enc.pickled)
        return store.put(key, None, encoded=enc)

    def _warn_pickled(self, types: tuple) -> None:
        self._warned_pickle = True
        warnings.warn(
            f"cache {self.session}/{self.name}: samples holding {', '.join(types)} are stored with "
            f"pickle: slower to store and read than arrays, often larger, and never zero-copy or "
            f"gathered as a batch; return numpy arrays or tensors from the dataset or transform "
            f"(np.asarray(x), torch.as_tensor(x)) (warned once per cache)",
            UserWarning, stacklevel=3)

    def __getitem__(self, key):
        return self.get(key)

    def __contains__(self, key) -> bool:
        return self.store.contains(key)

    def __len__(self) -> int:
        return len(self.store)

    # --- batches -----------------------------------------------------------------------------------

    def get_batch(self, keys: Sequence, fn: Callable | None = None, out: Any = None) -> Any:
        """Values of ``keys`` collated like ``default_collate`` (stacked tensors).

        Misses are computed with ``fn(key)`` and stored, or raise a KeyError naming them. With
        ``out`` (a structure of tensors shaped like the batch, e.g. pinned buffers), the batch is
        gathered straight into it and ``out`` is returned.
        """
        if len(keys) == 0:
            raise InvalidArgument("get_batch() needs at least one key; got an empty sequence")
        store = self.store
        ints = _as_int_keys(keys)
        if ints is not None:  # the vectorised path: every key cached, one layout, in memory
            batch = self._gather(store, ints, out)
            if batch is not None:
                return batch
        values, missing = store.lookup_batch(keys, self.copy)
        if missing:
            if fn is None:
                raise KeyError(f"{len(missing)} of {len(keys)} keys are not cached: "
                               f"{[keys[i] for i in missing[:10]]}; pass fn= to compute them")
            for i in missing:
                values[i] = fn(keys[i])
                self._put(store, keys[i], values[i])
        batch = default_collate(values)
        if out is not None:
            _copy_into(out, batch)
            return out
        return batch

    def _gather(self, store: CacheStore, keys: np.ndarray, out: Any):
        arrays = None
        if out is not None:
            layout = store.batch_layout(keys)
            if layout is None:
                return None
            # out's leaves in the record's order: a dict out is matched by key, never by position
            arrays, dtypes, shapes = _out_leaves(_flatten_like(out, layout[0]))
            if not store.out_matches(layout, len(keys), arrays, dtypes, shapes):  # another dtype/shape:
                batch = self._gather(store, keys, None)               # convert, like copy_ does
                if batch is not None:
                    _copy_into(out, batch)
                    return out
                return None
        got = store.gather_ints(keys, arrays)
        if got is None:
            return None
        tree, leaves, columns = got
        if out is not None:
            return out
        return _build_collated(tree, [_to_tensor(c, leaf) for c, leaf in zip(columns, leaves)], False)

    def _gather_collated(self, store: CacheStore, keys: np.ndarray, sent_from: Any = None) -> Any:
        """The batch of int ``keys`` exactly as ``default_collate`` makes it from the samples
        (NOTE [collated batch]), gathered by the vectorised path; None when the batch is not all
        cached in memory with one layout, or holds a field default_collate would not stack the
        same way (None, pickled objects, dtypes torch lacks): the caller then goes item by item.
        ``sent_from``: the CachedDataset asking, in a DataLoader worker (see the code)."""
        layout = store.batch_layout(keys)
        if layout is None:
            return None
        tree, leaves = layout[:2]
        dtypes = [_collated_dtype(leaf) for leaf in leaves]
        if None in dtypes:
            return None
        if sent_from is not None:
            # in a DataLoader worker: a warm batch crosses the queue as its keys, and the main
            # process gathers it from the cache itself (NOTE [collated batch])
            return _Keys(sent_from, keys) if store.all_in_memory(keys) else None
        got = store.gather_ints(keys)
        if got is None:
            return None
        columns = [c if d is str else _to_tensor(c, leaf) for c, leaf, d in zip(got[2], leaves, dtypes)]
        return _build_collated(tree, columns, False)

    # --- housekeeping --------------------------------------------------------------------------

    def warmup(self, dataset: Any, progress: bool = True, desc: str | None = None) -> int:
        """Fill the cache with every item of ``dataset`` (wrapped or not); returns items computed.

        Only local rank 0 (``$LOCAL_RANK`` unset or 0) draws the progress bar.

        Each local rank starts at its own offset and skips what is already cached, so N processes
        warming up together compute each item about once.
        """
        ds = dataset if isinstance(dataset, (CachedDataset, CachedIterableDataset)) else self.wrap(dataset)
        rank = int(settings.get(settings.ENV_LOCAL_RANK, "0"))
        progress = bool(progress) and rank == 0  # one bar per machine, not one per process (None: none)
        if isinstance(ds, CachedIterableDataset):
            count = 0
            for _ in progress_bar(progress, None, desc or f"warmup {self.name}", iterable=ds, notebook=True):
                count += 1
            return count
        n = len(ds)
        if self.store.uncached:  # nowhere to keep them (logged when it was opened)
            return 0
        world = max(1, int(settings.get(settings.ENV_LOCAL_WORLD_SIZE, "1")))
        start = (n * rank) // world
        order = np.concatenate([np.arange(start, n), np.arange(0, start)]).astype(np.int64)
        store, computed = self.store, 0
        bar = progress_bar(progress, n, desc or f"warmup {self.name}", notebook=True)
        try:
            for lo in range(0, n, 4096):
                chunk = order[lo:lo + 4096]
                absent = store.absent_ints(chunk).tolist()
                if absent and getattr(store, "behind", None):  # what another node computed: read it
                    absent = _not_behind(store, absent)
                if bar is not None:
                    bar.update(len(chunk) - len(absent))  # cached already: done
                for i in absent:
                    if not store.contains(i):
                        self._put(store, i, ds._compute(i))
                        computed += 1
                    if bar is not None:
                        bar.update(1)  # as each is stored (tqdm redraws at most 10 times a second)
        finally:
            if bar is not None:
                bar.close()  # on Ctrl-C too: the bar's last line is the count stored
        return computed

    def stats(self) -> dict:
        """Counters shared by every process (keys: docs/design.md §10); with a remote or a snapshot
        tier, also its ``remote_*`` or ``snapshot_*`` counters and the seam's ``tier_*``, summed over
        every process (tiers.assembly: the keys of ``shmcache stat --json`` too)."""
        from ..tiers import assembly

        return assembly.stats(self.store)

    def clear(self) -> None:
        self.store.clear()

    def close(self) -> None:
        """Unmap this process's view and detach from the session (its liveness slot is released
        once no other open cache of this process uses the session, so ``shmcache destroy`` works
        without ``--force``). The cache itself stays for others. This object and the datasets it
        wrapped are then unusable: every use raises; open a new ShmDatasetCache."""
        self._closed = True
        store, self._store = self._store, None
        if store is not None:
            store.close()

    def _closed_error(self) -> InvalidArgument:
        return InvalidArgument(
            f"this ShmDatasetCache ({self.session}/{self.name or 'unnamed'}) was closed; create a "
            f"new one (ShmDatasetCache(session={self.session!r}, name={self.name!r})) to use the "
            f"cache again")

    def __enter__(self) -> ShmDatasetCache:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:  # never the secret
        return f"ShmDatasetCache(session={self.session!r}, name={self.name!r}, size={self.size_mb})"

    # --- pickling (DataLoader workers re-attach lazily by name) ------------------------------

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_store"] = None
        return state

    def _ensure_open(self) -> CacheStore:
        """The store, re-attached by name in a process that received this cache pickled."""
        if self._store is None:
            if self._closed:
                raise self._closed_error()
            if self.name is None:
                raise InvalidArgument(
                    f"this ShmDatasetCache in session {self.session!r} has no name, and get(), "
                    f"put(), [], len() and stats() cannot tell which function or dataset its "
                    f"values come from (two unnamed caches would share one cache); give it one: "
                    f"ShmDatasetCache(name='train'), or wrap(dataset) first (it is then named "
                    f"after the dataset)")
            self._open(self.name, self._fingerprint, 0)
        return self._store


def _snapshot_arg(snapshot: Any, options: dict | None) -> tuple[str, dict] | None:
    """``snapshot=`` and ``snapshot_options=`` checked: (url, options), or None for no snapshot."""
    from ..snapshot.tier import check_options

    if snapshot is None:
        snapshot = settings.get(ENV_SNAPSHOT, "").strip()
    if snapshot is not None and not isinstance(snapshot, (str, os.PathLike)):
        raise InvalidArgument(f"snapshot must be a path or a URL (e.g. 's3://bucket/snap'), got "
                              f"{type(snapshot).__name__}")
    options = check_options(options)
    if not os.fspath(snapshot):
        if options:
            warnings.warn("snapshot_options has no effect without snapshot= (or $SHMCACHE_SNAPSHOT); "
                          "pass snapshot=URL, or drop snapshot_options", UserWarning, stacklevel=3)
        return None
    return os.fspath(snapshot), options


# --- wrapped datasets -----------------------------------------------------------------------------


def _not_behind(store, keys: list, per_trip: int = 256) -> list:
    """The ``keys`` that the tiers behind ``store`` lack too; those they have are admitted into
    shared memory on the way (a bounded batch per round trip: values may be large)."""
    out = []
    for lo in range(0, len(keys), per_trip):
        part = keys[lo:lo + per_trip]
        out += [part[j] for j in store.lookup_batch(part, False)[1]]
    return out


class _NoSource:
    """What ``wrap(None)`` wraps: a dataset of a known length whose items are only in the cache."""

    def __init__(self, session: str, name: str, length: int):
        self.session, self.name, self.length = session, name, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, i: int):
        raise ItemNotCached(
            f"item {i!r} is not in cache {self.session}/{self.name}, and the cache has no source "
            f"(wrap(None)) to compute it from; import the whole snapshot into it (if the import said "
            f"items did not fit, give the cache a larger size= or spilling=True), or wrap the dataset "
            f"itself so that missing items are computed")


def _compute(dataset, transform, index):
    sample = dataset[index]
    return transform(sample) if transform is not None else sample


class CachedDataset(Dataset):
    """A map-style dataset whose items come from the cache (computed once, by any process)."""

    def __init__(self, cache: ShmDatasetCache, dataset: Any, transform: Callable | None):
        self.cache = cache
        self.dataset = dataset
        self.transform = transform
        self._len = len(dataset)
        # names this dataset to the main process when a worker sends a batch as its keys (NOTE
        # [collated batch]); copies pickled to workers keep it
        self._token = secrets.token_hex(8)
        _register(self)

    def __len__(self) -> int:
        return self._len

    def _index(self, i: Any) -> int:
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
            if isinstance(i, torch.Tensor) and i.numel() == 1 and not (
                    i.dtype == torch.bool or i.is_floating_point() or i.is_complex()):
                i = int(i)
            elif isinstance(i, np.ndarray) and i.ndim == 0 and i.dtype.kind in "iu":  # as cache.get takes it
                i = int(i)
            else:
                raise TypeError(f"dataset indices must be integers, not {type(i).__name__}")
        i = int(i)
        if i < 0:
            i += self._len
        if not 0 <= i < self._len:
            raise IndexError(f"index {i} out of range for a dataset of {self._len} items")
        return i

    def _indices(self, indices: Any) -> np.ndarray:
        """A batch of indices as int64, negatives wrapped and bounds checked in one numpy pass
        (the batch path must not pay a Python call per index)."""
        if type(indices) is list:  # a sampler's list of ints: fromiter is 3x faster than asarray
            arr = _plain_ints(indices)
        else:
            arr = _integer_array(indices, "dataset indices", TypeError)
        if arr is None:  # a list: fine if numpy makes it an integer array, else one by one
            arr = np.asarray(indices)
            if arr.dtype.kind not in "iu" or arr.ndim != 1:
                return np.fromiter((self._index(i) for i in indices), np.int64)
        arr = _as_int64(arr, lambda i: IndexError(f"index {i} out of range for a dataset of {self._len} items"))
        if not arr.size or (arr.min() >= 0 and arr.max() < self._len):  # the common case: 2 reductions
            return arr
        arr = np.where(arr < 0, arr + self._len, arr)
        bad = (arr < 0) | (arr >= self._len)
        if bad.any():
            raise IndexError(f"index {int(np.asarray(indices)[bad][0])} out of range for a dataset "
                             f"of {self._len} items")
        return arr

    def _compute(self, i: int) -> Any:
        return _compute(self.dataset, self.transform, int(i))

    def _store_computed(self, store: CacheStore, i: int, value: Any) -> None:
        try:
            self.cache._put(store, i, value)
        except EncodeError as exc:
            raise EncodeError(f"sample {i} of {type(self.dataset).__name__}: {exc}") from None

    def __getitem__(self, i):
        if type(i) is not int or not 0 <= i < self._len:  # a plain index needs no more checks
            if isinstance(i, list) or (isinstance(i, np.ndarray) and i.ndim) or (
                    isinstance(i, torch.Tensor) and i.dim() == 1):
                # DataLoader(ds, sampler=BatchSampler(...), batch_size=None): a whole batch per
                # call, collated by the vectorised path (the DataLoader then does no collation)
                return self.get_batch(i)
            i = self._index(i)
        cache = self.cache
        store = cache._store if cache._store is not None else cache._ensure_open()
        value = store.lookup(i, cache.copy)
        if value is MISSING:
            value = self._compute(i)
            self._store_computed(store, i, value)
        elif cache.verify and _VERIFY_RNG.random() < cache.verify:
            self._verify(i, value)
        return value

    def _verify(self, i: int, cached: Any) -> None:
        if not _same(cached, self._compute(i)):
            raise CacheMismatch(
                f"sample {i} of {type(self.dataset).__name__} differs from its cached copy in "
                f"{self.cache.session}/{self.cache.name}: the dataset changed since it was cached, "
                f"or it is not deterministic; drop the stale cache (cache.clear()), and keep random "
                f"augmentation outside the cache"
            )

    def __getitems__(self, indices: Sequence) -> list:
        """The DataLoader's batch hook: the batch gathered by the vectorised path when the
        DataLoader collates with default_collate (NOTE [collated batch]); else the samples from
        one batch lookup. Misses are computed and stored."""
        idx = self._indices(indices)
        cache = self.cache
        store = cache._ensure_open()
        if not cache.verify and _collates_by_default(sys._getframe(1)):
            batch = cache._gather_collated(store, idx, self if get_worker_info() is not None else None)
            if batch is not None:
                return [_Collated(batch)] * len(idx)
        return self._samples(idx)

    def _samples(self, keys: np.ndarray) -> list:
        """The samples of ``keys`` from one batch lookup (verified if asked); misses computed and stored."""
        cache = self.cache
        store = cache._ensure_open()
        idx = keys.tolist()
        values, missing = store.lookup_batch(idx, cache.copy)
        if cache.verify:
            hits = set(range(len(idx))) - set(missing)
            for j in hits:
                if _VERIFY_RNG.random() < cache.verify:
                    self._verify(idx[j], values[j])
        for j in missing:
            values[j] = self._compute(idx[j])
            self._store_computed(store, idx[j], values[j])
        return values

    def get_batch(self, indices: Sequence, fn: Callable | None = None, out: Any = None) -> Any:
        """A collated batch (the vectorised path), misses computed from the dataset (or ``fn``).

        Same signature as ``ShmDatasetCache.get_batch``, so a wrapped dataset can feed
        ``PrefetchRing.from_cache(ds, key_batches)`` directly.
        """
        return self.cache.get_batch(self._indices(indices), fn=fn or self._compute, out=out)

    def __getstate__(self) -> dict:
        return self.__dict__.copy()  # the cache pickles by name (ShmDatasetCache.__getstate__)

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        _register(self)  # a worker's copy, or a copy made in this process: either serves the token


class CachedIterableDataset(IterableDataset):
    """An iterable dataset: the first full pass records, later passes replay from the cache.

    Each stream (rank x DataLoader worker) records its own sequence under its own keys, with a
    completion marker written only after a full pass; a pass that was cut short, or finds an item
    missing, reads the source again and fills the gaps.

    DataLoader workers: each worker gets its own copy of the dataset and records what *its* copy
    yields, under its own keys (``RANK.<worker id>of<num_workers>``). An unsharded stream is thus
    read, yielded and stored once per worker (what PyTorch does with any IterableDataset), so
    shard it in the source's ``__iter__`` with ``torch.utils.data.get_worker_info()`` (for example
    ``itertools.islice(items, info.id, None, info.num_workers)``); a different ``num_workers`` (or
    world size) records anew.
    """

    def __init__(self, cache: ShmDatasetCache, dataset: Iterable, transform: Callable | None,
                 one_shot: bool = False):
        self.cache = cache
        self.dataset = dataset
        self.transform = transform
        self._one_shot = one_shot  # a plain iterator: one pass of the source, ever
        self._pending: tuple[int, list, Any] | None = None  # pid, items wrap() read, their iterator

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_pending"] = None  # the items wrap() read belong to this process's first pass
        return state

    def _source(self):
        """The source for a recording pass: the items wrap() read, then the rest of their
        iterator (first pass in this process), else a fresh iterator of the dataset."""
        pending, self._pending = self._pending, None
        # not in a DataLoader worker, even a forked one that inherited it: a worker opens its own
        # iterator (a source that shards by get_worker_info() must see the worker)
        if pending is not None and pending[0] == os.getpid() and get_worker_info() is None:
            return itertools.chain(pending[1], pending[2])
        if self._one_shot:
            if getattr(self, "_consumed", False):
                raise InvalidArgument(
                    f"the one-shot iterator ({type(self.dataset).__name__}) wrapped as "
                    f"{self.cache.session}/{self.cache.name} was read once already, and the cache "
                    f"does not hold all of it (the first pass stopped early, or the cache was "
                    f"full), so it cannot be replayed; wrap a re-iterable dataset (an "
                    f"IterableDataset or a container), or finish the first pass")
            self._consumed = True
        return iter(self.dataset)

    def _stream(self) -> str:
        info = get_worker_info()
        worker = f"{info.id}of{info.num_workers}" if info is not None else "main"
        return f"{settings.get(settings.ENV_RANK, '0')}.{worker}"

    def __iter__(self):
        store = self.cache._ensure_open()
        stream = self._stream()
        marker = f"__stream__:{stream}"
        total = store.lookup(marker, count=False)
        if total is not MISSING:
            self._pending = None
            for i in range(total):
                value = store.lookup(f"{stream}:{i}", self.cache.copy)
                if value is MISSING:
                    yield from self._record(store, stream, marker, skip=i)
                    return
                yield value
            return
        yield from self._record(store, stream, marker, skip=0)

    def _record(self, store: CacheStore, stream: str, marker: str, skip: int):
        count = 0
        for i, sample in enumerate(self._source()):
            count = i + 1
            if i < skip:
                continue  # already yielded from the cache in this pass
            value = self.transform(sample) if self.transform is not None else sample
            self.cache._put(store, f"{stream}:{i}", value)
            yield value
        store.put(marker, count)  # only after a full pass


# --- the DataLoader's default collation (NOTE [collated batch]) ------------------------------------

# NOTE [collated batch]
#     ``DataLoader(ds, batch_size=B)`` calls ``ds.__getitems__(indices)`` and hands what it returns
#     to its ``collate_fn`` (torch.utils.data._utils.fetch._MapDatasetFetcher.fetch). Samples one by
#     one, stacked again by default_collate, cost 5-10x the vectorised gather. So when the caller is
#     torch's fetcher and its collate_fn is default_collate itself, __getitems__ gathers the batch
#     already collated and returns it as a list of n references to one ``_Collated`` marker;
#     default_collate looks only at ``type(batch[0])``, finds ``_Collated`` in its
#     ``default_collate_fn_map`` (registered below: a private type, so nobody else's collation
#     changes) and returns the batch. ``_gather_collated`` builds exactly what default_collate would
#     (dtypes, shapes, dict/list/tuple types), and refuses (None: item by item) what it cannot.
#     Any other caller - a custom collate_fn, a wrapper around default_collate, a direct call, a
#     torch whose fetcher looks different - gets the plain list of samples, as before.
#
#     In a DataLoader worker the collated batch would cross the worker's queue pickled: tensors
#     moved to a new shared-memory segment, sent by file descriptor, mapped again by the main
#     process - more work than the gather itself, for data that is in shared memory already. So a
#     worker that finds every key of a batch in memory with one layout (store.all_in_memory)
#     returns a ``_Keys`` batch instead: it pickles as the dataset's token and the keys, and
#     unpickling it in the main process (or its pin-memory thread) gathers the batch there, from
#     the CachedDataset registered under that token (``_LIVE``). If the cache lost items meanwhile
#     (clear()), the main process reads them item by item, computing misses. A worker's own
#     misses, cold epochs and every other sample type are computed in the worker as before.


class _Collated:
    """Every element of a batch that __getitems__ returned already collated."""

    __slots__ = ("batch",)

    def __init__(self, batch: Any):
        self.batch = batch


def _collate_gathered(batch: list, *, collate_fn_map: dict | None = None) -> Any:
    return batch[0].batch


default_collate_fn_map[_Collated] = _collate_gathered

# token -> the CachedDatasets of this process that carry it (copies of one dataset, same cache)
_LIVE: dict[str, weakref.WeakSet] = {}


def _register(ds: CachedDataset) -> None:
    _LIVE.setdefault(ds._token, weakref.WeakSet()).add(ds)


class _Keys:
    """A warm batch in a worker: pickled as its keys, gathered where it is unpickled."""

    __slots__ = ("ds", "keys")

    def __init__(self, ds: CachedDataset, keys: np.ndarray):
        self.ds, self.keys = ds, keys

    def __reduce__(self):
        return _gather_sent, (self.ds._token, self.keys.tobytes())


def _gather_sent(token: str, raw: bytes) -> Any:
    """Unpickling a ``_Keys`` batch: gather it here (NOTE [collated batch])."""
    ds = next(iter(_LIVE.get(token, ())), None)
    if ds is None:  # the DataLoader holds its dataset: only a process that is not its parent gets here
        raise InvalidArgument(f"a DataLoader batch arrived for a CachedDataset (token {token}) "
                              f"that this process no longer holds; keep the dataset alive while "
                              f"its DataLoader runs")
    keys = np.frombuffer(raw, np.int64)
    store = ds.cache._ensure_open()
    batch = ds.cache._gather_collated(store, keys)
    if batch is None:  # cleared since the worker looked: item by item, computing misses
        batch = default_collate(ds._samples(keys))
    return batch

_FETCH_CODE = getattr(getattr(_MapDatasetFetcher, "fetch", None), "__code__", None)


def _collates_by_default(frame: Any) -> bool:
    """True if ``frame`` (__getitems__'s caller) is torch's map-style fetcher collating with
    default_collate (NOTE [collated batch])."""
    if frame.f_code is not _FETCH_CODE:
        return False
    fetcher = frame.f_locals.get("self")
    return getattr(fetcher, "collate_fn", None) is default_collate


_TORCH_DTYPES: dict[str, Any] = {}


def _collated_dtype(leaf: codec.Leaf) -> Any:
    """The torch dtype default_collate gives a column of ``leaf`` (str for str/bytes: a list of
    them), or None where its result would differ from a stacked column (None, pickled objects) or
    torch has no such dtype (default_collate raises there: the item-by-item path lets it)."""
    tag = leaf.tag
    if tag in ("s", "y"):
        return str
    if tag == "e":  # tensors; other registered types (PIL images) are not stacked by default_collate
        return getattr(torch, leaf.meta.split(":", 1)[0], None) if leaf.ext == "torch" else None
    if tag not in ("i", "f", "b", "a"):
        return None
    key = leaf.dtype.str
    if key not in _TORCH_DTYPES:
        try:
            _TORCH_DTYPES[key] = torch.from_numpy(np.empty(0, leaf.dtype)).dtype
        except (TypeError, ValueError):
            _TORCH_DTYPES[key] = None
    return _TORCH_DTYPES[key]


def _build_collated(tree: tuple, columns: list, in_sequence: bool) -> Any:
    """default_collate's structure: a list for tuples and lists, a dict for dicts; str and bytes
    fields stay a list of them - a tuple inside a tuple or list sample (it transposes with zip)."""
    tag = tree[0]
    if tag == "leaf":
        column = columns[tree[1]]
        return tuple(column) if in_sequence and isinstance(column, list) else column
    if tag in ("T", "L"):
        return [_build_collated(c, columns, True) for c in tree[1]]
    return {k: _build_collated(c, columns, False) for k, c in tree[1]}


# --- collation helpers ---------------------------------------------------------------------------


_INT64_MAX = np.iinfo(np.int64).max


def _integer_array(values: Any, what: str, error: type[Exception]) -> np.ndarray | None:
    """An ndarray or tensor of ``what`` as a 1-D integer numpy array (None for anything else, such
    as a list). Raises ``error`` naming the problem for bool, float or complex values and for
    arrays that are not 1-D: a float array silently truncated to ints would read other items."""
    if isinstance(values, torch.Tensor):
        if values.dtype == torch.bool or values.is_floating_point() or values.is_complex():
            raise error(f"{what} must be integers, not a tensor of {values.dtype}")
        values = values.cpu().numpy()
    if not isinstance(values, np.ndarray):
        return None
    if values.dtype.kind not in "iu":
        raise error(f"{what} must be integers, not an array of {values.dtype}"
                    + ("; pass str keys as a list" if values.dtype.kind in "US" else ""))
    if values.ndim != 1:
        raise error(f"{what} must be a 1-D sequence, not an array of shape {tuple(values.shape)}")
    return values


def _as_int64(values: np.ndarray, out_of_range: Callable[[int], Exception]) -> np.ndarray:
    """``values`` as int64; a uint64 above 2**63-1 raises ``out_of_range(value)`` instead of
    wrapping around to a negative number (which would silently read another item)."""
    if values.dtype.kind == "u" and values.dtype.itemsize == 8 and values.size:
        big = values > _INT64_MAX
        if big.any():
            raise out_of_range(int(values[big][0]))
    return values.astype(np.int64, copy=False)


def _as_int_keys(keys: Sequence) -> np.ndarray | None:
    """Cache keys as one int64 array for the vectorised path, or None for keys looked up one by
    one (str, bytes, mixed, or ints beyond 64 bits: those raise InvalidKey there)."""
    arr = _integer_array(keys, "an array of cache keys", InvalidKey)
    if arr is not None:
        return _as_int64(arr, lambda k: InvalidKey(
            f"int key {k} does not fit in a signed 64-bit integer; use a str key (str({k}))"))
    return _plain_ints(keys)


def _plain_ints(keys: Sequence) -> np.ndarray | None:
    """``keys`` as int64 if every one is a plain int that fits; else None."""
    try:
        if all(type(k) is int for k in keys):
            return np.fromiter(keys, np.int64, len(keys))
    except (OverflowError, TypeError):
        return None
    return None


def _to_tensor(column: Any, leaf: codec.Leaf) -> Any:
    if column is None or isinstance(column, list):
        return column
    if leaf.tag == "e":
        from_parts = codec.ext_from_parts(leaf.ext)
        return from_parts(leaf.meta, (len(column), *leaf.shape), column.reshape(-1))
    return torch.from_numpy(column)


def _out_leaves(leaves: list) -> tuple[list, list, list]:
    """``out``'s leaves as numpy arrays over the same memory (any dtype: through a uint8 view
    where numpy has no such dtype, e.g. bfloat16), with their torch dtype names and shapes."""
    arrays, dtypes, shapes = [], [], []
    for t in leaves:
        if isinstance(t, torch.Tensor):
            if not t.is_cpu:  # is_cpu, requires_grad: attributes, a microsecond less a leaf than .device, .detach()
                raise InvalidArgument(f"out= tensors must be in CPU memory (pinned is fine), got one on "
                                      f"{t.device}; gather on the host and copy, or use PrefetchRing")
            if t.requires_grad:
                t = t.detach()
            arrays.append(t.view(torch.uint8).numpy() if t.dtype == torch.bfloat16 else t.numpy())
            dtypes.append(str(t.dtype).removeprefix("torch."))
            shapes.append(tuple(t.shape))
        elif isinstance(t, np.ndarray):
            arrays.append(t)
            dtypes.append(None)
            shapes.append(t.shape)
        else:
            raise InvalidArgument(f"out= holds a {type(t).__name__}; give tensors or arrays shaped "
                                  f"like the batch")
    return arrays, dtypes, shapes


def _flatten_like(out: Any, tree: tuple, path: str = "out") -> list:
    """The leaves of ``out`` in the order of the record's layout ``tree``; InvalidArgument naming
    the place where ``out`` is shaped unlike the batch (a missing field would stay unfilled)."""
    tag = tree[0]
    if tag == "leaf":
        return [out]
    if tag in ("T", "L"):
        if not isinstance(out, (tuple, list)) or len(out) != len(tree[1]):
            raise _unlike(path, out, f"a sequence of {len(tree[1])} fields")
        return [leaf for i, (o, c) in enumerate(zip(out, tree[1])) for leaf in _flatten_like(o, c, f"{path}[{i}]")]
    keys = [k for k, _ in tree[1]]
    if not isinstance(out, dict) or set(out) != set(keys):
        raise _unlike(path, out, f"a dict with keys {keys}")
    return [leaf for k, c in tree[1] for leaf in _flatten_like(out[k], c, f"{path}[{k!r}]")]


def _described(value: Any) -> str:
    if isinstance(value, dict):
        return f"a dict with keys {list(value)}"
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}"
    return f"a {type(value).__name__}"


def _unlike(path: str, out: Any, batch_has: str) -> InvalidArgument:
    return InvalidArgument(f"{path} is {_described(out)} where the batch has {batch_has}; give one "
                           f"buffer per field, shaped like the batch")


def _copy_into(out: Any, batch: Any, path: str = "out") -> None:
    """Copy a collated ``batch`` into ``out``, field by field, converting dtypes like ``copy_``;
    InvalidArgument (nothing half-copied is returned) where the two are shaped differently."""
    if isinstance(out, (torch.Tensor, np.ndarray)):
        if not isinstance(batch, (torch.Tensor, np.ndarray)):
            raise _unlike(path, out, _described(batch))
        if tuple(batch.shape) != tuple(out.shape):
            raise InvalidArgument(f"{path} has shape {tuple(out.shape)} where the batch has "
                                  f"{tuple(batch.shape)}; size out= like the batch")
        if isinstance(out, torch.Tensor):
            out.copy_(torch.as_tensor(batch))
        else:
            out[...] = batch.numpy() if isinstance(batch, torch.Tensor) else batch
    elif isinstance(out, (tuple, list)):
        if not isinstance(batch, (tuple, list)) or len(batch) != len(out):
            raise _unlike(path, out, _described(batch))
        for i, (o, b) in enumerate(zip(out, batch)):
            _copy_into(o, b, f"{path}[{i}]")
    elif isinstance(out, dict):
        if not isinstance(batch, dict) or set(batch) != set(out):
            raise _unlike(path, out, _described(batch))
        for k in out:
            _copy_into(out[k], batch[k], f"{path}[{k!r}]")
    else:
        raise InvalidArgument(f"{path} is a {type(out).__name__}; give tensors or arrays shaped like the batch")
