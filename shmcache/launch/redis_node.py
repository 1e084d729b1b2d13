"""One ``redis-server`` per node for ``--remote spawn``: started for the job, stopped with it.

The server is a cache, never a store: no snapshot, no append-only file, a memory cap with LRU
eviction, bound to the address by which this host reaches the master (the other nodes reach it
the same way; 127.0.0.1 when the master is this host's loopback). Its configuration, passwords
included, goes in on its standard input, so no password is ever on a command line (``ps`` shows
``redis-server HOST:PORT``). It is a companion process of the supervisor: in a session of its
own, killed by the kernel if the launcher dies, and by the guard (NOTE [launcher shutdown], 8-9).

NOTE [spawned redis]
    How the launcher knows the server it speaks to is the one it started, and what the workers
    may do there. The endpoint it announces (NOTE [remote rendezvous], 2) is the proven one.

    1. The launcher picks a free port (bind to port 0, close) and starts redis-server on it.
       Between that close and the server's bind another local user can take the port and answer
       like Redis, so the launcher never speaks to that port at all: the server also listens on
       a Unix socket in a directory of the launcher's own (``<launch dir>/redis``, 0700 in the
       launcher's 0700 directory; ``unixsocketperm 700``), which nobody else can reach or
       replace, and the launcher's readiness check (AUTH + INFO server, by hand) goes there,
       and only once the kernel says the process listening there is the child (SO_PEERCRED):
       INFO's process_id is the other end's word, which an impostor at that path gave.
       That holds only if nobody else can rename the launcher's directory, so it is made only
       in a $TMPDIR that no other user can write without the sticky bit, nor own
       (supervisor.launch_directory): in a scratch directory writable by all, another user
       moved it away, answered INFO on a socket of their own and got the workers' AUTH.
    2. Before it announces ``host:port`` the launcher proves the port is its child's: INFO
       over the socket names the child's PID and the port, and every socket in LISTEN state on
       that port at the bound address or the wildcard (/proc/net/tcp and tcp6) is one of the
       child's file descriptors (/proc/PID/fd). A server that exits with "Address already in
       use" lost the race: the launcher names the user who holds the port (the uid of
       /proc/net/tcp), warns, and tries a fresh port, START_ATTEMPTS (3) times in all, then
       fails with exit status 1 and that cause. No byte went to the other port. Once the
       server holds its port nobody else can bind it (SO_REUSEPORT is per user); if the server
       dies during the job, the launcher says so at the end.
    3. Users (Redis 6.0 or newer: access control lists). ``default`` is off: no connection
       without a user and its password. The workers' user, WORKER_USER, has the job's password
       (made by node 0, the same on every node) and may run only WORKER_COMMANDS - what the
       remote tier sends - on KEY_PATTERN keys, with no pub/sub channel: Lua (EVAL, FUNCTION),
       ACL, replication (SYNC, PSYNC, REPLICAOF), MIGRATE, CLIENT, SHUTDOWN, DEBUG, CONFIG,
       MODULE, KEYS, SCAN and FLUSHALL are refused (NOPERM) to whoever holds that password. The
       launcher's user, ADMIN_USER, may only AUTH, PING and INFO; its password is new for each
       server and never leaves the launcher. The launcher stops the server with SIGTERM, not
       SHUTDOWN. The workers' URL names the user: ``redis+shards://shmcache:PASSWORD@...``.
    4. The node's own processes reach its server over that Unix socket too: their URL is the
       job's, the same server list on every node (the tier shards keys by position), plus
       ``?socket=K:PATH`` for their own node K (``RedisTier``), so they never AUTH over TCP
       to their own node's port - not even if the server died during the job and another
       local user took its port. What is not covered: the other nodes reach a server over TCP,
       where the password crosses the network in clear at every AUTH (NOTE [remote
       rendezvous], 5), and would follow a dead server's port to whoever took it; whoever
       learns the password can read and write the cache's keys on every node's server, nothing
       more (3), and what they write is a miss without the job's secret (NOTE [record
       authentication]). On a network you do not trust, use a TLS Redis of your own
       (``--remote rediss://``).
    5. Memory. ``maxmemory`` (the MB of ``spawn:MB``) bounds the keys, not what a client holds:
       one read naming a 2 MiB key 100 times (an MGET, or GETRANGEs in one pipeline) made a
       16 MiB server hold 206 MiB, and a bulk of
       512 MiB (Redis's own limit) on each of many connections waits in their query buffers. So
       with the workers' password nobody could make the server take the node's memory, a value,
       a client's pending input and its pending reply are each bounded by the same MB (a value
       larger than the whole cap could not be kept anyway; a reply of distinct keys fits in
       what the server holds), and on Redis 7 all clients together too (``maxmemory-clients``):
       the server closes a client past them, which the remote tier counts as a fault (a miss).
"""

