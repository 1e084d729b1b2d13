"""Source values that encode their key, and the invariant check every crash and stress test ends with.

A value is built from its key alone (``value_for``), so any process can verify what it read: a torn
record, a record of another key, or garbage left by a writer that died mid-copy never compares
equal. ``check_store`` inspects a quiescent cache (no writer running) through its shared structures
and returns the list of broken invariants (empty when sound), in the spirit of diskcache's
``cache.check()``: the test fails on what is wrong, not only on "it survived".
"""

from __future__ import annotations

import json
import struct
from collections import Counter
from pathlib import Path

import numpy as np

from shmcache import cli
from shmcache.cache.admission import AHEAD_BYTES
from shmcache.cache.allocator import commit_step_chunks
from shmcache.cache.generation import MetaLayout
from shmcache.cache.index import INT_KEY, SPILLED, TableView, key_bytes
from shmcache.cache.store import MISSING, CacheStore

__all__ = ["SIZES", "value_for", "fixed_value", "same_value", "check_store", "cache_segments",
           "intent_phase", "group_phase", "reader_saw_no_harm"]

# Record sizes spanning several size classes: 64-byte classes, the doubling classes, and a few
# records large enough to need their own commit step.
SIZES = (8, 100, 333, 1000, 2500, 4100, 9000, 33000, 70000)
_M48 = (1 << 48) - 1


