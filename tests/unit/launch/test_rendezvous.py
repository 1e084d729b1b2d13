"""The launchers' exchange of Redis endpoints (NOTE [remote rendezvous]) over real sockets.

Each "node" is a thread here (the protocol is what is tested; tests/integration/
test_launch_remote.py runs it between real launchers with real servers). ``start_server`` is
the node's server start: it records the password it was given and returns a made-up endpoint.
Every node holds the job token ``TOKEN`` unless told otherwise; node 0 hands out ``SECRET``.
"""

from __future__ import annotations

import json
import secrets
import socket
import threading
import time

import pytest

from shmcache.errors import LaunchError, RendezvousTimeout
from shmcache.launch import rendezvous
from shmcache.launch.rendezvous import host_exchange, join_exchange

TOKEN = "a-job-token-" + "0" * 20
SECRET = "the-jobs-secret-" + "1" * 48


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Node(threading.Thread):
    """One node's side of the exchange, run in a thread; its result or error kept."""

    def __init__(self, rank: int, port: int, nnodes: int, *, job: str = "job-1",
                 timeout_s: float = 20.0, on_start=None, token: str = TOKEN) -> None:
        super().__init__(daemon=True)
        self.rank, self.port, self.nnodes, self.job, self.timeout_s = rank, port, nnodes, job, timeout_s
        self.on_start = on_start
        self.token = token
        self.passwords: list[str] = []
        self.result: tuple[str, str, list[str]] | None = None  # password, secret, endpoints
        self.error: BaseException | None = None

    def start_server(self, password: str) -> str:
        self.passwords.append(password)
        if self.on_start is not None:
            self.on_start(self)
        return f"10.0.0.{self.rank}:{6000 + self.rank}"

    def run(self) -> None:
        try:
            if self.rank == 0:
                password, endpoints = host_exchange(
                    port=self.port, nnodes=self.nnodes, job=self.job, token=self.token, secret=SECRET,
                    timeout_s=self.timeout_s, start_server=self.start_server)
                self.result = (password, SECRET, endpoints)
            else:
                self.result = join_exchange(
                    master_addr="127.0.0.1", port=self.port, nnodes=self.nnodes, node_rank=self.rank,
                    job=self.job, token=self.token, timeout_s=self.timeout_s,
                    start_server=self.start_server)
        except BaseException as exc:  # noqa: BLE001 - kept for the test to look at
            self.error = exc


def run_all(nodes: list[Node], timeout_s: float = 30.0) -> None:
    for node in nodes:
        node.start()
    for node in nodes:
        node.join(timeout_s)
        assert not node.is_alive(), f"node {node.rank} still waiting after {timeout_s} s"


def test_every_node_gets_one_password_and_every_endpoint_by_rank():
    port = free_port()
    nodes = [Node(k, port, 3) for k in (2, 1, 0)]  # the others first: they retry until node 0 listens
    run_all(nodes)
    assert [n.error for n in nodes] == [None] * 3
    expected = ["10.0.0.0:6000", "10.0.0.1:6001", "10.0.0.2:6002"]
    assert {tuple(n.result[2]) for n in nodes} == {tuple(expected)}
    passwords = {n.result[0] for n in nodes} | {p for n in nodes for p in n.passwords}
    assert len(passwords) == 1 and len(passwords.pop()) >= 32  # node 0's, started with it everywhere
    assert {n.result[1] for n in nodes} == {SECRET}  # node 0's secret, on every node


def test_a_launcher_of_another_job_is_refused_without_the_password():
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    stranger = Node(1, port, 2, job="another-job")
    run_all([stranger])
    assert isinstance(stranger.error, LaunchError) and stranger.passwords == []
    assert "job ID 'another-job', but node 0 runs another job" in str(stranger.error)
    right = Node(1, port, 2)
    run_all([right])  # the exchange goes on for the right one
    host.join(10)
    assert right.error is None and host.error is None
    assert right.result == host.result


