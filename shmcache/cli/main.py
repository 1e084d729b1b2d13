"""``shmcache``: inspect and manage sessions and caches (like MindSpore's ``cache_admin``).

Commands::

    shmcache stat [SESSION] [--json | --prometheus]
                                         one row per cache: its dataset (wrap(label=), else its
                                         repr), items and bytes in memory and on disk,
                                         average item size, hits, misses; a snapshot read
                                         through (snapshot=): its hits, misses, bytes, errors;
                                         --prometheus: the text exposition format
    shmcache top [SESSION] [--once] [--interval S] [--sort K]
                                         a live view: per cache hit ratio, hits/s, misses/s, MB/s,
                                         tier reads/s; per rank the share of time waiting for batches
    shmcache ls [--json]                 the sessions, with owner, age, last use, live processes,
                                         memory, the cache opened longest ago
    shmcache new [NAME] [--spill-dir D] [--memory-dir D] [--remote URL]
                                         create a session and print its name (a session has no
                                         size: --size says where a cap goes)
    shmcache destroy NAME [--force] [--cache C]
                                         drop a session and everything in it (or only cache C)
    shmcache gc [--idle-for D] [--json]  reclaim what dead processes left behind; with --idle-for
                                         (90s, 30m, 12h, 1d, 2w), also destroy the sessions
                                         nobody has used for that long; with --cache-idle-for D,
                                         the caches no process has opened for that long
    shmcache info [--json]               limits and configuration
    shmcache export SESSION [CACHE] DEST [--overwrite]
                                         write a cache to a snapshot: a directory, or an fsspec URL
                                         (s3://bucket/prefix, file://, memory://)
    shmcache import SRC [--session S] [--name N] [--force] [--size MB] [--spilling --spill-dir D]
                    [--allow-pickle] [--allow-unsigned] [--timeout-s S]   ($SHMCACHE_SECRET: the job's secret)
                                         fill a cache from a snapshot (it then runs without its
                                         source: cache.wrap(None))

Everything happens in the namespace of ``$SHMCACHE_DIR`` (default: a per-user directory). This
module never imports torch, so it starts fast. Exit codes: 0 success, 1 an error shmcache
explains (and an import that did not store every item, or an export that left out damaged
records: the line printed says which and why), 2 bad usage.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import pwd
import sys
import time
from typing import TYPE_CHECKING

from ..base import ahead, memdir, rowcopy, settings
from ..base.memory import memory_limits
from ..base.namespace import namespace, resolve_session_name
from ..base.settings import ENV_MEMORY_DIR, ENV_REMOTE, ENV_SPILL_DIR
from ..cache import codec, hit, index
from ..cache.registry import SessionRegistry
from ..errors import CacheInUse, CacheNotFound, InvalidArgument, SessionInUse, ShmcacheError

if TYPE_CHECKING:  # the store's module (and numpy) load only for the commands that open a cache
    from ..cache.store import CacheStore

__all__ = ["main"]


def _size(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _age(seconds: float) -> str:
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def _ago(seconds: float | None) -> str:
    return "in use" if seconds is None else f"{_age(seconds)} ago"


_DURATION_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def _duration(text: str) -> float:
    """``90s``, ``30m``, ``12h``, ``1d``, ``2w`` -> seconds (argparse type: a bad one exits 2)."""
    number, unit = text.strip()[:-1], text.strip()[-1:].lower()
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if unit not in _DURATION_UNITS or not number or not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a duration: write a number and a unit, s, m, h, d or w "
            f"(90s, 30m, 12h, 1d, 2w)")
    return value * _DURATION_UNITS[unit]


def _table(headers: list[str], rows: list[list[str]], right: set[int]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    fmt = lambda cells: "  ".join(c.rjust(w) if i in right else c.ljust(w)  # noqa: E731
                                  for i, (c, w) in enumerate(zip(cells, widths))).rstrip()
    return "\n".join([fmt(headers), fmt(["-" * w for w in widths]), *map(fmt, rows)])


def _cache_stats(registry: SessionRegistry, session: str) -> list[dict]:
    from ..tiers.node_stats import cache_rows

    rows = cache_rows(registry, session)
    for st in rows:
        if "error" not in st:
            st.update(_pages(registry, session, st))
    return rows


def _page(n: int) -> str:
    """A page size as its power-of-two unit: 4 KiB, 64 KiB, 2 MiB, 1 GiB."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n >> shift} {unit}"
    return f"{n} B"


