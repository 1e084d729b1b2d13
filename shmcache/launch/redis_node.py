"""One ``redis-server`` per node for ``--remote spawn``: started for the job, stopped with it.

The server is a cache, never a store: no snapshot, no append-only file, a memory cap with LRU
eviction, a random password per job (NOTE [remote rendezvous], 2), bound to the address by which
this host reaches the master (the other nodes reach it the same way; 127.0.0.1 when the master
is this host's loopback). Its configuration, password included, goes in on its standard input,
so no password is ever on a command line (``ps`` shows ``redis-server HOST:PORT``). It is a
companion process of the supervisor: in a session of its own, killed by the kernel if the
launcher dies, and by the guard (NOTE [launcher shutdown], 8-9).
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import time

from ..base import settings
from ..errors import LaunchError
from .supervisor import Companion

__all__ = ["DEFAULT_MAXMEMORY_MB", "RedisNode", "find_redis_server", "route_address",
           "format_endpoint"]

#: ``--remote spawn`` without ``:MB``: each node's server may hold this much (MiB), then evicts.
DEFAULT_MAXMEMORY_MB = 1024
#: Commands the spawned server refuses (renamed to nothing): see RedisNode._config.
_ADMIN_COMMANDS = ("CONFIG", "MODULE", "DEBUG", "SLAVEOF", "REPLICAOF", "EVAL", "EVALSHA", "SCRIPT", "SAVE",
                   "BGSAVE", "BGREWRITEAOF")
#: A new server that does not answer PING within this time is reported as failed to start.
START_TIMEOUT_S = 30.0
#: A free port can be taken between our look and the server's bind: try again with another.
START_ATTEMPTS = 3
#: Seconds between SIGTERM and SIGKILL when the job ends (a cache with nothing to save exits at once).
STOP_TIMEOUT_S = 5.0

INSTALL_HINT = (
    "install it on every node (`apt-get install redis-server` on Debian and Ubuntu, `dnf install "
    "redis` on Fedora and RHEL), or give every node an existing Redis with --remote "
    "redis://[:PASSWORD@]HOST:PORT"
)


def find_redis_server() -> str:
    """The path of ``redis-server``, or a LaunchError that says how to get it."""
    path = shutil.which("redis-server")
    if path is None:
        raise LaunchError(f"--remote spawn: redis-server is not installed on this node (not found "
                          f"on $PATH={os.environ.get('PATH', '')!r}); {INSTALL_HINT}")
    return path


def route_address(master_addr: str) -> str:
    """This host's address on the route to ``master_addr``: where the other nodes reach it.

    A UDP ``connect`` sends nothing; it only makes the kernel pick the source address it would
    use. For a master on this host's loopback that is 127.0.0.1, for node 0 itself its own address.
    """
    try:
        infos = socket.getaddrinfo(master_addr, None, type=socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise LaunchError(f"--remote spawn: --master-addr {master_addr!r} does not resolve "
                          f"({exc.strerror}); give node 0's host name or address") from None
    family, _, _, _, sockaddr = sorted(infos, key=lambda i: i[0] != socket.AF_INET)[0]
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.connect((sockaddr[0], 9))
            return probe.getsockname()[0]
    except OSError as exc:
        raise LaunchError(f"--remote spawn: no route from this node to --master-addr "
                          f"{master_addr!r} ({sockaddr[0]}): {exc.strerror or exc}") from None


def format_endpoint(host: str, port: int) -> str:
    """``host:port``, with an IPv6 address in brackets as URLs want it."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def is_loopback(endpoint: str) -> bool:
    host = endpoint.rsplit(":", 1)[0].strip("[]")
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


