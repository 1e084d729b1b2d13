"""Fitness tests for the rooms of the package (issue 29), checked on the source with ``ast``:

- no reach-ins: a module uses another module only through its public names. ``X._name`` where X is
  not ``self``/``cls`` and ``_name`` is not defined in the module itself (at module level, or as a
  member of a class it defines) reaches into someone else's private state; so do
  ``from other import _name`` and importing another package's private module
  (``torch.utils.data._utils``). The underscore then tells a reader what they may change freely.
- no import cycles among shmcache's modules, counting every import: module level, inside a
  function, and under ``if TYPE_CHECKING:`` (test_layers.py checks only the module-level ones).

Both scanners take a package directory, so the last tests plant a reach-in and a cycle in a
temporary package and check that they are reported: these tests can fail.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import shmcache

PKG = Path(shmcache.__file__).resolve().parent

# Underscored names that are public API of the standard library, spelled with an underscore so they
# cannot clash with a namedtuple's fields. A third-party name goes in THIRD_PARTY, for one module.
STDLIB_IDIOMS = {
    "_replace", "_asdict", "_fields", "_make", "_field_defaults",  # collections.namedtuple
    "_exit",  # os._exit: leave a forked child without running the parent's atexit handlers
    "_getframe",  # sys._getframe
}

# A third-party library's underscored names, allowed only in the one module named here (so a second
# module that needs them asks that one), each with its reason. Never a name of shmcache.
THIRD_PARTY: dict[str, dict[str, str]] = {
    "snapshot.location": {
        "_size": "fsspec's AsyncFileSystem names its coroutines with an underscore (its async API)",
        "_call_s3": "s3fs's coroutine for one S3 call, the same API: a ranged GetObject read bounded",
    },
    "base.locks": {
        "_is_owned": "threading.RLock's own test of its owner (threading.Condition's too): a hold that a Ctrl-C "
                     "cut short is undone only where this thread took it",
    },
    "data.wrapped": {
        "_fingerprint": "Hugging Face datasets' Dataset._fingerprint: the digest a table moves when it changes in "
                        "place (set_transform, set_format), read to say so",
    },
    "data.torch_private": {  # NOTE [collated batch]: recognise torch's own fetcher and collate, nothing else
        "torch.utils.data._utils.collate": "default_collate_fn_map: torch documents registering there",
        "_MapDatasetFetcher": "the same fetcher's class",
    },
}

# The reach-ins and import cycles allowed to remain: none. The mechanism stays so that a reach-in
# that cannot be removed at once is listed here, in review, never silent; the test fails on any
# reach-in or cycle not listed and on a listed one that no longer occurs, so the lists only shrink.
KNOWN_REACH_INS: dict[str, dict[str, int]] = {}
KNOWN_CYCLE_EDGES: set[str] = set()


# --- the scanners ---------------------------------------------------------------------------------


def modules(root: Path) -> dict[str, Path]:
    """Dotted module name below ``root`` (a package: its folder's name) -> its file."""
    out = {}
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root).with_suffix("").parts
        if rel[-1] == "__init__":
            rel = rel[:-1]
        if rel and rel[-1] == "__main__":
            continue
        out[".".join(rel)] = f
    return out


def _private(name: str) -> bool:
    return name.startswith("_") and not name.endswith("__")


def _bound(node: ast.stmt):
    """The names a statement of a module or class body binds (descending into if/try/with)."""
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        yield node.name
    elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
        for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
            yield from (n.id for n in ast.walk(target) if isinstance(n, ast.Name))
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        yield from ((a.asname or a.name).split(".")[0] for a in node.names)
    elif isinstance(node, (ast.If, ast.Try, ast.With, ast.For, ast.While)):
        body = [s for s in ast.iter_child_nodes(node) if isinstance(s, ast.stmt)]
        body += [s for h in getattr(node, "handlers", []) for s in h.body]
        for sub in body:
            yield from _bound(sub)


def _own_names(tree: ast.Module) -> set[str]:
    """What a module defines itself: its module-level names, and the members of its classes
    (class-level names and the attributes its methods set on ``self``/``cls``)."""
    own = {name for node in tree.body for name in _bound(node)}
    for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
        own.update(name for node in cls.body for name in _bound(node))
        own.update(n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute)
                   and isinstance(n.ctx, ast.Store) and isinstance(n.value, ast.Name)
                   and n.value.id in ("self", "cls"))
    return own


