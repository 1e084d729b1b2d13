"""The launchers' exchange of Redis endpoints (NOTE [remote rendezvous]) over real sockets.

Each "node" is a thread here (the protocol is what is tested; tests/integration/
test_launch_remote.py runs it between real launchers with real servers). ``start_server`` is
the node's server start: it records the password it was given and returns a made-up endpoint.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest

from shmcache.errors import LaunchError, RendezvousTimeout
from shmcache.launch.rendezvous import host_exchange, join_exchange


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Node(threading.Thread):
    """One node's side of the exchange, run in a thread; its result or error kept."""

    def __init__(self, rank: int, port: int, nnodes: int, *, job: str = "job-1",
                 timeout_s: float = 20.0, on_start=None) -> None:
        super().__init__(daemon=True)
        self.rank, self.port, self.nnodes, self.job, self.timeout_s = rank, port, nnodes, job, timeout_s
        self.on_start = on_start
        self.passwords: list[str] = []
        self.result: tuple[str, list[str]] | None = None
        self.error: BaseException | None = None

    def start_server(self, password: str) -> str:
        self.passwords.append(password)
        if self.on_start is not None:
            self.on_start(self)
        return f"10.0.0.{self.rank}:{6000 + self.rank}"

    def run(self) -> None:
        try:
            if self.rank == 0:
                self.result = host_exchange(port=self.port, nnodes=self.nnodes, job=self.job,
                                            timeout_s=self.timeout_s, start_server=self.start_server)
            else:
                self.result = join_exchange(
                    master_addr="127.0.0.1", port=self.port, nnodes=self.nnodes, node_rank=self.rank,
                    job=self.job, timeout_s=self.timeout_s, start_server=self.start_server)
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
    assert {tuple(n.result[1]) for n in nodes} == {tuple(expected)}
    passwords = {n.result[0] for n in nodes} | {p for n in nodes for p in n.passwords}
    assert len(passwords) == 1 and len(passwords.pop()) >= 32  # node 0's, started with it everywhere


def test_a_launcher_of_another_job_is_refused_without_the_password():
    port = free_port()
    host = Node(0, port, 2)
    host.start()
    stranger = Node(1, port, 2, job="another-job")
    run_all([stranger])
    assert isinstance(stranger.error, LaunchError) and stranger.passwords == []
    assert "job ID 'another-job', but node 0 runs job 'job-1'" in str(stranger.error)
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
    assert "--node-rank 1, which another live launcher of this job already has" in str(second.error)
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


@pytest.mark.parametrize("garbage", [b"GET / HTTP/1.1\r\n\r\n", b"x" * 70000])
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
