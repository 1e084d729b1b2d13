"""The node's cache statistics in Prometheus's text exposition format: ``shmcache stat
--prometheus`` (for node_exporter's textfile collector, or a cron job) and the launcher's
``--metrics-port`` (``/metrics``). Built with ``prometheus_client`` (``pip install
'shmcache[metrics]'``), imported only here and only when asked for.

Every metric is labelled by ``session`` and ``cache``; the input-stall ones also by ``rank``.
Counters are counters (``_total``), gauges are gauges, and units are in the names (``_bytes``,
``_seconds``). ``METRICS`` maps each key of ``stats()`` to its metric, so
the exposition and ``stats()`` hold the same numbers (a test checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InvalidArgument

__all__ = ["METRICS", "RANK_METRICS", "exposition", "serve", "require"]

# stats key -> (metric name without _total, "counter" or "gauge", help)
METRICS: dict[str, tuple[str, str, str]] = {
    "items_mem": ("shmcache_items_memory", "gauge", "Items held in shared memory."),
    "items_disk": ("shmcache_items_disk", "gauge", "Items spilled to disk."),
    "bytes_mem": ("shmcache_memory_bytes", "gauge", "Bytes of the items in shared memory."),
    "bytes_disk": ("shmcache_disk_bytes", "gauge", "Bytes of the spilled items on disk (as stored)."),
    "bytes_disk_raw": ("shmcache_disk_raw_bytes", "gauge", "Bytes of the spilled items before compression."),
    "avg_item_bytes": ("shmcache_item_average_bytes", "gauge", "Average bytes per item."),
    "capacity_bytes": ("shmcache_capacity_bytes", "gauge", "The cache's memory cap (0: the session's automatic cap)."),
    "committed_bytes": ("shmcache_committed_bytes", "gauge", "Shared memory committed to the cache's items."),
    "shm_bytes": ("shmcache_shm_bytes", "gauge", "Shared memory the cache's segments take."),
    "hits": ("shmcache_hits", "counter", "Reads served from shared memory or spill."),
    "misses": ("shmcache_misses", "counter", "Reads not found in shared memory or spill."),
    "rejected": ("shmcache_rejected", "counter", "Values not admitted (full, index could not grow, lock stuck)."),
    "corrupt": ("shmcache_corrupt", "counter", "Spilled records that failed their checks."),
    "computed": ("shmcache_computed", "counter", "Values computed from the source."),
    "claim_waits": ("shmcache_claim_waits", "counter", "Misses served a value another process computed."),
    "claim_timeouts": ("shmcache_claim_timeouts", "counter", "Misses that waited out a claim, then computed."),
    "tier_admitted": ("shmcache_tier_admitted", "counter", "Tier hits stored in shared memory."),
    "tier_undecodable": ("shmcache_tier_undecodable", "counter", "Intact tier records no value could be decoded from."),
    "tier_pickle_refused": ("shmcache_tier_pickle_refused", "counter", "Unsigned tier records refused (pickle)."),
    "remote_hits": ("shmcache_remote_hits", "counter", "Reads served by the remote tier."),
    "remote_misses": ("shmcache_remote_misses", "counter", "Reads the remote tier did not have."),
    "remote_bytes_read": ("shmcache_remote_read_bytes", "counter", "Bytes read from the remote tier."),
    "remote_bytes_written": ("shmcache_remote_written_bytes", "counter", "Bytes written to the remote tier."),
    "remote_errors": ("shmcache_remote_errors", "counter", "Remote tier faults."),
    "remote_corrupt": ("shmcache_remote_corrupt", "counter", "Remote records that failed their checks."),
    "remote_dropped": ("shmcache_remote_dropped", "counter", "Values offered to the remote tier and never written."),
    "remote_forged": ("shmcache_remote_forged", "counter", "Remote values without the job's MAC."),
    "remote_backlog": ("shmcache_remote_backlog_items", "gauge", "Values queued for the remote tier now."),
    "snapshot_hits": ("shmcache_snapshot_hits", "counter", "Reads served by the snapshot read through."),
    "snapshot_misses": ("shmcache_snapshot_misses", "counter", "Reads the snapshot did not have."),
    "snapshot_bytes_read": ("shmcache_snapshot_read_bytes", "counter", "Bytes read from the snapshot."),
    "snapshot_reads": ("shmcache_snapshot_reads", "counter", "Batched reads of the snapshot."),
    "snapshot_errors": ("shmcache_snapshot_errors", "counter", "Snapshot faults."),
    "snapshot_corrupt": ("shmcache_snapshot_corrupt", "counter", "Snapshot records that failed their checks."),
    "snapshot_forged": ("shmcache_snapshot_forged", "counter", "Snapshot records without the job's MAC."),
}
# each rank's key of stats()["ranks"][rank] -> its metric, labelled by rank too (NOTE [stall counts])
RANK_METRICS: dict[str, tuple[str, str, str]] = {
    "stall_waits": ("shmcache_input_waits", "counter", "Batches the rank's training loop waited for."),
    "stall_seconds": ("shmcache_input_stall_seconds", "counter", "Time the rank's training loop waited for batches."),
    "loop_seconds": ("shmcache_input_loop_seconds", "counter", "Time of the rank's training loop (waits and steps)."),
    "stall_share": ("shmcache_input_stall_ratio", "gauge", "Share of the loop's time spent waiting (since the start)."),
}
_LABELS = ["session", "cache"]


def require() -> Any:
    """``prometheus_client``, or an error saying how to install it."""
    try:
        import prometheus_client
    except ImportError:
        raise InvalidArgument("the Prometheus output needs the prometheus_client package: "
                              "pip install 'shmcache[metrics]'") from None
    return prometheus_client


def _families(rows: list[dict]) -> list[Any]:
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def family(name: str, kind: str, doc: str, labels: list[str]) -> Any:
        cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
        return cls(name, doc, labels=labels)

    up = GaugeMetricFamily("shmcache_cache_up", "1: the cache was read; 0: it could not be opened.",
                           labels=_LABELS)
    info = GaugeMetricFamily("shmcache_cache_info", "The cache's dataset (wrap(label=), else its repr) "
                             "and tiers, as labels.", labels=[*_LABELS, "dataset", "remote", "snapshot"])
    fams = {key: family(*spec, _LABELS) for key, spec in METRICS.items()}
    rank_fams = {key: family(*spec, [*_LABELS, "rank"]) for key, spec in RANK_METRICS.items()}
    for st in rows:
        labels = [st["session"], st["name"]]
        up.add_metric(labels, 0.0 if "error" in st else 1.0)
        if "error" in st:
            continue
        info.add_metric([*labels, (st.get("label") or "")[:200], st.get("remote") or "",
                         st.get("snapshot") or ""], 1.0)
        for key, fam in fams.items():
            if key in st:
                fam.add_metric(labels, float(st[key]))
        for rank, per in st.get("ranks", {}).items():
            for key, fam in rank_fams.items():
                fam.add_metric([*labels, rank], float(per[key]))
    return [up, info, *fams.values(), *rank_fams.values()]


class _Collector:
    """Reads the node's rows on every scrape (``rows()``)."""

    def __init__(self, rows: Callable[[], list[dict]]):
        self._rows = rows

    def collect(self):
        yield from _families(self._rows())


def exposition(rows: list[dict]) -> str:
    """``rows`` (``shmcache stat --json``'s) in the text exposition format."""
    client = require()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(lambda: rows))
    return client.generate_latest(registry).decode()


def serve(port: int, host: str, rows: Callable[[], list[dict]]) -> Any:
    """Serve ``/metrics`` on ``host:port`` from a daemon thread, ``rows()`` read on each scrape;
    returns the server (``shutdown()`` stops it). Its address is ``server.server_address``."""
    client = require()
    registry = client.CollectorRegistry(auto_describe=False)
    registry.register(_Collector(rows))
    server, _thread = client.start_http_server(port, addr=host, registry=registry)
    return server
