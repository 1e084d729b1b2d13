"""``ShmDatasetCache``: the public face of shmcache for PyTorch.

It binds one named cache of a session (``store.CacheStore``) and adds what PyTorch users need:
wrapping map-style and iterable datasets (shmcache.data.wrapped), batches collated like
``default_collate`` (gathered straight into caller buffers such as pinned memory:
shmcache.data.batches, and a DataLoader's own batches: shmcache.data.collate), warm-up with a
progress bar, and tensors as a first-class sample type (shmcache.data.tensors, which the codec
loads lazily where a process meets a tensor). Its arguments are checked in shmcache.data.arguments.
"""

from __future__ import annotations

import logging
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, IterableDataset, default_collate

from ..base import settings
from ..base.namespace import namespace, resolve_session_name, validate_name
from ..base.progress import progress_bar
from ..base.settings import ENV_REMOTE, ENV_SECRET, ENV_SIZE_MB, ENV_SPILLING
from ..base.trust import resolve_secret
from ..cache import codec
from ..cache.registry import SessionRegistry
from ..cache.store import MISSING, CacheStore, UncachedStore
from ..cache.store_protocol import Store
from ..errors import (
    CacheNotFound,
    EncodeError,
    InvalidArgument,
    ItemTooLarge,
    SessionNotFound,
    SharedMemoryFull,
    SnapshotError,
)
from ..tiers.remote import resolve as resolve_remote
from . import tensors
from .arguments import (
    check_session,
    check_size,
    default_name,
    label_of,
    say_earlier_versions,
    size_from_env,
    snapshot_arg,
)
from .batches import as_int_keys, copy_into, gather
from .fingerprint import fingerprint, given_fingerprint, length_or_none
from .probes import read_probes, same_value
from .stream import CachedIterableDataset, check_reshuffle, read_head
from .wrapped import CachedDataset, NoSource, compute_each, keep_computed, same_sample

__all__ = ["ShmDatasetCache", "CachedDataset", "CachedIterableDataset"]

log = logging.getLogger("shmcache")

tensors.register()  # torch is imported here anyway: tensors are encoded without a lookup


# --- the cache ------------------------------------------------------------------------------------

# frames that are not the user's: shmcache's own, and a DataLoader's fetch (which calls ds[i])
WARMUP_BATCH = 256  # misses a warm-up claims, computes and stores together (NOTE [claims])

_NOT_USERS = tuple(os.path.dirname(os.path.abspath(path)) + os.sep for path in (
    os.path.dirname(os.path.abspath(__file__)), sys.modules[DataLoader.__module__].__file__))


def _shown(category: type, text: str, stacklevel: int) -> bool:
    """Whether ``warnings.warn(text, category, stacklevel)`` called by this function's caller would
    pass the warnings filters now (the first that matches decides, as the warnings module's own
    matching does); True where a frame cannot be found, which warn() would report anyway."""
    try:
        frame = sys._getframe(stacklevel)  # stacklevel 1 is the caller's own frame
    except ValueError:
        return True
    module, lineno = frame.f_globals.get("__name__", "<string>"), frame.f_lineno
    for action, message, cat, mod, line in warnings.filters:
        if ((message is None or message.match(text)) and issubclass(category, cat)
                and (mod is None or mod.match(module)) and (line == 0 or line == lineno)):
            return action != "ignore"
    return warnings.defaultaction != "ignore"


def _user_stacklevel() -> int:
    """The ``stacklevel`` of a warning raised by this function's caller that names the user's line:
    the first frame outside shmcache and torch.utils.data (the last frame if there is none)."""
    level, frame = 1, sys._getframe(1)
    while frame.f_back is not None and frame.f_code.co_filename.startswith(_NOT_USERS):
        frame, level = frame.f_back, level + 1
    return level



class _KeyPaths:
    """What the error of the i-th of a batch's ``(key, value)`` pairs names, spelt out only for a
    value no kept shape packs (codec.encode_many walks it): a batch's 64 keys are not formatted on
    every store."""

    __slots__ = ("pairs",)

    def __init__(self, pairs: list):
        self.pairs = pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, i: int) -> str:
        return f"the value of key {self.pairs[i][0]!r}"


