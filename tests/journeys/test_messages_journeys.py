"""Docs and messages that a new user found disagreeing with what happens (issue 25, item 7), each
checked as a user meets it: the CLI and scripts in fresh processes, their own environment."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _journey import env, run

ROOT = Path(__file__).resolve().parents[2]

DATASET = textwrap.dedent('''\
    import numpy as np


    class Numbers:
        """n items of 64 int32, item i full of i + offset: another offset, another dataset."""

        def __init__(self, n=50, offset=0):
            self.n, self.offset = n, offset

        def __len__(self):
            return self.n

        def __getitem__(self, i):
            return np.full(64, i + self.offset, np.int32)
''')


def _shmcache(*args, cwd: Path, e: dict | None = None) -> subprocess.CompletedProcess:
    """``python -m shmcache ARGS`` in a fresh process (the CLI never imports torch)."""
    return subprocess.run(
        [sys.executable, "-m", "shmcache", *map(str, args)],
        cwd=cwd,
        env=e or env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def _script(tmp_path: Path, name: str, body: str) -> Path:
    (tmp_path / "mydata.py").write_text(DATASET)
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


# --- the docs ---------------------------------------------------------------------------------------


def test_launch_readme_says_the_rendezvous_port_proves_the_job_token():
    text = (ROOT / "launch" / "README.md").read_text()
    notes = " ".join(text.split("Notes:", 1)[1].split())
    assert "SHMCACHE_RDZV_TOKEN" in notes and "HMAC" in notes
    assert not re.search(r"That port[^.]*unauthenticated", notes), "the token's proof works (README)"


def test_readme_claims_no_test_count_or_duration_that_goes_stale():
    text = (ROOT / "README.md").read_text().split("## Tests", 1)[1].split("\n## ", 1)[0]
    assert not re.search(r"about [\d,]+ tests|\d+(-\d+)? minutes", text), text[:200]


def test_readme_states_the_spill_reserve_with_its_quarter():
    from shmcache.cache.admission import index_reserve

    assert index_reserve(2 << 20) == (2 << 20) // 4  # the quarter binds a small cap
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "at least 1 MiB but at most a quarter of it, at most 256 MiB" in text


def test_cache_sh_says_mib_for_its_size():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash is not installed")
    out = subprocess.run(
        [bash, str(ROOT / "launch" / "cache.sh"), "-h"], capture_output=True, text=True, timeout=30
    ).stdout
    size = [ln for ln in out.splitlines() if "--size MIB" in ln]
    assert len(size) == 2 and "in MiB" in size[1], size
    assert not re.search(r"\bMB\b", out), out


# --- the CLI ----------------------------------------------------------------------------------------


def test_unknown_session_hints_fit_the_command(tmp_path):
    _shmcache("new", "there", cwd=tmp_path)
    try:
        for args, fix in (
            (["destroy", "nosuch"], "nothing to destroy"),
            (["stat", "nosuch"], "check the name"),
            (["export", "nosuch", tmp_path / "snap"], "check the name"),
        ):
            done = _shmcache(*args, cwd=tmp_path)
            assert done.returncode == 1, done
            assert "no session 'nosuch'" in done.stderr and "sessions: there" in done.stderr, done.stderr
            assert fix in done.stderr and "shmcache ls" in done.stderr, done.stderr
            assert "session='auto'" not in done.stderr and "shmcache new" not in done.stderr, done.stderr
    finally:
        _shmcache("destroy", "there", cwd=tmp_path)


def test_commands_that_only_look_never_create_the_shmcache_dir(tmp_path):
    missing = tmp_path / "typo" / "ns"
    e = env(missing)
    for args in (
        ["stat"],
        ["stat", "--json"],
        ["ls"],
        ["ls", "--json"],
        ["info"],
        ["stat", "s"],
        ["destroy", "s"],
        ["export", "s", tmp_path / "snap"],
    ):
        done = _shmcache(*args, cwd=tmp_path, e=e)
        assert done.returncode in (0, 1) and "Traceback" not in done.stderr, (args, done)
        assert not (tmp_path / "typo").exists(), f"`shmcache {' '.join(map(str, args))}` made {missing}"
    assert json.loads(_shmcache("ls", "--json", cwd=tmp_path, e=e).stdout) == []


def test_new_says_where_a_size_goes(tmp_path):
    done = _shmcache("new", "sized", "--size", "512", cwd=tmp_path)
    assert done.returncode == 2, done
    assert "no size of its own" in done.stderr and "size=512" in done.stderr, done.stderr
    assert "--size 512" in done.stderr and "SHMCACHE_SIZE_MB" in done.stderr, done.stderr
    assert "sized" not in _shmcache("ls", cwd=tmp_path).stdout


# --- scripts ----------------------------------------------------------------------------------------


def test_the_pickle_warning_points_at_the_users_line(tmp_path):
    job = _script(
        tmp_path,
        "job.py",
        """\
        import warnings
        from shmcache import ShmDatasetCache

        class Pickled:
            def __len__(self):
                return 8

            def __getitem__(self, i):
                return {"tags": {i, i + 1}}

        warnings.simplefilter("always")
        cache = ShmDatasetCache(session="pk", name="p")
        ds = cache.wrap(Pickled())  # LINE
        cache.close()
        """,
    )
    line = next(n for n, text in enumerate(job.read_text().splitlines(), 1) if "# LINE" in text)
    done = subprocess.run(
        [sys.executable, str(job)], cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=60
    )
    try:
        assert done.returncode == 0, done.stderr
        assert f"{job}:{line}: UserWarning: cache pk/p: samples holding set" in done.stderr, done.stderr
    finally:
        _shmcache("destroy", "pk", cwd=tmp_path)


def test_warmup_computations_count_as_misses(tmp_path):
    _script(
        tmp_path,
        "warm.py",
        """\
        import json
        from shmcache import ShmDatasetCache
        from mydata import Numbers

        cache = ShmDatasetCache(session="wm", name="w")
        computed = cache.warmup(cache.wrap(Numbers(50)), progress=False)
        print(json.dumps({"returned": computed, **cache.stats()}))
        cache.close()
        """,
    )
    try:
        st = json.loads(run(["warm.py"], tmp_path, env()).splitlines()[-1])
        stat = json.loads(_shmcache("stat", "wm", "--json", cwd=tmp_path).stdout)[0]
    finally:
        _shmcache("destroy", "wm", cwd=tmp_path)
    # wrap() computed 3 probes (kept, not counted: they fingerprint the dataset), warmup() the other
    # 47: each a miss, as a read that computes its item is; stats()'s `computed` counts every
    # computation, the probes' reads included (NOTE [claims])
    assert st["returned"] == 47 and st["misses"] == 47 and st["hits"] == 0, st
    assert st["computed"] >= 47 + 3, st
    assert stat["misses"] == 47, stat


def test_python_opens_a_cache_the_cli_imported_by_session_and_name(tmp_path):
    _script(
        tmp_path,
        "export.py",
        """\
        import sys
        from shmcache import ShmDatasetCache
        from mydata import Numbers

        cache = ShmDatasetCache(session="src")
        ds = cache.wrap(Numbers(50))
        for i in range(len(ds)):
            ds[i]
        cache.export(sys.argv[1])
        print(cache.name)
        cache.close()
        """,
    )
    _script(
        tmp_path,
        "train.py",
        """\
        import sys
        from shmcache import ShmDatasetCache
        from mydata import Numbers

        by_name = ShmDatasetCache(session="job", name=sys.argv[1]).wrap(None)  # as the README shows
        assert len(by_name) == 50 and all(int(by_name[i][0]) == i for i in range(50))
        cache = ShmDatasetCache(session="job")
        ds = cache.wrap(Numbers(50))  # the very dataset: found by its fingerprint
        assert cache.name == sys.argv[1] and all(int(ds[i][0]) == i for i in range(50))
        print("misses", cache.stats()["misses"])
        cache.close()
        """,
    )
    try:
        name = run(["export.py", tmp_path / "snap"], tmp_path, env()).split()[-1]
        done = _shmcache("import", tmp_path / "snap", "--session", "job", cwd=tmp_path)
        assert done.returncode == 0 and name in done.stdout + done.stderr, done
        assert "misses 0" in run(["train.py", name], tmp_path, env())
    finally:
        for session in ("src", "job"):
            _shmcache("destroy", session, "--force", cwd=tmp_path)


@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_a_reader_of_a_cache_that_import_force_replaces_goes_on_from_its_source(tmp_path):
    """`shmcache import --force` under a live reader: its reads miss from then on and it computes its
    items from its own source, uncached, said once; it never stops, never reads the other dataset."""
    _script(
        tmp_path,
        "export.py",
        """\
        import sys
        from shmcache import ShmDatasetCache
        from mydata import Numbers

        cache = ShmDatasetCache(session=sys.argv[2], name="c")
        ds = cache.wrap(Numbers(50, offset=int(sys.argv[3])))
        for i in range(len(ds)):
            ds[i]
        cache.export(sys.argv[1])
        cache.close()
        """,
    )
    _script(
        tmp_path,
        "reader.py",
        """\
        import os, sys
        from shmcache import ShmDatasetCache
        from mydata import Numbers

        cache = ShmDatasetCache(session="live", name="c")
        ds = cache.wrap(Numbers(50))
        assert all(int(ds[i][0]) == i for i in range(50))
        print("ready", flush=True)
        sys.stdin.readline()  # the test replaced the cache
        wrong = sum(int(ds[i][0]) != i for i in range(50) for _ in range(2))  # the other's: i + 1000
        print("wrong", wrong, flush=True)
        """,
    )
    reader = None
    try:
        run(["export.py", tmp_path / "other", "src", "1000"], tmp_path, env())
        run(["export.py", tmp_path / "mine", "live", "0"], tmp_path, env())
        reader = subprocess.Popen(
            [sys.executable, "reader.py"],
            cwd=tmp_path,
            env=env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert reader.stdout.readline().strip() == "ready"
        done = _shmcache("import", tmp_path / "other", "--session", "live", "--name", "c", "--force", cwd=tmp_path)
        assert done.returncode == 0, done
        out, err = reader.communicate("go\n", timeout=60)
        assert reader.returncode == 0, err
        assert "wrong 0" in out, out
        said = [ln for ln in err.splitlines() if "was destroyed while this process used it" in ln]
        assert len(said) == 1 and "own source" in said[0], err
    finally:
        if reader is not None and reader.poll() is None:
            reader.kill()
            reader.wait()
        for session in ("src", "live"):
            _shmcache("destroy", session, "--force", cwd=tmp_path)


def test_launch_from_the_parent_of_a_clone_named_shmcache_runs_the_package(tmp_path):
    """The clone (no __init__.py) on sys.path first - the current directory - is a namespace package
    that hides the installed one from `python -m shmcache.launch`: its recipes folder, launch/,
    is found instead. It says so and runs the real launcher."""
    e = env()
    e.pop("PYTHONPATH", None)  # the package as installed (pip install -e): never through the checkout
    probe = subprocess.run(
        [sys.executable, "-c", "import shmcache.launch.run"], cwd=tmp_path, env=e, capture_output=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip("shmcache is not installed (pip install -e .): only PYTHONPATH finds it")
    clone = tmp_path / "shmcache"
    shutil.copytree(ROOT / "launch", clone / "launch")
    (clone / "shmcache").mkdir()  # the package folder, without the package: the clone's layout
    (tmp_path / "job.py").write_text("import os\nprint('rank', os.environ['RANK'])\n")
    done = subprocess.run(
        [sys.executable, "-m", "shmcache.launch", "--nproc", "1", "job.py"],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=90,
    )
    try:
        assert done.returncode == 0, done.stderr
        assert "rank 0" in done.stdout
        assert f"{clone} (a clone in the current directory) hides the installed package" in done.stderr
    finally:
        _shmcache("destroy", os.environ.get("SHMCACHE_SESSION", "default"), "--force", cwd=tmp_path, e=e)


_WRAP = """
import sys
from shmcache import ShmDatasetCache
from shmcache.errors import CacheMismatch
cache = ShmDatasetCache(session="mm", name="photos", size=8)
try:
    cache.wrap([[float(sys.argv[1])] * 4 for _ in range(10)])
