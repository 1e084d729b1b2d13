"""One creator: simultaneous starts, early attachers, creators that die, corrupted headers.

RELIABILITY.md scenarios 8 and 9: eight processes that start at the same instant with no rank
variables create each object exactly once; an attacher that arrives while the creator is still
initialising waits for it (or times out naming the lock) and never recreates or unlinks a live
object; whatever a dead creator left half-made is recovered under the lock.
"""

from __future__ import annotations

import json
import os

import posix_ipc
import pytest
from _procs_util import Zygote, release_barrier, status_of, wait_for
from _shmcheck import cache_segments, check_store, same_value, value_for

from shmcache import cli
from shmcache.cache.registry import SessionRegistry
from shmcache.cache.store import MISSING, CacheStore
from shmcache.errors import CacheNotFound

C = "c"
CAP = 64 << 20
N = 8


def _lock_path(ns, session: str, cache: str = C):
    return ns.root / "sessions" / session / "caches" / f"{cache}.lock"


def test_eight_processes_at_the_same_instant_create_each_object_once(tmp_path, shm_namespace):
    with Zygote(tmp_path / "z") as z:
        for r in range(3):  # three brand-new sessions: three races
            session = f"race-{r}"
            bar = tmp_path / f"barrier-{r}"
            bar.mkdir()
            kids = [z.spawn("open_at_barrier", session, C, CAP, str(bar), N) for _ in range(N)]
            release_barrier(bar, N)
            results = []
            for pid, out in kids:
                status = z.wait(pid, 60)
                res = json.loads(out.read_text())
                assert status == 0, f"{status_of(status)}: {res.get('exception')}\n{res.get('traceback')}"
                results.append(res)
            assert len({r["root_ino"] for r in results}) == 1, "the root segment was created twice"
            assert len({r["meta_ino"] for r in results}) == 1, "the meta segment was created twice"
            assert len({r["table_ino"] for r in results}) == 1, "the table segment was created twice"
            assert len({(r["session_created"], r["session_creator"]) for r in results}) == 1, \
                "the session was created more than once"
            assert all(r["seen"] == N for r in results), "every process sees every other's item"
            store = CacheStore(session, C, create=False)
            roots = [n for n in cache_segments(store) if n.endswith("+root")]
            assert len(roots) == 1
            assert check_store(store, results[0]["pids"]) == []
            assert store.stats()["items_mem"] == N
            store.close()


@pytest.mark.parametrize("exist_ok", [True, False])
def test_eight_processes_create_the_same_session_at_once(exist_ok, tmp_path, shm_namespace):
    bar = tmp_path / "barrier"
    bar.mkdir()
    with Zygote(tmp_path / "z") as z:
        kids = [z.spawn("registry_create_at_barrier", "same", str(bar), exist_ok) for _ in range(N)]
        release_barrier(bar, N)
        results = []
        for pid, out in kids:
            status = z.wait(pid, 60)
            res = json.loads(out.read_text())
            assert status == 0, res
            results.append(res)
    made = [r for r in results if "created" in r]
    if exist_ok:
        assert len(made) == N
        assert len({(r["created"], r["creator"], r["dir_ino"]) for r in made}) == 1
    else:
        assert len(made) == 1, "exactly one create() wins"
        assert all("already exists" in r["exists"] for r in results if "exists" in r)
    assert [s.name for s in SessionRegistry().list()] == ["same"]
    leftovers = [p.name for p in (shm_namespace.root / "sessions").iterdir() if p.name != "same"]
    assert leftovers == [], "temporary session directories left behind"


