"""``--remote`` on the launcher, with real ``redis-server`` processes and real launchers.

Several nodes are simulated on this machine: one launcher per node (``--nnodes N --node-rank K
--master-addr 127.0.0.1``), each with its own ``$SHMCACHE_DIR``. The workers are
``launch_scripts/remote_ping.py``: each writes what ``$SHMCACHE_REMOTE`` it got, whether every
endpoint answered AUTH + PING, and which ``redis-server`` processes its launcher started. The
tests then check the servers are gone when the job ends - on success, a failing worker, SIGINT,
SIGKILL of a launcher, a node that never comes - and that no password reaches the launchers'
output or process titles. Skipped when redis-server is missing, except under
``$SHMCACHE_REQUIRE_REAL_PARTS=1`` (CI), where that is a failure.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from shmcache.launch import main
from shmcache.launch.redis_node import WORKER_USER

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
PING = str(SCRIPTS / "remote_ping.py")
LAUNCH = [sys.executable, "-m", "shmcache.launch"]
REDIS_SERVER = shutil.which("redis-server")

REQUIRED = os.environ.get("SHMCACHE_REQUIRE_REAL_PARTS") == "1"

if REDIS_SERVER is None and REQUIRED:
    raise RuntimeError("redis-server is missing but $SHMCACHE_REQUIRE_REAL_PARTS=1: install it "
                       "(`apt-get install redis-server`) - these tests must run here")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None,
                                 reason="redis-server is not installed (apt-get install redis-server)")


@pytest.fixture(autouse=True)
def launcher_environment(monkeypatch, tmp_path_factory):
    """Launchers and workers import shmcache from this checkout; temporary files stay in the
    test's directory (a SIGKILLed launcher cannot remove its own)."""
    paths = [str(REPO), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))
    monkeypatch.delenv("SHMCACHE_REMOTE", raising=False)
    monkeypatch.delenv("SHMCACHE_SECRET", raising=False)
    monkeypatch.delenv("SHMCACHE_RDZV_TOKEN", raising=False)


@pytest.fixture
def nodes(tmp_path):
    """Start launchers as simulated nodes, each with its own namespace; killed at teardown. They
    share one $SHMCACHE_RDZV_TOKEN, as srun would give them, unless ``env`` says otherwise."""
    started: list[subprocess.Popen] = []
    master_port = free_port_pair()
    token = secrets.token_hex(32)

    def start(node_rank: int, nnodes: int, *args: str, port: int | None = None,
              env: dict[str, str | None] | None = None) -> subprocess.Popen:
        env = {**os.environ, "SHMCACHE_DIR": str(tmp_path / f"ns-node{node_rank}"),
               "SHMCACHE_RDZV_TOKEN": token, **(env or {})}
        env = {k: v for k, v in env.items() if v is not None}
        common = ["--nnodes", str(nnodes), "--node-rank", str(node_rank), "--master-addr",
                  "127.0.0.1", "--master-port", str(port or master_port)]
        proc = subprocess.Popen([*LAUNCH, *common, *args], env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        started.append(proc)
        return proc

    start.master_port = master_port
    start.token = token
    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=30)


# --- helpers ----------------------------------------------------------------------------------