from __future__ import annotations

import ipaddress
import os
import pwd
import re
import secrets
import shutil
import socket
import stat
import struct
import subprocess
import time
from collections.abc import Callable

from ..base import settings
from ..errors import LaunchError
from .supervisor import Companion

__all__ = ["DEFAULT_MAXMEMORY_MB", "RedisNode", "find_redis_server", "route_address",
           "format_endpoint", "server_version", "socket_inodes", "WORKER_USER", "WORKER_COMMANDS", "KEY_PATTERN"]

#: ``--remote spawn`` without ``:MB``: each node's server may hold this much (MiB), then evicts.
DEFAULT_MAXMEMORY_MB = 1024
#: The workers' user on the spawned server (NOTE [spawned redis], 3), in their URL.
WORKER_USER = "shmcache"
#: What the remote tier sends (``RedisTier``): AUTH at connect, GETRANGE in a pipeline to read
#: (each value only as far as the largest acceptable record), SET (NX) in a pipeline to write,
#: SET NX PX and GETRANGE to take and read leases (NOTE [remote leases]: no command more),
#: PING and INFO for ``shmcache info``; redis-py's CLIENT SETINFO at connect is refused, which
#: redis-py ignores. GET and MGET are not sent, so not allowed.
WORKER_COMMANDS = ("auth", "hello", "ping", "info", "getrange", "set")
#: The keys of every cache's values (RedisTier.prefix: shmcache:<identity>:<key>).
KEY_PATTERN = "shmcache:*"
#: The launcher's own user, on the Unix socket only in practice: readiness and the proof of the
#: port; no key. Its password is made per server and never leaves the launcher.
ADMIN_USER = "shmcache-launcher"
ADMIN_COMMANDS = ("auth", "ping", "info")
#: Access control lists (``user`` in redis.conf) came with Redis 6.0.
MIN_VERSION = (6, 0)
#: sun_path holds 108 bytes with its NUL on Linux.
MAX_SOCKET_PATH = 107
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
    """This node's server: ``start(password)`` returns its endpoint, ``stop()`` ends it.

    ``password`` is the workers' (user WORKER_USER, NOTE [spawned redis], 3); the launcher's own
    password is made here and never leaves this object. ``warn`` hears of a port another process
    took (the start then goes on with another port)."""

    def __init__(self, *, executable: str, bind: str, maxmemory_mb: int, workdir: str,
                 warn: Callable[[str], None] | None = None) -> None:
        self._executable = executable
        self._bind = bind
        self._maxmemory_mb = maxmemory_mb
        self._workdir = workdir
        self._warn = warn or (lambda _message: None)
        self._log_path = os.path.join(workdir, "redis-server.log")
        # NOTE [spawned redis], 1: the launcher speaks to its server only here, in a directory
        # of its own (0700): nobody else can be listening at this path
        self._socket_dir = os.path.join(workdir, "redis")
        self._socket_path = os.path.join(self._socket_dir, "redis.sock")
        self._admin_password = secrets.token_urlsafe(24)
        self._server: Companion | None = None
        self.endpoint: str | None = None

    def start(self, password: str) -> str:
        """Start the server, prove that the port it listens on is its own, and return
        ``host:port`` (NOTE [spawned redis]); a port taken by another process between our pick
        and the server's bind is named, and another is tried, START_ATTEMPTS times in all."""
        if not re.fullmatch(r"[A-Za-z0-9_-]{16,256}", password):  # it goes into redis.conf's ACL line
            raise LaunchError("--remote spawn: the job's Redis password must be 16-256 URL-safe "
                              "characters (A-Z a-z 0-9 _ -), as node 0's launcher makes it; this "
                              "one is not (not shown), so no redis-server was started")
        version = server_version(self._executable)
        if version < MIN_VERSION:
            raise LaunchError(
                f"--remote spawn: {self._executable} is Redis {'.'.join(map(str, version))}, which "
                f"has no access control lists; the spawned server needs Redis "
                f"{'.'.join(map(str, MIN_VERSION))} or newer, so that the workers' user may run "
                f"only the commands the cache sends (install a newer redis-server, or give every "
                f"node an existing Redis with --remote redis://[USER:PASSWORD@]HOST:PORT)")
        if len(self._socket_path.encode()) > MAX_SOCKET_PATH:
            raise LaunchError(f"--remote spawn: the launcher's directory {self._workdir!r} is too "
                              f"long a path for a Unix socket ({MAX_SOCKET_PATH} bytes at most); "
                              f"set $TMPDIR to a shorter directory, e.g. /tmp")
        os.makedirs(self._socket_dir, mode=0o700, exist_ok=True)
        _check_private(self._socket_dir)
        taken: list[str] = []
        for _attempt in range(START_ATTEMPTS):
            port = _free_port(self._bind)
            config = self._config(port, password, version)
            self._server = Companion([self._executable, "-"], stdin_text=config,
                                     log_path=self._log_path, env=_server_environment())
            holder = self._wait_ready(port)
            if holder is None:
                self.endpoint = format_endpoint(self._bind, port)
                return self.endpoint
            taken.append(f"port {port} by {holder}")
            if len(taken) < START_ATTEMPTS:
                self._warn(f"--remote spawn: port {port} on {self._bind} was taken by another "
                           f"process ({holder}) between the launcher's pick and redis-server's "
                           f"bind; its server was not used, and nothing was sent to it; trying "
                           f"another port")
        raise LaunchError(
            f"--remote spawn: another process took the port picked for this node's redis-server "
            f"on {self._bind} before the server could bind it, {START_ATTEMPTS} times "
            f"({'; '.join(taken)}); nothing was sent to those ports. Another local user may be "
            f"racing for free ports: run the job again, or give every node an existing Redis "
            f"with --remote redis://[USER:PASSWORD@]HOST:PORT")

    @property
    def socket_path(self) -> str:
        """The server's Unix socket, in the launcher's own directory (NOTE [spawned redis], 1):
        this node's processes reach their server there, never over its TCP port."""
        return self._socket_path

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

    def _config(self, port: int, password: str, version: tuple[int, ...]) -> str:
        """redis.conf on standard input: a cache (no persistence), capped, LRU, its users
        (NOTE [spawned redis], 3), and a Unix socket only the launcher's user reaches."""
        channels = " resetchannels" if version >= (6, 2) else ""  # 6.0: no channel rules (nor need)
        return "\n".join([
            f"bind {self._bind}",
            f"port {port}",
            "protected-mode yes",
            f'dir "{self._workdir}"',
            f'unixsocket "{self._socket_path}"',
            "unixsocketperm 700",
            'save ""',
            "appendonly no",
            f"maxmemory {self._maxmemory_mb}mb",
            "maxmemory-policy allkeys-lru",
            # NOTE [spawned redis], 5: what a client sends or is sent is bounded by the cap too
            f"proto-max-bulk-len {self._maxmemory_mb}mb",
            f"client-query-buffer-limit {self._maxmemory_mb}mb",
            f"client-output-buffer-limit normal {self._maxmemory_mb}mb {self._maxmemory_mb}mb 0",
            *([f"maxmemory-clients {self._maxmemory_mb}mb"] if version >= (7, 0) else []),
            "daemonize no",
            'logfile ""',
            "loglevel warning",
            # nobody connects as "default"; the launcher's user sees the server and no key; the
            # workers' user may run what the remote tier sends, on the cache's keys only
            "user default off resetkeys resetchannels -@all" if channels else "user default off -@all",
            f"user {ADMIN_USER} on >{self._admin_password} resetkeys{channels} -@all "
            f"{' '.join('+' + c for c in ADMIN_COMMANDS)}",
            f"user {WORKER_USER} on >{password} resetkeys ~{KEY_PATTERN}{channels} -@all "
            f"{' '.join('+' + c for c in WORKER_COMMANDS)}",
            "",
        ])

    def _wait_ready(self, port: int) -> str | None:
        """None once the server answers on its Unix socket and the TCP port is proven its own;
        who holds the port (a description) if the server exited because the port was taken."""
        deadline = time.monotonic() + START_TIMEOUT_S
        assert self._server is not None
        while time.monotonic() < deadline:
            status = self._server.poll()
            if status is not None:
                log = self.log_tail()
                self.stop()  # reaps it, and dismisses its guard
                if "Address already in use" in log:
                    return _holder(self._bind, port)
                raise LaunchError(f"--remote spawn: redis-server exited with status {status} at "
                                  f"start (bind {self._bind}, port {port}); its log "
                                  f"({self._log_path}) ends with: {log or '(nothing)'}")
            try:
                info = _server_info(self._socket_path, ADMIN_USER, self._admin_password, self._server.pid)
            except _Stranger as stranger:
                self.stop()
                raise LaunchError(f"--remote spawn: another process ({stranger}) listens on the "
                                  f"launcher's socket {self._socket_path}, not the redis-server it "
                                  f"started (PID {stranger.expected}); nothing was sent to it. Check "
                                  f"who can write to {self._workdir}, and run the job again") from None
            if info is not None:
                self._prove(port, info)
                return None
            time.sleep(0.02)
        self.stop()
        raise LaunchError(f"--remote spawn: redis-server on {format_endpoint(self._bind, port)} did "
                          f"not answer on its Unix socket within {START_TIMEOUT_S:g} s; its log "
                          f"ends with: {self.log_tail() or '(nothing)'}")

    def _prove(self, port: int, info: dict[str, str]) -> None:
        """NOTE [spawned redis], 2: the server behind the socket is our child, listening on
        ``port``, and whatever listens on ``bind:port`` is that child's socket."""
        assert self._server is not None
        pid = self._server.pid
        why = None
        if info.get("process_id") != str(pid) or info.get("tcp_port") != str(port):
            why = (f"the server on the launcher's socket says it is PID {info.get('process_id')} on "
                   f"port {info.get('tcp_port')}, not the child {pid} on port {port}")
        else:
            listeners = _listeners(self._bind, port)
            ours = socket_inodes(pid)
            strangers = [uid for inode, uid in listeners if inode not in ours]
            if not listeners:
                why = f"no socket listens on {format_endpoint(self._bind, port)}"
            elif strangers:
                why = (f"another process ({_describe_uid(strangers[0])}) also listens on "
                       f"{format_endpoint(self._bind, port)}")
        if why is not None:
            self.stop()
            raise LaunchError(f"--remote spawn: the redis-server the launcher started is not the "
                              f"one on {format_endpoint(self._bind, port)}: {why}; nothing was "
                              f"sent to that port. Run the job again, or give every node an "
                              f"existing Redis with --remote redis://[USER:PASSWORD@]HOST:PORT")

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
    try:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((bind, 0))
            return s.getsockname()[1]
    except OSError as exc:
        raise LaunchError(f"--remote spawn: no free port on {bind} for this node's redis-server "
                          f"({exc.strerror or exc}); free some, or give every node an existing "
                          f"Redis with --remote redis://[USER:PASSWORD@]HOST:PORT") from None


