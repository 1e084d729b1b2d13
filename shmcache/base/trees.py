"""Nested containers as a *spec* and a flat list of leaves: the one flatten and rebuild of shmcache.

A spec is ``LEAF`` (None) or ``(kind, aux, children)``: ``"map"`` (aux: the mapping's type and its
keys, children in that order), ``"namedtuple"`` (aux: its type), ``"list"`` or ``"tuple"`` (aux:
None). Leaves are listed depth first, children in order.

Who makes specs: :func:`flatten` of a value (the prefetch ring and the sink swap a batch's leaves
for slot views and rebuild it), and ``codec.leaves`` of a record's layout (the structure of a
gathered batch, whose leaves are columns). Who reads them: :func:`rebuild` (a batch from its
leaves; as ``default_collate`` shapes it with ``collated=True``) and :func:`flatten_like` (the
leaves of an ``out=`` tree, matched to a batch's spec by key, never by position).

No torch and no numpy here: the codec (cache layer) uses this module too.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

__all__ = ["LEAF", "flatten", "rebuild", "flatten_like"]

LEAF = None  # the spec of a leaf


def flatten(tree: Any, leaves: list[Any]) -> Any:
    """Append ``tree``'s leaves to ``leaves`` (depth first) and return the spec to rebuild it: a
    mapping, a namedtuple, a list or a tuple is a container, anything else a leaf."""
    if isinstance(tree, Mapping):
        keys = tuple(tree.keys())
        return ("map", (type(tree), keys), tuple(flatten(tree[k], leaves) for k in keys))
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return ("namedtuple", type(tree), tuple(flatten(v, leaves) for v in tree))
    if isinstance(tree, (list, tuple)):
        kind = "list" if isinstance(tree, list) else "tuple"
        return (kind, None, tuple(flatten(v, leaves) for v in tree))
    leaves.append(tree)
    return LEAF


def rebuild(spec: Any, leaves: Iterator[Any], collated: bool = False) -> Any:
    """Inverse of :func:`flatten`: the same containers, filled from ``leaves`` in order.

    ``collated``: the batch of such samples as torch's ``default_collate`` shapes it (NOTE
    [collated batch]): every sequence a list (a namedtuple its own
    type), every mapping a dict, and
    a leaf that is a list (a column of str or bytes) a tuple inside a sequence (default_collate
    transposes a sequence with zip)."""
    if collated:
        return _collated(spec, leaves, False)
    if spec is LEAF:
        return next(leaves)
    kind, aux, children = spec
    values = [rebuild(child, leaves) for child in children]
    if kind == "map":
        mapping_type, keys = aux
        try:  # keep OrderedDict & co; fall back to dict for mappings that can't be built from pairs
            return mapping_type(zip(keys, values, strict=True))
        except TypeError:
            return dict(zip(keys, values, strict=True))
    if kind == "namedtuple":
        return aux(*values)
    return values if kind == "list" else tuple(values)


def _collated(spec: Any, leaves: Iterator[Any], in_sequence: bool) -> Any:
    if spec is LEAF:
        leaf = next(leaves)
        return tuple(leaf) if in_sequence and isinstance(leaf, list) else leaf
    if spec[0] == "map":  # (indexing, not unpacking: once per batch on the DataLoader's path)
        return {k: _collated(c, leaves, False) for k, c in zip(spec[1][1], spec[2])}
    if spec[0] == "namedtuple":  # default_collate keeps a namedtuple's type
        return spec[1](*[_collated(c, leaves, True) for c in spec[2]])
    return [_collated(c, leaves, True) for c in spec[2]]


def flatten_like(tree: Any, spec: Any, unlike: Callable[[str, Any, str], Exception],
                 path: str = "out") -> list[Any]:
    """The leaves of ``tree`` in the order of ``spec`` (a dict matched by key, a sequence by
    position; a leaf of the spec takes whatever ``tree`` holds there). Where ``tree`` is shaped
    otherwise, raises ``unlike(path, what tree holds there, what the spec has there)``."""
    if spec is LEAF:
        return [tree]
    leaves: list = []
    _flatten_into(tree, spec, unlike, path, (), leaves)
    return leaves


def _flatten_into(tree: Any, spec: tuple, unlike: Callable, path: str, at: tuple, leaves: list) -> None:
    """flatten_like's walk: ``at`` is the way down from ``path`` (keys and positions), spelt out
    only in an error (a batch's ``out=`` is flattened on every call)."""
    kind, aux, children = spec
    if kind == "map":
        keys = aux[1]
        if not isinstance(tree, dict) or len(tree) != len(keys) or any(k not in tree for k in keys):
            raise unlike(_spelt(path, at), tree, f"a dict with keys {list(keys)}")
        pairs = ((k, tree[k], c) for k, c in zip(keys, children))
    elif not isinstance(tree, (tuple, list)) or len(tree) != len(children):
        raise unlike(_spelt(path, at), tree, f"a sequence of {len(children)} fields")
    else:
        pairs = zip(range(len(children)), tree, children)
    for k, t, c in pairs:
        if c is LEAF:
            leaves.append(t)
        else:
            _flatten_into(t, c, unlike, path, (*at, k), leaves)


def _spelt(path: str, at: tuple) -> str:
    """``path`` and the way down ``at``: ``out[0]['img']``."""
    return path + "".join(f"[{k!r}]" for k in at)
