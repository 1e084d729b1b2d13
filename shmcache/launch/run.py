"""python -m shmcache.launch: start N training processes around one shmcache session.

A drop-in for ``torchrun --standalone`` on one node: it creates the shmcache session first, so every
process finds it, then starts the processes with the environment ``init_process_group("env://")``
reads, and stops them all together when one fails or when it is interrupted.

Usage::

    python -m shmcache.launch [options] script.py [script arguments...]
    python -m shmcache.launch [options] -m package.module [module arguments...]
    python -m shmcache.launch [options] --no-python program [program arguments...]

Everything after the script (or module, or program) is passed to it verbatim, including arguments
that look like options and ``--``; no ``--local-rank`` is added (read ``$LOCAL_RANK``).

Options (torchrun's spellings are accepted too, with ``-`` or ``_``)::

    --nproc N               processes on this node (also --nproc-per-node, --nproc_per_node);
                            an integer >= 1, or auto (one per visible CUDA device, else 1),
                            gpu (one per visible CUDA device), cpu (one per CPU core). Default 1.
    --session NAME          the shmcache session the processes share, created if missing.
                            Default: $SHMCACHE_SESSION, else "default". 1-64 of A-Z a-z 0-9 _ . -
    --size MIB              memory cap of each cache, in MiB (0: automatic); sets $SHMCACHE_SIZE_MB
    --spilling              spill to disk when memory is full; sets $SHMCACHE_SPILLING=1. Needs a
                            spill directory: --spill-dir, the session's, or $SHMCACHE_SPILL_DIR
    --spill-dir DIR         where spill files go (an existing directory: never created, a typo
                            would fill another disk); sets $SHMCACHE_SPILL_DIR and becomes the
                            spill directory of a session created now
    --memory-dir DIR        a tmpfs or hugetlbfs directory for the session's shared memory
                            instead of /dev/shm (a container's larger or huge-page mount); the
                            session created now records it, and sets $SHMCACHE_MEMORY_DIR
    --destroy-session       destroy the session (and everything cached in it) once every process
                            is gone, even if other jobs still use it; by default it stays, for
                            the next run to find
    --shutdown-timeout S    seconds a process gets between SIGTERM and SIGKILL. Default 10
    --master-addr A         address of rank 0 for init_process_group. Default 127.0.0.1
    --master-port P         port of rank 0. Default: a free port of this machine
    --nnodes N, --node-rank K
                            several machines, one launcher on each (see launch/slurm.sbatch):
                            RANK = K * nproc + LOCAL_RANK, WORLD_SIZE = N * nproc. Needs
                            --master-addr and --master-port. Each machine has its own cache.
    --run-id ID             $TORCHELASTIC_RUN_ID (also --rdzv-id). Default: a fresh UUID on one
                            node, "<master-addr>:<master-port>" on several (the same everywhere)
    --remote URL            a Redis behind each node's cache, shared by every node: sets
                            $SHMCACHE_REMOTE for the processes. redis://[:PASSWORD@]HOST:PORT[/DB],
                            rediss:// for TLS, redis+cluster://H1:P1,H2:P2 for a Redis Cluster.
                            The password is shown as *** in every message and, once the
                            launcher has started, in its process title; to keep it off every
                            command line from the first instant, export SHMCACHE_REMOTE instead,
                            or give a URL without one and export SHMCACHE_REMOTE_PASSWORD
    --remote spawn[:MB]     start one redis-server per node for the job (Redis's own package:
                            apt-get install redis-server), capped at MB MiB each (default 1024),
                            evicting the least recently used values when full, never saving to
                            disk, with a new random password for its one user, who may run
                            only the commands the cache sends, on its keys (see NOTE [spawned
                            redis]); bound to this node's
                            address on the route to --master-addr (127.0.0.1 when that is a
                            loopback). The launcher checks that the port is its server's before
                            it tells anyone (a port another process took is named, and another
                            one is tried).
                            With several nodes, the launchers exchange their servers' addresses
                            through node 0's launcher, on port --master-port + 1 (MASTER_PORT is
                            the training's own), and every process gets the same
                            SHMCACHE_REMOTE=redis+shards://shmcache:PASSWORD@H0:P0,... (by node
                            rank; the cache spreads keys over them by a consistent hash), with
                            ?socket=K:PATH for its own node K's server, which it reaches over
                            that Unix socket, never over TCP. Each
                            server stops with the job: on success, failure, Ctrl-C, and when
                            its launcher is killed (see NOTE [launcher shutdown]). Several
                            nodes need a job token, the same on every node, in
                            $SHMCACHE_RDZV_TOKEN (16 characters or
                            more; e.g. export SHMCACHE_RDZV_TOKEN=$(python3 -c 'import secrets;
                            print(secrets.token_hex(32))') once, before starting the launchers):
                            only launchers that prove they hold it join the exchange. Every
                            process also gets the job's SHMCACHE_SECRET, which authenticates
                            what it writes to the servers: the one set in the environment (node
                            0's, on every node), else a new one per job
    --rdzv-timeout S        seconds the launchers of a --remote spawn job wait for each other
                            (and for their servers to start) before failing with the node ranks
                            that did not come. Default 300
    --metrics-port P        serve the node's cache metrics (every cache here, as `shmcache stat
                            --prometheus` prints them: hits, misses, bytes, tiers, and each
                            rank's time waiting for batches) at http://ADDR:P/metrics while the
                            job runs, for Prometheus to scrape; 0: a free port (the address is
                            printed). Needs pip install 'shmcache[metrics]'
    --metrics-addr A        the address it binds. Default 127.0.0.1 (this machine only); for a
                            Prometheus elsewhere, the node's address on the cluster network (or
                            0.0.0.0) behind the cluster's firewall: the endpoint has no
                            authentication and names sessions, caches and datasets
    --standalone            accepted and ignored (torchrun's flag; one node is what this does)
    -m, --module            run a module, as ``python -m``
    --no-python             run the program directly, not through Python
    -h, --help              print this manual

Each process gets, on top of the launcher's own environment (torchrun's set for one node)::

    RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK,
    ROLE_WORLD_SIZE, ROLE_NAME=default, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID,
    TORCHELASTIC_RESTART_COUNT=0, TORCHELASTIC_MAX_RESTARTS=0, TORCHELASTIC_USE_AGENT_STORE=False
    (rank 0 hosts the rendezvous store: there is no torchrun agent), TORCHELASTIC_ERROR_FILE
    (where torch's ``@record`` writes an exception, which the failure summary then quotes),
    SHMCACHE_SESSION, SHMCACHE_LAUNCH (which launch a process belongs to: see launch.sharers),
    and, unless already set, OMP_NUM_THREADS=1 and
    TORCH_NCCL_ASYNC_ERROR_HANDLING=1. With the options above: SHMCACHE_SIZE_MB,
    SHMCACHE_SPILLING=1, SHMCACHE_SPILL_DIR, SHMCACHE_REMOTE, SHMCACHE_SECRET (--remote spawn).
    The launcher reads SHMCACHE_SESSION, SHMCACHE_SPILL_DIR and SHMCACHE_DIR (the namespace: see
    shmcache.base.namespace), and passes them on; it reads SHMCACHE_RDZV_TOKEN and does not.

Failures: when a process exits with a non-zero status or dies of a signal, every other process
gets SIGTERM, then SIGKILL after --shutdown-timeout. Ctrl-C (SIGINT), SIGTERM and SIGHUP sent to
the launcher are forwarded to every process, with the same escalation; a second one kills at
once. Each process runs in a process group of its own, which dies with it. If the launcher
itself is killed, even by SIGKILL, the kernel kills each process (Linux's PR_SET_PDEATHSIG) and a
small guard process the launcher started kills each process group: what the processes started
dies too, unless it left the group (setsid, start_new_session=True); another removes the
launcher's temporary directory ($TMPDIR/shmcache-launch-*). A summary on stderr names
the root cause first: the first rank that failed, its PID, exit code or signal name (and its
exception, when its entry point is decorated with
torch.distributed.elastic.multiprocessing.errors.record). See NOTE [launcher shutdown].

Exit status::

    0          every process exited 0
    1          the launcher could not prepare the session or, with --remote spawn, this node's
               Redis or the exchange with the other nodes (the message says why), or a
               process could not be reaped
    2          bad command line (the message names the argument)
    126, 127   the program could not be executed / was not found
    N          the first failing process's exit code
    128 + S    the first failing process died of signal S (139: SIGSEGV), or the launcher got
               signal S (130: Ctrl-C, 143: SIGTERM)

Examples::

    python -m shmcache.launch --nproc 4 train.py --epochs 10
    python -m shmcache.launch --nproc-per-node auto --session imagenet --size 65536 train.py
    python -m shmcache.launch --nproc 2 --spilling --spill-dir /scratch/spill -m mypkg.train
    python -m shmcache.launch --nproc 8 --session tmp --destroy-session train.py
    export SHMCACHE_RDZV_TOKEN=... # the same on every node (see --remote spawn)
    python -m shmcache.launch --nnodes 4 --node-rank $NODE --master-addr node0 --master-port 29500 \\
        --nproc 8 --remote spawn:65536 train.py
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import socket
import sys
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ..base import memdir, settings
from ..base.locks import LivenessSlot
from ..base.namespace import SHM_ROOT, resolve_session_name
from ..base.settings import (
    ENV_LAUNCH,
    ENV_MEMORY_DIR,
    ENV_RDZV_TOKEN,
    ENV_REMOTE,
    ENV_SECRET,
    ENV_SESSION,
    ENV_SIZE_MB,
    ENV_SPILL_DIR,
    ENV_SPILLING,
)
from ..base.urls import mask_url
from ..cache.registry import SessionRegistry
from ..errors import InvalidArgument, LaunchError, ShmcacheError, SpillError
from ..tiers.remote import parse_url
from ..tiers.spill import check_spill_dir
from . import metrics_server
from .redis_node import DEFAULT_MAXMEMORY_MB, WORKER_USER, RedisNode, find_redis_server, is_loopback, route_address
from .remote_option import RemoteOption, hide_in_process_title, parse_remote, shards_url
from .rendezvous import (
    TOKEN_HINT,
    check_token,
    host_exchange,
    join_exchange,
    new_password,
    new_secret,
    rendezvous_port,
)
from .sharers import Sharers, launch_mark
from .supervisor import FORWARDED_SIGNALS, RunOutcome, WorkerSpec, launch_directory, run_workers

__all__ = ["main"]

PROG = "python -m shmcache.launch"
USAGE = (
    f"{PROG} [--nproc N] [--session NAME] [--size MIB] [--spilling] [--spill-dir DIR] [--memory-dir DIR]\n"
    f"       [--destroy-session] [--shutdown-timeout S] [--master-addr A] [--master-port P]\n"
    f"       [--nnodes N --node-rank K] [--remote URL | --remote spawn[:MB]] [--rdzv-timeout S]\n"
    f"       [--metrics-port P [--metrics-addr A]]\n"
    f"       [-m | --no-python] script.py [args...]     (-h for the manual)"
)
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
DEFAULT_RDZV_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class LaunchPlan:
    """Everything the command line decided, checked; nothing started yet."""

    session: str
    nproc: int
    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    run_id: str
    command: list[str]  # the worker's argv
    shmcache_env: dict[str, str]  # SHMCACHE_* for every worker
    spill_dir: str | None
    destroy_session: bool
    shutdown_timeout_s: float
    remote: RemoteOption | None  # --remote: a URL for the workers, or spawn
    rdzv_timeout_s: float
    metrics_port: int | None = None  # --metrics-port: /metrics of the node while the job runs
    metrics_addr: str = "127.0.0.1"
    memory_dir: str | None = None  # --memory-dir: where a session made now keeps its memory


def main(argv: Sequence[str] | None = None) -> int:
    """Run the launcher; returns the exit status (see the module docstring)."""
    if argv is None:
        hide_in_process_title()  # a --remote password leaves `ps` before anything else happens
    parser = _build_parser()
    try:
        plan = _plan(parser, list(sys.argv[1:] if argv is None else argv))
        registry, slot = _prepare_session(plan)
    except SystemExit as exc:  # argparse's way out (-h, or a usage error): report, don't raise
        return exc.code if isinstance(exc.code, int) else 2
    except ShmcacheError as exc:  # the namespace or registry is unusable: the message says why
        print(f"{PROG}: error: cannot prepare the session: {exc}", file=sys.stderr)
        return 1
    server = None
    before = metrics_server.reading(registry, plan.session)  # the closing summary counts this job only
    sharers = Sharers(registry, plan.session, launch_mark(os.getpid()), os.getpid())  # other jobs' reads count too
    sharers.start()
    try:
        if plan.metrics_port is not None:
            server = metrics_server.start(registry, plan.metrics_addr, plan.metrics_port)
            host, port = server.server_address[:2]
            print(f"{PROG}: metrics at http://{host}:{port}/metrics", file=sys.stderr, flush=True)
        with launch_directory() as error_dir:
            outcome = _run(plan, error_dir)
    except InvalidArgument as exc:  # --metrics-port: the port is taken, or no prometheus_client
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    except LaunchError as exc:  # --remote spawn: this node's Redis, or the exchange, failed
        print(f"{PROG}: error: {mask_url(str(exc))}", file=sys.stderr)
        return 1
    except _Interrupted as exc:  # before any worker started; this node's Redis is stopped
        name = signal.Signals(exc.signo).name
        print(f"{PROG}: received {name} while preparing --remote spawn; stopped", file=sys.stderr)
        return 128 + exc.signo
    finally:
        if server is not None:
            metrics_server.stop(server)
        # the job's closing summary per cache of its session it used, read before a --destroy-session
        closing = metrics_server.summary(registry, plan.session, before)
        others = sharers.stop()
        if others and closing:
            closing.append(_shared_line(plan.session, others))
        slot.release()
        registry.mark_used(plan.session)  # `shmcache gc --idle-for` counts from the job's end
        if plan.destroy_session:
            _destroy_session(registry, plan.session)
    for line in outcome.summary():
        print(mask_url(line), file=sys.stderr)
    for line in closing:  # after the outcome: its first line names the root cause
        print(f"shmcache.launch: {line}", file=sys.stderr)  # as the outcome's lines
    return outcome.exit_code


def _run(plan: LaunchPlan, error_dir: str) -> RunOutcome:
    """The workers, behind this node's Redis when --remote spawn asks for one."""
    if plan.remote is None or not plan.remote.spawn:
        return run_workers(_worker_specs(plan, error_dir, {}),
                           shutdown_timeout_s=plan.shutdown_timeout_s)
    with _spawned_remote(plan, error_dir) as (url, secret):
        return run_workers(_worker_specs(plan, error_dir, {ENV_REMOTE: url, ENV_SECRET: secret}),
                           shutdown_timeout_s=plan.shutdown_timeout_s)


