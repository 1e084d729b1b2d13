"""The metrics as a monitoring system reads them: `shmcache stat --prometheus` and the launcher's
`/metrics`, parsed by prometheus_client's own parser and compared with `stats()`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _journey import env, run

from shmcache.tiers.prometheus import METRICS, RANK_METRICS

parser = pytest.importorskip("prometheus_client.parser")
LOOP = Path(__file__).with_name("_stall_loop.py")


def samples(text: str) -> dict:
    """{(metric sample name, frozenset of labels): value} of an exposition, with each family's type."""
    out, types = {}, {}
    for fam in parser.text_string_to_metric_families(text):
        types[fam.name] = fam.type
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out, types


def check_equal(text: str, st: dict) -> None:
    got, types = samples(text)
    base = {("session", st["session"]), ("cache", st["name"])}
    assert got[("shmcache_cache_up", frozenset(base))] == 1.0
    compared = 0
    for key, (name, kind, _) in METRICS.items():
        if key not in st:
            continue
        assert types[name] == kind, name
        sample = name + "_total" if kind == "counter" else name
        assert got[(sample, frozenset(base))] == st[key], key
        compared += 1
    for rank, per in st["ranks"].items():
        for key, (name, kind, _) in RANK_METRICS.items():
            sample = name + "_total" if kind == "counter" else name
            assert got[(sample, frozenset(base | {("rank", rank)}))] == per[key], (rank, key)
            compared += 1
    assert compared >= len([k for k in METRICS if k in st]) + 4


def test_stat_prometheus_equals_stats(tmp_path):
    e = env()
    e["RANK"] = "5"
    st = json.loads(run([LOOP, "timed", 0.0, 0.0], tmp_path, e).splitlines()[-1])
    assert st["ranks"]["5"]["stall_waits"] == 8
    text = run(["-m", "shmcache", "stat", "--prometheus"], tmp_path, env())
    check_equal(text, st)
    assert "shmcache_hits_total{" in text and "shmcache_input_stall_seconds_total{" in text
    # one session only, and the json and the exposition agree
    text = run(["-m", "shmcache", "stat", "stall", "--prometheus"], tmp_path, env())
    (row,) = json.loads(run(["-m", "shmcache", "stat", "stall", "--json"], tmp_path, env()))
    check_equal(text, row)


def test_stat_prometheus_of_nothing_parses(tmp_path):
    text = run(["-m", "shmcache", "stat", "--prometheus"], tmp_path, env())
    got, _ = samples(text)
    assert got == {}


_WORKER = '''
import json, os, sys, time
from pathlib import Path
import torch
from torch.utils.data import DataLoader
import shmcache
from shmcache import ShmDatasetCache

out = Path(sys.argv[1])
cache = ShmDatasetCache(name="data", size=16)
ds = cache.wrap([torch.full((4,), float(i)) for i in range(32)], fingerprint="list-v1")
for batch in shmcache.timed(DataLoader(ds, batch_size=4)):
    pass
(out / "stats.tmp").write_text(json.dumps(cache.stats()))
(out / "stats.tmp").rename(out / "stats.json")
deadline = time.monotonic() + 60  # the test scrapes meanwhile, then says done
while not (out / "done").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
'''


def test_launcher_serves_metrics_and_sums_up(tmp_path):
    import subprocess
    import sys
    import time
    import urllib.request

    (tmp_path / "worker.py").write_text(_WORKER)
    proc = subprocess.Popen([sys.executable, "-m", "shmcache.launch", "--session", "job", "--metrics-port", "0",
                             "worker.py", str(tmp_path)], cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        first = proc.stderr.readline()  # the launcher's first line names the address
        assert first.startswith("python -m shmcache.launch: metrics at http://127.0.0.1:"), first
        url = first.split(" at ", 1)[1].strip()
        deadline = time.monotonic() + 60
        while not (tmp_path / "stats.json").exists():
            assert time.monotonic() < deadline and proc.poll() is None, "the worker never filled its cache"
            time.sleep(0.05)
        st = json.loads((tmp_path / "stats.json").read_text())
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            text = response.read().decode()
        check_equal(text, st)
        assert st["ranks"]["0"]["stall_waits"] == 8
        (tmp_path / "done").write_text("")
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    assert proc.returncode == 0, err
    (line,) = [ln for ln in err.splitlines() if ln.startswith("shmcache.launch: cache job/data:")]
    assert "hit ratio" in line and "stall share" in line and "computed 32" in line, line


def test_a_taken_metrics_port_is_named(tmp_path):
    import socket
    import subprocess
    import sys

    (tmp_path / "worker.py").write_text("print('never')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "shmcache.launch", "--metrics-port", str(port), "worker.py"],
                              cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert f"--metrics-port {port} on 127.0.0.1 cannot be served" in done.stderr
    assert "pick another port" in done.stderr and "never" not in done.stdout


def test_without_prometheus_client_the_fix_is_named(tmp_path):
    import subprocess
    import sys

    code = ("import sys; sys.modules['prometheus_client'] = None; from shmcache.cli.main import main; "
            "sys.exit(main(['stat', '--prometheus']))")
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env(), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "pip install 'shmcache[metrics]'" in done.stderr


@pytest.mark.slow
@pytest.mark.skipif(__import__("shutil").which("prometheus") is None, reason="needs Debian's prometheus")
def test_a_prometheus_server_scrapes_the_launcher(tmp_path):
    import socket
    import subprocess
    import sys
    import time
    import urllib.parse
    import urllib.request

    (tmp_path / "worker.py").write_text(_WORKER)
    launcher = subprocess.Popen([sys.executable, "-m", "shmcache.launch", "--session", "job", "--metrics-port", "0",
                                 "worker.py", str(tmp_path)], cwd=tmp_path, env=env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    server = None
    try:
        first = launcher.stderr.readline()
        target = first.split("http://", 1)[1].split("/", 1)[0]
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            web = s.getsockname()[1]
        (tmp_path / "prometheus.yml").write_text(
            "global:\n  scrape_interval: 1s\nscrape_configs:\n  - job_name: shmcache\n"
            f"    static_configs:\n      - targets: ['{target}']\n")
        server = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                   f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                                  cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        query = urllib.parse.quote('shmcache_input_waits_total{session="job",cache="data",rank="0"}')
        deadline, value = time.monotonic() + 90, None
        while value != "8":
            assert time.monotonic() < deadline, f"prometheus never saw 8 waits (last: {value})"
            assert launcher.poll() is None and server.poll() is None
            time.sleep(0.5)
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{web}/api/v1/query?query={query}", timeout=5) as r:
                    result = json.loads(r.read())["data"]["result"]
            except OSError:
                continue  # not listening yet
            value = result[0]["value"][1] if result else None
        (tmp_path / "done").write_text("")
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 0, err
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        if launcher.poll() is None:
            launcher.kill()
            launcher.communicate(timeout=10)
