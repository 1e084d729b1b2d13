"""Not the launcher: this folder holds its recipes. Run from the parent of a clone named
``shmcache``, ``python -m shmcache.launch`` finds the clone before the installed package (the
current directory comes first on ``sys.path``, and the clone, having no ``__init__.py``, becomes a
namespace package that an editable install's finder never gets to override) and lands here.
Say so, then run the real launcher with the current directory off ``sys.path``."""

import importlib
import importlib.util
import os
import runpy
import sys

if __name__ == "__main__":
    here = os.path.dirname(os.path.abspath(__file__))
    clone = os.path.dirname(here)
    parent = os.path.dirname(clone)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != parent]
    for name in [m for m in sys.modules if m == "shmcache" or m.startswith("shmcache.")]:
        del sys.modules[name]
    importlib.invalidate_caches()
    try:
        spec = importlib.util.find_spec("shmcache.launch.run")
    except ImportError:
        spec = None
    if spec is None or spec.origin is None:
        sys.exit(
            f"python -m shmcache.launch: {clone} (a clone of shmcache, in the current directory) "
            f"hides the shmcache package, which is not installed: `pip install -e {clone}`, "
            f"or run the command from another directory"
        )
    print(
        f"python -m shmcache.launch: note: {clone} (a clone in the current directory) hides the "
        f"installed package; running the launcher of {os.path.dirname(os.path.dirname(spec.origin))} "
        f"(run it from another directory to drop this note)",
        file=sys.stderr,
    )
    sys.argv[0] = "shmcache.launch"
    runpy.run_module("shmcache.launch", run_name="__main__", alter_sys=True)
