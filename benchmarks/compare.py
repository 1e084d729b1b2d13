"""shmcache side by side with what users would pick instead, on the same data, in one run.

Reproduce the committed results (benchmarks/results/) with:

    .venv-bench/bin/python benchmarks/compare.py --workload cifar,imagenet,photos --procs 1,2,4 --repeats 3 \\
        --plot benchmarks/results --json benchmarks/results/compare.json

Systems: shmcache (ds[i] and get_batch), a memcpy yardstick (bulk copy and np.take gather of the same
bytes on /dev/shm), Redis as Bagua's CachedDataset uses it (GET and MGET), one torch.save file per
sample as torch_xla's CachedDataset (on /dev/shm and on disk), MosaicML Streaming (ds[i] and
iteration), and no cache (a DataLoader over the source). Each is filled from the same deterministic
source (fill time includes producing the items; the "no cache" fill is one bare pass over the source),
then read by 1, 2, 4 real reader processes that start together at a barrier, each reading its shard
(perm[rank::P]) of a fresh random permutation per epoch. Figures are medians over epochs (never
means), p90 of the time per 256 items, ratios to shmcache (same kind of read path, same P) and to the
bulk memcpy (GB/s, same P). A system that cannot run is shown as ``skipped (reason)``.
Setup (redis-server, the bench venv with torch pinned): benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from _common import (  # noqa: E402
    environment,
    environment_line,
    fmt_bytes,
    fmt_rate,
    fmt_ratio,
    fmt_s,
    free_loopback_port,
    markdown_table,
    median,
    p90,
)

NOTE_BUSY = "Measured on a busy, shared 2-core machine: compare rows within one run, not across runs."


# --- results ----------------------------------------------------------------------------------------


@dataclass
class PathResult:
    path: str
    label: str
    batched: bool
    procs: int
    total_items_s: float
    per_proc_items_s: float
    total_gb_s: float
    per_proc_gb_s: float
    p90_ms_per_256: float | None
    epoch_s: float                   # one pass over all items by all processes: n_items / total_items_s
    repeats: int
    error: str = ""                  # why this (path, P) run failed; the figures are then NaN


@dataclass
class PeerResult:
    system: str
    status: str                      # "ok", "skipped (reason)", "failed (reason)"
    version: str = ""
    fill_s: float | None = None
    memory_bytes: int | None = None
    memory_where: str = ""
    memory_note: str = ""
    paths: list[PathResult] = field(default_factory=list)
    extra: dict = field(default_factory=dict)


# --- measuring --------------------------------------------------------------------------------------


def summarise(epochs, path, procs: int, item_bytes: int, n_items: int) -> PathResult:
    """Medians over repeats of one (system, read path, P) run; see NOTE [reader protocol]."""
    by_repeat: dict[int, list] = {}
    for e in epochs:
        by_repeat.setdefault(e.repeat, []).append(e)
    totals = [sum(e.items for e in es) / (max(e.t1 for e in es) - min(e.t0 for e in es))
              for es in by_repeat.values()]
    per_proc = [e.items / (e.t1 - e.t0) for e in epochs]
    chunks = [c * 1e3 for e in epochs for c in e.chunk_s]
    total, each = median(totals), median(per_proc)
    return PathResult(path.key, path.label, path.batched, procs, total, each, total * item_bytes / 1e9,
                      each * item_bytes / 1e9, p90(chunks) if path.chunked else None,
                      n_items / total, len(by_repeat))


def measure_peer(peer, workload, procs: list[int], repeats: int, seed: int) -> PeerResult:
    """Fill one system, read it with every path and P, and remove it again (whatever happens)."""
    reason = peer.skip_reason()
    if reason:
        return PeerResult(peer.name, f"skipped ({reason})")
    res = PeerResult(peer.name, "ok", version=peer.version())
    try:
        t = time.perf_counter()
        peer.fill(workload)
        res.fill_s = time.perf_counter() - t
        mem = peer.memory()
        res.memory_bytes, res.memory_where, res.memory_note = mem.bytes, mem.where, mem.note
        before = _peer_stats(peer)
        for path in peer.paths:
            for p in procs:
                _progress(f"  {peer.name}: {path.label}, {p} proc(s)")
                res.paths.append(measure_path(peer, path, p, workload, repeats, seed))
        res.extra = {"after_fill": before, "after_reads": _peer_stats(peer)}
        res.memory_note += _read_misses(before, res.extra["after_reads"])
    except Exception as e:  # noqa: BLE001 - one failing system must not hide the others
        traceback.print_exc(file=sys.stderr)
        res.status = f"failed ({type(e).__name__}: {_first_line(e)})"
    finally:
        peer.close()
    return res


def measure_path(peer, path, procs: int, workload, repeats: int, seed: int) -> PathResult:
    """One (read path, P) run; a reader failure becomes a row saying so, and the next run goes on."""
    from peers._runner import ReaderError, run_readers

    try:
        epochs = run_readers(peer.module, peer.spec(), path.key, procs, workload, repeats, seed,
                             port=free_loopback_port())
        return summarise(epochs, path, procs, workload.item_bytes, workload.n_items)
    except ReaderError as e:
        print(e, file=sys.stderr)
        nan = float("nan")
        return PathResult(path.key, path.label, path.batched, procs, nan, nan, nan, nan, None, nan, 0,
                          error=_first_line(e))
    finally:
        peer.after_run()


def _peer_stats(peer) -> dict:
    stats = getattr(peer, "stats", None)
    return stats() if callable(stats) else {}


def _read_misses(before: dict, after: dict) -> str:
    """For a cache that counts: the misses during the warm epochs (should be 0) and the hits."""
    if "misses" not in before or "misses" not in after:
        return ""
    return f"; warm reads: {after['hits'] - before['hits']:,} hits, {after['misses'] - before['misses']:,} misses"


def _first_line(e: BaseException) -> str:
    lines = [ln for ln in str(e).splitlines() if ln.strip()]
    # a ReaderError carries a traceback: its last line says what went wrong
    return (lines[-1] if len(lines) > 1 else (lines[0] if lines else "")).strip()[:200]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_workload(workload, procs, repeats, seed, only) -> list[PeerResult]:
    from peers import all_peers

    out = []
    for peer in all_peers(only):
        _progress(f"[{workload.name}] {peer.name}")
        out.append(measure_peer(peer, workload, procs, repeats, seed))
    return out


# --- reporting --------------------------------------------------------------------------------------


def _find(results: list[PeerResult], system: str, procs: int, path: str) -> PathResult | None:
    for r in results:
        for pr in r.paths if r.system == system else ():
            if pr.procs == procs and pr.path == path:
                return pr
    return None


def ratios(results, pr: PathResult) -> tuple[float | None, float | None]:
    """(× shmcache on the same kind of path and P, fraction of the bulk memcpy GB/s at the same P)."""
    ref = _find(results, "shmcache", pr.procs, "batch" if pr.batched else "getitem")
    yard = _find(results, "memcpy yardstick", pr.procs, "memcpy")
    return (pr.total_items_s / ref.total_items_s if ref else None,
            pr.total_gb_s / yard.total_gb_s if yard else None)


def setup_table(workload, results: list[PeerResult]) -> str:
    rows = []
    for r in results:
        if r.status != "ok":
            rows.append([r.system, r.status, "—", "—", "—"])
            continue
        over = r.memory_bytes / workload.payload_bytes if r.memory_bytes else None
        mem = f"{fmt_bytes(r.memory_bytes)} {r.memory_where}" if r.memory_bytes else "none"
        rows.append([r.system, fmt_s(r.fill_s), mem,
                     fmt_ratio(over) if r.memory_bytes else "—", r.memory_note])
    return markdown_table(["system", "fill s", "memory", "× payload", "notes"], rows, "lrrrl")


def throughput_table(results: list[PeerResult], procs: list[int]) -> str:
    """Total items/s (GB/s) for each P in columns: the summary to quote."""
    head = ["system", "read path", *[f"{p} proc{'s' if p > 1 else ''}" for p in procs],
            f"× shmcache ({procs[-1]} p)", f"× memcpy ({procs[-1]} p)"]
    rows = []
    for r in results:
        for label in dict.fromkeys(pr.label for pr in r.paths):
            cells = {pr.procs: pr for pr in r.paths if pr.label == label}
            last = cells.get(procs[-1])
            xs, xm = ratios(results, last) if last else (None, None)
            rows.append([r.system, label,
                         *[_cell(cells.get(p)) for p in procs], fmt_ratio(xs), fmt_ratio(xm)])
        if r.status != "ok":
            rows.append([r.system, r.status, *["—"] * len(procs), "—", "—"])
    return markdown_table(head, rows, "ll" + "r" * (len(head) - 2))


def _cell(c: PathResult | None) -> str:
    if c is None:
        return "—"
    return f"failed: {c.error}" if c.error else f"{fmt_rate(c.total_items_s)}/s ({c.total_gb_s:.2g} GB/s)"


def detail_table(results: list[PeerResult]) -> str:
    head = ["system", "read path", "P", "items/s per proc", "GB/s per proc", "items/s total", "GB/s total",
            "p90 ms / 256", "epoch s", "× shmcache", "× memcpy"]
    rows = []
    for r in results:
        for pr in r.paths:
            xs, xm = ratios(results, pr)
            if pr.error:
                rows.append([r.system, pr.label, pr.procs, f"failed: {pr.error}", *["—"] * 7])
                continue
            rows.append([r.system, pr.label, pr.procs, fmt_rate(pr.per_proc_items_s), f"{pr.per_proc_gb_s:.3g}",
                         fmt_rate(pr.total_items_s), f"{pr.total_gb_s:.3g}",
                         fmt_s(pr.p90_ms_per_256), fmt_s(pr.epoch_s), fmt_ratio(xs), fmt_ratio(xm)])
    return markdown_table(head, rows, "llr" + "r" * (len(head) - 3))


def workload_report(workload, results, procs, repeats) -> str:
    return "\n\n".join([
        f"### {workload.name}: {workload.n_items:,} items of {fmt_bytes(workload.item_bytes)} "
        f"({workload.description}), {fmt_bytes(workload.payload_bytes)} in all",
        "Fill and memory (fill includes producing every item from the source):",
        setup_table(workload, results),
        f"Warm epochs, total items/s (GB/s) over all reader processes; median of {repeats} epochs; "
        f"each process reads its shard of a random permutation:",
        throughput_table(results, procs),
        "Details (medians; p90 of the time per 256 items):",
        detail_table(results),
    ])


# --- plots ------------------------------------------------------------------------------------------


def plot_all(all_results: dict, workloads: dict, procs: list[int], out_dir: Path) -> list[Path]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # noqa: F401
    except ImportError as e:
        _progress(f"plots skipped: matplotlib not available ({e})")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    files = [plot_vs_procs(name, all_results[name], procs, out_dir) for name in all_results]
    files.append(plot_vs_item_size(all_results, workloads, out_dir))
    return [f for f in files if f]


def _series(results: list[PeerResult]):
    """(label, style, path results) per system and read path: one colour per system, one line style
    per read path, so 15 lines stay legible."""
    styles = [("-", "o"), ("--", "s"), (":", "^")]
    for k, r in enumerate(results):
        for j, label in enumerate(dict.fromkeys(pr.label for pr in r.paths)):
            ls, marker = styles[j % len(styles)]
            yield f"{r.system}: {label}", dict(color=f"C{k}", ls=ls, marker=marker), \
                [pr for pr in r.paths if pr.label == label]


def _log_axes(ax, ylabel_fmt) -> None:
    from matplotlib.ticker import FuncFormatter, LogLocator

    ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_locator(LogLocator(subs="all"))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _pos: ylabel_fmt(y)))
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def plot_vs_procs(name: str, results: list[PeerResult], procs: list[int], out_dir: Path) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5.5))
    for label, style, prs in _series(results):
        prs = sorted(prs, key=lambda p: p.procs)
        ax.plot([p.procs for p in prs], [p.total_items_s for p in prs], label=label, **style)
    ax.set(xscale="log", yscale="log", xlabel="reader processes (2 cores)",
           ylabel="warm epoch, items/s (all processes)", title=f"{name}: throughput vs reader processes (median)")
    ax.set_xticks(procs, [str(p) for p in procs])
    ax.xaxis.set_minor_locator(plt.NullLocator())
    _log_axes(ax, fmt_rate)
    return _save(fig, out_dir / f"compare-{name}-procs.png")


def plot_vs_item_size(all_results: dict, workloads: dict, out_dir: Path) -> Path | None:
    """GB/s with one process against item size: one workload per distinct size (synthetic first)."""
    import matplotlib.pyplot as plt

    by_size: dict[int, str] = {}
    for name in sorted(all_results, key=lambda n: n == "photos"):
        by_size.setdefault(workloads[name].item_bytes, name)
    if len(by_size) < 2:
        _progress("item-size plot skipped: needs workloads of at least two item sizes (e.g. cifar,imagenet)")
        return None
    series: dict[str, tuple[dict, list[tuple[int, float]]]] = {}
    for size, name in sorted(by_size.items()):
        for label, style, prs in _series(all_results[name]):
            one = min(prs, key=lambda p: p.procs)
            series.setdefault(label, (style, []))[1].append((size, one.total_gb_s))
    fig, ax = plt.subplots(figsize=(10, 5.5))
    for label, (style, pts) in series.items():
        ax.plot([s for s, _ in pts], [g for _, g in pts], label=label, **style)
    ax.set(xscale="log", yscale="log", xlabel="item size (bytes)", ylabel="warm epoch, GB/s (1 process)",
           title=f"throughput vs item size ({', '.join(by_size.values())}; median)")
    _log_axes(ax, lambda y: f"{y:g}")
    return _save(fig, out_dir / "compare-itemsize.png")


# --- command line -----------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    from peers import PEER_KEYS
    from peers._workloads import WORKLOADS

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="cifar",
                    help=f"comma-separated, of: {', '.join(WORKLOADS)} (or 'all'); default cifar")
    ap.add_argument("--procs", default="1,2,4", help="reader process counts, comma-separated (default 1,2,4)")
    ap.add_argument("--items", type=int, default=None, help="items per workload (default: per workload)")
    ap.add_argument("--quick", action="store_true", help="small workloads and 3 epochs (for development)")
    ap.add_argument("--repeats", type=int, default=None, help="epochs per measurement (default 5; --quick 3)")
    ap.add_argument("--only", default=None, help=f"comma-separated subset of: {', '.join(PEER_KEYS)}")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--plot", type=Path, default=None, help="write PNG plots (and compare.md) into DIR")
    ap.add_argument("--json", type=Path, default=None, help="write every figure as JSON to FILE")
    ap.add_argument("--md", type=Path, default=None, help="write the markdown report to FILE "
                                                             "(default: DIR/compare.md with --plot)")
    args = ap.parse_args(argv)
    args.workloads = list(WORKLOADS) if args.workload == "all" else args.workload.split(",")
    args.procs = sorted(int(p) for p in args.procs.split(","))
    args.only = args.only.split(",") if args.only else None
    args.repeats = args.repeats or (3 if args.quick else 5)
    for w in args.workloads:
        if w not in WORKLOADS:
            ap.error(f"unknown workload {w!r}; choose from {', '.join(WORKLOADS)}")
    for k in args.only or []:
        if k not in PEER_KEYS:
            ap.error(f"unknown system {k!r} in --only; choose from {', '.join(PEER_KEYS)}")
    return args


def isolate_environment() -> str:
    """Private shmcache namespace and one thread per process, set before any reader starts."""
    ns = tempfile.mkdtemp(prefix="shmcache-compare-ns-")
    os.environ["SHMCACHE_DIR"] = ns
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return ns


def remove_leftover_segments() -> list[str]:
    """Segments of the private namespace still in /dev/shm after every session was destroyed: a leak
    to report (and remove, so the benchmark leaves nothing behind)."""
    try:
        from shmcache.base.namespace import namespace
    except Exception:  # noqa: BLE001 - shmcache not importable: it made nothing
        return []
    ns = namespace()
    leaks = ns.owned_segments()
    for name in leaks:
        ns.shm_path(name).unlink(missing_ok=True)
    return leaks


def collect_versions(results: dict) -> dict[str, str]:
    versions = {}
    for rs in results.values():
        for r in rs:
            if r.version:
                versions[r.system] = r.version
    return versions


def command_line(argv) -> str:
    return " ".join([".venv-bench/bin/python", "benchmarks/compare.py", *(argv if argv is not None else sys.argv[1:])])


def write_outputs(args, argv, env, workloads, all_results) -> str:
    """Plots first (the report links those that exist), then the markdown and JSON; the report."""
    if args.plot:
        for f in plot_all(all_results, workloads, args.procs, args.plot):
            _progress(f"wrote {f}")
    report = render_report(args, argv, env, workloads, all_results)
    md = args.md or (args.plot / "compare.md" if args.plot else None)
    if md:
        md.parent.mkdir(parents=True, exist_ok=True)
        md.write_text(report + "\n")
        _progress(f"wrote {md}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        payload = {"command": command_line(argv), "env": env, "procs": args.procs, "repeats": args.repeats,
                   "workloads": {n: {**asdict(workloads[n]), "item_bytes": workloads[n].item_bytes,
                                     "results": [asdict(r) for r in rs]} for n, rs in all_results.items()}}
        args.json.write_text(json.dumps(payload, indent=1, default=str) + "\n")
        _progress(f"wrote {args.json}")
    return report


def render_report(args, argv, env, workloads, all_results) -> str:
    parts = ["# shmcache compared with the alternatives", f"Command:\n\n    {command_line(argv)}",
             environment_line(env), NOTE_BUSY]
    for name, rs in all_results.items():
        parts.append(workload_report(workloads[name], rs, args.procs, args.repeats))
    if args.plot:
        pngs = [f"compare-{n}-procs.png" for n in all_results] + ["compare-itemsize.png"]
        parts.append("Plots: " + ", ".join(f"![{p}]({p})" for p in pngs if (args.plot / p).exists()))
    return "\n\n".join(parts)


def main(argv=None) -> int:
    args = parse_args(argv)
    ns_dir = isolate_environment()
    from peers._workloads import make_workload

    workloads = {w: make_workload(w, args.items, args.quick, args.seed) for w in args.workloads}
    env = environment()  # load average at the start: how busy the machine was
    all_results: dict[str, list[PeerResult]] = {}
    try:
        for name, wl in workloads.items():
            all_results[name] = run_workload(wl, args.procs, args.repeats, args.seed, args.only)
    finally:
        leaks = remove_leftover_segments()
        shutil.rmtree(ns_dir, ignore_errors=True)
    env.update(collect_versions(all_results))
    if leaks:
        env["leaked shmcache segments"] = ", ".join(leaks)
    print(write_outputs(args, argv, env, workloads, all_results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