# --- command line -----------------------------------------------------------------------------


class _PrintManual(argparse.Action):
    """-h prints the module docstring: the manual is written once."""

    def __call__(self, parser, namespace, values, option_string=None):  # noqa: ANN001
        print(manual())
        parser.exit(0)


def manual() -> str:
    """The module docstring as plain text: it is reStructuredText (for the API docs), whose
    literal-block marker ``::`` becomes one colon and whose ``literals`` lose their backquotes;
    the layout stays."""
    return re.sub(r"::$", ":", __doc__ or "", flags=re.MULTILINE).replace("``", "")


class _Parser(argparse.ArgumentParser):
    """Usage errors quote what was typed: a mistyped option next to a URL must not show its
    password. It also keeps the option strings that take a value (``takes_value``), which
    :func:`_split_script` needs to tell an option's value from the script."""

    def __init__(self, *args: Any, **kwargs: Any):
        self.takes_value: set[str] = set()  # before super(): argparse may add --help from there
        super().__init__(*args, **kwargs)

    def add_argument(self, *args: Any, **kwargs: Any) -> argparse.Action:
        action = super().add_argument(*args, **kwargs)
        if action.nargs != 0:
            self.takes_value.update(action.option_strings)
        return action

    def error(self, message: str):  # type: ignore[override]
        super().error(mask_url(message))


