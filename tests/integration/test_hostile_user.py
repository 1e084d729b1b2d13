"""A hostile local user (issue 8, item 5): whatever another user plants where shmcache will look -
a symlink at the namespace path, a symlink at a cache's folder in a shared spill directory, a
file, FIFO or symlink at one of our segment names - root's shmcache refuses with a clear error
that names the path, and never follows, chmods, writes into or unlinks what it did not make.

The attacker is a real user (``shmcache-attacker``, created here if missing). Every scenario runs
in a private mount namespace with fresh tmpfs over /tmp and /dev/shm, so planting
``/tmp/shmcache-0 -> /tmp`` never touches the machine's real /tmp; the mounts die with the
namespace's last process.
"""

from __future__ import annotations

import json
import os
import pwd
import shlex
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ATTACKER = "shmcache-attacker"

pytestmark = [
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root: creates a user, mounts tmpfs in a private "
                                                 "mount namespace and runs commands as another user"),
    pytest.mark.skipif(shutil.which("unshare") is None or shutil.which("runuser") is None,
                       reason="needs unshare and runuser (util-linux)"),
]

# Runs first inside the namespace: helpers for the scenario body, which prints one JSON line.
_PRELUDE = r'''
import json, os, stat, subprocess, sys

def attacker(*argv):
    """Run a command as the attacker; it must succeed (the plant is the premise of the test)."""
    subprocess.run(["runuser", "-u", "shmcache-attacker", "--", *argv], check=True)

def root_cli(*args, **env):
    """Root's `shmcache ARGS` with no $XDG_RUNTIME_DIR / $SHMCACHE_DIR unless given."""
    e = {k: v for k, v in os.environ.items() if k not in ("XDG_RUNTIME_DIR", "SHMCACHE_DIR")}
    e.update(env)
    p = subprocess.run([sys.executable, "-m", "shmcache.cli", *args], env=e, capture_output=True,
                       text=True, timeout=60)
    return {"rc": p.returncode, "out": p.stdout, "err": p.stderr}

def mode(path):
    return oct(stat.S_IMODE(os.lstat(path).st_mode))

def listing(path):
    return sorted(os.listdir(path))

def owner(path):
    return os.lstat(path).st_uid
'''


@pytest.fixture(scope="module")
def attacker_uid() -> int:
    try:
        return pwd.getpwnam(ATTACKER).pw_uid
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True, capture_output=True)
        return pwd.getpwnam(ATTACKER).pw_uid


def _mounts() -> str:
    """The shell commands that give the namespace fresh tmpfs at /dev/shm and /tmp.

    A checkout or virtual environment that lives under /tmp (a CI runner's clone, say) would vanish
    under the new /tmp, interpreter included: the real /tmp is bound aside first (inside the new
    /dev/shm, so nothing of it shows on the machine) and those directories are bound back at their
    own paths, then the aside mount goes."""
    needed = sorted({str(p) for p in (Path(__file__).resolve().parents[2], Path(sys.prefix).resolve())
                     if p.is_relative_to("/tmp")})
    cmds = ["mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm"]
    if needed:
        cmds += ["mkdir /dev/shm/.real-tmp", "mount --bind /tmp /dev/shm/.real-tmp"]
    cmds.append("mount -t tmpfs -o size=64m,mode=1777 tmpfs /tmp")
    for path in needed:
        aside = "/dev/shm/.real-tmp/" + os.path.relpath(path, "/tmp")
        cmds += [f"mkdir -p {shlex.quote(path)}", f"mount --bind {shlex.quote(aside)} {shlex.quote(path)}"]
    if needed:
        cmds += ["umount -l /dev/shm/.real-tmp", "rmdir /dev/shm/.real-tmp"]
    return " && ".join(cmds) + ' && exec "$0" -c "$1"'


