"""The exchange of per-node endpoints between the launchers of one job (``--remote spawn``).

Node 0's launcher hosts it; every other launcher joins. What travels: the job's Redis password
(made by node 0) and the job's secret (``$SHMCACHE_SECRET``) one way, each node's ``host:port``
the other, the full list back to everyone - and only between launchers that proved they hold the
job token ``$SHMCACHE_RDZV_TOKEN``.

NOTE [remote rendezvous]
    How the launchers of one job agree on their per-node Redis servers, within a bounded time,
    and with no one else. ``run._exchange`` and ``RedisNode`` point back here.

    1. Where. Node 0's launcher listens on MASTER_PORT + 1 of every interface, before it starts
       anything else. MASTER_PORT itself is the training's: rank 0 hosts torch's TCPStore there
       once the workers start, so the two never collide. It is a small socket protocol of our
       own rather than a TCPStore because the launcher must not import torch (it starts in a
       fraction of a second and stays small for the whole job), because the host knows who
       is connected, so a timeout names the missing nodes instead of "key not found", and
       because it authenticates its peers (5).
    2. Messages: one JSON object per line, each way. The handshake (5) comes first: a node
       sends {"v": 2, "job", "nnodes", "rank", "nonce"}; node 0 checks the protocol version,
       the job ID (a launcher of another job, or of an earlier run, on the same port is
       refused), the node count and the rank's range, and answers {"nonce"}; the node answers
       {"proof"}; node 0 checks it, then that no proven connection holds that rank, and answers
       {"proof"} with the sealed {"password", "secret"}. From here every message is sealed.
       The password is made once, by node 0 (``secrets.token_urlsafe``), so every server of the
       job shares it; the secret is node 0's ``$SHMCACHE_SECRET`` or a new one (a node whose
       own ``$SHMCACHE_SECRET`` differs stops there, before its endpoint). The node starts
       its server with the password (the workers' user's, NOTE [spawned redis] in
       ``RedisNode``) and, once the server answers on its own Unix socket and its TCP port is
       proven the server's, sends {"endpoint": "host:port"}. Node 0 does the same for itself in-process. Whenever an
       endpoint arrives, node 0 sends every proven node {"waiting_for": [ranks]}; when the last
       one arrives it sends {"endpoints": [...]} (ordered by node rank) to all, and closes.
    3. Time. One deadline, ``--rdzv-timeout`` seconds from the start of the exchange, bounds
       everything: connecting (a refused connection is retried: node 0 may start later), the
       server's start, the exchange. At its deadline node 0 sends {"error"} naming the missing
       ranks (never connected, or connected but their server not up yet) and the connections
       it refused, with their addresses, to every proven node, and fails with the same message.
       A node whose own deadline passes first (it started before node 0) waits a few seconds
       more for that message, then names the ranks node 0 last reported missing.
    4. Departures. A proven node whose connection closes before the end (its launcher died) is
       forgotten, and its rank is free again, so a restarted launcher can take its place. If
       node 0 goes away, every node sees its connection close and fails ("node 0 went away").
       Any failure ends that launcher with exit status 1, after it stopped its own server
       (``RedisNode``); no node trains with an incomplete list.
    5. Trust. Every launcher of a job with several nodes holds the same job token,
       ``$SHMCACHE_RDZV_TOKEN`` (at least 16 characters; without one the launcher refuses to
       start and says how to make one; the Slurm recipe makes one per job and srun passes it
       on). The token never crosses the wire. Each side proves it holds it by answering the
       other's fresh 128-bit nonce: proof = HMAC-SHA256(token, ["shmcache-rdzv proof", role,
       job, nnodes, rank, the other's nonce, its own nonce]), role "node" or "host" (so one
       side's answer is never the other's), checked with ``hmac.compare_digest``. The node
       proves first; node 0 checks before anything else happens - a rank is taken only by a
       proven connection, so a peer that claims a rank and then says nothing holds nothing -
       and answers with its own proof, which the node checks before it reads the welcome or
       sends its endpoint (a stranger listening where node 0 should be learns no endpoint).
       A wrong answer, an unexpected message, a duplicate rank from a proven peer, a peer of
       protocol 1, or a connection that has not proved itself within ``HANDSHAKE_TIMEOUT_S``
       (10 s) is refused: node 0 says so to the peer and on its own stderr, naming the peer's
       address, and drops it; the exchange goes on for the others. At most ``MAX_UNPROVEN``
       (32) unproven connections are kept (the oldest is dropped first), so a flood neither
       exhausts ``select`` nor delays anyone beyond it. After the handshake, messages are
       sealed with keys derived from the token and both nonces (HMAC-SHA256 of the token over
       the job, the rank and the nonces, then one key to encrypt and one to authenticate): the
       plaintext XORed with a keystream of HMAC-SHA256(key, direction:sequence:block) blocks,
       then an HMAC-SHA256 over direction, sequence number and ciphertext (encrypt-then-MAC),
       so a sniffer of the exchange learns neither the password nor the secret, and a message
       that was altered, replayed, reordered or reflected is refused. This is stdlib HMAC
       used as a PRF, not TLS: there is no forward secrecy (whoever records the exchange and
       later learns the token reads it), and everything rests on the token staying secret -
       it is in the launchers' environment (readable by the same user and root), never on a
       command line or in a file, and never in the workers' environment. What it does not
       protect: the Redis traffic itself is plain text (``redis://``: the password crosses the
       network at every AUTH), so on a network you do not trust, use a TLS Redis of your own
       (``--remote rediss://...``); and a peer that holds the token is the job. One node has
       no exchange and needs no token.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
import select
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

# ENV_RDZV_TOKEN: the job token every launcher of a multi-node ``--remote spawn`` job holds (NOTE, 5)
from ..base.settings import ENV_RDZV_TOKEN
from ..errors import LaunchError, RendezvousTimeout

__all__ = ["rendezvous_port", "host_exchange", "join_exchange", "new_password", "new_secret",
           "check_token", "ENV_RDZV_TOKEN", "MIN_TOKEN_CHARS"]

#: Shortest token accepted: 16 characters (``secrets.token_hex(32)`` gives 64).
MIN_TOKEN_CHARS = 16
#: How to make one, for the error messages.
TOKEN_HINT = (f"export {ENV_RDZV_TOKEN}=$(python3 -c 'import secrets; print(secrets.token_hex(32))') "
              f"once for the job, before starting its launchers, so that every node gets the same "
              f"one (srun passes the environment on; launch/slurm.sbatch makes one per job)")
#: The protocol's version, in the hello; a launcher of another version is refused by name.
PROTOCOL = 2

#: How long a node waits past its own deadline for node 0's message that names the missing ranks.
ERROR_GRACE_S = 5.0
#: Between two attempts to reach node 0 while it is not listening yet.
RETRY_INTERVAL_S = 0.2
#: Longest line accepted from the other side (a hello or an endpoint list is far shorter).
MAX_LINE = 1 << 16
#: A send that cannot complete in this time means the other side stopped reading: drop it.
SEND_TIMEOUT_S = 5.0
#: A connection that has not proved it holds the token within this time is dropped (NOTE, 5).
HANDSHAKE_TIMEOUT_S = 10.0
#: Connections node 0 keeps that have not proved themselves yet; the oldest goes first.
MAX_UNPROVEN = 32


def rendezvous_port(master_port: int) -> int:
    """Where node 0 hosts the exchange: MASTER_PORT + 1 (NOTE [remote rendezvous], 1)."""
    return master_port + 1


def new_password() -> str:
    """The job's Redis password: URL-safe, so it goes into a URL without escaping."""
    return secrets.token_urlsafe(24)


