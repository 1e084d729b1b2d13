"""Worker whose behaviour is chosen per rank, to drive the launcher's failure handling.

Usage: behave.py OUTDIR ACTION_OF_RANK_0 ACTION_OF_RANK_1 ...

Every rank first writes its PID to OUTDIR/pid-<RANK> (after installing any signal disposition,
so a test that sees the file can rely on it). Actions:
    sleep        sleep for a minute (the launcher must stop it)
    ignore-term  ignore SIGTERM, then sleep (the launcher must SIGKILL it)
    term-exit1   exit 1 from a SIGTERM handler (as torchelastic's raises), else sleep
    ignore-int   ignore SIGINT (writing OUTDIR/got-int-<RANK> when one comes), then sleep
    with-child   start a `sleep 60` child in its process group (its PID in OUTDIR/child-<RANK>),
                 then sleep: the launcher must stop the child too
    leave-child  start that child, then exit 0 without waiting for it: an orphan in the making
    raise        wait until every rank wrote its PID, then raise
    segv         wait until every rank wrote its PID, then die of SIGSEGV (no core file)
    exit0        exit 0 at once
"""

import os
import resource
import signal
import subprocess
import sys
import time


def write_atomically(path: str, text: str) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def wait_for_every_rank(out_dir: str, world_size: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if all(os.path.exists(os.path.join(out_dir, f"pid-{r}")) for r in range(world_size)):
            return
        time.sleep(0.02)
    raise TimeoutError("the other ranks did not start within 30 s")


def main() -> None:
    out_dir, actions = sys.argv[1], sys.argv[2:]
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    action = actions[rank]
    if action == "ignore-term":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if action == "term-exit1":
        signal.signal(signal.SIGTERM, lambda *_: os._exit(1))
    if action == "ignore-int":  # the file is the test's handshake: the forwarded signal arrived
        signal.signal(signal.SIGINT, lambda *_: write_atomically(os.path.join(out_dir, f"got-int-{rank}"), "1"))
    if action in ("with-child", "leave-child"):
        child = subprocess.Popen(["sleep", "60"])
        write_atomically(os.path.join(out_dir, f"child-{rank}"), str(child.pid))
    write_atomically(os.path.join(out_dir, f"pid-{rank}"), str(os.getpid()))

    if action in ("exit0", "leave-child"):
        return
    if action == "raise":
        wait_for_every_rank(out_dir, world_size)
        raise RuntimeError(f"rank {rank} fails on purpose")
    if action == "segv":
        wait_for_every_rank(out_dir, world_size)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


if __name__ == "__main__":
    main()
