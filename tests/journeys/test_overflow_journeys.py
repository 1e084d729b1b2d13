"""Overflows as a user meets them (issue 25, items 2 and 3), each a script in a fresh process: a
filled ``size=`` cap is said once, naming the cap and the fix, and an item larger than the whole
cap is served from the source like every other overflow - counted as rejected and said once."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

from _journey import env, run

DATASET = textwrap.dedent('''\
    import json

    import numpy as np
    from torch.utils.data import DataLoader

    from shmcache import ShmDatasetCache


    class Blobs:
        """n items of nbytes each; item `big` (if any) is `big_bytes` long."""

        def __init__(self, n, nbytes, big=-1, big_bytes=0):
            self.n, self.nbytes, self.big, self.big_bytes = n, nbytes, big, big_bytes

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            size = self.big_bytes if i == self.big else self.nbytes
            return np.full(size, i % 251, np.uint8)
''')

FILLED = DATASET + textwrap.dedent("""\
    cache = ShmDatasetCache(session="cap", name="small", size=1)
    ds = cache.wrap(Blobs(600, 10_000))  # 5.7 MiB of data, a cap of 1 MiB, no spilling
    for _ in range(2):
        for i in range(len(ds)):
            assert ds[i][0] == i % 251
    print(json.dumps(cache.stats()))
    cache.close()
""")

TOO_LARGE = DATASET + textwrap.dedent("""\
    from shmcache.errors import ItemTooLarge

    cache = ShmDatasetCache(session="cap", name="big", size=1)
    ds = cache.wrap(Blobs(40, 1000, big=1, big_bytes=3 << 20))  # item 1: 3 MiB, the cap 1 MiB
    for _ in range(2):
        assert len(ds[1]) == 3 << 20
    for batch in DataLoader(ds, batch_size=8, collate_fn=list):
        pass
    assert len(cache.get("k", lambda k: np.zeros(3 << 20, np.uint8))) == 3 << 20
    try:
        cache.put("p", np.zeros(3 << 20, np.uint8))  # an explicit put says so: documented
    except ItemTooLarge:
        print("put raised")
    print(json.dumps(cache.stats()))
    cache.close()
""")


def _run(tmp_path, script: str) -> tuple[str, str]:
    """``python job.py`` in a fresh process: its stdout and stderr, after asserting it exited 0."""
    (tmp_path / "job.py").write_text(script)
    done = subprocess.run(
        [sys.executable, "job.py"], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, f"job.py exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout, done.stderr


def _destroy(tmp_path):
    run(["-m", "shmcache", "destroy", "cap", "--force"], tmp_path, env())


def test_a_filled_size_cap_is_said_once_naming_the_cap_and_the_fix(tmp_path):
    try:
        out, err = _run(tmp_path, FILLED)
    finally:
        _destroy(tmp_path)
    st = json.loads(out.splitlines()[-1])
    assert st["rejected"] > 0 and st["items_mem"] > 0
    lines = [ln for ln in err.splitlines() if "stops growing in memory" in ln]
    assert len(lines) == 1, err
    assert "cap/small" in lines[0] and "size=1 MiB" in lines[0], lines[0]
    assert "larger size=" in lines[0] and "spilling=True" in lines[0] and "rejected" in lines[0], lines[0]


def test_an_item_larger_than_the_cap_is_served_counted_and_said_once(tmp_path):
    try:
        out, err = _run(tmp_path, TOO_LARGE)
    finally:
        _destroy(tmp_path)
    *_, said, stats = out.splitlines()
    st = json.loads(stats)
    assert said == "put raised"
    # ds[1] twice, the loader's ds[1], get("k"), put("p"): each counted, none stored
    assert st["rejected"] == 5 and st["items_mem"] == 39, st
    lines = [ln for ln in err.splitlines() if "can never fit" in ln]
    assert len(lines) == 1, err
    assert "cap/big" in lines[0] and "size=" in lines[0] and "rejected" in lines[0], lines[0]
