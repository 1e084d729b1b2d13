"""Helpers shared by the benchmarks: robust statistics, the environment line, sizes, tables.

Statistics are medians and p90s, never means: on a shared machine one descheduled run drags a mean
anywhere, a median stays put.
"""

from __future__ import annotations

import os
import platform
import socket
import sys
from collections.abc import Iterable, Sequence
from importlib import metadata
from pathlib import Path

import numpy as np

__all__ = [
    "median",
    "p90",
    "fmt_rate",
    "fmt_bytes",
    "fmt_ratio",
    "fmt_s",
    "allocated_bytes",
    "shm_usage",
    "free_loopback_port",
    "package_version",
    "environment",
    "environment_line",
    "markdown_table",
    "KernelOnly",
]


class FreeSource:
    """A map-style source whose items cost nothing: one ready 3 KB array (a miss path alone)."""

    def __init__(self, n: int):
        self.n, self.item = n, np.zeros(3072, np.uint8)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        return self.item


class KernelOnly:
    """The dataset's rows, and for each batch the bytes the cache's records of it would take
    (``row_bytes`` a row) written into fresh pages where the cache's would go (``/dev/shm``, or
    ``$SHMCACHE_MEMORY_DIR``) as the cache's writer does it (one ``posix_fallocate`` and one
    ``pwritev`` a batch), and nothing else: the most a shared-memory cache's cold epoch can reach
    here with the kernel's part on the loader's thread (pages backed ahead on an idle CPU,
    ``shmcache.base.ahead``, take part of it off). An epoch of it counts what the kernel's part
    costs inside an epoch, not in a loop of its own: those writes also evict the dataset's working
    set from the CPU's caches. Optimistic for a cache: the bytes come from one buffer that the
    CPU's caches hold."""

    def __init__(self, dataset, row_bytes: int):
        self.dataset = dataset
        self.row = bytes(max(1, row_bytes))
        self.fd, self.pid, self.end = -1, -1, 0

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, keys: list) -> list:
        rows = self.dataset.__getitems__(keys)
        if self.pid != os.getpid():  # a file of this process's (a forked worker's own)
            import tempfile

            from shmcache.base import settings

            where = settings.get(settings.ENV_MEMORY_DIR) or "/dev/shm"
            self.fd, path = tempfile.mkstemp(dir=where, prefix="bench-kernel-only-")
            os.unlink(path)  # its pages go when the descriptor does
            self.pid, self.end = os.getpid(), 0
        n = len(rows) * len(self.row)
        os.posix_fallocate(self.fd, self.end, n)
        os.pwritev(self.fd, [self.row] * len(rows), self.end)
        self.end += n
        return rows

    def close(self) -> None:
        if self.pid == os.getpid():
            os.close(self.fd)
        self.fd, self.pid = -1, -1


def private_namespace(prefix: str) -> str:
    """Point $SHMCACHE_DIR at a fresh directory of this run's (unless the caller set one), and on
    the way out (atexit: a normal end, an exception, sys.exit, SIGTERM - a `timeout`) destroy every
    session made there - their shared memory too - and remove the directory: a benchmark leaves
    nothing behind. Only the process that made it cleans (not a forked DataLoader worker)."""
    import atexit
    import shutil
    import signal
    import tempfile

    if "SHMCACHE_DIR" in os.environ:
        return os.environ["SHMCACHE_DIR"]
    where = os.environ["SHMCACHE_DIR"] = tempfile.mkdtemp(prefix=prefix)
    owner = os.getpid()

    def clean() -> None:
        if os.getpid() != owner:
            return
        try:
            from shmcache.cache.registry import SessionRegistry

            registry = SessionRegistry()
            for info in registry.list():
                registry.destroy(info.name, force=True)
        finally:
            shutil.rmtree(where, ignore_errors=True)

    def terminated(signum, frame) -> None:
        raise SystemExit(128 + signum)  # atexit runs on the way out

    atexit.register(clean)
    if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, terminated)
    return where


INSIDE_NAMESPACE = "--inside-namespace"


def inside_mount(argv: list[str]) -> str | None:
    """In the script ``in_huge_tmpfs`` runs again: the mount it made, taken out of ``argv`` with
    its flag; None outside the namespace (the script then runs itself there)."""
    if INSIDE_NAMESPACE not in argv:
        return None
    i = argv.index(INSIDE_NAMESPACE)
    mount = argv[i + 1]
    del argv[i:i + 2]
    return mount


def in_huge_tmpfs(script: str, argv: list[str], size: str) -> int:
    """Run ``script`` again (argv: ``INSIDE_NAMESPACE <mount> argv...``) in a private mount
    namespace (``unshare -m``) with a tmpfs ``huge=within_size`` of ``size`` mounted for it:
    nothing of the machine's changes. Needs root."""
    import shutil
    import subprocess
    import sys
    import tempfile

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        print("needs root and unshare(1): the huge-page tmpfs is mounted in a private mount namespace",
              file=sys.stderr)
        return 2
    mnt = tempfile.mkdtemp(prefix="shmcache-bench-huge-")
    try:
        inner = (f"mount -t tmpfs -o size={size},huge=within_size tmpfs {mnt} && "
                 f"exec {sys.executable} {script} {INSIDE_NAMESPACE} {mnt} {' '.join(argv)}")
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", inner]).returncode
    finally:
        os.rmdir(mnt)


