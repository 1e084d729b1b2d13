"""Slot rows (NOTE [slot rows]): a process's own row, garbage, the process-memory fallback, fork,
a reader beside a writer, and the byte layout its three users share with older processes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from shmcache.cache import claims, stall
from shmcache.cache.registry import MAX_SLOTS
from shmcache.cache.slot_rows import GARBAGE, SlotRows
from shmcache.tiers import counts as tier_counts


def _rows(path, slot=lambda: 3, **kw) -> SlotRows:
    return SlotRows(path, 4, slot=slot, what="test counts", **kw)


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kept in the process only" in r.getMessage()]


def test_a_row_is_the_slots_and_readers_sum_every_row(tmp_path):
    path = tmp_path / "c.rows"
    assert _rows(path).read() is None and _rows(path).sum() is None  # no file: nothing to sum
    a, b = _rows(path, lambda: 0).own_row(), _rows(path, lambda: 7).own_row()
    a[0] += 2
    b[0] += 3
    b[3] += 1
    assert os.path.getsize(path) == MAX_SLOTS * 4 * 8
    total, tail = _rows(path).sum()
    assert total == [5, 0, 0, 1] and tail == b""
    words = np.fromfile(path, np.uint64).reshape(MAX_SLOTS, 4)
    assert words[0, 0] == 2 and words[7, 0] == 3  # each process's counts in its slot's row only


def test_a_garbage_row_is_left_out_by_readers_and_zeroed_by_its_owner(tmp_path):
    path = tmp_path / "c.rows"
    _rows(path, lambda: 1).own_row()[0] += 4
    words = np.memmap(path, np.uint64, "r+")
    words[3 * 4:4 * 4] = [9, GARBAGE, 1, 1]  # slot 3: one word at 2**62
    words.flush()
    del words
    assert _rows(path).sum()[0] == [4, 0, 0, 0]  # left out, not failed over
    row = _rows(path, lambda: 3).own_row()  # its owner starts it again
    assert list(row) == [0, 0, 0, 0]
    row[0] += 1
    assert _rows(path).sum()[0] == [5, 0, 0, 0]


def test_the_tail_follows_the_rows_and_extra_rows_follow_the_slots(tmp_path):
    path = tmp_path / "c.rows"
    rows = _rows(path, extra_rows=2, tail=16)
    rows.own_row(tail=b"redis://x")[1] += 6
    assert os.path.getsize(path) == (MAX_SLOTS + 2) * 4 * 8 + 16
    with open(path, "rb") as f:
        f.seek((MAX_SLOTS + 2) * 4 * 8)
        assert f.read() == b"redis://x".ljust(16, b"\0")
    total, tail = _rows(path, extra_rows=2, tail=16).sum()
    assert total[1] == 6 and tail.rstrip(b"\0") == b"redis://x"


@pytest.mark.parametrize("what", ["fifo", "symlink", "other owner"])
def test_a_file_open_owned_refuses_gives_a_row_of_process_memory_said_once(tmp_path, caplog, what):
    path = tmp_path / "c.rows"
    target = tmp_path / "target"
    target.write_bytes(b"")
    if what == "fifo":
        os.mkfifo(path)
    elif what == "symlink":
        path.symlink_to(target)
    else:
        path.write_bytes(b"")
        os.chown(path, 65534, 65534)  # the tests run as root: another user's file
    rows = _rows(path)
    with caplog.at_level(logging.WARNING, "shmcache"):
        row = rows.row()
        row[0] += 5
        assert rows.row() is row and row[0] == 5  # counted in this process
    said = _warnings(caplog)
    assert len(said) == 1 and said[0].startswith("test counts: ")
    assert ("symbolic links" if what == "symlink" else "not a regular file of this user") in said[0]
    assert target.stat().st_size == 0  # nothing written through the link
    if what == "other owner":
        assert path.stat().st_size == 0 and _rows(path).sum() is None  # nor summed by readers


def test_no_slot_gives_a_row_of_process_memory(tmp_path, caplog):
    def no_slot() -> int:
        raise RuntimeError("every liveness slot is taken")

    with caplog.at_level(logging.WARNING, "shmcache"):
        row = _rows(tmp_path / "c.rows", no_slot).own_row()
    row[0] += 1
    assert _warnings(caplog) and "every liveness slot is taken" in _warnings(caplog)[0]
    assert _rows(tmp_path / "c.rows").sum()[0] == [0, 0, 0, 0]


def test_a_forked_child_maps_its_own_slots_row(tmp_path):
    path = tmp_path / "c.rows"
    parent = os.getpid()
    rows = _rows(path, lambda: 1 if os.getpid() == parent else 2)
    rows.row()[0] += 1
    pid = os.fork()
    if pid == 0:  # the child: its first count maps its own slot's row
        try:
            rows.row()[0] += 10
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        assert time.monotonic() < deadline, "the forked child did not exit"
        time.sleep(0.01)
    rows.row()[0] += 1  # the parent's row is still its own
    words = np.fromfile(path, np.uint64).reshape(MAX_SLOTS, 4)
    assert (int(words[1, 0]), int(words[2, 0])) == (2, 10)


_LANES = 0x0000000100000001  # both 32-bit halves of word 2 hold k: a torn word would not

_WRITER = textwrap.dedent("""
    import sys
    from shmcache.cache.slot_rows import SlotRows
    row = SlotRows(sys.argv[1], 4, slot=lambda: 5).own_row()
    go = SlotRows(sys.argv[1], 4, slot=lambda: 0).own_row()  # the reader's row: word 3 is 2 for stop
    k = 0
    while go[3] == 1 and k < int(sys.argv[2]):
        k += 1
        row[0] = k
        row[2] = k * %d
        row[1] = 2 * k