def free_port_pair() -> int:
    """A port P such that P and P + 1 (the exchange of endpoints) are free now."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s:
                try:
                    s.bind(("", port + 1))
                except OSError:
                    continue
            return port
    raise RuntimeError("no two consecutive free ports")


def read_reports(out_dir: Path, count: int, timeout_s: float = 30.0) -> list[dict]:
    names = [out_dir / f"remote-{r}.json" for r in range(count)]
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in names):
        assert time.monotonic() < deadline, f"not every worker reported in {out_dir}"
        time.sleep(0.02)
    return [json.loads(p.read_text()) for p in names]


def is_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def answers_anything(endpoint: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=1):
            return True
    except OSError:
        return False


def assert_servers_gone(reports: list[dict], timeout_s: float = 10.0) -> None:
    """Every redis-server the launchers started has exited, and no endpoint accepts a connection."""
    pids = {int(pid) for r in reports for pid in r["redis_servers"]}
    endpoints = {e for r in reports for e in r.get("endpoints", [])}
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        alive = [p for p in pids if not is_gone(p)]
        listening = [e for e in endpoints if answers_anything(e)]
        if not alive and not listening:
            return
        time.sleep(0.05)
    pytest.fail(f"redis-server left running: pids {alive}, endpoints {listening}")


def password_of(url: str) -> str:
    password = urlsplit(url).password
    assert password and len(password) >= 16, url
    return password


def finish(proc: subprocess.Popen, timeout_s: float = 60.0) -> tuple[int, str, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out, err


def check_job(reports: list[dict], nnodes: int) -> str:
    """Every worker got the same redis+shards URL, N endpoints by node rank, all answering; each
    node's its own server's Unix socket (?socket=K:PATH, K its node rank). Returns the URL
    without that query."""
    urls = {r["url"].split("?", 1)[0] for r in reports}
    assert len(urls) == 1, urls
    url = urls.pop()
    ranks_of_launcher: dict[int, set[int]] = {}
    for report in reports:
        name, _, value = urlsplit(report["url"]).query.partition("=")
        index, _, path = unquote(value).partition(":")
        assert name == "socket" and path.endswith("/redis/redis.sock"), report["url"]
        assert Path(path).parent.parent.name.startswith("shmcache-launch-"), path
        ranks_of_launcher.setdefault(report["launcher"], set()).add(int(index))
    assert sorted(k for ks in ranks_of_launcher.values() for k in ks) == list(range(nnodes))
    assert url.startswith(f"redis+shards://{WORKER_USER}:"), url
    servers = [r["redis_servers"] for r in reports]
    for report in reports:
        assert len(report["endpoints"]) == nnodes, report
        assert report["answers"] == [True] * nnodes, report
        assert len(report["redis_servers"]) == 1, report  # one server per node, the launcher's
    # node K's server is the K-th endpoint (the remote tier shards over them in this order)
    by_node = {r["launcher"]: r for r in reports}
    assert len(by_node) == nnodes
    for report in reports:
        (cmdline,) = report["redis_servers"].values()
        assert password_of(url) not in cmdline
    assert len({tuple(s) for s in servers}) == nnodes
    return url


# --- --remote spawn: N launchers, one redis-server each ---------------------------------------


@needs_redis
def test_spawn_gives_every_worker_the_same_shards_and_stops_them_after_success(tmp_path, nodes):
    procs = [nodes(k, 2, "--nproc", "2", "--remote", "spawn:64", PING, str(tmp_path), *["exit0"] * 4)
             for k in (0, 1)]
    results = [finish(p) for p in procs]
    reports = read_reports(tmp_path, 4, timeout_s=1)
    for code, _out, err in results:
        assert code == 0, err
    url = check_job(reports, 2)
    endpoints = reports[0]["endpoints"]
    for report in reports:
        node = report["rank"] // 2
        (cmdline,) = report["redis_servers"].values()
        assert cmdline.endswith(f"redis-server {endpoints[node]}")  # the K-th endpoint: node K
    assert_servers_gone(reports)
    secret = password_of(url)
    for _code, out, err in results:
        assert secret not in out and secret not in err
        assert f"redis+shards://{WORKER_USER}:***@" in err  # the launcher says what it set, masked


@needs_redis
def test_spawn_servers_stop_when_a_worker_fails(tmp_path, nodes):
    procs = [nodes(k, 2, "--remote", "spawn", PING, str(tmp_path), "exit0", "raise")
             for k in (0, 1)]
    (code0, out0, err0), (code1, out1, err1) = [finish(p) for p in procs]
    reports = read_reports(tmp_path, 2, timeout_s=1)
    assert code0 == 0, err0
    assert code1 == 1, err1
    assert "shmcache.launch: rank 1 (pid" in err1 and "failed first: exit code 1" in err1
    check_job(reports, 2)
    assert_servers_gone(reports)
    secret = password_of(reports[0]["url"])
    assert secret not in out0 + err0 + out1 + err1


@needs_redis
def test_spawn_servers_stop_on_sigint(tmp_path, nodes):
    procs = [nodes(k, 2, "--remote", "spawn", PING, str(tmp_path), "sleep", "sleep") for k in (0, 1)]
    reports = read_reports(tmp_path, 2)
    check_job(reports, 2)
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        code, out, err = finish(proc, timeout_s=30)
        assert code == 130, err
        assert password_of(reports[0]["url"]) not in out + err
    assert_servers_gone(reports)


@needs_redis
def test_spawn_servers_die_with_a_sigkilled_launcher(tmp_path, nodes):
    """No code runs in a SIGKILLed launcher: PR_SET_PDEATHSIG and the guard stop its server."""
    procs = [nodes(k, 2, "--remote", "spawn", PING, str(tmp_path), "sleep", "sleep") for k in (0, 1)]
    reports = read_reports(tmp_path, 2)
    check_job(reports, 2)
    for proc in procs:
        proc.kill()
    for proc in procs:
        proc.wait(timeout=10)
    assert_servers_gone(reports)
    for report in reports:  # and the workers went with them
        deadline = time.monotonic() + 10
        while not is_gone(report["pid"]):
            assert time.monotonic() < deadline, f"worker {report['pid']} survived its launcher"
            time.sleep(0.05)


@needs_redis
def test_a_node_that_never_comes_is_named_within_the_timeout(tmp_path, nodes):
    """3 nodes announced, 2 start: both fail within --rdzv-timeout, naming node rank 2, and stop
    their servers; no worker starts."""
    procs = [nodes(k, 3, "--remote", "spawn", "--rdzv-timeout", "2", PING, str(tmp_path), "exit0")
             for k in (0, 1)]
    start = time.monotonic()
    results = [finish(p, timeout_s=30) for p in procs]
    assert time.monotonic() - start < 2 + 5 + 5  # the timeout, the grace of a node, slack
    for code, _out, err in results:
        assert code == 1, err
        assert "node ranks [2]" in err, err
    assert "never reached node 0: [2]" in results[0][2]
    assert not list(tmp_path.glob("remote-*.json"))  # no worker ran
    left = [p for p in _redis_servers_started_here() if not is_gone(p)]
    assert left == []


@needs_redis
def test_sigint_while_waiting_for_the_other_nodes_stops_the_server(tmp_path, nodes):
    proc = nodes(0, 2, "--remote", "spawn", "--rdzv-timeout", "60", PING, str(tmp_path), "exit0")
    deadline = time.monotonic() + 30
    while not (servers := _redis_servers_started_here()):  # node 0's is up; node 1 never comes
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.02)
    proc.send_signal(signal.SIGINT)
    code, _out, err = finish(proc, timeout_s=10)
    assert code == 130, err
    assert "received SIGINT while preparing --remote spawn" in err
    deadline = time.monotonic() + 10
    while [p for p in servers if not is_gone(p)]:
        assert time.monotonic() < deadline, "node 0's redis-server outlived its launcher's Ctrl-C"
        time.sleep(0.05)


def _redis_servers_started_here() -> list[int]:
    """redis-server processes whose working directory is under this test's TMPDIR."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if os.path.basename(f.read().split(b" ", 1)[0].split(b"\0", 1)[0]) != b"redis-server":
                    continue
            cwd = os.readlink(f"/proc/{entry}/cwd")
        except OSError:
            continue
        if cwd.startswith(os.environ["TMPDIR"]):
            pids.append(int(entry))
    return pids


@needs_redis
@pytest.mark.skipif(importlib.util.find_spec("redis") is None and not REQUIRED,
                    reason="redis-py is not installed (pip install 'shmcache[redis]')")
