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

# Rank of each module (dotted below shmcache; a package by its __init__): a module may import
# only modules of a strictly lower rank.
RANK = {
    "errors": 0, "_faults": 0,
    "config": 1,
    "trust": 1,  # the job's secret and the MAC of records from outside shared memory (NOTE [record authentication])
    "ordering": 1,  # the asymmetric fence (membarrier) of NOTE [publish order]
    "launch.supervisor": 1,  # the launcher's process machinery: knows nothing of shmcache
    "launch.remote_option": 1,  # --remote: what it means, and its password out of sight
    "launch.rendezvous": 1,  # the launchers' exchange of Redis endpoints (NOTE [remote rendezvous])
    "snapshot.location": 1.5,  # where a snapshot's files live: a local directory or an fsspec URL
    "launch.redis_node": 2,  # one redis-server per node, a companion of the supervisor
    "locks": 2, "segment": 2,
    "process_slot": 3, "registry": 3, "codec": 3, "allocator": 3, "index": 3,
    "spill.format": 3, "spill.recovery": 3.1, "spill.files": 3.2, "spill": 3.3,
    "snapshot.format": 3.4,  # the snapshot's files (NOTE [snapshot format]): spill records, an index
    "generation": 3.5,  # a cache's root and meta words, the totals and the intent record
    "gather": 3.5,  # the vectorised batch gather (columns out of a class segment)
    "tier_protocol": 3.5,  # what the store needs of an indexed tier (the spill tier): NOTE [tiers]
    "tier_counts": 3.5,  # a tier's counters, one row per process slot (NOTE [tier counts])
    "store": 4,
    "tiers": 4.5,  # the tier seam: a store with the tiers behind it (NOTE [tiers])
    "remote": 4.6,  # the Redis tier (NOTE [remote tier]); redis-py imported lazily
    "spill.tier": 5,  # the spill tier (an IndexedTier) and where its folder is; used above the store
    "maintenance": 5.5,  # gc of a namespace: the registry's, then each cache's, then spill folders
    "snapshot.export": 5.5, "snapshot.load": 5.6,  # a cache to a snapshot and back (no torch)
    "snapshot.tier": 5.55,  # the read-through tier: a snapshot behind shared memory (no torch)
    "snapshot": 5.7,
    "fingerprint": 5,  # torch layer: names a wrapped dataset's cache
    "_pil": 5,  # torch layer: PIL images as a codec type (the codec loads it lazily, by name)
    "_torch": 5,  # torch layer: tensors as a codec type (the codec loads it lazily, by name)
    "dataset": 6, "prefetch": 6, "sink": 7,
    "sampler": 6,  # torch layer: which indices each rank reads (knows nodes, not caches)
    "cli": 8, "launch.run": 8, "launch": 8.1,
}
NO_TORCH = ["config", "trust", "errors", "ordering", "locks", "registry", "segment", "codec", "allocator", "index",
            "store", "generation", "gather", "tier_protocol", "maintenance", "cli", "spill",
            "spill.format", "spill.recovery", "spill.files", "spill.tier",
            "process_slot", "tiers", "tier_counts", "_faults", "launch", "launch.run", "launch.supervisor", "_pil",
            "launch.remote_option", "launch.rendezvous", "launch.redis_node", "remote",
            "snapshot", "snapshot.format", "snapshot.location", "snapshot.export", "snapshot.load",
            "snapshot.tier"]
TOP = {"dataset", "prefetch", "sink", "launch", "launch.run", "cli"}


def _path(module: str) -> Path:
    """The file of a dotted module name below shmcache (a package: its __init__.py)."""
    base = PKG.joinpath(*module.split("."))
    return base / "__init__.py" if base.is_dir() else base.with_suffix(".py")


def _package(module: str) -> list[str]:
    """The package a module's relative imports start from, as parts below shmcache."""
    parts = module.split(".")
    return parts if _path(module).name == "__init__.py" else parts[:-1]


def _is_module(parts: list[str]) -> bool:
    base = PKG.joinpath(*parts)
    return base.is_dir() or base.with_suffix(".py").exists()


def _imports(module: str) -> list[tuple[str, int]]:
    """Every module this one imports, anywhere in the file: (absolute dotted name, line)."""
    tree = ast.parse(_path(module).read_text(), str(_path(module)))
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: from . import x / from .x import y / from .. import z
                pkg = _package(module)
                pkg = pkg[:len(pkg) - (node.level - 1)]
                base = pkg + (node.module.split(".") if node.module else [])
                if node.module is None:  # submodules, or attributes of a package
                    out += [(".".join(["shmcache", *base, a.name]) if _is_module(base + [a.name])
                             else ".".join(["shmcache", *base]), node.lineno) for a in node.names]
                else:
                    out.append((".".join(["shmcache", *base]), node.lineno))
            else:
                mod = node.module or ""
                if mod == "shmcache":
                    out += [(f"shmcache.{a.name}", node.lineno) for a in node.names]
                else:
                    out.append((mod, node.lineno))
    return out


def _ranked(name: str) -> str | None:
    """The module of RANK an absolute import names: the longest ranked prefix (None: the root)."""
    parts = name.split(".")[1:]
    while parts:
        if ".".join(parts) in RANK:
            return ".".join(parts)
        parts.pop()
    return None


def _existing(names):
    return [m for m in names if _path(m).exists()]


def _all_modules() -> set[str]:
    found = set()
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).with_suffix("").parts
        if rel[-1] == "__main__" or rel == ("__init__",):
            continue
        found.add(".".join(rel[:-1] if rel[-1] == "__init__" else rel))
    return found


def test_every_module_has_a_rank():
    modules = _all_modules()
    assert modules <= set(RANK), f"modules without a layer: {sorted(modules - set(RANK))}"


@pytest.mark.parametrize("module", _existing(NO_TORCH))
def test_low_layers_never_import_torch(module):
    bad = [(m, line) for m, line in _imports(module) if m == "torch" or m.startswith("torch.")]
    assert not bad, f"{_path(module)} imports torch at lines {[line for _, line in bad]}"


@pytest.mark.parametrize("module", sorted(_existing(RANK)))
def test_imports_point_down_only(module):
    wrong = []
    for name, line in _imports(module):
        if not name.startswith("shmcache"):
            continue
        target = _ranked(name)
        if target is None:
            if name not in ("shmcache", "shmcache.__init__"):
                wrong.append(f"line {line}: imports unknown module {name}")
            elif module not in TOP:  # the package root re-exports the torch layer lazily
                wrong.append(f"line {line}: imports the package root")
            continue
        if target == module or module.startswith(target + "."):
            continue  # a package's own modules importing one another: ranked among themselves
        if RANK[target] >= RANK[module]:
            wrong.append(f"line {line}: imports {target} (rank {RANK[target]} >= {RANK[module]})")
    assert not wrong, f"{_path(module)}: " + "; ".join(wrong)


@pytest.mark.parametrize("module", ["config", "errors", "locks", "registry", "segment", "codec",
                                    "allocator", "index", "store", "spill", "spill.files", "spill.format",
                                    "spill.recovery", "process_slot", "_faults"])
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
