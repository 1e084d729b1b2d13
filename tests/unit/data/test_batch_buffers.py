"""Large batches without out= reuse output buffers - but never one that a caller still holds."""

import numpy as np
import torch

from shmcache import ShmDatasetCache


def test_big_batches_recycle_only_dropped_buffers():
    cache = ShmDatasetCache(session="buf", name="x", size=256)
    for i in range(300):
        cache.put(i, (np.full((96, 96, 3), i % 250, np.uint8), i))  # 256 x 27 KB = 7 MB batches
    a = cache.get_batch(list(range(0, 256)))
    b = cache.get_batch(list(range(1, 257)))
    assert a[0].data_ptr() != b[0].data_ptr()
    held = a[0][10]  # a view keeps a's buffer alive even after the batch itself is dropped
    ptr_a = a[0].data_ptr()
    del a
    c = cache.get_batch(list(range(2, 258)))
    assert c[0].data_ptr() != ptr_a
    assert int(held[0, 0, 0]) == 10 and int(b[0][0, 0, 0, 0]) == 1  # nothing overwritten
    ptr_c = c[0].data_ptr()
    del c
    d = cache.get_batch(list(range(3, 259)))
    assert d[0].data_ptr() == ptr_c, "a dropped buffer is used again"
    assert torch.equal(d[1], torch.arange(3, 259))
    assert int(d[0][0, 0, 0, 0]) == 3 and int(held[0, 0, 0]) == 10
    cache.close()