def _build_parser() -> _Parser:
    p = _Parser(prog=PROG, usage=USAGE, add_help=False, allow_abbrev=False)
    p.add_argument("-h", "--help", action=_PrintManual, nargs=0)
    p.add_argument("--nproc", "--nproc-per-node", "--nproc_per_node", dest="nproc",
                   type=_parse_nproc, default=1, metavar="N")
    p.add_argument("--nnodes", type=_positive_int, default=1, metavar="N")
    p.add_argument("--node-rank", "--node_rank", dest="node_rank", type=_non_negative_int,
                   default=0, metavar="K")
    p.add_argument("--session", metavar="NAME")
    p.add_argument("--size", type=_non_negative_int, metavar="MIB")
    p.add_argument("--spilling", action="store_true")
    p.add_argument("--spill-dir", "--spill_dir", dest="spill_dir", metavar="DIR")
    p.add_argument("--memory-dir", "--memory_dir", dest="memory_dir", metavar="DIR")
    p.add_argument("--destroy-session", "--destroy_session", dest="destroy_session",
                   action="store_true")
    p.add_argument("--shutdown-timeout", "--shutdown_timeout", dest="shutdown_timeout",
                   type=_non_negative_float, default=DEFAULT_SHUTDOWN_TIMEOUT_S, metavar="S")
    p.add_argument("--master-addr", "--master_addr", dest="master_addr", metavar="A")
    p.add_argument("--master-port", "--master_port", dest="master_port", type=_port, metavar="P")
    p.add_argument("--run-id", "--rdzv-id", "--rdzv_id", dest="run_id", metavar="ID")
    p.add_argument("--remote", type=_parse_remote, metavar="URL")
    p.add_argument("--rdzv-timeout", "--rdzv_timeout", dest="rdzv_timeout", type=_positive_float,
                   default=DEFAULT_RDZV_TIMEOUT_S, metavar="S")
    p.add_argument("--metrics-port", "--metrics_port", dest="metrics_port", type=_port, metavar="P")
    p.add_argument("--metrics-addr", "--metrics_addr", dest="metrics_addr", default="127.0.0.1", metavar="A")
    p.add_argument("--standalone", action="store_true")
    p.add_argument("-m", "--module", action="store_true")
    p.add_argument("--no-python", "--no_python", dest="no_python", action="store_true")
    return p


