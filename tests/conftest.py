"""Shared fixtures: every test runs in its own shmcache namespace and must leave nothing behind.

The autouse fixture points ``$SHMCACHE_DIR`` at a fresh directory, so segment names, lock files and
the registry of one test never meet another's (or a parallel run's). At teardown it destroys every
session still registered there - which exercises ``destroy`` on every test - and then fails the test
if any shared-memory object of the namespace is still in ``/dev/shm``, or any child process it
started is still alive.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from shmcache.base.namespace import ENV_DIR, ENV_SESSION, ENV_SPILL_DIR, namespace
from shmcache.base.settings import ENV_MEMORY_DIR
from shmcache.cache import hit


def _children(pid: int) -> set[int]:
    """Direct and indirect children of ``pid`` (from /proc), so a test can't leave processes behind."""
    kids: set[int] = set()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return kids
    parent_of: dict[int, int] = {}
    for e in entries:
        if not e.isdigit():
            continue
        try:
            with open(f"/proc/{e}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":  # zombies are reaped by whoever owns them; they hold nothing
            continue
        parent_of[int(e)] = int(fields[1])
    frontier = {pid}
    while frontier:
        nxt = {c for c, p in parent_of.items() if p in frontier} - kids
        kids |= nxt
        frontier = nxt
    return kids


@pytest.fixture(scope="session", autouse=True)
def resource_tracker_started_first():
    """multiprocessing's resource tracker is a child that lives as long as the test run. Started
    here, before any test, it is never mistaken for a process that a test left behind - whichever
    test happens to be the first to use multiprocessing (a DataLoader with workers, spawn)."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    yield


@pytest.fixture(scope="session", autouse=True)
def torch_compiler_cache_in_the_run(tmp_path_factory):
    """torch's first optimizer step (a test's, or a training script's that a test starts) makes
    its compiler's cache folder, /tmp/torchinductor_<user>, unless $TORCHINDUCTOR_CACHE_DIR names
    one: this run's own (under pytest's temporary folder), which the processes it starts inherit."""
    if "TORCHINDUCTOR_CACHE_DIR" in os.environ:  # the caller's choice
        yield
        return
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path_factory.mktemp("torchinductor"))
    yield
    os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


@pytest.fixture(autouse=True)
def shm_namespace(tmp_path, monkeypatch):
    root = tmp_path / "shmcache-ns"
    monkeypatch.setenv(ENV_DIR, str(root))
    monkeypatch.delenv(ENV_SESSION, raising=False)
    monkeypatch.delenv(ENV_SPILL_DIR, raising=False)
    monkeypatch.delenv(ENV_MEMORY_DIR, raising=False)  # sessions in /dev/shm unless a test says
    ns = namespace()
    before = _children(os.getpid())
    yield ns

    problems = []
    deadline = time.monotonic() + 5.0
    stray = _children(os.getpid()) - before
    while stray and time.monotonic() < deadline:
        time.sleep(0.05)
        stray = _children(os.getpid()) - before
    if stray:
        problems.append(f"child processes left running: {sorted(stray)}")
        for pid in stray:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    from shmcache.cache.registry import SessionRegistry  # imported late: tests of config run without it

    registry = SessionRegistry(ns)
    for info in registry.list():
        registry.destroy(info.name, force=True)
    left = ns.owned_segments()
    if left:
        problems.append(f"segments left in /dev/shm after destroying every session: {left}")
        for name in left:
            try:
                os.unlink(ns.shm_path(name))
            except FileNotFoundError:
                pass
    if problems:
        pytest.fail("; ".join(problems))


@pytest.fixture(params=["compiled", "python"])
def hit_path(request, monkeypatch):
    """Each test twice: int-key hits through the compiled hot path and through the Python one
    (what an install without a C compiler, or ``SHMCACHE_NATIVE=0``, runs). hit's NATIVE is read
    when a view maps a generation: set it before the cache is opened."""
    if request.param == "compiled" and not hit.NATIVE and "not built" in hit.unavailable_reason():
        pytest.skip(f"the compiled hit: {hit.unavailable_reason()}")
    monkeypatch.setattr(hit, "NATIVE", request.param == "compiled")
    return request.param


@pytest.fixture
def huge_pages():
    """Huge pages reserved for the test (vm.nr_hugepages raised, then put back)."""
    knob = Path("/proc/sys/vm/nr_hugepages")
    if os.geteuid() != 0:
        pytest.skip("needs root: reserves huge pages and mounts a hugetlbfs in a private mount namespace")
    old = int(knob.read_text())
    try:
        knob.write_text(str(old + 64))
        if int(knob.read_text()) < old + 32:
            pytest.skip("the kernel could not reserve 32 huge pages here (memory too fragmented)")
        yield
    finally:
        knob.write_text(str(old))


@pytest.fixture
def private_mounts():
    """``run(steps, timeout)``: the shell command line ``steps`` in a private mount namespace
    (``unshare -m``, as root), where what it mounts (a small tmpfs, one over /dev/shm, a huge-page
    mount) is its own and goes with it; returns the finished process. Skips where the machine
    cannot: not root, no unshare(1), or a mount refused - which ``steps`` says with exit 99
    (``mount ... || exit 99``)."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1): mounts in a private mount namespace")

    def run(steps: str, timeout: float = 120) -> subprocess.CompletedProcess:
        proc = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", steps],
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode == 99 or "unshare failed" in proc.stderr:
            pytest.skip(f"cannot mount here: {proc.stderr.strip()[-300:]}")
        return proc

    return run


