"""The Redis that `--remote spawn` starts runs as the launcher's user, and its password crosses
the network in clear at every AUTH (design 9): whoever holds it may change values, never run
code. Its administrative commands were left on: on Redis 5 and 6 (what `apt-get install
redis-server` gives on Ubuntu 20.04 and 22.04) `CONFIG SET dir ~/.ssh`, `CONFIG SET dbfilename
authorized_keys` and `SAVE` write a file of the client's choosing as that user, `MODULE LOAD`
loads a shared object, and Debian's Lua (CVE-2022-0543) escapes through `EVAL`. Redis 7 protects
`dir` by default, but CONFIG, SAVE and EVAL still answer. The workers need GET, MGET, SET, INFO:
everything else that reaches the file system or the server's code is renamed away."""

from __future__ import annotations

import os
import shutil

import pytest
import redis

from shmcache.launch.redis_node import RedisNode, find_redis_server

if shutil.which("redis-server") is None and os.environ.get("SHMCACHE_REQUIRE_REAL_PARTS") == "1":
    raise RuntimeError("redis-server is missing but $SHMCACHE_REQUIRE_REAL_PARTS=1: install it "
                       "(`apt-get install redis-server`) - these tests must run here")
pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (apt-get install redis-server)")

_OFF = [("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"), ("MODULE", "LIST"), ("DEBUG", "SLEEP", "0"),
        ("SLAVEOF", "NO", "ONE"), ("REPLICAOF", "NO", "ONE"), ("EVAL", "return 1", "0"),
        ("SCRIPT", "FLUSH"), ("SAVE",), ("BGSAVE",), ("BGREWRITEAOF",)]


@pytest.fixture
def spawned(tmp_path):
    node = RedisNode(executable=find_redis_server(), bind="127.0.0.1", maxmemory_mb=16, workdir=str(tmp_path))
    with node:
        host, port = node.start("a-job-password-0123456789").rsplit(":", 1)
        client = redis.Redis(host=host, port=int(port), password="a-job-password-0123456789")
        yield client
        client.close()


@pytest.mark.parametrize("command", _OFF, ids=lambda c: " ".join(c[:2]))
def test_the_spawned_servers_admin_commands_are_off(spawned, command):
    with pytest.raises(redis.ResponseError, match="unknown command"):
        spawned.execute_command(*command)


def test_what_the_workers_use_still_works(spawned):
    spawned.set(b"k", b"v")
    assert spawned.mget([b"k", b"x"]) == [b"v", None]
    assert "used_memory" in spawned.info("memory")
