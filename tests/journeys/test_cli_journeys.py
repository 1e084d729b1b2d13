"""The command line as a shell user meets it (issue 17): a cache of tensors filled by one script,
then ``shmcache`` commands, each in a fresh process with its own environment that never imported
torch. Every command runs under a wrapper that reports, at exit, whether torch got imported:
stat, ls, info and gc decode no record and must not import it; export and import of a cache of
tensors must work with no import by the user (the codec loads the tensor handler by itself).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

# Runs the CLI as `python -m shmcache ARGS` does, then reports whether torch was imported.
_WRAPPER = textwrap.dedent("""\
    import runpy, sys
    sys.argv = ["shmcache", *sys.argv[1:]]
    code = 0
    try:
        runpy.run_module("shmcache", run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    sys.stderr.write("\\nTORCH-IMPORTED=%s\\n" % ("torch" in sys.modules))
    sys.exit(code)
""")

_FILL = textwrap.dedent("""\
    import torch
    from torch.utils.data import Dataset

    from shmcache import ShmDatasetCache


    class Squares(Dataset):
        def __len__(self):
            return {n}

        def __getitem__(self, i):
            return torch.full((4,), float(i) ** 2), i


    cache = ShmDatasetCache(size=16)
    ds = cache.wrap(Squares())
    for i in range(len(ds)):
        ds[i]
    print(cache.stats()["name"])
""")


def _env() -> dict:
    """The test's environment: $SHMCACHE_DIR (the fixture's namespace) and $PYTHONPATH kept."""
    env = dict(os.environ)
    env.pop("SHMCACHE_SESSION", None)
    return env


def _run(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=_env())


def shmcache(*args: str) -> tuple[int, str, str, bool]:
    """``shmcache ARGS`` in a fresh process: (exit code, stdout, stderr, torch imported)."""
    proc = _run([sys.executable, "-c", _WRAPPER, *args])
    marker = proc.stderr.rstrip().rsplit("\n", 1)[-1]
    assert marker.startswith("TORCH-IMPORTED="), proc.stderr[-2000:]
    return proc.returncode, proc.stdout, proc.stderr.rstrip().rsplit("\n", 1)[0], marker.endswith("True")


def _fill(tmp_path: Path, n: int = 300) -> str:
    script = tmp_path / "fill.py"
    script.write_text(_FILL.format(n=n))
    proc = _run([sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.split()[-1]


@pytest.fixture
def tensor_cache(tmp_path) -> str:
    """A cache of 300 (tensor, int) samples in session 'default', filled by a script of its own."""
    return _fill(tmp_path)


def test_stat_ls_info_never_import_torch(tensor_cache):
    rc, out, err, torch_imported = shmcache("stat")
    assert rc == 0, err
    assert tensor_cache in out and "300" in out
    assert not torch_imported
    rc, out, err, torch_imported = shmcache("stat", "--json")
    assert rc == 0, err
    [row] = json.loads(out)
    assert row["name"] == tensor_cache and row["items_mem"] == 300
    assert not torch_imported
    for command in (["ls"], ["info"], ["ls", "--json"]):
        rc, out, err, torch_imported = shmcache(*command)
        assert rc == 0, (command, err)
        assert not torch_imported, command


def test_gc_keeps_a_cache_of_tensors_without_torch(tensor_cache):
    rc, out, err, torch_imported = shmcache("gc")
    assert rc == 0, err
    assert "damaged" not in out, out
    assert not torch_imported
    rc, out, err, _ = shmcache("gc", "--json")
    assert rc == 0, err
    assert json.loads(out)["dropped_caches"] == []
    rc, out, err, _ = shmcache("stat", "--json")
    assert json.loads(out)[0]["items_mem"] == 300  # nothing dropped: the valid cache is intact


_FILL_CUSTOM = textwrap.dedent("""\
    import numpy as np
    from shmcache.cache import codec
    from shmcache.cache.store import CacheStore


    class Point:
        def __init__(self, xy):
            self.xy = xy


    codec.register_type(Point, "point", lambda p: ("i8:8", (2,), np.asarray(p.xy, np.int64).view(np.uint8)),
                        lambda meta, shape, raw: Point(raw.view(np.int64).tolist()))
    store = CacheStore("default", "points", capacity_bytes=4 << 20)
    for i in range(50):
        store.put(i, (Point([i, -i]), i))
    store.close()
