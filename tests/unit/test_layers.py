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

# The layers of docs/design.md §2, bottom to top; the folders below shmcache/ are these layers. A
# module may import any module of a lower layer, and modules of its own layer only without a cycle.
LAYERS = {
    "base": 0,      # OS primitives: names, private dirs, memory limits, shm objects, locks, fences, MACs
    "cache": 1,     # the store and its parts: registry, slots, allocator, index, generations, codec
    "tiers": 2,     # what lies behind shared memory: spill files, Redis, and the seam that reads them
    "snapshot": 3,  # a cache to portable files and back, and the read-through tier over them
    "data": 4,      # the torch layer: wrapped datasets, tensors and images, sampler, prefetch, sink
    "launch": 5,    # entry points: the launcher (torchrun-compatible) ...
    "cli": 6,       # ... and the command line (it removes the launcher's stale directories)
}
ROOT_MODULES = {"errors": 0}  # the public error taxonomy lives at the root, below everything
TOP = {"data", "launch", "cli"}  # may import the package root (which re-exports the torch layer lazily)
TORCH_LAYER = "data"
NO_TORCH_IN_TORCH_LAYER = ["data.images"]  # PIL images as a codec type: no torch needed


def layer_of(module: str) -> str:
    head = module.split(".")[0]
    return head if head in LAYERS else module


def rank(module: str) -> int:
    head = layer_of(module)
    if head in LAYERS:
        return LAYERS[head]
    return ROOT_MODULES[head]


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


def _imports(module: str, source: str | None = None, top_level: bool = False) -> list[tuple[str, int]]:
    """Every module this one imports, anywhere in the file (or only at module level):
    (absolute dotted name, line)."""
    tree = ast.parse(_path(module).read_text() if source is None else source, str(_path(module)))
    out = []
    for node in (tree.body if top_level else ast.walk(tree)):
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


def _module_of(name: str) -> str | None:
    """The shmcache module an absolute import names (its longest existing prefix; None: the root)."""
    parts = name.split(".")[1:]
    while parts:
        if _path(".".join(parts)).exists():
            return ".".join(parts)
        parts.pop()
    return None


def _all_modules() -> set[str]:
    found = set()
    for f in PKG.rglob("*.py"):
        rel = f.relative_to(PKG).with_suffix("").parts
        if rel[-1] == "__main__" or rel == ("__init__",):
            continue
        found.add(".".join(rel[:-1] if rel[-1] == "__init__" else rel))
    return found


MODULES = sorted(_all_modules())


def _violations(module: str, source: str | None = None) -> list[str]:
    """What in a module imports upward: a higher layer, or the package root below the top."""
    wrong = []
    for name, line in _imports(module, source):
        if not name.startswith("shmcache"):
            continue
        target = _module_of(name)
        if target is None:
            if layer_of(module) not in TOP:
                wrong.append(f"line {line}: imports the package root")
        elif rank(target) > rank(module):
            wrong.append(f"line {line}: imports {target} (layer {layer_of(target)!r} is above "
                         f"{layer_of(module)!r})")
    return wrong


def test_the_folders_are_the_layers():
    folders = {p.name for p in PKG.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    assert folders == set(LAYERS), f"folders {sorted(folders)} != layers {sorted(LAYERS)}"
    loose = {p.stem for p in PKG.glob("*.py")} - {"__init__", "__main__"}
    assert loose == set(ROOT_MODULES), f"modules outside the layers' folders: {sorted(loose - set(ROOT_MODULES))}"


@pytest.mark.parametrize("module", MODULES)
def test_imports_point_down_only(module):
    wrong = _violations(module)
    assert not wrong, f"{_path(module)}: " + "; ".join(wrong)


def test_an_upward_import_is_caught():
    """The check can fail: the snapshot tier importing the torch layer's image type is refused."""
    source = _path("snapshot.tier").read_text() + "\nfrom ..data import images\n"
    assert any("layer 'data' is above 'snapshot'" in w for w in _violations("snapshot.tier", source))
    source = _path("cache.store").read_text() + "\ndef f():\n    from ..tiers.spill import tier\n"
    assert any("'tiers' is above 'cache'" in w for w in _violations("cache.store", source))


def _layer_graph(layer: str) -> dict[str, set[str]]:
    """Module-level imports among one layer's modules (lazy ones inside functions break cycles)."""
    members = [m for m in MODULES if layer_of(m) == layer]
    graph = {}
    for m in members:
        targets = {_module_of(n) for n, _ in _imports(m, top_level=True) if n.startswith("shmcache.")}
        graph[m] = {t for t in targets if t in members and t != m and not m.startswith(t + ".")}
    return graph


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_no_cycle_within_a_layer(layer):
    graph, state, cycle = _layer_graph(layer), {}, []

    def visit(m, path):
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycle.append(" -> ".join([*path, m, t][path.index(t) if t in path else 0:]))
            elif t not in state:
                visit(t, [*path, m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycle, f"import cycles in {layer}/: {cycle}"


NO_TORCH = [m for m in MODULES if layer_of(m) != TORCH_LAYER] + NO_TORCH_IN_TORCH_LAYER


@pytest.mark.parametrize("module", NO_TORCH)
def test_low_layers_never_import_torch(module):
    bad = [(m, line) for m, line in _imports(module) if m == "torch" or m.startswith("torch.")]
    assert not bad, f"{_path(module)} imports torch at lines {[line for _, line in bad]}"


def test_no_torch_at_run_time():
    mods = ", ".join(f"shmcache.{m}" for m in NO_TORCH)
    code = (f"import sys, {mods}\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch')[:5])")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "[]"


def test_import_shmcache_is_lazy():
    code = ("import sys, shmcache\n"
            "assert 'torch' not in sys.modules, 'import shmcache imported torch'\n"
            "assert 'shmcache.data.dataset' not in sys.modules\n"
            "shmcache.ShmDatasetCache\n"
            "assert 'torch' in sys.modules\n"
            "print('ok')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]
