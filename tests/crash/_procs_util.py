"""Child processes for the crash and stress tests: every child is reaped, every wait is bounded.

Two ways to run a worker operation (the ``op_*`` functions of ``_worker.py``) in a real process:

* ``Procs.start(op, *args)`` starts a fresh interpreter (``python _worker.py op args``): the
  honest "a new program starts" case, ~0.35 s each.
* ``Zygote`` starts one interpreter that imports shmcache once and then forks a child per request,
  ~5 ms each, which is what makes a hundred SIGKILLs affordable. The zygote is started with the
  crash-point environment (``SHMCACHE_CRASH_AT``/``SHMCACHE_CRASH_AFTER``), so its children are
  processes "started with that environment"; the zygote itself never reaches a crash point.

Every operation writes its result as JSON to a file, so no pipe can fill and block a child. On exit
(normal or not) both helpers SIGKILL and reap whatever is still running, as filelock's
``process_helpers`` do, so a failing test never leaves a process behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["Procs", "Zygote", "wait_for", "WORKER", "release_barrier", "crash_env", "status_of"]

HERE = Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"
PY = sys.executable
_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK")


def crash_env(crash_at: str | None = None, crash_after: int | None = None, **extra: str) -> dict:
    """The environment of a child: ours (with the test's $SHMCACHE_DIR), no rank variables, and
    the crash point armed if asked."""
    env = {k: v for k, v in os.environ.items() if k not in _RANK_VARS
           and k not in ("SHMCACHE_CRASH_AT", "SHMCACHE_CRASH_AFTER")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), env.get("PYTHONPATH", "")) if p)
    if crash_at:
        env["SHMCACHE_CRASH_AT"] = crash_at
    if crash_after:
        env["SHMCACHE_CRASH_AFTER"] = str(crash_after)
    env.update(extra)
    return env


def wait_for(predicate, timeout_s: float, what: str, interval_s: float = 0.005):
    """Poll ``predicate`` until it returns something truthy; fail naming ``what`` after the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout_s:.1f}s waiting for {what}")
        time.sleep(interval_s)


def release_barrier(barrier_dir: Path, n: int, timeout_s: float = 30.0) -> None:
    """Wait until ``n`` workers are ready at the file barrier in ``barrier_dir``, then let them go."""
    wait_for(lambda: len(list(barrier_dir.glob("ready.*"))) >= n, timeout_s,
             f"{n} workers at the start barrier in {barrier_dir}")
    (barrier_dir / "go").touch()


def status_of(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class Procs:
    """Fresh worker interpreters; all killed and reaped on exit."""

    def __init__(self, out_dir: Path):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._procs: list[subprocess.Popen] = []
        self._n = 0

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, op: str, *args, env: dict | None = None, stderr=None) -> subprocess.Popen:
        self._n += 1
        out = self.out_dir / f"{op}.{self._n}.json"
        p = subprocess.Popen([PY, str(WORKER), op, str(out), json.dumps(list(args))],
                             env=env or crash_env(), stdin=subprocess.DEVNULL,
                             stdout=subprocess.DEVNULL, stderr=stderr)
        p.out_path = out  # type: ignore[attr-defined]
        self._procs.append(p)
        return p

    def finish(self, p: subprocess.Popen, timeout_s: float = 30.0) -> tuple[int, dict | None]:
        """Wait for ``p`` (killing it after the timeout, then failing) and return its result."""
        try:
            p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
            raise AssertionError(f"worker {p.args[2]} (pid {p.pid}) still running after {timeout_s}s") from None
        finally:
            for f in (p.stderr, p.stdout):
                if f is not None:
                    f.close()
        return p.returncode, _read_result(p.out_path)

    def close(self) -> None:
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for p in self._procs:
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:  # pragma: no cover - the fixture reports it
                pass
            for f in (p.stderr, p.stdout):
                if f is not None and not f.closed:
                    f.close()
        self._procs.clear()


def _read_result(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


class Zygote:
    """One pre-imported interpreter that forks a child per operation (see the module docstring)."""

    def __init__(self, out_dir: Path, *, crash_at: str | None = None, crash_after: int | None = None,
                 env: dict | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self._n = 0
        self.proc = subprocess.Popen(
            [PY, str(WORKER), "zygote", "-", "[]"],
            env=env or crash_env(crash_at, crash_after), stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, text=True, bufsize=1,
        )
        reply = self._recv(60.0)
        assert reply.get("ready"), f"zygote did not start: {reply}"

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _send(self, msg: dict, timeout_s: float) -> dict:
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        return self._recv(timeout_s)

    def _recv(self, timeout_s: float) -> dict:
        import selectors

        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            if not sel.select(timeout_s):
                self.proc.kill()
                raise AssertionError(f"zygote gave no answer within {timeout_s:.0f}s")
        line = self.proc.stdout.readline()
        if not line:
            raise AssertionError(f"zygote died ({status_of(self.proc.wait(5))})")
        return json.loads(line)

    def spawn(self, op: str, *args) -> tuple[int, Path]:
        """Fork a child running ``op(*args)``; returns (pid, path of its result)."""
        self._n += 1
        out = self.out_dir / f"{op}.{self._n}.json"
        reply = self._send({"cmd": "spawn", "op": op, "args": list(args), "out": str(out)}, 30.0)
        return reply["pid"], out

    def wait(self, pid: int, timeout_s: float = 30.0, kill_after_s: float | None = None) -> int:
        """Reap ``pid``: its return code (negative: the signal). ``kill_after_s``: SIGKILL it then
        if it is still running. A child still running at ``timeout_s`` is killed and fails the test."""
        reply = self._send({"cmd": "wait", "pid": pid, "timeout": timeout_s,
                            "kill_after": kill_after_s}, timeout_s + 30.0)
        if reply.get("timed_out"):
            raise AssertionError(f"child {pid} still running after {timeout_s}s (killed)")
        return reply["status"]

    def kill(self, pid: int, sig: int = signal.SIGKILL) -> None:
        self._send({"cmd": "kill", "pid": pid, "sig": int(sig)}, 10.0)

    def run(self, op: str, *args, timeout_s: float = 30.0,
            kill_after_s: float | None = None) -> tuple[int, dict | None]:
        pid, out = self.spawn(op, *args)
        status = self.wait(pid, timeout_s, kill_after_s)
        return status, _read_result(out)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # EOF: the zygote kills and reaps its children, then exits
            except OSError:
                pass
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for f in (self.proc.stdin, self.proc.stdout):
            if f is not None and not f.closed:
                try:
                    f.close()
                except OSError:
                    pass
