"""MosaicML Streaming: MDS shards written with ``MDSWriter``, read with ``StreamingDataset(local=...)``.

The shards live in a local folder under ``/tmp`` (disk, page cache warm), uncompressed, images as a
fixed-shape ``ndarray:uint8:H,W,C`` column (its fastest encoding) and labels as ``int``. Readers are
one Streaming "node" of P ranks: each process gets RANK / WORLD_SIZE / LOCAL_RANK /
LOCAL_WORLD_SIZE, so the ranks coordinate through Streaming's own shared memory; with P > 1,
``StreamingDataset.__init__`` also briefly starts a gloo process group, pinned to 127.0.0.1 (loopback).
Two read paths:

- ``getitem``: random access ``ds[i]`` over the reader's shard, item by item;
- ``iter``: Streaming's own iteration (``shuffle=True``, its partition of the epoch for this rank)
  collated into batches of 256 with ``default_collate``, as ``StreamingDataLoader`` would.

Install: ``pip install mosaicml-streaming -c constraints.txt`` with ``torch==2.13.0`` in the
constraints, so torch stays the CPU build.
"""

from __future__ import annotations

import importlib.machinery
import os
import shutil
import sys
import tempfile
import time
import types
import warnings

import numpy as np

from . import _runner
from ._base import Memory, Peer, ReadPath

__all__ = ["Streaming", "open_reader", "import_streaming"]


def _stub_torchvision(reason: str) -> None:
    """Stand in for a torchvision that cannot load, with just what ``import streaming`` touches.

    ``streaming/__init__`` imports its ``vision`` subpackage, which imports torchvision at module
    level. The only torchvision wheel reachable here for torch 2.13.0 is built against CUDA torch
    (``0.28.0+cu130``) and fails to load against ``torch 2.13.0+cpu``. MDS reading never touches
    torchvision, so two names are enough; anything that does use them raises.
    """
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]

    def module(name: str) -> types.ModuleType:
        m = types.ModuleType(name)
        m.__spec__ = importlib.machinery.ModuleSpec(name, None)
        return m

    tv, datasets, transforms, functional = (module(n) for n in (
        "torchvision", "torchvision.datasets", "torchvision.transforms", "torchvision.transforms.functional"))

    class VisionDataset:  # noqa: D401 - placeholder
        def __init__(self, *args, **kwargs):
            raise RuntimeError(f"torchvision is stubbed by the benchmark: {reason}")

    def to_tensor(*args, **kwargs):
        raise RuntimeError(f"torchvision is stubbed by the benchmark: {reason}")

    datasets.VisionDataset, functional.to_tensor = VisionDataset, to_tensor
    tv.datasets, tv.transforms, transforms.functional = datasets, transforms, functional
    tv.__version__ = "stub"
    sys.modules.update({m.__name__: m for m in (tv, datasets, transforms, functional)})


_TORCHVISION_NOTE = ""


def import_streaming():
    """``import streaming``, stubbing torchvision first if the installed one cannot load."""
    global _TORCHVISION_NOTE
    if "streaming" in sys.modules:
        return sys.modules["streaming"]
    try:
        import torchvision  # noqa: F401
    except ModuleNotFoundError:
        pass  # streaming will say so itself
    except Exception as e:  # noqa: BLE001 - a broken binary wheel raises anything
        _TORCHVISION_NOTE = f"torchvision stubbed ({type(e).__name__}: {str(e)[:60]})"
        _stub_torchvision(_TORCHVISION_NOTE)
    import streaming

    return streaming


class Streaming(Peer):
    name = "MosaicML Streaming"
    module = __name__
    paths = (ReadPath("getitem", "ds[i] per item", False),
             ReadPath("iter", "iteration (shuffle) + collate ×256", True))

    def __init__(self) -> None:
        self.local: str | None = None

    def skip_reason(self) -> str | None:
        try:
            import_streaming()
        except Exception as e:  # noqa: BLE001 - any import failure is a reason to skip
            return f"import streaming failed: {type(e).__name__}: {str(e)[:120]}"
        return None

    def version(self) -> str:
        from _common import package_version

        note = f" ({_TORCHVISION_NOTE})" if _TORCHVISION_NOTE else ""
        return f"mosaicml-streaming {package_version('mosaicml-streaming')}{note}"

    def fill(self, workload) -> None:
        from streaming import MDSWriter

        self.local = tempfile.mkdtemp(prefix="shmcache-compare-streaming-")
        columns = {"x": "ndarray:uint8:" + ",".join(map(str, workload.shape)), "y": "int"}
        src = workload.source()
        with MDSWriter(out=self.local, columns=columns, compression=None) as out:
            for i in range(workload.n_items):
                image, label = src[i]
                out.write({"x": image, "y": label})

    def spec(self) -> dict:
        return {"local": self.local}

    def memory(self) -> Memory:
        from _common import allocated_bytes

        return Memory(allocated_bytes(self.local), "disk", "MDS shards")

    def after_run(self) -> None:
        """Streaming leaves shared memory behind when a process exits; clean it between runs."""
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()

    def close(self) -> None:
        if self.local:
            self.after_run()
            shutil.rmtree(self.local, ignore_errors=True)
            self.local = None


def _set_world(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      GLOO_SOCKET_IFNAME="lo")


class _Reader:
    def __init__(self, spec: dict, path: str, rank: int, world: int, port: int):
        _set_world(rank, world, port)
        streaming = import_streaming()
        self.path = path
        self.ds = streaming.StreamingDataset(local=spec["local"], remote=None, batch_size=_runner.CHUNK,
                                             shuffle=(path == "iter"), shuffle_seed=1234)
        self.items_in_last_epoch: int | None = None
        self.repeatable = path == "getitem"  # iter(ds) syncs all ranks: exactly one pass each

    def epoch(self, indices: np.ndarray) -> list[float]:
        if self.path == "getitem":
            return _runner.timed_chunks(self._getitem, indices)
        return self._iterate()

    def _getitem(self, indices: np.ndarray) -> None:
        for i in indices:
            self.ds[int(i)]

    def _iterate(self) -> list[float]:
        """One of Streaming's own epochs for this rank (its partition, not ``indices``), collated ×256.

        Every rank starts ``iter(ds)`` together (Streaming syncs the node's ranks there), right after
        the runner's barrier; the item count is what Streaming handed out (its partition may pad).
        """
        from torch.utils.data import default_collate

        # Streaming hands out read-only arrays over its shard buffers; collate copies them anyway
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        out, batch, self.items_in_last_epoch = [], [], 0
        t = time.perf_counter()
        for s in self.ds:
            batch.append((s["x"], s["y"]))
            if len(batch) == _runner.CHUNK:
                default_collate(batch)
                self.items_in_last_epoch += len(batch)
                batch, now = [], time.perf_counter()
                out.append(now - t)
                t = now
        if batch:
            default_collate(batch)
            self.items_in_last_epoch += len(batch)
            out.append(time.perf_counter() - t)
        return out

    def sample(self, i: int):
        return self.ds[i]

    def close(self) -> None:
        pass


def open_reader(spec: dict, path: str, rank: int, world: int, port: int) -> _Reader:
    return _Reader(spec, path, rank, world, port)