def test_a_rank_taken_by_a_live_launcher_is_refused():
    port = free_port()
    gate = threading.Event()
    first = Node(1, port, 3, on_start=lambda node: gate.wait(10))  # holds rank 1 while starting
    host = Node(0, port, 3)
    host.start()
    first.start()
    deadline = time.monotonic() + 10
    while not first.passwords:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    second = Node(1, port, 3)
    run_all([second])
    assert "node rank 1, which the launcher at 127.0.0.1:" in str(second.error)
    assert "already has" in str(second.error) and second.passwords == []
    gate.set()
    run_all([Node(2, port, 3)])
    first.join(10)
    host.join(10)
    assert first.error is None and host.error is None


def test_a_node_that_never_comes_is_named_on_every_node():
    port = free_port()
    nodes = [Node(k, port, 3, timeout_s=1.0) for k in (0, 1)]
    start = time.monotonic()
    run_all(nodes)
    assert time.monotonic() - start < 1.0 + 5.0
    for node in nodes:
        assert isinstance(node.error, RendezvousTimeout), node.error
        assert "node ranks [2] of 3 did not join" in str(node.error)
        assert "never reached node 0: [2]" in str(node.error)


def test_no_node_0_is_a_timeout_that_says_where_it_looked():
    port = free_port()
    node = Node(1, port, 2, timeout_s=0.5)
    run_all([node])
    assert isinstance(node.error, RendezvousTimeout)
    assert f"node 0's launcher at 127.0.0.1:{port} did not accept a connection" in str(node.error)
    assert node.passwords == []


def test_node_0_going_away_ends_the_others():
    port = free_port()

    def fail(node: Node) -> None:
        time.sleep(1.0)  # node 1, retrying every 0.2 s, has connected and said hello by now
        raise LaunchError("this node's redis-server would not start")

    host = Node(0, port, 3, on_start=fail)
    other = Node(1, port, 3, timeout_s=10)
    start = time.monotonic()
    run_all([host, other])
    assert isinstance(host.error, LaunchError)
    assert isinstance(other.error, LaunchError) and not isinstance(other.error, RendezvousTimeout)
    assert "node 0's launcher at" in str(other.error) and "went away" in str(other.error)
    assert time.monotonic() - start < 5  # at once, not at the end of its 10 s


def test_node_0_reports_a_busy_port():
    with socket.create_server(("", 0)) as busy:
        port = busy.getsockname()[1]
        node = Node(0, port, 2, timeout_s=1)
        run_all([node])
    assert isinstance(node.error, LaunchError)
    assert f"cannot listen on port {port} (MASTER_PORT + 1)" in str(node.error)
    assert node.passwords == []