def _split_script(parser: _Parser, argv: list[str]) -> tuple[list[str], list[str]]:
    """Split argv into the launcher's options and ``script args...``.

    Done by hand because argparse's REMAINDER drops a ``--`` that belongs to the script
    (python/cpython#61252), and script arguments must arrive verbatim.
    """
    takes_value = parser.takes_value
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return argv[:i], argv[i + 1:]
        if not token.startswith("-") or token == "-":
            return argv[:i], argv[i:]
        i += 2 if token in takes_value else 1  # "--opt=value" is one token
    return argv, []


def _plan(parser: _Parser, argv: list[str]) -> LaunchPlan:
    """Parse and check the whole command line; every problem ends in parser.error (exit 2)."""
    launcher_argv, script_argv = _split_script(parser, argv)
    args = parser.parse_args(launcher_argv)
    if not script_argv:
        parser.error("the script to run is missing: put it after the options, e.g. "
                     "`--nproc 2 train.py` (or `-m package.module`)")
    command = _worker_command(parser, args, script_argv)
    try:  # what every rank would refuse, before any starts (--spilling sets SHMCACHE_SPILLING=1 for them)
        settings.check_switches(skip=(ENV_SPILLING,) if args.spilling else ())
    except InvalidArgument as exc:
        parser.error(str(exc))
    session = _session_name(parser, args.session)
    master_addr, master_port, run_id = _rendezvous(parser, args)
    spill_dir = _spill_dir(parser, args.spill_dir) if args.spill_dir else None
    if args.spilling or spill_dir:
        _check_spill_settings(parser, session, spill_dir, args.spilling)
    if args.remote is not None and args.remote.spawn and args.nnodes > 1 and master_port == 65535:
        parser.error("argument --master-port: 65535 leaves no port for the exchange of the Redis "
                     "endpoints (--master-port + 1); pick a lower one")
    if args.remote is not None and args.remote.spawn and args.nnodes > 1:
        why = check_token(settings.get(ENV_RDZV_TOKEN))
        if why is not None:
            parser.error(f"argument --remote: spawn on {args.nnodes} nodes needs a job token, so "
                         f"that only this job's launchers join node 0's exchange on port "
                         f"{master_port + 1} and learn its Redis password and secret, but {why}: "
                         f"{TOKEN_HINT}")
    memory_dir = _memory_dir(parser, session, args.memory_dir) if args.memory_dir else None
    env = _shmcache_env(session, args.size, args.spilling, spill_dir)
    if memory_dir is not None:
        env[ENV_MEMORY_DIR] = memory_dir
    if args.remote is not None and args.remote.url is not None:
        env[ENV_REMOTE] = args.remote.url
    return LaunchPlan(
        session=session, nproc=args.nproc, nnodes=args.nnodes, node_rank=args.node_rank,
        master_addr=master_addr, master_port=master_port, run_id=run_id, command=command,
        shmcache_env=env, spill_dir=spill_dir, destroy_session=args.destroy_session,
        shutdown_timeout_s=args.shutdown_timeout, remote=args.remote,
        rdzv_timeout_s=args.rdzv_timeout, metrics_port=args.metrics_port, metrics_addr=args.metrics_addr,
        memory_dir=memory_dir,
    )