def test_a_nodes_own_processes_reach_its_server_over_its_unix_socket(tmp_path):
    """Not over TCP: a port the server lost (it died mid-job, someone took it) would get their
    AUTH (NOTE [spawned redis], 4)."""
    assert main(["--remote", "spawn:32", str(SCRIPTS / "remote_socket.py"), str(tmp_path)]) == 0
    report = json.loads((tmp_path / "socket-0.json").read_text())
    assert report["value"] == "a value", report
    assert report["connections"]["tcp"] == 0 and report["connections"]["unix"] >= 1, report
    assert report["counters"]["errors"] == 0, report


@needs_redis
def test_spawn_on_one_node_needs_no_exchange(tmp_path, capsys):
    assert main(["--remote", "spawn:32", PING, str(tmp_path), "exit0"]) == 0
    (report,) = read_reports(tmp_path, 1, timeout_s=1)
    assert len(report["endpoints"]) == 1 and report["answers"] == [True]
    assert report["endpoints"][0].startswith("127.0.0.1:")
    assert_servers_gone([report])
    captured = capsys.readouterr()
    assert password_of(report["url"]) not in captured.out + captured.err


def test_missing_redis_server_names_the_package(tmp_path, monkeypatch, capsys):
    """PATH without redis-server: exit 1 before any worker, naming apt-get and --remote URL."""
    empty = tmp_path / "bin"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))
    assert main(["--remote", "spawn", PING, str(tmp_path), "exit0"]) == 1
    err = capsys.readouterr().err
    assert "redis-server is not installed" in err
    assert "apt-get install redis-server" in err
    assert "--remote redis://" in err
    assert not list(tmp_path.glob("remote-*.json"))


# --- --remote URL: passed on as it is, never shown --------------------------------------------


def test_remote_url_reaches_the_workers_and_its_password_no_title(tmp_path, nodes):
    url = "redis://:s3cret-Passw0rd@127.0.0.1:6399/2"
    proc = nodes(0, 1, "--remote", url, "--no-python", sys.executable, "-c",
                 "import os, sys, time; open(sys.argv[1], 'w').write(os.environ['SHMCACHE_REMOTE']);"
                 " time.sleep(60)", str(tmp_path / "url"))
    deadline = time.monotonic() + 30
    while not (tmp_path / "url").exists():
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert (tmp_path / "url").read_text() == url
    with open(f"/proc/{proc.pid}/cmdline", "rb") as f:
        title = f.read()
    assert b"s3cret-Passw0rd" not in title
    assert b"redis://:***@127.0.0.1:6399/2" in title
    proc.send_signal(signal.SIGTERM)
    _code, out, err = finish(proc)
    assert "s3cret-Passw0rd" not in out + err


@pytest.mark.parametrize(("value", "shown"), [
    ("http://:hunter2@10.0.0.1:6379", "http://:***@10.0.0.1:6379"),
    ("redis://:hunter2@10.0.0.1:99999", "redis://:***@10.0.0.1:99999"),  # the tier's own parser
    ("spawn:0", "spawn:0"),
    ("spawn:lots", "spawn:lots"),
])
def test_bad_remote_is_a_usage_error_without_the_password(value, shown, capsys):
    assert main(["--remote", value, PING, "/nonexistent", "exit0"]) == 2
    err = capsys.readouterr().err
    assert "argument --remote" in err and shown in err
    assert "hunter2" not in err



# --- end to end: a training job over the spawned servers and the remote tier -------------------


@needs_redis
@pytest.mark.skipif(importlib.util.find_spec("redis") is None and not REQUIRED,
                    reason="redis-py is not installed (pip install 'shmcache[redis]')")
def test_two_nodes_over_spawned_redis_compute_each_item_about_once(tmp_path, nodes):
    """2 launchers x 2 ranks, --remote spawn: epoch 1 computes each item once in the job (each
    rank its shard), epoch 2 reads every item on every node - its own node's from shared memory,
    the other's from the other node's Redis - and nothing is computed again."""
    n = 240
    train = str(SCRIPTS / "remote_train.py")
    procs = [nodes(k, 2, "--nproc", "2", "--remote", "spawn:64", "--destroy-session", train,
                   str(tmp_path), str(n)) for k in (0, 1)]
    results = [finish(p, timeout_s=100) for p in procs]
    for code, _out, err in results:
        assert code == 0, err[-3000:]
    records = [json.loads((tmp_path / f"train-{r}.json").read_text()) for r in range(4)]
    assert [r["wrong"] for r in records] == [[]] * 4  # every value equals the source, every node
    calls = [int(i) for i in (tmp_path / "calls").read_text().split()]
    assert set(calls) == set(range(n))
    in_wrap = sum(r["calls_in_wrap"] for r in records)  # wrap() computes a few to fingerprint
    assert len(calls) - in_wrap <= 1.05 * n, f"{len(calls)} computations ({in_wrap} in wrap) for {n}"
    for node in (0, 1):  # a node's counters are shared by its ranks: the last to finish saw all
        hits = max(r["stats"]["remote_hits"] for r in records[2 * node:2 * node + 2])
        assert hits >= n // 2 - 8, records[2 * node]["stats"]  # the other node's half, from Redis
    url = records[0]["url"].split("?", 1)[0]
    assert {r["url"].split("?", 1)[0] for r in records} == {url}
    secret = password_of(url)
    for _code, out, err in results:
        assert secret not in out + err
    endpoints = urlsplit(url).netloc.rsplit("@", 1)[1].split(",")
    assert_servers_gone([{"redis_servers": {}, "endpoints": endpoints}])


# --- trust: the job token, the job's secret, hostile peers (issue 16, items 2, 3 and 7) ---------

ATTACKER = "shmcache-attacker"