HUGE_HELPS_BYTES = 256 << 20  # far beyond what a TLB of base pages reaches (~6 MiB of 4 KiB pages)


def _pages(registry: SessionRegistry, session: str, st: dict) -> dict:
    """What backs a cache's memory (its session's memory directory, or /dev/shm: ``memdir.backing``),
    and whether huge pages would help: random reads of small items across more memory than the
    TLB reaches miss it on nearly every item (``memdir.Backing``)."""
    where = registry.segment_dir(session)
    back = memdir.backing(where)
    helps = back.page_size <= mmap.PAGESIZE and not back.advise and st.get("bytes_mem", 0) >= HUGE_HELPS_BYTES
    return {"memory_dir": registry.get(session).memory_dir or "/dev/shm", "page_size": back.page_size,
            "pages": back.describe(), "huge_pages_would_help": helps}


def _attach_spill(store: CacheStore) -> None:
    """Let stat and gc see spilled items (no-op when the cache never spilled)."""
    from ..tiers.spill.tier import attach_existing

    attach_existing(store)


# --- commands -------------------------------------------------------------------------------------

_CHECK_NAME = "check the name (`shmcache ls` lists the sessions)"


def cmd_stat(args, registry: SessionRegistry) -> int:
    sessions = ([registry.get(args.session, fix=_CHECK_NAME).name] if args.session is not None
                else [s.name for s in registry.list()])
    rows = [st for s in sessions for st in _cache_stats(registry, s)]
    if args.prometheus:  # the text exposition format: node_exporter's textfile collector reads it
        from ..tiers.prometheus import exposition

        sys.stdout.write(exposition(rows))
        return 0
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        where = f"session {args.session!r}" if args.session else f"any session in {registry.ns.root}"
        print(f"no caches in {where}")
        return 0
    headers = ["session", "cache", "dataset", "items mem", "items disk", "bytes mem", "bytes disk",
               "avg item", "pages", "hits", "misses", "rejected", "computed", "claim waits", "last opened"]
    remote = any("remote" in st for st in rows)
    if remote:  # the remote tier's columns, only when a cache has one (NOTE [tier counts])
        headers += ["remote hits", "remote misses", "read", "written", "errors", "forged", "backlog", "dropped",
                    "leases", "lease waits"]
    snapshot = any("snapshot" in st for st in rows)
    if snapshot:  # the snapshot tier's columns, only when a cache has one (NOTE [snapshot read-through])
        headers += ["snap hits", "snap misses", "snap read", "snap errors", "snap forged"]
    table = []
    for st in rows:
        if "error" in st:
            table.append([st["session"], st["name"], "", "error: " + st["error"][:60]] + [""] * (len(headers) - 4))
            continue
        label = st.get("label") or "-"
        label = label if len(label) <= 40 else label[:37] + "..."
        table.append([st["session"], st["name"], label, str(st["items_mem"]), str(st["items_disk"]),
                      _size(st["bytes_mem"]), _size(st["bytes_disk"]), _size(st["avg_item_bytes"]),
                      _page(st["page_size"]), str(st["hits"]), str(st["misses"]), str(st["rejected"]),
                      str(st["computed"]), str(st["claim_waits"]),  # NOTE [claims]
                      _ago(None if st["in_use"] else st["idle_s"])])
        if remote:
            table[-1] += ([str(st["remote_hits"]), str(st["remote_misses"]), _size(st["remote_bytes_read"]),
                           _size(st["remote_bytes_written"]), str(st["remote_errors"]), str(st["remote_forged"]),
                           str(st["remote_backlog"]), str(st["remote_dropped"]),
                           str(st["remote_leases"]),  # NOTE [remote leases]
                           str(st["remote_lease_waits"])] if "remote" in st else ["-"] * 10)
        if snapshot:
            table[-1] += ([str(st["snapshot_hits"]), str(st["snapshot_misses"]), _size(st["snapshot_bytes_read"]),
                           str(st["snapshot_errors"] + st["snapshot_corrupt"]), str(st["snapshot_forged"])]
                          if "snapshot" in st else ["-"] * 5)
    print(_table(headers, table, right=set(range(3, len(headers)))))
    for st in rows:
        if st.get("huge_pages_would_help"):
            print(f"\n{st['session']}/{st['name']}: {_size(st['bytes_mem'])} on {st['pages']}: random reads of "
                  f"small items miss the TLB on nearly every item; huge pages make them faster (README: Memory "
                  f"in containers and huge pages): a tmpfs mounted huge=within_size, then ${ENV_MEMORY_DIR} "
                  f"or `shmcache new --memory-dir` for a new session there")
    return 0