""" % _LANES)


def test_a_reader_sums_while_a_writer_process_writes(tmp_path):
    path = tmp_path / "c.rows"
    mine = _rows(path, lambda: 0).own_row()
    mine[3] = 1  # go
    writer = subprocess.Popen([sys.executable, "-c", _WRITER, str(path), str(1 << 24)])
    try:
        mid_write, last = 0, 0
        while True:
            done = writer.poll() is not None
            total, _ = _rows(path).sum()
            k, twice, lanes = total[0], total[1], total[2]
            assert lanes == (lanes & 0xFFFFFFFF) * _LANES, f"a torn word: {lanes:#x}"
            assert last <= k and 2 * (k - 1) <= twice and lanes >= (k - 1) * _LANES
            last = k
            mid_write += 0 < k and not done
            if mid_write == 50:
                mine[3] = 2  # seen enough: stop
            if done:
                break
        assert writer.returncode == 0 and mid_write >= 1
        assert total[:3] == [k, 2 * k, k * _LANES]  # once it stopped: every word its last value
    finally:
        writer.kill()
        writer.wait(timeout=30)


def test_the_three_users_files_keep_their_layout(tmp_path):
    """Old and new processes share these files: sizes, offsets and row widths are fixed."""
    c = claims.Claims(tmp_path / "c.claims", lambda: 2)
    c.count(claims.COMPUTED, 3)
    # the rows, then a byte a bucket to lock (no contents), then from 128 KiB a u16 owner word a bucket
    assert MAX_SLOTS * 4 * 8 + claims.BUCKETS <= claims._OWNERS_OFF == 128 << 10
    assert os.path.getsize(tmp_path / "c.claims") == claims._OWNERS_OFF + 2 * claims.BUCKETS
    assert np.fromfile(tmp_path / "c.claims", np.uint64)[2 * 4 + claims.COMPUTED] == 3
    assert c.take(7) == claims.TAKEN
    owners = np.fromfile(tmp_path / "c.claims", np.uint16)[claims._OWNERS_OFF // 2:]
    assert owners[7] == 2 + 1 and np.count_nonzero(owners) == 1  # its slot + 1
    c.release(7)
    assert claims.read_counts(tmp_path / "c.claims")["computed"] == 3
    assert claims.read_counts(tmp_path / "missing.claims") == dict.fromkeys(claims.COUNTER_NAMES, 0)
    c.close()

    stall.StallCounts(tmp_path / "c.stall", lambda: 2).row()[stall.WAITS] += 1
    assert os.path.getsize(tmp_path / "c.stall") == (MAX_SLOTS + stall.RETIRED_RANKS) * 8 * 8
    assert np.fromfile(tmp_path / "c.stall", np.uint64)[2 * 8 + stall.WAITS] == 1

    row = tier_counts.process_row(tmp_path / "c.remote", "redis://h:1", lambda: 2, "remote tier")
    row[1] += np.uint64(4)
    assert os.path.getsize(tmp_path / "c.remote") == MAX_SLOTS * 16 * 8 + 512
    assert np.fromfile(tmp_path / "c.remote", np.uint64, MAX_SLOTS * 16)[2 * 16 + 1] == 4
    got = tier_counts.read_counts(tmp_path / "c.remote", tier_counts.COUNTERS["remote"])
    assert got["misses"] == 4 and got["url"] == "redis://h:1"
    assert tier_counts.read_counts(tmp_path / "missing.remote", tier_counts.COUNTERS["remote"]) is None


@pytest.mark.parametrize("what", ["fifo", "symlink", "other owner"])
def test_a_reader_never_opens_what_a_writer_would_refuse(tmp_path, what):
    # A FIFO at a counts file's name must not block `stats()` or `shmcache stat` (a plain open()
    # waits for a writer forever), a link is not followed, another user's counts are not summed.
    path = tmp_path / "c.rows"
    target = tmp_path / "target"
    target.write_bytes(np.full(MAX_SLOTS * 4, 7, np.uint64).tobytes())
    if what == "fifo":
        os.mkfifo(path)
    elif what == "symlink":
        path.symlink_to(target)
    else:
        path.write_bytes(target.read_bytes())
        os.chown(path, 65534, 65534)  # the tests run as root: another user's file
    code = textwrap.dedent(f"""
        from shmcache.cache.slot_rows import SlotRows
        rows = SlotRows({str(path)!r}, 4, slot=lambda: 0, what="test counts")
        print(rows.read(), rows.sum())
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["None", "None"]


def test_the_claims_owner_words_start_on_a_page_of_every_page_size_linux_uses():
    """Review, fixed: the owner words are mapped on their own (mmap with offset=_OWNERS_OFF), and an
    mmap's offset must be a multiple of the page size (mmap.ALLOCATIONGRANULARITY). _OWNERS_OFF is
    96 KiB (the 32 KiB of rows, then 64 KiB of lock bytes): a page boundary with 4 KiB pages, not
    with the 64 KiB pages of many aarch64 kernels (memdir.py: "often 64 KiB on aarch64"; Grace,
    RHEL). There the mmap raises, _owner_words gives up silently, no holder is ever marked stuck,
    and a stopped holder costs a claim_timeout_s per batch again. The words should start at a
    multiple of 64 KiB (or be mapped with the file from offset 0)."""
    assert claims._OWNERS_OFF % (64 << 10) == 0, (
        f"the owner words start at {claims._OWNERS_OFF} bytes: not a page boundary with 64 KiB pages, "
        f"where their mmap is refused")