def redis_command(endpoint: str, password: str, *args: str) -> bytes:
    """One Redis command after AUTH as the workers' user, by hand; the raw reply (enough to
    search it for a string)."""
    host, port = endpoint.rsplit(":", 1)
    request = b"".join(b"*%d\r\n" % len(c) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w.encode()) for w in c)
                       for c in (("AUTH", WORKER_USER, password), args))
    reply = b""
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(request)
        sock.settimeout(0.5)
        try:
            while chunk := sock.recv(1 << 16):
                reply += chunk
        except TimeoutError:
            pass
    assert reply.startswith(b"+OK\r\n"), reply[:200]
    return reply


def wait_listening(port: int, proc: subprocess.Popen, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not answers_anything(f"127.0.0.1:{port}"):
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate(timeout=10)
        time.sleep(0.02)


def test_multi_node_spawn_without_a_token_refuses_naming_the_fix(tmp_path, nodes):
    proc = nodes(1, 2, "--remote", "spawn", "--rdzv-timeout", "2", PING, str(tmp_path), "exit0",
                 env={"SHMCACHE_RDZV_TOKEN": None})
    code, _out, err = finish(proc, timeout_s=30)
    assert code == 2, err
    assert "SHMCACHE_RDZV_TOKEN" in err and "secrets.token_hex" in err, err
    assert not list(tmp_path.glob("remote-*.json"))


@needs_redis
def test_spawn_gives_workers_a_fresh_secret_in_their_environment_only(tmp_path, nodes):
    """The same new $SHMCACHE_SECRET in every worker of the job; not on any command line (the
    launchers', the workers', the servers'), not in a server's environment or configuration, not
    in a file, not in the output; the rendezvous token does not reach the workers."""
    procs = [nodes(k, 2, "--remote", "spawn:32", PING, str(tmp_path), "sleep", "sleep") for k in (0, 1)]
    reports = read_reports(tmp_path, 2)
    url = check_job(reports, 2)
    secrets_ = {r["secret"] for r in reports}
    assert len(secrets_) == 1, secrets_
    secret = secrets_.pop()
    assert secret and len(secret) >= 64 and secret != nodes.token, secret
    assert not any(r["has_rdzv_token"] for r in reports)
    servers = [int(pid) for r in reports for pid in r["redis_servers"]]
    for pid in [r["pid"] for r in reports] + [p.pid for p in procs] + servers:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            assert secret.encode() not in f.read(), pid
    for pid in servers:
        with open(f"/proc/{pid}/environ", "rb") as f:
            assert secret.encode() not in f.read(), pid
    for endpoint in reports[0]["endpoints"]:
        config = redis_command(endpoint, password_of(url), "CONFIG", "GET", "*")
        assert b"NOPERM" in config  # no one reads its configuration (test_launch_redis_commands.py)
        assert b"NOPERM" in redis_command(endpoint, password_of(url), "KEYS", "*")
        keyspace = redis_command(endpoint, password_of(url), "INFO", "keyspace")
        assert b"keys=" not in keyspace and secret.encode() not in keyspace  # nothing stored
    for path in Path(os.environ["TMPDIR"]).rglob("*"):
        if path.is_file():
            assert secret.encode() not in path.read_bytes(), path
    for proc in procs:
        proc.send_signal(signal.SIGINT)
    for proc in procs:
        _code, out, err = finish(proc)
        assert secret not in out + err
    assert_servers_gone(reports)


@needs_redis
def test_one_node_spawn_makes_a_secret_and_keeps_the_users(tmp_path, monkeypatch):
    assert main(["--remote", "spawn:32", PING, str(tmp_path), "exit0"]) == 0
    (fresh,) = read_reports(tmp_path, 1, timeout_s=1)
    assert fresh["secret"] and len(fresh["secret"]) >= 64
    (tmp_path / "remote-0.json").unlink()
    monkeypatch.setenv("SHMCACHE_SECRET", "the-users-own-secret-0123456789")
    assert main(["--remote", "spawn:32", PING, str(tmp_path), "exit0"]) == 0
    (kept,) = read_reports(tmp_path, 1, timeout_s=1)
    assert kept["secret"] == "the-users-own-secret-0123456789"


@needs_redis
def test_the_users_secret_is_node_0s_and_another_one_on_a_node_is_refused(tmp_path, nodes):
    node0 = nodes(0, 2, "--remote", "spawn", "--rdzv-timeout", "4", PING, str(tmp_path), "exit0", "exit0",
                  env={"SHMCACHE_SECRET": "node-0s-secret-0123456789"})
    node1 = nodes(1, 2, "--remote", "spawn", "--rdzv-timeout", "4", PING, str(tmp_path), "exit0", "exit0",
                  env={"SHMCACHE_SECRET": "another-secret-0123456789"})
    (code0, _out0, err0), (code1, out1, err1) = finish(node0), finish(node1)
    assert code1 == 1, err1
    assert "$SHMCACHE_SECRET on this node differs from node 0's" in err1, err1
    assert "node-0s-secret" not in out1 + err1
    assert code0 == 1 and "node ranks [1]" in err0, err0
    assert not list(tmp_path.glob("remote-*.json"))


@needs_redis
@pytest.mark.slow  # long (several seconds of real processes); CI runs it (.ci/run: -m slow)
def test_a_launcher_with_another_token_is_refused_and_named(tmp_path, nodes):
    """Node 1 holds another token: node 0 refuses it, naming its address, and gives it nothing;
    node 1 is told why; node 0 fails at --rdzv-timeout listing the refusal."""
    node0 = nodes(0, 2, "--remote", "spawn", "--rdzv-timeout", "4", PING, str(tmp_path), "exit0")
    node1 = nodes(1, 2, "--remote", "spawn", "--rdzv-timeout", "4", PING, str(tmp_path), "exit0",
                  env={"SHMCACHE_RDZV_TOKEN": secrets.token_hex(32)})
    (code0, _out0, err0), (code1, _out1, err1) = finish(node0), finish(node1)
    assert code1 == 1 and code0 == 1, (err0, err1)
    assert "SHMCACHE_RDZV_TOKEN" in err1 and "refused" in err1, err1
    assert "refused 127.0.0.1:" in err0 and "SHMCACHE_RDZV_TOKEN" in err0, err0
    assert "node ranks [1]" in err0, err0
    assert not list(tmp_path.glob("remote-*.json"))


@needs_redis
def test_squatters_on_the_rendezvous_port_do_not_stop_the_job(tmp_path, nodes):
    """One connection says nothing; another claims node rank 1 (in either protocol) and then
    says nothing: no rank is taken before a peer proves it holds the token, so the job runs."""
    node0 = nodes(0, 2, "--remote", "spawn", "--rdzv-timeout", "20", PING, str(tmp_path), "exit0", "exit0")
    port = nodes.master_port + 1
    wait_listening(port, node0)
    job = f"127.0.0.1:{nodes.master_port}"
    squatters = [socket.create_connection(("127.0.0.1", port)) for _ in range(3)]
    squatters[1].sendall(json.dumps({"job": job, "nnodes": 2, "rank": 1}).encode() + b"\n")
    squatters[2].sendall(json.dumps({"v": 2, "job": job, "nnodes": 2, "rank": 1,
                                     "nonce": secrets.token_hex(16)}).encode() + b"\n")
    time.sleep(0.3)
    try:
        node1 = nodes(1, 2, "--remote", "spawn", "--rdzv-timeout", "20", PING, str(tmp_path), "exit0", "exit0")
        results = [finish(node0, timeout_s=30), finish(node1, timeout_s=30)]
    finally:
        for sock in squatters:
            sock.close()
    for code, _out, err in results:
        assert code == 0, err
    check_job(read_reports(tmp_path, 2, timeout_s=1), 2)


#: The attacker, another local user: reads the job ID from the launcher's command line in /proc
#: (as `ps` shows it), joins node 0's exchange as node rank 1 in the old protocol and in the new
#: one (with a made-up proof), offers its own endpoint, and prints all it received.
ATTACK = r"""
import json, secrets, socket, sys
argv = open("/proc/%s/cmdline" % sys.argv[1], "rb").read().decode().split("\0")
addr, port = argv[argv.index("--master-addr") + 1], int(argv[argv.index("--master-port") + 1])
job, nnodes = "%s:%d" % (addr, port), int(argv[argv.index("--nnodes") + 1])
def talk(messages):
    try:
        sock = socket.create_connection((addr, port + 1), timeout=2)
    except OSError as exc:  # the exchange is over already
        return None, {"me": None, "got": "", "connect": str(exc)}
    me, got = "%s:%d" % sock.getsockname()[:2], b""
    for message in messages:
        try:
            sock.sendall(json.dumps(message).encode() + b"\n")
            sock.settimeout(1.0)
            reply = b""
            while not reply.endswith(b"\n"):
                chunk = sock.recv(1 << 16)
                if not chunk:
                    break
                reply += chunk
            got += reply
        except OSError:
            pass
    return sock, {"me": me, "got": got.decode(errors="replace")}
endpoint = {"endpoint": "127.0.0.1:1"}
held, results = [], []
for messages in ([{"job": job, "nnodes": nnodes, "rank": 1}, endpoint],
                 [{"v": 2, "job": job, "nnodes": nnodes, "rank": 1, "nonce": secrets.token_hex(16)},
                  {"proof": secrets.token_hex(32)}, endpoint]):
    sock, result = talk(messages)
    held.append(sock)
    results.append(result)
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def attacker_python() -> str:
    """An interpreter the attacker (a real second user, created if missing) can run."""
    if os.geteuid() != 0 or shutil.which("runuser") is None:
        pytest.skip("needs root and runuser (util-linux) to act as another user")
    import pwd
    try:
        pwd.getpwnam(ATTACKER)
    except KeyError:
        subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", ATTACKER],
                       check=True, capture_output=True)
    for candidate in (sys.executable, "/usr/bin/python3", "/usr/local/bin/python3"):
        if subprocess.run(["runuser", "-u", ATTACKER, "--", candidate, "-c", "pass"],
                          capture_output=True).returncode == 0:
            return candidate
    pytest.skip(f"no Python interpreter that {ATTACKER} may run")


@needs_redis
def test_another_user_on_the_rendezvous_port_gets_nothing_and_injects_nothing(tmp_path, nodes,
                                                                              attacker_python):
    node0 = nodes(0, 2, "--remote", "spawn", "--rdzv-timeout", "20", PING, str(tmp_path), "exit0", "exit0")
    wait_listening(nodes.master_port + 1, node0)
    attack = subprocess.run(["runuser", "-u", ATTACKER, "--", attacker_python, "-c", ATTACK, str(node0.pid)],
                            capture_output=True, text=True, timeout=30, env={"PATH": os.environ["PATH"]})
    assert attack.returncode == 0, attack.stderr
    tries = json.loads(attack.stdout)
    node1 = nodes(1, 2, "--remote", "spawn", "--rdzv-timeout", "20", PING, str(tmp_path), "exit0", "exit0")
    (first,) = read_reports(tmp_path, 1)  # node 0's worker
    assert "127.0.0.1:1" not in first["endpoints"], first  # the attacker's endpoint reached no worker
    password, secret = password_of(first["url"]), first["secret"]
    for attempt in tries:
        assert password not in attempt["got"], attempt
        assert not secret or secret not in attempt["got"], attempt
        assert "refused" in attempt["got"], attempt
    (code0, _out0, err0), (code1, _out1, err1) = finish(node0), finish(node1)
    assert code0 == 0 and code1 == 0, (err0, err1)
    check_job(read_reports(tmp_path, 2, timeout_s=1), 2)
    for attempt in tries:
        assert f"refused {attempt['me']}" in err0, (attempt, err0)  # node 0 names the peer


# --- the port race: another user takes the port between the pick and redis-server's bind ---------
# (issue 24, item 1; NOTE [spawned redis] in shmcache/launch/redis_node.py)

#: The other user's listener: on each port read from stdin, bind and listen at once ("bound"),
#: then accept, say "conn", answer every chunk as Redis answers AUTH + PING (+OK +PONG), and
#: keep what it received; at the end of stdin, one JSON line with everything received.
HOSTILE = r"""
import json, socket, sys, threading
got = []
def talk(conn):
    record = bytearray()
    got.append(record)
    conn.settimeout(5)
    try:
        while chunk := conn.recv(1 << 16):
            record += chunk
            conn.sendall(b"+OK\r\n+PONG\r\n")
    except OSError:
        pass
def serve(srv):
    while True:
        try:
            conn, _ = srv.accept()
        except OSError:
            return
        print("conn", flush=True)
        threading.Thread(target=talk, args=(conn,), daemon=True).start()
for line in sys.stdin:
    srv = socket.socket()
    srv.bind(("127.0.0.1", int(line)))
    srv.listen(16)
    print("bound", flush=True)
    threading.Thread(target=serve, args=(srv,), daemon=True).start()
print(json.dumps([bytes(r).decode("latin-1") for r in got]), flush=True)
"""

#: What stands in PATH as redis-server: it reads the configuration the launcher sends, tells the
#: race driver the port it names, waits for its go, and only then becomes the real redis-server
#: (same PID) with the same configuration: the window between the launcher's pick and the
#: server's bind, opened wide and on cue, so the other user takes the port every time.
WRAPPER = r"""#!{python}
import os, socket, sys
real = {real!r}
if sys.argv[1:] != ["-"]:
    os.execv(real, [real, *sys.argv[1:]])
config = sys.stdin.buffer.read()
port = next(ln.split()[1] for ln in config.decode().splitlines() if ln.startswith("port "))
with socket.socket(socket.AF_UNIX) as ctl:
    ctl.connect("\0shmcache-race-ctl")
    ctl.sendall(port.encode())
    ctl.recv(16)
r, w = os.pipe()
os.write(w, config)
os.close(w)
os.dup2(r, 0)
os.execv(real, [real, "-"])
"""

#: Runs in a private network namespace (its own loopback): the other user's listener, the cue
#: between the wrapper and that user (the first TAKES ports the launcher picks are taken, and
#: the server waits up to 0.5 s for a connection to them, so a launcher that speaks to the port
#: does it before the server starts), then one launcher with --remote spawn. Prints a JSON
#: report: the launcher's status and stderr, the ports taken, what the other user received.
RACE_DRIVER = r"""
import json, os, queue, socket, subprocess, sys, threading
attacker_python, attacker, takes, out_dir, ping = sys.argv[1:6]
launch = sys.argv[6:]
subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
hostile = subprocess.Popen(["runuser", "-u", attacker, "--", attacker_python, "-c", os.environ["HOSTILE"]],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={"PATH": os.environ["PATH"]})
lines = queue.Queue()
threading.Thread(target=lambda: [lines.put(ln.strip()) for ln in hostile.stdout], daemon=True).start()
ctl = socket.socket(socket.AF_UNIX)
ctl.bind("\0shmcache-race-ctl")
ctl.listen(8)
taken = []
def cue():
    while True:
        conn, _ = ctl.accept()
        with conn:
            port = int(conn.recv(16))
            if len(taken) < int(takes):
                taken.append(port)
                hostile.stdin.write(f"{port}\n")
                hostile.stdin.flush()
                assert lines.get(timeout=10) == "bound"
                try:
                    lines.get(timeout=0.5)  # "conn": someone spoke to the other user's port
                except queue.Empty:
                    pass
            conn.sendall(b"go")
threading.Thread(target=cue, daemon=True).start()
job = subprocess.run([*launch, "--remote", "spawn:16", ping, out_dir, "exit0"], capture_output=True,
                     text=True, timeout=90)
hostile.stdin.close()
hostile.wait(timeout=30)
rest = []
while not lines.empty():
    rest.append(lines.get())
print(json.dumps({"code": job.returncode, "stderr": job.stderr, "taken": taken,
                  "received": json.loads(rest[-1]), "connections": rest.count("conn")}))
"""


def launch_racing_another_user(tmp_path: Path, attacker_python: str, takes: int) -> dict:
    """One launcher with --remote spawn, in a private network namespace, while another user
    takes the first ``takes`` ports it picks (RACE_DRIVER); the driver's report."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        pytest.skip("needs unshare (util-linux) and ip (iproute2) for a private loopback")
    wrappers = tmp_path / "bin"
    wrappers.mkdir()
    wrapper = wrappers / "redis-server"
    wrapper.write_text(WRAPPER.format(python=sys.executable, real=REDIS_SERVER))
    wrapper.chmod(0o755)
    env = {**os.environ, "HOSTILE": HOSTILE, "PATH": f"{wrappers}{os.pathsep}{os.environ['PATH']}",
           "SHMCACHE_DIR": str(tmp_path / "ns")}
    driver = subprocess.run(["unshare", "-n", "--", sys.executable, "-c", RACE_DRIVER, attacker_python,
                             ATTACKER, str(takes), str(tmp_path), PING, *LAUNCH],
                            env=env, capture_output=True, text=True, timeout=120)
    assert driver.returncode == 0, driver.stderr[-3000:]
    return json.loads(driver.stdout)


def assert_nothing_left(reports: list[dict]) -> None:
    assert_servers_gone(reports)
    assert not _redis_servers_started_here()
    assert not list(Path(os.environ["TMPDIR"]).glob("shmcache-launch-*"))


@needs_redis
def test_a_port_taken_between_pick_and_bind_gets_nothing_and_another_is_used(tmp_path, attacker_python):
    race = launch_racing_another_user(tmp_path, attacker_python, takes=1)
    (port,) = race["taken"]
    assert race["received"] == [] and race["connections"] == 0, race  # not a byte, not a connect
    assert race["code"] == 0, race["stderr"]
    (report,) = read_reports(tmp_path, 1, timeout_s=1)
    (endpoint,) = report["endpoints"]
    assert endpoint != f"127.0.0.1:{port}" and report["answers"] == [True], report
    err = race["stderr"]
    assert f"port {port} on 127.0.0.1 was taken by another process (user {ATTACKER}" in err, err
    assert "trying another port" in err
    assert password_of(report["url"]) not in err
    assert_nothing_left([report])


@needs_redis
def test_a_port_taken_on_every_attempt_fails_naming_the_cause(tmp_path, attacker_python):
    race = launch_racing_another_user(tmp_path, attacker_python, takes=3)
    assert len(race["taken"]) == 3
    assert race["received"] == [] and race["connections"] == 0, race
    assert race["code"] == 1, race["stderr"]
    err = race["stderr"]
    assert "another process took the port picked for this node's redis-server on 127.0.0.1" in err, err
    for port in race["taken"]:
        assert f"port {port} by user {ATTACKER}" in err, err
    assert "nothing was sent to those ports" in err and "--remote redis://" in err
    assert not list(tmp_path.glob("remote-*.json"))  # no worker started
    assert_nothing_left([])


#: The other user, in a $TMPDIR that everyone may write and that is not sticky. Reads the
#: launcher's PID on stdin; once a launcher's directory is there and that launcher's
#: redis-server runs, renames the directory away (anyone may, in such a parent), makes its own
#: in its place with a Unix socket where the server's was, prints "swapped", and answers every
#: connection as the server answers the launcher's AUTH + INFO (the child's PID and port, from
#: /proc), keeping what each sent. At the end of stdin: one JSON line.
SWAPPER = r"""
import json, os, socket, sys, threading, time
shared = sys.argv[1]
launcher = sys.stdin.readline().strip()
ended = threading.Event()
threading.Thread(target=lambda: (sys.stdin.read(), ended.set()), daemon=True).start()
def server():
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                title = f.read().decode(errors="replace")
        except OSError:
            continue
        if ppid == launcher and "redis-server" in title and ":" in title:
            return pid, title.rsplit(":", 1)[1].strip("\0 ")
got = b""
while not ended.wait(0.01):
    made = [d for d in os.listdir(shared) if d.startswith("shmcache-launch-")]
    found = server() if made else None
    if found:
        pid, port = found
        mine = os.path.join(shared, made[0])
        os.rename(mine, mine + ".away")
        os.mkdir(mine)
        os.mkdir(os.path.join(mine, "redis"))
        for d in (mine, os.path.join(mine, "redis")):
            os.chmod(d, 0o777)
        srv = socket.socket(socket.AF_UNIX)
        srv.bind(os.path.join(mine, "redis", "redis.sock"))
        os.chmod(os.path.join(mine, "redis", "redis.sock"), 0o777)
        srv.listen(8)
        srv.settimeout(1)
        print("swapped", flush=True)
        body = f"# Server\r\nprocess_id:{pid}\r\ntcp_port:{port}\r\n".encode()
        while not ended.is_set() and len(got) < 4000:
            try:
                conn, _ = srv.accept()
            except OSError:
                continue
            conn.settimeout(1)
            try:
                got += conn.recv(4096)
                conn.sendall(b"+OK\r\n$%d\r\n%s\r\n" % (len(body), body))
            except OSError:
                pass
            conn.close()
        break
ended.wait(60)
print(json.dumps({"got": got.decode("latin-1")}), flush=True)
"""

#: A worker that reaches its Redis only once the test says so (after the other user's move).
CUED_WORKER = """
import os, sys, time
deadline = time.monotonic() + 30
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.02)
from shmcache.tiers.remote import RedisTier
tier = RedisTier(os.environ["SHMCACHE_REMOTE"], "cued", secret=os.environ["SHMCACHE_SECRET"].encode())
tier.get_many([b"k"])
tier.close()
"""


@needs_redis
def test_a_tmpdir_others_can_write_without_the_sticky_bit_is_refused(tmp_path, attacker_python):
    """In a $TMPDIR that every user may write and that is not sticky, another user renamed the
    launcher's directory away and put their own in its place: the launcher's INFO and the
    workers' AUTH (the job's password) went to their socket. The launcher refuses such a
    $TMPDIR before it makes anything there."""
    base = Path(tempfile.mkdtemp(prefix="shmcache-test-scratch-", dir="/tmp"))  # the other user reaches it
    try:
        base.chmod(0o755)
        shared = base / "scratch"
        shared.mkdir()
        shared.chmod(0o777)  # writable by all, no sticky bit: some clusters' scratch disks
        worker = tmp_path / "cued_worker.py"
        worker.write_text(CUED_WORKER)
        cue = tmp_path / "go"
        hostile = subprocess.Popen(["runuser", "-u", ATTACKER, "--", attacker_python, "-c", SWAPPER, str(shared)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                   env={"PATH": os.environ["PATH"]})
        job = subprocess.Popen([*LAUNCH, "--remote", "spawn:16", str(worker), str(cue)], stderr=subprocess.PIPE,
                               text=True, env={**os.environ, "TMPDIR": str(shared),
                                               "SHMCACHE_DIR": str(tmp_path / "ns")})
        hostile.stdin.write(f"{job.pid}\n")
        hostile.stdin.flush()
        lines: list[str] = []

        def read() -> None:
            for line in hostile.stdout:
                lines.append(line)
                if line.strip() == "swapped":
                    cue.touch()  # the other user is in place: the worker may go

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        _, err = job.communicate(timeout=90)
        hostile.stdin.close()
        reader.join(timeout=60)
        hostile.wait(timeout=10)
        hostile.stdout.close()
        got = json.loads(lines[-1])["got"]
        assert "AUTH" not in got and "INFO" not in got, got  # nothing reached the other user
        assert job.returncode == 1, err
        assert f"the temporary directory '{shared}' ($TMPDIR) is not safe" in err, err
        assert "writable by every user and not sticky (mode 777)" in err and "/tmp" in err, err
        assert list(shared.iterdir()) == []  # nothing made there
    finally:
        shutil.rmtree(base, ignore_errors=True)


@pytest.mark.parametrize("mode, uid, gid, refused", [
    (0o1777, 0, 0, None),  # /tmp's kind: sticky
    (0o700, None, None, None),  # the user's own
    (0o755, 65534, 65534, "owned by another user (uid 65534)"),  # its owner may rename anything there
    (0o770, None, 65534, "writable by its group and not sticky (mode 770)"),
    (0o777, None, None, "writable by every user and not sticky (mode 777)"),
], ids=["sticky", "own", "another-users", "group-writable", "world-writable"])
def test_the_launchers_directory_is_made_only_where_nobody_else_can_replace_it(tmp_path, monkeypatch, mode, uid,
                                                                                  gid, refused):
    from shmcache.errors import LaunchError
    from shmcache.launch.supervisor import launch_directory

    if (uid, gid) != (None, None) and os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another user")
    parent = tmp_path / "parent"
    parent.mkdir()
    os.chown(parent, os.geteuid() if uid is None else uid, os.getegid() if gid is None else gid)
    parent.chmod(mode)
    link = tmp_path / "link"
    link.symlink_to(parent)  # $TMPDIR through a symlink: judged, and used, by its real path
    monkeypatch.setattr(tempfile, "tempdir", str(link))
    if refused is None:
        with launch_directory() as made:
            assert Path(made).parent == parent and (Path(made).stat().st_mode & 0o777) == 0o700
        return
    with pytest.raises(LaunchError, match=rf"{link}.*not safe.*{parent} is {re.escape(refused)}.*set \$TMPDIR"):
        with launch_directory():
            pass
    assert list(parent.iterdir()) == []


@pytest.mark.parametrize("remote", [[], ["--remote", "spawn:32"]], ids=["workers", "spawn"])
def test_a_sigkilled_launchers_temporary_directory_is_removed(tmp_path, nodes, remote):
    """No code runs in a SIGKILLed launcher: its guard removes /tmp/shmcache-launch-*."""
    if remote and REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    proc = nodes(0, 1, *remote, PING, str(tmp_path), "sleep")
    read_reports(tmp_path, 1)
    (made,) = Path(os.environ["TMPDIR"]).glob("shmcache-launch-*")
    proc.kill()
    proc.wait(timeout=10)
    deadline = time.monotonic() + 10
    while made.exists():
        assert time.monotonic() < deadline, f"{made} outlived its SIGKILLed launcher: {list(made.iterdir())}"
        time.sleep(0.05)


#: A launcher killed together with its guard (the OOM killer, say): nothing removes its directory.
KILLED_WITH_ITS_GUARD = r"""
import os, signal, sys
from shmcache.launch.supervisor import launch_directory
with launch_directory() as path:
    print(path, flush=True)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            if ppid == os.getpid():
                os.kill(int(entry), signal.SIGKILL)  # the guard
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_gc_removes_the_directory_of_a_launcher_killed_with_its_guard(tmp_path):
    from shmcache.launch.supervisor import launch_directory
    run = subprocess.run([sys.executable, "-c", KILLED_WITH_ITS_GUARD], capture_output=True, text=True,
                         timeout=30)
    assert run.returncode == -signal.SIGKILL, run.stderr
    left = Path(run.stdout.strip())
    assert left.is_dir() and left.name.startswith("shmcache-launch-")
    foreign = Path(os.environ["TMPDIR"]) / "shmcache-launch-not-a-launchers"
    foreign.mkdir()  # no launcher file: not gc's to remove
    with launch_directory() as live:  # a running launcher's: kept
        gc = subprocess.run([sys.executable, "-m", "shmcache.cli", "gc"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, "SHMCACHE_DIR": str(tmp_path / "ns")})
        assert gc.returncode == 0, gc.stderr
        assert os.path.isdir(live)
    assert not left.exists()
    assert f"gc: removed {left}, the temporary directory of a launcher that was killed" in gc.stdout
    assert foreign.is_dir()


# --- the Slurm recipe -------------------------------------------------------------------------

FAKE_SRUN = """#!/bin/bash
# srun for a test: the command once per "node", SLURM_NODEID=K, each with its own namespace
while [[ "$1" == --* ]]; do shift; done
pids=()
for k in $(seq 0 $((SLURM_NNODES - 1))); do
    SLURM_NODEID=$k SHMCACHE_DIR="$FAKE_NAMESPACES/node$k" "$@" &
    pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""


@needs_redis
@pytest.mark.skipif(shutil.which("bash") is None, reason="bash is not installed")
def test_slurm_recipe_with_remote_spawn(tmp_path):
    """launch/slurm.sbatch under a stand-in srun (two nodes on this machine) and REMOTE=spawn."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(FAKE_SRUN)
    (bin_dir / "scontrol").write_text("#!/bin/sh\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    out = tmp_path / "out"
    out.mkdir()
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "n[1-2]",
           "SLURM_NNODES": "2", "MASTER_PORT": str(free_port_pair()), "REMOTE": "spawn:32",
           "FAKE_NAMESPACES": str(tmp_path / "ns")}
    assert "SHMCACHE_RDZV_TOKEN" not in env  # the recipe makes the job's own
    run = subprocess.run(["bash", str(REPO / "launch" / "slurm.sbatch"), PING, str(out), "exit0",
                          "exit0"], env=env, capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    reports = read_reports(out, 2, timeout_s=1)
    check_job(reports, 2)
    assert_servers_gone(reports)
    assert password_of(reports[0]["url"]) not in run.stdout + run.stderr
    assert reports[0]["secret"] == reports[1]["secret"] and len(reports[0]["secret"]) >= 64
    assert reports[0]["secret"] not in run.stdout + run.stderr