def _isolated(body: str) -> dict:
    """Run ``body`` as root under fresh private tmpfs at /tmp and /dev/shm; return its JSON line."""
    script = _PRELUDE + textwrap.dedent(body)
    mounts = _mounts()
    env = {k: v for k, v in os.environ.items()
           if k not in ("XDG_RUNTIME_DIR", "SHMCACHE_DIR", "SHMCACHE_SPILL_DIR", "SHMCACHE_SESSION")}
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", mounts, sys.executable, script],
                       env=env, capture_output=True, text=True, timeout=100)
    assert p.returncode == 0, f"scenario failed (rc {p.returncode}):\n{p.stdout}\n{p.stderr}"
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("target", ["/tmp", "/dev/shm"])
def test_symlink_at_the_default_namespace_path_is_refused(attacker_uid, target):
    out = _isolated(f'''
        before = {{"mode": mode({target!r}), "list": listing({target!r})}}
        attacker("ln", "-s", {target!r}, "/tmp/shmcache-0")
        ls = root_cli("ls")
        stat_ = root_cli("stat")
        print(json.dumps({{"before": before, "ls": ls, "stat": stat_, "mode": mode({target!r}),
                          "list": listing({target!r}), "link": os.readlink("/tmp/shmcache-0")}}))
    ''')
    for run in (out["ls"], out["stat"]):
        assert run["rc"] == 1, run
        err = run["err"]
        assert "/tmp/shmcache-0" in err and "symlink" in err and "attack" in err, err
        assert "SHMCACHE_DIR" in err and "XDG_RUNTIME_DIR" in err, err  # the fix
        assert "Traceback" not in err
    assert out["mode"] == out["before"]["mode"] == "0o1777"  # never chmodded to 0700
    expect = out["before"]["list"] + (["shmcache-0"] if target == "/tmp" else [])
    assert out["list"] == expect, "root wrote into the symlink's target"
    assert out["link"] == target  # the attacker's symlink is left alone


def test_namespace_directory_owned_by_another_user_is_refused(attacker_uid):
    out = _isolated('''
        attacker("mkdir", "-m", "0777", "/tmp/shmcache-0")
        ls = root_cli("ls")
        print(json.dumps({"ls": ls, "mode": mode("/tmp/shmcache-0"), "list": listing("/tmp/shmcache-0"),
                          "owner": owner("/tmp/shmcache-0")}))
    ''')
    assert out["ls"]["rc"] == 1, out
    assert "/tmp/shmcache-0" in out["ls"]["err"] and f"uid {attacker_uid}" in out["ls"]["err"], out
    assert out["mode"] == "0o777" and out["list"] == [] and out["owner"] == attacker_uid


def test_symlink_at_a_cache_folder_in_a_shared_spill_dir_is_refused(attacker_uid):
    out = _isolated('''
        import numpy as np
        from shmcache.tiers.spill import tier as spilling
        from shmcache.base.namespace import namespace
        from shmcache.errors import NotOwner
        from shmcache.cache.store import CacheStore
        os.mkdir("/tmp/ns", 0o700)
        os.environ["SHMCACHE_DIR"] = "/tmp/ns"
        os.mkdir("/tmp/scratch"); os.chmod("/tmp/scratch", 0o1777)   # a shared spill disk
        os.mkdir("/tmp/precious", 0o755)                            # root's, the target
        folder = f"/tmp/scratch/{namespace().prefix}+s+c"           # predictable: lists in ls -l
        attacker("ln", "-s", "/tmp/precious", folder)
        store = CacheStore("s", "c", capacity_bytes=2 << 20)
        try:
            spilling.attach(store, "/tmp/scratch")
            for i in range(64):
                store.put(i, np.full(50_000, i, np.uint8))
            err = "attached"
        except NotOwner as exc:
            err = f"NotOwner: {exc}"
        store.destroy()
        from shmcache.cache.registry import SessionRegistry
        SessionRegistry().gc()
        print(json.dumps({"err": err, "mode": mode("/tmp/precious"), "list": listing("/tmp/precious"),
                          "link": os.readlink(folder)}))
    ''')
    assert out["err"].startswith("NotOwner"), out
    assert "/tmp/scratch/shmcache-0-" in out["err"] and "symlink" in out["err"] and "attack" in out["err"], out
    assert out["mode"] == "0o755" and out["list"] == [], "root wrote into the symlink's target"
    assert out["link"] == "/tmp/precious"