def server_version(executable: str) -> tuple[int, ...]:
    """``redis-server --version``'s ``v=X.Y.Z`` as a tuple ((0,) when it says nothing readable)."""
    try:
        out = subprocess.run([executable, "--version"], capture_output=True, text=True,
                             timeout=10, env=_server_environment()).stdout
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise LaunchError(f"--remote spawn: {executable} --version failed ({exc}); {INSTALL_HINT}") from None
    match = re.search(r"\bv=(\d+)\.(\d+)(?:\.(\d+))?", out)
    return tuple(int(part) for part in match.groups() if part is not None) if match else (0,)


def _check_private(path: str) -> None:
    """The socket's directory is ours alone: a directory (not a link), our own, mode 0700."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
        raise LaunchError(f"--remote spawn: {path} is not a private directory of this user "
                          f"(mode {stat.S_IMODE(st.st_mode):o}, owner {st.st_uid}); the launcher "
                          f"made it 0700 in its own directory: something else changed it")


def _command(*words: bytes) -> bytes:
    return b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)


class _Stranger(Exception):
    """The process listening on the launcher's socket is not its child (SO_PEERCRED)."""

    def __init__(self, pid: int, uid: int, expected: int) -> None:
        super().__init__(f"PID {pid}, {_describe_uid(uid)}")
        self.expected = expected