# b"[" * 60000: JSON nested deeper than the parser recurses (RecursionError) crashed node 0
@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", b"x" * 70000, b"[" * 60000 + b"\n"])
def test_something_else_on_the_port_is_refused_and_the_exchange_goes_on(garbage):
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    deadline = time.monotonic() + 10
    while True:
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            break
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    with sock:
        try:
            sock.sendall(garbage)
            reply = sock.recv(4096)
        except ConnectionResetError:
            reply = b""
    assert b"password" not in reply
    run_all([Node(1, port, 2)])
    host.join(10)
    assert host.error is None


# --- the job token (NOTE [remote rendezvous], 5) ----------------------------------------------


def connect(port: int) -> socket.socket:
    deadline = time.monotonic() + 10
    while True:
        try:
            return socket.create_connection(("127.0.0.1", port), timeout=5)
        except ConnectionRefusedError:
            assert time.monotonic() < deadline
            time.sleep(0.02)


def lines_of(sock: socket.socket) -> list[dict]:
    data = b""
    sock.settimeout(5)
    while chunk := sock.recv(65536):
        data += chunk
    return [json.loads(line) for line in data.splitlines()]


def test_a_launcher_with_another_token_is_refused_and_named(capsys):
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    wrong = Node(1, port, 2, token="another-token-" + "2" * 20)
    run_all([wrong])
    assert isinstance(wrong.error, LaunchError) and wrong.passwords == []
    assert "answered the challenge wrong" in str(wrong.error) and "SHMCACHE_RDZV_TOKEN" in str(wrong.error)
    assert "refused 127.0.0.1:" in capsys.readouterr().err  # node 0 names the peer
    right = Node(1, port, 2)
    run_all([right])
    host.join(10)
    assert right.error is None and host.error is None and right.result == host.result


def test_a_node_refuses_a_node_0_without_the_token():
    """A stranger listening where node 0 should be: the node checks its proof and sends nothing
    more (no endpoint), failing with the reason."""
    with socket.create_server(("127.0.0.1", 0)) as fake:
        port = fake.getsockname()[1]
        node = Node(1, port, 2)
        node.start()
        sock, _ = fake.accept()
        with sock:
            sock.settimeout(5)
            reader = sock.makefile("rb")
            hello = json.loads(reader.readline())
            assert hello["v"] == 2 and len(hello["nonce"]) == 32
            sock.sendall(json.dumps({"nonce": secrets.token_hex(16)}).encode() + b"\n")
            assert "proof" in json.loads(reader.readline())
            sock.sendall(json.dumps({"proof": secrets.token_hex(32), "box": "", "mac": ""}).encode() + b"\n")
            node.join(10)
            assert reader.read() == b""  # nothing after its proof: no endpoint
    assert isinstance(node.error, LaunchError) and node.passwords == []
    assert f"127.0.0.1:{port} did not prove it holds this job's $SHMCACHE_RDZV_TOKEN" in str(node.error)


def test_the_token_and_the_welcome_never_cross_the_wire_in_clear():
    """A peer that proves itself gets the password and the secret only sealed; the proofs differ
    per connection (fresh nonces both ways) and the token itself is never sent."""
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    with connect(port) as sock:
        nonce = secrets.token_hex(16)
        sock.sendall(json.dumps({"v": 2, "job": "job-1", "nnodes": 2, "rank": 1, "nonce": nonce}).encode() + b"\n")
        reader = sock.makefile("rb")
        challenge = json.loads(reader.readline())["nonce"]
        proof = rendezvous._proof(TOKEN, "node", "job-1", 2, 1, challenge, nonce)
        sock.sendall(json.dumps({"proof": proof}).encode() + b"\n")
        welcome = reader.readline()
        assert TOKEN.encode() not in welcome and SECRET.encode() not in welcome
        assert b"password" not in welcome and host.passwords[0].encode() not in welcome
        message = json.loads(welcome)
        assert message["proof"] == rendezvous._proof(TOKEN, "host", "job-1", 2, 1, nonce, challenge)
        channel = rendezvous._Channel(TOKEN, "job-1", 2, 1, nonce, challenge, is_host=False)
        assert channel.open(dict(message, box=message["box"][:-4] + "AAA=")) is None  # tampered
        assert channel.open(message) == {"password": host.passwords[0], "secret": SECRET}
        sock.sendall(json.dumps(channel.seal({"endpoint": "10.0.0.1:6001"})).encode() + b"\n")
        host.join(10)
    assert host.error is None and host.result[2] == ["10.0.0.0:6000", "10.0.0.1:6001"]


def test_silent_and_unproven_connections_hold_no_rank_and_are_dropped(monkeypatch, capsys):
    monkeypatch.setattr(rendezvous, "HANDSHAKE_TIMEOUT_S", 0.5)
    monkeypatch.setattr(rendezvous, "MAX_UNPROVEN", 4)
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    squatters = [connect(port) for _ in range(6)]  # more than MAX_UNPROVEN: the oldest go first
    squatters[-1].sendall(json.dumps({"v": 2, "job": "job-1", "nnodes": 2, "rank": 1,
                                      "nonce": secrets.token_hex(16)}).encode() + b"\n")
    try:
        for sock in squatters:  # lines_of reads until the host drops it (5 s at most): no sleep
            assert all("password" not in m for m in lines_of(sock))  # dropped, told why
        run_all([Node(1, port, 2)])
        host.join(10)
    finally:
        for sock in squatters:
            sock.close()
    assert host.error is None
    err = capsys.readouterr().err
    assert "too many connections that did not prove" in err
    assert "did not prove it holds $SHMCACHE_RDZV_TOKEN within 0.5 s" in err


def test_a_node_0_impostor_sending_deep_json_is_a_launch_error():
    """Something listening where node 0 should be answers the hello with JSON nested deeper than
    the parser recurses: the joining launcher says so (LaunchError), it does not die of a
    RecursionError."""
    node = _join_an_impostor([b"[" * 60000 + b"\n"])
    assert isinstance(node.error, LaunchError), repr(node.error)
    assert node.passwords == []


def test_a_proof_with_non_ascii_characters_is_refused_and_the_exchange_goes_on(capsys):
    """hmac.compare_digest raises TypeError for a str with non-ASCII characters: a peer that knew
    only the job ID (it is in `ps`) ended node 0's launcher with {"proof": "é..."}. It is a wrong
    answer now, refused like any other."""
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    with connect(port) as sock:
        sock.sendall(json.dumps({"v": 2, "job": "job-1", "nnodes": 2, "rank": 1,
                                 "nonce": secrets.token_hex(16)}).encode() + b"\n")
        sock.settimeout(5)
        assert "nonce" in json.loads(sock.recv(4096).split(b"\n")[0])
        sock.sendall(json.dumps({"proof": "\u00e9" * 64}).encode() + b"\n")
        assert all("password" not in m for m in lines_of(sock))
    run_all([Node(1, port, 2)])
    host.join(10)
    assert host.error is None, repr(host.error)
    assert "answered the challenge wrong" in capsys.readouterr().err


def test_a_node_0_impostor_with_a_non_ascii_proof_is_a_launch_error():
    node = _join_an_impostor([json.dumps({"nonce": secrets.token_hex(16)}).encode() + b"\n",
                              json.dumps({"proof": "\u00e9" * 64}).encode() + b"\n"])
    assert isinstance(node.error, LaunchError), repr(node.error)
    assert "did not prove it holds" in str(node.error) and node.passwords == []



@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_what_a_refused_peer_sent_is_quoted_short(capsys):
    """Node 0's refusals quoted whatever the peer sent (its protocol version, job ID, ranks), up
    to a 64 KB line each, kept every one in memory, printed each whole, and put the last five in
    the timeout message to every proven node: no token or job ID needed to grow node 0's memory
    per connection, flood its log, and make that message too long for the protocol (the proven
    node then failed with "a line longer than the protocol allows" instead of the missing
    ranks). Quotes are a few dozen characters now, and only the last refusals are kept."""
    port = free_port()
    host = Node(0, port, 3, timeout_s=4)
    host.start()
    node = Node(1, port, 3, timeout_s=4)
    node.start()
    junk = json.dumps({"v": "\u00e9" * 30000, "nonce": secrets.token_hex(16)}, ensure_ascii=False).encode()
    for _ in range(6):
        with connect(port) as sock:
            sock.sendall(junk + b"\n")
            lines_of(sock)
    for n in (node, host):
        n.join(30)
        assert not n.is_alive()
    assert isinstance(node.error, RendezvousTimeout), repr(node.error)
    assert "node ranks [2] of 3 did not join" in str(node.error)
    refusals = [ln for ln in capsys.readouterr().err.splitlines() if "refused" in ln]
    assert len(refusals) >= 6 and max(map(len, refusals)) < 1000


def _join_an_impostor(replies: list[bytes]):
    """A joining launcher (rank 1) against something listening where node 0 should be, which
    answers each message it receives with the next of ``replies``; the node, after its run."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]

        def impostor():
            conn, _ = server.accept()
            with conn:
                for reply in replies:
                    conn.recv(4096)
                    conn.sendall(reply)
                time.sleep(1)

        t = threading.Thread(target=impostor, daemon=True)
        t.start()
        node = Node(1, port, 2, timeout_s=10)
        run_all([node])
        t.join(5)
    return node
