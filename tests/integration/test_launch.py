"""The launcher, with real processes: environment, rendezvous, failure handling, signals, recipes.

Workers are the small scripts in ``launch_scripts/``; each writes what it saw (its environment,
its PID) to a directory the test reads. Scenario 15 of RELIABILITY.md is covered by the
``test_failing_rank_*``, ``test_signal_*`` and ``test_launcher_sigkilled_*`` tests. The autouse
fixture in tests/conftest.py gives each test its own ``$SHMCACHE_DIR`` (inherited by the launcher
and its workers) and fails a test that leaves a process or a segment behind.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import shmcache
from shmcache.cache.registry import SessionRegistry
from shmcache.launch import main

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "launch_scripts"
LAUNCH = [sys.executable, "-m", "shmcache.launch"]

#: Keys torchrun gives its workers whose values must be the same under shmcache.launch.
SAME_VALUE_KEYS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
    "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS", "OMP_NUM_THREADS", "TORCH_NCCL_ASYNC_ERROR_HANDLING",
)
#: torchrun keys that shmcache.launch leaves out on purpose: this one is the agent's own
#: setting (which signals *it* handles), leaking into workers through its environment.
NOT_MIRRORED = {"TORCHELASTIC_SIGNALS_TO_HANDLE"}
#: How long a launcher may take to stop everything, beyond the grace period the test gives it.
SLACK_S = 10.0
# "Stopped at once" means well under a grace period the launcher would otherwise wait out; the
# gap between the two is wide so that a loaded CI machine cannot blur them.
LONG_GRACE_S = 30
AT_ONCE_S = 10.0


@pytest.fixture(autouse=True)
def launcher_environment(monkeypatch, tmp_path_factory):
    """Launchers and workers import shmcache from this checkout, and keep temporary files in
    the test's own directory: a SIGKILLed launcher cannot remove its error-file directory."""
    paths = [str(REPO), str(SCRIPTS), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in paths if p))
    monkeypatch.setenv("TMPDIR", str(tmp_path_factory.mktemp("tmpdir")))


