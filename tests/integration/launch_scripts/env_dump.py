"""Worker: write what it was given (environment, argv, whether its session exists) to OUTDIR.

Usage: env_dump.py OUTDIR [anything...]  ->  OUTDIR/rank-<RANK>.json
Imports no torch, so it starts fast under the launcher and under torchrun alike.
"""

import json
import os
import sys


def session_exists() -> bool | None:
    session = os.environ.get("SHMCACHE_SESSION")
    if session is None:
        return None
    from shmcache.cache.registry import SessionRegistry

    return SessionRegistry().exists(session)


def main() -> None:
    out_dir = sys.argv[1]
    record = {
        "env": dict(os.environ),
        "argv": sys.argv[1:],
        "session_exists": session_exists(),
        "pid": os.getpid(),
    }
    path = os.path.join(out_dir, f"rank-{os.environ['RANK']}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
