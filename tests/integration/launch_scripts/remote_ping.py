"""Worker that reports what ``--remote`` gave it, and whether each Redis endpoint answers.

Usage: remote_ping.py OUTDIR ACTION_OF_RANK_0 ACTION_OF_RANK_1 ...

Every rank writes OUTDIR/remote-<RANK>.json: its PID, $SHMCACHE_REMOTE, the endpoints of a
``redis+shards://`` URL and, for each, whether it answered AUTH + PING with the URL's user and password
(the Redis protocol by hand: two commands need no client library), and the PID and command line
of every ``redis-server`` whose parent is this worker's parent (the launcher), the job's
``$SHMCACHE_SECRET`` and whether ``$SHMCACHE_RDZV_TOKEN`` reached it. Actions:
    exit0   wait until every rank wrote its file (30 s at most), then exit 0: a node's launcher
            stops its redis-server when its workers are done, so a rank that left early would
            take its endpoint away from a rank still pinging it
    raise   wait until every rank wrote its file, then raise
    sleep   sleep for a minute (the launcher must stop it)
"""

import json
import os
import socket
import sys
import time
from urllib.parse import urlsplit


def answers(endpoint: str, user: str, password: str) -> bool:
    host, port = endpoint.rsplit(":", 1)
    words = [b"AUTH", user.encode(), password.encode()] if user else [b"AUTH", password.encode()]
    request = b"*%d\r\n" % len(words) + b"".join(b"$%d\r\n%s\r\n" % (len(w), w) for w in words)
    request += b"*1\r\n$4\r\nPING\r\n"
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=5) as sock:
            sock.sendall(request)
            reply = b""
            while reply.count(b"\r\n") < 2:
                chunk = sock.recv(256)
                if not chunk:
                    break
                reply += chunk
    except OSError:
        return False
    return reply == b"+OK\r\n+PONG\r\n"


def redis_servers_of(parent: int) -> dict[str, str]:
    servers = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if ppid == parent and os.path.basename(cmdline.split(" ", 1)[0]) == "redis-server":
            servers[entry] = cmdline
    return servers


def every_rank_reported(out_dir: str, world_size: int, timeout_s: float = 30.0) -> bool:
    """Wait until every rank wrote its report (True), or timeout_s passed (False)."""
    deadline = time.monotonic() + timeout_s
    while not all(os.path.exists(os.path.join(out_dir, f"remote-{r}.json")) for r in range(world_size)):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def main() -> None:
    out_dir, actions = sys.argv[1], sys.argv[2:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    url = os.environ.get("SHMCACHE_REMOTE")
    record = {"rank": rank, "pid": os.getpid(), "launcher": os.getppid(), "url": url,
              "secret": os.environ.get("SHMCACHE_SECRET"),
              "has_rdzv_token": "SHMCACHE_RDZV_TOKEN" in os.environ}
    if url and url.startswith("redis+shards://"):
        parts = urlsplit(url)
        endpoints = parts.netloc.rsplit("@", 1)[1].split(",")
        record["endpoints"] = endpoints
        record["answers"] = [answers(e, parts.username or "", parts.password or "") for e in endpoints]
    record["redis_servers"] = redis_servers_of(os.getppid())
    path = os.path.join(out_dir, f"remote-{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)

    action = actions[rank]
    if action == "exit0":
        every_rank_reported(out_dir, world_size)
    if action == "raise":
        if not every_rank_reported(out_dir, world_size):
            raise TimeoutError("the other ranks did not start within 30 s")
        raise RuntimeError(f"rank {rank} fails on purpose")
    if action == "sleep":
        time.sleep(60)


if __name__ == "__main__":
    main()