def cmd_top(args, registry: SessionRegistry) -> int:
    from . import top

    if args.session is not None:
        registry.get(args.session, fix=_CHECK_NAME)
    if args.once or not sys.stdout.isatty():  # piped: one frame, as --once
        top.print_once(registry, args.session, args.sort, args.interval)
        return 0
    import curses

    try:
        top.run_live(registry, args.session, args.sort, args.interval)
    except curses.error as exc:  # no usable terminal ($TERM unset or unknown)
        raise InvalidArgument(f"this terminal cannot show the live view ({exc}; TERM="
                              f"{os.environ.get('TERM', '')!r}): set TERM (e.g. xterm-256color), "
                              f"or print frames with `shmcache top --once`") from None
    return 0


def cmd_ls(args, registry: SessionRegistry) -> int:
    rows = []
    now = time.time()
    for info in registry.list():
        mem = registry.ns.occupied_bytes(registry.segment_prefix(info.name))
        try:
            owner = pwd.getpwuid(info.uid).pw_name
        except KeyError:
            owner = str(info.uid)
        live = len(registry.live_pids(info.name))
        last_used = now if live else registry.last_used(info.name)
        opened = {c: registry.cache_last_opened(info.name, c) for c in registry.cache_names(info.name)}
        # per cache, how long since a process last had it open (0: open now): NOTE [cache use]
        idle = {c: 0.0 if t is None else round(max(0.0, now - t), 1) for c, t in opened.items()}
        rows.append({"session": info.name, "owner": owner, "created": info.created,
                     "age_s": round(now - info.created, 1), "last_used": round(last_used, 1),
                     "idle_s": round(max(0.0, now - last_used), 1), "live_processes": live,
                     "caches": len(idle), "caches_idle_s": idle, "shm_bytes": mem,
                     "spill_dir": info.spill_dir})
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    if not rows:
        print(f"no sessions in {registry.ns.root}")
        return 0
    print(_table(["session", "owner", "age", "last used", "live procs", "caches", "memory", "oldest cache opened"],
                 [[r["session"], r["owner"], _age(r["age_s"]),
                   _ago(None if r["live_processes"] else r["idle_s"]), str(r["live_processes"]),
                   str(r["caches"]), _size(r["shm_bytes"]),
                   _ago(max(r["caches_idle_s"].values()) or None) if r["caches_idle_s"] else "-"]
                  for r in rows], right={2, 3, 4, 5, 6, 7}))
    return 0


def cmd_new(args, registry: SessionRegistry) -> int:
    if args.size is not None:  # where a MindSpore user looks for a session's size: say where it is
        raise InvalidArgument(
            f"a session has no size of its own: each cache has its cap, size= in MiB "
            f"(ShmDatasetCache(size={args.size})), and the caches with size=0 share the session's "
            f"automatic cap (80% of the memory free); for a whole job: `python -m shmcache.launch "
            f"--size {args.size} ...` or $SHMCACHE_SIZE_MB={args.size}; then `shmcache new` without --size")
    spill = args.spill_dir
    if spill is not None:
        from ..tiers.spill import check_spill_dir

        spill = str(check_spill_dir(spill))
    remote = args.remote
    if remote is not None:
        from ..tiers.remote import parse_url

        parse_url(remote)  # a bad URL is an error now (without its password), not at first use
    info = registry.create(args.name, spill_dir=spill, remote=remote, memory_dir=args.memory_dir)
    print(info.name)
    return 0


