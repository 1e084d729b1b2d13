"""What every journey test does: run a step as a user would, in a process of its own, with its own
environment (PYTHONPATH kept: the package is importable from the checkout, as pip's editable
install makes it in CI)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

from shmcache.base.namespace import ENV_DIR

# a script whose samples are stored with pickle (a set each): the warning said once per job
PICKLED = textwrap.dedent("""\
    from shmcache import ShmDatasetCache

    cache = ShmDatasetCache(session="notes", name="sets")
    ds = cache.wrap([{i, i + 1} for i in range(40)])  # a set: stored with pickle
    [ds[i] for i in range(40)]
    cache.close()
""")


def env(shm_dir: Path | str | None = None) -> dict:
    """The test's environment, with ``$SHMCACHE_DIR`` at ``shm_dir`` (another machine's shared
    memory) when given, and no snapshot read through unless a step asks for one."""
    out = dict(os.environ)
    if shm_dir is not None:
        out[ENV_DIR] = str(shm_dir)
    out.pop("SHMCACHE_SNAPSHOT", None)
    return out


def run(args: list, cwd: Path, env: dict, timeout: float = 90) -> str:
    """``python ARGS`` in ``cwd``; its stdout, after asserting it exited 0 (else its output)."""
    done = subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{args} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout
