"""The layers of docs/design.md §2, checked on the source with ``ast``: imports point down only,
and nothing below the torch layer imports torch - at any depth, lazily or not (checked once more
at run time, in a fresh interpreter, so a third-party import cannot smuggle torch in)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import shmcache

PKG = Path(shmcache.__file__).resolve().parent

# Rank of each module: a module may import only modules of a strictly lower rank.
RANK = {
    "errors": 0, "_faults": 0,
    "config": 1,
    "locks": 2, "segment": 2,
    "_process": 3, "registry": 3, "codec": 3, "allocator": 3, "index": 3, "spill": 3,
    "store": 4,
    "remote": 4,  # the Redis tier (NOTE [remote tier]): bytes in, bytes out; redis-py imported lazily
    "spilling": 5,  # wires spill segments into the store; used by the torch layer and the CLI
    "fingerprint": 5,  # torch layer: names a wrapped dataset's cache
    "_pil": 5,  # torch layer: PIL images as a codec type (registered lazily)
    "dataset": 6, "prefetch": 6, "sink": 7,
    "sampler": 6,  # torch layer: which indices each rank reads (knows nodes, not caches)
    "cli": 8, "launch": 8, "_procs": 1,
}
NO_TORCH = ["config", "errors", "locks", "registry", "segment", "codec", "allocator", "index",
            "store", "cli", "spill", "_process", "_faults", "spilling", "_procs", "launch", "_pil",
            "remote"]
TOP = {"dataset", "prefetch", "sink", "launch", "cli"}


def _imports(module: str) -> list[tuple[str, int]]:
    """Every module this one imports, anywhere in the file: (absolute dotted name, line)."""
    tree = ast.parse((PKG / f"{module}.py").read_text(), f"{module}.py")
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y
                base = "shmcache" + (f".{node.module}" if node.module else "")
                if node.module is None:  # a submodule, or an attribute of the package root
                    out += [(f"shmcache.{a.name}" if (PKG / f"{a.name}.py").exists()
                             else "shmcache", node.lineno) for a in node.names]
                else:
                    out.append((base, node.lineno))
            else:
                mod = node.module or ""
                if mod == "shmcache":
                    out += [(f"shmcache.{a.name}", node.lineno) for a in node.names]
                else:
                    out.append((mod, node.lineno))
    return out


def _existing(names):
    return [m for m in names if (PKG / f"{m}.py").exists()]


def test_every_module_has_a_rank():
    modules = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    assert modules <= set(RANK), f"modules without a layer: {sorted(modules - set(RANK))}"


@pytest.mark.parametrize("module", _existing(NO_TORCH))
def test_low_layers_never_import_torch(module):
    bad = [(m, line) for m, line in _imports(module) if m == "torch" or m.startswith("torch.")]
    assert not bad, f"shmcache/{module}.py imports torch at lines {[line for _, line in bad]}"


@pytest.mark.parametrize("module", sorted(_existing(RANK)))
def test_imports_point_down_only(module):
    wrong = []
    for name, line in _imports(module):
        if not name.startswith("shmcache"):
            continue
        target = name.split(".")[1] if "." in name else ""
        if target in ("", "__init__"):
            if module not in TOP:  # the package root re-exports the torch layer lazily
                wrong.append(f"line {line}: imports the package root")
            continue
        if target not in RANK:
            wrong.append(f"line {line}: imports unknown module {name}")
        elif RANK[target] >= RANK[module]:
            wrong.append(f"line {line}: imports {target} (rank {RANK[target]} >= {RANK[module]})")
    assert not wrong, f"shmcache/{module}.py: " + "; ".join(wrong)


@pytest.mark.parametrize("module", ["config", "errors", "locks", "registry", "segment", "codec",
                                    "allocator", "index", "store", "spill", "_process", "_faults"])
def test_low_layers_never_import_the_layers_above(module):
    above = {"dataset", "prefetch", "sink", "launch", "cli"}
    bad = [n for n, _ in _imports(module) if n.startswith("shmcache.") and n.split(".")[1] in above]
    assert not bad, f"{module} imports {bad}"


def test_no_torch_at_run_time():
    mods = ", ".join(f"shmcache.{m}" for m in _existing(NO_TORCH))
    code = (f"import sys, {mods}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_import_shmcache_is_lazy():
    code = ("import sys, shmcache\n"
            "assert 'torch' not in sys.modules, 'import shmcache imported torch'\n"
            "assert 'shmcache.dataset' not in sys.modules\n"
            "shmcache.ShmDatasetCache\n"
            "assert 'torch' in sys.modules\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
