"""Snapshot journeys across processes and "machines" (issue 17, items 3 and 5): each step a process
of its own; a machine is a ``$SHMCACHE_DIR`` of its own (machine A: the conftest's, cleaned by it;
machine B: the ``other_machine`` fixture's, emptied at the end). PYTHONPATH is kept.

- read-through with no import and no source: A exports; B, in a fresh process that never imports
  the dataset's module, serves ``ShmDatasetCache(snapshot=DIR).wrap(None)``: every item equal to
  the source's, through ``ds[i]``, ``get_batch`` and a DataLoader with workers;
- export on A, import on B: ``from_snapshot`` in one process of B, then another process of B
  serves the imported cache by name with no source, and a training process with the code copied
  to another path wraps the dataset itself and computes nothing."""

from __future__ import annotations

import json
import shutil
import textwrap
from pathlib import Path

from _journey import env, run

N = 48

MAKE = textwrap.dedent(f'''\
    """Machine A: the dataset, its cache filled and exported (argv: DEST, EXPECTED)."""
    import sys

    import torch
    from torch.utils.data import Dataset

    from shmcache import ShmDatasetCache


    class Records(Dataset):
        computed = 0

        def __init__(self, n={N}):
            self.n = n
            self.names = [f"rec-{{i}}" for i in range(n)]

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            Records.computed += 1
            g = torch.Generator().manual_seed(i)
            return torch.randn(3, 8, 8, generator=g), i % 5, self.names[i]


    if __name__ == "__main__":
        cache = ShmDatasetCache(session="build")
        src = Records()
        ds = cache.wrap(src)
        cache.warmup(ds, progress=False)
        cache.export(sys.argv[1])
        torch.save([src[i] for i in range(len(src))], sys.argv[2])
        print(cache.name)
        cache.close()
''')

SERVE = textwrap.dedent('''\
    """Machine B, a fresh process: the snapshot served with no import and no source (argv: SNAP,
    EXPECTED), or an imported cache by name (argv: SNAP, EXPECTED, NAME)."""
    import json
    import sys

    import torch
    from torch.utils.data import DataLoader

    from shmcache import ShmDatasetCache

    expected = torch.load(sys.argv[2])
    if len(sys.argv) > 3:
        cache = ShmDatasetCache(session="job", name=sys.argv[3], snapshot="")
    else:
        cache = ShmDatasetCache(session="job", snapshot=sys.argv[1])
    ds = cache.wrap(None)
    assert len(ds) == len(expected)


    def same(a, b):
        return torch.equal(a[0], b[0]) and a[1] == b[1] and a[2] == b[2]


    items_ok = all(same(ds[i], expected[i]) for i in range(0, len(ds), 5))
    x, y, names = cache.get_batch([3, 1, 4])
    batch_ok = (torch.equal(x, torch.stack([expected[i][0] for i in (3, 1, 4)]))
                and names == ("rec-3", "rec-1", "rec-4"))  # a tuple, as default_collate gives
    batch_seen = [names, y.tolist(), [float(v) for v in x[:, 0, 0, 0]],
                  [float(expected[i][0][0, 0, 0]) for i in (3, 1, 4)]]
    seen = {}
    for xb, yb, nb in DataLoader(ds, batch_size=8, shuffle=True, num_workers=2):
        for x, y, n in zip(xb, yb.tolist(), nb):
            seen[int(n.split("-")[1])] = (x, y, n)
    loader_ok = sorted(seen) == list(range(len(expected))) and all(same(seen[i], expected[i]) for i in seen)
    st = cache.stats()
    print(json.dumps({"name": cache.name, "len": len(ds), "items_ok": items_ok, "batch_ok": batch_ok,
                      "loader_ok": loader_ok, "batch_seen": repr(batch_seen),
                      "snapshot_hits": st.get("snapshot_hits", 0),
                      "items_mem": st["items_mem"], "make_imported": "make" in sys.modules}))
    cache.close()
''')

IMPORT = textwrap.dedent('''\
    """Machine B: import the snapshot (argv: SNAP)."""
    import sys

    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache.from_snapshot(sys.argv[1], session="job", progress=False)
    assert cache.last_import.complete, cache.last_import
    print(cache.name, cache.last_import.items)
    cache.close()
''')

TRAIN = textwrap.dedent('''\
    """Machine B: training, the dataset's code imported from a copy at another path."""
    import json

    from torch.utils.data import DataLoader

    from make import Records
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="job")
    ds = cache.wrap(Records())
    Records.computed = 0
    n = sum(len(b[1]) for b in DataLoader(ds, batch_size=16))
    print(json.dumps({"name": cache.name, "seen": n, "computed": Records.computed}))
    cache.close()
''')





def _machine_a(tmp_path) -> tuple[Path, Path, str]:
    """Machine A builds and exports; returns (snapshot, expected items file, the cache's name)."""
    code = tmp_path / "a"
    code.mkdir()
    (code / "make.py").write_text(MAKE)
    snap, expected = tmp_path / "snap", tmp_path / "expected.pt"
    name = run(["make.py", snap, expected], code, env()).strip()
    return snap, expected, name


def test_read_through_with_no_import_and_no_source_on_another_machine(tmp_path, other_machine):
    """``ShmDatasetCache(snapshot=DIR).wrap(None)`` raised about get()/put(); now it serves the
    snapshot, named after it, with every item equal to the source's."""
    snap, expected, name = _machine_a(tmp_path)
    b = tmp_path / "b"  # no dataset code here
    b.mkdir()
    (b / "serve.py").write_text(SERVE)
    got = json.loads(run(["serve.py", snap, expected], b, env(other_machine)))
    assert got["name"] == name and got["len"] == N and not got["make_imported"]
    assert got["batch_ok"], got["batch_seen"]
    assert got["items_ok"] and got["loader_ok"], got
    assert got["snapshot_hits"] == N and got["items_mem"] == N  # read through into shared memory


def test_export_on_one_machine_import_on_another_then_serve_and_train(tmp_path, other_machine):
    snap, expected, name = _machine_a(tmp_path)
    b = tmp_path / "b" / "checkout" / "elsewhere"  # the code at another path on machine B
    b.mkdir(parents=True)
    shutil.copy(tmp_path / "a" / "make.py", b / "make.py")
    for script, text in (("serve.py", SERVE), ("import_it.py", IMPORT), ("train.py", TRAIN)):
        (b / script).write_text(text)
    imported, items = run(["import_it.py", snap], b, env(other_machine)).split()
    assert imported == name and int(items) == N
    got = json.loads(run(["serve.py", snap, expected, name], b, env(other_machine)))  # no snapshot=
    assert got["batch_ok"], got["batch_seen"]
    assert got["items_ok"] and got["loader_ok"] and got["snapshot_hits"] == 0, got
    trained = json.loads(run(["train.py"], b, env(other_machine)))
    assert trained == {"name": name, "seen": N, "computed": 0}
