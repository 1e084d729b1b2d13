"""Memory admission: how much shared memory one cache may take, and whether there is room now
(NOTE [memory limits], below).

``Admission`` is one handle's policy: the cap (``capacity_bytes``, the root's CAPACITY word), the
session's automatic cap and its raising (``raise_auto_cap``), the per-process budget of the
session's auto-sized caches (``_SESSION_BUDGETS``), the index's reserve when spilling, and the
commit of a size class's chunks within all of that (``commit``). The store asks it where a record
or a segment would grow and gets ``NoRoom`` when there is none; what it then does with the record
(spill it, reject it) is the store's.

NOTE [memory limits]
    What a cache may take of shared memory is checked where it grows: at each commit step of a
    data segment (``Admission.commit``: 64 KiB or one chunk at a time, so the checks below are rare).

    * ``size=`` (MiB) given: the cache's own cap (RootLayout.CAPACITY); meta, index and data count.
    * ``size=0``: the *session's* automatic cap - 80% of what is really available (MemAvailable,
      the process's cgroup, /dev/shm's free space - or that of the session's memory directory,
      as for every check here: SessionRegistry.memory_root; ``memory_limits``) when the session's
      first auto-sized cache is made, kept in the session's ``auto_capacity`` file
      (SessionRegistry.auto_capacity) so caches made later share it rather than each taking 80%
      of what is left. An auto-sized cache checks what all segments of the session really
      occupy in /dev/shm (st_blocks, as ``shmcache ls`` counts) against it, again each time its
      process has committed 1/16 of what was left at the last look (so the checks grow frequent
      as the session fills) or 50 ms have passed: together they stay within it, give or take
      what more than 16 processes committing within the same 50 ms could add, and an index
      growth (a few bytes per item), which is not checked.
      Caches with their own size= are counted in that sum but keep their own caps.
      The cap was measured once; memory short at that moment must not shrink the session for
      good: an auto-sized cache that finds no room asks again (at most once a second per handle,
      Admission.raise_auto_cap) and raises the session's cap - the file, then its root's CAPACITY
      and SIZING words - to 80% of what is available now plus what the session holds, if that is
      1/8 more. Its data segments are sized for all of /dev/shm (sparse), so a raised cap can be
      committed (Admission.data_segment_bytes).
    * Pages backed ahead (``commit_ahead``, ``base.ahead``): after a run (a cold batch), the
      chunks the next run of its class will commit are reserved and backed on a thread of their
      own while the next batch is computed. Reserved chunks count in the committed total at once
      (the class record's ``reserved`` word), so the cap holds whichever class or process commits
      next, and that class's next commit takes them without asking for room. Only what
      ``commit`` would now give without asking anyone: within the cap, within the process's
      allowance of an auto-sized session, never while spilling or while memory was found full.
      A run that never comes leaves them counted (at most one run's chunks a class; gc's
      recount keeps them), and their pages go with the segment.
    * Memory full at creation (the automatic cap below one page of data): the cache is made with
      no room for data (RootLayout.SIZING = AUTO_NONE), every item is rejected or spilled, and
      that is said once (log_no_memory). If not even the cache's own segments fit, CacheStore
      raises SharedMemoryFull,
      having removed what it made; ShmDatasetCache then serves from an UncachedStore (computes
      from the source, counts the rejections in the process).
    * Spilling on: spilled records are found through the index, which lives in shared memory and
      doubles as it fills (the old and the new table coexist during a growth). So data admission
      into memory stops early enough to leave a reserve - 1/16 of the cap or of /dev/shm,
      whichever is smaller, at least 1 MiB (at most a quarter), at most 256 MiB - free both under
      the cap and in /dev/shm. A reserve of R bytes lets the index double until a new table no
      longer fits beside the old one: about 11,000 spilled items per MiB of reserve (a 64 MiB
      /dev/shm keeps 4 MiB: ~45,000 spilled items; a cache of 4 GiB or more keeps 256 MiB: ~2.9
      million; more when the index was already large when memory filled). Beyond that, and when
      others fill /dev/shm meanwhile, new items are rejected (counted, said once). ``wrap()`` of a
      map-style dataset sizes the index for all its items up front (within half the cap): it
      never grows.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import time
from pathlib import Path

from ..base import memdir, ordering
from ..base.memory import memory_limits
from ..base.procs import parent_pid, started
from ..base.shm import PAGE, WORD, Segment
from ..errors import ItemTooLarge, SharedMemoryFull
from .allocator import DATA_OFF, commit_step_chunks
from .generation import AUTO, AUTO_NONE, SIZED, Generation, MetaLayout, RootLayout, split_epoch
from .index import MAX_RECORD, TableView
from .indexed_tier import IndexedTier
from .registry import SessionRegistry

__all__ = ["Admission", "NoRoom", "MIN_CAPACITY", "initial_capacity", "log_no_memory", "index_reserve"]

log = logging.getLogger("shmcache")

MIN_CAPACITY = MetaLayout.SIZE + PAGE  # a cap below this holds nothing


# The most commit_ahead reserves of a class past its committed chunks: a DataLoader batch's run (64
# rows of 24 KB: 1.6 MB), not an import's batch of thousands whose next may never come
AHEAD_BYTES = 8 << 20


class NoRoom(Exception):
    """The cache (or /dev/shm) has no room for this record (internal: the store spills or rejects)."""


# (namespace, session, pid) -> [bytes this process may still commit, until when] before the
# session's caches are summed again (Admission.commit, NOTE [memory limits]). Per process, not
# per handle: two caches of one process that each trusted their own look would each take the
# same room. The pid keeps a forked child from trusting its parent's allowance.
_SESSION_BUDGETS: dict[tuple[str, str, int], list] = {}


def initial_capacity(registry: SessionRegistry, session: str, capacity_bytes: int) -> tuple[int, int]:
    """``(sizing, cap)`` of a cache being made: ``size=`` as given (SIZED), else the session's
    automatic cap (AUTO; AUTO_NONE with the smallest cap when memory is full now)."""
    if capacity_bytes:
        return SIZED, capacity_bytes
    root = registry.memory_root(session)
    capacity = registry.auto_capacity(session, lambda: memory_limits(shm_root=root).auto_capacity(), MIN_CAPACITY)
    if capacity < MIN_CAPACITY:  # memory is full now: a cache that holds nothing in memory
        return AUTO_NONE, MIN_CAPACITY
    return AUTO, capacity


def log_no_memory(session: str, name: str, root: str = "/dev/shm") -> None:
    """Say that a cache made while memory is full (AUTO_NONE) gets no memory, and what to do
    (``root``: where the session's memory lives, SessionRegistry.memory_root)."""
    lim = memory_limits(shm_root=root)
    log.warning(
        "cache %s/%s gets no memory: the automatic cap (size=0) is 80%% of what is free, and "
        "%s has %.1f MiB free of %.1f MiB (MemAvailable %.0f MiB, cgroup %s); its items go to "
        "disk if spilling is on, else are computed from the source, not cached. "
        "Free %s (`shmcache gc`, `shmcache destroy`), or in Docker raise --shm-size",
        session, name, root, (lim.shm_free or 0) / 2**20, (lim.shm_total or 0) / 2**20,
        (lim.mem_available or 0) / 2**20,
        f"{lim.cgroup_free / 2**20:.0f} MiB free" if lim.cgroup_limit else "no limit", root)


class Admission:
    """What one handle of a cache may commit of shared memory (NOTE [memory limits]). The caller
    holds the cache's lock for everything but the reads of the cap; ``spill`` is the store's spill
    tier (None when not spilling): whether it accepts decides the index's reserve."""

    def __init__(self, root: Segment, registry: SessionRegistry, session: str, name: str):
        self._root = root
        self.registry = registry
        self.session, self.name = session, name
        self.shm_root = registry.memory_root(session)  # /dev/shm, or the session's memory directory
        self.capacity_bytes = WORD.unpack_from(root.buf, RootLayout.CAPACITY)[0]
        self._shm_full_logged = False
        self._shm_full_until = 0.0  # /dev/shm was full a moment ago: commit refuses until then
        self._auto_retry_at = 0.0  # an auto-sized cache found full asks again then (raise_auto_cap)

    def sizing(self) -> int:
        """How this cache's cap was set: SIZED, AUTO or AUTO_NONE (the root's word)."""
        return WORD.unpack_from(self._root.buf, RootLayout.SIZING)[0]

    def session_shm_bytes(self) -> int:
        """Bytes of shared memory that every cache of this session really occupies (allocated pages)."""
        return self.registry.ns.occupied_bytes(self.registry.segment_prefix(self.session))

    def check_fits(self, nbytes: int, chunk_size: int, table_capacity: int) -> None:
        """A record of ``nbytes`` (a chunk of ``chunk_size``) could fit in the empty cache beside an
        index of ``table_capacity`` entries: else ItemTooLarge, or NoRoom for an automatic cap on
        a machine short of memory (nothing to fix in size=)."""
        room = self.capacity_bytes - MetaLayout.SIZE - TableView.bytes_for(table_capacity)
        if chunk_size > min(room, MAX_RECORD) and self.raise_auto_cap():
            room = self.capacity_bytes - MetaLayout.SIZE - TableView.bytes_for(table_capacity)
        if chunk_size > min(room, MAX_RECORD):  # would not fit even in the empty cache
            if self.sizing() != SIZED and chunk_size <= MAX_RECORD:
                raise NoRoom  # size=0 on a machine short of memory: nothing to fix in size=
            need = (chunk_size + MetaLayout.SIZE + TableView.bytes_for(table_capacity)) / 2**20
            raise ItemTooLarge(
                f"an item of {nbytes / 2**20:.2f} MiB can never fit in cache {self.session}/"
                f"{self.name} of {self.capacity_bytes / 2**20:.2f} MiB (its index takes "
                f"{(self.capacity_bytes - room) / 2**20:.2f} MiB); give it size= (MiB) of at least "
                f"{int(need) + 1}, or store smaller samples"
            )

    def data_segment_bytes(self) -> int:
        """The virtual size of a new data segment's chunks: size=0's cap may rise later
        (raise_auto_cap), so the segment is sized for all of /dev/shm (sparse: address space
        only); size= is a cap for good."""
        shm_total = memory_limits(shm_root=self.shm_root).shm_total or self.capacity_bytes
        return min(self.capacity_bytes, shm_total) if self.sizing() == SIZED else shm_total

    def commit(self, gen: Generation, cls: int, seg: Segment, chunk_size: int, committed: int,
               spill: IndexedTier | None, fence: bool = True, chunks: int = 1) -> int:
        """Commit more chunks of class ``cls`` within the cap; raise NoRoom when there is no room
        (NOTE [memory limits]: the session's automatic cap, and the index's reserve when spilling).
        ``fence=False``: a chunk of put_records, whose fence A comes before it moves the bump
        (NOTE [publish order], "A publish group"). ``chunks``: commit at least that many in this
        step where there is room (a run of a group's records: one fallocate for all of them); the
        caller asks again while it has fewer."""
        if time.monotonic() < self._shm_full_until:
            raise NoRoom  # /dev/shm was full a moment ago: don't ask the kernel on every miss
        # never past the segment's virtual size, whatever the word says
        reserved = min(gen.classes.reserved(cls), (seg.size - DATA_OFF) // chunk_size) - committed
        if reserved > 0:  # asked ahead (commit_ahead): in the committed total already, no room to ask
            return self._back_and_commit(gen, cls, seg, chunk_size, committed, spill, fence,
                                         min(max(commit_step_chunks(chunk_size), chunks), reserved))
        meta = gen.meta.buf
        used = WORD.unpack_from(meta, MetaLayout.COMMITTED)[0]
        step = commit_step_chunks(chunk_size)
        keep = shm_free = 0
        step = max(step, chunks)  # a run's chunks in one step where there is room
        if spill is not None and spill.accepting:  # one statvfs, when spilling only
            shm_total, shm_free = _shm_space(self.shm_root)
            keep = index_reserve(min(self.capacity_bytes, shm_total or self.capacity_bytes))
        room = (self.capacity_bytes - keep - used) // chunk_size
        auto = self.sizing() == AUTO
        if auto:  # one allowance per process and session, shared by all its caches there
            budget = _SESSION_BUDGETS.setdefault((str(self.registry.ns.root), self.session, os.getpid()),
                                                 [0, 0.0])
        if room >= 1 and auto and (budget[0] < min(step, room) * chunk_size or time.monotonic() > budget[1]):
            # the session's caches together: what they occupy is summed again once this process
            # has committed 1/16 of what was left at the last look, or 50 ms later (NOTE [memory
            # limits])
            session_bytes = self.session_shm_bytes()
            left = self.capacity_bytes - keep - session_bytes
            room = min(room, left // chunk_size)
            budget[:] = max(0, left // 16), time.monotonic() + 0.05
            if room < 1:
                self._shm_full_until = time.monotonic() + 1.0  # don't list /dev/shm on every miss
                self.log_memory_full(
                    f"the caches of session {self.session} hold {session_bytes / 2**20:.1f} MiB of "
                    f"shared memory, their automatic cap (size=0) is {self.capacity_bytes / 2**20:.1f} "
                    f"MiB for all of them together", spill)
        if room >= 1 and keep:  # /dev/shm keeps room for the index of what goes to disk
            room = min(room, (shm_free - keep) // chunk_size)
            if room < 1:
                self._shm_full_until = time.monotonic() + 1.0
        # never past the segment's virtual size (made for the cap of its time: a cap that rose)
        room = min(room, (seg.size - DATA_OFF) // chunk_size - committed)
        if room < 1 and self.raise_auto_cap():
            self._shm_full_until = 0.0
            return self.commit(gen, cls, seg, chunk_size, committed, spill, fence, chunks)
        if room < 1:
            if keep:
                self.log_memory_full(f"memory is full ({used / 2**20:.1f} MiB committed; "
                                     f"{keep / 2**20:.1f} MiB of shared memory kept for the index "
                                     f"of spilled items)", spill)
            elif self.sizing() == SIZED:  # a filled cap is said too, naming it and the fix
                self.log_memory_full(f"its cap is full (size={self.capacity_bytes / 2**20:g} MiB, "
                                     f"{used / 2**20:.1f} MiB of records committed)", spill,
                                     fix="give it a larger size= (MiB)")
            else:
                self.log_memory_full(f"its automatic cap (size=0) of {self.capacity_bytes / 2**20:.1f} "
                                     f"MiB is full", spill)
            raise NoRoom
        step = self._back_and_commit(gen, cls, seg, chunk_size, committed, spill, fence,
                                     min(step, room)) - committed  # fewer where the memory is short
        gen.meta.words[MetaLayout.COMMITTED >> 3] = used + step * chunk_size
        if auto:
            budget[0] = max(0, budget[0] - step * chunk_size)
        return committed + step

    def _back_and_commit(self, gen: Generation, cls: int, seg: Segment, chunk_size: int, committed: int,
                         spill: IndexedTier | None, fence: bool, step: int) -> int:
        """``step`` chunks past ``committed`` backed (nothing to do where this process's thread
        backed them already) and committed; the committed total is the caller's (``commit_ahead``
        counted reserved chunks in it already). Fewer where the memory has no room for all of
        them (a run of a group's records: what fits of it, the caller asks again for the rest); a
        refused fallocate on hugetlbfs keeps the pages it took, which a smaller step then uses."""
        while True:
            try:
                seg.commit(DATA_OFF + committed * chunk_size, step * chunk_size)
                break
            except SharedMemoryFull as exc:
                if step > 1:
                    step //= 2
                    continue
                self.log_shm_full(exc, spill)
                raise NoRoom from None
        gen.classes.set_committed(cls, committed + step)
        if fence:
            ordering.fence()  # the committed count before the bump that relies on it (ClassTable.get)
        return committed + step

    def commit_ahead(self, gen: Generation, cls: int, seg: Segment, chunk_size: int, chunks: int,
                     spill: IndexedTier | None) -> None:
        """Reserve the ``chunks`` chunks of class ``cls`` past its committed ones for the next
        run's ``commit`` and have their pages backed on a thread of their own meanwhile
        (``Segment.commit_ahead``): a cold epoch's next batch, computed while they are backed.
        Reserved chunks count in the committed total at once (``ClassTable.reserved``), so the
        cap holds whichever class or process commits next; only what ``commit`` would now give
        without asking anyone: within the cap, within this process's allowance when auto-sized,
        never while spilling (/dev/shm keeps room for the index) or while memory was found full.
        Caller holds the lock."""
        if time.monotonic() < self._shm_full_until or (spill is not None and spill.accepting):
            return
        _, _, committed = gen.classes.get(cls)
        seg_chunks = (seg.size - DATA_OFF) // chunk_size
        have = max(committed, min(gen.classes.reserved(cls), seg_chunks))
        used = WORD.unpack_from(gen.meta.buf, MetaLayout.COMMITTED)[0]
        room = min((self.capacity_bytes - used) // chunk_size, seg_chunks - have)
        auto = self.sizing() != SIZED
        if auto:  # the session's allowance for this process, while it holds
            budget = _SESSION_BUDGETS.get((str(self.registry.ns.root), self.session, os.getpid()))
            room = min(room, budget[0] // chunk_size) if budget and time.monotonic() <= budget[1] else 0
        chunks = min(chunks, max(1, AHEAD_BYTES // chunk_size))  # an import's batch: not all of it again
        n = min(committed + chunks - have, room)  # the next run's chunks not reserved yet
        if n > 0:  # the total first: a writer killed between the two leaves it too high (room lost
            # until a recount), never too low (the cap passed)
            gen.meta.words[MetaLayout.COMMITTED >> 3] = used + n * chunk_size
            gen.classes.set_reserved(cls, have + n)
            if auto:
                budget[0] -= n * chunk_size
            have += n
        if have > committed:
            seg.commit_ahead(DATA_OFF + committed * chunk_size, (have - committed) * chunk_size)

    def raise_auto_cap(self) -> bool:
        """An auto-sized cache (size=0) has no room: if the session's cap was set while memory was
        short and memory is free now, raise it (NOTE [memory limits]); True if it rose. Asked at
        most once a second per handle; caller holds the lock."""
        if self.sizing() == SIZED or time.monotonic() < self._auto_retry_at:
            return False
        self._auto_retry_at = time.monotonic() + 1.0
        cap = WORD.unpack_from(self._root.buf, RootLayout.CAPACITY)[0]  # raised by another process already?
        if cap <= self.capacity_bytes:
            now = memory_limits(shm_root=self.shm_root).auto_capacity(self.session_shm_bytes())
            if now <= self.capacity_bytes + self.capacity_bytes // 8:  # the cap as measured, give or
                return False  # take what the session's own metadata and rounding make: kept
            cap = self.registry.raise_auto_capacity(self.session, now)
            self._root.words[RootLayout.CAPACITY >> 3] = cap
            ordering.fence()
            self._root.words[RootLayout.SIZING >> 3] = AUTO  # after the cap: AUTO_NONE no more
        log.info("cache %s/%s: memory is free again; the automatic cap rises from %.1f to %.1f MiB",
                 self.session, self.name, self.capacity_bytes / 2**20, cap / 2**20)
        self.capacity_bytes = cap
        _SESSION_BUDGETS.pop((str(self.registry.ns.root), self.session, os.getpid()), None)  # sum it again
        self._shm_full_logged = False
        return True

    def log_shm_full(self, exc: Exception, spill: IndexedTier | None) -> None:
        """/dev/shm refused a segment or a commit: refuse without asking for a second, say it once."""
        self._shm_full_until = time.monotonic() + 1.0
        self.log_memory_full(str(exc), spill)

    def log_memory_full(self, why: str, spill: IndexedTier | None, fix: str = "") -> None:
        """Say once that memory is full, what happens to new items now, and ``fix`` if any: once
        per cache, generation, cap, spilling and job, not once per process (RootLayout.SAID_FULL: a
        job of 8 ranks with 8 DataLoader workers each said it 64 times)."""
        if self._shm_full_logged:
            return
        self._shm_full_logged = True
        gen = split_epoch(WORD.unpack_from(self._root.buf, RootLayout.EPOCH)[0])[0]
        spilling = spill is not None and spill.accepting
        if not self.first_to_say(RootLayout.SAID_FULL, f"{gen}:{self.capacity_bytes}:{spilling}"):
            return  # another process of this job said it
        if spilling:
            then = f"new items go to disk (spill files in {spill.where})"
        else:
            then = ("new items are served from the source, not cached, and counted as rejected; "
                    f"{fix + ', or ' if fix else ''}spilling=True would keep them on disk")
        log.warning("cache %s/%s stops growing in memory: %s; %s", self.session, self.name, why, then)

    def first_to_say(self, word: int, notice: str) -> bool:
        """Whether this process is the first of its job to say ``notice`` about this cache (root
        word ``word``: RootLayout.SAID_FULL, root.NOTICE_WORDS), marking it said. The job is in the
        mark: the session and its cache outlive the job, and a later job must be told again; a
        stable digest, as str's hash differs from process to process. A hint, never a lock."""
        said = f"{notice}:{_job()}".encode()
        mark = int.from_bytes(hashlib.blake2b(said, digest_size=8).digest(), "little") | 1
        if WORD.unpack_from(self._root.buf, word)[0] == mark:
            return False
        self._root.words[word >> 3] = mark
        return True


def _job() -> str:
    """Who counts as one job for a log line said once (Admission.first_to_say). Under a launcher
    (ours, torchrun: $TORCHELASTIC_RUN_ID set) each rank leads a session of its own, its
    DataLoader workers in it, and the session leader's parent is that launch's launcher (torchrun's
    agent): the run id and that process - a run id alone is a name the user may fix for every
    launch (--rdzv-id 456, torchrun's static "none"). Else a script: this process, or the one
    whose multiprocessing children this is, however deep (a DataLoader worker of a rank that
    torch.multiprocessing.spawn started) - each run told again, whatever shell, Makefile or sweep
    driver runs it (they share one process group)."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id:
        # the session's leader, not the process group's: a group a worker makes stays in the session
        return f"run {run_id} launcher {started(parent_pid(os.getsid(0)))}"
    parent = multiprocessing.parent_process()
    return f"process {started(_script_of(parent.pid) if parent is not None else os.getpid())}"


def _script_of(pid: int) -> int:
    """The script's process above multiprocessing child ``pid``: up from ``pid`` while it is a
    multiprocessing child itself (its parent, multiprocessing.parent_process, is known only to
    ``pid``: /proc tells the rest, by its command line)."""
    for _ in range(16):  # a bound, never reached: no tree of processes is that deep
        parent = parent_pid(pid)
        if parent is None or parent <= 1 or not _multiprocessing_child(pid, parent):
            return pid
        pid = parent
    return pid


def _multiprocessing_child(pid: int, parent: int) -> bool:
    """Whether process ``pid`` was started by multiprocessing in ``parent``: spawned (its command
    line says so), forked by the forkserver (which is the forkserver's own, the forkserver itself
    a child so spawned), or forked (the parent's command line, as a DataLoader worker's)."""
    try:
        mine = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"--multiprocessing-fork" in mine or b"from multiprocessing.forkserver import main" in mine:
            return True
        return mine == Path(f"/proc/{parent}/cmdline").read_bytes()
    except OSError:
        return False


def _shm_space(root: str) -> tuple[int, int]:
    """``(total, free)`` bytes of /dev/shm or a memory directory (one statvfs)."""
    try:
        return memdir.space(root)
    except OSError:
        return 0, 0


def index_reserve(limit: int) -> int:
    """Shared memory a spilling cache of ``limit`` bytes (its cap, or /dev/shm if smaller) leaves
    free for its index: 1/16 of it, at least 1 MiB (at most a quarter), at most 256 MiB
    (NOTE [memory limits])."""
    return min(max(limit // 16, 1 << 20), limit // 4, 256 << 20)
