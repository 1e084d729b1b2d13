"""What reading the metrics at 1 Hz costs a running job: bench_dataloader.py's warm DataLoader row
(3 KB items, batch 256, shuffled; its waits counted by shmcache.timed), measured in windows that
alternate without and with a scraper - a process serving /metrics as the launcher's
--metrics-port does (tiers/prometheus.serve, every cache of the node read on each scrape) and
fetching it once a second over HTTP. Same run, interleaved windows, ratio of the medians.

    python benchmarks/bench_metrics.py            # ~1 minute
    python benchmarks/bench_metrics.py --quick    # ~15 s
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import environment, environment_line, fmt_rate, median, print_table  # noqa: E402

import shmcache  # noqa: E402
from shmcache import ShmDatasetCache  # noqa: E402
from shmcache.base.namespace import namespace  # noqa: E402
from shmcache.cache.registry import SessionRegistry  # noqa: E402

_SCRAPER = """
import os, sys, time, urllib.request, resource
from pathlib import Path
from shmcache.base.namespace import namespace
from shmcache.cache.registry import SessionRegistry
from shmcache.launch import metrics_server
flag, out = Path(sys.argv[1]), Path(sys.argv[2])
server = metrics_server.start(SessionRegistry(namespace()), "127.0.0.1", 0)
url = "http://127.0.0.1:%d/metrics" % server.server_address[1]
scrapes, size, scrape_cpu = 0, 0, 0.0
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
while not (flag.parent / "stop").exists():
    if flag.exists():
        before = cpu()
        with urllib.request.urlopen(url, timeout=10) as r:
            size = len(r.read())
        scrape_cpu += cpu() - before  # the request and the server's answer: both in this process
        scrapes += 1
    time.sleep(1.0)
out.write_text("%d %f %d %f" % (scrapes, cpu(), size, scrape_cpu))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    n, rounds, window_s = (20_000, 3, 2.0) if args.quick else (50_000, 6, 4.0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-metrics-"))
    os.environ["SHMCACHE_DIR"] = str(tmp / "ns")
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, (n, 32, 32, 3), dtype=np.uint8)
    y = rng.integers(0, 10, n)
    cache = ShmDatasetCache(session="bench-metrics", name="d3k", size=0)
    ds = cache.wrap([(x[i], int(y[i])) for i in range(n)], fingerprint="bench-metrics-3k")
    cache.warmup(ds, progress=False)
    loader = DataLoader(ds, batch_size=256, shuffle=True)
    for _ in shmcache.timed(loader):
        pass  # the first pass is not measured
    flag = tmp / "scrape"
    scraper = subprocess.Popen([sys.executable, "-c", _SCRAPER, str(flag), str(tmp / "scraper.out")])
    rates: dict[str, list[float]] = {"without": [], "with": []}
    try:
        time.sleep(2.0)  # the scraper imported and serving
        for _ in range(rounds):
            for name in ("without", "with"):
                if name == "with":
                    flag.write_text("")
                else:
                    flag.unlink(missing_ok=True)
                end, items, start = time.perf_counter() + window_s, 0, time.perf_counter()
                while time.perf_counter() < end:
                    for batch in shmcache.timed(loader):
                        items += len(batch[1])
                        if time.perf_counter() >= end:
                            break
                rates[name].append(items / (time.perf_counter() - start))
    finally:
        flag.unlink(missing_ok=True)
        (tmp / "stop").write_text("")
        scraper.wait(30)
    scrapes, cpu_s, size, scrape_cpu = (tmp / "scraper.out").read_text().split()
    st = cache.stats()
    cache.close()
    SessionRegistry(namespace()).destroy("bench-metrics", force=True)
    shutil.rmtree(tmp, ignore_errors=True)
    off, on = median(rates["without"]), median(rates["with"])
    print(environment_line(environment()))
    print_table(["row", "items/s (median of windows)", "windows", "ratio"],
                [["DataLoader, no scraper", fmt_rate(off), str(rounds), "1.000"],
                 ["DataLoader, /metrics scraped at 1 Hz", fmt_rate(on), str(rounds), f"{on / off:.3f}"]])
    print(f"scraper: {scrapes} scrapes of {int(size)} bytes, {float(cpu_s):.2f} s of CPU in all "
          f"(imports and server included), {float(scrape_cpu) / max(1, int(scrapes)) * 1e3:.1f} ms of CPU "
          f"per scrape; the job's stall share {st['stall_share']:.1%}")


if __name__ == "__main__":
    main()
