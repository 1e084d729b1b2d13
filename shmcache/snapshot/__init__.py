"""Portable snapshots of a cache: export it to a directory or an object-store prefix, import it
into shared memory anywhere, run without the source.

    format        the files: data files of self-checking records, a sorted index, the manifest
    location      where they live: a local directory or an fsspec URL (s3://, memory://, ...)
    export        a cache to a snapshot (shmcache export, ShmDatasetCache.export)
    load          a snapshot into a cache (shmcache import, ShmDatasetCache.from_snapshot)
    tier          the read-through tier: a snapshot read key by key behind shared memory

May import: ``tiers``, ``cache``, ``base``, ``errors``; and modules of this room without a cycle.
Never torch.

Start reading at NOTE [snapshot format] (``format``), then ``load.import_snapshot`` and NOTE
[snapshot read-through] (``tier.SnapshotTier``).
"""