""")


def test_gc_keeps_a_cache_whose_handler_no_process_has_loaded(tmp_path):
    """A type registered by the user's own script: gc, in a process that cannot load its handler,
    checks the cache's layouts by their structure and keeps it."""
    script = tmp_path / "fill_custom.py"
    script.write_text(_FILL_CUSTOM)
    proc = _run([sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rc, out, err, torch_imported = shmcache("gc", "--json")
    assert rc == 0, err
    assert json.loads(out)["dropped_caches"] == [], out
    assert not torch_imported
    rc, out, err, _ = shmcache("stat", "--json")
    assert json.loads(out)[0]["items_mem"] == 50


def test_an_authenticated_import_keeps_a_type_only_the_users_script_registers(tmp_path, monkeypatch):
    """The job's MAC says our own writer made a record of the user's registered type: the CLI,
    which cannot decode it, imports it for the script that can. Without a MAC the same records
    are a stranger's, of a type nothing here decodes: never stored (issue 24)."""
    monkeypatch.setenv("SHMCACHE_SECRET", "a-job-secret-of-enough-bytes-0123456789")
    script = tmp_path / "fill_custom.py"
    script.write_text(_FILL_CUSTOM)
    proc = _run([sys.executable, str(script)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    for signed, dest in ((True, tmp_path / "signed"), (False, tmp_path / "unsigned")):
        if not signed:
            monkeypatch.delenv("SHMCACHE_SECRET")
        rc, out, err, _ = shmcache("export", "default", "points", str(dest))
        assert rc == 0, err
        rc, out, err, _ = shmcache("destroy", "default")
        assert rc == 0, err
        rc, out, err, _ = shmcache("import", str(dest), *(() if signed else ("--allow-unsigned",)))
        if signed:
            assert rc == 0 and "imported 50 of 50" in out, err + out
            reader = tmp_path / "read_custom.py"
            reader.write_text(_FILL_CUSTOM.split("store = CacheStore")[0] + textwrap.dedent("""\
                from shmcache import ShmDatasetCache
                with ShmDatasetCache(name="points") as cache:
                    p, i = cache[7]
                assert i == 7 and p.xy == [7, -7], (p.xy, i)
                print("ok")
            """))
            proc = _run([sys.executable, str(reader)])
            assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]
        else:
            assert "imported 0 of 50" in out + err, err + out


def test_export_then_import_a_cache_of_tensors_with_no_import(tensor_cache, tmp_path):
    dest = tmp_path / "snap"
    rc, out, err, torch_imported = shmcache("export", "default", str(dest))
    assert rc == 0, err
    assert "300" in out, out
    assert not torch_imported  # records are copied as they are: no tensor is built
    assert (dest / "manifest.json").exists()
    # as on another machine: the session is gone, the snapshot fills a new one
    rc, out, err, _ = shmcache("destroy", "default")
    assert rc == 0, err
    rc, out, err, torch_imported = shmcache("import", str(dest))
    assert rc == 0, err + out
    assert "imported 300 of 300" in out, out
    assert not torch_imported  # records are checked, not turned into tensors
    rc, out, err, torch_imported = shmcache("stat", "--json")
    assert rc == 0, err
    [row] = json.loads(out)
    assert row["name"] == tensor_cache and row["items_mem"] == 300
    assert not torch_imported
    # and a training script reads the tensors back from memory
    check = tmp_path / "check.py"
    check.write_text(textwrap.dedent(f"""\
        import torch
        from shmcache import ShmDatasetCache
        cache = ShmDatasetCache(name={tensor_cache!r})
        x, i = cache.get(7)
        assert i == 7 and torch.equal(x, torch.full((4,), 49.0)), (x, i)
        print("ok")
    """))
    proc = _run([sys.executable, str(check)])
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def _median_start_s(runs: int) -> float:
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        rc, _, err, torch_imported = shmcache("stat")
        times.append(time.perf_counter() - t0)
        assert rc == 0 and not torch_imported, err
    return sorted(times)[len(times) // 2]


@pytest.mark.slow  # ~40 s: three imports of torch to compare with; the tests above assert no torch
def test_stat_starts_fast_on_a_cache_of_tensors(tensor_cache):
    """Bounded against a process that imports torch: stat must stay well under it."""
    stat_s = _median_start_s(3)
    torch_s = []
    for _ in range(3):
        t0 = time.perf_counter()
        proc = _run([sys.executable, "-c", "import torch"])
        torch_s.append(time.perf_counter() - t0)
        assert proc.returncode == 0
    assert stat_s < sorted(torch_s)[1], (stat_s, torch_s)