def _own_extension(path: Path, node: ast.ImportFrom, name: str) -> bool:
    """``from . import _x`` in ``x.py``, with ``_x.c`` beside it: the compiled half of the module
    that wraps it (base/rowcopy.py and _rowcopy.c), which only that wrapper may import. Only if
    nothing else answers to ``_x`` there: a Python module or package of that name, or a name the
    package's ``__init__`` binds (``from . import`` returns that first)."""
    here = path.parent
    if not (node.level == 1 and not node.module and name == f"_{path.stem}" and (here / f"{name}.c").exists()):
        return False
    init = here / "__init__.py"
    bound = init.exists() and name in _own_names(ast.parse(init.read_text(encoding="utf-8")))
    return not ((here / f"{name}.py").exists() or (here / name).exists() or bound)


def reach_ins(path: Path, allowed: frozenset[str] | set[str] = frozenset()) -> list[tuple[int, str, str]]:
    """(line, private name, the code) for each reach-in of one module (``allowed``: names that
    are public where this module uses them: THIRD_PARTY)."""
    allowed = STDLIB_IDIOMS | set(allowed)
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    own = _own_names(tree)
    imported = {(a.asname or a.name).split(".")[0] for n in ast.walk(tree)
                if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _private(node.attr) and node.attr not in allowed:
            holder = node.value.id if isinstance(node.value, ast.Name) else None
            if holder in ("self", "cls"):
                continue
            # an imported name's members are never this module's own, whatever it defines
            if node.attr in own and holder not in imported:
                continue
            found.append((node.lineno, node.attr, ast.unparse(node)))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) > 1 \
                and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            name = node.args[1].value
            if _private(name) and name not in allowed and name not in own:
                found.append((node.lineno, name, ast.unparse(node)))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name, f"import {a.name}") for a in node.names
                      if any(_private(p) for p in a.name.split(".")) and a.name not in allowed]
        elif isinstance(node, ast.ImportFrom):
            source = "." * node.level + (node.module or "")
            if any(_private(p) for p in (node.module or "").split(".")) and node.module not in allowed:
                found.append((node.lineno, node.module, f"from {source} import ..."))
            found += [(node.lineno, a.name, f"from {source} import {a.name}") for a in node.names
                      if _private(a.name) and a.name not in allowed and not _own_extension(path, node, a.name)]
    return sorted(found)


def import_graph(root: Path) -> dict[str, dict[str, int]]:
    """importer -> {imported: first line} among the modules below ``root``, counting every import
    (module level, function-local, under ``if TYPE_CHECKING:``). A module importing its own
    package (``from . import x`` resolving to the package) is not an edge: Python has run the
    package's ``__init__`` before any of its modules."""
    mods = modules(root)

    def resolve(parts: list[str]) -> str | None:
        while parts:
            if ".".join(parts) in mods:
                return ".".join(parts)
            parts = parts[:-1]
        return None

    graph: dict[str, dict[str, int]] = {m: {} for m in mods}
    for m, f in mods.items():
        here = m.split(".") if m else []
        package = here if f.name == "__init__.py" else here[:-1]
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"), str(f))):
            targets: list[str | None] = []
            if isinstance(node, ast.Import):
                targets = [resolve(a.name.split(".")[1:]) for a in node.names
                           if a.name.split(".")[0] == root.name]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package[:len(package) - (node.level - 1)] + \
                        (node.module.split(".") if node.module else [])
                elif (node.module or "").split(".")[0] == root.name:
                    base = node.module.split(".")[1:]
                else:
                    continue
                targets = [resolve(base + [a.name]) for a in node.names]
            for t in targets:
                if t and t != m and not m.startswith(t + "."):
                    graph[m].setdefault(t, node.lineno)
    return graph


def cycle_edges(graph: dict[str, dict[str, int]]) -> dict[str, list[str]]:
    """Every edge "a -> b" that lies on a cycle -> one such cycle (a, b, ..., a)."""
    out = {}
    for a in sorted(graph):
        for b in sorted(graph[a]):
            path = _path_between(graph, b, a)
            if path:
                out[f"{a} -> {b}"] = [a, *path]
    return out


