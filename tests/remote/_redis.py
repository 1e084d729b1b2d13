"""Real Redis servers for the remote tier's tests: started on free 127.0.0.1 ports, each in its own
temporary directory, with a password, nothing saved (``--save '' --appendonly no``), and always
stopped (SIGCONT first, for one a test stopped). A 3-master Cluster is made with
``redis-cli --cluster create ... --cluster-replicas 0 --cluster-yes``.

Not a test module (the leading underscore keeps pytest from collecting it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

import pytest

REQUIRE = "SHMCACHE_REQUIRE_REAL_PARTS"
PASSWORD = "s3cret-Pa55-7f1c"  # grepped for in every log line and message of the tests


def need_redis() -> None:
    """Skip (with the reason) when redis-server is missing - fail instead under CI."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    if missing:
        why = f"{' and '.join(missing)} not installed (apt-get install -y redis-server)"
        if os.environ.get(REQUIRE) == "1":
            pytest.fail(f"${REQUIRE}=1 and {why}")
        pytest.skip(why)


def free_port(bus: bool = False) -> int:
    """A port free now on 127.0.0.1 (and port + 10000 too, for a Cluster's bus)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 < 65536:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port pair found")


def make_certs(d) -> dict:
    """A throwaway CA and a certificate for 127.0.0.1 signed by it (openssl), for TLS tests."""
    d.mkdir(parents=True, exist_ok=True)
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1\n")

    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt",
        "-days", "1", "-subj", "/CN=shmcache-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "1", "-extfile", "san.ext")
    return {"ca": str(d / "ca.crt"), "cert": str(d / "server.crt"), "key": str(d / "server.key")}


class RedisServer:
    """One redis-server process. ``url`` carries the password; ``kill``/``stop``/``cont`` signal it.
    With ``tls`` (make_certs), it speaks TLS only."""

    def __init__(self, workdir, password: str | None = PASSWORD, *, maxmemory: str | None = None,
                 policy: str | None = None, cluster: bool = False, tls: dict | None = None):
        self.password = password
        self.tls = tls
        self.port = free_port(bus=cluster)
        self.dir = workdir / f"redis-{self.port}"
        self.dir.mkdir(parents=True)
        ports = (["--port", "0", "--tls-port", str(self.port), "--tls-cert-file", tls["cert"],
                  "--tls-key-file", tls["key"], "--tls-ca-cert-file", tls["ca"], "--tls-auth-clients", "no"]
                 if tls else ["--port", str(self.port)])
        args = ["redis-server", *ports, "--bind", "127.0.0.1", "--save", "",
                "--appendonly", "no", "--dir", str(self.dir), "--logfile", str(self.dir / "log"),
                "--daemonize", "no", "--protected-mode", "no"]
        if password:
            args += ["--requirepass", password]
        if maxmemory:
            args += ["--maxmemory", maxmemory]
        if policy:
            args += ["--maxmemory-policy", policy]
        if cluster:
            args += ["--cluster-enabled", "yes", "--cluster-config-file", str(self.dir / "nodes.conf")]
            if password:
                args += ["--masterauth", password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.stopped = False
        self._wait_ready()

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        scheme = "rediss" if self.tls else "redis"
        return f"{scheme}://:{self.password}@{self.addr}" if self.password else f"{scheme}://{self.addr}"

    def cli(self, *args: str, check: bool = True) -> str:
        env = dict(os.environ, REDISCLI_AUTH=self.password or "")  # not on the command line
        tls = ["--tls", "--cacert", self.tls["ca"]] if self.tls else []
        out = subprocess.run(["redis-cli", *tls, "-p", str(self.port), *args], capture_output=True,
                             text=True, env=env, timeout=30)
        if check and out.returncode:
            raise RuntimeError(f"redis-cli {args}: {out.stderr}")
        return out.stdout.strip()

    def values(self) -> int:
        """The number of values stored (keys that are not leases: NOTE [remote leases])."""
        import redis

        r = redis.Redis(port=self.port, password=self.password, ssl=bool(self.tls),
                        ssl_ca_certs=self.tls["ca"] if self.tls else None)
        try:
            return sum(b":lease:" not in k for k in r.scan_iter(count=1000))
        finally:
            r.close()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited: "
                                   f"{(self.dir / 'log').read_text()[-2000:]}")
            if self.cli("ping", check=False) == "PONG":
                return
            time.sleep(0.02)
        raise RuntimeError(f"redis-server on {self.port} did not answer within 10 s")

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(10)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)
        self.stopped = True

    def cont(self) -> None:
        self.proc.send_signal(signal.SIGCONT)
        self.stopped = False

    def close(self) -> None:
        if self.proc.poll() is None:
            if self.stopped:
                self.cont()
            self.proc.kill()
        self.proc.wait(10)


class RedisCluster:
    """Three cluster-enabled masters joined by ``redis-cli --cluster create``."""

    def __init__(self, workdir, password: str = PASSWORD):
        self.password = password
        self.servers: list[RedisServer] = []
        try:
            for _ in range(3):
                self.servers.append(RedisServer(workdir, password, cluster=True))
            env = dict(os.environ, REDISCLI_AUTH=password)
            subprocess.run(["redis-cli", "--cluster", "create", *(s.addr for s in self.servers),
                            "--cluster-replicas", "0", "--cluster-yes"], check=True, env=env,
                           capture_output=True, timeout=60)
            deadline = time.monotonic() + 20
            while not all("cluster_state:ok" in s.cli("cluster", "info") for s in self.servers):
                if time.monotonic() > deadline:
                    raise RuntimeError("the cluster did not reach cluster_state:ok within 20 s")
                time.sleep(0.05)
        except BaseException:
            self.close()
            raise

    @property
    def url(self) -> str:
        return f"redis+cluster://:{self.password}@" + ",".join(s.addr for s in self.servers)

    def close(self) -> None:
        for s in self.servers:
            s.close()
