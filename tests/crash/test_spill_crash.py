"""SIGKILL spill writers mid-append, again and again (RELIABILITY.md scenario 11, NOTE [spill records]).

Each round forks a writer that takes over slot 0 of one spill directory - repairing whatever the
previous, killed writer left - and appends large records in a loop, acknowledging each one in a
side file only after ``append`` returned (as the store publishes an index entry only then). The
parent kills it at a random moment, or just as the file starts to grow (mid-pwritev), then checks
that every acknowledged record reads back exactly, that torn tails are cut off (by ``recover()``
in some rounds, by the next writer's takeover in the others), and that nothing hangs.
"""

from __future__ import annotations

import functools
import os
import random
import select
import signal
import struct
import time
from pathlib import Path

import numpy as np
import pytest

from shmcache.tiers import records as spill_format
from shmcache.tiers.spill import SpillLoc, SpillStore

ROUNDS = 30
MAX_ROUNDS = 150  # more rounds while fewer than TEARS kills have landed mid-record (timing decides)
TEARS = 3
SLOT = 0
ACK = struct.Struct("<5q")  # key id, file_id, offset, stored_len, raw_len


@functools.lru_cache(maxsize=4)
def _bases(gen: int) -> tuple[bytes, bytes]:
    """Per-round source bytes: token-like int64 ids (compress ~4x) and random bytes (stored raw)."""
    rng = np.random.default_rng(gen)
    toks = np.repeat(rng.integers(0, 1000, size=(2 << 20) // 32), 4).astype(np.int64).tobytes()
    return toks, rng.bytes(2 << 20)


def expected(kid: int) -> bytes:
    """The payload of key id ``kid`` (round kid // 1000): 128 KiB - 2 MiB, stamped with its id."""
    toks, noise = _bases(kid // 1000)
    size = int(np.random.default_rng(kid).integers(128 << 10, 2 << 20))
    body = toks if kid % 3 == 0 else noise
    return kid.to_bytes(8, "little") + body[8:size]


def key(kid: int) -> bytes:
    return b"item-%d" % kid


def _writer(path: Path, gen: int, ack_path: Path, ready_w: int) -> None:
    """Child: take over the slot, say ready, append and acknowledge until killed."""
    store = SpillStore(path)
    with open(ack_path, "ab", buffering=0) as ack:
        for i in range(1000):
            kid = gen * 1000 + i
            loc = store.append(SLOT, key(kid), expected(kid))  # i == 0: takeover and repair first
            ack.write(ACK.pack(kid, *loc))  # only now may anyone refer to it
            if i == 0:
                os.write(ready_w, b"r")


def _spawn_writer(path: Path, gen: int, ack_path: Path) -> tuple[int, int]:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        code = 1
        try:
            os.close(ready_r)
            _writer(path, gen, ack_path, ready_w)
            code = 0
        finally:
            os._exit(code)
    os.close(ready_w)
    return pid, ready_r


def _wait_ready(pid: int, ready_r: int, timeout_s: float = 20.0) -> None:
    try:
        readable, _, _ = select.select([ready_r], [], [], timeout_s)
        if not readable or os.read(ready_r, 1) != b"r":
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"writer {pid} did not take over the slot within {timeout_s}s (hang or crash)")
    finally:
        os.close(ready_r)


def _kill_mid_write(pid: int, path: Path, targeted: bool, rng: random.Random) -> None:
    """SIGKILL at a random moment, or (targeted) as soon as the file grows: inside a pwritev."""
    if targeted:
        start = os.path.getsize(path)
        deadline = time.monotonic() + 5.0
        while os.path.getsize(path) <= start + (16 << 10) and time.monotonic() < deadline:
            pass
    else:
        time.sleep(rng.uniform(0.0, 0.03))
    os.kill(pid, signal.SIGKILL)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, "the writer exited early"


def _acked(ack_path: Path) -> list[tuple[int, SpillLoc]]:
    raw = ack_path.read_bytes() if ack_path.exists() else b""
    rows = [ACK.unpack_from(raw, k) for k in range(0, len(raw) - len(raw) % ACK.size, ACK.size)]
    return [(kid, SpillLoc(*loc)) for kid, *loc in rows]


def _check(store: SpillStore, records: list[tuple[int, SpillLoc]]) -> None:
    for kid, loc in records:
        got = store.read(loc, key(kid))
        assert got is not None, f"acknowledged record {kid} at {loc} is unreadable"
        assert got == expected(kid), f"acknowledged record {kid} at {loc} reads back wrong data"


def _end(loc: SpillLoc, kid: int) -> int:
    return loc.offset + spill_format.record_bytes(len(key(kid)), loc.stored_len)


def test_sigkill_writers_mid_append(tmp_path):
    path = tmp_path / "spill"
    data_file = path / f"{SLOT}.spill"
    reader = SpillStore(path)
    rng = random.Random(1234)
    tears = {"recover": 0, "takeover": 0}
    previous: list[tuple[int, SpillLoc]] = []
    valid_end, repaired = spill_format.FILE_HEADER_BYTES, True
    try:
        gen = 0
        while gen < ROUNDS or (tears["recover"] + tears["takeover"] < TEARS and gen < MAX_ROUNDS):
            gen += 1
            size_before = os.path.getsize(data_file) if data_file.exists() else spill_format.FILE_HEADER_BYTES
            ack_path = tmp_path / f"ack{gen}"
            pid, ready_r = _spawn_writer(path, gen, ack_path)
            _wait_ready(pid, ready_r)  # the takeover finished: the dead writer's lock was free
            _kill_mid_write(pid, data_file, targeted=gen % 2 == 1, rng=rng)
            acked = _acked(ack_path)
            takeover = acked[0][1]
            # The new writer appended after every acknowledged record and over nothing valid: exactly
            # at the end when the file was repaired, else somewhere up to the torn tail it cut off.
            assert takeover.offset == size_before if repaired else valid_end <= takeover.offset <= size_before
            tears["takeover"] += takeover.offset < size_before
            _check(reader, previous + acked)
            repaired = gen % 4 in (0, 1)  # gc repairs these; in the other rounds the next writer does
            if repaired:
                report = reader.recover(SLOT)
                assert (report.files, report.live, report.bytes_valid) == (1, 0, os.path.getsize(data_file))
                tears["recover"] += report.bytes_truncated > 0
            previous, valid_end = acked, _end(acked[-1][1], acked[-1][0])

        report = reader.recover(SLOT, verify=True)
        all_acked = [rec for g in range(1, gen + 1) for rec in _acked(tmp_path / f"ack{g}")]
        assert report.corrupt_records == 0 and report.records >= len(all_acked)
        _check(reader, all_acked)
        loc = reader.append(SLOT, b"after", b"after" * 1000)  # a new owner continues after the valid prefix
        assert loc.offset == report.bytes_valid and reader.read(loc, b"after") == b"after" * 1000
        assert reader.stats()["corrupt_reads"] == 0
    finally:
        reader.close()
    print(f"torn tails: {tears} in {gen} rounds, records acknowledged: {len(all_acked)}")
    assert tears["recover"] + tears["takeover"] >= TEARS, f"kills never tore a record: {tears} in {gen} rounds"
