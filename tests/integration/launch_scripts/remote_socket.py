"""Worker that writes and reads one value through the remote tier with ``$SHMCACHE_REMOTE`` (what
``--remote spawn`` gave it), and reports how its node's redis-server is reached meanwhile.

Usage: remote_socket.py OUTDIR

Writes OUTDIR/socket-<RANK>.json: the value read back, and for the redis-server its launcher
started (the worker's parent's child), the TCP connections it holds (ESTABLISHED in
/proc/net/tcp{,6}, by the inodes of its /proc/PID/fd) and the Unix-socket ones, counted while
the tier's connection is open.
"""

import json
import os
import sys

from remote_ping import redis_servers_of

from shmcache.launch.redis_node import socket_inodes
from shmcache.tiers.remote import RedisTier


def connections(pid: int) -> dict[str, int]:
    inodes = socket_inodes(pid)
    out = {"tcp": 0, "unix": 0}
    for table, kind in (("/proc/net/tcp", "tcp"), ("/proc/net/tcp6", "tcp"), ("/proc/net/unix", "unix")):
        with open(table) as f:
            for line in f.read().splitlines()[1:]:
                fields = line.split()
                if kind == "tcp" and fields[3] == "01" and fields[9] in inodes:  # 01: ESTABLISHED
                    out["tcp"] += 1
                if kind == "unix" and fields[5] == "03" and fields[6] in inodes:  # 03: connected
                    out["unix"] += 1
    return out


def main() -> None:
    out_dir, rank = sys.argv[1], int(os.environ["RANK"])
    (server,) = redis_servers_of(os.getppid())
    tier = RedisTier(os.environ["SHMCACHE_REMOTE"], "socket-test", secret=os.environ["SHMCACHE_SECRET"].encode())
    tier.offer([(b"k", b"a value")])
    tier.flush()
    value = tier.get(b"k")
    seen = connections(int(server))  # the tier's connection is open now
    tier.close()
    with open(os.path.join(out_dir, f"socket-{rank}.json"), "w") as f:
        json.dump({"value": None if value is None else bytes(value).decode(), "connections": seen,
                   "counters": tier.counters()}, f)


if __name__ == "__main__":
    main()
