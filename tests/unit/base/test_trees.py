"""base/trees.py: the one flatten and rebuild of nested containers (the prefetch ring's and the
sink's batches, a gathered batch from ``codec.leaves``' spec, ``out=`` trees)."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import default_collate

import shmcache.data.dataset  # noqa: F401  (registers torch tensors with the codec)
from shmcache.base import trees
from shmcache.cache import codec

Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize("value", [
    1, [1, 2], (1, [2, 3]), {"x": 1, "y": (2, 3)}, OrderedDict(b=1, a=2), Pair(1, [2]),
    {"deep": [{"k": (1,)}, Pair(a={"z": 2}, b=3)]}, [], {},
])
def test_flatten_then_rebuild_gives_the_same_containers(value):
    leaves: list = []
    spec = trees.flatten(value, leaves)
    got = trees.rebuild(spec, iter(leaves))
    assert got == value and type(got) is type(value)


def test_leaves_are_depth_first_in_order():
    leaves: list = []
    trees.flatten({"b": [1, 2], "a": (3, {"c": 4})}, leaves)
    assert leaves == [1, 2, 3, 4]


@pytest.mark.parametrize("sample", [
    (np.arange(3, dtype=np.float32), 5), [np.zeros(2), 1.5, True],
    {"img": np.ones((2, 2), np.uint8), "meta": (7, np.float64(2.5))},
    (torch.arange(4), {"label": 3}), ((1, 2), [3, (4, 5)]),
])
def test_the_codec_spec_rebuilds_what_default_collate_makes(sample):
    """A gathered batch (columns of the record's leaves) rebuilt with collated=True has
    default_collate's containers: lists for tuples and lists, dicts for dicts."""
    spec, leaves = codec.leaves(codec.encode(sample).layout)
    flat: list = []
    trees.flatten(sample, flat)
    assert len(flat) == len(leaves)
    collated = default_collate([sample, sample])
    columns: list = []
    trees.flatten(collated, columns)
    rebuilt = trees.rebuild(spec, iter(columns), collated=True)

    def same(a, b):
        assert type(a) is type(b)
        if isinstance(a, dict):
            assert list(a) == list(b) and all(same(a[k], b[k]) for k in a)
        elif isinstance(a, (list, tuple)):
            assert len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        else:
            assert a is b
        return True

    assert same(rebuilt, collated)


def test_a_list_leaf_inside_a_sequence_is_a_tuple_when_collated():
    """default_collate transposes a sequence with zip: a str field's column there is a tuple."""
    spec, _ = codec.leaves(codec.encode((np.zeros(2), "ab")).layout)
    got = trees.rebuild(spec, iter(["col", ["ab", "ab"]]), collated=True)
    assert got == ["col", ("ab", "ab")]
    spec, _ = codec.leaves(codec.encode({"s": "ab"}).layout)
    assert trees.rebuild(spec, iter([["ab", "ab"]]), collated=True) == {"s": ["ab", "ab"]}


def _unlike(path, value, has):
    return ValueError(f"{path} is {type(value).__name__} where the batch has {has}")


def test_flatten_like_matches_a_dict_by_key_and_names_the_place_it_differs():
    spec, _ = codec.leaves(codec.encode({"a": 1, "b": (2, 3)}).layout)
    assert trees.flatten_like({"b": ["x", "y"], "a": "z"}, spec, _unlike) == ["z", "x", "y"]
    with pytest.raises(ValueError, match=r"out\['b'\] is list where the batch has a sequence of 2 fields"):
        trees.flatten_like({"a": 1, "b": [1]}, spec, _unlike)
    with pytest.raises(ValueError, match=r"out is list where the batch has a dict with keys \['a', 'b'\]"):
        trees.flatten_like([1, 2], spec, _unlike)


def test_flatten_like_names_a_place_deep_inside_and_a_dict_with_other_keys():
    spec, _ = codec.leaves(codec.encode(({"img": 1, "lab": (2, 3)}, 4)).layout)
    assert trees.flatten_like(({"lab": [7, 8], "img": 6}, 9), spec, _unlike) == [6, 7, 8, 9]
    with pytest.raises(ValueError, match=r"^out\[0\]\['lab'\] is tuple where the batch has a sequence of 2"):
        trees.flatten_like(({"lab": (7,), "img": 6}, 9), spec, _unlike)
    with pytest.raises(ValueError, match=r"^out\[0\] is dict where the batch has a dict with keys \['img', 'lab'\]"):
        trees.flatten_like(({"lab": (7, 8), "image": 6}, 9), spec, _unlike)
