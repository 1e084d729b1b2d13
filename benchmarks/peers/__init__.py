"""The systems ``compare.py`` measures side by side, in the order the tables show them.

shmcache first (the reference for ratios), then the memcpy yardstick (the ceiling), then what users
would pick instead: Redis (Bagua's CachedDataset), per-sample ``torch.save`` files (torch_xla's
CachedDataset) on /dev/shm and on disk, MosaicML Streaming, and no cache at all.
"""

from __future__ import annotations

from ._base import Memory, Peer, ReadPath
from .nocache import NoCache
from .redis_peer import Redis
from .shmcache_peer import ShmCache
from .streaming_peer import Streaming
from .torchsave import TorchSave
from .yardstick import Yardstick

__all__ = ["Memory", "Peer", "ReadPath", "all_peers", "PEER_KEYS"]

PEER_KEYS = ("shmcache", "memcpy", "redis", "torchsave-shm", "torchsave-disk", "streaming", "nocache")


def all_peers(only: list[str] | None = None) -> list[Peer]:
    """Fresh peer objects, optionally only those named in ``only`` (keys of PEER_KEYS)."""
    make = {
        "shmcache": ShmCache, "memcpy": Yardstick, "redis": Redis,
        "torchsave-shm": lambda: TorchSave("shm"), "torchsave-disk": lambda: TorchSave("disk"),
        "streaming": Streaming, "nocache": NoCache,
    }
    return [make[k]() for k in PEER_KEYS if not only or k in only]