class RedisNode:
    """This node's server: ``start(password)`` returns its endpoint, ``stop()`` ends it."""

    def __init__(self, *, executable: str, bind: str, maxmemory_mb: int, workdir: str) -> None:
        self._executable = executable
        self._bind = bind
        self._maxmemory_mb = maxmemory_mb
        self._workdir = workdir
        self._log_path = os.path.join(workdir, "redis-server.log")
        self._server: Companion | None = None
        self.endpoint: str | None = None

    def start(self, password: str) -> str:
        """Start the server and wait until it answers AUTH + PING; returns ``host:port``."""
        for attempt in range(START_ATTEMPTS):
            port = _free_port(self._bind)
            self._server = Companion([self._executable, "-"], stdin_text=self._config(port, password),
                                     log_path=self._log_path, env=_server_environment())
            if self._wait_ready(port, password, last_attempt=attempt == START_ATTEMPTS - 1):
                self.endpoint = format_endpoint(self._bind, port)
                return self.endpoint
            # the port was taken between our look and its bind: try another one
        raise AssertionError("unreachable: the last attempt raises")  # pragma: no cover

    def poll(self) -> int | None:
        """The server's exit status if it has exited (on its own: a crash, the OOM killer)."""
        return self._server.poll() if self._server is not None else None

    def stop(self) -> int | None:
        """Stop the server (SIGTERM, then SIGKILL); its exit status, None if none was started."""
        server, self._server = self._server, None
        return server.stop(STOP_TIMEOUT_S) if server is not None else None

    def __enter__(self) -> RedisNode:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def _config(self, port: int, password: str) -> str:
        """redis.conf on standard input: a cache (no persistence), capped, LRU, with a password."""
        return "\n".join([
            f"bind {self._bind}",
            f"port {port}",
            "protected-mode yes",
            f"requirepass {password}",
            'save ""',
            "appendonly no",
            f"maxmemory {self._maxmemory_mb}mb",
            "maxmemory-policy allkeys-lru",
            f'dir "{self._workdir}"',
            "daemonize no",
            'logfile ""',
            "loglevel warning",
            # whoever holds the password may change values, never run code as this user (design 9):
            # off with what reaches the file system or the server's code (CONFIG SET dir and
            # dbfilename + SAVE write any file on Redis 5-6; MODULE LOAD; Debian's Lua escape).
            # The workers use AUTH, PING, GET, MGET, SET, INFO. All of these exist from Redis 5 on.
            *(f'rename-command {c} ""' for c in _ADMIN_COMMANDS),
            "",
        ])

    def _wait_ready(self, port: int, password: str, *, last_attempt: bool) -> bool:
        """True once the server answers; False if it exited because its port was taken."""
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self._server is not None
        while time.monotonic() < deadline:
            status = self._server.poll()
            if status is not None:
                log = self.log_tail()
                self.stop()  # reaps it, and dismisses its guard
                if "Address already in use" in log and not last_attempt:
                    return False
                raise LaunchError(f"--remote spawn: redis-server exited with status {status} at "
                                  f"start (bind {self._bind}, port {port}); its log "
                                  f"({self._log_path}) ends with: {log or '(nothing)'}")
            if _answers(self._bind, port, password):
                return True
            time.sleep(0.02)
        self.stop()
        raise LaunchError(f"--remote spawn: redis-server on {format_endpoint(self._bind, port)} did "
                          f"not answer PING within {START_TIMEOUT_S:g} s; its log ends with: "
                          f"{self.log_tail() or '(nothing)'}")

    def log_tail(self, lines: int = 5) -> str:
        """The last lines of the server's log, on one line (for an error message)."""
        try:
            with open(self._log_path, errors="replace") as f:
                return " | ".join(ln.strip() for ln in f.read().splitlines()[-lines:])
        except OSError:
            return ""


def _server_environment() -> dict[str, str]:
    """The launcher's environment less every SHMCACHE_* variable: the job's secret, the
    rendezvous token and the remote tier's URL are no business of the server's."""
    return settings.without_ours(os.environ)


def _free_port(bind: str) -> int:
    family = socket.AF_INET6 if ":" in bind else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((bind, 0))
        return s.getsockname()[1]


def _answers(host: str, port: int, password: str, timeout_s: float = 1.0) -> bool:
    """AUTH + PING in the Redis protocol (two commands: no client library in the launcher)."""
    secret = password.encode()
    request = (b"*2\r\n$4\r\nAUTH\r\n$%d\r\n%s\r\n*1\r\n$4\r\nPING\r\n" % (len(secret), secret))
    try:
        with socket.create_connection((host, port), timeout=timeout_s) as sock:
            sock.sendall(request)
            reply = b""
            while reply.count(b"\r\n") < 2:
                chunk = sock.recv(256)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return reply.startswith(b"+OK\r\n+PONG\r\n")
