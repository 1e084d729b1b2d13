"""The launcher's ``--metrics-port``: ``/metrics`` of the node (every cache of the namespace, as
``shmcache stat --prometheus`` prints it, read on each scrape) served from a daemon thread of the
launcher while the job runs; and the job's closing summary per cache of its session.

The server binds ``--metrics-addr`` (default 127.0.0.1: only this machine can scrape it). To let
a Prometheus server on another machine scrape it, bind an address it can reach (``--metrics-addr
0.0.0.0``, or the node's address on the cluster network) and keep the port behind the cluster's
firewall: the metrics name sessions, caches and datasets, and the endpoint has no authentication.
"""

from __future__ import annotations

from typing import Any

from ..cache.registry import SessionRegistry
from ..errors import InvalidArgument
from ..tiers.node_stats import node_rows

__all__ = ["start", "summary"]


def start(registry: SessionRegistry, host: str, port: int) -> Any:
    """The running server (``server.server_address``: where; ``server.shutdown()`` stops it)."""
    from ..tiers.prometheus import serve

    try:
        return serve(port, host, lambda: node_rows(registry))
    except OSError as exc:  # taken, or an address this machine does not have
        raise InvalidArgument(f"--metrics-port {port} on {host} cannot be served ({exc.strerror or exc}): "
                              f"pick another port (0: a free one) or address (--metrics-addr)") from None


def stop(server: Any) -> None:
    server.shutdown()
    server.server_close()


def summary(registry: SessionRegistry, session: str) -> list[str]:
    """One line per cache of ``session`` for the end of the job: hit ratio, stall share (of every
    rank's loop), values computed, and bytes served (hits times the average item size: an estimate,
    there is no counter of bytes)."""
    lines = []
    try:
        rows = node_rows(registry, session)
    except Exception as exc:  # noqa: BLE001 - a summary is no reason to change the exit status
        return [f"cache summary unavailable: {exc}"]
    for st in rows:
        if "error" in st:
            lines.append(f"cache {st['session']}/{st['name']}: {st['error']}")
            continue
        looked = st["hits"] + st["misses"]
        ratio = f"{st['hits'] / looked:.1%}" if looked else "-"
        stall = f"{st['stall_share']:.1%}" if st["loop_seconds"] else "not measured"
        served = st["hits"] * st["avg_item_bytes"]
        lines.append(f"cache {st['session']}/{st['name']}: hit ratio {ratio} ({st['hits']} hits, "
                     f"{st['misses']} misses), stall share {stall}, computed {st['computed']}, "
                     f"served ~{served / 2**20:.1f} MiB from the cache")
    return lines
