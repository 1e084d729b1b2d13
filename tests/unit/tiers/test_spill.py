"""Spill files (shmcache.tiers.spill): round trips, self-checking records, repair, disk full, bad paths.

Crash tests (SIGKILL mid-append) live in tests/crash/test_spill_crash.py.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path

import numpy as np
import pytest
from _forks import die_holding_after_forking_an_idle_child, reap

from shmcache.errors import InvalidArgument, LockTimeout, SpillError
from shmcache.tiers import records as spill_format
from shmcache.tiers.spill import (
    RECORD_HEADER_BYTES,
    SpillFull,
    SpillLoc,
    SpillStore,
    check_spill_dir,
    recovery,
)

REPO = Path(__file__).resolve().parents[3]


def tokens(n: int, seed: int = 0) -> np.ndarray:
    """Token-like int64 ids: a small vocabulary, with runs (compresses ~4x)."""
    rng = np.random.default_rng(seed)
    return np.repeat(rng.integers(0, 1000, size=n // 4 + 1), 4)[:n].astype(np.int64)


def noise(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).bytes(n)


def payload(i: int) -> bytes:
    """Record i of a mixed workload: tokens, random bytes, empty, tiny, and > 8 KiB raw."""
    kind = i % 5
    if kind == 0:
        return tokens(64 + 37 * i, seed=i).tobytes()
    if kind == 1:
        return noise(100 + 53 * i, seed=i)
    if kind == 2:
        return b""
    if kind == 3:
        return bytes([i % 256]) * (i % 7)
    return noise(9000 + i, seed=i)


@pytest.fixture
def store(tmp_path):
    s = SpillStore(tmp_path / "spill")
    yield s
    s.close()


def fork_call(fn) -> int:
    """Run ``fn`` in a forked child; return its exit status (0: fn returned)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            fn()
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def flip(path: Path, offset: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ mask]))


# --- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data, compressed",
    [
        (tokens(50_000), True),  # compressible: stored as a zstd frame
        (noise(200_000), False),  # incompressible: stored raw
        (b"", False),
        (b"x", False),
    ],
    ids=["tokens", "random", "empty", "one-byte"],
)
def test_round_trip(store, data, compressed):
    loc = store.append(3, b"key", data)
    raw = memoryview(data).cast("B")
    assert loc.file_id == 3 and loc.raw_len == len(raw) and loc.compressed is compressed
    if compressed:
        assert loc.stored_len * 1.05 < loc.raw_len
    got = store.read(loc, b"key")
    assert isinstance(got, bytearray) and got == raw.tobytes()
    out = np.empty(len(raw), np.uint8)
    assert store.read_into(loc, b"key", out) and out.tobytes() == raw.tobytes()
    assert store.read(loc[:3], b"key") == raw.tobytes()  # the index may keep only 3 fields


def test_raw_records_are_never_decompressed(store):
    locs = [store.append(0, b"%d" % i, noise(20_000, seed=i)) for i in range(10)]
    assert not any(loc.compressed for loc in locs)
    for i, loc in enumerate(locs):
        assert store.read(loc, b"%d" % i) == noise(20_000, seed=i)
    assert store.stats()["reads_decompressed"] == 0


def test_payload_types(store):
    arr = np.arange(1000, dtype=np.float32).reshape(10, 100)
    loc = store.append(0, b"a", arr)  # any C-contiguous buffer, of any format and shape
    assert np.array_equal(np.frombuffer(store.read(loc, b"a"), np.float32).reshape(10, 100), arr)
    loc = store.append(0, bytearray(b"b"), memoryview(b"hello" * 50))
    assert store.read(loc, memoryview(b"b")) == b"hello" * 50


def test_many_records_and_stats(store):
    keys = [f"item-{i}".encode() for i in range(400)]
    locs = [store.append(i % 3, keys[i], payload(i)) for i in range(400)]
    for i, loc in enumerate(locs):
        assert loc.offset % spill_format.ALIGN == 0
        assert store.read(loc, keys[i]) == payload(i)
    st = store.stats()
    assert st["records"] == 400 and st["files"] == 3
    assert st["bytes_disk_raw"] == sum(len(payload(i)) for i in range(400))
    assert st["bytes_disk"] == sum(loc.stored_len for loc in locs) < st["bytes_disk_raw"]
    assert st["corrupt_reads"] == 0
    store.close()
    report = SpillStore(store.path).recover(verify=True)
    assert (report.files, report.records, report.corrupt_records, report.bytes_truncated) == (3, 400, 0, 0)


