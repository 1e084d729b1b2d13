"""shmcache: one dataset cache in POSIX shared memory for every PyTorch process on a machine.

The public names load lazily, so ``import shmcache`` (and the ``shmcache`` command line) never
imports torch.

The folders are the rooms, which are the layers, bottom to top: ``base`` < ``cache`` < ``tiers``
< ``snapshot`` < ``data`` < ``launch``, ``cli``; ``errors`` sits below them all. Each room's
``__init__`` says what lives there and what it may import; docs/design.md is the map.
"""

from __future__ import annotations

from .errors import *  # noqa: F401,F403  (errors are part of the public API)
from .errors import __all__ as _errors_all

__version__ = "0.1.0"

_LAZY = {
    "ShmDatasetCache": "data.dataset",
    "CachedDataset": "data.dataset",
    "CachedIterableDataset": "data.dataset",
    "NodeAffineSampler": "data.sampler",
    "PrefetchRing": "data.prefetch",
    "timed": "data.stall",
    "sink_loop": "data.sink",
    "SinkResult": "data.sink",
    "LossMonitor": "data.sink",
    "TimeMonitor": "data.sink",
}

__all__ = [*_LAZY, *_errors_all, "__version__"]


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'shmcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
