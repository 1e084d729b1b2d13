"""The stall counts file (NOTE [stall counts]): rows, the retired rows, garbage, a wait running."""

from __future__ import annotations

import numpy as np

from shmcache.cache import stall


def _counts(tmp_path, slot: int = 3) -> stall.StallCounts:
    return stall.StallCounts(tmp_path / "c.stall", lambda: slot)


def test_a_pass_counts_waits_stall_and_loop(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "2")
    one = stall.Pass(_counts(tmp_path))
    for _ in range(3):
        one.got(one.ask())
    asked = one.ask()
    running = stall.read_ranks(tmp_path / "c.stall")[2]
    assert running["waiting_since"] == asked  # a wait running now is visible to readers
    one.got(asked, batch=False)  # the source ran out: a wait, no batch
    r = stall.read_ranks(tmp_path / "c.stall")[2]
    assert (r["waits"], r["waiting_since"], r["processes"]) == (3, 0, 1)
    assert r["loop_ns"] >= r["stall_ns"] > 0
    keys = stall.stats_keys(tmp_path / "c.stall")
    assert keys["ranks"]["2"]["stall_waits"] == keys["stall_waits"] == 3
    assert 0 < keys["stall_share"] <= 1


def test_another_rank_in_the_slot_carries_the_row_into_its_retired_row(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "1")
    first = stall.Pass(_counts(tmp_path))
    first.got(first.ask())
    before = stall.read_ranks(tmp_path / "c.stall")[1]
    monkeypatch.setenv("RANK", "0")  # the slot's next process is rank 0
    second = stall.Pass(_counts(tmp_path))
    second.got(second.ask())
    ranks = stall.read_ranks(tmp_path / "c.stall")
    assert ranks[1]["waits"] == 1 and ranks[1]["stall_ns"] == before["stall_ns"]
    assert ranks[1]["processes"] == 0  # retired: no process writes it now
    assert ranks[0]["waits"] == 1
    monkeypatch.setenv("RANK", "1")  # rank 1 again: its retired counts grow, the live row restarts
    third = stall.Pass(_counts(tmp_path))
    third.got(third.ask())
    assert stall.read_ranks(tmp_path / "c.stall")[1]["waits"] == 2


def test_garbage_rows_are_left_out_and_restarted(tmp_path, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    path = tmp_path / "c.stall"
    one = stall.Pass(_counts(tmp_path, slot=0))
    one.got(one.ask())
    words = np.memmap(path, np.uint64, "r+")
    words[stall.ROW_WORDS * 5: stall.ROW_WORDS * 6] = 1 << 63  # slot 5: garbage
    words.flush()
    del words
    assert set(stall.read_ranks(path)) == {0}
    again = stall.Pass(_counts(tmp_path, slot=5))  # its owner starts it again
    again.got(again.ask())
    assert stall.read_ranks(path)[0]["waits"] == 2
    assert stall.read_ranks(tmp_path / "missing.stall") == {}
    assert stall.stats_keys(tmp_path / "missing.stall")["ranks"] == {}
