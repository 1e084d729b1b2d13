"""Process machinery of the launcher: start the workers, watch them, shut them all down together.

``shmcache.launch`` is the command line; this module knows nothing of arguments or sessions. It
must not import torch (the launcher stays light; only the workers import it).

NOTE [launcher shutdown]
    The protocol that guarantees no worker outlives the job, and that the exit status names the
    root cause. Every loop and signal path in this module points back here.

    1. Start. Each worker is spawned from the main thread into a session of its own (setsid, as
       torchrun does), so one ``killpg`` reaches the worker and everything it started (DataLoader
       workers, compilers), and a Ctrl-C typed in the terminal reaches only the launcher, which
       then coordinates. In the child, before exec, ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks the
       kernel to kill the worker when its parent goes away, even if the launcher is SIGKILLed
       (pytorch#76287). The signal fires when the parent *thread* that forked exits, which is why
       workers are spawned only from the main thread. The child then checks that its parent is
       still the launcher: one that died between fork and prctl would never send the signal.
       PR_SET_PDEATHSIG is Linux-only and covers the worker process itself, not its children;
       those die with the worker's process group in steps 3-4, or by the guard (8) if the
       launcher was SIGKILLed.
    2. Watch. The launcher sleeps in ``select`` on a wakeup pipe (``signal.set_wakeup_fd``), so
       SIGCHLD and the signals it forwards wake it at once; every wait still has a timeout, after
       which it re-checks everything, so a lost wakeup costs latency, never a hang.
    3. A worker exits. It is first *peeked at* with ``waitid(WNOWAIT)``, which leaves it a zombie:
       while it is unreaped its PID cannot be reused, so its process-group ID still names only
       its own group. Anything left in that group is SIGKILLed (its parent is gone, it would be
       an orphan), and only then is the worker reaped. Exit code 0: keep watching. Any other
       status, from a worker the launcher had not signalled, is the *first failure*: go to 4.
    4. Shut down. Every live worker's process group gets SIGTERM (or the signal the launcher
       received, see 5), and the launcher keeps watching as in 2 for up to the grace period
       (``--shutdown-timeout``); then the groups still alive get SIGKILL, and the launcher waits
       a bounded time to reap them. A second signal to the launcher during the grace period
       (Ctrl-C twice) skips the rest of it.
    5. Signals to the launcher. SIGINT, SIGTERM and SIGHUP are forwarded as themselves (a worker
       sees Ctrl-C as KeyboardInterrupt, as it would without a launcher), with the escalation of
       4; the launcher then exits with 128 + the signal number (130 for Ctrl-C).
    6. Report. A summary goes to stderr, root cause first: the first failed rank, its PID and
       exit code or signal name, the error its ``@record``-decorated entry point wrote to
       ``$TORCHELASTIC_ERROR_FILE`` if any, then every other rank and what happened to it.
       The exit status is the first failure's (128 + signal number for a signal).
    7. Handlers and the wakeup descriptor are restored on the way out, so ``main()`` can run
       inside a test process and leave it as it was.
    8. The guard. A SIGKILLed launcher runs no code, and PR_SET_PDEATHSIG kills only the
       workers, not what they started. So before any worker, the launcher starts a guard: a
       tiny Python process in a session of its own, reading a pipe whose only writer is the
       launcher. The launcher writes ``+PGID`` when a worker starts and ``-PGID`` when it is
       about to reap one (the zombie still holds the ID, so the guard never holds an ID the
       kernel may have reused), and ``done`` once every worker is gone. End of file without
       ``done`` means the launcher died: the guard SIGKILLs every process group it still holds
       - each worker's children and grandchildren, which stay in the group - and exits.
       What escapes: a descendant that left its worker's process group (``setsid``,
       ``setpgid``: daemons, ``start_new_session=True``), anything started in the microseconds
       between a worker's spawn and its ``+PGID`` line, and everything if the guard itself is
       SIGKILLed first (``kill -9 -- -PGID`` of the launcher's group does not reach it; a Slurm
       or systemd cgroup kill takes everything anyway). The launcher's temporary directory
       (``launch_directory``: the workers' error files, a companion's log) has a guard of its
       own, holding no group, that removes it on end of file; after the launcher's own removal
       it is told ``done``.
    9. Companions. A process that serves the workers for the whole job (``--remote spawn``'s
       ``redis-server``, ``RedisNode``) starts before them and stops after them: the
       workers write to it until they exit. It is started as a worker is (from the main thread,
       in a session of its own, with PR_SET_PDEATHSIG and the same check of its parent) and
       held by a guard of its own, started first, that knows only its process group; so a
       SIGKILLed launcher takes it down as it takes the workers, and Ctrl-C typed in the
       terminal reaches the launcher, not it. When the job ends - every worker gone, on success,
       failure or a signal - or when preparing the job fails, the launcher sends its group
       SIGTERM, SIGKILL after a few seconds, releases it from its guard while the zombie still
       holds the ID, reaps it, and only then tells that guard ``done``.
"""