def shuffled_epoch(ds, workers: int, batch_size: int = 64) -> float:
    """Seconds of one ``DataLoader(ds, batch_size, shuffle=True, num_workers=workers)`` epoch
    (the same order each time: seed 0; forked workers, not kept between epochs)."""
    import time

    import torch
    from torch.utils.data import DataLoader

    torch.manual_seed(0)
    loader = DataLoader(ds, batch_size=batch_size, shuffle=True, num_workers=workers,
                        persistent_workers=False, multiprocessing_context="fork" if workers else None)
    t = time.perf_counter()
    for _ in loader:
        pass
    return time.perf_counter() - t


def median(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None]
    return float(np.median(vals)) if vals else float("nan")


def p90(values: Iterable[float]) -> float:
    vals = [v for v in values if v is not None]
    return float(np.percentile(vals, 90)) if vals else float("nan")


def _finite(x: float | None) -> bool:
    return x is not None and np.isfinite(x)


def fmt_rate(x: float | None) -> str:
    """Items/s with three significant digits and k/M suffixes: 1.23M, 45.6k, 789."""
    if not _finite(x):
        return "—"
    for scale, suffix in ((1e6, "M"), (1e3, "k")):
        if x >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def fmt_bytes(n: float | None) -> str:
    if not _finite(n):
        return "—"
    for scale, suffix in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{int(n)} B"


def fmt_ratio(x: float | None) -> str:
    return f"{x:.2g}×" if _finite(x) else "—"


def fmt_s(x: float | None) -> str:
    return f"{x:.3g}" if _finite(x) else "—"


def allocated_bytes(path: str | os.PathLike) -> int:
    """Bytes really allocated under ``path`` (st_blocks, so sparse files count what they use)."""
    p = Path(path)
    if not p.exists():
        return 0
    if p.is_file():
        return p.stat().st_blocks * 512
    total = 0
    for root, _dirs, files in os.walk(p):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def shm_usage() -> tuple[int, int]:
    """(size, free) of /dev/shm in bytes."""
    st = os.statvfs("/dev/shm")
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def free_loopback_port() -> int:
    """A free TCP port on 127.0.0.1 (loopback only: nothing of the benchmark listens elsewhere)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def package_version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def _mem_total() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def environment(extra: dict[str, str] | None = None) -> dict[str, str]:
    """Versions, CPUs, memory and /dev/shm: what a reader needs to judge the numbers."""
    shm_size, shm_free = shm_usage()
    env = {
        "python": platform.python_version(),
        "numpy": np.__version__,
        "torch": package_version("torch"),
        "cpus": f"{len(os.sched_getaffinity(0))} usable of {os.cpu_count()} ({_cpu_model()})",
        "mem": fmt_bytes(_mem_total()),
        "/dev/shm": f"{fmt_bytes(shm_size)} ({fmt_bytes(shm_free)} free)",
        "loadavg": " ".join(Path("/proc/loadavg").read_text().split()[:3]),
        "kernel": platform.release(),
    }
    env.update(extra or {})
    return env


def environment_line(env: dict[str, str]) -> str:
    return "env: " + "; ".join(f"{k} {v}" for k, v in env.items()) + f"; argv {' '.join(sys.argv[1:])}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]], align: str | None = None) -> str:
    """A GitHub markdown table; ``align`` is one char per column, 'l' or 'r' (default: first l, rest r)."""
    align = align or "l" + "r" * (len(headers) - 1)
    sep = ["---" if a == "l" else "--:" for a in align]
    lines = [headers, sep, *rows]
    return "\n".join("| " + " | ".join(str(c) for c in line) + " |" for line in lines)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """A plain aligned text table (the bench_*.py scripts' output)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(c.ljust(w) for c, w in zip(r, widths)))


def start_redis(workdir: str | os.PathLike) -> tuple:
    """A password-protected redis-server on 127.0.0.1 for a benchmark, without persistence, its log
    in ``workdir``, answering PING: ``(process, url, port, password)``; the caller kills it."""
    import secrets
    import subprocess
    import time

    import redis

    port, password = free_loopback_port(), secrets.token_hex(12)
    server = subprocess.Popen(["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "",
                               "--appendonly", "no", "--dir", str(workdir), "--requirepass", password,
                               "--logfile", str(Path(workdir) / "redis.log")],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port, password=password).ping()
            return server, f"redis://:{password}@127.0.0.1:{port}", port, password
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                server.kill()
                server.wait()
                raise
            time.sleep(0.05)