def test_threads_share_a_slot(store):
    results: dict[int, list[SpillLoc]] = {}

    def work(t: int) -> None:
        results[t] = [store.append(0, b"%d-%d" % (t, i), payload(t * 100 + i)) for i in range(50)]

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    offsets = sorted(loc.offset for locs in results.values() for loc in locs)
    assert len(set(offsets)) == 200  # no two records at one offset
    for t, locs in results.items():
        for i, loc in enumerate(locs):
            assert store.read(loc, b"%d-%d" % (t, i)) == payload(t * 100 + i)


_READER = """
import json, sys, hashlib
from shmcache.tiers.spill import SpillStore
req = json.load(sys.stdin)
s = SpillStore(req["path"], create=False)
digests = []
for key, loc in req["records"]:
    data = s.read(tuple(loc), key.encode())
    digests.append(None if data is None else hashlib.sha1(data).hexdigest())
mine = [[k, list(s.append(req["slot"], k.encode(), k.encode() * 100))] for k in ("x1", "x2")]
s.close()
json.dump({"digests": digests, "mine": mine}, sys.stdout)
"""


def test_another_process_reads_everything(store):
    """A fresh interpreter (not a fork) reads every record, and appends to its own slot."""
    import hashlib

    records = [(f"k{i}", store.append(0, f"k{i}".encode(), payload(i))) for i in range(60)]
    request = {"path": str(store.path), "slot": 1, "records": [[k, list(loc)] for k, loc in records]}
    proc = subprocess.run(
        [sys.executable, "-c", _READER],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr
    answer = json.loads(proc.stdout)
    assert answer["digests"] == [hashlib.sha1(payload(i)).hexdigest() for i in range(60)]
    for key, loc in answer["mine"]:
        assert store.read(loc, key.encode()) == key.encode() * 100


def test_forked_processes_write_their_own_slots_while_others_read(store):
    """Two forked writers append while the parent reads each record once it is acknowledged."""
    import time

    def writer(slot: int) -> None:
        with open(store.path / f"ack{slot}", "wb", buffering=0) as f:
            for i in range(150):
                loc = store.append(slot, b"%d/%d" % (slot, i), payload(slot * 1000 + i))
                f.write(np.array([i, *loc], np.int64).tobytes())  # only after append returned

    pids = {}
    for slot in (1, 2):
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            code = 1
            try:
                writer(slot)
                code = 0
            finally:
                os._exit(code)
        pids[slot] = pid
    exits: dict[int, int] = {}
    verified = {1: 0, 2: 0}
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline and (len(exits) < 2 or sum(verified.values()) < 300):
            for slot, pid in pids.items():
                if slot not in exits and (status := os.waitpid(pid, os.WNOHANG))[0]:
                    exits[slot] = os.waitstatus_to_exitcode(status[1])
                ack = store.path / f"ack{slot}"
                rows = np.fromfile(ack, np.int64) if ack.exists() else np.empty(0, np.int64)
                for i, *loc in rows[: len(rows) // 5 * 5].reshape(-1, 5)[verified[slot] :].tolist():
                    assert store.read(loc, b"%d/%d" % (slot, i)) == payload(slot * 1000 + i)
                    verified[slot] += 1
    finally:
        for slot, pid in pids.items():
            if slot not in exits:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
    assert exits == {1: 0, 2: 0} and verified == {1: 150, 2: 150}
    assert store.stats()["corrupt_reads"] == 0


def test_reader_follows_a_recreated_directory(store, tmp_path):
    """After another process destroys and re-creates the directory, reads find the new files."""
    old = store.append(0, b"old", b"o" * 100)
    assert store.read(old, b"old") == b"o" * 100  # caches a descriptor on the old 0.spill
    other = SpillStore(store.path)
    other.destroy()
    other = SpillStore(store.path)
    try:
        new = other.append(0, b"new", b"n" * 100)  # a new 0.spill: the new record where the old one was
        assert new.offset == old.offset
        assert store.read(new, b"new") == b"n" * 100
        assert store.read(old, b"old") is None
    finally:
        other.close()


def test_pickles_as_its_path(store):
    loc = store.append(0, b"k", b"v" * 1000)
    clone = pickle.loads(pickle.dumps(store))
    try:
        assert clone.read(loc, b"k") == b"v" * 1000 and clone.level == store.level
    finally:
        clone.close()


def test_fork_child_cannot_steal_the_parents_slot(store):
    store.append(0, b"parent", b"p" * 100)

    def child() -> None:
        store.lock_timeout_s = 0.2
        with pytest.raises(LockTimeout, match="slot 0"):
            store.append(0, b"child", b"c")  # the parent holds slot 0: the child must not write it
        loc = store.append(1, b"child", b"c" * 100)
        assert store.read(loc, b"child") == b"c" * 100
        store.close()  # closes the child's copies only

    assert fork_call(child) == 0
    loc = store.append(0, b"parent2", b"q" * 100)  # the parent kept its lock and its file
    assert store.read(loc, b"parent2") == b"q" * 100
    other = SpillStore(store.path)
    try:
        assert other.recover(0).live == 1
    finally:
        other.close()


def test_second_owner_of_a_live_slot_times_out(store, tmp_path):
    store.append(0, b"a", b"1")
    other = SpillStore(store.path, lock_timeout_s=0.1)
    try:
        with pytest.raises(LockTimeout, match="its own liveness slot"):
            other.append(0, b"b", b"2")
        assert other.append(1, b"b", b"2").file_id == 1
    finally:
        other.close()


def test_closed_store_refuses_work(store):
    loc = store.append(0, b"a", b"1")
    store.close()
    store.close()  # idempotent
    with pytest.raises(SpillError, match="closed"):
        store.read(loc, b"a")
    assert store.stats()["records"] == 1


def test_destroy_deletes_the_directory(tmp_path):
    s = SpillStore(tmp_path / "d")
    s.append(0, b"a", b"1")
    s.destroy()
    assert not (tmp_path / "d").exists()


def test_files_are_private(store):
    store.append(0, b"a", b"1")
    assert store.path.stat().st_mode & 0o777 == 0o700
    assert store.file_path(0).stat().st_mode & 0o777 == 0o600


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda s: s.append(-1, b"k", b""), "slot"),
        (lambda s: s.append(1 << 16, b"k", b""), "slot"),
        (lambda s: s.append(True, b"k", b""), "slot"),
        (lambda s: s.append(0, "k", b""), "must be bytes"),
        (lambda s: s.append(0, b"k" * 70_000, b""), "hash long keys"),
        (lambda s: s.append(0, b"k", 12), "bytes-like"),
        (lambda s: s.append(0, b"k", np.zeros((4, 4))[:, 0]), "C-contiguous"),
        (lambda s: s.read((0, -1, 3), b"k"), "negative"),
        (lambda s: s.read("nope", b"k"), "spill location"),
        (lambda s: s.read_into((0, 32, 1), b"k", b"x"), "writable"),
    ],
)
def test_bad_arguments(store, call, match):
    with pytest.raises(InvalidArgument, match=match):
        call(store)


