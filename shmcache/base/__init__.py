"""OS primitives, the bottom room: nothing here knows what a cache is.

Names and private directories (``namespace``), how much memory there is (``memory``, ``memdir``),
one shared-memory object (``shm``, NOTE [segment lifecycle]), flock locks and liveness slots
(``locks``, NOTE [lock files]), memory ordering for lock-free readers (``ordering``), the job's
secret and record MACs (``trust``, NOTE [record authentication]), the one reader of environment
variables (``settings``), small owned files (``owned_file``), crash points (``faults``), URL
masking (``urls``), the progress bar (``progress``), nested containers (``trees``).

May import: ``errors``; and modules of this room without a cycle. Never torch.

Start reading at ``shm.Segment`` and NOTE [segment lifecycle], then ``locks.FlockLock``.
"""
