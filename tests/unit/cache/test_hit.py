"""The compiled hit of an int key (cache.hit, issue 27): the value the Python hot path gives, the
hit counted where the view counts it, and for anything but that path's exact case the long way
(``LONG_WAY``), which names damage; bad arguments refused by name, clean under the sanitizers,
off with ``SHMCACHE_NATIVE=0``.

Most tests drive one ``Hits`` over buffers made here (a root, a table, a meta segment and a class
segment, as the view maps them), so each check can be broken on its own; the rest go through a
real cache both ways (the ``hit_path`` fixture).
"""

from __future__ import annotations

import gc
import mmap
import os
import weakref
from pathlib import Path

import numpy as np
import pytest

from shmcache.cache import hit
from shmcache.cache.allocator import DATA_OFF
from shmcache.cache.generation import HITS, RootLayout
from shmcache.cache.index import ENTRY_BYTES, INT_KEY, READY, SPILLED, TABLE_OFF, location_word, state_word
from shmcache.cache.store import MISSING, CacheStore
from shmcache.cache.view import UNDECODABLE
from shmcache.errors import InvalidArgument

native = pytest.mark.skipif("not built" in hit.unavailable_reason(),
                            reason=f"the compiled hit: {hit.unavailable_reason()}")

EPOCH, CAP, CLS, LID, CHUNK = 0x1_0000_0001, 16, 3, 5, 64  # a class of 64-byte chunks, 4 handed out