def _worker_command(parser: argparse.ArgumentParser, args: argparse.Namespace,
                    script_argv: list[str]) -> list[str]:
    script, *rest = script_argv
    if args.module and args.no_python:
        parser.error("argument -m/--module: not allowed with --no-python (a module runs through "
                     "Python); drop one of them")
    if args.module:
        return [sys.executable, "-u", "-m", script, *rest]  # -u as torchrun: whole lines interleave
    if args.no_python:
        if os.sep not in script and not shutil.which(script):
            parser.error(f"argument --no-python: program {script!r} is not on $PATH; give its path")
        if os.sep in script and not os.access(script, os.X_OK):
            parser.error(f"argument --no-python: {script!r} is not an executable file; check the "
                         f"path, or `chmod +x` it")
        return script_argv
    if not os.path.isfile(script):
        parser.error(f"argument script: {script!r} is not a file (from {os.getcwd()}); check the "
                     f"path, or use -m for a module, --no-python for a program")
    return [sys.executable, "-u", script, *rest]


def _session_name(parser: argparse.ArgumentParser, given: str | None) -> str:
    try:
        return resolve_session_name(given) if given is not None else resolve_session_name("auto")
    except InvalidArgument as exc:
        origin = "--session" if given is not None else f"${ENV_SESSION}"
        parser.error(f"argument {origin}: {exc}")