def test_attacher_waits_for_a_slow_creator_and_never_recreates(tmp_path, shm_namespace):
    """The creator holds the cache lock while it makes the first generation (root already there,
    ready header set, epoch word still 0). An attacher waits for it, then uses the same objects;
    an impatient one times out with a message naming the lock."""
    session = "slow"
    started, go = tmp_path / "started", tmp_path / "go"
    with Zygote(tmp_path / "z") as z:
        creator, creator_out = z.spawn("slow_creator", session, C, CAP, "+g1+meta", str(started),
                                       str(go), 1)
        wait_for(started.exists, 30, "the creator to be half-way")
        root_name = _root_name(shm_namespace, session)
        root_ino = os.stat(shm_namespace.shm_path(root_name)).st_ino
        patient, patient_out = z.spawn("open", session, C, CAP, 30, 2)
        impatient = z.run("open", session, C, CAP, 0.5)[1]
        assert impatient["type"] == "LockTimeout"
        assert str(_lock_path(shm_namespace, session)) in impatient["error"], impatient["error"]
        # the impatient one was refused the lock the creator holds: so is the patient one, which
        # came first (no sleep needed; it is still waiting)
        assert not patient_out.exists(), "the attacher must wait for the creator"
        assert os.stat(shm_namespace.shm_path(root_name)).st_ino == root_ino, \
            "an early attacher replaced the live root segment"
        go.touch()
        assert z.wait(creator, 30) == 0
        assert z.wait(patient, 30) == 0
    res_c, res_p = json.loads(creator_out.read_text()), json.loads(patient_out.read_text())
    assert res_c["root_ino"] == res_p["root_ino"] == root_ino
    store = CacheStore(session, C, create=False)
    assert check_store(store, [1, 2]) == []
    assert store.stats()["items_mem"] == 2


def _cache_prefix(ns, session: str) -> str:
    """The name prefix of every segment of cache C of ``session`` (see store.CacheStore._seg_name)."""
    return ns.segment_name(session, C) + "+"


def _root_name(ns, session: str) -> str:
    return _cache_prefix(ns, session) + "root"


def test_half_made_root_is_left_alone_while_its_creator_holds_the_lock(tmp_path, shm_namespace):
    session = "half"
    SessionRegistry().create(session)
    lock = _lock_path(shm_namespace, session)
    held = tmp_path / "held"
    root_name = _root_name(shm_namespace, session)
    # what a creator looks like right after O_CREAT|O_EXCL + ftruncate, before its header
    shm = posix_ipc.SharedMemory(root_name, posix_ipc.O_CREX, mode=0o600, size=4096)
    shm.close_fd()
    root_ino = os.stat(shm_namespace.shm_path(root_name)).st_ino
    with Zygote(tmp_path / "z") as z:
        holder, _ = z.spawn("hold_flock", str(lock), str(held))
        wait_for(held.exists, 30, "the creator (lock holder)")
        res = z.run("open", session, C, CAP, 1.0)[1]
        assert res["type"] == "LockTimeout", res
        assert str(lock) in res["error"]
        assert 0.9 < res["waited_s"] < 10
        assert os.stat(shm_namespace.shm_path(root_name)).st_ino == root_ino, \
            "the attacher touched a root whose creator is alive"
        z.kill(holder)
        assert z.wait(holder, 10) == -9
        # the creator is dead: the next opener recovers the half-made root under the lock
        res = z.run("open", session, C, CAP, 5.0, 3)[1]
    assert "error" not in res, res
    store = CacheStore(session, C, create=False)
    assert check_store(store, [3]) == []


@pytest.mark.parametrize("field,offset", [("magic", 0), ("version", 8), ("size", 16), ("ready", 24)])
def test_corrupted_root_header_is_recovered_under_the_lock(field, offset, tmp_path, shm_namespace):
    session = "corrupt"
    store = CacheStore(session, C, capacity_bytes=CAP)
    for k in range(10):
        assert store.put(k, value_for(k))
    store.close()
    root = shm_namespace.shm_path(_root_name(shm_namespace, session))
    fd = os.open(root, os.O_RDWR)
    try:
        os.pwrite(fd, b"\xde\xad\xbe\xef", offset)
    finally:
        os.close(fd)
    with Zygote(tmp_path / "z") as z:
        status, res = z.run("open", session, C, CAP, 5.0, 42)
    assert status == 0 and "error" not in res, f"{field}: {res}"
    store = CacheStore(session, C, create=False)
    assert same_value(store.lookup(42, count=False), value_for(42))
    assert check_store(store, list(range(10)) + [42]) == []


