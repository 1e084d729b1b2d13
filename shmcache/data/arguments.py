"""The arguments of ``ShmDatasetCache``, checked before anything is opened: sizes, ``snapshot=``,
the session (a misspelled one would silently start an empty cache), a cache's default name and
label.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from typing import Any

import numpy as np

from ..base import settings
from ..base.namespace import namespace, validate_name
from ..base.settings import ENV_SIZE_MB, ENV_SNAPSHOT
from ..errors import InvalidArgument, SessionNotFound

__all__ = ["check_session", "check_size", "size_from_env", "label_of", "default_name", "snapshot_arg",
           "say_earlier_versions"]

log = logging.getLogger("shmcache")
_MAX_SIZE_MB = 1 << 26  # 64 TiB: anything larger is a unit mistake (bytes given as MiB)

_SESSIONS_SAID: set[tuple[str, str]] = set()  # (namespace, session): a new session is logged once


def check_session(session: str, create: bool) -> None:
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


def label_of(dataset: Any, label: str | None) -> str:
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


def check_size(size: Any, what: str = "size") -> int:
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)):
        raise InvalidArgument(f"{what} must be an int number of MiB (0 = automatic), got "
                              f"{type(size).__name__} {size!r}")
    if size < 0 or size > _MAX_SIZE_MB:
        raise InvalidArgument(f"{what}={size} MiB is out of range: give 0 (80% of the memory really "
                              f"available) or a number of MiB up to {_MAX_SIZE_MB} "
                              f"(size is in MiB, not bytes)")
    return int(size)


def size_from_env() -> int:
    raw = settings.get(ENV_SIZE_MB, "").strip()
    try:
        value = int(raw)
    except ValueError:
        raise InvalidArgument(f"${ENV_SIZE_MB}={raw!r} is not an int number of MiB; set it to e.g. "
                              f"4096, or unset it") from None
    return check_size(value, f"${ENV_SIZE_MB}")


def default_name(dataset: Any, fingerprint: str) -> str:
    base = "".join(c if c.isalnum() or c in "_.-" else "_" for c in type(dataset).__name__)[:40]
    return validate_name(f"{base}-{fingerprint[:_FP_CHARS]}", "cache")


_FP_CHARS = 12  # of the fingerprint in a default name


def say_earlier_versions(registry: Any, session: str, name: str) -> None:
    """Cache ``name`` (a default name) was just made: if the session holds caches of the same
    dataset type under another fingerprint - the dataset changed, or it is another dataset of the
    type - say which ones stay in shared memory, their size and how to drop them (NOTE [cache
    use]). Not one that a live process has open: that one is in use, not left behind - most often
    another dataset of the type in the same job (the training split, wrapped before its validation
    split), which the advice to drop it would throw away. One nobody has open may be either (the
    training script's cache when the evaluation script runs after it): the line says both."""
    base = name[:-_FP_CHARS]
    for other in registry.cache_names(session):
        if other == name or not other.startswith(base) or len(other) != len(name):
            continue
        last = registry.cache_last_opened(session, other)
        if last is None:  # open in a live process now
            continue
        log.warning("cache %s/%s is new: a dataset of type %s with another length, attributes, code, "
                    "transform or samples; %s/%s, of the same type (%.1f MiB of shared memory, last opened %s), "
                    "stays in memory: if it is an earlier version of this dataset, drop it with `shmcache "
                    "destroy %s --cache %s`, or every cache no process opened for a day with `shmcache gc "
                    "--cache-idle-for 1d`; if it is another dataset you still use (another split), keep it",
                    session, name, base[:-1], session, other, registry.cache_shm_bytes(session, other) / 2**20,
                    _ago(time.time() - last), session, other)


def _ago(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"


def snapshot_arg(snapshot: Any, options: dict | None) -> tuple[str, dict] | None:
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