def _server_info(path: str, user: str, password: str, pid: int, timeout_s: float = 1.0) -> dict[str, str] | None:
    """AUTH + INFO server over the Unix socket (the Redis protocol by hand: no client library in
    the launcher); its fields, or None while the server does not answer there. The kernel names
    the process that listens there (SO_PEERCRED): unless it is ``pid``, nothing is sent, and
    _Stranger says who it is (INFO's process_id is only what the other end writes)."""
    request = _command(b"AUTH", user.encode(), password.encode()) + _command(b"INFO", b"server")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout_s)
            sock.connect(path)
            peer_pid, peer_uid, _gid = struct.unpack("3i", sock.getsockopt(
                socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i")))
            if peer_pid != pid:
                raise _Stranger(peer_pid, peer_uid, pid)
            sock.sendall(request)
            reply = b""
            while not _complete_info(reply):
                chunk = sock.recv(1 << 16)
                if not chunk or len(reply) > 1 << 20:
                    return None
                reply += chunk
    except OSError:
        return None
    if not reply.startswith(b"+OK\r\n$"):
        return None
    body = reply[5:].split(b"\r\n", 1)[1].decode(errors="replace")
    return dict(line.split(":", 1) for line in body.splitlines() if ":" in line and not line.startswith("#"))


def _complete_info(reply: bytes) -> bool:
    """Whether ``reply`` holds +OK and the whole bulk string of INFO (or an error instead)."""
    if b"\r\n" not in reply:
        return False
    first, rest = reply.split(b"\r\n", 1)
    if first != b"+OK":
        return True  # an error: nothing more to wait for
    if not rest.startswith(b"$") or b"\r\n" not in rest:
        return rest.startswith(b"-")
    head, body = rest.split(b"\r\n", 1)
    try:
        return len(body) >= int(head[1:]) + 2
    except ValueError:
        return True


def _listeners(bind: str, port: int) -> list[tuple[str, int]]:
    """``(inode, uid)`` of every TCP socket in LISTEN state on ``port`` at ``bind`` or at the
    wildcard address (where a connection to ``bind:port`` may land), from /proc/net/tcp{,6}."""
    addresses = {ipaddress.ip_address(bind), ipaddress.ip_address("0.0.0.0"), ipaddress.ip_address("::")}
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: TCP_LISTEN
                continue
            host_hex, _, port_hex = fields[1].partition(":")
            if int(port_hex, 16) != port:
                continue
            raw = bytes.fromhex(host_hex)  # in the kernel's byte order, 32 bits at a time
            address = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
            mapped = getattr(address, "ipv4_mapped", None)
            if address in addresses or (mapped is not None and mapped in addresses):
                found.append((fields[9], int(fields[7])))
    return found


def socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets process ``pid`` holds (/proc/PID/fd/N -> socket:[INODE])."""
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def _holder(bind: str, port: int) -> str:
    """Who listens on ``bind:port`` now, for a message: its user, from /proc/net/tcp."""
    uids = sorted({uid for _inode, uid in _listeners(bind, port)})
    return ", ".join(_describe_uid(u) for u in uids) if uids else "it no longer listens"


def _describe_uid(uid: int) -> str:
    try:
        return f"user {pwd.getpwuid(uid).pw_name}, uid {uid}"
    except KeyError:
        return f"uid {uid}"