def test_cache_folder_owned_by_another_user_in_a_shared_spill_dir_is_refused(attacker_uid):
    out = _isolated('''
        from shmcache.tiers.spill import tier as spilling
        from shmcache.base.namespace import namespace
        from shmcache.errors import NotOwner
        from shmcache.cache.store import CacheStore
        os.mkdir("/tmp/ns", 0o700)
        os.environ["SHMCACHE_DIR"] = "/tmp/ns"
        os.mkdir("/tmp/scratch"); os.chmod("/tmp/scratch", 0o1777)
        folder = f"/tmp/scratch/{namespace().prefix}+s+c"
        attacker("mkdir", "-m", "0777", folder)
        store = CacheStore("s", "c", capacity_bytes=2 << 20)
        try:
            spilling.attach(store, "/tmp/scratch")
            err = "attached"
        except NotOwner as exc:
            err = f"NotOwner: {exc}"
        store.destroy()
        from shmcache.cache.registry import SessionRegistry
        SessionRegistry().destroy("s")
        SessionRegistry().gc()
        print(json.dumps({"err": err, "mode": mode(folder), "list": listing(folder), "owner": owner(folder)}))
    ''')
    assert out["err"].startswith("NotOwner") and f"uid {out['owner']}" in out["err"], out
    assert out["mode"] == "0o777" and out["list"] == []  # not chmodded, not written, not removed


@pytest.mark.parametrize("plant", ["file", "fifo", "symlink"])
def test_squatted_segment_name_is_a_clear_error_and_never_unlinked(attacker_uid, plant):
    out = _isolated(f'''
        from shmcache.base.namespace import namespace
        from shmcache.errors import NotOwner
        from shmcache.cache.registry import SessionRegistry
        from shmcache.cache.store import CacheStore
        os.mkdir("/tmp/ns", 0o700)
        os.environ["SHMCACHE_DIR"] = "/tmp/ns"
        ns = namespace()
        root = str(ns.shm_path(ns.segment_name("s", "c", "root")))
        orphan = str(ns.shm_path(ns.segment_name("gone", "c", "root")))  # a session that does not exist
        plant = {{"file": ["touch"], "fifo": ["mkfifo"], "symlink": ["ln", "-s", "/dev/shm/victim"]}}[{plant!r}]
        for path in (root, orphan):
            attacker(*plant, path)
        try:
            CacheStore("s", "c", capacity_bytes=2 << 20)
            err = "opened"
        except NotOwner as exc:
            err = f"NotOwner: {{exc}}"
        except Exception as exc:
            err = f"{{type(exc).__name__}}: {{exc}}"
        reg = SessionRegistry()
        destroyed = reg.destroy("s", force=True)
        gc = reg.gc()
        gc_cli = root_cli("gc", SHMCACHE_DIR="/tmp/ns")
        print(json.dumps({{"err": err, "root": root, "left": listing("/dev/shm"), "destroyed": destroyed,
                          "gc": gc.removed_segments, "gc_cli": gc_cli, "owned": ns.owned_segments(),
                          "owners": [owner(p) for p in (root, orphan)]}}))
    ''')
    err = out["err"]
    assert err.startswith("NotOwner"), out
    assert out["root"] in err and f"uid {attacker_uid}" in err and "SHMCACHE_DIR" in err, err
    squats = (out["root"], out["root"].replace("+s+", "+gone+"))
    assert sorted(out["left"]) == sorted(os.path.basename(p) for p in squats), out
    assert out["owners"] == [attacker_uid, attacker_uid]
    assert out["destroyed"] == [] and out["gc"] == [] and out["gc_cli"]["rc"] == 0, out
    assert out["owned"] == []  # another user's file is never "ours", whatever its name
