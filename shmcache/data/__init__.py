"""The torch layer: what a training script touches.

``ShmDatasetCache`` (``dataset``) and what ``wrap()`` returns (``wrapped``); its arguments
(``arguments``); ``get_batch``'s gather (``batches``) and the DataLoader's collated batch
(``collate``, NOTE [collated batch]); the identity that names a cache (``fingerprint``, NOTE
[fingerprint]), probe reads and ``verify_sample`` (``probes``, ``verify``); tensors and PIL images
as codec types (``tensors``, ``images``); ``NodeAffineSampler`` (``sampler``), ``PrefetchRing``
(``prefetch``, NOTE [ring slot reuse]), ``sink_loop`` (``sink``) and a loop's waits (``stall``).

May import: ``snapshot``, ``tiers``, ``cache``, ``base``, ``errors`` and the package root; and
modules of this room without a cycle. The only room that imports torch (``images`` does not).

Start reading at ``ShmDatasetCache.get`` and ``ShmDatasetCache.wrap``.
"""