class Forged:
    """The buffers and dicts one Hits reads, as a view maps them: key 7's record in chunk 2."""

    def __init__(self):
        self.root = np.zeros(RootLayout.EPOCH // 8 + 8, np.uint64)
        self.root[RootLayout.EPOCH // 8] = EPOCH
        self.table = np.zeros((TABLE_OFF + ENTRY_BYTES * CAP) // 8, np.uint64)
        self.meta = np.zeros(64, np.uint64)
        self.data = np.zeros(DATA_OFF + 8 * CHUNK, np.uint8)
        self.data[DATA_OFF + 2 * CHUNK:DATA_OFF + 2 * CHUNK + 40] = np.arange(40)
        self.classes = {CLS: (None, memoryview(self.data).toreadonly(), CHUNK, 4)}
        self.decoded: list = []
        self.layouts = {LID: (b"", None, 24, self.decode)}
        self.counted = 0
        self.put(7, state_word(READY | INT_KEY, LID, 40), location_word(CLS, 2))
        self.counters = [0, 0, 0, 0]
        self.hits = hit.reader(self.root, EPOCH, self.table, CAP, self.meta, self.classes, self.layouts,
                               UNDECODABLE, self.count)

    def decode(self, buf):
        self.decoded.append(type(buf))
        return bytes(buf)

    def count(self):
        self.counted += 1

    def put(self, key: int, w0: int, w2: int, w1: int | None = None) -> None:
        at = (TABLE_OFF + ENTRY_BYTES * key) // 8
        self.table[at:at + 3] = [w0, key if w1 is None else w1, w2]


@pytest.fixture
def forged():
    return Forged()


RECORD = bytes(range(40))


@native
def test_a_hit_is_the_record_decoded_from_a_copy_of_its_own(forged):
    assert forged.hits.get(7) == RECORD
    assert forged.decoded == [bytearray]  # the private decoder, on a copy (never a view of shared memory)
    assert forged.counted == 1  # no target set: counted by the view's count


@native
def test_peek_is_a_hit_uncounted(forged):
    forged.hits.target(forged.counters, 8 * 5)
    assert forged.hits.peek(7) == RECORD and forged.hits.peek(6) is hit.ABSENT
    assert forged.counters[0] == 0 and int(forged.meta[5]) == 0 and forged.counted == 0
    _break(forged, "a chunk not handed out")
    assert forged.hits.peek(7) is hit.LONG_WAY


@native
def test_an_empty_entry_at_the_keys_own_position_is_absent(forged):
    assert forged.hits.get(6) is hit.ABSENT and forged.counted == 0


def _break(f: Forged, how: str):
    """``(what get is asked, after what)`` for one check of the hot path broken."""
    key = 7
    if how == "a bool key":
        f.put(1, state_word(READY | INT_KEY, LID, 40), location_word(CLS, 2))
        key = True
    elif how == "an int subclass":
        key = type("MyInt", (int,), {})(7)
    elif how in ("a negative key", "a key past the table", "a key past 64 bits"):
        key = {"a negative key": -1, "a key past the table": CAP, "a key past 64 bits": 1 << 70}[how]
    elif how == "another epoch":
        f.root[RootLayout.EPOCH // 8] = EPOCH + 1
    elif how == "spilled":
        f.put(7, state_word(READY | INT_KEY | SPILLED, LID, 40), location_word(CLS, 2))
    elif how == "a str key's entry":
        f.put(7, state_word(READY, LID, 40), location_word(CLS, 2))
    elif how == "not ready":
        f.put(7, state_word(INT_KEY, LID, 40), location_word(CLS, 2))
    elif how == "another key word":
        f.put(7, state_word(READY | INT_KEY, LID, 40), location_word(CLS, 2), w1=8)
    elif how == "a class not mapped here":
        f.put(7, state_word(READY | INT_KEY, LID, 40), location_word(CLS + 1, 2))
    elif how == "a layout not mapped here":
        f.put(7, state_word(READY | INT_KEY, LID + 1, 40), location_word(CLS, 2))
    elif how == "a chunk not handed out":
        f.put(7, state_word(READY | INT_KEY, LID, 40), location_word(CLS, 4))
    elif how == "a length short of the layout":
        f.put(7, state_word(READY | INT_KEY, LID, 23), location_word(CLS, 2))
    elif how == "a length past the chunk":
        f.put(7, state_word(READY | INT_KEY, LID, CHUNK + 1), location_word(CLS, 2))
    elif how == "a class record past its segment":
        f.classes[CLS] = (None, memoryview(f.data), CHUNK, 9)  # 9 handed out, 8 fit: chunk 8 is past the end
        f.put(7, state_word(READY | INT_KEY, LID, 40), location_word(CLS, 8))
    elif how == "a class record that is no tuple of 4":
        f.classes[CLS] = (None, memoryview(f.data), CHUNK)
    elif how == "a chunk size that is no int":
        f.classes[CLS] = (None, memoryview(f.data), float(CHUNK), 4)
    elif how == "undecodable bytes":
        f.layouts[LID] = (b"", None, 24, lambda buf: int("x"))  # ValueError: one of UNDECODABLE
    return key


BROKEN = ["a bool key", "an int subclass", "a negative key", "a key past the table", "a key past 64 bits",
          "another epoch", "spilled", "a str key's entry", "not ready", "another key word",
          "a class not mapped here", "a layout not mapped here", "a chunk not handed out",
          "a length short of the layout", "a length past the chunk", "a class record past its segment",
          "a class record that is no tuple of 4", "a chunk size that is no int", "undecodable bytes"]


@native
@pytest.mark.parametrize("how", BROKEN)
def test_anything_but_the_hot_paths_case_goes_the_long_way_uncounted(forged, how):
    key = _break(forged, how)
    assert forged.hits.get(key) is hit.LONG_WAY
    assert forged.counted == 0


@native
def test_a_decoder_that_fails_otherwise_raises_through_and_counts_nothing(forged):
    def decode(buf):
        raise KeyboardInterrupt

    forged.layouts[LID] = (b"", None, 24, decode)
    with pytest.raises(KeyboardInterrupt):
        forged.hits.get(7)
    assert forged.counted == 0


@native
def test_a_target_counts_into_the_list_and_its_meta_word(forged):
    forged.hits.target(forged.counters, 8 * 5)
    for _ in range(3):
        assert forged.hits.get(7) == RECORD
    assert forged.counters == [3, 0, 0, 0] and int(forged.meta[5]) == 3 and forged.counted == 0
    forged.counters[0] = 1 << 62  # garbage: the view's count restarts it at 0, not this
    assert forged.hits.get(7) == RECORD and forged.counted == 1
    forged.hits.target(None, -1)  # no slot: counted by the view's count again
    forged.counters[0] = 0
    assert forged.hits.get(7) == RECORD and forged.counted == 2 and forged.counters[0] == 0


@native
def test_a_target_set_before_a_fork_is_not_the_childs(forged):
    """A forked child counts by the view's count (which takes the child's own slot), never into
    the parent's row."""
    forged.hits.target(forged.counters, 8 * 5)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, exit without pytest's teardown
        try:
            forged.hits.get(7)
            os.write(w, f"{forged.counted} {forged.counters[0]} {int(forged.meta[5])}".encode())
        finally:
            os._exit(0)
    os.close(w)
    got = os.read(r, 100).decode()
    os.close(r)
    os.waitpid(pid, 0)
    assert got == "1 0 0"
    assert forged.hits.get(7) == RECORD and forged.counters[0] == 1  # the parent's target holds


@native
def test_a_reader_and_a_view_that_hold_each_other_are_collected():
    """The view holds its reader, the reader the view's count: a cycle the collector must free
    (a cache dropped without close() would otherwise keep its mappings)."""

    class View:
        pass

    f = Forged()
    view = View()
    view.hits = hit.reader(f.root, EPOCH, f.table, CAP, f.meta, f.classes, f.layouts, UNDECODABLE,
                           view.__repr__)  # a bound method: holds the view
    gone = weakref.ref(view)
    del view
    gc.collect()
    assert gone() is None


def _args(**change) -> tuple:
    f = Forged()
    kw = dict(root=f.root, epoch_at=RootLayout.EPOCH, table=f.table, entries_at=TABLE_OFF, entry_bytes=ENTRY_BYTES,
              capacity=CAP)
    kw.update(change)
    return (kw["root"], kw["epoch_at"], EPOCH, kw["table"], kw["entries_at"], kw["entry_bytes"], kw["capacity"],
            DATA_OFF, READY | INT_KEY | SPILLED, READY | INT_KEY, 8, 0xFFFFFF, 32, 48, (1 << 48) - 1, f.classes,
            f.layouts, UNDECODABLE, hit.LONG_WAY, hit.ABSENT, f.meta, f.count)


@native
@pytest.mark.parametrize(("change", "error", "match"), [
    ({"epoch_at": 4}, ValueError, "epoch word"),
    ({"epoch_at": 4096}, ValueError, "epoch word"),
    ({"capacity": CAP + 1}, ValueError, "do not fit a table"),
    ({"entry_bytes": 16}, ValueError, "do not fit a table"),
    ({"table": np.zeros(40, np.uint8)[1:33]}, ValueError, "do not fit a table"),
    ({"root": "root"}, TypeError, "bytes-like"),
])
def test_bad_arguments_are_refused_by_name(change, error, match):
    from shmcache.cache import _hit

    with pytest.raises(error, match=match):
        _hit.Hits(*_args(**change))


@native
def test_a_target_outside_the_meta_segment_is_refused(forged):
    with pytest.raises(ValueError, match="not an aligned word"):
        forged.hits.target(forged.counters, 8 * 64)
    with pytest.raises(ValueError, match="not an aligned word"):
        forged.hits.target(forged.counters, 3)
    with pytest.raises(TypeError, match="must be a list"):
        forged.hits.target((0,), 8)


@native
@pytest.mark.parametrize("meta", ["a read-only mapping", "bytes"])
def test_a_meta_segment_that_cannot_be_written_is_refused(meta):
    """Each hit is written into the meta segment: a buffer that cannot be written there is refused
    by name when the reader is made, never written (a read-only mapping faulted at the first hit,
    SIGSEGV; bytes were changed in place)."""
    f = Forged()
    buf = mmap.mmap(-1, 512, prot=mmap.PROT_READ) if meta == "a read-only mapping" else bytes(512)
    with pytest.raises(TypeError, match="meta segment must be a writable buffer"):
        hit.reader(f.root, EPOCH, f.table, CAP, buf, f.classes, f.layouts, UNDECODABLE, f.count)


# --- through a real cache, both ways ------------------------------------------------------------


def _values():
    yield np.arange(12, dtype=np.float32).reshape(3, 4)
    yield (np.full((4, 4), 3, np.uint8), 7, "label")
    yield {"img": np.ones((2, 2), np.int64), "y": 2.5, "tags": ["a", "b"]}
    yield 12345
    yield None


@pytest.mark.usefixtures("hit_path")
def test_a_cache_gives_the_same_values_and_counts_both_ways():
    s = CacheStore("hit", "both", capacity_bytes=8 << 20)
    try:
        values = list(_values())
        for i, v in enumerate(values):
            assert s.put(i, v)
        for _ in range(3):
            for i, v in enumerate(values):
                got = s.lookup(i)
                assert repr(got) == repr(v) and type(got) is type(v)
            assert s.lookup(len(values)) is MISSING  # EMPTY at its own position
            assert s.lookup(10**6) is MISSING  # past the table: probed
            got, missing = s.lookup_batch(list(range(len(values) + 3)) + [10**6])  # probed, then read
            assert [repr(g) for g in got[:len(values)]] == [repr(v) for v in values]
            assert missing == [len(values), len(values) + 1, len(values) + 2, len(values) + 3]
        got = s.lookup(0)
        got[0, 0] = -1  # a copy of its own
        assert s.lookup(0)[0, 0] == 0
        stats = s.stats()
        assert (stats["hits"], stats["misses"]) == (3 * 2 * len(values) + 2, 6 + 3 * 4)
    finally:
        s.destroy()
        s.close()


@pytest.mark.usefixtures("hit_path")
def test_a_clear_and_a_table_growth_under_a_warm_reader_give_right_values():
    w = CacheStore("hit", "grow", capacity_bytes=32 << 20)
    r = CacheStore("hit", "grow", create=False)
    try:
        assert w.put(3, "three") and r.lookup(3) == "three"
        for i in range(4000):  # the table doubles a few times: each a new epoch
            w.put(10 + i, i)
        assert r.lookup(3) == "three" and r.lookup(3999 + 10) == 3999
        w.clear()
        assert r.lookup(3) is MISSING
        assert w.put(3, "again") and r.lookup(3) == "again"
        assert r.stats()["hits"] == 1  # counted per generation: the one since the clear
    finally:
        r.close()
        w.destroy()
        w.close()


# --- the C under the sanitizers, the switch, the build ------------------------------------------

_SANITIZED = """
import importlib.util, sys
import numpy as np
sys.path.insert(0, sys.argv[2])
spec = importlib.util.spec_from_file_location("shmcache.cache._hit", sys.argv[1])
rc = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rc)
import shmcache.cache.hit as hit
hit._hit = rc
import test_hit as t
for how in t.BROKEN:
    f = t.Forged()
    f.hits = hit.reader(f.root, t.EPOCH, f.table, t.CAP, f.meta, f.classes, f.layouts, t.UNDECODABLE, f.count)
    key = t._break(f, how)
    assert f.hits.get(key) is hit.LONG_WAY, how
f = t.Forged()
f.hits = hit.reader(f.root, t.EPOCH, f.table, t.CAP, f.meta, f.classes, f.layouts, t.UNDECODABLE, f.count)
f.hits.target(f.counters, 8 * 63)
for key in (7, 6, 0, t.CAP - 1, 2**63 - 1, -2**63):
    f.hits.get(key)
assert f.counters[0] == 1 and int(f.meta[63]) == 1
for args in ((4,), (4096,)):
    try:
        rc.Hits(*t._args(epoch_at=args[0]))
    except ValueError:
        pass
print("clean")
"""


def test_the_c_is_clean_under_address_and_undefined_behaviour_sanitizers(sanitized):
    done = sanitized(Path(hit.__file__).with_name("_hit.c"), _SANITIZED, str(Path(__file__).parent))
    assert done.returncode == 0 and done.stdout == "clean\n", done.stderr[-3000:]


def test_shmcache_native_0_turns_it_off_and_says_how_to_turn_it_on(compiled_part):
    compiled_part.turned_off_by_env("from shmcache.cache import hit; print(hit.NATIVE); "
                                    "print(hit.unavailable_reason())", '"single_hit": "python: ')


def test_ci_builds_it_where_a_compiler_and_pythons_headers_are_present(compiled_part):
    """As the row copy (test_rowcopy, whose unbuilt-install tests run this file too): a failed
    build would quietly leave every hit on the Python path."""
    compiled_part.built_where_it_can(hit.NATIVE, hit.unavailable_reason(), "the compiled hit was not built",
                                     "the install runs the Python hot path")


def test_a_hit_counted_after_its_cache_was_closed_says_closed():
    """A lookup that passed its checks as another thread closed the cache counts after the close:
    that is the close's error (InvalidArgument: open it again), never an AttributeError of the
    view's innards (seen racing close() against hits in threads, both paths: both count through
    ``count``, the compiled one when it has no target)."""
    s = CacheStore("hit", "closed", capacity_bytes=8 << 20)
    try:
        assert s.put(1, "one") and s.lookup(1) == "one"
        view = s.view
        view.close()
        with pytest.raises(InvalidArgument, match="was closed in this process"):
            view.count(HITS)
    finally:
        s.close()
        CacheStore("hit", "closed", create=False).destroy()
