"""The Redis that `--remote spawn` starts runs as the launcher's user, and its password crosses
the network in clear at every AUTH (design 9): whoever holds it may change the cache's values,
never run code, read or destroy anything else, or take the server. Its `default` user is off;
the workers' user (NOTE [spawned redis], 3 in shmcache/launch/redis_node.py) may run what the
remote tier sends, on the cache's keys, and nothing else: no Lua (EVAL, FUNCTION), no ACL (which
opened the server to every local user by `ACL SETUSER default nopass`), no replication (SYNC: a
full dump), no MIGRATE, CLIENT, SHUTDOWN, DEBUG, CONFIG (on Redis 5 and 6, `CONFIG SET dir` and
`SAVE` write a file of the client's choosing as that user), MODULE, KEYS, SCAN or FLUSHALL."""

from __future__ import annotations

import os
import shutil
import socket

import pytest
import redis

from shmcache.errors import LaunchError
from shmcache.launch.redis_node import WORKER_USER, RedisNode, find_redis_server, server_version
from shmcache.tiers.remote import RedisTier

if shutil.which("redis-server") is None and os.environ.get("SHMCACHE_REQUIRE_REAL_PARTS") == "1":
    raise RuntimeError("redis-server is missing but $SHMCACHE_REQUIRE_REAL_PARTS=1: install it "
                       "(`apt-get install redis-server`) - these tests must run here")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (apt-get install redis-server)")

PASSWORD = "a-job-password-0123456789"

#: What a worker's password must not open. DEBUG and MODULE are also off by Redis 7's own
#: defaults (enable-debug-command, enable-module-command), which answer before the ACL does.
_REFUSED = [("FUNCTION", "LOAD", "#!lua name=x\nredis.register_function('f', function() return 1 end)"),
            ("FCALL", "f", "0"), ("EVAL", "return 1", "0"), ("EVALSHA", "0" * 40, "0"), ("SCRIPT", "FLUSH"),
            ("ACL", "SETUSER", "default", "on", "nopass", "+@all", "~*"), ("ACL", "LIST"),
            ("SYNC",), ("PSYNC", "?", "-1"), ("REPLICAOF", "127.0.0.1", "1"), ("SLAVEOF", "NO", "ONE"),
            ("MIGRATE", "127.0.0.1", "1", "shmcache:k", "0", "1000"), ("CLIENT", "PAUSE", "100"),
            ("CLIENT", "KILL", "TYPE", "normal"), ("CLIENT", "LIST"), ("SHUTDOWN", "NOSAVE"),
            ("DEBUG", "SLEEP", "0"), ("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "*"),
            ("MODULE", "LOAD", "/tmp/x.so"),
            ("GET", "shmcache:k"), ("MGET", "shmcache:k"), ("KEYS", "*"), ("SCAN", "0"), ("FLUSHALL",), ("FLUSHDB",),
            ("SAVE",), ("BGSAVE",), ("MONITOR",), ("SUBSCRIBE", "c"), ("PUBLISH", "c", "m")]


@pytest.fixture
def spawned(tmp_path):
    """The spawned server and a client with the workers' credentials, as their URL gives them."""
    node = RedisNode(executable=find_redis_server(), bind="127.0.0.1", maxmemory_mb=16, workdir=str(tmp_path))
    with node:
        host, port = node.start(PASSWORD).rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port), username=WORKER_USER, password=PASSWORD)
        client.endpoint = f"{host}:{port}"
        yield client
        client.close()


@pytest.mark.parametrize("command", _REFUSED, ids=lambda c: " ".join(c[:2]))
def test_the_workers_user_cannot_run_anything_else(spawned, command):
    with pytest.raises(redis.ResponseError, match="no permissions|not allowed") as refused:
        spawned.execute_command(*command)
    if command[0] not in ("DEBUG", "MODULE"):
        assert isinstance(refused.value, redis.exceptions.NoPermissionError), refused.value
    assert spawned.ping()  # the server is still there, still answering


@pytest.mark.parametrize("command", [("SET", "other:k", "v"), ("GETRANGE", "other:k", "0", "9"),
                                     ("SET", "shmcache", "v")])
def test_the_workers_user_cannot_touch_a_key_outside_the_caches(spawned, command):
    with pytest.raises(redis.exceptions.NoPermissionError, match="keys"):
        spawned.execute_command(*command)


@pytest.mark.parametrize("password", [None, pytest.param(PASSWORD, marks=pytest.mark.slow),
                                      pytest.param("nopass", marks=pytest.mark.slow)])
def test_the_default_user_cannot_connect(spawned, password):
    host, port = spawned.endpoint.rsplit(":", 1)
    stranger = redis.Redis(host=host, port=int(port), password=password, protocol=2)
    with pytest.raises((redis.exceptions.AuthenticationError, redis.ResponseError)):
        stranger.ping()
    stranger.close()