class CompiledPart:
    """The checks every optional compiled part of shmcache shares (``compiled_part``): each part's
    own tests call them with its flag, its reason and what ``shmcache info`` says of it."""

    @staticmethod
    def turned_off_by_env(probe: str, info: str) -> None:
        """``probe`` (Python that prints the part's flag, then its reason) run with
        ``SHMCACHE_NATIVE=0``: the flag False, the reason saying how to turn it on (or that it was
        not built); ``shmcache info --json`` then holds ``info``."""
        env = {**os.environ, "SHMCACHE_NATIVE": "0"}
        out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True,
                             timeout=60).stdout
        assert out.splitlines()[0] == "False", out
        assert ("SHMCACHE_NATIVE" in out and "unset it" in out) or "not built" in out, out
        shown = subprocess.run([sys.executable, "-m", "shmcache.cli", "info", "--json"], env=env,
                               capture_output=True, text=True, check=True, timeout=60).stdout
        assert info in shown, shown

    @staticmethod
    def built_where_it_can(native: bool, reason: str, not_built: str, without: str) -> None:
        """An install on a machine that can build the part must: the extension is optional, so a
        failed build would quietly leave ``without``. Fails with ``not_built`` and the reason
        (test_rowcopy's unbuilt-install tests look for that message)."""
        # the compiler setuptools runs: $CC, else Python's own; either may carry flags ("ccache gcc")
        cc = shlex.split(os.environ.get("CC") or sysconfig.get_config_var("CC") or "cc") or ["cc"]
        if not (shutil.which(cc[0]) and (Path(sysconfig.get_paths()["include"]) / "Python.h").exists()):
            pytest.skip(f"no C compiler or Python headers here: {without}")
        if "turned off" in reason:
            pytest.skip("turned off by SHMCACHE_NATIVE in this run")
        assert native, f"{not_built}: {reason}"


@pytest.fixture
def compiled_part() -> type[CompiledPart]:
    return CompiledPart


@pytest.fixture
def sanitized(tmp_path):
    """``run(c_file, script, *args)``: ``c_file`` (a compiled part of shmcache) built with
    AddressSanitizer and UBSan (-fno-sanitize-recover: the first finding aborts), then ``script``
    run by a child Python with it preloaded, given the built file and ``args``; returns the
    finished child. Skips where gcc or its AddressSanitizer runtime is missing."""
    cc = shutil.which("gcc")
    asan = cc and subprocess.run([cc, "-print-file-name=libasan.so"], capture_output=True, text=True).stdout.strip()
    if not asan or not os.path.isabs(asan):
        pytest.skip("no gcc with AddressSanitizer's runtime here")

    def run(c_file: Path, script: str, *args: str) -> subprocess.CompletedProcess:
        so = tmp_path / f"{c_file.stem}.so"
        subprocess.run([cc, "-shared", "-fPIC", "-g", "-O1", "-fsanitize=address,undefined",
                        "-fno-sanitize-recover=all", "-I", sysconfig.get_paths()["include"], str(c_file), "-o",
                        str(so)], check=True, timeout=120)
        env = {**os.environ, "LD_PRELOAD": asan, "ASAN_OPTIONS": "detect_leaks=0", "PYTHONMALLOC": "malloc"}
        return subprocess.run([sys.executable, "-c", script, str(so), *args], env=env, capture_output=True,
                              text=True, timeout=120)

    return run