def cmd_destroy(args, registry: SessionRegistry) -> int:
    if args.cache is not None:
        size = registry.cache_shm_bytes(args.name, args.cache)
        try:
            removed = registry.drop_cache(args.name, args.cache, force=args.force)
        except CacheInUse as exc:  # the library's message says force: say what to type here
            raise CacheInUse(str(exc).replace("with force", f"with `shmcache destroy --force {args.name} "
                                              f"--cache {args.cache}`")) from None
        print(f"destroyed cache {args.name}/{args.cache} ({_size(size)} of shared memory freed, "
              f"{len(removed)} segments removed)")
        return 0
    try:
        removed = registry.destroy(args.name, force=args.force)
    except SessionInUse:  # the library's message says force=True: say what to type here
        pids = ", ".join(map(str, registry.live_pids(args.name))) or "none left now: try again"
        raise SessionInUse(
            f"session {args.name!r} is in use by live processes (pids {pids}); stop them first, "
            f"or destroy it anyway with `shmcache destroy --force {args.name}` (their caches "
            f"vanish under them)") from None
    print(f"destroyed session {args.name!r} ({len(removed)} segments removed)")
    return 0


def cmd_gc(args, registry: SessionRegistry) -> int:
    from ..launch.supervisor import remove_stale_launch_directories
    from ..tiers.namespace_gc import collect_garbage

    done = collect_garbage(registry, args.idle_for, args.cache_idle_for)
    result, report, idle, reclaimed = done.to_json(), done.registry, done.idle, done.reclaimed
    result["removed_launch_dirs"] = launch_dirs = remove_stale_launch_directories()
    dropped, recounted, skipped = done.dropped, done.recounted, done.skipped
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        for s in idle:
            print(f"gc: destroyed session {s.name!r}, unused for {_age(s.idle_s)} "
                  f"({len(s.removed_segments)} segments removed)")
        for c in done.idle_caches:
            print(f"gc: dropped cache {c.session}/{c.cache}, not opened for {_age(c.idle_s)} "
                  f"({_size(c.shm_bytes)} of shared memory freed)")
        # slot files of exited processes are normal leftovers (a clean exit leaves one too)
        print(f"gc: {len(result['removed_segments'])} orphaned segments removed, "
              f"{reclaimed} half-written entries reclaimed, {len(report.removed_dirs)} half-made "
              f"sessions removed, {len(report.removed_locks)} slot files of exited processes "
              f"cleared, {len(report.removed_spill_files)} orphaned spill folders removed, "
              f"{len(report.removed_caches)} caches that were never made forgotten")
        for d in dropped:
            print(f"gc: cache {d['cache']} was damaged and is dropped (now empty; its contents are "
                  f"recomputed on use): {d['reason']}")
        for d in recounted:
            print(f"gc: cache {d['cache']}: recounted {', '.join(d['counters'])}")
        for d in skipped:
            print(f"gc: cache {d['cache']} skipped: {d['reason']}")
        for path in launch_dirs:
            print(f"gc: removed {path}, the temporary directory of a launcher that was killed")
    return 0