except CacheMismatch as exc:
    print("MISMATCH", exc)
else:
    print("BOUND")
if sys.argv[2:] == ["clear"]:
    cache.clear()
    print("CLEARED", len(cache))
cache.close()
"""


def test_a_cache_of_another_dataset_names_the_fix_that_works(tmp_path):
    """Issue 31: CacheMismatch said "drop the old one with cache.clear()"; after a clear() (0 items)
    a fresh process wrapping the new dataset met the same error. The message names what works,
    and what it names works, as a user runs it: each step a fresh process."""
    e = env(tmp_path / "shm")
    script = tmp_path / "wrap.py"
    script.write_text(_WRAP)
    assert "BOUND" in run([script, "1", "clear"], tmp_path, e)
    out = run([script, "2"], tmp_path, e)  # another dataset, a fresh process, the cache cleared
    assert out.startswith("MISMATCH"), out
    assert "cache.clear()" not in out, out  # not offered: it drops the items, not the dataset bound
    fix = re.search(r"`(shmcache destroy [^`]+)`", out)
    assert fix, out
    run(["-m", *fix.group(1).split()], tmp_path, e)
    try:
        assert "BOUND" in run([script, "2"], tmp_path, e)
    finally:
        run(["-m", "shmcache", "destroy", "mm"], tmp_path, e)  # the test leaves no segments