def test_what_the_workers_send_still_works(spawned):
    assert spawned.set(b"shmcache:c:k", b"v", nx=True)
    assert not spawned.set(b"shmcache:c:k", b"w", nx=True)
    pipe = spawned.pipeline(transaction=False)
    pipe.set(b"shmcache:c:j", b"x", nx=True)
    pipe.set(b"shmcache:c:k", b"y")
    assert pipe.execute(raise_on_error=True) == [True, True]
    pipe = spawned.pipeline(transaction=False)
    for k in (b"shmcache:c:k", b"shmcache:c:j", b"shmcache:c:none"):
        pipe.getrange(k, 0, 99)
    assert pipe.execute(raise_on_error=True) == [b"y", b"x", b""]
    assert spawned.ping()
    assert "used_memory" in spawned.info("memory")


def test_the_remote_tier_reads_and_writes_with_the_workers_url(spawned):
    """The tier itself (its connect, pipelined GETRANGE and SET NX, probe) with the URL the launcher gives."""
    from shmcache.launch.remote_option import shards_url
    from shmcache.tiers.remote import probe

    url = shards_url(WORKER_USER, PASSWORD, [spawned.endpoint])
    tier = RedisTier(url, "acl-test", secret=b"s" * 32)
    try:
        tier.offer([(b"k1", b"value one"), (b"k2", b"value two")])
        assert tier.flush()
        assert tier.get_many([b"k1", b"k2", b"k3"]) == [b"value one", b"value two", None]
        # leases (NOTE [remote leases]): SET NX PX and GETRANGE, under the ACL's key pattern
        assert tier.lease([b"k3", b"k4"], 5.0) == [True, True]
        other = RedisTier(url, "acl-test", secret=b"s" * 32)
        try:
            assert other.lease([b"k3", b"k5"], 5.0) == [False, True]  # k3's lease is the first tier's
            # k1's value is there (and its lease was free: taken too - the value wins); k3's lease is held
            assert other.poll([b"k1", b"k3"], 5.0) == ([b"value one", None], [True, False])
        finally:
            other.close()
        counters = tier.counters()
        assert counters["errors"] == 0 and counters["dropped"] == 0 and counters["leases"] == 2, counters
    finally:
        tier.close()
    info = probe(url)
    assert info["answers"] and info["error"] is None and info["used_memory"], info


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_port_is_proven_the_servers_over_ipv6_too(tmp_path):
    """The proof reads /proc/net/tcp6 (addresses in the kernel's word order) as well."""
    node = RedisNode(executable=find_redis_server(), bind="::1", maxmemory_mb=16, workdir=str(tmp_path))
    with node:
        endpoint = node.start(PASSWORD)
        assert endpoint.startswith("[::1]:")
        client = redis.Redis(host="::1", port=int(endpoint.rsplit(":", 1)[1]), username=WORKER_USER,
                             password=PASSWORD)
        assert client.ping()
        client.close()


def test_a_redis_without_access_control_lists_is_refused_by_name(tmp_path):
    """Redis 5 (Ubuntu 20.04's) has no ACL users: the launcher says so, and what to do, before
    it starts anything."""
    old = tmp_path / "redis-server"
    old.write_text("#!/bin/sh\necho 'Redis server v=5.0.7 sha=00000000:0 malloc=jemalloc-5.2.1 bits=64'\n")
    old.chmod(0o755)
    node = RedisNode(executable=str(old), bind="127.0.0.1", maxmemory_mb=16, workdir=str(tmp_path))
    with pytest.raises(LaunchError, match=r"is Redis 5\.0\.7, which has no access control lists.*6\.0 or "
                                          r"newer.*--remote redis://"):
        node.start(PASSWORD)
    assert node.poll() is None and not (tmp_path / "redis-server.log").exists()  # nothing started


@pytest.mark.parametrize("password", ["short", "x" * 20 + "\nuser default on nopass +@all ~*", "a b" * 10])
def test_a_password_that_would_change_the_configuration_is_refused(tmp_path, password):
    """The password goes into redis.conf's ACL line: only node 0's kind (URL-safe) is accepted."""
    node = RedisNode(executable=find_redis_server(), bind="127.0.0.1", maxmemory_mb=16, workdir=str(tmp_path))
    with pytest.raises(LaunchError, match="URL-safe") as refused:
        node.start(password)
    assert password not in str(refused.value) and node.poll() is None


#: The workers' AUTH, by hand (a client that then sends what redis-py would not).
_AUTH = b"*3\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
    len(WORKER_USER), WORKER_USER.encode(), len(PASSWORD), PASSWORD.encode())


def _peak_mib(client) -> float:
    return client.info("memory")["used_memory_peak"] / (1 << 20)


def test_one_reply_cannot_make_the_server_hold_more_than_its_cap(spawned):
    """NOTE [spawned redis], 5: an MGET that names one 2 MiB key 100 times asked a 16 MiB server
    for a 200 MiB reply, which it built in memory (peak 206 MiB). The workers may not MGET any
    more; the reads they may send, 100 GETRANGEs of that key in one pipeline, leave the server
    within its cap too (it closes the client, or evicts what the pending replies crowd out)."""
    spawned.set(b"shmcache:big", b"x" * (2 << 20))
    pipe = spawned.pipeline(transaction=False)
    for _ in range(100):
        pipe.getrange(b"shmcache:big", 0, 4 << 20)
    try:
        replies = pipe.execute()
    except redis.exceptions.ConnectionError:
        replies = []
    assert sum(map(len, replies)) < 100 * (2 << 20)  # never the whole 200 MiB
    assert spawned.ping()  # the server is still there
    assert _peak_mib(spawned) < 4 * 16, spawned.info("memory")["used_memory_peak_human"]


