"""An adversary's review of the remote tier (issue 11): passwords that a URL parser and its masker
read differently, and faults a real server makes that the first tests did not make."""

from __future__ import annotations

import logging
import re
import time

import numpy as np
import pytest
from _redis import RedisServer, need_redis

from shmcache import ShmDatasetCache
from shmcache.base.urls import mask_url as mask_text
from shmcache.errors import InvalidArgument
from shmcache.tiers.remote import RedisTier, mask_url, parse_url

# generated passwords (base64, `openssl rand -base64`) hold "/" and "+"; people type "@" and "?"
ODD_PASSWORDS = ["Ab3/xY9+kL0q/Zz8", "p@ss@w0rd-9x7", "qu?ery#hash-4k2"]


def _pieces(pw: str) -> list[str]:
    """The parts of ``pw`` between its URL characters (3+ characters: none is a common word)."""
    return [p for p in re.split(r"[/@?#]", pw) if len(p) >= 3]


@pytest.mark.parametrize("pw", ODD_PASSWORDS)
def test_a_password_with_url_characters_is_masked_everywhere(pw):
    """parse_url took everything up to the last '@' as the userinfo, but mask_url stopped at the
    first '/' or '@': a password with a '/' was shown whole in every log line, error, stat and
    repr; one with an '@' in part; a '?' split it into a host and a 'port' named in the error."""
    url = f"redis://:{pw}@127.0.0.1:6390/2"
    u = parse_url(url)
    assert (u.password, u.nodes, u.db) == (pw, (("127.0.0.1", 6390),), 2)
    shown = [str(u), repr(u), mask_url(url), mask_text(f"--remote {url} --nnodes 2")]
    for text in shown:
        assert "***" in text, text
        for part in _pieces(pw):
            assert part not in text, (part, text)
    with pytest.raises(InvalidArgument) as err:
        parse_url(f"redis://:{pw}@127.0.0.1:99999")
    assert "99999" in str(err.value) and pw not in str(err.value)
    for part in _pieces(pw):
        assert part not in str(err.value), (part, str(err.value))


def test_a_slash_password_never_reaches_the_log(tmp_path, caplog):
    """End to end against a server whose password has a '/': the tier's log lines (here: the
    server killed) carry the masked URL."""
    need_redis()
    pw = ODD_PASSWORDS[0]
    server = RedisServer(tmp_path, pw)
    caplog.set_level(logging.WARNING, "shmcache")
    tier = RedisTier(f"redis://:{pw}@{server.addr}?timeout=0.3", "c")
    try:
        tier.offer([(b"k", b"v")])
        assert tier.flush(5)
        assert tier.get(b"k") == b"v"
        server.kill()
        assert tier.get(b"k") is None
        text = "\n".join(r.getMessage() for r in caplog.records) + repr(tier)
        assert "unreachable" in text and "***" in text
        assert "Ab3" not in text and "Zz8" not in text, text
    finally:
        tier.close(1)
        server.close()


def test_a_stopped_cluster_master_costs_one_timeout_per_batch(redis_cluster, caplog):
    """A batch's read on a Cluster with one master SIGSTOPped took ~36 timeouts (10.9 s with
    ?timeout=0.3, for 100 keys): redis-py's cluster pipeline, after the timeout, re-sent each of
    the stopped master's keys on its own, each waiting its own timeout (a 256-key batch at the
    default 1 s: about 85 s of a training step). A batch must cost at most about one timeout."""
    caplog.set_level(logging.WARNING, "shmcache")
    tier = RedisTier(redis_cluster.url + "?timeout=0.3", "clustered")
    try:
        pairs = [(f"key{i}".encode(), f"value{i}".encode()) for i in range(100)]
        tier.offer(pairs)
        assert tier.flush(10)
        assert tier.get_many([k for k, _ in pairs]) == [v for _, v in pairs]
        redis_cluster.servers[1].stop()
        t0 = time.monotonic()
        got = tier.get_many([k for k, _ in pairs])
        took = time.monotonic() - t0
        assert took < 1.5, f"one batch took {took:.1f} s with a 0.3 s timeout"
        assert all(v is None or v == dict(pairs)[k] for (k, _), v in zip(pairs, got))
        assert "did not answer" in "\n".join(r.getMessage() for r in caplog.records)
        redis_cluster.servers[1].cont()
        time.sleep(1.3)  # past the breaker's first pause
        assert tier.get_many([k for k, _ in pairs]) == [v for _, v in pairs]
    finally:
        redis_cluster.servers[1].cont()
        tier.close(2)


class _Numbers:
    """A small map-style dataset; ``seed`` makes another dataset of the same length and type."""

    def __init__(self, seed, n=24):
        self.seed, self.n = seed, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return np.full(64, self.seed * 1000 + i, np.int64)


def test_an_imported_cache_shares_its_remote_values_by_dataset_not_by_name(redis_server, tmp_path):
    """ShmDatasetCache.from_snapshot opened its remote tier before the import told it the
    dataset, so the tier kept the bare cache name as its identity ('train', where every other
    process of the cache uses 'train.<fingerprint>'): an imported node shared nothing with the
    others, and two datasets imported under one name read each other's values - a wrong value."""
    snaps = {}
    for seed in (1, 2):  # two datasets, both exported as cache "train", items 0-7 only
        cache = ShmDatasetCache(session=f"make{seed}", name="train", remote="")
        ds = cache.wrap(_Numbers(seed))
        for i in range(8):
            ds[i]
        snaps[seed] = tmp_path / f"snap{seed}"
        cache.export(snaps[seed])
        cache.close()
    a = ShmDatasetCache.from_snapshot(snaps[1], session="node_a", remote=redis_server.url)
    b = ShmDatasetCache.from_snapshot(snaps[2], session="node_b", remote=redis_server.url)
    try:
        da, db = a.wrap(_Numbers(1)), b.wrap(_Numbers(2))
        assert int(da[15][0]) == 1015  # computed on node a, written to Redis behind the loop
        a.store.behind[0].flush(5)
        assert int(db[15][0]) == 2015, "node b was served dataset 1's value"
        other = ShmDatasetCache(session="node_c", name="train", remote=redis_server.url)
        try:  # a third node of dataset 1, opened the ordinary way, finds node a's value
            dc = other.wrap(_Numbers(1))
            assert other.store.behind[0].identity == a.store.behind[0].identity
            assert int(dc[15][0]) == 1015
        finally:
            other.close()
    finally:
        a.close()
        b.close()