def test_bad_level(tmp_path):
    with pytest.raises(InvalidArgument, match="level"):
        SpillStore(tmp_path, level=0)


# --- self-checking records ----------------------------------------------------------------------


def test_wrong_key_is_a_quiet_miss(store, caplog):
    loc = store.append(0, b"right", b"data" * 100)
    with caplog.at_level(logging.WARNING, logger="shmcache"):
        assert store.read(loc, b"wrong") is None
        assert store.read(loc, b"longer-key") is None
        assert store.read_into(loc, b"wrong", bytearray(400)) is False
    assert store.stats()["key_mismatches"] == 3 and store.stats()["corrupt_reads"] == 0
    assert not caplog.records  # a stale location is not damage


def test_truncated_record_is_a_counted_miss(store, caplog):
    locs = [store.append(0, b"%d" % i, payload(i)) for i in range(5)]
    locs.append(store.append(0, b"last", tokens(20_000).tobytes()))
    os.truncate(store.file_path(0), locs[-1].offset + locs[-1].stored_len // 2)
    with caplog.at_level(logging.WARNING, logger="shmcache"):
        assert store.read(locs[-1], b"last") is None
        assert store.read(locs[-1], b"last") is None  # counted again, logged once
        assert store.read_into(locs[-1], b"last", bytearray(locs[-1].raw_len)) is False
    assert store.stats()["corrupt_reads"] == 3
    assert len(caplog.records) == 1 and "cut short" in caplog.text and str(store.file_path(0)) in caplog.text
    for i, loc in enumerate(locs[:-1]):
        assert store.read(loc, b"%d" % i) == payload(i)


@pytest.mark.parametrize("kind", ["zstd", "raw", "raw-large", "empty"])
def test_every_flipped_byte_is_a_miss(store, kind):
    """Flip each byte of a record (header, key, padding excepted, payload) in turn: never wrong data."""
    data = {
        "zstd": tokens(300).tobytes(),
        "raw": noise(300),
        "raw-large": noise(20_000),
        "empty": b"",
    }[kind]
    before = store.append(0, b"before", b"b" * 64)
    loc = store.append(0, b"the-key", data)
    after = store.append(0, b"after", b"a" * 64)
    assert loc.compressed is (kind == "zstd")
    path = store.file_path(0)
    key_end = loc.offset + RECORD_HEADER_BYTES + len(b"the-key")
    body = key_end + spill_format.padding(len(b"the-key"))
    positions = [*range(loc.offset, key_end), *range(body, body + loc.stored_len)]
    if kind == "raw-large":  # every byte is slow here: header, key, and 300 spread over the body
        positions = positions[: key_end - loc.offset] + positions[key_end - loc.offset :: 67]
    misses = 0
    for pos in positions:
        for mask in (0x01, 0x80):
            flip(path, pos, mask)
            misses += store.read(loc, b"the-key") is None
            flip(path, pos, mask)
    assert misses == 2 * len(positions)
    assert store.stats()["corrupt_reads"] + store.stats()["key_mismatches"] == misses
    assert store.read(loc, b"the-key") == data
    assert store.read(before, b"before") == b"b" * 64 and store.read(after, b"after") == b"a" * 64


def test_corrupt_zstd_frame_never_raises(store, monkeypatch):
    """Bytes that pass the checksum but that zstd rejects (a bug, not damage) are still a miss."""
    loc = store.append(0, b"k", tokens(5000).tobytes())
    garbage = b"\xff" * loc.stored_len
    head = spill_format.pack_head(spill_format.FLAG_ZSTD, b"k", loc.raw_len, garbage)
    with open(store.file_path(0), "r+b") as f:  # a well-formed record whose frame is garbage
        f.seek(loc.offset)
        f.write(head + b"k" + b"\0" * 7 + garbage)
    assert store.read(loc, b"k") is None
    assert store.read_into(loc, b"k", bytearray(loc.raw_len)) is False
    assert store.stats()["corrupt_reads"] == 2


@pytest.mark.parametrize(
    "where",
    ["past-the-end", "file-header", "mid-record", "missing-file", "stored-len", "raw-len"],
)
def test_bad_locations_are_misses(store, where):
    loc = store.append(0, b"k", tokens(1000).tobytes())
    bad = {
        "past-the-end": (0, loc.offset + 10_000, loc.stored_len),
        "file-header": (0, 0, loc.stored_len),
        "mid-record": (0, loc.offset + 8, loc.stored_len),
        "missing-file": (7, loc.offset, loc.stored_len),
        "stored-len": (0, loc.offset, loc.stored_len + 8),
        "raw-len": loc,
    }[where]
    if where == "raw-len":
        assert store.read_into(bad, b"k", bytearray(loc.raw_len + 1)) is False
    else:
        assert store.read(bad, b"k") is None
        assert store.read_into(bad, b"k", bytearray(loc.raw_len)) is False
    assert store.read(loc, b"k") == tokens(1000).tobytes()


def test_body_check_detects_single_bit_flips():
    rng = np.random.default_rng(1)
    for size in (0, 7, 8191, 8192, 8193, 40_000, 100_003):
        data = bytearray(rng.bytes(size))
        good = spill_format.body_check(data)
        for pos in rng.integers(0, size, size=min(size, 40)):
            for bit in (0, 5, 7):
                data[pos] ^= 1 << bit
                assert spill_format.body_check(data) != good, (size, pos, bit)
                data[pos] ^= 1 << bit


def test_body_check_detects_swapped_blocks():
    data = bytearray(np.random.default_rng(2).bytes(5 * 4096))
    good = spill_format.body_check(data)
    data[0:4096], data[4096:8192] = data[4096:8192], data[0:4096]
    assert spill_format.body_check(data) != good


# --- repair -------------------------------------------------------------------------------------


def _dead_writer_file(tmp_path: Path, n: int) -> tuple[Path, list[SpillLoc]]:
    """A spill dir whose slot 0 writer appended n records and then died without close()."""
    path = tmp_path / "dead"
    SpillStore(path).close()

    def writer() -> None:
        s = SpillStore(path)
        locs = [list(s.append(0, b"%d" % i, payload(i))) for i in range(n)]
        (path / "locs.json").write_text(json.dumps(locs))
        # os._exit follows, as after a SIGKILL: the kernel drops the lock, clean_end stays 0

    assert fork_call(writer) == 0
    locs = [SpillLoc(*loc) for loc in json.loads((path / "locs.json").read_text())]
    (path / "locs.json").unlink()
    return path, locs


@pytest.mark.parametrize("tail", ["half-record", "half-header", "garbage", "zeros"])
def test_recover_truncates_a_torn_tail(tmp_path, tail):
    path, locs = _dead_writer_file(tmp_path, 8)
    valid_end = os.path.getsize(path / "0.spill")
    with open(path / "0.spill", "ab") as f:
        if tail == "half-record":
            whole = spill_format.record_bytes(1, 1000)
            rec = spill_format.pack_head(0, b"x", 1000, b"y" * 1000) + b"x" + b"\0" * 7 + b"y" * 1000
            f.write(rec[: whole // 2])
        elif tail == "half-header":
            f.write(spill_format.pack_head(0, b"x", 10, b"y" * 10)[:20])
        elif tail == "garbage":
            f.write(noise(5000, seed=9))
        else:
            f.write(b"\0" * 4096)
    torn_size = os.path.getsize(path / "0.spill")
    s = SpillStore(path)
    try:
        report = s.recover()
        assert report.repaired == (0,) and report.records == 8 and report.bytes_valid == valid_end
        assert report.bytes_truncated == torn_size - valid_end > 0
        assert os.path.getsize(path / "0.spill") == valid_end
        for i, loc in enumerate(locs):
            assert s.read(loc, b"%d" % i) == payload(i)
        new = s.append(0, b"new", b"n" * 10)  # the next owner continues after the valid prefix
        assert new.offset == valid_end and s.read(new, b"new") == b"n" * 10
    finally:
        s.close()


def test_next_owner_repairs_without_recover(tmp_path):
    path, locs = _dead_writer_file(tmp_path, 3)
    valid_end = os.path.getsize(path / "0.spill")
    with open(path / "0.spill", "ab") as f:
        f.write(spill_format.pack_head(0, b"x", 10, b"y" * 10))  # a header whose record never came
    s = SpillStore(path)
    try:
        assert s.append(0, b"new", b"n").offset == valid_end
        assert all(s.read(loc, b"%d" % i) == payload(i) for i, loc in enumerate(locs))
    finally:
        s.close()


def test_clean_close_lets_the_next_owner_skip_the_scan(tmp_path, monkeypatch):
    real_scan = recovery._scan
    scans: list[int] = []
    monkeypatch.setattr(recovery, "_scan", lambda fd, size, verify: scans.append(size) or real_scan(fd, size, verify))
    s = SpillStore(tmp_path / "c")
    s.append(0, b"a", b"1" * 100)
    s.close()  # records its clean end in the file header
    s = SpillStore(tmp_path / "c")
    loc = s.append(0, b"b", b"2" * 100)
    assert scans == [] and s.read(loc, b"b") == b"2" * 100
    s.close()
    path, _ = _dead_writer_file(tmp_path, 3)  # died: clean_end stayed 0, so the next owner scans
    s = SpillStore(path)
    try:
        s.append(0, b"c", b"3")
        assert scans == [os.path.getsize(path / "0.spill") - spill_format.record_bytes(1, 1)]
    finally:
        s.close()


def test_recover_skips_live_writers_and_foreign_files(store, tmp_path):
    store.append(0, b"a", b"1")
    (store.path / "5.spill").write_bytes(b"not a spill file, but long enough to have a header")
    (store.path / "notes.txt").write_text("ignored")
    other = SpillStore(store.path)
    try:
        report = other.recover()
        assert (report.files, report.live, report.foreign, report.bytes_truncated) == (2, 1, 1, 0)
        assert store.recover().live == 1  # our own writer counts as live too
        with pytest.raises(SpillError, match="5.spill is not a shmcache spill file"):
            other.append(5, b"k", b"v")
    finally:
        other.close()


def test_verify_counts_corrupt_records_without_dropping_later_ones(tmp_path):
    path, locs = _dead_writer_file(tmp_path, 10)
    flip(path / "0.spill", locs[4].offset + RECORD_HEADER_BYTES + 8 + 3)
    s = SpillStore(path)
    try:
        report = s.recover(verify=True)
        assert (report.records, report.corrupt_records, report.bytes_truncated) == (10, 1, 0)
        assert s.read(locs[9], b"9") == payload(9)
    finally:
        s.close()


# --- disk full ----------------------------------------------------------------------------------


def _failing_pwritev(err: int, *, after_bytes: int):
    """os.pwritev that writes the first ``after_bytes`` of a record, then fails with ``err``."""
    real = os.pwritev

    def fake(fd, buffers, offset):
        flat = b"".join(bytes(b) for b in buffers)
        if offset == 0 or len(flat) <= after_bytes:  # file headers and small records go through
            return real(fd, buffers, offset)
        real(fd, [flat[:after_bytes]], offset)  # a partial record lands on disk ...
        raise OSError(err, os.strerror(err))  # ... then the disk fills up

    return fake


@pytest.mark.parametrize("err, error", [(errno.ENOSPC, SpillFull), (errno.EDQUOT, SpillFull), (errno.EIO, SpillError)])
def test_injected_write_failure_leaves_a_valid_file(store, monkeypatch, err, error):
    locs = [store.append(0, b"%d" % i, payload(i)) for i in range(6)]
    size = os.path.getsize(store.file_path(0))
    monkeypatch.setattr(os, "pwritev", _failing_pwritev(err, after_bytes=700))
    with pytest.raises(error, match=str(store.file_path(0))) as info:
        store.append(0, b"big", noise(50_000))
    assert isinstance(info.value, SpillError) and isinstance(info.value, OSError)
    assert (type(info.value) is SpillFull) == (err != errno.EIO)
    assert "spill_dir" in str(info.value)
    assert os.path.getsize(store.file_path(0)) == size  # the partial record is gone
    monkeypatch.undo()
    for i, loc in enumerate(locs):
        assert store.read(loc, b"%d" % i) == payload(i)
    after = store.append(0, b"after", b"z" * 100)  # and the writer carries on when space returns
    assert after.offset == size and store.read(after, b"after") == b"z" * 100
    store.close()
    report = SpillStore(store.path).recover(verify=True)
    assert (report.records, report.corrupt_records, report.bytes_truncated) == (7, 0, 0)


def test_spill_full_pickles():
    err = pickle.loads(pickle.dumps(SpillFull("no space left for spill file /x")))
    assert type(err) is SpillFull and str(err) == "no space left for spill file /x"


def _mount_tmpfs(where: Path, options: str) -> None:
    where.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        where.rmdir()
        pytest.skip(f"cannot mount a tmpfs here ({proc.stderr.strip() or proc.returncode}); needs root")


def _umount(where: Path) -> None:
    subprocess.run(["umount", "-l", str(where)], check=True, capture_output=True)
    where.rmdir()


def test_real_disk_full_on_a_small_tmpfs(tmp_path):
    mnt = tmp_path / "small"
    _mount_tmpfs(mnt, "size=1m,mode=0700")
    try:
        s = SpillStore(mnt / "spill")
        locs = []
        with pytest.raises(SpillFull, match="no space left"):
            for i in range(100):
                locs.append(s.append(0, b"%d" % i, noise(60_000, seed=i)))
        assert 5 < len(locs) < 20
        end = locs[-1].offset + spill_format.record_bytes(len(b"%d" % (len(locs) - 1)), 60_000)
        assert os.path.getsize(s.file_path(0)) == end  # the torn record was truncated away
        for i, loc in enumerate(locs):
            assert s.read(loc, b"%d" % i) == noise(60_000, seed=i)
        small = s.append(0, b"small", b"s" * 100)  # what fits still goes in
        assert s.read(small, b"small") == b"s" * 100
        s.close()
        report = SpillStore(mnt / "spill").recover(verify=True)
        assert (report.records, report.corrupt_records, report.bytes_truncated) == (len(locs) + 1, 0, 0)
    finally:
        _umount(mnt)


# --- the spill directory ------------------------------------------------------------------------


def test_check_spill_dir_accepts_a_directory_and_the_store_makes_its_folder_0700(tmp_path):
    before = list(tmp_path.iterdir())  # the test's namespace directory
    assert check_spill_dir(str(tmp_path)) == tmp_path
    assert list(tmp_path.iterdir()) == before  # the write probe left nothing
    store = SpillStore(tmp_path / "folder")
    assert store.path.is_dir() and store.path.stat().st_mode & 0o777 == 0o700
    store.close()


def test_check_spill_dir_rejects_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(SpillError, match=f"{f} exists but is not a directory; remove it"):
        check_spill_dir(f)
    with pytest.raises(SpillError, match="below does not exist"):
        check_spill_dir(f / "below")


def test_check_spill_dir_rejects_a_read_only_directory(tmp_path):
    if os.geteuid() == 0:  # root ignores mode bits; a read-only mount stops it
        ro = tmp_path / "ro"
        _mount_tmpfs(ro, "size=64k,ro")
    else:
        ro = tmp_path / "ro"
        ro.mkdir(mode=0o500)
    try:
        with pytest.raises(SpillError, match=f"spill_dir {ro} is not writable: .*SHMCACHE_SPILL_DIR"):
            check_spill_dir(ro)
        with pytest.raises(SpillError, match=f"spill folder {ro}: Read-only file system"):
            SpillStore(ro)
    finally:
        if os.geteuid() == 0:
            _umount(ro)


def test_check_spill_dir_rejects_non_paths():
    with pytest.raises(InvalidArgument, match="spill_dir must be a path"):
        check_spill_dir(3)  # type: ignore[arg-type]


def test_create_false_needs_an_existing_directory(tmp_path):
    with pytest.raises(SpillError, match="no spill directory at"):
        SpillStore(tmp_path / "missing", create=False)


def test_a_forked_child_that_never_writes_does_not_keep_a_dead_writers_slot(tmp_path):
    """The slot file's flock goes with its writer, even if an idle forked child inherited it."""
    path = tmp_path / "spill"
    store = SpillStore(path, lock_timeout_s=2)

    def hold():
        store.append(0, b"k", b"v" * 100)  # takes slot 0's flock, keeps it until close
        return lambda: None

    child = die_holding_after_forking_an_idle_child(hold, tmp_path / "child.pid")
    try:
        os.kill(child, 0)
        takeover = SpillStore(path, lock_timeout_s=2)
        loc = takeover.append(0, b"next", b"w" * 100)  # LockTimeout if the child kept the slot
        assert takeover.read(loc, b"next") == b"w" * 100
        takeover.close()
    finally:
        reap(child)


def test_a_fork_while_another_thread_holds_the_spill_folder_lock_does_not_hang_the_child(tmp_path):
    import threading

    from shmcache.tiers.spill import tier as spilling

    held, done = threading.Event(), threading.Event()

    def holder():
        with spilling._FILES_LOCK:
            held.set()
            done.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    held.wait(10)
    try:
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                signal.alarm(10)  # a hang ends as SIGALRM, not as a stuck test
                spilling._shared_files(tmp_path / "spill", 1, 0)
                code = 0
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
    finally:
        done.set()
        t.join()
    assert os.waitstatus_to_exitcode(status) == 0, "the child hung on a lock the parent's thread held"


# --- issue 8: log once per file and condition; a missing file is not damage ---------------------


def test_damage_to_many_records_of_one_file_logs_one_line(store, caplog):
    locs = [store.append(0, b"%d" % i, bytes([i]) * 1000) for i in range(40)]
    path = store.file_path(0)
    raw = bytearray(path.read_bytes())
    for loc in locs:  # one flipped byte in the stored bytes of every record
        raw[loc.offset + RECORD_HEADER_BYTES + 8] ^= 0x5A
    path.write_bytes(raw)
    with caplog.at_level(logging.WARNING, logger="shmcache"):
        for i, loc in enumerate(locs):
            assert store.read(loc, b"%d" % i) is None
    assert store.stats()["corrupt_reads"] == 40  # every one counted ...
    lines = [r for r in caplog.records if "corrupt spill record" in r.getMessage()]
    assert len(lines) == 1, [r.getMessage() for r in lines]  # ... one line for the file and condition
    assert str(path) in lines[0].getMessage() and "counted" in lines[0].getMessage()


def test_a_missing_spill_file_is_a_quiet_miss(store, caplog):
    loc = store.append(0, b"k", payload(1))
    store.close()
    reader = SpillStore(store.path)
    os.unlink(store.file_path(0))  # what a clear() elsewhere does
    with caplog.at_level(logging.WARNING, logger="shmcache"):
        assert reader.read(loc, b"k") is None
    assert not caplog.records, caplog.text
    reader.close()


def test_check_spill_dir_refuses_a_missing_directory_and_creates_nothing(tmp_path):
    with pytest.raises(SpillError, match=r"does not exist; create it first \(mkdir -p .*/a/b\)"):
        check_spill_dir(tmp_path / "a" / "b")
    assert not (tmp_path / "a").exists()


# --- the record on its own (spill/format.py), as the remote and snapshot tiers use it ------------


@pytest.mark.parametrize("payload", [b"", b"a" * 10_000, bytes(range(256)) * 40, np.arange(5000).tobytes()])
def test_pack_and_unpack_record_round_trip_and_refuse_other_keys_cuts_and_flips(payload):
    import zstandard

    from shmcache.tiers.spill import pack_record, unpack_record

    cctx, dctx = zstandard.ZstdCompressor(level=1, write_content_size=True), zstandard.ZstdDecompressor()
    buf = b"".join(bytes(part) for part in pack_record(b"key1", payload, cctx))
    assert len(buf) % spill_format.ALIGN == 0
    assert unpack_record(buf, b"key1", dctx) == (bytearray(payload), None)
    view, _ = unpack_record(buf, b"key1", dctx, copy=False)  # an import's way: no copy of a raw one
    assert bytes(view) == payload
    assert unpack_record(buf, b"key2", dctx)[1] == "it holds another key"
    assert unpack_record(buf[: RECORD_HEADER_BYTES + 2], b"key1", dctx)[0] is None
    caught = 0
    for pos in range(len(buf)):
        flipped = bytearray(buf)
        flipped[pos] ^= 0x10
        out, why = unpack_record(flipped, b"key1", dctx)
        assert out is None or out == payload, pos  # never wrong bytes
        caught += out is None
    assert caught >= len(buf) - 14  # only the zero padding (at most 7 + 7 bytes) is unchecked


def test_the_spill_tier_is_an_indexed_tier_and_round_trips_through_a_location(tmp_path):
    """The seam of NOTE [tiers]: the store writes through ``write`` and reads a ``RecordLocation`` back;
    a location with another key, or one cut short, is a miss, never another record."""
    from shmcache.cache.indexed_tier import IndexedTier, RecordLocation
    from shmcache.cache.store import CacheStore
    from shmcache.tiers.spill import tier as spilling

    store = CacheStore("tier", "c", capacity_bytes=4 << 20)
    try:
        tier = spilling.attach(store, tmp_path)
        assert isinstance(tier, IndexedTier) and store.spill is tier
        loc = tier.write(b"k" * 8, b"r" * 100)
        assert isinstance(loc, RecordLocation) and loc.raw == 100
        assert tier.read(loc, b"k" * 8) == b"r" * 100
        assert tier.read(loc, b"j" * 8) is None
        assert tier.read(RecordLocation(loc.word, loc.stored - 1), b"k" * 8) is None
    finally:
        store.destroy()