def _path_between(graph: dict[str, dict[str, int]], start: str, goal: str) -> list[str] | None:
    """The shortest import path start -> ... -> goal (breadth first), or None."""
    came: dict[str, str | None] = {start: None}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            if node == goal:
                path = [node]
                while came[path[-1]] is not None:
                    path.append(came[path[-1]])
                return path[::-1]
            for t in sorted(graph.get(node, ())):
                if t not in came:
                    came[t] = node
                    nxt.append(t)
        frontier = nxt
    return None


# --- the package ----------------------------------------------------------------------------------


def reach_in_report(root: Path, known: dict[str, dict[str, int]],
                    third_party: dict[str, dict[str, str]] | None = None) -> list[str]:
    """What is wrong against the known list: each new reach-in (file:line, the name, what to do),
    and each known one that no longer occurs."""
    problems = []
    for module, path in modules(root).items():
        found = reach_ins(path, set((third_party or {}).get(module, {})))
        counts = Counter(name for _, name, _ in found)
        allowed = known.get(module, {})
        for line, name, code in found:
            if counts[name] > allowed.get(name, 0):
                rel = path.relative_to(root.parent)
                problems.append(
                    f"{rel}:{line}: `{code}` reaches into another module's private name {name!r}; "
                    f"give the module that owns it a public name (or method) for this use and "
                    f"call that instead")
        for name, n in allowed.items():
            if counts[name] < n:
                problems.append(
                    f"{module}: KNOWN_REACH_INS lists {n} use(s) of {name!r} but {counts[name]} "
                    f"remain: lower the count (or drop the entry) in tests/unit/test_rooms.py")
    for module in sorted(set(known) - set(modules(root))):
        problems.append(f"KNOWN_REACH_INS names {module!r}, which no longer exists: drop it")
    return problems


def cycle_report(root: Path, known: set[str]) -> list[str]:
    graph = import_graph(root)
    found = cycle_edges(graph)
    problems = []
    for edge, cycle in sorted(found.items()):
        if edge not in known:
            a, b = edge.split(" -> ")
            problems.append(
                f"{modules(root)[a].relative_to(root.parent)}:{graph[a][b]}: importing {b} closes "
                f"the cycle {' -> '.join(cycle)} (function-local and TYPE_CHECKING imports count); "
                f"move what both need into a lower module, or pass it in")
    problems += [f"KNOWN_CYCLE_EDGES lists {edge!r}, which is no longer on a cycle: drop it"
                 for edge in sorted(known - set(found))]
    return problems


def test_no_reach_ins_into_private_names():
    problems = reach_in_report(PKG, KNOWN_REACH_INS, THIRD_PARTY)
    assert not problems, "\n".join(problems)


def test_no_import_cycles():
    problems = cycle_report(PKG, KNOWN_CYCLE_EDGES)
    assert not problems, "\n".join(problems)


def test_third_party_waivers_are_used_and_are_no_name_of_ours():
    """A waiver that is no longer needed goes; one that names a private of a shmcache module the
    waiving module imports would hide a reach-in, so it cannot be one."""
    mods, graph = modules(PKG), import_graph(PKG)
    for module, names in THIRD_PARTY.items():
        used = {name for _, name, _ in reach_ins(mods[module])}
        assert set(names) <= used, f"{module} no longer uses {sorted(set(names) - used)}: drop them from THIRD_PARTY"
        for imported in graph[module]:
            theirs = set(names) & _own_names(ast.parse(mods[imported].read_text(encoding="utf-8")))
            assert not theirs, f"THIRD_PARTY waives {sorted(theirs)} in {module}, names that {imported} defines"


def test_the_known_lists_hold_only_cache_and_data():
    """Outside cache/ and data/ nothing may be waived; inside, only until the store split lands."""
    rooms = {m.split(".")[0] for m in KNOWN_REACH_INS}
    rooms |= {m.split(".")[0] for e in KNOWN_CYCLE_EDGES for m in e.split(" -> ")}
    assert rooms <= {"cache", "data"}, rooms


# --- the scanners can fail ------------------------------------------------------------------------


def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "planted"
    for rel, text in {"__init__.py": "", **files}.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return root


