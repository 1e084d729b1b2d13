"""One cache in shared memory, shared by every process of the machine.

The store (``store.CacheStore``, NOTE [publish order]: a facade over its read side,
``view.CacheView``, lock-free, and its write side, ``writer.CacheWriter``, under the lock; the
surface every store shares is ``store_protocol.Store``; the root's words ``root``) and its parts:
size classes (``allocator``), the lock-free index (``index``), generations and the meta segment
(``generation``), the record and its layouts (``codec``, NOTE [record format]), the batch gather
(``gather``), admission (``admission``, NOTE [memory limits]), a group of ``put_records``
published together (``publish_group``), repair and gc (``repair``), portable records (``portable``),
claims (``claims``, NOTE [claims]), counters (``stats``, ``stall``; rows per process:
``slot_rows``, NOTE [slot rows]); sessions and their processes (``registry``, ``process_slot``).
It knows the spill files only through the ``IndexedTier`` protocol it declares (``indexed_tier``).

May import: ``base``, ``errors``; and modules of this room without a cycle. Never torch, never a
room above (tiers, snapshot, data, launch, cli).

Start reading at ``CacheView.lookup`` and ``CacheWriter.put`` with NOTE [publish order], then
``index.TableView`` and ``codec``.
"""