def cmd_info(args, registry: SessionRegistry) -> int:
    lim = memory_limits()
    ns = registry.ns
    spill = settings.get(ENV_SPILL_DIR)
    spill_free = None
    if spill:
        try:
            st = os.statvfs(spill)
            spill_free = st.f_bavail * st.f_frsize
        except OSError:
            pass
    from .. import __version__

    memory_dir, mem_total, mem_free, new_lim = settings.get(ENV_MEMORY_DIR) or None, None, None, lim
    # what a session made now would be told (a disk, a directory gone, a read-only mount): no space,
    # no pages and no cap are shown for a directory no session can be made in
    refused = memdir.refusal(memory_dir) if memory_dir else None
    if memory_dir and not refused:
        try:
            mem_total, mem_free = memdir.space(memory_dir)
            new_lim = memory_limits(shm_root=memory_dir)
        except OSError:
            pass
    info = {
        "version": __version__, "namespace": str(ns.root), "segment_prefix": ns.prefix,
        "shm_total_bytes": lim.shm_total, "shm_free_bytes": lim.shm_free,
        "mem_available_bytes": lim.mem_available, "cgroup_limit_bytes": lim.cgroup_limit,
        "cgroup_free_bytes": lim.cgroup_free, "cgroup_limit_file": lim.cgroup_file,
        "auto_capacity_bytes": None if refused else new_lim.auto_capacity(),
        "spill_dir": spill, "spill_free_bytes": spill_free,
        "shm_pages": memdir.backing().describe(),
        "memory_dir": memory_dir, "memory_dir_total_bytes": mem_total, "memory_dir_free_bytes": mem_free,
        "memory_dir_pages": memdir.backing(memory_dir).describe() if memory_dir and not refused else None,
        "memory_dir_error": refused,
        "thp_shmem_enabled": memdir.shmem_enabled(),
        "batch_copy": "compiled" if rowcopy.NATIVE else f"numpy: {rowcopy.unavailable_reason()}",
        "single_hit": "compiled" if hit.NATIVE else f"python: {hit.unavailable_reason()}",
        "pages_ahead": "compiled" if ahead.NATIVE else f"none: {ahead.unavailable_reason()}",
        "pages_ahead_copy": "mapped" if not ahead.mapping_unavailable_reason()
        else f"pwritev: {ahead.mapping_unavailable_reason()}",
        "batch_encode": "compiled" if codec.PACK_NATIVE else f"python: {codec.pack_unavailable_reason()}",
        "batch_probe": "compiled" if index.PROBE_NATIVE else f"numpy: {index.probe_unavailable_reason()}",
        "sessions": len(registry.list()),
        "segments": sum(len(ns.owned_segments(d)) for d in [None, *registry.memory_dirs()]),
        "remotes": _remotes(registry),
    }
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    lines = [
        ("version", info["version"]), ("namespace", f"{ns.root}  ($SHMCACHE_DIR)"),
        ("segment prefix", f"/dev/shm/{ns.prefix}+..."),
        ("/dev/shm", f"{_size(lim.shm_free)} free of {_size(lim.shm_total)}; {info['shm_pages']}"),
        ("memory dir", f"{memory_dir}  (refused for new sessions: {refused})" if refused
         else f"{memory_dir}  ({_size(mem_free)} free of {_size(mem_total)}; {info['memory_dir_pages']}; "
              f"$SHMCACHE_MEMORY_DIR, for new sessions)" if memory_dir
         else "not set: new sessions in /dev/shm ($SHMCACHE_MEMORY_DIR, shmcache new --memory-dir)"),
        ("huge pages (shmem THP)", f"shmem_enabled {info['thp_shmem_enabled']}; a tmpfs mount's huge= "
                                   f"decides for its files (`shmcache stat` shows each cache's pages)"),
        ("batch copy", "compiled: a batch's rows are copied out of shared memory in one pass" if rowcopy.NATIVE
         else f"numpy, two passes: {rowcopy.unavailable_reason()}"),
        ("single hit", "compiled: an int key's hit (ds[i], cache.get) is one call" if hit.NATIVE
         else f"Python: {hit.unavailable_reason()}"),
        ("pages ahead", ("compiled: a cold batch's pages are backed on an idle CPU while the batch is computed"
                         + ("; its records copied in through that thread's mapping of them"
                            if not ahead.mapping_unavailable_reason()
                            else f"; its records pwritten: {ahead.mapping_unavailable_reason()}"))
         if ahead.NATIVE else f"none, each batch backs its own: {ahead.unavailable_reason()}"),
        ("batch encode", "compiled: a cold batch's samples of one shape are packed one call each"
         if codec.PACK_NATIVE else f"Python: {codec.pack_unavailable_reason()}"),
        ("batch probe", "compiled: a batch's keys are looked up in the index in one pass"
         if index.PROBE_NATIVE else f"numpy: {index.probe_unavailable_reason()}"),
        ("MemAvailable", _size(lim.mem_available)),
        ("cgroup memory limit", f"{_size(lim.cgroup_limit)} ({_size(lim.cgroup_free)} free; "
                                f"{lim.cgroup_file})" if lim.cgroup_limit else "no limit"),
        ("automatic cap (size=0)", "none: a session made now is refused (memory dir, above)" if refused
         else f"{_size(new_lim.auto_capacity())}  (80% of the memory dir's free huge pages - its pool, which "
              f"MemAvailable and the cgroup do not count - for a session made now)" if new_lim.huge_pool
         else f"{_size(new_lim.auto_capacity())}  (80% of the smallest above, for a "
              f"session made now: in {'the memory dir' if memory_dir else '/dev/shm'})"),
        ("spill dir", f"{spill}  ({_size(spill_free)} free)" if spill else "not set ($SHMCACHE_SPILL_DIR)"),
        ("sessions / segments", f"{info['sessions']} / {info['segments']}"),
    ]
    for r in info["remotes"]:
        state = (f"answers; {_size(r['used_memory'])} used of "
                 f"{_size(r['maxmemory']) if r['maxmemory'] else 'no maxmemory'}" if r["answers"]
                 else f"does not answer ({r['error']})")
        lines.append((f"remote ({r['source']})", f"{r['url']}  {state}"))
    if not info["remotes"]:
        lines.append(("remote", "none ($SHMCACHE_REMOTE, shmcache new --remote)"))
    width = max(len(k) for k, _ in lines)
    print("\n".join(f"{k.ljust(width)}  {v}" for k, v in lines))
    return 0


