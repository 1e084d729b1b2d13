"""The README's main command never fails after it succeeded (issue 25, item 1).

It died once in 13 runs, under load, after training had finished: ``terminate called without an
active exception``, SIGABRT. The cause: DistributedDataParallel imports
torch.distributed.nn.functional, whose functions take ``group=group.WORLD`` as a default evaluated
at import; imported after ``init_process_group``, they hold the process group for good, so
``destroy_process_group()`` freed nothing and the group - gloo's threads, rank 0's TCPStore
server thread - was destroyed only while Python finalized its modules, after the script's end
(gdb: ``~ProcessGroupGloo`` under ``finalize_modules`` in ``Py_FinalizeEx``). The example now
imports that module first and destroys the group for real (``teardown()`` in examples/train.py).

The default test pins that deterministically: at interpreter exit (atexit, before finalization)
no thread of the process group is left in any rank. The slow one runs the command itself many
times under CPU load."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from _journey import env

ROOT = Path(__file__).resolve().parents[2]
TRAIN = str(ROOT / "examples" / "train.py")

# every worker (RANK set) writes the names of its native threads when the interpreter starts to exit
PROBE = textwrap.dedent("""\
    import atexit, json, os

    def _threads():
        tasks = sorted(os.listdir("/proc/self/task"))
        names = [open(f"/proc/self/task/{t}/comm").read().strip() for t in tasks]
        with open(os.path.join(os.environ["EXIT_PROBE_DIR"], f"{os.getpid()}.json"), "w") as f:
            json.dump({"rank": os.environ["RANK"], "threads": names}, f)

    if os.environ.get("RANK") is not None and os.environ.get("EXIT_PROBE_DIR"):
        atexit.register(_threads)
""")


def test_the_example_leaves_no_process_group_thread_to_interpreter_teardown(tmp_path):
    probe, out = tmp_path / "probe", tmp_path / "threads"
    probe.mkdir()
    out.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    e = env()
    e["PYTHONPATH"] = os.pathsep.join(p for p in (str(probe), e.get("PYTHONPATH")) if p)
    e["EXIT_PROBE_DIR"] = str(out)
    done = subprocess.run(
        [sys.executable, "-m", "shmcache.launch", "--nproc", "2", TRAIN, "--tasks", "digits", "--digit-epochs", "1"],
        cwd=tmp_path,
        env=e,
        capture_output=True,
        text=True,
        timeout=110,
    )
    assert done.returncode == 0, done.stderr
    reports = [json.loads(p.read_text()) for p in out.iterdir()]
    assert {r["rank"] for r in reports} >= {"0", "1"}, reports
    for r in reports:
        left = [t for t in r["threads"] if t.startswith(("gloo", "pt_gloo", "pt_tcpstore"))]
        assert not left, f"rank {r['rank']} reached interpreter exit with the process group's threads {left}"


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_readme_command_never_fails_after_succeeding_under_cpu_load(tmp_path):
    """The README's command as it is (`python -m shmcache.launch --nproc 2 examples/train.py`),
    15 times, warm after the first, while two busy loops compete for the CPUs."""
    quick_start = (ROOT / "README.md").read_text().split("## Quick start", 1)[1]
    first = re.findall(r"```bash\n(.*?)```", quick_start, re.S)[0]
    argv = next(part for part in first.split("&&") if "shmcache.launch" in part).split()
    assert argv[:5] == ["python", "-m", "shmcache.launch", "--nproc", "2"] and argv[5] == "examples/train.py", argv
    busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    failures = []
    try:
        for run in range(15):
            done = subprocess.run(
                [sys.executable, *argv[1:]], cwd=ROOT, env=env(), capture_output=True, text=True, timeout=300
            )
            if done.returncode != 0:
                failures.append((run, done.returncode, "test accuracy" in done.stdout, done.stderr[-2000:]))
    finally:
        for p in busy:
            p.kill()
            p.wait()
    assert not failures, failures
