"""SIGKILL a writer of ``put_records`` (what an import and a tier hit store through) at every step
of a publish group (PublishGroup, NOTE [publish order]: "a publish group"), with a reader hammering lookups.

A group's records are allocated and copied, fenced, their bumps moved, fenced, then published. A
writer killed before the first fence has published nothing and moved no bump: the repair (the next
writer or ``shmcache gc``) gives every chunk back. Killed after it, every record is whole: the
repair publishes the rest. Either way no reader sees a torn value, every published record reads
right, the totals and the allocator agree with the table, and the chunks are there to reuse. Each
case runs with the x86 default and with the fences forced on (SHMCACHE_ORDERING=membarrier).
"""

from __future__ import annotations

import pytest
from _procs_util import Zygote, crash_env, status_of, wait_for
from _shmcheck import (
    check_store,
    fixed_value,
    gc_json,
    group_phase,
    reader_saw_no_harm,
    row_value,
    same_value,
    value_for,
)

from shmcache.cache import process_slot
from shmcache.cache.generation import GROUP_RECORDS
from shmcache.cache.store import MISSING, CacheStore

S, C = "crashchunk", "c"
CAP = 64 << 20
N = 40  # records put: one group (GROUP_RECORDS is 128)
# point, crash_after (hits of the point to pass), records put, doomed keys present once repaired,
# chunks the repair gives back, who repairs
CASES = [
    ("allocated", 10, N, 0, 11, "gc"),  # 10 records copied, the 11th allocated
    ("mid_copy", 10, N, 0, 11, "writer"),  # the 11th half-copied
    ("group_copied", 20, N, 0, 21, "gc"),
    ("group_fenced", 0, N, 0, N, "writer"),  # all copied and fenced, phase 2 not yet written
    ("group_bumped", 0, N, N, 0, "gc"),  # phase 2, bumps moved, before the second fence
    ("group_publishing", 15, N, N, 0, "writer"),  # 15 entries READY, 25 not
    ("group_published", 0, N, N, 0, "gc"),  # every entry READY, the totals not yet
    ("group_fenced", 1, 3 * GROUP_RECORDS // 2, GROUP_RECORDS, GROUP_RECORDS // 2, "writer"),  # the 2nd group
]


@pytest.fixture(autouse=True)
def _own_slots():
    yield
    process_slot.release_all()


def _keys(n: int) -> list:
    return [f"s{i}" if i % 4 == 0 else 1000 + i for i in range(n)]  # str keys hash anywhere


@pytest.mark.parametrize("ordering", ["default", "membarrier"])
@pytest.mark.parametrize("point,after,n,present_after,given_back,repairer", CASES)
def test_a_group_killed_anywhere_is_undone_or_finished(point, after, n, present_after, given_back, repairer,
                                                       ordering, tmp_path, capsys):
    extra = {"SHMCACHE_ORDERING": "membarrier"} if ordering == "membarrier" else {}
    store = CacheStore(S, C, capacity_bytes=CAP)
    base = list(range(60))  # every kind and size class of value_for
    for k in base:
        assert store.put(k, value_for(k))
    doomed, later = _keys(n), [9000]
    universe = base + doomed + later
    stop, ready = tmp_path / "stop", tmp_path / "reader.ready"
    with Zygote(tmp_path / "crashing", env=crash_env(point, after, **extra)) as crashing, \
            Zygote(tmp_path / "clean", env=crash_env(**extra)) as clean:
        reader, reader_out = clean.spawn("reader", S, C, CAP, universe, str(stop), str(ready))
        wait_for(ready.exists, 30, "the reader to start")
        status, _ = crashing.run("put_records", S, C, doomed, CAP)
        assert status == -9, f"the writer should die at {point!r}, but it ended with {status_of(status)}"
        assert group_phase(store) != 0, "the dead writer's group intent should still be there"
        seen = {k: store.lookup(k, count=False) for k in doomed}
        assert all(v is MISSING or same_value(v, value_for(k)) for k, v in seen.items()), point
        # the earlier groups' keys, published: runs of one layout and length go first
        # (CacheWriter.put_many), so which keys they are is not the items' order
        before = {k for k, v in seen.items() if v is not MISSING}
        if given_back:  # undone: nothing of the killed group was ever visible
            assert len(before) == present_after

        if repairer == "writer":  # the next writer, another process, repairs on its way in
            assert clean.run("put", S, C, later, CAP)[0] == 0
            assert gc_json(capsys)["reclaimed_entries"] == 0  # nothing left to repair
        else:
            assert gc_json(capsys)["reclaimed_entries"] == given_back
        assert group_phase(store) == 0
        stored = len(base) + present_after + (len(later) if repairer == "writer" else 0)
        # an undone group's commit steps stay committed for the next writer (not leaked: below)
        assert check_store(store, universe, slack_steps=64) == []
        present = {k for k in doomed if store.lookup(k, count=False) is not MISSING}
        assert len(present) == present_after and (present == before if given_back else True)
        assert store.stats()["items_mem"] == stored

        # the chunks given back are handed out again: every doomed key stored, nothing left over
        status, res = clean.run("put_records", S, C, doomed, CAP)
        assert status == 0 and res["stored"] == n, (status, res)
        assert check_store(store, universe) == []
        assert store.stats()["items_mem"] == stored + n - present_after
        stop.touch()
        assert clean.wait(reader, 30) == 0
    reader_saw_no_harm(reader_out)
    store.destroy()


# A run: int keys whose records take one size class, admitted with numpy over the run
# (CacheWriter.put_many: one intent write, one pwrite of its chunks, one stage of its entries):
# of one layout and length (fixed), or of three layouts and lengths (rows: a str of 1-3 chars).
# point, crash_after, records put, keys present once repaired, chunks given back, who repairs
RUN_CASES = [
    ("run_allocated", 0, N, 0, N, "gc"),  # the run in the intent, nothing copied
    ("run_mid_copy", 0, N, 0, N, "writer"),  # half of its chunks written
    ("run_copied", 0, N, 0, N, "gc"),  # copied and staged, not fenced
    ("group_fenced", 0, N, 0, N, "writer"),
    ("group_publishing", 15, N, N, 0, "gc"),  # 15 entries READY, 25 not: finished
    ("run_copied", 1, GROUP_RECORDS + N, GROUP_RECORDS, N, "writer"),  # the run's 2nd group
]


def _fixed(k):
    return fixed_value(k, 3000)


def _rows(k):
    return row_value(k, 3000)


@pytest.mark.parametrize("ordering, kind", [
    ("default", "fixed:3000"), ("membarrier", "fixed:3000"), ("default", "rows:3000"),
    pytest.param("membarrier", "rows:3000", marks=pytest.mark.slow),
])
@pytest.mark.parametrize("point,after,n,present_after,given_back,repairer", RUN_CASES)
def test_a_run_killed_anywhere_is_undone_or_finished(point, after, n, present_after, given_back, repairer,
                                                     ordering, kind, tmp_path, capsys):
    value = _fixed if kind == "fixed:3000" else _rows
    extra = {"SHMCACHE_ORDERING": "membarrier"} if ordering == "membarrier" else {}
    store = CacheStore(S, C, capacity_bytes=CAP)
    base = list(range(60))
    for k in base:
        assert store.put(k, value(k))
    doomed, later = list(range(100, 100 + n)), [900]  # each at its own home entry: one run
    universe = base + doomed + later
    stop, ready = tmp_path / "stop", tmp_path / "reader.ready"
    with Zygote(tmp_path / "crashing", env=crash_env(point, after, **extra)) as crashing, \
            Zygote(tmp_path / "clean", env=crash_env(**extra)) as clean:
        reader, reader_out = clean.spawn("reader", S, C, CAP, universe, str(stop), str(ready), kind)
        wait_for(ready.exists, 30, "the reader to start")
        status, _ = crashing.run("put_records", S, C, doomed, CAP, kind)
        assert status == -9, f"the writer should die at {point!r}, but it ended with {status_of(status)}"
        assert group_phase(store) != 0, "the dead writer's group intent should still be there"
        seen = {k: store.lookup(k, count=False) for k in doomed}
        assert all(v is MISSING or same_value(v, value(k)) for k, v in seen.items()), point
        if given_back:  # undone: nothing of the killed group was ever visible
            assert [k for k, v in seen.items() if v is not MISSING] == doomed[:present_after]

        if repairer == "writer":
            assert clean.run("put", S, C, later, CAP, kind)[0] == 0
            assert gc_json(capsys)["reclaimed_entries"] == 0
        else:
            assert gc_json(capsys)["reclaimed_entries"] == given_back
        assert group_phase(store) == 0
        stored = len(base) + present_after + (len(later) if repairer == "writer" else 0)
        assert check_store(store, universe, value, slack_steps=64) == []
        assert [k for k in doomed if store.lookup(k, count=False) is not MISSING] == doomed[:present_after]
        assert store.stats()["items_mem"] == stored

        status, res = clean.run("put_records", S, C, doomed, CAP, kind)
        assert status == 0 and res["stored"] == n, (status, res)
        assert check_store(store, universe, value) == []
        assert store.stats()["items_mem"] == stored + n - present_after
        stop.touch()
        assert clean.wait(reader, 30) == 0
    reader_saw_no_harm(reader_out)
    store.destroy()
