"""The prose of the code and docs points at symbols and stays inside the repository (issue 29).

- Comments, docstrings and strings in shmcache/ name symbols (``CacheStore.put_records``, NOTE
  [publish order], ``codec.RECORD_HEADER``), never a file path: paths go stale when a module
  moves or is renamed, symbols are found by grep and by tools.
- README, CHANGELOG and docs/ link only to files of this repository.
- Each room's ``__init__.py`` says what lives there and what it may import, as
  tests/unit/test_layers.py ranks the rooms.
"""

from __future__ import annotations

import ast
import io
import re
import tokenize
from collections import Counter
from pathlib import Path

from test_layers import LAYERS, ROOT_MODULES, TOP

import shmcache

PKG = Path(shmcache.__file__).resolve().parent
ROOT = PKG.parent

# a file of Python: x.py, cache/x.py, ../x.py, shmcache/cache/x.py
_PY_PATH = re.compile(r"(?<![\w.])(?:\.\.?/)*(?:[\w-]+/)*[\w-]+\.py\b")

# What may stay a path, and why.
ALLOWED = {
    "train.py": "a user's script in the launcher's manual and messages",
    "script.py": "a user's script in the launcher's usage line",
}
ALLOWED_PREFIXES = {
    "benchmarks/": "a script the reader runs to measure what the comment claims",
}
ALLOWED_IN = {
    # a message that tells the user which file to edit on an unknown architecture
    ("shmcache/base/ordering.py", "shmcache/base/ordering.py"): 1,
}


def python_paths(source: str) -> list[tuple[int, str]]:
    """(line, path) of every file of Python named in a comment, docstring or string of ``source``."""
    found = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type not in (tokenize.COMMENT, tokenize.STRING) and tok.type != getattr(
                tokenize, "FSTRING_MIDDLE", -1):
            continue
        for m in _PY_PATH.finditer(tok.string):
            found.append((tok.start[0] + tok.string.count("\n", 0, m.start()), m.group(0)))
    return found


def _stray_paths(rel: str, source: str) -> list[str]:
    allowed = Counter({path: n for (where, path), n in ALLOWED_IN.items() if where == rel})
    wrong = []
    for line, path in python_paths(source):
        if path in ALLOWED or any(path.startswith(p) for p in ALLOWED_PREFIXES):
            continue
        if allowed[path] > 0:
            allowed[path] -= 1
            continue
        wrong.append(f"{rel}:{line}: {path}")
    return wrong


def test_comments_docstrings_and_messages_name_symbols_not_files():
    wrong = []
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        wrong += _stray_paths(rel, path.read_text(encoding="utf-8"))
    assert not wrong, (
        "comments, docstrings and messages in shmcache/ name a file; name the symbol instead "
        "(`NOTE [publish order]`, `CacheStore.put_records`, `codec.RECORD_HEADER`, the module as "
        "`tiers.records`), since files move and symbols are what grep finds:\n  " + "\n  ".join(wrong))


def test_the_path_check_can_fail():
    source = ('"""Published as NOTE [publish order] in store.py says."""\n'
              "x = 1  # see cache/chunk.py and ../records.py\n"
              "y = f'run shmcache/base/ordering.py'\n")
    assert _stray_paths("shmcache/x.py", source) == [
        "shmcache/x.py:1: store.py", "shmcache/x.py:2: cache/chunk.py", "shmcache/x.py:2: ../records.py",
        "shmcache/x.py:3: shmcache/base/ordering.py"]
    assert _stray_paths("shmcache/x.py", "z = 2  # python benchmarks/bench_cache.py; train.py\n") == []


# --- the repository stands alone -------------------------------------------------------------------

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _docs() -> list[Path]:
    return [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "benchmarks").rglob("*.md"))]


def _outside_links(doc: Path, text: str) -> list[str]:
    """What in a doc leaves the repository: ``../`` anywhere, or a relative link to no file of it."""
    wrong = [f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}: {m.group(0)!r}"
             for m in re.finditer(r"\.\./\S*", text)]
    for m in _LINK.finditer(text):
        target = m.group(1).split("#", 1)[0]
        if not target or re.match(r"[a-z][a-z0-9+.-]*:", target):  # an anchor, or a URL
            continue
        resolved = (doc.parent / target).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            wrong.append(f"{doc.name}:{text.count(chr(10), 0, m.start()) + 1}: link to {target}")
    return wrong


def test_docs_link_only_inside_the_repository():
    wrong = []
    for doc in _docs():
        if doc.exists():
            wrong += _outside_links(doc, doc.read_text(encoding="utf-8"))
    assert not wrong, (
        "the repository stands alone: link to a file of it (docs/design.md, a NOTE by name, a test "
        "file), and move what another repository's page says into this one:\n  " + "\n  ".join(wrong))


def test_the_link_check_can_fail():
    doc = ROOT / "docs" / "design.md"
    text = "see [the brief](../shared/DESIGN.md), [gone](missing.md), [ok](design.md), [web](https://x.org)\n"
    assert _outside_links(doc, text) == [
        "design.md:1: '../shared/DESIGN.md),'", "design.md:1: link to ../shared/DESIGN.md",
        "design.md:1: link to missing.md"]


# --- every room has a sign -------------------------------------------------------------------------

def _rank(room: str) -> int:
    return LAYERS[room.split(".")[0]]


def may_import(room: str) -> set[str]:
    """The rooms (and the root's modules) that a room may import from, by tests/unit/test_layers.py."""
    lower = {r for r in LAYERS if LAYERS[r] < _rank(room)} | {m for m, r in ROOT_MODULES.items()
                                                              if r < _rank(room) or r == 0}
    return lower | ({"the package root"} if room.split(".")[0] in TOP else set())


def _named(docstring: str) -> set[str]:
    """The rooms a docstring's "May import:" paragraph names."""
    m = re.search(r"^May import:(.*?)(?:\n\n|\Z)", docstring, re.M | re.S)
    if not m:
        return set()
    text = " ".join(m.group(1).split(";", 1)[0].split())
    return set(re.findall(r"``(\w+)``", text)) | ({"the package root"} if "package root" in text else set())


def _rooms() -> dict[str, Path]:
    return {init.parent.relative_to(PKG).as_posix().replace("/", "."): init
            for init in sorted(PKG.rglob("__init__.py")) if init.parent != PKG}


def test_each_room_says_what_lives_there_and_what_it_may_import():
    problems = []
    for room, init in _rooms().items():
        doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
        if not doc:
            problems.append(f"{room}: no docstring (say what lives in the room, what it may import, "
                            "and where to start reading)")
            continue
        expected = may_import(room)
        named = _named(doc) - {room.split(".")[0]}  # a sub-room may name its own room's modules
        if named != expected:
            problems.append(f"{room}: 'May import:' names {sorted(named)}; test_layers allows "
                            f"{sorted(expected)}")
        if "Start reading" not in doc:
            problems.append(f"{room}: no 'Start reading at ...' line")
    assert ast.get_docstring(ast.parse((PKG / "__init__.py").read_text(encoding="utf-8")))
    assert not problems, "\n".join(problems)


def test_the_room_check_reads_the_layer_order():
    assert may_import("base") == {"errors"}
    assert may_import("cache") == {"base", "errors"}
    assert may_import("tiers.spill") == {"cache", "base", "errors"}
    assert may_import("cli") == set(LAYERS) - {"cli"} | {"errors", "the package root"}
    assert _named("May import: ``cache``, ``base``; and modules of this room.\n") == {"cache", "base"}