def test_a_planted_reach_in_is_reported(tmp_path):
    root = _plant(tmp_path, {
        "low/__init__.py": "",
        "low/owner.py": "_SECRET = 1\nclass Box:\n    def __init__(self):\n        self._inner = 2\n",
        "high/__init__.py": "",
        "high/user.py": (
            "from collections import namedtuple\n"
            "from ..low import owner\n"
            "from ..low.owner import _SECRET\n"
            "from torch.utils.data._utils import collate\n"
            "P = namedtuple('P', 'a')\n"
            "_SECRET2 = owner._SECRET\n"  # line 6: the owner's name, although this module has one like it
            "def f(box, p):\n"
            "    return box._inner, p._replace(a=1), getattr(box, '_inner')\n"  # line 8
            "class Mine:\n"
            "    def __init__(self):\n"
            "        self._own = 1\n"
            "    def same(self, other):\n"
            "        return other._own\n"  # a member of a class of this module: allowed
        ),
    })
    problems = reach_in_report(root, {})
    text = "\n".join(problems)
    assert "planted/high/user.py:3: `from ..low.owner import _SECRET`" in text
    assert "planted/high/user.py:4: `from torch.utils.data._utils import ...`" in text
    assert "planted/high/user.py:6: `owner._SECRET`" in text
    assert "planted/high/user.py:8: `box._inner`" in text
    assert "planted/high/user.py:8: `getattr(box, '_inner')`" in text
    assert "give the module that owns it a public name" in text
    assert len(problems) == 5, text  # not _replace (a namedtuple's), not other._own (its own class's)
    # a known entry that is gone fails too, so the list only shrinks
    gone = reach_in_report(root, {"high.user": {"_SECRET": 3, "_inner": 2, "torch.utils.data._utils": 1}})
    assert any("lists 3 use(s) of '_SECRET' but 2 remain" in p for p in gone), gone


def test_only_a_compiled_module_beside_its_wrapper_is_exempt(tmp_path):
    """``from . import _x`` in ``x.py`` passes only for the compiled half of ``x`` (``_x.c``): a
    ``_x.c`` beside a Python module ``_x`` (or a package ``_x``, or a name ``_x`` that the
    package's ``__init__`` binds, which the import returns first) would hide that reach-in."""
    root = _plant(tmp_path, {
        "low/__init__.py": "_wrap = object()\n",
        "low/fast.py": "from . import _fast\n",  # the real thing: _fast.c and nothing else
        "low/_fast.c": "/* compiled */\n",
        "low/store.py": "from . import _store\n",
        "low/_store.py": "SECRET = 1\n",
        "low/_store.c": "",
        "low/table.py": "from . import _table\n",
        "low/_table/__init__.py": "",
        "low/_table.c": "",
        "low/wrap.py": "from . import _wrap\n",
        "low/_wrap.c": "",
    })
    text = "\n".join(reach_in_report(root, {}))
    for name in ("store", "table", "wrap"):
        assert f"planted/low/{name}.py:1: `from . import _{name}`" in text, text
    assert "fast.py" not in text, text


def test_a_planted_cycle_is_reported(tmp_path):
    root = _plant(tmp_path, {
        "a.py": "from . import b\n",
        "b.py": "def f():\n    from .c import g\n",  # function-local
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .a import x\n",
        "d.py": "from . import a\n",  # imports into the cycle, but is not on it
    })
    problems = cycle_report(root, set())
    text = "\n".join(problems)
    assert "planted/a.py:1: importing b closes the cycle a -> b -> c -> a" in text, text
    assert "planted/b.py:2: importing c closes the cycle b -> c -> a -> b" in text, text
    assert "planted/c.py:3: importing a closes the cycle c -> a -> b -> c" in text, text
    assert len(problems) == 3 and "d.py" not in text, text
    gone = cycle_report(root, {"a -> b", "b -> c", "c -> a", "d -> a"})
    assert gone == ["KNOWN_CYCLE_EDGES lists 'd -> a', which is no longer on a cycle: drop it"], gone


def test_the_unit_tests_mirror_the_layer_folders():
    """tests/unit/<layer>/ holds the tests of that layer's modules; only cross-cutting checks (the
    layers, the rooms, the docs, the settings) sit at its top."""
    unit = Path(__file__).resolve().parent
    folders = {p.name for p in unit.iterdir() if p.is_dir() and p.name != "__pycache__"}
    layers = {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}
    assert folders <= layers, f"tests/unit/ folders that are no layer of shmcache/: {sorted(folders - layers)}"
