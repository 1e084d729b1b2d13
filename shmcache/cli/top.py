"""``shmcache top``: a live view of the node's caches, refreshed every second (``--interval``):
per cache its items, hit ratio (since it was made), hits/s, misses/s, MB/s (hits/s times the
average item size: an estimate, no counter of bytes served exists), tier reads/s (hits of the
remote and snapshot tiers) and the stall share of its busiest rank; then per rank of each cache
the share of the last interval its training loop spent waiting for batches (a wait still running
counts: NOTE [stall counts]), the share since the start, and batches/s. Keys: h, m, b, i, n, s
sort by hits/s, misses/s, MB/s, items, name, stall; q quits. ``--once`` prints one frame (two
readings ``--interval`` apart) to stdout and exits.

Reading costs the job nothing it can feel: each refresh reads a few files and counter rows, with
no lock, no slot and no use hold (``node_stats``)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from ..cache import stall
from ..cache.registry import SessionRegistry
from ..tiers.node_stats import node_rows

__all__ = ["Sampler", "frame", "run_live", "SORTS"]

# key -> (what the header says, the sort key of a cache line)
SORTS = {
    "h": ("hits/s", lambda c: -c.hits_s), "m": ("misses/s", lambda c: -c.misses_s),
    "b": ("MB/s", lambda c: -c.mb_s), "i": ("items", lambda c: -c.items),
    "n": ("name", lambda c: (c.session, c.name)), "s": ("stall", lambda c: -c.stall),
}


@dataclass
class RankLine:
    rank: int
    share: float  # of the last interval
    share_all: float  # since the start
    batches_s: float
    waiting_s: float  # how long its current wait has run (0: not waiting)


@dataclass
class CacheLine:
    session: str
    name: str
    items: int = 0
    hit_ratio: float = 0.0
    hits_s: float = 0.0
    misses_s: float = 0.0
    mb_s: float = 0.0
    tier_s: float = 0.0
    stall: float = 0.0  # the largest share of its ranks over the last interval
    error: str = ""
    ranks: list[RankLine] = field(default_factory=list)


def _tier_hits(st: dict) -> int:
    return st.get("remote_hits", 0) + st.get("snapshot_hits", 0)


class Sampler:
    """Readings of the node's caches; ``lines()`` compares the latest with the one before."""

    def __init__(self, registry: SessionRegistry, session: str | None = None):
        self.registry, self.session = registry, session
        self._prev: dict | None = None
        self._prev_t = 0.0
        self._prev_ns = 0

    def _read(self) -> dict:
        out = {}
        for st in node_rows(self.registry, self.session):
            ranks = {}
            if "error" not in st:
                path = stall.stall_path(self.registry.cache_meta_path(st["session"], st["name"]))
                ranks = stall.read_ranks(path)
            out[(st["session"], st["name"])] = (st, ranks)
        return out

    def lines(self) -> list[CacheLine]:
        now_t = time.monotonic()
        now_ns = time.monotonic_ns()
        cur = self._read()
        prev, dt = self._prev or {}, max(now_t - self._prev_t, 1e-9) if self._prev else 0.0
        self._prev, self._prev_t = cur, now_t
        out = []
        for key, (st, ranks) in cur.items():
            line = CacheLine(*key)
            if "error" in st:
                line.error = st["error"]
                out.append(line)
                continue
            line.items = st["items_mem"] + st["items_disk"]
            looked = st["hits"] + st["misses"]
            line.hit_ratio = st["hits"] / looked if looked else 0.0
            old, old_ranks = prev.get(key, (None, {}))
            if old is not None and "error" not in old and dt:
                line.hits_s = max(0, st["hits"] - old["hits"]) / dt
                line.misses_s = max(0, st["misses"] - old["misses"]) / dt
                line.mb_s = line.hits_s * st["avg_item_bytes"] / 1e6
                line.tier_s = max(0, _tier_hits(st) - _tier_hits(old)) / dt
            for rank, r in ranks.items():
                running = now_ns - r["waiting_since"] if r["waiting_since"] else 0
                share = batches = 0.0
                o = old_ranks.get(rank)
                if o is not None and dt:
                    o_running = (self._prev_ns - o["waiting_since"]) if o["waiting_since"] else 0
                    waited = (r["stall_ns"] + running) - (o["stall_ns"] + o_running)
                    share = min(1.0, max(0.0, waited / (dt * 1e9)))
                    batches = max(0, r["waits"] - o["waits"]) / dt
                share_all = r["stall_ns"] / r["loop_ns"] if r["loop_ns"] else 0.0
                line.ranks.append(RankLine(rank, share, share_all, batches, running / 1e9))
            line.stall = max((r.share for r in line.ranks), default=0.0)
            out.append(line)
        self._prev_ns = now_ns
        return out


def _table(headers: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < 2 else c.rjust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return [fmt(headers), *map(fmt, rows)]


def frame(lines: list[CacheLine], sort: str, interval: float) -> list[str]:
    """The text of one frame."""
    label, order = SORTS[sort]
    lines = sorted(lines, key=order)
    head = (f"shmcache top  {time.strftime('%H:%M:%S')}  every {interval:g} s  sorted by {label}  "
            f"(keys: h m b i n s sort, q quits)")
    if not lines:
        return [head, "", "no caches"]
    table = _table(["session", "cache", "items", "hit ratio", "hits/s", "misses/s", "MB/s", "tier reads/s",
                    "stall"],
                   [[c.session, c.name, "error: " + c.error[:50]] + [""] * 6 if c.error else
                    [c.session, c.name, str(c.items), f"{c.hit_ratio:.1%}", f"{c.hits_s:.0f}",
                     f"{c.misses_s:.0f}", f"{c.mb_s:.1f}", f"{c.tier_s:.0f}",
                     f"{c.stall:.0%}" if c.ranks else "-"] for c in lines])
    ranks = [[c.session, c.name, str(r.rank), f"{r.share:.0%}", f"{r.share_all:.0%}", f"{r.batches_s:.1f}",
              f"{r.waiting_s:.1f} s" if r.waiting_s else "-"] for c in lines for r in c.ranks]
    out = [head, "", *table]
    if ranks:
        out += ["", *_table(["session", "cache", "rank", "stall share", "since start", "batches/s",
                             "waiting now"], ranks)]
    return out


def print_once(registry: SessionRegistry, session: str | None, sort: str, interval: float) -> None:
    sampler = Sampler(registry, session)
    sampler.lines()
    time.sleep(interval)
    print("\n".join(frame(sampler.lines(), sort, interval)))


def run_live(registry: SessionRegistry, session: str | None, sort: str, interval: float) -> None:
    """The curses view until q (or ^C)."""
    import curses

    def loop(screen) -> None:
        try:
            curses.curs_set(0)
        except curses.error:  # a terminal without cursor control: the cursor stays
            pass
        screen.timeout(100)  # a key is seen within 0.1 s
        sampler = Sampler(registry, session)
        order, lines, due = sort, sampler.lines(), time.monotonic() + interval
        while True:
            screen.erase()
            height, width = screen.getmaxyx()
            for y, text in enumerate(frame(lines, order, interval)[:height - 1]):
                screen.addnstr(y, 0, text, width - 1)
            screen.refresh()
            while time.monotonic() < due:
                key = screen.getch()
                if key in (ord("q"), ord("Q")):
                    return
                if 0 <= key < 256 and chr(key) in SORTS:
                    order = chr(key)
                    break
            if time.monotonic() >= due:
                lines, due = sampler.lines(), time.monotonic() + interval

    try:
        curses.wrapper(loop)
    except KeyboardInterrupt:
        pass
