"""Two users on one machine (RELIABILITY.md scenario 7): separate namespaces, mode 0600 objects,
and another user can neither attach to, read, nor remove ours.

The other user is a forked child that drops to uid/gid 65534 (nobody); it needs root to do that.
"""

from __future__ import annotations

import json
import os
import stat
import tempfile

import numpy as np
import pytest

from shmcache.base.shm import Segment
from shmcache.cache.store import CacheStore
from shmcache.errors import NotOwner, ShmcacheError

NOBODY = 65534

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")


def _as_other_user(check) -> dict:
    """Run ``check()`` in a forked child as uid 65534; return the dict it produced."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never return into pytest
        code = 0
        try:
            os.close(r)
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            out = check()
        except BaseException as exc:  # noqa: BLE001 - reported to the parent
            out, code = {"crash": f"{type(exc).__name__}: {exc}"}, 1
        os.write(w, json.dumps(out).encode())
        os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        data = f.read()
    _, status = os.waitpid(pid, 0)
    result = json.loads(data or "{}")
    assert "crash" not in result, result
    return result


def test_another_user_cannot_attach_read_or_remove_our_cache(shm_namespace):
    store = CacheStore("mine", "c", capacity_bytes=8 << 20)
    for i in range(20):
        store.put(i, np.full(100, i))
    ours = shm_namespace.owned_segments()
    assert ours
    for name in ours:  # mode 0600, whatever the umask
        assert stat.S_IMODE(os.stat(shm_namespace.shm_path(name)).st_mode) == 0o600
    for path in shm_namespace.root.rglob("*"):
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode & 0o077 == 0, f"{path} is mode {oct(mode)}"

    shared_tmp = tempfile.mkdtemp(prefix="shmcache-other-")
    os.chmod(shared_tmp, 0o777)

    def check():
        out = {}
        try:  # attach to one of our segments
            Segment.attach(ours[0])
            out["attach"] = "attached"
        except NotOwner as exc:
            out["attach"] = f"NotOwner: {exc}"
        try:  # read it as a plain file
            open(shm_namespace.shm_path(ours[0]), "rb").read(1)
            out["read"] = "read"
        except PermissionError:
            out["read"] = "denied"
        try:  # remove it (/dev/shm is sticky: only the owner may)
            os.unlink(shm_namespace.shm_path(ours[0]))
            out["unlink"] = "removed"
        except PermissionError:
            out["unlink"] = "denied"
        try:  # use our namespace directory
            os.environ["SHMCACHE_DIR"] = str(shm_namespace.root)
            CacheStore("mine", "c", create=False)
            out["namespace"] = "opened"
        except (ShmcacheError, PermissionError) as exc:
            out["namespace"] = f"{type(exc).__name__}: {exc}"
        # its own namespace works, side by side, with its own segment names
        os.environ["SHMCACHE_DIR"] = os.path.join(shared_tmp, "ns")
        theirs = CacheStore("mine", "c", capacity_bytes=8 << 20)
        theirs.put(1, np.full(100, -1))
        out["own_value"] = int(theirs.lookup(1)[0])
        out["own_segments"] = theirs.ns.owned_segments()
        theirs.destroy()
        out["left"] = theirs.ns.owned_segments()
        return out

    result = _as_other_user(check)
    assert result["attach"].startswith("NotOwner") and "SHMCACHE_DIR" in result["attach"]
    assert result["read"] == "denied"
    assert result["unlink"] == "denied"
    assert result["namespace"] != "opened"
    assert result["own_value"] == -1
    assert result["own_segments"] and not set(result["own_segments"]) & set(ours)
    assert all(f"-{NOBODY}-" in name for name in result["own_segments"])
    assert result["left"] == []
    assert shm_namespace.owned_segments() == ours, "the other user's cleanup touched ours"
    assert int(store.lookup(1)[0]) == 1
    store.close()
    import shutil

    shutil.rmtree(shared_tmp, ignore_errors=True)
