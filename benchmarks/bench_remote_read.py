"""One batch read from Redis: the remote tier's pipelined ``GETRANGE key 0 bound-1`` per key (each
value read only as far as the largest record the tier would accept) against one ``MGET`` of the
same keys (what it sent before: ``client.mget``), on one local redis-server.

    python benchmarks/bench_remote_read.py            # ~20 s on 2 cores
    python benchmarks/bench_remote_read.py --quick

Rows: value sizes of 3 KB (cifar-like) and 150 KB (imagenet-like), 256 keys a batch. Columns:
the median seconds of one batch's read (the raw values, before any check), by each command, and
their same-run ratio; ``get_many``: the whole tier read (GETRANGE, MAC-less record checks and
decode) for scale. Reads alternate between the two commands, so drift hits both alike.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, environment_line, median, print_table, start_redis  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds")
    ap.add_argument("--keys", type=int, default=256, help="keys a batch (default 256)")
    args = ap.parse_args()
    rounds = 15 if args.quick else 60

    import redis
    import zstandard

    from shmcache.tiers import remote
    from shmcache.tiers.records import pack_record

    rows = []
    with tempfile.TemporaryDirectory(prefix="shmcache-bench-") as workdir:
        server, url, port, password = start_redis(workdir)
        try:
            client = redis.Redis(port=port, password=password)
            for label, size in (("3 KB", 3 << 10), ("150 KB", 150 << 10)):
                tier = remote.RedisTier(url, f"bench{size}")
                pkeys = [b"k%06d" % i for i in range(args.keys)]
                rkeys = [tier.rkey(k) for k in pkeys]
                cctx = zstandard.ZstdCompressor(level=1)
                for rk in rkeys:
                    client.set(rk, b"".join(pack_record(rk, os.urandom(size), cctx)))
                ranged, mget, whole = [], [], []
                for _ in range(rounds):
                    t = time.perf_counter()
                    got = tier.fetch(pkeys)
                    ranged.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    old = client.mget(rkeys)  # what the tier sent before, the same way
                    mget.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    tier.get_many(pkeys)
                    whole.append(time.perf_counter() - t)
                    assert got == old, "GETRANGE and MGET read different values"
                r, m = median(ranged), median(mget)
                rows.append(
                    [
                        label,
                        f"{args.keys}",
                        f"{m * 1e3:.2f} ms",
                        f"{r * 1e3:.2f} ms",
                        f"{r / m:.2f}x",
                        f"{median(whole) * 1e3:.2f} ms",
                    ]
                )
                client.delete(*rkeys)
                tier.close()
            client.close()
        finally:
            server.kill()
            server.wait()
    print_table(["values", "keys", "MGET", "GETRANGE pipeline", "ratio", "get_many"], rows)
    print(environment_line(environment()))


if __name__ == "__main__":
    main()