def gc_json(capsys) -> dict:
    """Run `shmcache gc --json` in-process and return its report."""
    capsys.readouterr()
    assert cli.main(["gc", "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _pattern(key, size: int) -> bytes:
    seed = repr(key).encode()
    reps = -(-size // len(seed))
    return (seed * reps)[:size]


def value_for(key):
    """The source value of ``key``: its type and size vary with the key, its bytes encode it."""
    h = key if isinstance(key, int) else sum(key.encode() if isinstance(key, str) else key)
    size = SIZES[h % len(SIZES)]
    kind = h % 3
    if kind == 0:
        return _pattern(key, size)
    if kind == 1:
        return np.frombuffer(_pattern(key, size), np.uint8).copy()
    return {"key": key, "payload": _pattern(key, size), "n": size}


def fixed_value(key, size: int = 3000) -> bytes:
    """Same-size records (one size class): what the chunk-reclaim tests need."""
    return _pattern(key, size)


def row_value(key, size: int = 3000) -> tuple:
    """Records of one size class whose layouts differ (a str of 1-3 characters beside ``size``
    bytes): one run of several shapes (CacheWriter._put_run)."""
    return _pattern(key, size), "n" * (key % 3 + 1)


def same_value(a, b) -> bool:
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                and a.shape == b.shape and bool((a == b).all()))
    return type(a) is type(b) and a == b


def reader_saw_no_harm(report_path) -> None:
    """A reader process's report (JSON: errors, bad, hits): no exception, no torn or foreign value,
    and it did read something."""
    report = json.loads(Path(report_path).read_text())
    assert report["errors"] == [], f"the reader got exceptions: {report['errors']}"
    assert report["bad"] == [], f"the reader read torn or foreign values: {report['bad']}"
    assert report["hits"] > 0


def intent_phase(store: CacheStore) -> int:
    g = store.view.refresh()
    return struct.unpack_from("Q", g.meta.buf, MetaLayout.INTENT)[0]


def group_phase(store: CacheStore) -> int:
    """The phase of the group intent (put_records: PublishGroup)."""
    g = store.view.refresh()
    return struct.unpack_from("Q", g.meta.buf, MetaLayout.GROUP)[0]


def cache_segments(store: CacheStore) -> set[str]:
    head = store.view.base + "+"
    return {n for n in store.ns.owned_segments() if n.startswith(head)}


def check_store(store: CacheStore, keys=None, source=value_for, *, after_gc: bool = True,
                slack_steps: int = 1) -> list[str]:
    """Every invariant of a quiescent, non-spilling cache that must hold after a crash was repaired.

    ``keys``: the universe of keys that may be stored; each one present must read back equal to
    ``source(key)``, and the present ones must be exactly the table's entries. ``slack_steps``:
    commit steps a class may hold beyond its bump (a publish group of put_records that was undone leaves
    the steps it committed for the next writer: committed, not leaked).
    """
    problems: list[str] = []
    g = store.view.refresh()
    meta = g.meta.buf
    items_mem, bytes_mem, committed = struct.unpack_from("QQQ", meta, MetaLayout.ITEMS_MEM)
    table_items = struct.unpack_from("Q", meta, MetaLayout.TABLE_ITEMS)[0]
    phase = struct.unpack_from("Q", meta, MetaLayout.INTENT)[0]
    group_phase = struct.unpack_from("Q", meta, MetaLayout.GROUP)[0]
    entries = list(g.index.entries())
    if after_gc and phase != 0:
        problems.append(f"intent record left at phase {phase} after gc/repair")
    if after_gc and group_phase != 0:
        problems.append(f"group intent record left at phase {group_phase} after gc/repair")
    if any(w0 & SPILLED for w0, _, _ in entries):
        problems.append("spilled entries in a cache without spilling")
    if items_mem != len(entries):
        problems.append(f"items_mem {items_mem} != {len(entries)} READY entries")
    if table_items != len(entries):
        problems.append(f"table items {table_items} != {len(entries)} READY entries")
    record_bytes = sum(w0 >> 32 for w0, _, _ in entries)
    if bytes_mem != record_bytes:
        problems.append(f"bytes_mem {bytes_mem} != {record_bytes}, the sum of the READY records")
    # each key once (int keys store themselves; str/bytes keys are checked through `keys` below)
    dup = [w1 for (_, w1), n in Counter((w0 & INT_KEY, w1) for w0, w1, _ in entries).items() if n > 1]
    if dup:
        problems.append(f"{len(dup)} keys stored more than once: {dup[:5]}")
    # the allocator: every chunk below a class's bump is referenced by exactly one entry
    by_class: dict[int, list[int]] = {}
    for _, _, w2 in entries:
        by_class.setdefault(w2 >> 48, []).append(w2 & _M48)
    expect_committed = MetaLayout.SIZE + TableView.bytes_for(g.index.capacity)
    for cls in g.classes.used_classes():
        chunk, bump, committed_chunks = g.classes.get(cls)
        reserved = g.classes.reserved(cls)  # chunks asked ahead count in the total (Admission.commit_ahead)
        expect_committed += max(committed_chunks, reserved) * chunk
        if reserved > committed_chunks + max(AHEAD_BYTES // chunk, 1, commit_step_chunks(chunk)):
            problems.append(f"class {cls}: {reserved - committed_chunks} chunks reserved past its "
                            f"{committed_chunks} committed, more than one run's")
        chunks = sorted(by_class.pop(cls, []))
        if chunks != list(range(bump)):
            leaked = sorted(set(range(bump)) - set(chunks))
            problems.append(f"class {cls} (chunk {chunk}): bump {bump} but {len(chunks)} referenced "
                            f"chunks; leaked {leaked[:8]}{'...' if len(leaked) > 8 else ''}; "
                            f"shared {len(chunks) - len(set(chunks))}")
        if bump > committed_chunks:
            problems.append(f"class {cls}: bump {bump} beyond its {committed_chunks} committed chunks")
        if committed_chunks - bump > slack_steps * commit_step_chunks(chunk):
            problems.append(f"class {cls}: {committed_chunks - bump} committed chunks unused, more "
                            f"than {slack_steps} commit step(s) ({commit_step_chunks(chunk)})")
    if by_class:
        problems.append(f"entries point into unregistered classes {sorted(by_class)}")
    if committed != expect_committed:
        problems.append(f"committed_bytes {committed} != {expect_committed} (meta + current table + "
                        f"committed and reserved chunks): off by {committed - expect_committed}")
    if after_gc:
        want = {store.view.segment_name("root"), store.view.segment_name(f"g{g.gen}", "meta"),
                store.view.segment_name(f"g{g.gen}", f"t{g.version}")}
        want |= {store.view.segment_name(f"g{g.gen}", f"c{c}") for c in g.classes.used_classes()}
        have = cache_segments(store)
        if have != want:
            problems.append(f"segments: unexpected {sorted(have - want)}, missing {sorted(want - have)}")
    if keys is not None:
        present = 0
        for key in keys:
            v = store.lookup(key, count=False)
            if v is MISSING:
                continue
            present += 1
            if not same_value(v, source(key)):
                problems.append(f"key {key!r} reads {str(v)[:60]}, not its source value")
        if present != len(entries):
            problems.append(f"{present} of the keys are present but the table has {len(entries)} "
                            f"entries (an entry nobody published, or a key stored twice)")
        int_words = {key_bytes(k)[0] for k in keys if isinstance(k, int)}
        stray = [w1 for w0, w1, _ in entries if w0 & INT_KEY and w1 not in int_words]
        if stray:
            problems.append(f"entries for int keys never written: {stray[:5]}")
    return problems