def _remotes(registry: SessionRegistry) -> list[dict]:
    """The remote tiers in force here ($SHMCACHE_REMOTE, each session's), each probed with a short
    timeout (remote.probe): masked URL, whether it answers, its used and maximum memory."""
    from ..tiers.remote import probe

    found = [("$" + ENV_REMOTE, settings.get(ENV_REMOTE))]
    found += [(f"session {s.name}", s.remote) for s in registry.list()]
    out = []
    for source, url in found:
        if not url:
            continue
        try:
            out.append({"source": source, **probe(url)})
        except InvalidArgument as exc:  # a bad URL, or no redis-py: say so, never the password
            out.append({"source": source, "url": None, "answers": False, "used_memory": None,
                        "maxmemory": None, "error": str(exc)})
    return out
def cmd_export(args, registry: SessionRegistry) -> int:
    from ..cache.store import CacheStore
    from ..snapshot.export import export_cache

    if len(args.where) > 2:
        raise InvalidArgument(f"export takes SESSION [CACHE] DEST, got {len(args.where) + 1} arguments")
    name, dest = (args.where if len(args.where) == 2 else (None, args.where[0]))
    registry.get(args.session, fix=_CHECK_NAME)  # SessionNotFound, naming the sessions there are
    if name is None:
        names = registry.cache_names(args.session)
        if len(names) != 1:
            raise InvalidArgument(
                f"session {args.session!r} holds {len(names)} caches ({', '.join(names) or 'none'}); "
                f"name the one to export: shmcache export {args.session} CACHE {dest}")
        name = names[0]
    elif name not in registry.cache_names(args.session):
        raise CacheNotFound(f"session {args.session!r} has no cache {name!r} (it has: "
                            f"{', '.join(registry.cache_names(args.session)) or 'none'}); see `shmcache stat`")
    store = CacheStore(args.session, name, ns=registry.ns, create=False)
    try:
        _attach_spill(store)
        report = export_cache(store, dest, overwrite=args.overwrite, segment_bytes=args.segment_mb << 20)
    finally:
        store.close()
    print(report)
    return 1 if report.damaged else 0