def _rendezvous(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[str, int, str]:
    """MASTER_ADDR, MASTER_PORT and the run ID, the same on every node."""
    if args.node_rank >= args.nnodes:
        parser.error(f"argument --node-rank: {args.node_rank} is not below --nnodes "
                     f"{args.nnodes}; node ranks go from 0 to nnodes - 1")
    if args.nnodes > 1 and (args.master_addr is None or not args.master_port):
        parser.error("argument --nnodes: several nodes need --master-addr and --master-port "
                     "(rank 0's host and a port that is free there), the same on every node")
    addr = args.master_addr or "127.0.0.1"
    port = args.master_port or _free_port()
    if args.run_id:
        run_id = args.run_id
    else:
        run_id = str(uuid.uuid4()) if args.nnodes == 1 else f"{addr}:{port}"
    return addr, port, run_id


def _spill_dir(parser: argparse.ArgumentParser, raw: str) -> str:
    """--spill-dir as an absolute path to an existing, writable directory: the library's own check
    (spill.check_spill_dir), so the launcher and the cache accept and refuse the same paths."""
    try:
        return str(check_spill_dir(raw))
    except (SpillError, InvalidArgument) as exc:
        parser.error(f"argument --spill-dir: {exc}")


def _memory_dir(parser: argparse.ArgumentParser, session: str, raw: str) -> str:
    """--memory-dir checked as the library checks it (``memdir.private_dir``: a memory filesystem, no
    symlink, no directory others can swap), and agreeing with the session's if it exists."""
    path = os.path.abspath(os.path.expanduser(raw))
    try:
        if path != SHM_ROOT:  # /dev/shm itself: POSIX shared memory, as without the option
            memdir.private_dir(path)
    except ShmcacheError as exc:
        parser.error(f"argument --memory-dir: {exc}")
    registry = SessionRegistry()
    existing = registry.get(session) if registry.exists(session) else None
    if existing is not None and (existing.memory_dir or "/dev/shm") != path:
        parser.error(f"argument --memory-dir: session {session!r} keeps its shared memory in "
                     f"{existing.memory_dir or '/dev/shm'}, not {path}; drop --memory-dir, or "
                     f"`shmcache destroy {session}` first")
    return path


def _check_spill_settings(parser: argparse.ArgumentParser, session: str, spill_dir: str | None,
                          spilling: bool) -> None:
    """--spill-dir agrees with the session's; --spilling has a directory from somewhere."""
    registry = SessionRegistry()
    existing = registry.get(session) if registry.exists(session) else None
    session_spill_dir = existing.spill_dir if existing is not None else None
    if session_spill_dir and spill_dir and session_spill_dir != spill_dir:
        parser.error(f"argument --spill-dir: session {session!r} already spills to "
                     f"{session_spill_dir!r}, not {spill_dir!r}; drop --spill-dir, or "
                     f"`shmcache destroy {session}` first")
    if not spilling or spill_dir or session_spill_dir or settings.get(ENV_SPILL_DIR):
        return
    parser.error(f"argument --spilling: no spill directory; pass --spill-dir DIR or set "
                 f"${ENV_SPILL_DIR}")


def _shmcache_env(session: str, size_mb: int | None, spilling: bool,
                  spill_dir: str | None) -> dict[str, str]:
    """SHMCACHE_* for the workers: the cache reads them as the defaults of its arguments."""
    env = {ENV_SESSION: session}
    if size_mb is not None:
        env[ENV_SIZE_MB] = str(size_mb)
    if spilling:
        env[ENV_SPILLING] = "1"
    if spill_dir is not None:
        env[ENV_SPILL_DIR] = spill_dir
    return env


# --- argument types (their messages follow "argument --x: ") ----------------------------------


def _parse_nproc(text: str) -> int:
    if text in ("auto", "gpu", "cpu"):
        return _nproc_keyword(text)
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a number of processes; use an integer >= 1, or auto, gpu, cpu"
        ) from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n} processes: use an integer >= 1")
    return n


def _nproc_keyword(word: str) -> int:
    if word == "cpu":
        return os.cpu_count() or 1
    gpus = _cuda_device_count()
    if word == "gpu" and gpus == 0:
        raise argparse.ArgumentTypeError(
            "'gpu', but no CUDA device is visible (check $CUDA_VISIBLE_DEVICES and nvidia-smi); "
            "give a number, or use auto"
        )
    return gpus or 1


