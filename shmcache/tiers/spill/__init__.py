"""Spill: where a cache's items go on disk when its shared memory is full.

    tiers.records the self-checking record (also the record of the remote and snapshot tiers)
    recovery      the file-level crash protocol: take over a slot file, repair a torn tail
    files         SpillStore: one folder of append-only slot files, lock-free reads
    tier          SpillTier, the store's indexed tier (cache.indexed_tier.IndexedTier): where its folder
                  is, write a record and answer its RecordLocation, read a RecordLocation back

NOTE [spill records] (in ``tiers.records``, one folder up) holds the protocol. The spill tier
decides nothing and never calls the store (NOTE [tiers]): the store publishes the locations it
answers.

May import: ``tiers`` (the record), ``cache``, ``base``, ``errors``; and modules of this room
without a cycle. Never torch.

Start reading at NOTE [spill records], then ``SpillStore.append`` and ``SpillStore.read``.
"""

from ...errors import SpillFull
from ..records import FILE_HEADER_BYTES, MAX_KEY_BYTES, RECORD_HEADER_BYTES, pack_record, unpack_record
from .files import MAX_FILE_IDS, SpillLoc, SpillStore, check_spill_dir
from .recovery import RecoverReport

__all__ = [
    "SpillStore",
    "SpillLoc",
    "SpillFull",
    "RecoverReport",
    "check_spill_dir",
    "pack_record",
    "unpack_record",
    "MAX_FILE_IDS",
    "MAX_KEY_BYTES",
    "FILE_HEADER_BYTES",
    "RECORD_HEADER_BYTES",
]