from __future__ import annotations

import ctypes
import grp
import json
import os
import pwd
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field

from ..base.procs import start_time
from ..errors import LaunchError

__all__ = [
    "WorkerSpec", "WorkerResult", "RunOutcome", "run_workers", "Companion", "FORWARDED_SIGNALS",
    "launch_directory", "remove_stale_launch_directories",
]

#: Signals the launcher forwards to every worker (NOTE [launcher shutdown], 5).
FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

#: Longest sleep between two checks of the workers when nothing wakes the launcher up.
POLL_INTERVAL_S = 0.5
#: How long to wait for SIGKILLed workers to be reaped before reporting them as unreaped.
REAP_TIMEOUT_S = 5.0

_PR_SET_PDEATHSIG = 1  # include/uapi/linux/prctl.h: one number on every architecture
_LAUNCHER = "shmcache.launch"


@dataclass(frozen=True)
class WorkerSpec:
    """What to run for one rank: the full command line and the full environment."""

    rank: int
    argv: Sequence[str]
    env: dict[str, str]
    error_file: str | None = None  # where torch's @record writes the worker's exception


@dataclass
class WorkerResult:
    """One worker's fate, filled in as the launcher watches it."""

    rank: int
    pid: int
    returncode: int | None = None  # Popen's convention: -N when killed by signal N
    signals_sent: list[tuple[int, float]] = field(default_factory=list)  # (signal, s into shutdown)
    signalled_before_exit: bool = False
    error_message: str | None = None

    @property
    def failed_on_its_own(self) -> bool:
        return self.returncode not in (None, 0) and not self.signalled_before_exit


@dataclass
class RunOutcome:
    """Everything the launcher knows once every worker is gone (or could not be reaped)."""

    workers: list[WorkerResult]
    first_failure: WorkerResult | None = None
    received_signal: int | None = None
    start_error: str | None = None
    start_error_code: int = 1

    @property
    def exit_code(self) -> int:
        """0 when every worker exited 0, else the root cause's (NOTE [launcher shutdown], 6)."""
        if self.received_signal is not None:
            return 128 + self.received_signal
        if self.start_error is not None:
            return self.start_error_code
        if self.first_failure is not None:
            return _exit_status(self.first_failure.returncode)
        if any(w.returncode is None for w in self.workers):
            return 1  # a worker could not be reaped: not a success
        return 0

    @property
    def root_cause(self) -> WorkerResult | None:
        """The worker to blame, unless a signal to the launcher or a failed start came first."""
        if self.received_signal is None and self.start_error is None:
            return self.first_failure
        return None

    def summary(self) -> list[str]:
        """Lines for stderr, root cause first; empty when every worker exited 0."""
        if self.exit_code == 0:
            return []
        lines = list(self._root_cause_lines())
        for w in sorted(self.workers, key=lambda w: w.rank):
            if w is not self.root_cause:
                lines.append(f"{_LAUNCHER}: rank {w.rank} (pid {w.pid}): {self._fate_of(w)}")
        lines.append(f"{_LAUNCHER}: exit status {self.exit_code}")
        return lines

    def _root_cause_lines(self) -> Iterator[str]:
        if self.received_signal is not None:
            name = _signal_name(self.received_signal)
            yield f"{_LAUNCHER}: received {name}; forwarded it to every worker"
        elif self.start_error is not None:
            yield f"{_LAUNCHER}: {self.start_error}"
        elif self.root_cause is not None:
            w = self.root_cause
            what = _describe(w.returncode)
            yield f"{_LAUNCHER}: rank {w.rank} (pid {w.pid}) failed first: {what}"
            if w.error_message:
                yield f"{_LAUNCHER}:     {w.error_message}"

    def _fate_of(self, w: WorkerResult) -> str:
        if w.returncode is None:
            return f"could not be reaped (stuck in the kernel?); see `ps -o stat,cmd -p {w.pid}`"
        if not w.signalled_before_exit:
            if w.returncode == 0:
                return "exited 0"
            return f"also failed: {_describe(w.returncode)}"
        sent = ", then ".join(
            _signal_name(signo) + (f" after {at_s:.1f} s" if at_s >= 0.05 else "")
            for signo, at_s in w.signals_sent
        )
        if w.returncode >= 0:  # it exited on its own: a handler of the signal's, or a failure of its own
            # meanwhile - which, the launcher cannot tell (its output can)
            return f"exited with {_describe(w.returncode)} after the launcher sent {sent}"
        return f"terminated by launcher ({sent}): {_describe(w.returncode)}"