def _cuda_device_count() -> int:
    """Visible CUDA devices, without importing torch (the launcher stays light)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        count = 0
        for entry in visible.split(","):
            if not entry.strip() or entry.strip().startswith("-"):
                break  # CUDA stops at the first invalid entry ("-1" hides every device)
            count += 1
        return count
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _positive_int(text: str) -> int:
    value = _int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value}: use an integer >= 1")
    return value


def _non_negative_int(text: str) -> int:
    value = _int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value}: use an integer >= 0")
    return value


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: use a finite number of seconds >= 0")
    return value


def _positive_float(text: str) -> float:
    value = _non_negative_float(text)
    if value == 0:
        raise argparse.ArgumentTypeError("0: use a number of seconds > 0")
    return value


def _parse_remote(text: str) -> RemoteOption:
    """spawn[:MB], or a URL the remote tier accepts (its own parser: one definition of valid)."""
    try:
        option = parse_remote(text, DEFAULT_MAXMEMORY_MB)
        if option.url is not None:
            parse_url(option.url)
    except ValueError as exc:  # argparse would quote the raw value, password and all
        hint = "" if text.startswith("spawn") else "; or spawn[:MB]: one redis-server per node"
        raise argparse.ArgumentTypeError(f"{exc}{hint}") from None
    return option


def _port(text: str) -> int:
    value = _int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"{value}: a port is between 1 and 65535 (0: a free one)")
    return value


# --- the session and the workers --------------------------------------------------------------


def _prepare_session(plan: LaunchPlan) -> tuple[SessionRegistry, LivenessSlot]:
    """The session exists before any worker starts, with the launcher attached to it.

    The launcher holds a liveness slot for the whole job, so `shmcache ls` shows the job and a
    plain `shmcache destroy` refuses to pull the session from under it.
    """
    registry = SessionRegistry()
    registry.ensure(plan.session, spill_dir=plan.spill_dir, memory_dir=plan.memory_dir)
    return registry, registry.attach_process(plan.session)


def _destroy_session(registry: SessionRegistry, session: str) -> None:
    """--destroy-session, after every worker is gone; a failure here must not hide theirs."""
    try:
        registry.destroy(session, force=True)
    except ShmcacheError as exc:
        print(f"{PROG}: warning: could not destroy session {session!r}: {exc}", file=sys.stderr)


def _shared_line(session: str, pids: list[int]) -> str:
    """The closing summary's word on processes outside the job that used its session meanwhile."""
    shown = ", ".join(map(str, pids[:8])) + (f" and {len(pids) - 8} more" if len(pids) > 8 else "")
    return (f"session {session} was also used by {len(pids)} process{'es' if len(pids) > 1 else ''} "
            f"outside this job while it ran (pid{'s' if len(pids) > 1 else ''} {shown}): the counts above "
            f"include their reads (a cache's counters are the session's, not the job's)")


def _worker_specs(plan: LaunchPlan, error_dir: str, extra_env: dict[str, str]) -> list[WorkerSpec]:
    specs = []
    for local_rank in range(plan.nproc):
        error_file = os.path.join(error_dir, f"error-{local_rank}.json")
        env = {**os.environ, **_rank_env(plan, local_rank), **plan.shmcache_env, **extra_env,
               "TORCHELASTIC_ERROR_FILE": error_file,
               ENV_LAUNCH: launch_mark(os.getpid())}  # the job's processes, to Sharers
        env.pop(ENV_RDZV_TOKEN, None)  # the launchers' business: a worker never needs it
        rank = plan.node_rank * plan.nproc + local_rank
        specs.append(WorkerSpec(rank=rank, argv=plan.command, env=env, error_file=error_file))
    return specs