def new_secret() -> str:
    """The job's record secret ($SHMCACHE_SECRET for its workers): 256 random bits."""
    return secrets.token_hex(32)


def check_token(token: str | None) -> str | None:
    """Why ``token`` cannot be the job token (None: it can)."""
    if not token:
        return f"${ENV_RDZV_TOKEN} is not set"
    if len(token) < MIN_TOKEN_CHARS:
        return f"${ENV_RDZV_TOKEN} has {len(token)} characters, fewer than {MIN_TOKEN_CHARS}"
    return None


# --- the handshake and the sealed messages (NOTE [remote rendezvous], 5) -----------------------


def _mac(key: bytes, *parts: object) -> str:
    """HMAC-SHA256 of ``parts``, encoded as a JSON list (unambiguous), in hex."""
    return hmac.new(key, json.dumps(parts).encode(), hashlib.sha256).hexdigest()


def _equal(given: object, expected: str) -> bool:
    """Whether the other side's ``given`` is ``expected``, in constant time. hmac.compare_digest
    raises TypeError for a str with non-ASCII characters: from a peer that is a wrong answer."""
    return isinstance(given, str) and given.isascii() and hmac.compare_digest(given, expected)


def _proof(token: str, role: str, job: str, nnodes: int, rank: int, challenge: str,
           own_nonce: str) -> str:
    """The answer of ``role`` ("node" or "host") to the other side's ``challenge``."""
    return _mac(token.encode(), "shmcache-rdzv proof", role, job, nnodes, rank, challenge, own_nonce)


