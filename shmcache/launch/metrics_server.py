"""The launcher's ``--metrics-port``: ``/metrics`` of the node (every cache of the namespace, as
``shmcache stat --prometheus`` prints it, read on each scrape) served from a daemon thread of the
launcher while the job runs; and the job's closing summary per cache of its session that the job
used, counted over the job only (its counters less their reading at the start: ``reading``).

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

__all__ = ["start", "reading", "summary"]


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


# what the closing summary counts of a job: these counters less their reading when it started
_COUNTED = ("hits", "misses", "computed", "stall_seconds", "loop_seconds")
_OF_GENERATION = ("hits", "misses")  # in the generation's meta: zero again after clear(); the others per cache


def reading(registry: SessionRegistry, session: str) -> dict[str, dict]:
    """The counters of each cache of ``session`` now (the launcher's, before its job starts), for
    ``summary`` to subtract: the session outlives the job, and so do its caches' counters."""
    try:
        rows = node_rows(registry, session)
    except Exception:  # noqa: BLE001 - no reading: the summary counts what the caches hold (as before)
        return {}
    return {st["name"]: {k: st[k] for k in (*_COUNTED, "incarnation", "generation")}
            for st in rows if "error" not in st}


def summary(registry: SessionRegistry, session: str, before: dict[str, dict] | None = None) -> list[str]:
    """One line per cache of ``session`` that the job used, for the end of the job: hit ratio,
    stall share (of every rank's loop), values computed, and bytes served (hits times the average
    item size: an estimate, there is no counter of bytes) - in the job, the counters less their
    ``reading`` at its start (``before``). A cache whose counters did not move is left out (a
    warm rerun's summary said `hit ratio 50%` and listed the caches of earlier jobs); one whose
    counters went back (cleared, or destroyed and made again, in the job) counts from zero."""
    lines = []
    try:
        rows = node_rows(registry, session)
    except Exception as exc:  # noqa: BLE001 - a summary is no reason to change the exit status
        return [f"cache summary unavailable: {exc}"]
    for st in rows:
        if "error" in st:
            lines.append(f"cache {st['session']}/{st['name']}: {st['error']}")
            continue
        was = (before or {}).get(st["name"])
        got = {k: st[k] for k in _COUNTED}
        if was is not None:
            # a counter of another incarnation (destroyed and made again in the job), or of another
            # generation (cleared), is not the job's to subtract: the new one started at zero
            same_cache = was["incarnation"] == st["incarnation"]
            same_gen = same_cache and was["generation"] == st["generation"]
            for k in _COUNTED:
                base = was[k] if (same_gen if k in _OF_GENERATION else same_cache) else 0
                got[k] -= base if got[k] >= base else 0  # one that went back anyway counts from zero
            if not any(got[k] for k in ("hits", "misses", "computed")):
                continue  # the job never read it
        looked = got["hits"] + got["misses"]
        ratio = f"{got['hits'] / looked:.1%}" if looked else "-"
        stall = f"{got['stall_seconds'] / got['loop_seconds']:.1%}" if got["loop_seconds"] > 0 else "not measured"
        served = got["hits"] * st["avg_item_bytes"]
        lines.append(f"cache {st['session']}/{st['name']}: hit ratio {ratio} ({got['hits']} hits, "
                     f"{got['misses']} misses), stall share {stall}, computed {got['computed']}, "
                     f"served ~{served / 2**20:.1f} MiB from the cache")
    return lines
