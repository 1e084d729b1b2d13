"""The exchange of per-node endpoints between the launchers of one job (``--remote spawn``).

Node 0's launcher hosts it; every other launcher joins. What travels: the job's Redis password
(made by node 0) one way, each node's ``host:port`` the other, the full list back to everyone.

NOTE [remote rendezvous]
    How the launchers of one job agree on their per-node Redis servers, within a bounded time.
    ``run.py`` and ``redis_node.py`` point back here.

    1. Where. Node 0's launcher listens on MASTER_PORT + 1 of every interface, before it starts
       anything else. MASTER_PORT itself is the training's: rank 0 hosts torch's TCPStore there
       once the workers start, so the two never collide. It is a small socket protocol of our
       own rather than a TCPStore because the launcher must not import torch (it starts in a
       fraction of a second and stays small for the whole job), and because the host knows who
       is connected, so a timeout names the missing nodes instead of "key not found".
    2. Messages: one JSON object per line, each way. A node sends {"job", "nnodes", "rank"}.
       Node 0 checks the job ID (a launcher of another job, or of an earlier run, on the same
       port gets an error, not the password), the node count, and that no live connection holds
       that rank, then answers {"password"}. The password is made once, by node 0
       (``secrets.token_urlsafe``), so every server of the job shares it. The node starts its
       server with it and, once the server answers AUTH + PING, sends {"endpoint": "host:port"}.
       Node 0 does the same for itself in-process. Whenever an endpoint arrives, node 0 sends
       every connected node {"waiting_for": [ranks]}; when the last one arrives it sends
       {"endpoints": [...]} (ordered by node rank) to all, and closes.
    3. Time. One deadline, ``--rdzv-timeout`` seconds from the start of the exchange, bounds
       everything: connecting (a refused connection is retried: node 0 may start later), the
       server's start, the exchange. At its deadline node 0 sends {"error"} naming the missing
       ranks (never connected, or connected but their server not up yet) to every node, and
       fails with the same message. A node whose own deadline passes first (it started before
       node 0) waits a few seconds more for that message, then names the ranks node 0 last
       reported missing.
    4. Departures. A node whose connection closes before the end (its launcher died) is
       forgotten, and its rank is free again, so a restarted launcher can take its place. If
       node 0 goes away, every node sees its connection close and fails ("node 0 went away").
       Any failure ends that launcher with exit status 1, after it stopped its own server
       (redis_node.py); no node trains with an incomplete list.
    5. Trust. Like torch's TCPStore on MASTER_PORT, this port is unauthenticated: whoever can
       reach it during the exchange and knows the job ID (``--run-id``, by default
       ``MASTER_ADDR:MASTER_PORT``) can learn the password. Use it on the cluster's own network;
       the README's security notes say so.
"""

from __future__ import annotations

import json
import secrets
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from ..errors import LaunchError, RendezvousTimeout

__all__ = ["rendezvous_port", "host_exchange", "join_exchange", "new_password"]

#: How long a node waits past its own deadline for node 0's message that names the missing ranks.
ERROR_GRACE_S = 5.0
#: Between two attempts to reach node 0 while it is not listening yet.
RETRY_INTERVAL_S = 0.2
#: Longest line accepted from the other side (a hello or an endpoint list is far shorter).
MAX_LINE = 1 << 16
#: A send that cannot complete in this time means the other side stopped reading: drop it.
SEND_TIMEOUT_S = 5.0


def rendezvous_port(master_port: int) -> int:
    """Where node 0 hosts the exchange: MASTER_PORT + 1 (NOTE [remote rendezvous], 1)."""
    return master_port + 1


def new_password() -> str:
    """The job's Redis password: URL-safe, so it goes into a URL without escaping."""
    return secrets.token_urlsafe(24)


# --- node 0 -----------------------------------------------------------------------------------


@dataclass
class _Peer:
    """One connection to node 0, and what it said so far."""

    sock: socket.socket
    buffer: bytes = b""
    rank: int | None = None
    endpoint: str | None = None
    lines: list[dict] = field(default_factory=list)


