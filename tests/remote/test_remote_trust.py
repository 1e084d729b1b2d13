"""Issue 16, the remote tier: a Redis value is input from whoever can write to that Redis. A planted
pickle runs nothing; with the job's secret ($SHMCACHE_SECRET, secret=) a forged value, or one copied
under another key, is a counted miss and never served. Two "nodes" are two namespaces of this
process (each its own shared memory), against a real redis-server."""

from __future__ import annotations

import json
import logging

import pytest
import redis
import zstandard
from _planted import Evil, Thing

from shmcache import ShmDatasetCache
from shmcache.base.namespace import namespace
from shmcache.cache import codec
from shmcache.cache.registry import SessionRegistry
from shmcache.cli.main import main as cli
from shmcache.tiers.records import pack_record
from shmcache.tiers.tiered_store import portable_key, portable_record

SECRET = "job-secret-0f3a9c"
pytestmark = pytest.mark.filterwarnings("ignore:.*stored with pickle:UserWarning")




@pytest.fixture
def nodes(tmp_path):
    """``node(i, **kw)``: a named cache "c" in namespace i of its own, with the remote in force."""
    made, roots = [], []

    def node(i, url, **kw):
        root = tmp_path / f"node{i}"
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SHMCACHE_DIR", str(root))
            cache = ShmDatasetCache(session="s", name="c", remote=url, **kw)
        made.append(cache)
        roots.append(root)
        return cache

    yield node
    for cache in made:
        cache.close()
    for root in set(roots):
        registry = SessionRegistry(namespace(root))
        for info in registry.list():
            registry.destroy(info.name, force=True)


def _flush(cache):
    assert cache.store.behind[0].flush(10)


def _client(server):
    host, port = server.addr.split(":")
    return redis.Redis(host=host, port=int(port), password=server.password)


def _rkey(key) -> bytes:
    return b"shmcache:c:" + portable_key(key)


def _logs(caplog) -> str:
    return "\n".join(r.getMessage() for r in caplog.records)


def test_a_planted_pickle_in_redis_runs_no_code(redis_server, nodes, tmp_path, caplog):
    """Anyone who can write to the Redis stored {"obj": Evil()}: every other node that read it ran
    its code. Now the value is refused unread: a miss, computed from the source, and one log line
    naming the opt-in."""
    caplog.set_level(logging.WARNING, "shmcache")
    marker = tmp_path / "ran"
    a = nodes(0, redis_server.url)
    a.get(5, lambda k: {"obj": Evil(marker), "x": 1})
    _flush(a)
    assert _client(redis_server).exists(_rkey(5)) and not marker.exists()
    b = nodes(1, redis_server.url)
    assert b.get(5, lambda k: {"obj": None, "x": 2}) == {"obj": None, "x": 2}
    assert not marker.exists(), "the planted pickle ran"
    assert b.stats()["tier_pickle_refused"] == 1
    assert "allow_pickle=True" in _logs(caplog)


def test_own_pickled_values_round_trip_with_the_secret_or_the_opt_in(redis_server, nodes):
    """The job's own values (its secret on both sides) keep working, pickled objects included;
    without a secret, allow_pickle=True opts in."""
    a = nodes(0, redis_server.url, secret=SECRET)
    a.get(1, lambda k: {"obj": Thing(7), "x": 1})
    _flush(a)
    b = nodes(1, redis_server.url, secret=SECRET)
    assert b.get(1, lambda k: pytest.fail("computed again")) == {"obj": Thing(7), "x": 1}
    assert b.stats()["remote_forged"] == 0 and b.stats()["remote_hits"] == 1

    c = nodes(2, redis_server.url, secret="")  # no secret: data, and pickles only with the opt-in
    d = nodes(3, redis_server.url, secret="", allow_pickle=True)
    c.get(2, lambda k: {"obj": Thing(8)})
    _flush(c)
    assert d.get(2, lambda k: pytest.fail("computed again")) == {"obj": Thing(8)}


def _forge(key, value, rkey=None) -> bytes:
    """What an attacker with the Redis password (not the secret) writes: a well-formed record,
    checksums recomputed, for ``key``."""
    rec = portable_record(codec.encode(value), key)
    return b"".join(pack_record(rkey or _rkey(key), rec, zstandard.ZstdCompressor()))


def test_a_forged_value_with_a_secret_is_a_counted_miss_and_replaced(redis_server, nodes, monkeypatch, caplog,
                                                                     capsys, tmp_path):
    """A value with recomputed checksums but no MAC (or another secret's) was served as right.
    With the job's secret it is a miss, counted as remote_forged; the value computed then replaces
    it in Redis, so the next node reads the job's own."""
    caplog.set_level(logging.WARNING, "shmcache")
    monkeypatch.setenv("SHMCACHE_SECRET", SECRET)  # the launcher's way: every worker has it
    r = _client(redis_server)
    r.set(_rkey(3), _forge(3, {"x": -1}))
    b = nodes(1, redis_server.url)
    assert b.get(3, lambda k: {"x": 3}) == {"x": 3}
    st = b.stats()
    assert st["remote_forged"] == 1 and st["remote_hits"] == 0
    assert "forged" in _logs(caplog)
    with pytest.MonkeyPatch.context() as mp:  # `shmcache stat` on that node
        mp.setenv("SHMCACHE_DIR", str(tmp_path / "node1"))
        capsys.readouterr()
        assert cli(["stat", "--json"]) == 0
        assert json.loads(capsys.readouterr().out)[0]["remote_forged"] == 1
    _flush(b)
    c = nodes(2, redis_server.url)
    assert c.get(3, lambda k: pytest.fail("computed again")) == {"x": 3}
    assert c.stats()["remote_forged"] == 0
    # another secret's value is forged too
    e = nodes(3, redis_server.url, secret="another-job")
    assert e.get(3, lambda k: {"x": 3}) == {"x": 3} and e.stats()["remote_forged"] == 1


def test_a_value_copied_under_another_key_is_not_served(redis_server, nodes):
    """A signed value of key 1 written under key 2's name (its key and checksums rewritten, its
    MAC trailer kept) is not key 2's value."""
    a = nodes(0, redis_server.url, secret=SECRET)
    a.get(1, lambda k: {"x": 1})
    _flush(a)
    r = _client(redis_server)
    signed = r.get(_rkey(1))
    assert len(signed) > 40
    body = _forge(1, {"x": 1}, rkey=_rkey(2))  # key 2's header, key 1's value
    r.set(_rkey(2), body + signed[-40:])
    r.set(_rkey(4), signed)  # the value as it is, under another key
    b = nodes(1, redis_server.url, secret=SECRET)
    assert b.get(2, lambda k: {"x": 2}) == {"x": 2}
    assert b.get(4, lambda k: {"x": 4}) == {"x": 4}
    assert b.get(1, lambda k: pytest.fail("computed again")) == {"x": 1}
    assert b.stats()["remote_forged"] == 2
