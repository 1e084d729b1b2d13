"""Several nodes, one cache each (issue 11): a job of 2 "nodes" x 2 processes on this machine.

Each node is a ``python -m shmcache.launch --nnodes 2 --node-rank K --nproc 2`` with a namespace of
its own (``$SHMCACHE_DIR``), as two machines would each have their own ``/dev/shm``; the four ranks
join one gloo group over loopback (for the barriers between epochs) and read a cached dataset
through ``NodeAffineSampler`` - set up from the launcher's environment, not from arguments - for 3
epochs. From epoch 2 every read must be a hit of the node's cache, and each node must cache its own
part (1/2 of the data) and nothing else. The same job with ``DistributedSampler`` misses in epoch 2
and fills both caches with most of the dataset: what the sampler is for, and proof the checks bite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from shmcache.base.namespace import namespace
from shmcache.cache.registry import SessionRegistry

REPO = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "launch_scripts" / "node_affine_epochs.py"
N, EPOCHS, NODES, NPROC = 1000, 3, 2, 2


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_job(tmp_path: Path, kind: str) -> tuple[list[dict], list]:
    """Two launchers, one per node namespace; returns (the ranks' records, the namespaces)."""
    port = str(_free_port())
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
               TMPDIR=str(tmp_path))
    namespaces, procs = [], []
    try:
        for k in range(NODES):
            ns = namespace(tmp_path / f"node{k}")
            namespaces.append(ns)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "shmcache.launch", "--nnodes", str(NODES), "--node-rank",
                 str(k), "--nproc", str(NPROC), "--master-addr", "127.0.0.1", "--master-port", port,
                 "--session", "job", str(SCRIPT), str(tmp_path), str(N), str(EPOCHS), kind],
                env=dict(env, SHMCACHE_DIR=str(ns.root)), stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True))
        for proc in procs:
            _, err = proc.communicate(timeout=90)
            assert proc.returncode == 0, err[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()  # its workers follow (PR_SET_PDEATHSIG)
                proc.communicate(timeout=30)
        for ns in namespaces:  # the autouse fixture only knows the test's own namespace
            registry = SessionRegistry(ns)
            for info in registry.list():
                registry.destroy(info.name, force=True)
            assert not ns.owned_segments()
    records = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(NODES * NPROC)]
    return records, namespaces


def _node_view(records: list[dict], k: int) -> dict:
    """Node k's reads per epoch (its ranks together), and its cache's stats per epoch."""
    ranks = records[k * NPROC:(k + 1) * NPROC]
    return {
        "read": [sorted(i for r in ranks for i in r["epochs"][e]["read"]) for e in range(EPOCHS)],
        "calls": [sum(r["epochs"][e]["calls"] for r in ranks) for e in range(EPOCHS)],
        "stats": [ranks[0]["epochs"][e] for e in range(EPOCHS)],  # local rank 0 read the stats
        "cached": set(ranks[0]["cached"]),
    }


def test_two_nodes_hit_their_own_cache_from_epoch_two(tmp_path):
    records, _ = _run_job(tmp_path, "node_affine")
    assert {r["len"] for r in records} == {N // (NODES * NPROC)}
    probes = {0, N // 2, N - 1}  # wrap() stores these on every node: it reads them to name the cache
    for k in range(NODES):
        node = _node_view(records, k)
        part = set(range(k, N, NODES))
        for e in range(EPOCHS):  # the node reads its part, exactly once each, every epoch
            assert node["read"][e] == sorted(part), f"node {k} epoch {e + 1}"
        stats = node["stats"]
        assert stats[0]["misses"] == len(part - probes) == node["calls"][0]
        for e in range(1, EPOCHS):
            assert stats[e]["misses"] == stats[0]["misses"], f"node {k}: a miss in epoch {e + 1}"
            assert stats[e]["hits"] - stats[e - 1]["hits"] == len(part), f"node {k} epoch {e + 1}"
            assert node["calls"][e] == 0
        assert node["cached"] == part | probes  # its part (1/N of the data), nothing else
        assert stats[-1]["items_mem"] == len(part | probes)
    # the nodes' reads are disjoint and together the whole dataset, every epoch
    for e in range(EPOCHS):
        reads = [i for k in range(NODES) for i in _node_view(records, k)["read"][e]]
        assert sorted(reads) == list(range(N))


@pytest.mark.slow
def test_distributed_sampler_misses_across_nodes(tmp_path):
    """The baseline the sampler exists for (and proof that the checks above can fail): with
    DistributedSampler(shuffle=True) a node reads about half its samples in epoch 2 for the first
    time, and by epoch 3 each node has cached about 3/4 of the dataset."""
    records, _ = _run_job(tmp_path, "distributed")
    for k in range(NODES):
        node = _node_view(records, k)
        stats = node["stats"]
        assert stats[1]["misses"] - stats[0]["misses"] > N // 2 * 0.3  # ~1/2 of N/2 reads
        assert len(node["cached"]) > 0.6 * N
