"""Redis, the way Bagua's ``CachedDataset`` uses it: pickled samples in a local redis-server.

The benchmark starts its own ``redis-server`` on 127.0.0.1 at a free port (loopback only, no
persistence: ``--save "" --appendonly no``) and shuts it down at the end. Samples are pickled
(protocol 5) and written with ``MSET`` in batches of 20 (Bagua's writer buffer). Readers connect with
redis-py and read

- ``GET``: one ``GET`` + ``pickle.loads`` per item, in random order;
- ``MGET``: one ``MGET`` of 256 keys + ``pickle.loads`` each + ``default_collate``.

Install: ``apt-get install -y redis-server`` and ``pip install redis``.
"""

from __future__ import annotations

import pickle
import shutil
import subprocess
import tempfile
import time

import numpy as np
from _common import free_loopback_port, package_version

from . import _runner
from ._base import Memory, Peer, ReadPath

__all__ = ["Redis", "open_reader"]

MSET_BATCH = 20
HOST = "127.0.0.1"


def _key(i: int) -> bytes:
    return b"%d" % i


class Redis(Peer):
    name = "redis (Bagua)"
    module = __name__
    paths = (ReadPath("get", "GET per item", False), ReadPath("mget", "MGET ×256 + collate", True))

    def __init__(self) -> None:
        self.server: subprocess.Popen | None = None
        self.port = 0
        self.tmpdir: str | None = None

    def skip_reason(self) -> str | None:
        if shutil.which("redis-server") is None:
            return "redis-server not found (apt-get install -y redis-server)"
        if package_version("redis") == "not installed":
            return "redis-py not installed (pip install redis)"
        return None

    def version(self) -> str:
        out = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout
        server = next((w.split("=", 1)[1] for w in out.split() if w.startswith("v=")), "?")
        return f"redis-server {server}, redis-py {package_version('redis')}"

    def fill(self, workload) -> None:
        self._start_server()
        client = self._client()
        src, batch = workload.source(), {}
        for i in range(workload.n_items):
            batch[_key(i)] = pickle.dumps(src[i], protocol=5)
            if len(batch) == MSET_BATCH:
                client.mset(batch)
                batch = {}
        if batch:
            client.mset(batch)
        client.close()

    def _start_server(self) -> None:
        self.tmpdir = tempfile.mkdtemp(prefix="shmcache-compare-redis-")
        self.port = free_loopback_port()
        cmd = ["redis-server", "--bind", HOST, "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--protected-mode", "yes", "--dir", self.tmpdir, "--logfile", f"{self.tmpdir}/redis.log"]
        self.server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ready()

    def _wait_ready(self, timeout_s: float = 20.0) -> None:
        import redis

        deadline = time.monotonic() + timeout_s
        while True:
            if self.server.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.server.returncode}; see {self.tmpdir}/redis.log")
            try:
                self._client().ping()
                return
            except redis.ConnectionError as e:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server not answering on {HOST}:{self.port} after {timeout_s}s") from e
                time.sleep(0.05)

    def _client(self):
        import redis

        return redis.Redis(host=HOST, port=self.port)

    def spec(self) -> dict:
        return {"port": self.port}

    def memory(self) -> Memory:
        info = self._client().info("memory")
        return Memory(info["used_memory"], "redis", f"used_memory; RSS {info['used_memory_rss'] >> 20} MiB")

    def close(self) -> None:
        if self.server is not None:
            self.server.terminate()  # SIGTERM: redis-server exits cleanly, nothing saved (--save "")
            try:
                self.server.wait(10)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait(10)
            self.server = None
        if self.tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            self.tmpdir = None


class _Reader:
    def __init__(self, spec: dict, path: str):
        import redis

        self.client = redis.Redis(host=HOST, port=spec["port"])
        self.client.ping()
        self.path = path

    def epoch(self, indices: np.ndarray) -> list[float]:
        return _runner.timed_chunks(self._mget if self.path == "mget" else self._get, indices)

    def _get(self, indices: np.ndarray) -> None:
        for i in indices:
            pickle.loads(self.client.get(_key(i)))

    def _mget(self, indices: np.ndarray) -> None:
        from torch.utils.data import default_collate

        values = self.client.mget([_key(i) for i in indices])
        default_collate([pickle.loads(v) for v in values])

    def sample(self, i: int):
        if self.path == "mget":
            return pickle.loads(self.client.mget([_key(i)])[0])
        return pickle.loads(self.client.get(_key(i)))

    def close(self) -> None:
        self.client.close()


def open_reader(spec: dict, path: str, rank: int, world: int, port: int) -> _Reader:
    return _Reader(spec, path)