@pytest.fixture
def launcher():
    """Start ``python -m shmcache.launch`` as a subprocess; SIGKILLed at teardown if still alive."""
    started: list[subprocess.Popen] = []

    def start(*args: str) -> subprocess.Popen:
        proc = subprocess.Popen([*LAUNCH, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        started.append(proc)
        return proc

    yield start
    for proc in started:
        if proc.poll() is None:
            proc.kill()  # its workers follow through PR_SET_PDEATHSIG
        proc.communicate(timeout=30)


# --- helpers ----------------------------------------------------------------------------------


def wait_for_files(directory: Path, names: list[str], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not all((directory / n).exists() for n in names):
        assert time.monotonic() < deadline, f"{names} not all in {directory} after {timeout_s} s"
        time.sleep(0.02)


def read_pids(directory: Path, prefix: str, count: int) -> list[int]:
    names = [f"{prefix}-{r}" for r in range(count)]
    wait_for_files(directory, names)
    return [int((directory / n).read_text()) for n in names]


def is_gone(pid: int) -> bool:
    """No such process, or only a zombie (it holds nothing; its parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The PIDs still alive after ``timeout_s`` (empty when all went in time)."""
    deadline = time.monotonic() + timeout_s
    alive = [p for p in pids if not is_gone(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.05)
        alive = [p for p in alive if not is_gone(p)]
    return alive


def zombie_children() -> list[int]:
    """Children of this process that exited and were never reaped."""
    zombies = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z" and int(fields[1]) == os.getpid():
            zombies.append(int(entry))
    return zombies


def inherited_environment() -> dict[str, str]:
    """What any child of this process inherits (pytest can leave the C environ and os.environ
    apart, e.g. COLUMNS and LINES, so ask a child rather than reading os.environ)."""
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return json.loads(out)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_main(*args: str) -> int:
    """main() in this process: it must reap every worker and restore every signal handler."""
    watched = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGCHLD)
    handlers = [signal.getsignal(s) for s in watched]
    code = main([*args])
    assert zombie_children() == []
    assert [signal.getsignal(s) for s in watched] == handlers
    wakeup_fd = signal.set_wakeup_fd(-1)  # reading it means setting it: put it back at once
    signal.set_wakeup_fd(wakeup_fd)
    assert wakeup_fd == -1
    return code


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str, float]:
    """Wait for a launcher subprocess: exit status, stderr, and seconds it took from now."""
    start = time.monotonic()
    _, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, err, time.monotonic() - start


def summary_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if ln.startswith("shmcache.launch:")]


def dumps(out_dir: Path, count: int) -> list[dict]:
    names = [f"rank-{r}.json" for r in range(count)]
    wait_for_files(out_dir, names, timeout_s=1)
    return [json.loads((out_dir / n).read_text()) for n in names]


# --- environment ------------------------------------------------------------------------------


def test_worker_env_matches_torchrun(tmp_path):
    """Same rank-related keys and values as torchrun --standalone gives its workers."""
    under_torchrun, under_launch = tmp_path / "torchrun", tmp_path / "launch"
    under_torchrun.mkdir()
    under_launch.mkdir()
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(SCRIPTS / "env_dump.py"), str(under_torchrun)],
        check=True, timeout=90, capture_output=True,
    )
    assert run_main("--nproc", "2", str(SCRIPTS / "env_dump.py"), str(under_launch)) == 0

    parent_keys = set(inherited_environment())
    theirs, ours = dumps(under_torchrun, 2), dumps(under_launch, 2)
    for rank, (t, o) in enumerate(zip(theirs, ours)):
        torchrun_keys = set(t["env"]) - parent_keys
        missing = torchrun_keys - NOT_MIRRORED - set(o["env"])
        assert not missing, f"rank {rank}: torchrun sets {sorted(missing)}, shmcache.launch not"
        for key in SAME_VALUE_KEYS:
            assert o["env"][key] == t["env"][key], f"rank {rank}: {key}"
        assert o["env"]["RANK"] == str(rank)
    for run in (theirs, ours):  # one rendezvous per run: the same address, port and run ID
        for key in ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
            assert run[0]["env"][key] == run[1]["env"][key]
        assert 0 < int(run[0]["env"]["MASTER_PORT"]) < 65536
    # the error files differ per rank, so @record of one rank cannot overwrite another's
    assert ours[0]["env"]["TORCHELASTIC_ERROR_FILE"] != ours[1]["env"]["TORCHELASTIC_ERROR_FILE"]


def test_session_and_cache_settings_reach_workers(tmp_path, shm_namespace):
    spill = tmp_path / "spill" / "nested"
    spill.mkdir(parents=True)
    assert run_main("--nproc", "2", "--session", "job1", "--size", "64", "--spilling",
                    "--spill-dir", str(spill), str(SCRIPTS / "env_dump.py"), str(tmp_path)) == 0
    for record in dumps(tmp_path, 2):
        env = record["env"]
        assert record["session_exists"] is True  # created before the worker started
        assert env["SHMCACHE_SESSION"] == "job1"
        assert env["SHMCACHE_SIZE_MB"] == "64"
        assert env["SHMCACHE_SPILLING"] == "1"
        assert env["SHMCACHE_SPILL_DIR"] == str(spill)
        assert env["SHMCACHE_DIR"] == str(shm_namespace.root)  # the namespace is inherited
    assert spill.is_dir()
    assert SessionRegistry().get("job1").spill_dir == str(spill)  # the session remembers it


def test_session_defaults_to_environment_then_default(tmp_path, monkeypatch):
    assert run_main(str(SCRIPTS / "env_dump.py"), str(tmp_path)) == 0
    assert dumps(tmp_path, 1)[0]["env"]["SHMCACHE_SESSION"] == "default"
    monkeypatch.setenv("SHMCACHE_SESSION", "from-env")
    assert run_main(str(SCRIPTS / "env_dump.py"), str(tmp_path)) == 0
    assert dumps(tmp_path, 1)[0]["env"]["SHMCACHE_SESSION"] == "from-env"
    assert SessionRegistry().exists("from-env")


