"""The metrics as a monitoring system reads them: `shmcache stat --prometheus` and the launcher's
`/metrics`, parsed by prometheus_client's own parser and compared with `stats()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _journey import env, run

from shmcache.tiers.prometheus import METRICS, RANK_METRICS

parser = pytest.importorskip("prometheus_client.parser")
LOOP = Path(__file__).with_name("_stall_loop.py")


def samples(text: str) -> dict:
    """{(metric sample name, frozenset of labels): value} of an exposition, with each family's type."""
    out, types = {}, {}
    for fam in parser.text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out, types


def check_equal(text: str, st: dict) -> None:
    got, types = samples(text)
    base = {("session", st["session"]), ("cache", st["name"])}
    assert got[("shmcache_cache_up", frozenset(base))] == 1.0
    compared = 0
    for key, (name, kind, _) in METRICS.items():
        if key not in st:
            continue
        assert types[name] == kind, name
        sample = name + "_total" if kind == "counter" else name
        assert got[(sample, frozenset(base))] == st[key], key
        compared += 1
    for rank, per in st["ranks"].items():
        for key, (name, kind, _) in RANK_METRICS.items():
            sample = name + "_total" if kind == "counter" else name
            assert got[(sample, frozenset(base | {("rank", rank)}))] == per[key], (rank, key)
            compared += 1
    assert compared >= len([k for k in METRICS if k in st]) + 4


def test_stat_prometheus_equals_stats(tmp_path):
    e = env()
    e["RANK"] = "5"
    st = json.loads(run([LOOP, "timed", 0.0, 0.0], tmp_path, e).splitlines()[-1])
    assert st["ranks"]["5"]["stall_waits"] == 8
    text = run(["-m", "shmcache", "stat", "--prometheus"], tmp_path, env())
    check_equal(text, st)
    assert "shmcache_hits_total{" in text and "shmcache_input_stall_seconds_total{" in text
    # one session only, and the json and the exposition agree
    text = run(["-m", "shmcache", "stat", "stall", "--prometheus"], tmp_path, env())
    (row,) = json.loads(run(["-m", "shmcache", "stat", "stall", "--json"], tmp_path, env()))
    check_equal(text, row)


def test_stat_prometheus_of_nothing_parses(tmp_path):
    text = run(["-m", "shmcache", "stat", "--prometheus"], tmp_path, env())
    got, _ = samples(text)
    assert got == {}
