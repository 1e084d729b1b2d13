"""What shmcache takes from torch's private ``torch.utils.data._utils``: the one place that does.

The collated-batch path (NOTE [collated batch]) must know two things torch has no public name for:

* the code of the map-style fetcher's ``fetch`` (``_MapDatasetFetcher.fetch``): a dataset's
  ``__getitems__`` returns a batch already collated only when that frame calls it, with
  default_collate as its collate_fn - any other caller gets plain samples;
* ``default_collate_fn_map``, where default_collate looks up how to collate a type: the marker
  type of a collated batch is registered there (torch's docs show this import for it).

A torch that moves either keeps working - ``FETCH_CODE`` is None and every batch goes item by
item, as for any other caller - but loses the fast path without a word, so
``test_torch_private`` fails loudly when either is not where this module looks.
"""

from __future__ import annotations

import importlib
from types import CodeType
from typing import Any

from torch.utils.data._utils.collate import default_collate_fn_map

__all__ = ["FETCH_CODE", "default_collate_fn_map", "fetcher_class"]


def fetcher_class() -> Any:
    """torch's map-style fetcher class (``torch.utils.data._utils.fetch._MapDatasetFetcher``), or
    None where this torch has none by that name."""
    try:
        module = importlib.import_module("torch.utils.data._utils.fetch")
    except ImportError:
        return None
    return getattr(module, "_MapDatasetFetcher", None)


# the code object __getitems__ compares its caller's frame with (collate.collates_by_default)
FETCH_CODE: CodeType | None = getattr(getattr(fetcher_class(), "fetch", None), "__code__", None)
