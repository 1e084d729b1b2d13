"""What lies behind a cache's shared memory, and the views of a whole node.

The self-checking record (``records``, NOTE [spill records]) of spill files, Redis values and
snapshots; the spill files (``tiers.spill``); Redis (``remote``, NOTE [remote tier], NOTE [remote
leases]); the seam that asks the tiers in order (``tiered_store.TieredStore``, NOTE [tiers]),
what each tier answers (``protocol.Tier``) and the one place that wires them (``assembly``);
their counters (``counts``, NOTE [tier counts]) and circuit breaker (``breaker``); every cache of
a node read as a bystander (``node_stats``, ``prometheus``) and ``shmcache gc`` as a call
(``namespace_gc``).

May import: ``cache``, ``base``, ``errors``; and modules of this room without a cycle. Never torch.

Start reading at NOTE [tiers] (``tiered_store``), then ``assembly.assemble``.
"""
