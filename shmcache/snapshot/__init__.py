"""Portable snapshots of a cache: export it to a directory or an object-store prefix, import it
into shared memory anywhere, run without the source.

    format.py     the files: data files of self-checking records, a sorted index, the manifest
    location.py   where they live: a local directory or an fsspec URL (s3://, memory://, ...)
    export.py     a cache to a snapshot (shmcache export, ShmDatasetCache.export)
    load.py       a snapshot into a cache (shmcache import, ShmDatasetCache.from_snapshot)
    tier.py       the read-through tier: a snapshot read key by key behind shared memory

NOTE [snapshot format] holds the format and the order in which it is written.
"""