class _Channel:
    """The messages after the handshake, encrypted and authenticated with keys derived from the
    token and both nonces: a keystream of HMAC-SHA256 blocks (a PRF in counter mode), then an
    HMAC over direction, sequence number and ciphertext (encrypt-then-MAC)."""

    def __init__(self, token: str, job: str, nnodes: int, rank: int, node_nonce: str,
                 host_nonce: str, *, is_host: bool) -> None:
        session = bytes.fromhex(_mac(token.encode(), "shmcache-rdzv session", job, nnodes, rank,
                                     node_nonce, host_nonce))
        self._enc = hmac.new(session, b"encrypt", hashlib.sha256).digest()
        self._auth = hmac.new(session, b"authenticate", hashlib.sha256).digest()
        self._out, self._in = ("host", "node") if is_host else ("node", "host")
        self._sent = self._received = 0

    def _stream(self, direction: str, seq: int, length: int) -> bytes:
        blocks = (hmac.new(self._enc, f"{direction}:{seq}:{i}".encode(), hashlib.sha256).digest()
                  for i in range((length + 31) // 32))
        return b"".join(blocks)[:length]

    def _tag(self, direction: str, seq: int, box: bytes) -> str:
        return hmac.new(self._auth, f"{direction}:{seq}:".encode() + box, hashlib.sha256).hexdigest()

    def seal(self, message: dict) -> dict:
        plain = json.dumps(message).encode()
        seq, self._sent = self._sent, self._sent + 1
        box = bytes(a ^ b for a, b in zip(plain, self._stream(self._out, seq, len(plain))))
        return {"box": base64.b64encode(box).decode(), "mac": self._tag(self._out, seq, box)}

    def open(self, sealed: dict) -> dict | None:
        """The message, or None if it was not sealed by the other side, in this order."""
        try:
            box = base64.b64decode(sealed["box"], validate=True)
            tag = sealed["mac"]
        except (KeyError, TypeError, ValueError):
            return None
        if not _equal(tag, self._tag(self._in, self._received, box)):
            return None
        self._received += 1
        plain = bytes(a ^ b for a, b in zip(box, self._stream(self._in, self._received - 1, len(box))))
        message = _json(plain)
        return message if isinstance(message, dict) else None


def _json(line: bytes) -> object:
    """The JSON value of a line from the other side, None when it is not one: a line nested
    deeper than the parser recurses (``[[[[...``) raises RecursionError, which must not end a
    launcher any more than other garbage does."""
    try:
        return json.loads(line)
    except (ValueError, RecursionError):
        return None


def _quote(value: object) -> str:
    """What a peer sent, quoted for a message: at most 40 characters of its repr (a refusal is
    kept, printed and sent back; the peer chose up to a 64 KB line)."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _peer_name(address: tuple) -> str:
    """``host:port`` of a peer, an IPv4 address without its IPv6-mapped prefix."""
    host, port = address[0], address[1]
    if host.startswith("::ffff:") and "." in host:
        host = host[len("::ffff:"):]
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


# --- node 0 -----------------------------------------------------------------------------------


@dataclass
class _Peer:
    """One connection to node 0, and what it said so far."""

    sock: socket.socket
    name: str  # its address, for every message about it
    since: float  # when it connected (HANDSHAKE_TIMEOUT_S)
    buffer: bytes = b""
    hello: dict | None = None  # its hello, once given
    nonce: str | None = None  # node 0's challenge to it
    channel: _Channel | None = None  # once it proved it holds the token
    rank: int | None = None  # taken only once it proved it holds the token
    endpoint: str | None = None


class _Host:
    """Node 0's side (NOTE [remote rendezvous], 2-5)."""

    def __init__(self, port: int, nnodes: int, job: str, token: str) -> None:
        self._nnodes = nnodes
        self._job = job
        self._port = port
        self._token = token
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
        self._refused: list[str] = []  # "ADDRESS: why", the last few, for the timeout message
        self._refusals = 0

    def close(self) -> None:
        for sock in list(self._peers):
            sock.close()
        self._peers.clear()
        self._listener.close()

    def run(self, password: str, secret: str, own_endpoint: str, deadline: float,
            timeout_s: float) -> list[str]:
        self._endpoints[0] = own_endpoint
        self._welcome = {"password": password, "secret": secret}
        while len(self._endpoints) < self._nnodes:
            left = deadline - time.monotonic()
            if left <= 0:
                message = self._timeout_message(timeout_s)
                self._broadcast({"error": message, "timeout": True})
                raise RendezvousTimeout(f"--remote spawn: {message}")
            readable, _, _ = select.select([self._listener, *self._peers], [], [], min(left, 0.5))
            for sock in readable:
                if sock is self._listener:
                    self._accept()
                elif sock in self._peers:
                    self._read(self._peers[sock])
            self._drop_slow_handshakes()
        endpoints = [self._endpoints[k] for k in range(self._nnodes)]
        self._broadcast({"endpoints": endpoints})
        return endpoints

    def _accept(self) -> None:
        try:
            sock, address = self._listener.accept()
        except OSError:
            return
        sock.settimeout(SEND_TIMEOUT_S)
        unproven = [p for p in self._peers.values() if p.channel is None]
        if len(unproven) >= MAX_UNPROVEN:  # a flood of connections must not exhaust select()
            self._refuse(min(unproven, key=lambda p: p.since), "too many connections that did not prove "
                         "they hold the job token; this one was the oldest")
        self._peers[sock] = _Peer(sock, _peer_name(address), time.monotonic())

    def _drop_slow_handshakes(self) -> None:
        """NOTE [remote rendezvous], 5: a silent connection holds nothing, and not for long."""
        now = time.monotonic()
        for peer in list(self._peers.values()):
            if peer.channel is None and now - peer.since > HANDSHAKE_TIMEOUT_S:
                self._refuse(peer, f"it did not prove it holds ${ENV_RDZV_TOKEN} within "
                                   f"{HANDSHAKE_TIMEOUT_S:g} s")

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
        message = _json(line)
        if not isinstance(message, dict):
            self._refuse(peer, "a message that is not the launcher's (is something else on this port?)")
        elif peer.hello is None:
            self._hello(peer, message)
        elif peer.channel is None:
            self._check_proof(peer, message)
        else:
            opened = peer.channel.open(message)
            if opened is None:
                self._refuse(peer, "a message not sealed with the job token's keys (tampered with?)")
            elif isinstance(opened.get("endpoint"), str) and peer.endpoint is None:
                peer.endpoint = opened["endpoint"]
                self._endpoints[peer.rank] = peer.endpoint
                missing = self._missing()
                if missing:
                    self._broadcast({"waiting_for": missing})
            else:
                self._refuse(peer, "an unexpected message")

    def _hello(self, peer: _Peer, message: dict) -> None:
        """Step 1: what the peer says it is; checked, but no rank is taken before its proof."""
        job, nnodes, rank = message.get("job"), message.get("nnodes"), message.get("rank")
        nonce = message.get("nonce")
        if message.get("v") != PROTOCOL or not _is_nonce(nonce):
            self._refuse(peer, f"a launcher without the job-token handshake (protocol "
                               f"{_quote(message.get('v', 1))}, node 0 speaks {PROTOCOL}): every node "
                               f"needs the same shmcache version and ${ENV_RDZV_TOKEN}")
        elif job != self._job:
            self._refuse(peer, f"job ID {_quote(job)}, but node 0 runs another job: every node needs the "
                               f"same --run-id (or none), --master-addr and --master-port")
        elif nnodes != self._nnodes:
            self._refuse(peer, f"--nnodes {_quote(nnodes)}, but node 0 has --nnodes {self._nnodes}; give "
                               f"every node the same --nnodes")
        elif not isinstance(rank, int) or isinstance(rank, bool) or not 0 < rank < self._nnodes:
            self._refuse(peer, f"--node-rank {_quote(rank)}: node 0 expects 1 to {self._nnodes - 1}")
        else:
            peer.hello = message
            peer.nonce = secrets.token_hex(16)
            self._send(peer, {"nonce": peer.nonce})

    def _check_proof(self, peer: _Peer, message: dict) -> None:
        """Step 2: the peer's answer to node 0's challenge, then node 0's to the peer's."""
        hello = peer.hello
        assert hello is not None and peer.nonce is not None
        rank = hello["rank"]
        expected = _proof(self._token, "node", self._job, self._nnodes, rank, peer.nonce, hello["nonce"])
        proof = message.get("proof")
        if not _equal(proof, expected):
            self._refuse(peer, f"claimed node rank {rank} but answered the challenge wrong: it does "
                               f"not hold this job's ${ENV_RDZV_TOKEN}")
            return
        holder = next((p for p in self._peers.values() if p.rank == rank), None)
        answer = _proof(self._token, "host", self._job, self._nnodes, rank, hello["nonce"], peer.nonce)
        if holder is not None:
            self._refuse(peer, f"node rank {rank}, which the launcher at {holder.name} already has; "
                               f"give every node its own --node-rank", proof=answer)
            return
        peer.channel = _Channel(self._token, self._job, self._nnodes, rank, hello["nonce"], peer.nonce,
                                is_host=True)
        peer.rank = rank
        self._send(peer, {"proof": answer, **peer.channel.seal(self._welcome)}, sealed=False)

    def _refuse(self, peer: _Peer, why: str, proof: str | None = None) -> None:
        """Tell the peer why, say it here with its address, and drop it (NOTE, 5)."""
        self._refusals += 1
        self._refused = [*self._refused[-4:], f"{peer.name}: {why}"]  # bounded: anyone may connect
        print(f"shmcache.launch: --remote spawn: refused {peer.name}: {why}", file=sys.stderr, flush=True)
        reply: dict = {"error": f"node 0 refused this launcher ({peer.name}): {why}"}
        if proof is not None:
            reply["proof"] = proof
        self._send(peer, reply, sealed=False)
        self._drop(peer)

    def _drop(self, peer: _Peer) -> None:
        """NOTE [remote rendezvous], 4: a launcher that went away frees its rank."""
        self._peers.pop(peer.sock, None)
        if peer.rank is not None and self._endpoints.get(peer.rank) == peer.endpoint:
            self._endpoints.pop(peer.rank, None)
        peer.sock.close()

    def _send(self, peer: _Peer, message: dict, *, sealed: bool = True) -> None:
        if sealed and peer.channel is not None:
            message = peer.channel.seal(message)
        try:
            peer.sock.sendall(json.dumps(message).encode() + b"\n")
        except OSError:
            self._drop(peer)

    def _broadcast(self, message: dict) -> None:
        for peer in list(self._peers.values()):
            if peer.channel is not None:
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
        if self._refused:
            shown = "; ".join(self._refused)
            more = f" (and {self._refusals - len(self._refused)} more)" if self._refusals > len(self._refused) else ""
            parts.append(f"refused: {shown}{more}")
        return (f"node ranks {missing} of {self._nnodes} did not join the exchange "
                f"of Redis endpoints within --rdzv-timeout {timeout_s:g} s ({'; '.join(parts)}); "
                f"check that a launcher runs on each of those nodes with the same --master-addr, "
                f"--master-port, --nnodes and ${ENV_RDZV_TOKEN}, and that they reach port "
                f"{self._port} of node 0")


def _is_nonce(value: object) -> bool:
    return isinstance(value, str) and 32 <= len(value) <= 128


def host_exchange(*, port: int, nnodes: int, job: str, token: str, secret: str, timeout_s: float,
                  start_server: Callable[[str], str]) -> tuple[str, list[str]]:
    """Node 0: listen, start this node's server with a new password, collect every endpoint;
    the password and ``secret`` go to each launcher that proved it holds ``token``, only.

    Returns (password, endpoints ordered by node rank). Raises LaunchError or
    RendezvousTimeout (NOTE [remote rendezvous], 3) with every connection closed.
    """
    deadline = time.monotonic() + timeout_s
    host = _Host(port, nnodes, job, token)  # listening first: the other nodes' connects succeed early
    try:
        password = new_password()
        own = start_server(password)
        return password, host.run(password, secret, own, deadline, timeout_s)
    finally:
        host.close()


# --- the other nodes --------------------------------------------------------------------------


def join_exchange(*, master_addr: str, port: int, nnodes: int, node_rank: int, job: str, token: str,
                  timeout_s: float, start_server: Callable[[str], str],
                  own_secret: str | None = None) -> tuple[str, str, list[str]]:
    """Node K > 0: prove the token to node 0 and check node 0's proof, get the password and the
    job's secret (which must be ``own_secret`` when given), start this node's server, get every
    endpoint.

    Returns (password, secret, endpoints ordered by node rank)."""
    deadline = time.monotonic() + timeout_s
    where = f"node 0's launcher at {master_addr}:{port}"
    sock = _connect(master_addr, port, deadline, where, timeout_s)
    with sock:
        lines = _Lines(sock, where)
        nonce = secrets.token_hex(16)
        _send_line(sock, {"v": PROTOCOL, "job": job, "nnodes": nnodes, "rank": node_rank,
                          "nonce": nonce}, where)
        challenge = lines.next(deadline + ERROR_GRACE_S, timeout_s, None).get("nonce")
        if not _is_nonce(challenge):
            raise _error_from(lines.last)
        _send_line(sock, {"proof": _proof(token, "node", job, nnodes, node_rank, challenge, nonce)},
                   where)
        reply = lines.next(deadline + ERROR_GRACE_S, timeout_s, None)
        expected = _proof(token, "host", job, nnodes, node_rank, nonce, challenge)
        proof = reply.get("proof")
        if not _equal(proof, expected):
            if isinstance(reply.get("error"), str):
                raise _error_from(reply)
            raise LaunchError(f"--remote spawn: {where} did not prove it holds this job's "
                              f"${ENV_RDZV_TOKEN}; refused it, and sent it nothing. Every node needs "
                              f"the same token ({TOKEN_HINT}); or another program listens there")
        if isinstance(reply.get("error"), str):  # node 0 itself, refusing (a duplicate rank)
            raise _error_from(reply)
        channel = _Channel(token, job, nnodes, node_rank, nonce, challenge, is_host=False)
        welcome = channel.open(reply)
        if welcome is None or not isinstance(welcome.get("password"), str) \
                or not isinstance(welcome.get("secret"), str):
            raise LaunchError(f"--remote spawn: {where} sent a welcome not sealed with the job "
                              f"token's keys; is the network between the nodes tampered with?")
        password, secret = welcome["password"], welcome["secret"]
        if own_secret is not None and not hmac.compare_digest(own_secret.encode(), secret.encode()):
            raise LaunchError("--remote spawn: $SHMCACHE_SECRET on this node differs from node 0's; "
                              "records one node signs would be forged to the others: set the same "
                              "one on every node, or unset it (node 0 then makes one for the job)")
        _send_line(sock, channel.seal({"endpoint": start_server(password)}), where)
        waiting_for: list[int] | None = None
        while True:
            reply = channel.open(lines.next(deadline + ERROR_GRACE_S, timeout_s, waiting_for))
            if reply is None:
                raise LaunchError(f"--remote spawn: {where} sent a message not sealed with the job "
                                  f"token's keys; is the network between the nodes tampered with?")
            if isinstance(reply.get("endpoints"), list) and len(reply["endpoints"]) == nnodes:
                return password, secret, [str(e) for e in reply["endpoints"]]
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
        self.last: dict = {}

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
        message = _json(line)
        if not isinstance(message, dict):
            raise LaunchError(f"--remote spawn: {self._where} sent something that is not the "
                              f"launcher's protocol; is something else listening on that port?")
        self.last = message
        return message

    def _timeout_message(self, timeout_s: float, waiting_for: list[int] | None) -> str:
        if waiting_for is None:
            missing = "node 0 reported none missing yet"
        else:
            missing = f"node 0 last reported node ranks {waiting_for} missing"
        return (f"--remote spawn: the exchange of Redis endpoints did not complete within "
                f"--rdzv-timeout {timeout_s:g} s ({missing}); check that a launcher runs on every "
                f"node with the same --master-addr, --master-port and --nnodes")