def run_workers(specs: Sequence[WorkerSpec], *, shutdown_timeout_s: float) -> RunOutcome:
    """Start one process per spec and watch them until all are gone (NOTE [launcher shutdown])."""
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError(
            "shmcache.launch must run in the main thread: it installs signal handlers, and "
            "PR_SET_PDEATHSIG ties the workers' lives to the thread that spawned them"
        )
    try:
        guard = _Guard()
    except OSError as exc:
        return RunOutcome(workers=[], start_error=f"could not start the guard process ({exc})")
    with guard, _SignalWakeup() as wakeup:
        group = _WorkerGroup(wakeup, shutdown_timeout_s, guard)
        try:
            group.start(specs)
            group.watch()
        finally:
            group.kill_all_now()  # only does something if watch() was interrupted by an error
        return group.outcome


# --- the watch loop ---------------------------------------------------------------------------


class _WorkerGroup:
    """The workers of one launch and the state of the shutdown protocol."""

    def __init__(self, wakeup: _SignalWakeup, shutdown_timeout_s: float, guard: _Guard):
        self._wakeup = wakeup
        self._guard = guard
        self._grace_s = shutdown_timeout_s
        self._running: dict[int, tuple[subprocess.Popen, WorkerResult, WorkerSpec]] = {}
        self._signals_handled = 0  # how many of wakeup.received were acted upon
        self._shutdown_started: float | None = None
        self._kill_deadline: float | None = None  # set when the SIGKILL went out
        self.outcome = RunOutcome(workers=[])

    def start(self, specs: Sequence[WorkerSpec]) -> None:
        """Spawn every worker; stop early if a signal arrives or one cannot start."""
        parent_death = _ParentDeathSignal()
        for spec in specs:
            if self._wakeup.received:
                return  # Ctrl-C while starting: watch() shuts down what was started
            try:
                proc = subprocess.Popen(
                    list(spec.argv), env=spec.env, start_new_session=True, preexec_fn=parent_death
                )
            except OSError as exc:
                program = spec.argv[0]
                self.outcome.start_error = f"rank {spec.rank} could not start {program!r}: {exc}"
                self.outcome.start_error_code = _start_failure_status(exc)
                self._begin_shutdown(signal.SIGTERM)
                return
            self._guard.hold(proc.pid)  # its process group: setsid made the worker its leader
            result = WorkerResult(rank=spec.rank, pid=proc.pid)
            self.outcome.workers.append(result)
            self._running[proc.pid] = (proc, result, spec)

    def watch(self) -> None:
        """Loop until every worker is reaped (NOTE [launcher shutdown], 2-5)."""
        while self._running:
            self._wakeup.wait(self._next_timeout())
            self._reap_exited()
            self._handle_received_signals()
            if self.outcome.first_failure is not None:
                self._begin_shutdown(signal.SIGTERM)
            if self._grace_is_over():
                self._kill_running()
            if self._kill_deadline is not None and time.monotonic() >= self._kill_deadline:
                return  # NOTE [launcher shutdown], 4: unreaped workers are reported, not waited on

    def kill_all_now(self) -> None:
        """Last resort on the way out: nothing started here may outlive the launcher."""
        for proc, _result, _spec in self._running.values():
            _signal_group(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + REAP_TIMEOUT_S
        for proc, result, spec in list(self._running.values()):
            try:
                returncode = proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            self._record_exit(proc, result, spec, returncode)

    # --- steps ------------------------------------------------------------------------------

    def _next_timeout(self) -> float:
        if self._shutdown_started is None or self._kill_deadline is not None:
            return POLL_INTERVAL_S
        grace_left = self._shutdown_started + self._grace_s - time.monotonic()
        return max(0.0, min(POLL_INTERVAL_S, grace_left))

    def _reap_exited(self) -> None:
        """NOTE [launcher shutdown], 3: peek, clear the worker's group, then reap."""
        for pid, (proc, result, spec) in list(self._running.items()):
            if not _has_exited(proc):
                continue
            _signal_group(pid, signal.SIGKILL)  # its leftovers; the zombie keeps the group ID ours
            self._guard.release(pid)  # while the zombie still holds the ID (NOTE, 8)
            try:
                returncode = proc.wait(timeout=REAP_TIMEOUT_S)
            except subprocess.TimeoutExpired:  # pragma: no cover - a zombie is reaped at once
                continue
            self._record_exit(proc, result, spec, returncode)
            if result.failed_on_its_own and self.outcome.first_failure is None:
                self.outcome.first_failure = result

    def _record_exit(
        self, proc: subprocess.Popen, result: WorkerResult, spec: WorkerSpec, returncode: int
    ) -> None:
        result.returncode = returncode
        result.signalled_before_exit = bool(result.signals_sent)
        if returncode != 0 and spec.error_file:
            result.error_message = read_error_file(spec.error_file)
        self._running.pop(proc.pid, None)

    def _handle_received_signals(self) -> None:
        """NOTE [launcher shutdown], 5: a first signal starts a shutdown, a later one ends it."""
        for signo in self._wakeup.received[self._signals_handled:]:
            self._signals_handled += 1
            if self._shutdown_started is None:
                self.outcome.received_signal = signo
                self._begin_shutdown(signo)
            else:
                self._kill_running()

    def _begin_shutdown(self, signo: int) -> None:
        """NOTE [launcher shutdown], 4: the first signal to every group, and the grace clock."""
        if self._shutdown_started is None:
            self._shutdown_started = time.monotonic()
            self._send_to_running(signo)

    def _grace_is_over(self) -> bool:
        if self._shutdown_started is None:
            return False
        return time.monotonic() >= self._shutdown_started + self._grace_s

    def _kill_running(self) -> None:
        if self._kill_deadline is None:
            self._send_to_running(signal.SIGKILL)
            self._kill_deadline = time.monotonic() + REAP_TIMEOUT_S

    def _send_to_running(self, signo: int) -> None:
        started = self._shutdown_started if self._shutdown_started is not None else time.monotonic()
        at_s = time.monotonic() - started
        for proc, result, _spec in self._running.values():
            result.signals_sent.append((signo, at_s))
            _signal_group(proc.pid, signo)


# --- signals ----------------------------------------------------------------------------------


class _SignalWakeup:
    """Record forwarded signals and wake the watch loop on them and on SIGCHLD (NOTE, 2 and 7)."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._read_fd = self._write_fd = -1
        self._old_wakeup_fd = -1
        self._old_handlers: dict[int, object] = {}

    def __enter__(self) -> _SignalWakeup:
        self._read_fd, self._write_fd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._old_wakeup_fd = signal.set_wakeup_fd(self._write_fd, warn_on_full_buffer=False)
        for signo in (*FORWARDED_SIGNALS, signal.SIGCHLD):
            # The wakeup pipe is only written for signals that have a Python handler.
            self._old_handlers[signo] = signal.signal(signo, self._on_signal)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signo, handler in self._old_handlers.items():
            # None: the old handler was not set from Python; the default is the best guess.
            restored = signal.SIG_DFL if handler is None else handler
            signal.signal(signo, restored)  # type: ignore[arg-type]
        signal.set_wakeup_fd(self._old_wakeup_fd)
        os.close(self._read_fd)
        os.close(self._write_fd)

    def _on_signal(self, signo: int, _frame: object) -> None:
        if signo != signal.SIGCHLD:  # SIGCHLD only needs to wake the loop up
            self.received.append(signo)

    def wait(self, timeout_s: float) -> None:
        """Sleep until a signal arrives or ``timeout_s`` passes; the caller re-checks everything."""
        readable, _, _ = select.select([self._read_fd], [], [], timeout_s)
        if readable:
            try:
                while os.read(self._read_fd, 512):
                    pass
            except BlockingIOError:
                pass


#: The guard's program (NOTE [launcher shutdown], 8). ``python -I -S``: no site, no shmcache import.
_GUARD_PROGRAM = """
import os, shutil, signal, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
groups = set()
for line in sys.stdin:
    if line == "done\\n":
        sys.exit(0)
    (groups.add if line[0] == "+" else groups.discard)(int(line[1:]))
for pgid in groups:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except OSError:
        pass
for _ in range(50 if len(sys.argv) > 1 else 0):  # a dying companion may still write in it
    shutil.rmtree(sys.argv[1], ignore_errors=True)
    if not os.path.lexists(sys.argv[1]):
        break
    time.sleep(0.1)
"""


class _Guard:
    """The process that kills the workers' groups if the launcher dies (NOTE [launcher shutdown], 8)."""

    def __init__(self, remove_dir: str | None = None) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _GUARD_PROGRAM, *([remove_dir] if remove_dir else [])],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL, start_new_session=True, text=True, bufsize=1,
        )

    def hold(self, pgid: int) -> None:
        self._send(f"+{pgid}")

    def release(self, pgid: int) -> None:
        self._send(f"-{pgid}")

    def _send(self, line: str) -> None:
        try:
            self._proc.stdin.write(line + "\n")
        except OSError:  # the guard was killed: the workers still have PR_SET_PDEATHSIG
            pass

    def __enter__(self) -> _Guard:
        return self

    def __exit__(self, *exc_info: object) -> None:
        """Every worker is gone (or reported unreaped): tell the guard to leave them alone."""
        self._send("done")
        try:
            self._proc.stdin.close()
        except OSError:
            pass
        try:
            self._proc.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - it exits on "done" at once
            self._proc.kill()
            self._proc.wait()