def test_a_bulk_larger_than_the_cap_is_refused_before_it_is_read(spawned):
    """A SET that announces a 100 MiB value (Redis's own bound is 512 MiB) on a 16 MiB server:
    refused at its length, so nobody can make many connections each buffer one."""
    host, port = spawned.endpoint.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(_AUTH)
        assert sock.recv(5) == b"+OK\r\n"
        sock.sendall(b"*3\r\n$3\r\nSET\r\n$10\r\nshmcache:q\r\n$%d\r\n" % (100 << 20) + b"x" * 4096)
        assert b"invalid bulk length" in sock.recv(1024)


@pytest.mark.skipif(shutil.which("redis-server") is None or server_version(shutil.which("redis-server")) < (7, 0),
                    reason="maxmemory-clients came with Redis 7.0")
def test_many_clients_together_cannot_make_the_server_hold_more_than_its_cap(spawned):
    """Twelve clients each send 12 MiB of a 15 MiB value (under the per-client bound) and never
    the rest: 144 MiB of pending input on a 16 MiB server. Redis 7's maxmemory-clients closes
    the largest clients once all of them together pass the cap."""
    host, port = spawned.endpoint.rsplit(":", 1)
    head = b"*3\r\n$3\r\nSET\r\n$10\r\nshmcache:q\r\n$%d\r\n" % (15 << 20)
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(12)]
    try:
        for sock in socks:
            sock.sendall(_AUTH)
            assert sock.recv(5) == b"+OK\r\n"
            try:
                sock.sendall(head + b"x" * (12 << 20))
            except (BrokenPipeError, ConnectionResetError):
                pass  # closed by the server on the way
        assert spawned.ping()  # answered after the server read what it could of the others
        assert _peak_mib(spawned) < 4 * 16, spawned.info("memory")["used_memory_peak_human"]
    finally:
        for sock in socks:
            sock.close()


#: What stands in PATH as redis-server: it reads the launcher's configuration, forks an impostor
#: that listens on the launcher's socket and answers AUTH + INFO as the server would (the
#: child's PID and port), then becomes the real redis-server (same PID, the launcher's child)
#: with its socket beside it. INFO's fields are the other end's word; the kernel's is not.
IMPOSTOR = r"""#!{python}
import os, socket, sys
real = {real!r}
if sys.argv[1:] != ["-"]:
    os.execv(real, [real, *sys.argv[1:]])
config = sys.stdin.read()
path = next(ln.split(None, 1)[1].strip('"') for ln in config.splitlines() if ln.startswith("unixsocket "))
port = next(ln.split()[1] for ln in config.splitlines() if ln.startswith("port "))
child, ready = os.getpid(), os.pipe()
if os.fork() == 0:
    srv = socket.socket(socket.AF_UNIX)
    srv.bind(path)
    srv.listen(4)
    os.write(ready[1], b"x")
    body = f"# Server\r\nprocess_id:{{child}}\r\ntcp_port:{{port}}\r\n".encode()
    while True:
        conn, _ = srv.accept()
        got = conn.recv(4096)
        with open(path + ".got", "ab") as f:
            f.write(got)
        conn.sendall(b"+OK\r\n$%d\r\n%s\r\n" % (len(body), body))
        conn.close()
os.read(ready[0], 1)
r, w = os.pipe()
os.write(w, config.replace(f'unixsocket "{{path}}"', f'unixsocket "{{path}}.real"').encode())
os.close(w)
os.dup2(r, 0)
os.execv(real, [real, "-"])
"""


def test_a_process_that_is_not_the_child_on_the_launchers_socket_gets_nothing(tmp_path):
    """Another process at the socket's path (it cannot be there unless someone can write to the
    launcher's directory) answered INFO with the child's PID and port, and got the launcher's
    AUTH: now the kernel's word on who listens there (SO_PEERCRED) decides, before a byte."""
    import sys

    wrapper = tmp_path / "bin" / "redis-server"
    wrapper.parent.mkdir()
    wrapper.write_text(IMPOSTOR.format(python=sys.executable, real=find_redis_server()))
    wrapper.chmod(0o755)
    workdir = tmp_path / "launch"
    workdir.mkdir(mode=0o700)
    node = RedisNode(executable=str(wrapper), bind="127.0.0.1", maxmemory_mb=16, workdir=str(workdir))
    with node, pytest.raises(LaunchError, match=r"another process \(PID \d+, user root, uid 0\) listens on the "
                                                r"launcher's socket .*not the redis-server it started \(PID \d+\); "
                                                r"nothing was sent to it"):
        node.start(PASSWORD)
    got = workdir / "redis" / "redis.sock.got"  # made (empty) when the check's connection closes
    assert not got.exists() or got.read_bytes() == b""  # not a byte