def _iterable(dataset: Any) -> bool:
    """Whether wrap() takes ``dataset`` as a stream: an IterableDataset, or an iterable with no
    ``__getitem__``."""
    return isinstance(dataset, IterableDataset) or (not hasattr(dataset, "__getitem__")
                                                    and isinstance(dataset, Iterable))


def _native_hint(types: tuple) -> str:
    """What to return instead of the pickled ``types`` (codec names them: type, and the dtype or
    kind of an array or tensor that is not stored natively)."""
    if all(t.startswith(("numpy.", "torch.Tensor")) and t.endswith((")", "dtype object", "dtype"))
           for t in types):  # arrays and tensors already: their dtype or kind is the problem
        return ("what is stored natively is dense numeric arrays and strided tensors of a numeric "
                "dtype: split object or structured arrays into numeric arrays (or a list), and make "
                "nested, sparse or quantized tensors dense (t.to_dense(), t.dequantize(), padding)")
    if all(" nested deeper than " in t for t in types):  # containers only: their depth is the problem
        return (f"nest a sample's containers at most {codec.MAX_NESTING} deep (a tree as flat lists of "
                f"its nodes, or arrays)")
    return ("return numpy arrays or tensors from the dataset or transform (np.asarray(x), "
            "torch.as_tensor(x))")


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
        remote: a Redis tier shared by several nodes behind the shared memory (``RedisTier``):
            ``redis://[:password@]host:port[/db]``, ``rediss://...``, ``redis+cluster://h1:p1,...``,
            ``redis+shards://h1:p1,h2:p2,...``; None: ``$SHMCACHE_REMOTE``, else the session's
            (``shmcache new NAME --remote URL``); ``""``: none.
        snapshot: a snapshot (a path, or an fsspec URL such as ``s3://bucket/snap``) read through
            on a miss before the source (``SnapshotTier``): the records a miss needs are read
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
        memory_dir: a tmpfs or hugetlbfs directory for the shared memory of the session, if this
            creates it (None: ``$SHMCACHE_MEMORY_DIR``, else /dev/shm); the session records it, so
            every process finds it without this. An existing session elsewhere: InvalidArgument.
    """

    def __init__(self, session: str = "auto", name: str | None = None, size: int = 0,
                 spilling: bool = False, spill_dir: str | os.PathLike | None = None, *,
                 copy: bool = True, verify: float = 0.0, lock_timeout_s: float = 60.0,
                 remote: str | None = None, snapshot: str | os.PathLike | None = None,
                 snapshot_options: dict | None = None, secret: str | bytes | None = None,
                 allow_pickle: bool = False, create: bool = True,
                 memory_dir: str | os.PathLike | None = None):
        settings.check_switches()  # each on/off variable, first: the user's code reads the refusal here
        self.session = resolve_session_name(session)
        self._secret = resolve_secret(secret)  # travels to DataLoader workers with the cache
        if not isinstance(allow_pickle, bool):
            raise InvalidArgument(f"allow_pickle must be True or False, got {allow_pickle!r}")
        self.allow_pickle = allow_pickle
        if not isinstance(create, bool):
            raise InvalidArgument(f"create must be True or False, got {create!r}")
        check_session(self.session, create)
        if memory_dir is not None:  # made there now, or refused if it keeps its memory elsewhere
            from ..cache.registry import SessionRegistry

            SessionRegistry(namespace()).ensure(self.session, memory_dir=memory_dir)
        if name is not None:
            validate_name(name, "cache")
        size = check_size(size)
        if size == 0 and settings.get(ENV_SIZE_MB):
            size = size_from_env()
        if not isinstance(spilling, bool):
            raise InvalidArgument(f"spilling must be True or False, got {spilling!r}")
        if spill_dir is not None and not isinstance(spill_dir, (str, os.PathLike)):
            raise InvalidArgument(f"spill_dir must be a path, got {type(spill_dir).__name__}")
        self.size_mb = size
        self.spilling = spilling or settings.flag(ENV_SPILLING)
        self.spill_dir = spill_dir  # None: the session's, then $SHMCACHE_SPILL_DIR (``resolve_spill_dir``)
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
        self.opened: Store | None = None  # the store once open (open_store); None until then
        self._fingerprint: str | None = None
        self._given_fp: str | None = None  # wrap(fingerprint=...) of the wrap() under way
        self._closed = False
        # a warning of samples stored with pickle, of an item that can never fit: checked once
        # per cache object, said once per job (Store.first_to_say: not by each rank and worker)
        self._warned_pickle = False
        self._shapes: list = []  # the samples' shapes seen last (codec.encode_many's memo)
        self._warned_too_large = False
        self._warned_gone = False  # one log line per cache object when the cache was destroyed under it
        self._source_len: int | None = None  # len() of the map-style dataset wrapped: export() records it
        self.last_import = None  # from_snapshot(): what the import stored (snapshot.load.ImportReport)
        # the namespace travels with the cache (pickled to workers): a forkserver or spawn child
        # may see another $SHMCACHE_DIR, and would otherwise build an empty twin of the cache
        self._ns_root = str(namespace().root)
        self._remote_arg = remote  # resolved with the session's when the store is opened (_open)
        if remote or (remote is None and settings.get(ENV_REMOTE)):  # a bad URL fails here
            resolve_remote(remote, None)
        self._snapshot = snapshot_arg(snapshot, snapshot_options)  # (url, options) or None
        if self.spilling:  # a missing or unusable spill directory is an error now, not later
            from ..cache.registry import SessionRegistry
            from ..tiers.spill.tier import resolve_spill_dir

            registry = SessionRegistry(namespace())
            resolve_spill_dir(self.spill_dir, registry.ensure(self.session).spill_dir)
        if name is not None:
            self._open(name, None, 0)

    # --- binding to a store --------------------------------------------------------------------

    def _open(self, name: str, fingerprint: str | None, table_hint: int) -> Store:
        if self._closed:
            raise self._closed_error()
        try:
            self.opened = CacheStore(self.session, name, capacity_bytes=self.size_mb << 20,
                                     fingerprint=fingerprint, table_hint=table_hint,
                                     lock_timeout_s=self.lock_timeout_s, ns=self._ns_root)
        except SharedMemoryFull as exc:  # not even the cache's own segments fit: serve uncached
            self.opened = UncachedStore(self.session, name, exc)
        self.name, self._fingerprint = name, fingerprint
        if self.spilling and not self.opened.uncached:
            from ..tiers.spill import tier as spilling

            spilling.attach(self.opened, self.spill_dir)
        self._attach_remote(fingerprint)
        if self._snapshot is not None:  # assembly.ORDER puts it in front of the remote tier
            self._attach_snapshot(name, fingerprint)
        return self.opened

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

            if fingerprint is None and not self.opened.uncached:  # a named cache bound earlier
                fingerprint = self.opened.read_meta().get("fingerprint")
            tier = remote.open_tier(self.opened, url, fingerprint, registry, self._secret)
            self.opened = assembly.assemble(self.opened, [tier], name=self.opened.name, fingerprint=fingerprint,
                                            allow_pickle=self.allow_pickle, registry=registry)

    def _attach_snapshot(self, name: str, fingerprint: str | None) -> None:
        """With a snapshot, the store becomes ``TieredStore(local, [SnapshotTier, ...])``; without
        one it stays the local store itself (no extra call on a hit)."""
        from ..cache.registry import SessionRegistry
        from ..snapshot.tier import open_tier
        from ..tiers import assembly

        if fingerprint is None and not self.opened.uncached:  # a named cache bound earlier
            fingerprint = self.opened.read_meta().get("fingerprint")
        local = self.opened
        registry = SessionRegistry(namespace(self._ns_root))
        try:
            tier = open_tier(local, self._snapshot[0], registry, self._snapshot[1], self._secret)
            self.opened = assembly.assemble(local, [tier], name=name, fingerprint=fingerprint,
                                            allow_pickle=self.allow_pickle, registry=registry)
        except BaseException:
            self.opened = None
            local.close()
            raise

    @property
    def store(self) -> Store:
        """The underlying store (opened on first use; see ``open_store``)."""
        return self.open_store()

    # --- wrapping datasets ----------------------------------------------------------------------

    def wrap(self, dataset: Any, transform: Callable | None = None, *, label: str | None = None,
             fingerprint: str | None = None, reshuffle: bool | None = None):
        """A dataset that reads through this cache: map-style or iterable, same items as ``dataset``.
        ``dataset=None``: the cache alone (imported from a snapshot), with no source behind it.
        ``label``: what `shmcache stat` shows to tell this cache from others (default: the
        dataset's ``repr``, cut to 80 characters; its class name where the repr is Python's own).
        ``fingerprint``: the identity of the dataset's contents, given by the caller (a version,
        a hash of its file list): wrap() then reads no sample (NOTE [fingerprint] is skipped:
        the caller answers for it naming these contents and no others).
        ``reshuffle`` (an iterable dataset only): a replayed epoch in an order drawn from the epoch
        (True), in the recorded order (False), or in the recorded order said once per job where the
        source's order may follow its epoch (None; data.stream.CachedIterableDataset)."""
        reshuffle = check_reshuffle(reshuffle, _iterable(dataset))  # (wrap(None) is map-style)
        if dataset is None:
            return self._wrap_without_source(transform)
        if transform is not None and not callable(transform):
            raise InvalidArgument(f"transform must be callable, got {type(transform).__name__}")
        if label is not None and not isinstance(label, str):
            raise InvalidArgument(f"label must be a str, got {type(label).__name__}")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not 0 < len(fingerprint) <= 256):
            raise InvalidArgument(f"fingerprint must be a non-empty str (a version or a hash of the "
                                  f"dataset's contents, at most 256 characters), got {fingerprint!r:.80}")
        self._given_fp = fingerprint
        wrapped = self._wrap(dataset, transform, reshuffle)
        store = self.opened
        if store is not None and not store.uncached:
            store.record_label(label_of(dataset, label))
        return wrapped

    def _wrap(self, dataset: Any, transform: Callable | None, reshuffle: bool | None = None):
        if _iterable(dataset):
            return self._wrap_iterable(dataset, transform, reshuffle)
        if not hasattr(dataset, "__getitem__") or length_or_none(dataset) is None:
            raise InvalidArgument(
                f"wrap() takes a map-style dataset (with __getitem__ and __len__) or an iterable "
                f"dataset, got {type(dataset).__name__}"
            )
        n = len(dataset)
        indices = sorted({0, n // 2, n - 1}) if n and self._given_fp is None else []
        # encoded once: to check them, to fingerprint the dataset, to store them; a probe that
        # raised counts by its exception's type, and raises again where the DataLoader reads it
        probes, again = read_probes(dataset, transform, indices)
        if again is not None and again.error is None and not same_sample(probes[0].encoded, again.value) \
                and not same_value(probes[0].value, again.value):
            raise InvalidArgument(
                f"{type(dataset).__name__}[{indices[0]}] differs between two reads: the dataset (or "
                f"transform) is random, and a cache would freeze one draw; cache the deterministic part "
                f"(cache.wrap(ds, transform=decode)) and apply random augmentation on top"
            )
        samples = [p.encoded if p.error is None else codec.encode(("raised", type(p.error).__qualname__))
                   for p in probes]
        self._bind(dataset, transform, samples, table_hint=n)
        self._source_len = n
        # the fingerprint's probes (and the second read of the first): computations too
        self.opened.count_computed(len(probes) + (again is not None))
        for p in probes:  # computed anyway: keep them
            if p.error is None:
                self.put_computed(self.opened, p.index, None, p.encoded)
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
        if self.opened is None and self.name is None:
            if self._snapshot is None:
                raise InvalidArgument(
                    f"wrap(None) serves a cache without its source dataset, but this ShmDatasetCache in "
                    f"session {self.session!r} names none: give name= of the cache (as `shmcache import` "
                    f"named it), or snapshot=URL to serve a snapshot read through")
            from ..snapshot.tier import manifest_of

            manifest = manifest_of(*self._snapshot, secret=self._secret)
            # the table grows as records arrive: the manifest's counts (length, items) claim, they
            # do not prove, and a table sized by them commits /dev/shm that outlives the process
            self._open(manifest.name, manifest.fingerprint, 0)
        store = self.open_store()
        meta = store.read_meta() if not store.uncached else {}
        length = meta.get("length")
        # what proves the length: the job's secret, else the items held (the cache's own count of
        # what an import stored, verified; or what the snapshot's data files hold)
        authenticated, items = meta.get("length_authenticated") is True, None
        tier = None
        if self._snapshot is not None:
            from ..snapshot.tier import snapshot_tier

            tier = snapshot_tier(store)
            if manifest is None:
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
            authenticated, items = tier is not None and tier.authenticated, manifest.items
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
        from ..snapshot.format import unproven_length_problem

        problem = None if authenticated else unproven_length_problem(length, len(store) if items is None else items)
        if problem is not None:
            from ..base.urls import mask_url

            where = (f"the manifest of snapshot={mask_url(self._snapshot[0])}" if items is not None
                     else f"cache {self.session}/{self.name} (as imported)")
            raise SnapshotError(
                f"wrap(None) would serve {where} at its length, but it states {problem}, and no secret of "
                f"this job authenticates it (an unsigned snapshot, or one read with allow_unsigned). Export "
                f"the snapshot with this job's secret (${ENV_SECRET}, secret=) and import or read it with "
                f"that secret, or wrap the dataset itself (cache.wrap(dataset)): nothing from outside sizes "
                f"memory")
        if self._fingerprint is None and meta.get("fingerprint"):
            self._tiers_learn(meta["fingerprint"])  # imported by another process since we opened it
            self._fingerprint = meta["fingerprint"]  # wrap(another dataset) later is refused
        self._source_len = length  # export() records it
        return CachedDataset(self, NoSource(self.session, self.name, length), None)

    @classmethod
    def from_snapshot(cls, src: str | os.PathLike, session: str = "auto", name: str | None = None,
                      size: int = 0, spilling: bool = False, spill_dir: str | os.PathLike | None = None, *,
                      force: bool = False, threads: int | None = None, progress: bool | None = None,
                      storage_options: dict | None = None, allow_unsigned: bool = False,
                      timeout_s: float | None = None, **kwargs: Any) -> ShmDatasetCache:
        """A cache filled from the snapshot at ``src`` (a path or an fsspec URL, e.g. ``s3://b/snap``):
        named as the exported cache unless ``name=`` is given; ``wrap(None)`` then serves it with no
        source. A cache of that name holding another dataset is refused (CacheMismatch) unless
        ``force=True``, which replaces its contents. ``last_import`` says what was stored: items that
        did not fit the cap (spilled with ``spilling=True``, else left out), records skipped as
        damaged. With a secret (``secret=``, ``$SHMCACHE_SECRET``) only a snapshot signed with it is
        imported unless ``allow_unsigned=True``; pickled objects of a snapshot that is not signed are
        skipped unless ``allow_pickle=True`` (NOTE [record authentication]). ``timeout_s``: the
        longest one read of an HTTP(S) or S3 snapshot may take (None: 60 s, ``load``'s
        IMPORT_TIMEOUT_S); past it the import fails (SnapshotError naming the server) and gives back
        the cache it made. Other keyword arguments go to ShmDatasetCache."""
        from ..snapshot.load import (
            cache_exists,
            given_back_on_failure,
            import_into,
            read_indexes,
            read_manifest,
            replace_other_dataset,
        )

        loc, manifest = read_manifest(src, storage_options, timeout_s)
        from ..snapshot.format import MANIFEST, authenticate

        # refused before a cache is made: a snapshot not signed with the job's secret, or one whose
        # data files fail their checks (read first: nothing in /dev/shm is sized before they pass)
        secret = resolve_secret(kwargs.get("secret"))  # what the cache made below resolves too
        authenticate(manifest, secret, allow_unsigned, loc.where(MANIFEST))
        indexes = read_indexes(loc, manifest)
        made = not cache_exists(session, name or manifest.name)
        cache = cls(session, name or manifest.name, size, spilling, spill_dir, **kwargs)
        try:
            with given_back_on_failure(cache.store, made):  # a failed import leaves no cache it made
                if replace_other_dataset(cache.store, manifest, force):  # destroyed: a new incarnation
                    cache.close()
                    cache = cls(session, name or manifest.name, size, spilling, spill_dir, **kwargs)
                cache.last_import = import_into(cache.store, loc, manifest, force=force, threads=threads,
                                                progress=progress, secret=secret or "",
                                                allow_pickle=cache.allow_pickle, allow_unsigned=allow_unsigned,
                                                indexes=indexes)
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

    def _wrap_iterable(self, dataset: Iterable, transform: Callable | None,
                       reshuffle: bool | None) -> CachedIterableDataset:
        """With a name, the stream is not read here. Without one, its first 16 items name the
        cache (with the dataset's attributes, NOTE [fingerprint]); they are read from the
        iterator the first pass then goes on with, so a stream that cannot be read twice (a
        queue, a socket behind ``__iter__``) loses nothing."""
        one_shot = isinstance(dataset, Iterator)  # (calling iter() would open a stream)
        if self.name is not None or self._fingerprint is not None or self._given_fp is not None:
            self._bind(dataset, transform, [], table_hint=0)
            return CachedIterableDataset(self, dataset, transform, one_shot=one_shot, reshuffle=reshuffle)
        if one_shot:
            raise InvalidArgument(
                f"wrap() of a one-shot iterator ({type(dataset).__name__}) needs a name: without "
                f"one the cache would be named after its first items, which two different streams "
                f"can share; give ShmDatasetCache(name=...) (the stream is then not read until the "
                f"first pass), or wrap a re-iterable dataset (an IterableDataset or a container)"
            )
        head, it, at = read_head(dataset, 16)
        samples = [codec.encode(transform(x) if transform else x) for x in head]
        self._bind(dataset, transform, samples, table_hint=0)
        # the first pass of this process starts with them (if it is in the epoch they were read in)
        return CachedIterableDataset(self, dataset, transform, pending=(os.getpid(), head, it, at),
                                     reshuffle=reshuffle)

    def _bind(self, dataset, transform, samples, table_hint: int) -> None:
        given = self._given_fp
        fp = fingerprint(dataset, transform, samples) if given is None else given_fingerprint(dataset, given)
        if self.opened is None:
            name = self.name or default_name(dataset, fp)
            registry = SessionRegistry(namespace(self._ns_root)) if self.name is None else None
            new = registry is not None and not registry.cache_meta_path(self.session, name).exists()
            self._open(name, fp, table_hint)
            if new:  # a dataset that changed leaves its old cache: say so (NOTE [cache use])
                say_earlier_versions(registry, self.session, name)
        elif self._fingerprint is None:  # opened by name before any dataset: this one is its dataset
            self._tiers_learn(fp)  # a snapshot of another dataset: refused
            self.opened.bind_fingerprint(fp)
            self._fingerprint = fp
            if table_hint:  # its index sized for it, as a cache made for it is
                self.opened.reserve_entries(table_hint)
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

        assembly.bind(self.opened, self.name, fp)

    # --- single items ----------------------------------------------------------------------------

    def get(self, key: int | str | bytes, fn: Callable | None = None) -> Any:
        """The cached value of ``key``; on a miss ``fn(key)``, stored (KeyError if ``fn`` is None)."""
        store = self.opened
        if store is None:
            store = self.open_store()
        value = store.lookup(key, self.copy)
        if value is not MISSING:
            return value
        if fn is None:
            raise KeyError(key)
        return store.fill(key, fn, partial(self.put_computed, store), self.copy)  # NOTE [claims]

    def put(self, key: int | str | bytes, value: Any) -> bool:
        """Store ``value`` under ``key`` (kept if present). False if the cache was full;
        ItemTooLarge if it can never fit (a cache of its own ``size=``, not spilling);
        CacheNotFound if the cache was destroyed while this process used it."""
        return self.put_computed(self.store, key, value, explicit=True)

    def put_computed(self, store: Store, key: Any, value: Any, enc: codec.Encoded | None = None,
                     explicit: bool = False) -> bool:
        """``store.put``, warning once per job when a sample had to be pickled. A value the
        cache computed for its caller (``explicit=False``) that can never fit is served anyway,
        like every other overflow: counted as rejected (by the store) and said once per job."""
        enc = self.encode(key, value) if enc is None else self._warned(enc)
        try:
            return store.put(key, None, encoded=enc)
        except ItemTooLarge as exc:
            if explicit:
                raise
            self._say_too_large(exc)
            return False
        except CacheNotFound as exc:  # destroyed under us (`shmcache destroy --force`, `import --force`)
            if explicit:
                raise
            self._say_gone(exc)
            return False

    def _put_many(self, store: Store, pairs: list) -> None:
        """Store the values a miss path computed (``(key, value)`` pairs) under one hold of the
        lock (``store.put_many``): what can never fit or finds the cache destroyed is served
        anyway, said once, as with ``put_computed``. A value that cannot be encoded raises
        EncodeError after the others are stored: one such sample loses only itself."""
        items, failed = self.encode_many(pairs)
        self.put_encoded(store, items)
        if failed is not None:
            raise failed[1]

    def put_encoded(self, store: Store, items: list) -> None:
        """``_put_many`` of values encoded already (``(key, codec.Encoded)`` pairs)."""
        too_large: list = []
        try:
            store.put_many(items, too_large=too_large)
        except CacheNotFound as exc:
            self._say_gone(exc)
        if too_large:
            self._say_too_large(too_large[0])

    def encode(self, key: Any, value: Any) -> codec.Encoded:
        """``value`` encoded for ``key``, warned about once per job when it had to be pickled."""
        return self._warned(codec.encode(value, f"the value of key {key!r}"))

    def encode_many(self, pairs: list) -> tuple[list, tuple | None]:
        """``encode`` of ``(key, value)`` pairs (codec.encode_many: a batch of one shape packed
        into one layout): ``([(key, Encoded), ...], (key, EncodeError) of the first value that
        cannot be encoded, or None)``; those values are left out."""
        encs = codec.encode_many([value for _, value in pairs], _KeyPaths(pairs), self._shapes)
        items, failed = [], None
        for (key, _), enc in zip(pairs, encs):
            if isinstance(enc, EncodeError):
                failed = failed or (key, enc)
            else:
                items.append((key, self._warned(enc)))
        return items, failed

    def _warned(self, enc: codec.Encoded) -> codec.Encoded:
        """``enc``, warned about once per job when it had to be pickled."""
        if enc.pickled and not self._warned_pickle:
            self._warn_pickled(enc.pickled)
        return enc

    def _say_too_large(self, exc: ItemTooLarge) -> None:
        if not self._warned_too_large:
            self._warned_too_large = True
            # marked said for the job only where it is shown: a rank whose logging is off (as on
            # every rank but the first in many training scripts) would take it from the others
            if not log.isEnabledFor(logging.WARNING):
                return
            if self.opened is None or self.opened.first_to_say("too large", "an item too large"):
                log.warning("%s; such items are served from the source, not cached, and counted as "
                            "rejected (said once per job)", exc)

    def _say_gone(self, exc: CacheNotFound) -> None:
        if not self._warned_gone:  # reads miss (counted), values come from the source
            self._warned_gone = True
            log.warning("%s; until then this process computes its items from its own source, "
                        "uncached (said once per cache)", exc)

    def _warn_pickled(self, types: tuple) -> None:
        self._warned_pickle = True
        self.say_once("pickled", f"{types}", (
            f"cache {self.session}/{self.name}: samples holding {', '.join(types)} are stored with "
            f"pickle: slower to store and read than arrays, often larger, and never zero-copy or "
            f"gathered as a batch; {_native_hint(types)} (warned once per job)"))

    def say_once(self, kind: str, mark: str, text: str) -> None:
        """``text`` as a UserWarning at the user's line, said once per job about this cache: by
        the first process of the job to say the notice of ``kind`` (a key of root.NOTICE_WORDS)
        marked ``mark``."""
        level = _user_stacklevel()
        # marked said for the job only where it is shown: a rank whose warnings are off (as on every
        # rank but the first in many training scripts) would take it from the others
        if not _shown(UserWarning, text, level):
            return
        if self.opened is not None and not self.opened.first_to_say(kind, mark):
            return
        warnings.warn(text, UserWarning, stacklevel=level)

    def __getitem__(self, key):
        return self.get(key)

    def __contains__(self, key) -> bool:
        return self.store.contains(key)

    def __len__(self) -> int:
        return len(self.store)

    # --- batches -----------------------------------------------------------------------------------

    def get_batch(self, keys: Sequence, fn: Callable | None = None, out: Any = None, *,
                  fn_many: Callable | None = None) -> Any:
        """Values of ``keys`` collated like ``default_collate`` (stacked tensors).

        Misses are computed with ``fn(key)`` and stored, or raise a KeyError naming them. With
        ``out`` (a structure of tensors shaped like the batch, e.g. pinned buffers), the batch is
        gathered straight into it and ``out`` is returned. ``fn_many`` (a list of keys -> a list
        of their values), when given with ``fn``, computes a batch's misses in one call.
        """
        if len(keys) == 0:
            raise InvalidArgument("get_batch() needs at least one key; got an empty sequence")
        store = self.store
        ints = as_int_keys(keys)
        if ints is not None:  # the vectorised path: every key cached, one layout, in memory
            batch = gather(store, ints, out)
            if batch is not None:
                return batch
        values, missing = store.lookup_batch(keys, self.copy)
        if missing:
            if fn is None:
                raise KeyError(f"{len(missing)} of {len(keys)} keys are not cached: "
                               f"{[keys[i] for i in missing[:10]]}; pass fn= to compute them")
            # one by one: what was computed before a raise (a broken sample, Ctrl-C) is kept
            many = fn_many or partial(compute_each, fn, keep=partial(keep_computed, self._put_many, store))
            got = store.fill_batch([keys[i] for i in missing], many, partial(self._put_many, store),
                                   self.copy)  # NOTE [claims]
            for i, value in zip(missing, got):
                values[i] = value
        batch = default_collate(values)
        if out is not None:
            copy_into(out, batch)
            return out
        return batch

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
        # a batch within this rank's share: one of WARMUP_BATCH claimed the next ranks' first items
        # too (2 ranks over 300 items: 256 by one, 44 by the other - no faster than one process)
        batch = max(1, min(WARMUP_BATCH, -(-n // world)))
        store, computed, shown = self.store, 0, 0
        bar = progress_bar(progress, n, desc or f"warmup {self.name}", notebook=True)
        try:
            for lo in range(0, n, 4096):
                chunk = order[lo:lo + 4096]
                absent = store.absent_ints(chunk).tolist()
                if absent and getattr(store, "behind", None):  # what another node computed: read it
                    absent = _not_behind(store, absent)
                bar.update(len(chunk) - len(absent))  # cached already: done
                shown += len(chunk) - len(absent)
                for at in range(0, len(absent), batch):
                    part = absent[at:at + batch]
                    todo = store.absent_ints(np.asarray(part, np.int64)).tolist()  # stored meanwhile?
                    # claimed, computed, stored a chunk at a time; counted as misses, as ds[i]'s would be
                    made = ds.fill_misses(store, todo, as_misses=True)[1] if todo else 0
                    computed += made
                    bar.update(len(part))  # as they are stored (tqdm redraws at most 10 times a second)
                    shown += len(part)
        except BaseException:  # Ctrl-C, a source's error: the bar's last line is the count stored
            try:
                bar.update(n - len(store.absent_ints(order)) - shown)
            except Exception:  # noqa: BLE001 - the store went too (destroyed): the bar stays as it was
                pass
            raise
        finally:
            bar.close()
        return computed

    def verify_sample(self, dataset: Any, fraction: float = 0.01, *, seed: int | None = None,
               progress: bool | None = None, raise_on_stale: bool = True):
        """Recompute ``fraction`` of the cached items of ``dataset`` (wrapped by this cache, or the
        dataset itself: it is wrapped) and compare each with its cached copy, with a progress bar
        (``None``: when stderr is a terminal). Returns a ``VerifyReport`` (``ok``, ``checked``,
        ``stale``); a stale item raises ``CacheMismatch`` naming them (``raise_on_stale=False``:
        logged and reported instead). The check the fingerprint cannot make: it sees a dataset's
        file paths, not the files, so an edited file is served stale until this (or ``verify=``)
        recomputes it. (``verify=``, the fraction of hits checked as they are read, keeps the
        attribute name ``verify``.)"""
        from .verify import verify_sample

        ds = dataset if isinstance(dataset, CachedDataset) else self.wrap(dataset)
        return verify_sample(ds, fraction, seed=seed, progress=progress, raise_on_stale=raise_on_stale)

    def stats(self) -> dict:
        """Counters shared by every process (keys: the README's ``stats()`` list); with a remote or a snapshot
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
        store, self.opened = self.opened, None
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
        state["opened"] = None
        state["_shapes"] = []  # samples of this process, not sent along
        return state

    def open_store(self) -> Store:
        """The store, opened on first use: re-attached by name in a process that received this
        cache pickled (a DataLoader worker)."""
        if self.opened is None:
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
        return self.opened


# --- warm-up --------------------------------------------------------------------------------------


def _not_behind(store: Store, keys: list, per_trip: int = 256) -> list:
    """The ``keys`` that the tiers behind ``store`` lack too; those they have are admitted into
    shared memory on the way (a bounded batch per round trip: values may be large)."""
    out = []
    for lo in range(0, len(keys), per_trip):
        part = keys[lo:lo + per_trip]
        out += [part[j] for j in store.lookup_batch(part, False)[1]]
    return out
