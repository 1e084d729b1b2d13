"""Liveness slots under churn: processes attach and detach while `shmcache gc` runs.

A process proves it is alive by holding the flock of its slot file (NOTE [lock files]); gc removes
slot files whose lock nobody holds. The two race: a slot file must never be removed while a live
process holds (or is just taking) its lock - that process would become invisible to
``live_pids()`` and ``destroy()``, and its slot number, with the hit/miss counters it indexes,
could be handed to a second live process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "crash"))

from _procs_util import Zygote  # noqa: E402

from shmcache.cache.registry import SessionRegistry  # noqa: E402


@pytest.mark.parametrize("seconds", [pytest.param(3.0, id="3s"),
                                     pytest.param(30.0, id="30s", marks=pytest.mark.slow)])
def test_gc_never_removes_the_slot_of_a_live_process(seconds, tmp_path):
    SessionRegistry().create("live")
    with Zygote(tmp_path / "z") as z:
        churners = [z.spawn("slot_churn", "live", seconds) for _ in range(2)]
        collector = z.spawn("gc_loop", seconds)
        results = []
        for pid, out in churners + [collector]:
            assert z.wait(pid, seconds + 30) == 0
            results.append(json.loads(out.read_text()))
    churn, gc = results[:2], results[2]
    assert gc["gcs"] > 10 and all(r["takes"] > 100 for r in churn)
    lost = sum(r["lost"] for r in churn)
    assert lost == 0, (
        f"{lost} of {sum(r['takes'] for r in churn)} slots taken by live processes had their lock "
        f"file removed by a concurrent gc ({sum(r['invisible'] for r in churn)} of them then "
        f"missing from live_pids()): {[s for r in churn for s in r['samples']][:3]}")
