"""Fixtures of the remote tier's tests: real redis-server processes (tests/remote/_redis.py)."""

from __future__ import annotations

import pytest
from _redis import RedisCluster, RedisServer, need_redis


@pytest.fixture
def redis_factory(tmp_path):
    """``make(**options)`` starts a RedisServer; every one is stopped at teardown."""
    need_redis()
    made: list = []

    def make(**kw):
        server = RedisServer(tmp_path, **kw)
        made.append(server)
        return server

    yield make
    for s in made:
        s.close()


@pytest.fixture
def redis_server(redis_factory):
    return redis_factory()


@pytest.fixture
def redis_cluster(tmp_path):
    need_redis()
    cluster = RedisCluster(tmp_path)
    yield cluster
    cluster.close()