class _Host:
    """Node 0's side (NOTE [remote rendezvous], 2-4)."""

    def __init__(self, port: int, nnodes: int, job: str) -> None:
        self._nnodes = nnodes
        self._job = job
        self._port = port
        try:
            if socket.has_dualstack_ipv6():
                self._listener = socket.create_server(
                    ("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=nnodes + 8)
            else:
                self._listener = socket.create_server(("", port), backlog=nnodes + 8)
        except OSError as exc:
            raise LaunchError(
                f"--remote spawn: node 0 cannot listen on port {port} (MASTER_PORT + 1) for the "
                f"exchange of the Redis endpoints: {exc.strerror or exc}; pick another "
                f"--master-port (its next port must be free too)"
            ) from None
        self._peers: dict[socket.socket, _Peer] = {}
        self._endpoints: dict[int, str] = {}

    def close(self) -> None:
        for sock in list(self._peers):
            sock.close()
        self._peers.clear()
        self._listener.close()

    def run(self, password: str, own_endpoint: str, deadline: float, timeout_s: float) -> list[str]:
        self._endpoints[0] = own_endpoint
        self._password = password
        while len(self._endpoints) < self._nnodes:
            left = deadline - time.monotonic()
            if left <= 0:
                message = self._timeout_message(timeout_s)
                self._broadcast({"error": message, "timeout": True})
                raise RendezvousTimeout(f"--remote spawn: {message}")
            readable, _, _ = select.select([self._listener, *self._peers], [], [], min(left, 1.0))
            for sock in readable:
                if sock is self._listener:
                    self._accept()
                else:
                    self._read(self._peers[sock])
        endpoints = [self._endpoints[k] for k in range(self._nnodes)]
        self._broadcast({"endpoints": endpoints})
        return endpoints

    def _accept(self) -> None:
        try:
            sock, _addr = self._listener.accept()
        except OSError:
            return
        sock.settimeout(SEND_TIMEOUT_S)
        self._peers[sock] = _Peer(sock)

    def _read(self, peer: _Peer) -> None:
        try:
            data = peer.sock.recv(4096)
        except OSError:
            data = b""
        if not data:
            self._drop(peer)
            return
        peer.buffer += data
        while b"\n" in peer.buffer and peer.sock in self._peers:
            line, peer.buffer = peer.buffer.split(b"\n", 1)
            self._handle(peer, line)
        if len(peer.buffer) > MAX_LINE and peer.sock in self._peers:
            self._refuse(peer, "a line longer than the protocol allows")

    def _handle(self, peer: _Peer, line: bytes) -> None:
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            self._refuse(peer, "a message that is not the launcher's (is something else on this port?)")
        elif peer.rank is None:
            self._hello(peer, message)
        elif isinstance(message.get("endpoint"), str):
            peer.endpoint = message["endpoint"]
            self._endpoints[peer.rank] = peer.endpoint
            missing = self._missing()
            if missing:
                self._broadcast({"waiting_for": missing})
        else:
            self._refuse(peer, "a second hello")

    def _hello(self, peer: _Peer, message: dict) -> None:
        job, nnodes, rank = message.get("job"), message.get("nnodes"), message.get("rank")
        if job != self._job:
            self._refuse(peer, f"job ID {job!r}, but node 0 runs job {self._job!r}: every node needs "
                               f"the same --run-id (or none), --master-addr and --master-port")
        elif nnodes != self._nnodes:
            self._refuse(peer, f"--nnodes {nnodes}, but node 0 has --nnodes {self._nnodes}; give "
                               f"every node the same --nnodes")
        elif not isinstance(rank, int) or not 0 < rank < self._nnodes:
            self._refuse(peer, f"--node-rank {rank!r}: node 0 expects 1 to {self._nnodes - 1}")
        elif rank in self._endpoints or any(p.rank == rank for p in self._peers.values()):
            self._refuse(peer, f"--node-rank {rank}, which another live launcher of this job "
                               f"already has; give every node its own --node-rank")
        else:
            peer.rank = rank
            self._send(peer, {"password": self._password})

    def _refuse(self, peer: _Peer, why: str) -> None:
        self._send(peer, {"error": f"node 0 refused this launcher: {why}"})
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        """NOTE [remote rendezvous], 4: a launcher that went away frees its rank."""
        self._peers.pop(peer.sock, None)
        if peer.rank is not None and self._endpoints.get(peer.rank) == peer.endpoint:
            self._endpoints.pop(peer.rank, None)
        peer.sock.close()

    def _send(self, peer: _Peer, message: dict) -> None:
        try:
            peer.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            self._drop(peer)

    def _broadcast(self, message: dict) -> None:
        for peer in list(self._peers.values()):
            if peer.rank is not None:
                self._send(peer, message)

    def _missing(self) -> list[int]:
        return [k for k in range(self._nnodes) if k not in self._endpoints]

    def _timeout_message(self, timeout_s: float) -> str:
        connected = {p.rank for p in self._peers.values() if p.rank is not None}
        missing = self._missing()
        absent = [k for k in missing if k not in connected]
        starting = [k for k in missing if k in connected]
        parts = []
        if absent:
            parts.append(f"never reached node 0: {absent}")
        if starting:
            parts.append(f"connected, but their Redis never answered: {starting}")
        return (f"node ranks {missing} of {self._nnodes} did not join the exchange "
                f"of Redis endpoints within --rdzv-timeout {timeout_s:g} s ({'; '.join(parts)}); "
                f"check that a launcher runs on each of those nodes with the same --master-addr, "
                f"--master-port and --nnodes, and that they reach port {self._port} of node 0")


def host_exchange(*, port: int, nnodes: int, job: str, timeout_s: float,
                  start_server: Callable[[str], str]) -> tuple[str, list[str]]:
    """Node 0: listen, start this node's server with a new password, collect every endpoint.

    Returns (password, endpoints ordered by node rank). Raises LaunchError or
    RendezvousTimeout (NOTE [remote rendezvous], 3) with every connection closed.
    """
    deadline = time.monotonic() + timeout_s
    host = _Host(port, nnodes, job)  # listening first: the other nodes' connects succeed early
    try:
        password = new_password()
        own = start_server(password)
        return password, host.run(password, own, deadline, timeout_s)
    finally:
        host.close()


# --- the other nodes --------------------------------------------------------------------------


def join_exchange(*, master_addr: str, port: int, nnodes: int, node_rank: int, job: str,
                  timeout_s: float, start_server: Callable[[str], str]) -> tuple[str, list[str]]:
    """Node K > 0: get the password from node 0, start this node's server, get every endpoint."""
    deadline = time.monotonic() + timeout_s
    where = f"node 0's launcher at {master_addr}:{port}"
    sock = _connect(master_addr, port, deadline, where, timeout_s)
    with sock:
        lines = _Lines(sock, where)
        _send_line(sock, {"job": job, "nnodes": nnodes, "rank": node_rank}, where)
        reply = lines.next(deadline + ERROR_GRACE_S, timeout_s, None)
        password = reply.get("password")
        if not isinstance(password, str):
            raise _error_from(reply)
        _send_line(sock, {"endpoint": start_server(password)}, where)
        waiting_for: list[int] | None = None
        while True:
            reply = lines.next(deadline + ERROR_GRACE_S, timeout_s, waiting_for)
            if isinstance(reply.get("endpoints"), list) and len(reply["endpoints"]) == nnodes:
                return password, [str(e) for e in reply["endpoints"]]
            if isinstance(reply.get("waiting_for"), list):
                waiting_for = reply["waiting_for"]
                continue
            raise _error_from(reply)


def _error_from(reply: dict) -> LaunchError:
    """Node 0's error message as this node's error (a timeout stays a timeout)."""
    error_type = RendezvousTimeout if reply.get("timeout") is True else LaunchError
    return error_type(f"--remote spawn: {_error_of(reply)}")


def _error_of(reply: dict) -> str:
    error = reply.get("error")
    return error if isinstance(error, str) else f"an unexpected message from node 0: {reply!r:.200}"


def _connect(addr: str, port: int, deadline: float, where: str, timeout_s: float) -> socket.socket:
    """Connect, retrying while node 0 is not listening yet (NOTE [remote rendezvous], 3)."""
    last: OSError | None = None
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise RendezvousTimeout(
                f"--remote spawn: {where} did not accept a connection within --rdzv-timeout "
                f"{timeout_s:g} s (last: {last.strerror or last if last else 'no attempt'}); check "
                f"that node 0's launcher runs with the same --master-addr and --master-port, and "
                f"that this node reaches that port"
            )
        try:
            sock = socket.create_connection((addr, port), timeout=min(left, 5.0))
        except socket.gaierror as exc:
            raise LaunchError(f"--remote spawn: --master-addr {addr!r} does not resolve "
                              f"({exc.strerror}); give node 0's host name or address") from None
        except OSError as exc:
            last = exc
            time.sleep(min(RETRY_INTERVAL_S, max(0.0, deadline - time.monotonic())))
            continue
        sock.settimeout(SEND_TIMEOUT_S)
        return sock


def _send_line(sock: socket.socket, message: dict, where: str) -> None:
    try:
        sock.sendall(json.dumps(message).encode() + b"\n")
    except OSError as exc:
        raise LaunchError(f"--remote spawn: {where} went away ({exc.strerror or exc}); see the "
                          f"log of node 0's launcher") from None


class _Lines:
    """JSON lines from node 0, each read against a deadline."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self._sock = sock
        self._where = where
        self._buffer = b""

    def next(self, deadline: float, timeout_s: float, waiting_for: list[int] | None) -> dict:
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RendezvousTimeout(self._timeout_message(timeout_s, waiting_for))
            readable, _, _ = select.select([self._sock], [], [], left)
            if not readable:
                continue
            try:
                data = self._sock.recv(4096)
            except OSError:
                data = b""
            if not data:
                raise LaunchError(f"--remote spawn: {self._where} went away during the exchange of "
                                  f"Redis endpoints (it stopped or failed: see its log)")
            self._buffer += data
            if len(self._buffer) > MAX_LINE:
                raise LaunchError(f"--remote spawn: {self._where} sent a line longer than the "
                                  f"protocol allows; is something else listening on that port?")
        line, self._buffer = self._buffer.split(b"\n", 1)
        try:
            message = json.loads(line)
        except ValueError:
            message = None
        if not isinstance(message, dict):
            raise LaunchError(f"--remote spawn: {self._where} sent something that is not the "
                              f"launcher's protocol; is something else listening on that port?")
        return message

    def _timeout_message(self, timeout_s: float, waiting_for: list[int] | None) -> str:
        if waiting_for is None:
            missing = "node 0 reported none missing yet"
        else:
            missing = f"node 0 last reported node ranks {waiting_for} missing"
        return (f"--remote spawn: the exchange of Redis endpoints did not complete within "
                f"--rdzv-timeout {timeout_s:g} s ({missing}); check that a launcher runs on every "
                f"node with the same --master-addr, --master-port and --nnodes")
