"""The Redis tier on its own (shmcache/tiers/remote.py), against real redis-server processes: URLs
(passwords with URL characters masked everywhere), jump hash, reads and write-behind on one server,
shards and a Cluster, and its faults (a stopped Cluster master costs one timeout per batch)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import time

import pytest
from _clock import FakeClock
from _redis import PASSWORD, RedisServer, need_redis

from shmcache.base.urls import mask_url as mask_text
from shmcache.errors import InvalidArgument
from shmcache.tiers.remote import BACKOFF_S, RedisTier, jump_hash, mask_url, parse_url, probe

# --- URLs --------------------------------------------------------------------------------------

def test_urls_parse():
    u = parse_url(f"redis://:{PASSWORD}@10.0.0.1:6380/3")
    assert (u.kind, u.tls, u.nodes, u.db, u.password) == ("server", False, (("10.0.0.1", 6380),), 3, PASSWORD)
    assert PASSWORD not in repr(u) and PASSWORD not in str(u) and "***" in str(u)
    u = parse_url("rediss://user:pw@host")
    assert (u.tls, u.username, u.password, u.nodes) == (True, "user", "pw", (("host", 6379),))
    u = parse_url(f"redis+cluster://:{PASSWORD}@a:7000,b:7001,[::1]:7002")
    assert u.kind == "cluster" and u.nodes == (("a", 7000), ("b", 7001), ("::1", 7002))
    u = parse_url("redis+shards://h1:1,h2:2,h3:3/2?timeout=0.25")
    assert (u.kind, len(u.nodes), u.db, u.timeout_s, u.password) == ("shards", 3, 2, 0.25, None)
    u = parse_url(f"redis+shards://shmcache:{PASSWORD}@h1:1,h2:2?socket=1:%2Ftmp%2Fd%40x%2Fredis.sock")
    assert (u.username, u.nodes, u.sockets) == ("shmcache", (("h1", 1), ("h2", 2)), ((1, "/tmp/d@x/redis.sock"),))


@pytest.mark.parametrize("url, says", [
    ("http://:{pw}@h:1", "scheme"),
    ("redis://:{pw}@h:99999", "port"),
    ("redis://:{pw}@h:1,g:2", "redis+shards"),
    ("redis://:{pw}@h:1/x", "database"),
    ("redis+cluster://:{pw}@h:1/2", "database 0"),
    ("redis+shards://:{pw}@h:1,h:1", "twice"),
    ("redis://:{pw}@:6379", "no host"),
    ("redis://:{pw}@h:1?timeout=0", "timeout"),
    ("redis://:{pw}@h:1?retries=3", "unknown option"),
    ("redis+shards://:{pw}@h:1,g:2?socket=2:%2Fs", "socket= takes K:PATH"),
    ("redis+shards://:{pw}@h:1,g:2?socket=1:s", "socket= takes K:PATH"),
    ("rediss://:{pw}@h:1?socket=0:%2Fs", "unknown option"),
    ("redis+cluster://:{pw}@h:1?socket=0:%2Fs", "unknown option"),
])
def test_bad_urls_name_the_url_without_its_password(url, says):
    with pytest.raises(InvalidArgument) as err:
        parse_url(url.format(pw=PASSWORD))
    assert says in str(err.value) and PASSWORD not in str(err.value) and "***" in str(err.value)


def test_mask_url():
    assert mask_url(f"redis://:{PASSWORD}@h:1/0") == "redis://:***@h:1/0"
    assert mask_url(f"redis://user:{PASSWORD}@h:1") == "redis://user:***@h:1"
    assert mask_url(f"redis+shards://{PASSWORD}@h:1,g:2") == "redis+shards://***@h:1,g:2"
    assert mask_url("redis://h:1") == "redis://h:1"


# --- jump hash ------------------------------------------------------------------------------------

def test_jump_hash_moves_about_one_fifth_from_4_to_5():
    keys = range(0, 20_000 * 7919, 7919)
    before = [jump_hash(k * 0x9E3779B97F4A7C15, 4) for k in keys]
    after = [jump_hash(k * 0x9E3779B97F4A7C15, 5) for k in keys]
    moved = [(a, b) for a, b in zip(before, after) if a != b]
    assert all(b == 4 for _, b in moved), "a key moved between two old servers"
    assert 0.18 < len(moved) / len(before) < 0.22, len(moved) / len(before)
    assert all(0.22 < before.count(s) / len(before) < 0.28 for s in range(4))


def test_jump_hash_is_the_papers():
    # every node and the launcher's servers must agree: the values of the paper's C++ code
    # (Lamping & Veach, compiled and run once) for these keys, pinned
    keys = [0, 1, 2, 3, 4, 5, 6, 7, 123456789, 2**64 - 1, 2**63]
    assert [jump_hash(k, 7) for k in keys] == [0, 6, 6, 3, 1, 4, 5, 0, 0, 2, 5]
    assert [jump_hash(k, 1000) for k in keys] == [0, 549, 338, 961, 172, 231, 421, 97, 294, 313, 453]
    assert jump_hash(2**64 - 1, 1) == 0


# --- one server -------------------------------------------------------------------------------

def _drain(tier, n_written):
    assert tier.flush(10)
    assert tier.counters()["backlog"] == 0


def test_round_trip_one_server(redis_server):
    tier = RedisTier(redis_server.url, "cacheA")
    try:
        assert tier.get_many([b"k1", b"k2"]) == [None, None]
        tier.offer([(b"k1", b"v1" * 100), (b"k2", b"v2")])
        _drain(tier, 2)
        assert tier.get_many([b"k1", b"k2", b"k3"]) == [b"v1" * 100, b"v2", None]
        tier.offer([(b"k1", b"other")])  # SET NX: the first value stays
        _drain(tier, 1)
        assert tier.get(b"k1") == b"v1" * 100
        c = tier.counters()
        assert (c["hits"], c["misses"], c["errors"]) == (3, 3, 0)
        assert c["bytes_written"] > 202 + len(b"other")  # each in its self-checking record
        assert redis_server.cli("exists", "shmcache:cacheA:k1") == "1"
    finally:
        tier.close()


def test_another_identity_sees_nothing(redis_server):
    a, b = RedisTier(redis_server.url, "cacheA"), RedisTier(redis_server.url, "cacheB")
    try:
        a.offer([(b"k", b"a")])
        _drain(a, 1)
        assert b.get(b"k") is None and a.get(b"k") == b"a"
    finally:
        a.close()
        b.close()


def test_values_that_are_not_this_caches_records_are_misses(redis_server, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    a, b = RedisTier(redis_server.url, "cacheA"), RedisTier(redis_server.url, "cacheB")
    try:
        a.offer([(b"good", b"x" * 5000), (b"cut", b"y" * 5000)])
        b.offer([(b"k", b"from B")])
        _drain(a, 2)
        _drain(b, 1)
        whole = a.fetch([b"cut"])[0]
        redis_server.cli("set", "shmcache:cacheA:garbage", "not a record at all")
        r = __import__("redis").Redis(port=redis_server.port, password=PASSWORD)
        r.set(b"shmcache:cacheA:cut", whole[:len(whole) // 2])  # truncated
        r.set(b"shmcache:cacheA:k", b.fetch([b"k"])[0])  # another cache's record under our key
        r.set(b"shmcache:cacheA:flip", whole[:-9] + bytes([whole[-9] ^ 1]) + whole[-8:])  # a bit flipped
        r.close()
        before = a.counters()
        got = a.get_many([b"good", b"garbage", b"cut", b"k", b"flip"])
        assert got == [b"x" * 5000, None, None, None, None]
        c = {k: v - before[k] for k, v in a.counters().items()}
        assert (c["hits"], c["corrupt"], c["misses"]) == (1, 4, 4), c
        text = _no_password(caplog)
        assert text.count("is not this cache's record") == 1, text
    finally:
        a.close()
        b.close()


def test_a_redis_user_without_getrange_is_a_fault_that_names_the_command_and_the_fix(redis_server, caplog):
    """Reads are GETRANGE (a value read only as far as the largest acceptable record), not MGET: a
    user's own Redis whose ACL allows only GET and MGET refuses them. That is logged once, naming
    what was refused and the fix, never a silent miss; writes still go."""
    caplog.set_level(logging.WARNING, "shmcache")
    admin = __import__("redis").Redis(port=redis_server.port, password=PASSWORD)
    admin.acl_setuser("reader", enabled=True, passwords=["+reader-pw"], keys=["shmcache:*"],
                      commands=["-@all", "+auth", "+hello", "+ping", "+get", "+mget", "+set"])
    tier = RedisTier(f"redis://reader:reader-pw@{redis_server.addr}", "acl")
    try:
        tier.offer([(b"k", b"v" * 100)])
        assert tier.flush(10) and admin.exists(b"shmcache:acl:k")
        assert tier.get_many([b"k"]) == [None]
        assert tier.counters()["errors"] == 1, tier.counters()
        text = _no_password(caplog)
        assert "refused a command or key the tier needs" in text and "+getrange" in text, text
        assert "getrange" in text.split("(NoPermissionError:")[1], text  # which command: the server's words
    finally:
        tier.close()
        admin.acl_deluser("reader")
        admin.delete(b"shmcache:acl:k")
        admin.close()


def test_full_queue_drops_and_counts(redis_server):
    tier = RedisTier(redis_server.url, "c", queue_items=4)
    try:
        redis_server.stop()  # the writer hangs on its first batch meanwhile: the queue fills
        tier.offer([(b"a", b"1")])
        time.sleep(0.1)
        tier.offer([(str(i).encode(), b"x") for i in range(10)])
        assert tier.counters()["dropped"] >= 6
    finally:
        redis_server.cont()
        tier.close()


def test_probe(redis_server, redis_factory):
    info = probe(redis_server.url)
    assert info["answers"] and info["used_memory"] > 0 and info["maxmemory"] == 0
    assert PASSWORD not in str(info)
    wrong = probe(redis_server.url.replace(PASSWORD, "nope"))
    assert not wrong["answers"] and wrong["error"]
    capped = redis_factory(maxmemory="50mb")
    assert probe(capped.url)["maxmemory"] == 50 << 20


# --- shards and a Cluster -----------------------------------------------------------------------------

def test_shards_spread_keys_by_jump_hash(redis_factory):
    servers = [redis_factory() for _ in range(3)]
    url = f"redis+shards://:{PASSWORD}@" + ",".join(s.addr for s in servers)
    tier = RedisTier(url, "sharded")
    try:
        pairs = [(f"key{i}".encode(), f"value{i}".encode()) for i in range(300)]
        tier.offer(pairs)
        _drain(tier, 300)
        assert tier.get_many([k for k, _ in pairs] + [b"absent"]) == [v for _, v in pairs] + [None]
        counts = [int(s.cli("dbsize")) for s in servers]
        assert sum(counts) == 300 and min(counts) > 60, counts
    finally:
        tier.close()


def test_cluster_round_trip(redis_cluster):
    tier = RedisTier(redis_cluster.url, "clustered")
    try:
        pairs = [(f"key{i}".encode(), f"value{i}".encode() * 10) for i in range(200)]
        tier.offer(pairs)
        _drain(tier, 200)
        assert tier.get_many([k for k, _ in pairs] + [b"absent"]) == [v for _, v in pairs] + [None]
        assert all(int(s.cli("dbsize")) > 30 for s in redis_cluster.servers)
        assert tier.counters()["errors"] == 0
        info = probe(redis_cluster.url)
        assert info["answers"] and PASSWORD not in str(info)
    finally:
        tier.close()


# --- faults --------------------------------------------------------------------------------------

def _no_password(caplog, *more):
    text = "\n".join(r.getMessage() for r in caplog.records) + "\n".join(map(str, more))
    assert PASSWORD not in text
    return text


def test_killed_server_is_a_miss_logged_once(redis_server, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    tier = RedisTier(redis_server.url + "?timeout=0.3", "c")
    try:
        tier.offer([(b"k", b"v")])
        _drain(tier, 1)
        redis_server.kill()
        t0 = time.monotonic()
        for _ in range(20):
            assert tier.get_many([b"k", b"j"]) == [None, None]
        assert time.monotonic() - t0 < 2
        tier.offer([(b"x", b"y")])
        c = tier.counters()
        assert c["errors"] == 1, c  # the breaker: one failed call, then misses at once
        text = _no_password(caplog, c, tier)
        assert text.count("unreachable") == 1, text
    finally:
        tier.close(1)


def test_stopped_server_times_out_and_nothing_hangs(redis_server, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    clock = FakeClock()  # the breaker's: its pause is waited out by moving it
    tier = RedisTier(redis_server.url + "?timeout=0.2", "c", clock=clock)
    try:
        tier.offer([(b"k", b"v")])
        _drain(tier, 1)
        redis_server.stop()
        t0 = time.monotonic()
        assert tier.get_many([b"k"]) == [None]
        assert tier.get_many([b"k"]) == [None]
        tier.offer([(b"z", b"1")])
        assert time.monotonic() - t0 < 1.0
        text = _no_password(caplog)
        assert text.count("did not answer") == 1, text
        redis_server.cont()
        assert tier.get(b"k") is None  # the breaker is open: a miss, without asking the server
        clock.advance(BACKOFF_S[0] * 1.25)  # past the first pause (jittered by up to 20%)
        assert tier.get(b"k") == b"v"
        assert "answers again" in _no_password(caplog)
    finally:
        redis_server.cont()
        t0 = time.monotonic()
        tier.close(2)
        assert time.monotonic() - t0 < 2.5


def test_wrong_password(redis_server, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    tier = RedisTier(redis_server.url.replace(PASSWORD, "wrong-one"), "c")
    try:
        assert tier.get(b"k") is None
        tier.offer([(b"k", b"v")])
        tier.flush(2)
        assert "refused the credentials" in _no_password(caplog)
        assert tier.counters()["errors"] >= 1
    finally:
        tier.close(1)
    assert redis_server.cli("dbsize") == "0"


def test_out_of_memory_pauses_writes_not_reads(redis_factory, caplog):
    caplog.set_level(logging.WARNING, "shmcache")
    server = redis_factory(maxmemory="2mb", policy="noeviction")
    tier = RedisTier(server.url, "c")
    try:
        tier.offer([(b"first", b"v")])
        _drain(tier, 1)
        tier.offer([(f"k{i}".encode(), os.urandom(64 << 10)) for i in range(200)])  # 12.5 MB > 2 MB
        tier.flush(5)
        assert "out of memory" in _no_password(caplog)
        assert tier.get(b"first") == b"v"  # reads go on
        assert tier.counters()["dropped"] > 0
    finally:
        tier.close(1)


def test_a_fork_while_the_lock_is_held_does_not_deadlock_the_child(redis_server):
    tier = RedisTier(redis_server.url, "c")
    try:
        tier.offer([(b"k", b"v")])
        _drain(tier, 1)
        with tier._lock:  # as the writer thread may hold it at the moment of a fork
            pid = os.fork()
            if pid == 0:  # the child: its own lock, queue, thread and connections
                ok = tier.get(b"k") == b"v"
                tier.offer([(b"child", b"c")])
                ok = ok and tier.flush(5)
                os._exit(0 if ok else 1)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child deadlocked on the lock it inherited")
        assert os.waitstatus_to_exitcode(status) == 0
        assert tier.get(b"child") == b"c"
    finally:
        tier.close()


def test_tls(redis_factory, tmp_path):
    from _redis import make_certs

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no certificates for a TLS server")
    certs = make_certs(tmp_path / "certs")
    server = redis_factory(tls=certs)
    tier = RedisTier(server.url + f"?ca={certs['ca']}", "tls")
    try:
        tier.offer([(b"k", b"over TLS")])
        _drain(tier, 1)
        assert tier.get(b"k") == b"over TLS" and tier.counters()["errors"] == 0
        assert probe(server.url + f"?ca={certs['ca']}")["answers"]
    finally:
        tier.close()
    # a client that cannot check the certificate refuses the server: a miss, never plain text
    untrusting = RedisTier(server.url, "tls")
    try:
        assert untrusting.get(b"k") is None and untrusting.counters()["errors"] == 1
    finally:
        untrusting.close()


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
    clock = FakeClock()  # the breaker's: its pause is waited out by moving it
    tier = RedisTier(redis_cluster.url + "?timeout=0.3", "clustered", clock=clock)
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
        clock.advance(BACKOFF_S[0] * 1.25)  # past the breaker's first pause (jittered by up to 20%)
        assert tier.get_many([k for k, _ in pairs]) == [v for _, v in pairs]
    finally:
        redis_cluster.servers[1].cont()
        tier.close(2)