class Companion:
    """A process that lives as long as the job, not as a worker (NOTE [launcher shutdown], 9).

    ``stdin_text`` is written to its standard input, which is then closed (how a secret reaches
    it without a command line); its standard output and error go to ``log_path``; ``env`` is its
    environment (None: the launcher's).
    """

    def __init__(self, argv: Sequence[str], *, stdin_text: str, log_path: str,
                 env: dict[str, str] | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("a companion process must be started from the main thread: "
                               "PR_SET_PDEATHSIG ties its life to the thread that spawned it")
        self._stopped = False
        self._guard = _Guard()
        try:
            with open(log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    list(argv), stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                    start_new_session=True, preexec_fn=_ParentDeathSignal(),
                )
        except BaseException:
            self._guard.__exit__(None, None, None)
            raise
        self._guard.hold(self._proc.pid)
        try:
            self._proc.stdin.write(stdin_text.encode())
            self._proc.stdin.close()
        except OSError:  # it exited at once: poll() and its log say why
            pass

    @property
    def pid(self) -> int:
        return self._proc.pid

    def poll(self) -> int | None:
        """Its exit status (Popen's convention) once it has exited, else None; it stays
        unreaped, so its process-group ID stays ours until stop() (NOTE [launcher shutdown], 3)."""
        if self._proc.returncode is not None:
            return self._proc.returncode
        try:
            status = os.waitid(os.P_PID, self._proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:  # reaped already (by Popen itself): let Popen tell
            return self._proc.poll()
        if status is None:
            return None
        if status.si_code in (os.CLD_KILLED, os.CLD_DUMPED):
            return -status.si_status
        return status.si_status

    def stop(self, timeout_s: float) -> int | None:
        """SIGTERM its group, SIGKILL after ``timeout_s``; reap it; dismiss its guard. Returns
        its exit status (None: it could not be reaped). Calling it again does nothing more."""
        if self._stopped:
            return self._proc.returncode
        self._stopped = True
        _signal_group(self._proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        _signal_group(self._proc.pid, signal.SIGKILL)  # it, or what it left in its group
        self._guard.release(self._proc.pid)  # while the zombie still holds the ID (NOTE, 8)
        try:
            self._proc.wait(timeout=REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:  # pragma: no cover - stuck in the kernel
            return None
        finally:
            self._guard.__exit__(None, None, None)
        return self._proc.returncode


#: The launcher's temporary directories: $TMPDIR/shmcache-launch-*, each with a LAUNCHER_FILE.
LAUNCH_DIR_PREFIX = "shmcache-launch-"
#: "PID START_TIME" of the launcher that made the directory (start time: /proc/PID/stat field 22).
LAUNCHER_FILE = "launcher"


def _group_has_others(gid: int) -> bool:
    """Whether users other than this one may be in group ``gid``: any group but our own primary
    one, a group with no entry (containers: who is in it is unknown), members listed, or another
    user whose primary group it is (``gr_mem`` lists only secondary members)."""
    if gid != os.getegid():
        return True
    try:
        if grp.getgrgid(gid).gr_mem:
            return True
    except KeyError:
        return True
    me = os.geteuid()
    return any(pw.pw_gid == gid and pw.pw_uid != me for pw in pwd.getpwall())


@contextmanager
def launch_directory(prefix: str = LAUNCH_DIR_PREFIX) -> Iterator[str]:
    """A private temporary directory (0700, under $TMPDIR) for one launch, removed when the
    launch ends - and, if the launcher is SIGKILLed, by a guard of its own (NOTE [launcher
    shutdown], 8), which then waits for nothing else: it only removes the directory. If the
    guard died too, ``shmcache gc`` removes it (``remove_stale_launch_directories``).

    It is made in $TMPDIR's real path, and only if nobody else can rename or replace what is
    made there (``_private_parent``): the launcher, its server and its workers reach what is in
    it by path (redis-server's socket, the error files)."""
    path = tempfile.mkdtemp(prefix=prefix, dir=_private_parent(tempfile.gettempdir()))
    with open(os.path.join(path, LAUNCHER_FILE), "x") as f:
        f.write(f"{os.getpid()} {start_time(os.getpid())}\n")
    try:
        guard: _Guard | None = _Guard(remove_dir=path)
    except OSError:  # no guard: the directory is still removed on every way out but SIGKILL
        guard = None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        if guard is not None:
            guard.__exit__(None, None, None)


def _private_parent(tmpdir: str) -> str:
    """The real path of ``tmpdir``, or a LaunchError if another user could rename or replace an
    entry in it or in a directory above it: each must be root's or ours, and writable by nobody
    else - unless sticky (/tmp), where only an entry's owner may rename or remove it. In a
    scratch directory writable by all and not sticky, another user renamed the launcher's
    directory away, put one of their own in its place with a socket where redis-server's was,
    answered the launcher's INFO as the server would, and read the job's Redis password from
    the first worker's AUTH."""
    real = os.path.realpath(tmpdir)
    current = real
    while True:
        try:
            st = os.stat(current)
        except OSError as exc:
            raise LaunchError(f"the temporary directory {tmpdir!r} ($TMPDIR) is unusable: {current}: "
                              f"{exc.strerror}; set $TMPDIR to a directory of your own, or unset it") from None
        shared_group = st.st_mode & stat.S_IWGRP and _group_has_others(st.st_gid)
        if not st.st_mode & stat.S_ISVTX and (st.st_mode & stat.S_IWOTH or shared_group):
            why = f"writable by {'every user' if st.st_mode & stat.S_IWOTH else 'its group'} and not sticky"
        elif st.st_uid not in (0, os.geteuid()):
            why = f"owned by another user (uid {st.st_uid})"
        else:
            why = None
        if why is not None:
            raise LaunchError(
                f"the temporary directory {tmpdir!r} ($TMPDIR) is not safe for the launcher's "
                f"private directory: {current} is {why} (mode {stat.S_IMODE(st.st_mode):o}), so "
                f"another user could rename the launcher's directory and put their own in its "
                f"place (the workers' error files; with --remote spawn, the socket where they "
                f"send the job's Redis password); set "
                f"$TMPDIR to a directory of your own, or to a sticky one such as /tmp")
        parent = os.path.dirname(current)
        if parent == current:
            return real
        current = parent


def remove_stale_launch_directories(tmpdir: str | None = None) -> list[str]:
    """Remove this user's launch directories whose launcher is gone (``shmcache gc``).

    Only real directories owned by this user, holding a LAUNCHER_FILE whose PID no longer runs
    or now belongs to a process that started at another time; anything else is left alone."""
    tmpdir = tmpdir or tempfile.gettempdir()
    removed = []
    try:
        entries = list(os.scandir(tmpdir))
    except OSError:
        return removed
    for entry in entries:
        if not entry.name.startswith(LAUNCH_DIR_PREFIX):
            continue
        try:
            st = entry.stat(follow_symlinks=False)
            if not entry.is_dir(follow_symlinks=False) or st.st_uid != os.geteuid():
                continue
            fd = os.open(os.path.join(entry.path, LAUNCHER_FILE), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            with os.fdopen(fd) as f:
                pid_text, start_text = f.read(100).split()
            pid = int(pid_text)
        except (OSError, ValueError):
            continue
        if start_time(pid) == start_text:
            continue  # its launcher runs
        shutil.rmtree(entry.path, ignore_errors=True)
        if not os.path.lexists(entry.path):
            removed.append(entry.path)
    return removed


class _ParentDeathSignal:
    """``preexec_fn`` for workers: die with the launcher (NOTE [launcher shutdown], 1).

    Everything that can fail or allocate much (loading libc) happens in the parent, at creation;
    the call in the forked child is two system calls.
    """

    def __init__(self) -> None:
        self._launcher_pid = os.getpid()
        try:
            self._prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):  # not Linux: no parent-death signal to ask for
            self._prctl = None
        else:  # prctl(int, unsigned long...): declared, not left to ctypes' int promotion of varargs
            self._prctl.argtypes = [ctypes.c_int] + [ctypes.c_ulong] * 4
            self._prctl.restype = ctypes.c_int

    def __call__(self) -> None:
        if self._prctl is not None:
            self._prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
        if os.getppid() != self._launcher_pid:  # the launcher died before prctl took effect
            os.kill(os.getpid(), signal.SIGKILL)


# --- small helpers ----------------------------------------------------------------------------


def _has_exited(proc: subprocess.Popen) -> bool:
    """True once ``proc`` has exited, without reaping it (NOTE [launcher shutdown], 3)."""
    try:
        status = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:  # reaped already (by Popen itself): let Popen tell
        return proc.poll() is not None
    return status is not None


def _signal_group(pid: int, signo: int) -> None:
    """Send ``signo`` to worker ``pid``'s process group, and to ``pid`` if it left the group."""
    try:
        os.killpg(pid, signo)
        if os.getpgid(pid) != pid:  # the worker moved itself into another group
            os.kill(pid, signo)
    except (ProcessLookupError, PermissionError):
        pass  # the group is empty already (or holds only someone else's setuid program)


def read_error_file(path: str) -> str | None:
    """The message torch's ``@record`` wrote for a failed worker, with where it was raised."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    message = data.get("message") if isinstance(data, dict) else None
    if isinstance(message, str):
        return message
    if not isinstance(message, dict) or not isinstance(message.get("message"), str):
        return None
    where = _innermost_frame(message.get("extraInfo", {}).get("py_callstack", ""))
    return f"{message['message']} ({where})" if where else message["message"]


def _innermost_frame(traceback_text: object) -> str | None:
    if not isinstance(traceback_text, str):
        return None
    frames = [ln.strip() for ln in traceback_text.splitlines() if ln.strip().startswith("File ")]
    return frames[-1] if frames else None


def _describe(returncode: int | None) -> str:
    if returncode is None:
        return "still running"
    if returncode < 0:
        return f"signal {_signal_name(-returncode)}"
    return f"exit code {returncode}"


def _signal_name(signo: int) -> str:
    try:
        return signal.Signals(signo).name
    except ValueError:
        return f"signal {signo}"


def _exit_status(returncode: int | None) -> int:
    """A shell's convention: 128 + N for a process killed by signal N."""
    if returncode is None:
        return 1
    return 128 - returncode if returncode < 0 else returncode


def _start_failure_status(exc: OSError) -> int:
    """A shell's convention: 127 for a missing program, 126 for one that cannot be executed."""
    if isinstance(exc, FileNotFoundError):
        return 127
    if isinstance(exc, PermissionError):
        return 126
    return 1