def cmd_import(args, registry: SessionRegistry) -> int:
    from ..snapshot.load import import_snapshot

    if args.spilling and not args.spill_dir and not settings.get(ENV_SPILL_DIR):
        session = resolve_session_name(args.session)
        if not (registry.exists(session) and registry.get(session).spill_dir):
            raise InvalidArgument(f"--spilling needs a spill directory: add --spill-dir DIR (an existing "
                                  f"directory), set ${ENV_SPILL_DIR}, or give session {session!r} one "
                                  f"(`shmcache new {session} --spill-dir DIR`)")
    report = import_snapshot(args.src, session=args.session, name=args.name, size_mb=args.size,
                             spilling=args.spilling, spill_dir=args.spill_dir, force=args.force,
                             threads=args.threads, allow_pickle=args.allow_pickle,
                             allow_unsigned=args.allow_unsigned,  # the secret: $SHMCACHE_SECRET
                             timeout_s=args.timeout_s)
    print(report)
    return 0 if report.complete else 1


# --- entry point --------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="shmcache", description="Inspect and manage shmcache sessions and caches.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND",
                           help="what to do; `shmcache COMMAND -h` for its arguments")
    s = sub.add_parser("stat", help="one row per cache (its dataset, items, bytes, hits, misses)")
    s.add_argument("session", nargs="?", help="only this session")
    out = s.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="machine-readable output")
    out.add_argument("--prometheus", action="store_true",
                     help="Prometheus's text exposition format, labelled by session, cache and rank "
                          "(for node_exporter's textfile collector; needs pip install 'shmcache[metrics]')")
    s.set_defaults(func=cmd_stat)
    s = sub.add_parser("top", help="a live view of the caches: hit ratio, hits/s, misses/s, MB/s, tier "
                                   "reads/s, and each rank's share of time waiting for batches")
    s.add_argument("session", nargs="?", help="only this session")
    s.add_argument("--once", action="store_true",
                   help="print one frame (two readings --interval apart) to stdout and exit (also "
                        "what a piped top does)")
    s.add_argument("--interval", type=_positive_float, default=1.0, metavar="S",
                   help="seconds between refreshes (default 1)")
    s.add_argument("--sort", choices=["h", "m", "b", "i", "n", "s"], default="h",
                   help="sort by hits/s (h, default), misses/s (m), MB/s (b), items (i), name (n) or "
                        "stall (s); the same keys sort the live view")
    s.set_defaults(func=cmd_top)
    s = sub.add_parser("ls", help="list sessions (owner, age, last use, live processes, memory, the "
                                  "cache opened longest ago)")
    s.add_argument("--json", action="store_true", help="machine-readable output (last_used in epoch seconds, idle_s)")
    s.set_defaults(func=cmd_ls)
    s = sub.add_parser("new", help="create a session and print its name")
    s.add_argument("name", nargs="?", help="session name (default: a random one)")
    s.add_argument("--spill-dir", help="default spill directory of the session's caches")
    s.add_argument("--memory-dir", metavar="DIR",
                   help="a tmpfs or hugetlbfs directory for the session's shared memory instead of "
                        "/dev/shm (default: $SHMCACHE_MEMORY_DIR)")
    s.add_argument("--size", type=_positive_int, metavar="MIB",
                   help="not an option of a session: each cache has its own cap (size= in MiB, or "
                        "$SHMCACHE_SIZE_MB, or the launcher's --size); this says so")
    s.add_argument("--remote", metavar="URL",
                   help="default remote tier of the session's caches: redis://[:password@]host:port[/db], "
                        "rediss://, redis+cluster://h1:p1,h2:p2, redis+shards://h1:p1,h2:p2")
    s.set_defaults(func=cmd_new)
    s = sub.add_parser("destroy", help="drop a session and everything in it")
    s.add_argument("name", help="the session to destroy (see `shmcache ls`)")
    s.add_argument("--force", action="store_true",
                   help="even if live processes are attached (their caches vanish under them)")
    s.add_argument("--cache", metavar="CACHE", help="drop only this cache of the session (see `shmcache stat`)")
    s.set_defaults(func=cmd_destroy)
    s = sub.add_parser("gc", help="reclaim what dead processes left behind")
    s.add_argument("--idle-for", type=_duration, metavar="DURATION",
                   help="also destroy the sessions no live process is attached to and nobody has "
                        "used for DURATION or longer: a number and s, m, h, d or w (90s, 30m, 12h, 1d, 2w)")
    s.add_argument("--cache-idle-for", type=_duration, metavar="DURATION",
                   help="also drop every cache that no live process has open and none opened for "
                        "DURATION or longer (an old version of a dataset, say)")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_gc)
    s = sub.add_parser("info", help="limits and configuration")
    s.add_argument("--json", action="store_true", help="machine-readable output")
    s.set_defaults(func=cmd_info)
    s = sub.add_parser("export", help="write a cache to a snapshot (a directory or an fsspec URL)",
                       usage="shmcache export [-h] [--overwrite] [--segment-mb MB] SESSION [CACHE] DEST")
    s.add_argument("session", help="the session of the cache (see `shmcache ls`)")
    s.add_argument("where", nargs="+", metavar="[CACHE] DEST",
                   help="the cache (optional when the session holds one) and where the snapshot goes: "
                        "a new directory, or s3://bucket/prefix, file://..., memory://...")
    s.add_argument("--overwrite", action="store_true", help="replace a snapshot already at DEST")
    s.add_argument("--segment-mb", type=_positive_int, default=512, metavar="MB",
                   help="size of each data file of the snapshot in MiB (default 512)")
    s.set_defaults(func=cmd_export)
    s = sub.add_parser("import", help="fill a cache from a snapshot (then it runs without its source)")
    s.add_argument("src", help="the snapshot: a directory, or s3://bucket/prefix, file://..., memory://...")
    s.add_argument("--session", default="auto", help="the session to import into (default: "
                                                     "$SHMCACHE_SESSION, else 'default')")
    s.add_argument("--name", help="the cache's name (default: the exported cache's)")
    s.add_argument("--force", action="store_true",
                   help="replace the contents of a cache of that name that holds another dataset")
    s.add_argument("--size", type=_positive_int, default=0, metavar="MB",
                   help="memory cap of a new cache in MiB (default 0: automatic)")
    s.add_argument("--spilling", action="store_true", help="spill what does not fit in memory to disk")
    s.add_argument("--spill-dir", help="where spill files go (with --spilling)")
    s.add_argument("--threads", type=_positive_int, default=None, help="segments read at once (default: up to 4)")
    s.add_argument("--allow-pickle", action="store_true",
                   help="also import records holding pickled objects from a snapshot not signed with "
                        "$SHMCACHE_SECRET (unpickling them can run any code: only for a snapshot you trust)")
    s.add_argument("--allow-unsigned", action="store_true",
                   help="with $SHMCACHE_SECRET set, import a snapshot not signed with it, as untrusted data")
    s.add_argument("--timeout-s", type=_positive_float, default=None, metavar="S",
                   help="the longest one read from an HTTP(S) or S3 snapshot may take, in seconds (default "
                        "60); past it the import fails and gives back the cache it made")
    s.set_defaults(func=cmd_import)
    return p


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a non-negative whole number")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds (e.g. 60, 0.5)")
    return value


# commands that only look: they never create $SHMCACHE_DIR (a typo in it must not leave a directory)
_LOOKING = ("stat", "top", "ls", "info", "export", "destroy")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        settings.check_switches()  # SHMCACHE_CLAIMS=disabled: every store refused to open, and gc skipped them all
        return args.func(args, SessionRegistry(namespace(create=args.command not in _LOOKING)))
    except InvalidArgument as exc:
        print(f"shmcache {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except ShmcacheError as exc:
        print(f"shmcache {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `shmcache stat | head`
        return 0


if __name__ == "__main__":
    sys.exit(main())