def test_gloo_all_reduce_under_the_launcher(tmp_path):
    """init_process_group("env://") works unchanged: 1 + 2 summed over two ranks."""
    assert run_main("--nproc", "2", str(SCRIPTS / "gloo_allreduce.py"), str(tmp_path)) == 0
    for rank in range(2):
        assert (tmp_path / f"rank-{rank}.txt").read_text().split() == ["3", "2"]


def test_nproc_auto_counts_visible_cuda_devices_without_torch(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert run_main("--nproc_per_node=auto", str(SCRIPTS / "env_dump.py"), str(tmp_path)) == 0
    assert [r["env"]["WORLD_SIZE"] for r in dumps(tmp_path, 2)] == ["2", "2"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert main(["--nproc", "gpu", str(SCRIPTS / "env_dump.py"), str(tmp_path)]) == 2
    assert "CUDA_VISIBLE_DEVICES" in capsys.readouterr().err


def test_node_rank_offsets_the_ranks(tmp_path):
    """--nnodes/--node-rank (launch/slurm.sbatch): node 1 of 2 holds ranks 2 and 3 of 4."""
    assert run_main("--nnodes", "2", "--node-rank", "1", "--nproc", "2", "--master-addr",
                    "127.0.0.1", "--master-port", "29999", str(SCRIPTS / "env_dump.py"),
                    str(tmp_path)) == 0
    names = ["rank-2.json", "rank-3.json"]
    envs = [json.loads((tmp_path / n).read_text())["env"] for n in names]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1"]
    assert {e["WORLD_SIZE"] for e in envs} == {"4"}
    assert {e["GROUP_RANK"] for e in envs} == {"1"}
    assert {e["GROUP_WORLD_SIZE"] for e in envs} == {"2"}
    assert {e["TORCHELASTIC_RUN_ID"] for e in envs} == {"127.0.0.1:29999"}  # same on each node


def test_two_launchers_form_one_job(tmp_path, launcher):
    """Two "nodes" on this machine, one launcher each, join one gloo group (one rank each, to
    keep it fast: the rank offsets are checked above)."""
    port = str(free_port())
    common = ["--nnodes", "2", "--nproc", "1", "--master-addr", "127.0.0.1", "--master-port",
              port, str(SCRIPTS / "gloo_allreduce.py"), str(tmp_path)]
    nodes = [launcher("--node-rank", str(k), "--session", f"node{k}", *common) for k in (0, 1)]
    for node in nodes:
        code, err, _ = finish(node, timeout_s=90)
        assert code == 0, err
    for rank in range(2):
        assert (tmp_path / f"rank-{rank}.txt").read_text().split() == ["3", "2"]


def test_destroy_session_after_the_workers(tmp_path):
    behave = str(SCRIPTS / "behave.py")
    assert run_main("--session", "kept", behave, str(tmp_path), "exit0") == 0
    assert SessionRegistry().exists("kept")  # sessions outlive the job by default
    assert run_main("--session", "dropped", "--destroy-session", behave, str(tmp_path),
                    "exit0") == 0
    assert not SessionRegistry().exists("dropped")


# --- what runs, and with which arguments ------------------------------------------------------


def test_script_arguments_arrive_verbatim(tmp_path):
    args = ["--foo", "bar", "-x", "--", "--nproc", "3", "-m", "--session=x", "-h"]
    assert run_main("--nproc", "1", str(SCRIPTS / "env_dump.py"), str(tmp_path), *args) == 0
    record = dumps(tmp_path, 1)[0]
    assert record["argv"] == [str(tmp_path), *args]
    assert "--local-rank" not in " ".join(record["argv"])


def test_module_mode(tmp_path):
    assert run_main("--nproc", "2", "-m", "env_dump", str(tmp_path), "--flag") == 0
    assert [r["argv"] for r in dumps(tmp_path, 2)] == [[str(tmp_path), "--flag"]] * 2


def test_no_python_runs_the_program_directly(tmp_path):
    assert run_main("--nproc", "2", "--session", "sh-job", "--no-python", "sh",
                    str(SCRIPTS / "echo_env.sh"), str(tmp_path), "a", "-b") == 0
    for rank in range(2):
        assert (tmp_path / f"rank-{rank}.txt").read_text().split() == [
            str(rank), "2", "sh-job", "a", "-b"]


def test_help_is_the_manual(capsys):
    assert main(["-h"]) == 0
    out = capsys.readouterr().out
    for section in ("Usage", "Options", "Exit status", "Examples", "SHMCACHE_SESSION"):
        assert section in out
    # plain text, not reStructuredText: no literal markers, no double backquotes
    assert "``" not in out and not [ln for ln in out.splitlines() if ln.rstrip().endswith("::")]
    assert "Usage:\n\n    python -m shmcache.launch [options] script.py" in out  # the layout stays
    assert "run a module, as python -m" in out



def test_manual_cites_notes_where_they_are(capsys):
    """Each NOTE the manual sends a reader to is defined in the file it names: the manual once sent
    readers of --remote spawn to 'NOTE [remote rendezvous] in NOTE [remote rendezvous]'."""
    assert main(["-h"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # a citation may wrap across lines
    root = Path(shmcache.__file__).resolve().parent.parent
    cited = re.findall(r"NOTE \[([^\]]+)\](?: in ([^\s),;]+))?", out)
    assert cited
    for note, where in cited:
        assert where != "NOTE", f"NOTE [{note}] is cited 'in NOTE [...]', not in a file"
        files = [root / where] if where else list((root / "shmcache").rglob("*.py"))
        assert any(f.is_file() and re.search(rf"^\s*NOTE \[{re.escape(note)}\]\s*$", f.read_text(), re.M)
                   for f in files), f"NOTE [{note}] cited by the manual is not defined in {where or 'shmcache/'}"

def test_launcher_does_not_import_torch():
    code = "import sys, shmcache.launch; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    assert out.strip() == "False"


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--nproc", "0", "s.py"], "--nproc"),
        (["--nproc", "-3", "s.py"], "--nproc"),
        (["--nproc", "two", "s.py"], "--nproc"),
        (["--nproc_per_node=1.5", "s.py"], "--nproc"),
        (["--session", "a/b", "SCRIPT"], "--session"),
        (["--session", "..", "SCRIPT"], "--session"),
        (["--session", "", "SCRIPT"], "--session"),
        (["--nproc", "2"], "script"),
        (["missing_script.py"], "script"),
        (["--spilling", "SCRIPT"], "--spilling"),
        (["--size", "-5", "SCRIPT"], "--size"),
        (["--shutdown-timeout", "-1", "SCRIPT"], "--shutdown-timeout"),
        (["--master-port", "70000", "SCRIPT"], "--master-port"),
        (["-m", "--no-python", "x"], "--no-python"),
        (["--no-python", "no-such-program-here", "x"], "--no-python"),
        (["--nnodes", "2", "SCRIPT"], "--nnodes"),
        (["--unknown-option", "SCRIPT"], "--unknown-option"),
    ],
)
def test_bad_arguments_exit_2_naming_the_argument(args, names, capsys):
    args = [str(SCRIPTS / "behave.py") if a == "SCRIPT" else a for a in args]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert names in err, err
    assert "usage:" in err
    assert SessionRegistry().list() == []  # nothing was created for a refused command line


def test_spilling_error_names_both_ways(capsys):
    assert main(["--spilling", str(SCRIPTS / "behave.py")]) == 2
    err = capsys.readouterr().err
    assert "--spill-dir DIR" in err and "$SHMCACHE_SPILL_DIR" in err


def test_spilling_uses_the_session_or_environment_spill_dir(tmp_path, monkeypatch):
    behave = [str(SCRIPTS / "behave.py"), str(tmp_path), "exit0"]
    (tmp_path / "s").mkdir()
    (tmp_path / "env-spill").mkdir()
    SessionRegistry().create("has-spill", spill_dir=tmp_path / "s")
    assert run_main("--spilling", "--session", "has-spill", *behave) == 0
    monkeypatch.setenv("SHMCACHE_SPILL_DIR", str(tmp_path / "env-spill"))
    assert run_main("--spilling", "--session", "other", *behave) == 0


def test_spill_dir_must_be_a_directory_and_agree_with_the_session(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert main(["--spill-dir", str(a_file), str(SCRIPTS / "behave.py")]) == 2
    assert "argument --spill-dir" in capsys.readouterr().err
    typo = tmp_path / "no-such" / "spill"  # never created: a typo would fill another disk
    assert main(["--spill-dir", str(typo), str(SCRIPTS / "behave.py")]) == 2
    err = capsys.readouterr().err
    assert f"spill_dir {typo} does not exist; create it first (mkdir -p {typo})" in err, err
    assert not (tmp_path / "no-such").exists()
    (tmp_path / "one").mkdir()
    (tmp_path / "two").mkdir()
    SessionRegistry().create("spills", spill_dir=tmp_path / "one")
    assert main(["--session", "spills", "--spill-dir", str(tmp_path / "two"),
                 str(SCRIPTS / "behave.py")]) == 2
    err = capsys.readouterr().err
    assert "already spills to" in err and "shmcache destroy spills" in err


def test_bad_session_in_environment_names_the_variable(monkeypatch, capsys):
    monkeypatch.setenv("SHMCACHE_SESSION", "../escape")
    assert main([str(SCRIPTS / "behave.py")]) == 2
    assert "$SHMCACHE_SESSION" in capsys.readouterr().err


# --- failures (RELIABILITY.md, scenario 15) ---------------------------------------------------


def test_failing_rank_stops_the_others(tmp_path, launcher):
    """Rank 1 raises: rank 0, rank 2 and rank 2's child are gone; the summary names rank 1 first."""
    proc = launcher("--nproc", "3", "--shutdown-timeout", str(LONG_GRACE_S), str(SCRIPTS / "behave.py"),
                    str(tmp_path), "sleep", "raise", "with-child")
    pids = read_pids(tmp_path, "pid", 3)
    child = int((tmp_path / "child-2").read_text())  # written before its parent's PID
    code, err, took_s = finish(proc, timeout_s=LONG_GRACE_S + SLACK_S)
    assert code == 1, err
    assert took_s < AT_ONCE_S, f"SIGTERM should have stopped the sleepers at once, took {took_s:.1f} s"
    lines = summary_lines(err)
    assert lines[0] == f"shmcache.launch: rank 1 (pid {pids[1]}) failed first: exit code 1", err
    assert f"rank 0 (pid {pids[0]}): terminated by launcher (SIGTERM)" in err
    assert f"rank 2 (pid {pids[2]}): terminated by launcher (SIGTERM)" in err
    assert "RuntimeError: rank 1 fails on purpose" in err  # the worker's own traceback
    assert wait_gone([*pids, child], timeout_s=2) == []


def test_a_rank_that_exits_with_a_code_after_sigterm_is_not_called_terminated(tmp_path, launcher):
    """A rank that exits 1 once the launcher's SIGTERM came (its handler's exit, as torchelastic's
    raises; or a failure of its own at the same moment) was summed up as "terminated by launcher
    (SIGTERM): exit code 1", which reads as the launcher's doing. The summary says what is known:
    it exited with that code after the launcher sent the signal."""
    proc = launcher("--nproc", "2", "--shutdown-timeout", str(LONG_GRACE_S), str(SCRIPTS / "behave.py"),
                    str(tmp_path), "term-exit1", "raise")
    pids = read_pids(tmp_path, "pid", 2)
    code, err, _ = finish(proc, timeout_s=LONG_GRACE_S + SLACK_S)
    assert code == 1, err
    assert summary_lines(err)[0] == f"shmcache.launch: rank 1 (pid {pids[1]}) failed first: exit code 1", err
    assert f"rank 0 (pid {pids[0]}): exited with exit code 1 after the launcher sent SIGTERM" in err, err
    assert "terminated by launcher" not in err, err


def test_failing_rank_ignoring_sigterm_is_killed_after_the_grace_period(tmp_path, launcher):
    grace_s = 1.0
    proc = launcher("--nproc", "2", "--shutdown-timeout", str(grace_s),
                    str(SCRIPTS / "behave.py"), str(tmp_path), "ignore-term", "raise")
    pids = read_pids(tmp_path, "pid", 2)
    code, err, took_s = finish(proc, timeout_s=grace_s + SLACK_S)
    assert code == 1, err
    assert grace_s * 0.9 <= took_s < grace_s + AT_ONCE_S
    assert summary_lines(err)[0].startswith("shmcache.launch: rank 1 ")
    assert "terminated by launcher (SIGTERM, then SIGKILL after 1.0 s): signal SIGKILL" in err
    assert wait_gone(pids, timeout_s=2) == []


def test_rank_killed_by_a_signal_is_named(tmp_path, launcher):
    proc = launcher("--nproc", "2", "--shutdown-timeout", "5", str(SCRIPTS / "behave.py"),
                    str(tmp_path), "sleep", "segv")
    pids = read_pids(tmp_path, "pid", 2)
    code, err, _ = finish(proc, timeout_s=5 + SLACK_S)
    assert code == 128 + signal.SIGSEGV, err
    assert summary_lines(err)[0] == (
        f"shmcache.launch: rank 1 (pid {pids[1]}) failed first: signal SIGSEGV")
    assert wait_gone(pids, timeout_s=2) == []


def test_what_a_worker_leaves_behind_dies_with_it(tmp_path):
    """A worker exits 0 but its child lives on: the launcher kills it instead of orphaning it."""
    assert run_main(str(SCRIPTS / "behave.py"), str(tmp_path), "leave-child") == 0
    child = int((tmp_path / "child-0").read_text())
    assert wait_gone([child], timeout_s=2) == []


def test_record_decorated_error_is_quoted_in_the_summary(capsys):
    assert main(["--nproc", "1", str(SCRIPTS / "record_raise.py")]) == 1
    lines = summary_lines(capsys.readouterr().err)
    assert lines[0].startswith("shmcache.launch: rank 0 ") and lines[0].endswith("exit code 1")
    assert "ValueError: bad batch 7 on purpose" in lines[1]
    assert "record_raise.py" in lines[1]  # where it was raised


@pytest.mark.parametrize("signo", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_launcher_is_forwarded_and_leaves_no_process(tmp_path, launcher, signo):
    proc = launcher("--nproc", "2", "--shutdown-timeout", str(LONG_GRACE_S), str(SCRIPTS / "behave.py"),
                    str(tmp_path), "with-child", "sleep")
    pids = read_pids(tmp_path, "pid", 2)
    child = int((tmp_path / "child-0").read_text())
    proc.send_signal(signo)
    code, err, took_s = finish(proc, timeout_s=LONG_GRACE_S + SLACK_S)
    assert code == 128 + signo, err
    assert took_s < AT_ONCE_S
    assert summary_lines(err)[0] == (
        f"shmcache.launch: received {signal.Signals(signo).name}; forwarded it to every worker")
    assert wait_gone([*pids, child], timeout_s=2) == []


def test_signal_twice_kills_at_once(tmp_path, launcher):
    """Ctrl-C, then Ctrl-C again: no waiting out a 60 s grace period for ranks that ignore it."""
    proc = launcher("--nproc", "2", "--shutdown-timeout", "60", str(SCRIPTS / "behave.py"),
                    str(tmp_path), "ignore-int", "ignore-int")
    pids = read_pids(tmp_path, "pid", 2)
    proc.send_signal(signal.SIGINT)
    wait_for_files(tmp_path, ["got-int-0", "got-int-1"])  # forwarded to both, which ignored it
    assert proc.poll() is None, "the workers ignore SIGINT: the launcher waits for the grace period"
    proc.send_signal(signal.SIGINT)
    code, err, took_s = finish(proc, timeout_s=SLACK_S)
    assert code == 130, err
    assert took_s < AT_ONCE_S
    assert "terminated by launcher (SIGINT, then SIGKILL" in err
    assert wait_gone(pids, timeout_s=2) == []


def test_launcher_sigkilled_takes_its_workers_down(tmp_path, launcher):
    """PR_SET_PDEATHSIG: nobody is left to forward anything, the kernel kills the workers."""
    proc = launcher("--nproc", "2", str(SCRIPTS / "behave.py"), str(tmp_path), "sleep", "sleep")
    pids = read_pids(tmp_path, "pid", 2)
    proc.kill()
    proc.communicate(timeout=10)
    assert wait_gone(pids, timeout_s=5) == []


def test_launcher_sigkilled_takes_the_children_of_its_workers_down(tmp_path, launcher):
    """A worker's own child (not a DataLoader worker: no parent-death check of its own) dies
    too: the launcher's guard kills each worker's process group (NOTE [launcher shutdown], 8)."""
    proc = launcher("--nproc", "2", str(SCRIPTS / "behave.py"), str(tmp_path), "with-child", "with-child")
    pids = read_pids(tmp_path, "pid", 2)
    children = [int((tmp_path / f"child-{r}").read_text()) for r in range(2)]
    proc.kill()
    proc.wait(timeout=10)  # not communicate(): a surviving child would hold its pipes open
    try:
        assert wait_gone([*pids, *children], timeout_s=5) == []
    finally:
        for pid in children:  # before the fix: do not leave them behind
            if not is_gone(pid):
                os.kill(pid, signal.SIGKILL)


# --- recipes ----------------------------------------------------------------------------------


bash = shutil.which("bash")
needs_bash = pytest.mark.skipif(bash is None, reason="bash is not installed")


@needs_bash
def test_cache_sh_runs_a_job_in_a_session(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    helped = subprocess.run([bash, str(REPO / "launch" / "cache.sh"), "-h"], env=env,
                            capture_output=True, text=True, timeout=30)
    assert helped.returncode == 0 and "Usage: launch/cache.sh" in helped.stdout
    job = [str(SCRIPTS / "env_dump.py"), str(tmp_path), "--arg"]
    kept = subprocess.run([bash, str(REPO / "launch" / "cache.sh"), "-n", "2", "-s", "smoke",
                           "--size", "16", *job], env=env, capture_output=True, text=True,
                          timeout=60)
    assert kept.returncode == 0, kept.stderr
    for record in dumps(tmp_path, 2):
        assert record["session_exists"] is True
        assert record["env"]["SHMCACHE_SIZE_MB"] == "16"
        assert record["argv"] == [str(tmp_path), "--arg"]
    assert "== shmcache stat smoke ==" in kept.stdout
    assert "failed" not in kept.stderr  # `shmcache stat` ran
    assert SessionRegistry().exists("smoke")  # kept for the next run
    dropped = subprocess.run([bash, str(REPO / "launch" / "cache.sh"), "-s", "smoke",
                              "--destroy", *job], env=env, capture_output=True, text=True,
                             timeout=60)
    assert dropped.returncode == 0, dropped.stderr
    assert not SessionRegistry().exists("smoke")


@needs_bash
def test_cache_sh_passes_on_the_job_status_and_rejects_bad_options(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable}
    cache_sh = str(REPO / "launch" / "cache.sh")
    failed = subprocess.run([bash, cache_sh, str(SCRIPTS / "behave.py"), str(tmp_path), "segv"],
                            env=env, capture_output=True, text=True, timeout=60)
    assert failed.returncode == 128 + signal.SIGSEGV, failed.stderr
    bad = subprocess.run([bash, cache_sh, "--bogus", "x.py"], env=env, capture_output=True,
                         text=True, timeout=30)
    assert bad.returncode == 2 and "--bogus" in bad.stderr


@needs_bash
def test_slurm_recipe_is_valid_bash():
    subprocess.run([bash, "-n", str(REPO / "launch" / "slurm.sbatch")], check=True, timeout=30)


@needs_bash
def test_cache_sh_prints_the_statistics_table_once(tmp_path):
    # examples/train.py prints `shmcache stat` itself when run alone; under cache.sh, which prints
    # it after the job, the table must not appear twice
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run([bash, str(REPO / "launch" / "cache.sh"), "-s", "once", "--destroy",
                        str(REPO / "examples" / "train.py"), "--tasks", "digits", "--digit-epochs", "1"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "test accuracy" in r.stdout
    assert r.stdout.count("== shmcache stat once ==") == 1
    assert [ln.split()[:2] for ln in r.stdout.splitlines()].count(["session", "cache"]) == 1, r.stdout
    assert not SessionRegistry().exists("once")
