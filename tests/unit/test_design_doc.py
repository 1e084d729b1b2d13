"""docs/design.md names only what exists: every module path it gives is a file of the package,
every NOTE it names is a NOTE block in the code, and §5 lists every NOTE block of the code, in
the file that holds it (issue 18: the doc had drifted from the code in ten places)."""

from __future__ import annotations

import re
from pathlib import Path

import shmcache

PKG = Path(shmcache.__file__).resolve().parent
DOC = PKG.parent / "docs" / "design.md"

# a NOTE block opens with its name alone on a line (in a docstring, or a comment of its own)
_BLOCK = re.compile(r"^\s*(?:#\s*)?NOTE \[([^\]]+)\]\s*$", re.M)
_MENTION = re.compile(r"NOTE \[([^\]]+)\]")
# a file of Python in the doc: shmcache/x/y.py, x/y.py (below shmcache/), or a bare y.py
_PATH = re.compile(r"(?<![\w/.])(\w[\w/]*\.py)\b")
_TREES = ("shmcache", "tests", "benchmarks", "examples")
_USERS_FILES = {"warm.py", "prep.py"}  # §7's example: a user's scripts, not ours


def _doc() -> str:
    return DOC.read_text(encoding="utf-8")


def _blocks() -> dict[str, list[str]]:
    """NOTE name -> the files (relative to the repository) that open a block of that name."""
    out: dict[str, list[str]] = {}
    for path in sorted(PKG.rglob("*.py")):
        for name in _BLOCK.findall(path.read_text(encoding="utf-8")):
            out.setdefault(name, []).append(path.relative_to(PKG.parent).as_posix())
    return out


def _section(doc: str, number: int) -> str:
    start = re.search(rf"^## {number}\. .*$", doc, re.M)
    assert start, f"docs/design.md has no section {number}"
    end = re.search(r"^## \d+\. ", doc[start.end():], re.M)
    return doc[start.end():start.end() + end.start()] if end else doc[start.end():]


def _note_table(doc: str) -> dict[str, str]:
    """§5's table: NOTE name -> the path its `where` column gives."""
    rows = re.findall(r"^\| \[([^\]]+)\] \| `([^`]+)` \|", _section(doc, 5), re.M)
    return dict(rows)


def _exists(path: str) -> bool:
    """A path with a folder is below the repository or below shmcache/; a bare name is the name of
    some file of the repository's Python trees."""
    root = PKG.parent
    if "/" in path:
        return (root / path).is_file() or (PKG / path).is_file()
    return any(next((root / tree).rglob(path), None) is not None for tree in _TREES)


def test_every_module_path_in_the_doc_exists():
    paths = set(_PATH.findall(_doc()))
    assert len(paths) > 10, "the doc names few module paths: the pattern above is out of date"
    missing = sorted(p for p in paths - _USERS_FILES if not _exists(p))
    assert not missing, f"docs/design.md names files that do not exist: {missing}"


def test_every_note_named_in_the_doc_is_a_block_in_the_code():
    blocks = _blocks()
    named = {" ".join(name.split()) for name in _MENTION.findall(_doc())}  # a name may wrap a line
    unknown = sorted(named - set(blocks))
    assert not unknown, f"docs/design.md names NOTE blocks the code does not have: {unknown}"


def test_each_note_block_is_opened_once():
    twice = {name: files for name, files in _blocks().items() if len(files) > 1}
    assert not twice, f"NOTE blocks opened in more than one place: {twice}"


def test_section_5_lists_every_note_block_where_it_is():
    blocks = {name: files[0] for name, files in _blocks().items()}
    table = _note_table(_doc())
    assert sorted(table) == sorted(blocks), (
        f"§5 lacks {sorted(set(blocks) - set(table))}; lists what the code lacks: "
        f"{sorted(set(table) - set(blocks))}")
    wrong = {name: (where, blocks[name]) for name, where in table.items() if where != blocks[name]}
    assert not wrong, f"§5 puts these NOTE blocks in the wrong file (doc, code): {wrong}"
    count = re.search(r"(\d+)\s+NOTE blocks", _section(_doc(), 5))
    assert count and int(count.group(1)) == len(blocks), f"§5 should say {len(blocks)} NOTE blocks"


def test_section_2_has_one_line_per_module():
    """The layer diagram of §2 names every module of the package, each under its own folder."""
    section = _section(_doc(), 2)
    named = {p for p in _PATH.findall(section) if p.startswith("shmcache/")}
    modules = {p.relative_to(PKG.parent).as_posix() for p in PKG.rglob("*.py")
               if p.name != "__init__.py" or p.parent == PKG}
    modules -= {"shmcache/__init__.py"}
    missing = sorted(modules - named)
    assert not missing, f"§2 does not name these modules: {missing}"