@pytest.mark.parametrize("suffix", ["+g1+meta", "+g1+t1"])
def test_creator_killed_after_the_root_before_the_first_generation(suffix, tmp_path, capsys):
    """The creator made the root segment (ready header set) and died before its first generation
    was published. The next process - or `shmcache gc` - must recover, not fail forever."""
    session = "dead-creator"
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_creating", session, C, CAP, suffix, "open")
        assert status == -9, status_of(status)
        status, res = z.run("open", session, C, CAP, 5.0, 5)
    if "error" in res:  # not recovered on open: `shmcache gc` is what the message recommends
        capsys.readouterr()
        assert cli.main(["gc"]) == 0
        with Zygote(tmp_path / "z2") as z:
            status, res2 = z.run("open", session, C, CAP, 5.0, 5)
        assert "error" not in res2, (
            f"opening the cache failed ({res['error']}), and still fails after `shmcache gc`: "
            f"{res2['error']}")
        pytest.fail(f"the cache was recovered only by `shmcache gc`; opening it failed with {res['error']}")
    store = CacheStore(session, C, create=False)
    assert same_value(store.lookup(5, count=False), value_for(5))
    assert check_store(store, [5]) == []


def test_creator_killed_right_after_making_its_root_leaves_no_cache_without_room(tmp_path, shm_namespace):
    """The creator made the root (header ready) and was SIGKILLed before it wrote the cap into it.
    The next opener made the first generation in that root: a cache of 0 bytes for good, every
    put an ItemTooLarge saying to give it size= - although size= was given."""
    session = "rootonly"
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_after_creating", session, C, CAP, "+root")
        assert status == -9, status_of(status)
        status, res = z.run("open", session, C, CAP, 5.0, 5)
    assert status == 0 and "error" not in res, res
    store = CacheStore(session, C, create=False)
    assert store.capacity_bytes == CAP
    assert same_value(store.lookup(5, count=False), value_for(5))
    assert check_store(store, [5]) == []
    store.close()


def test_killed_creator_of_a_session_leaves_nothing_gc_cannot_remove(tmp_path, capsys, shm_namespace):
    """A process killed at random moments while creating sessions and caches: afterwards every
    session opens, and `shmcache gc` leaves no temporary directory."""
    with Zygote(tmp_path / "z") as z:
        for i in range(30):
            z.run("cycle", [f"s{i % 3}"], i, CAP, kill_after_s=0.0005 * (i % 10))
    capsys.readouterr()
    assert cli.main(["gc"]) == 0
    assert not [p for p in (shm_namespace.root / "sessions").iterdir() if p.name.startswith(".")]
    for info in SessionRegistry().list():
        for name in SessionRegistry().cache_names(info.name):
            try:  # a destroy() killed after unlinking the root leaves the json: not a cache
                store = CacheStore(info.name, name, create=False, lock_timeout_s=5)
            except CacheNotFound:
                continue
            assert check_store(store, list(range(400))) == [], (info.name, name)
            assert store.lookup(10**9) is MISSING
            store.close()


def test_creator_killed_before_writing_the_cache_json(tmp_path, capsys, shm_namespace):
    """The creator died in write_json() (its temporary file written, not yet renamed to
    ``<cache>.json``). The metadata is written before any segment, so nothing was published;
    `shmcache gc` removes the temporary file, and whatever segments exist are listed or removed."""
    session = "nojson"
    SessionRegistry().create(session)
    with Zygote(tmp_path / "z") as z:
        status, _ = z.run("die_in_rename", session, C, CAP)
    assert status == -9, status_of(status)
    prefix = _cache_prefix(shm_namespace, session)
    segments = [n for n in shm_namespace.owned_segments() if n.startswith(prefix)]
    assert segments == [], "metadata first: no segment exists before the json does"
    capsys.readouterr()
    assert cli.main(["gc"]) == 0
    assert cli.main(["stat", "--json"]) == 0
    listed = [row["name"] for row in json.loads(capsys.readouterr().out.split("\n", 1)[1])]
    remaining = [n for n in shm_namespace.owned_segments() if n.startswith(prefix)]
    assert listed == [C] or remaining == [], (
        f"after `shmcache gc` the cache is neither listed by `shmcache stat` ({listed}) nor removed "
        f"(segments {remaining}): invisible to stat and gc, and without its fingerprint")
    caches_dir = shm_namespace.sessions_dir / session / "caches"
    tmp = [p.name for p in caches_dir.iterdir() if p.name.endswith(".tmp")]
    assert tmp == [], f"temporary files of a dead writer outlive `shmcache gc`: {tmp}"