def _rank_env(plan: LaunchPlan, local_rank: int) -> dict[str, str]:
    """torchrun's worker environment for a static rendezvous (checked against it in the tests)."""
    rank = plan.node_rank * plan.nproc + local_rank
    world_size = plan.nnodes * plan.nproc
    return {
        settings.ENV_RANK: str(rank),
        settings.ENV_LOCAL_RANK: str(local_rank),
        settings.ENV_WORLD_SIZE: str(world_size),
        settings.ENV_LOCAL_WORLD_SIZE: str(plan.nproc),
        "GROUP_RANK": str(plan.node_rank),
        "GROUP_WORLD_SIZE": str(plan.nnodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "ROLE_NAME": "default",
        "MASTER_ADDR": plan.master_addr,
        "MASTER_PORT": str(plan.master_port),
        "TORCHELASTIC_RUN_ID": plan.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # "True" would make every rank a client of a store that torchrun's agent hosts; here
        # there is no agent, so rank 0 hosts it.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }


def _free_port() -> int:
    """A port nobody listens on now (torchrun does the same; rank 0 binds it moments later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]



# --- --remote spawn: this node's Redis for the job ---------------------------------------------


class _Interrupted(BaseException):
    """SIGINT, SIGTERM or SIGHUP while this node's Redis starts or the nodes meet: unwind, so the
    server is stopped on the way out (the workers' signal handling starts only with them)."""

    def __init__(self, signo: int) -> None:
        super().__init__(signo)
        self.signo = signo


@contextmanager
def _spawned_remote(plan: LaunchPlan, workdir: str) -> Iterator[tuple[str, str]]:
    """Start this node's redis-server, meet the other nodes, yield $SHMCACHE_REMOTE and the job's
    $SHMCACHE_SECRET; stop the server when the job ends, however it ends (NOTE [remote
    rendezvous]; NOTE [launcher shutdown], 9)."""
    assert plan.remote is not None and plan.remote.spawn_mb is not None
    node = RedisNode(executable=find_redis_server(), bind=route_address(plan.master_addr),
                     maxmemory_mb=plan.remote.spawn_mb, workdir=workdir,
                     warn=lambda message: print(f"{PROG}: warning: {message}", file=sys.stderr))
    try:
        with _signals_raise():
            password, secret, endpoints = _exchange(plan, node)
        url = shards_url(WORKER_USER, password, endpoints, local=(plan.node_rank, node.socket_path))
        print(f"{PROG}: --remote spawn: node {plan.node_rank} of {plan.nnodes} serves "
              f"{node.endpoint} (maxmemory {plan.remote.spawn_mb} MiB, allkeys-lru); "
              f"{ENV_REMOTE}={mask_url(url)}", file=sys.stderr)
        yield url, secret
    finally:
        with _signals_ignored():  # a Ctrl-C now must not cut the stop short
            early = node.poll()
            node.stop()
        if early is not None:
            print(f"{PROG}: warning: this node's redis-server exited during the job (status "
                  f"{early}); the processes read and computed without it. Its log ended with: "
                  f"{node.log_tail() or '(nothing)'}", file=sys.stderr)


def _exchange(plan: LaunchPlan, node: RedisNode) -> tuple[str, str, list[str]]:
    """The job's password, its secret and every node's endpoint, by node rank (NOTE [remote
    rendezvous]). The secret is the user's $SHMCACHE_SECRET if set (node 0's, for every node),
    else a new one: never on a command line, never in a file, never sent to Redis."""
    own_secret = settings.get(ENV_SECRET) or None
    if plan.nnodes == 1:
        password = new_password()
        return password, own_secret or new_secret(), [node.start(password)]
    port = rendezvous_port(plan.master_port)
    token = settings.get(ENV_RDZV_TOKEN)  # set: checked by _plan
    if plan.node_rank == 0:
        secret = own_secret or new_secret()
        password, endpoints = host_exchange(port=port, nnodes=plan.nnodes, job=plan.run_id, token=token,
                                            secret=secret, timeout_s=plan.rdzv_timeout_s,
                                            start_server=node.start)
    else:
        password, secret, endpoints = join_exchange(
            master_addr=plan.master_addr, port=port, nnodes=plan.nnodes, node_rank=plan.node_rank,
            job=plan.run_id, token=token, timeout_s=plan.rdzv_timeout_s, start_server=node.start,
            own_secret=own_secret)
    loopback = [k for k, e in enumerate(endpoints) if is_loopback(e)]
    if loopback and len(loopback) < len(endpoints):
        raise LaunchError(
            f"--remote spawn: the Redis of node ranks {loopback} is bound to a loopback address "
            f"(their --master-addr {plan.master_addr!r} resolves to this host's loopback there), "
            f"which the other nodes cannot reach; give every node --master-addr as an address "
            f"the others reach (node 0's IP address or its name in DNS)"
        )
    return password, secret, endpoints


@contextmanager
def _signals_raise() -> Iterator[None]:
    def interrupt(signo: int, _frame: object) -> None:
        raise _Interrupted(signo)

    old = {signo: signal.signal(signo, interrupt) for signo in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for signo, handler in old.items():
            signal.signal(signo, signal.SIG_DFL if handler is None else handler)


@contextmanager
def _signals_ignored() -> Iterator[None]:
    old = {signo: signal.signal(signo, signal.SIG_IGN) for signo in FORWARDED_SIGNALS}
    try:
        yield
    finally:
        for signo, handler in old.items():
            signal.signal(signo, signal.SIG_DFL if handler is None else handler)
