"""Reader processes: P real processes that open a system, meet at a barrier, and read warm epochs.

NOTE [reader protocol]
    The parent starts P processes from a forkserver (a clean process with torch and numpy imported,
    so a reader inherits none of the parent's data: it attaches to the system the way a separate
    training process would). Each process opens its reader (attach, connect, map) and checks that a
    few items read through the system equal the source's (``sample(i)``: no figure measures wrong
    data), all *before* the first barrier, so none of it is timed. Then, for each repeat r: every
    process waits at the barrier, reads its shard of a fresh random permutation of all items
    (``perm_r[rank::P]``: the DistributedSampler pattern, so the total work per epoch is the same for
    every P), and reports (t0, t1, items, chunk latencies). A pass shorter than MIN_WINDOW_S is
    repeated over the same shard until the window is that long (every pass counts), so the skew of
    waking P processes from the barrier (milliseconds on a busy machine) stays small against the
    window; a reader whose passes must stay in step with other ranks (``repeatable = False``) reads
    exactly one. perf_counter is CLOCK_MONOTONIC, one clock for all processes of the machine, so the
    epoch wall time is max(t1) - min(t0). A failing reader aborts the barrier (the others stop at
    once) and sends its traceback with its rank; the parent raises it, and always terminates and
    reaps every child it started.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue as queue_mod
import time
import traceback
from dataclasses import dataclass, field

import numpy as np

__all__ = ["CHUNK", "EpochResult", "ReaderError", "run_readers", "timed_chunks", "context"]

CHUNK = 256  # items per batch, and per latency sample for item-by-item paths
BARRIER_TIMEOUT_S = 300.0
MIN_WINDOW_S = 0.25
_CTX = None


class ReaderError(RuntimeError):
    """A reader process failed; the message names its rank and carries its traceback."""


@dataclass
class EpochResult:
    repeat: int
    rank: int
    t0: float
    t1: float
    items: int
    chunk_s: list[float] = field(default_factory=list)


def context():
    """The forkserver context, created once; readers start from it with torch already imported."""
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["numpy", "torch", "peers._runner"])
    return _CTX


def timed_chunks(read_chunk, indices: np.ndarray, size: int = CHUNK) -> list[float]:
    """Call ``read_chunk(chunk)`` for consecutive chunks of ``indices``; seconds per CHUNK items each.

    A short last chunk (or a shard smaller than CHUNK) is scaled to CHUNK items, so the p90 is always
    "seconds per 256 items".
    """
    out = []
    for start in range(0, len(indices), size):
        chunk = indices[start : start + size]
        t = time.perf_counter()
        read_chunk(chunk)
        out.append((time.perf_counter() - t) * CHUNK / len(chunk))
    return out


def permutation(n_items: int, seed: int, repeat: int) -> np.ndarray:
    return np.random.default_rng((seed, 1_000_003, repeat)).permutation(n_items)


def _as_sample(value) -> tuple[np.ndarray, int]:
    """(image, label) from a sample, a one-item batch, or a dict with x/y, for the correctness check."""
    if isinstance(value, dict):
        value = (value["x"], value["y"])
    image, label = (np.asarray(v) for v in value[:2])
    if image.ndim == 4:  # a collated batch of one
        image = image[0]
    return image, int(label.reshape(-1)[0])


def _verify(reader, workload, rank: int) -> None:
    """Before anything is timed: a few items read through the system equal the source's."""
    sample = getattr(reader, "sample", None)
    if sample is None:
        return
    source = workload.source()
    for i in sorted({0, rank, workload.n_items // 2, workload.n_items - 1}):
        want, got = source[i], _as_sample(sample(i))
        if got[1] != want[1] or not np.array_equal(got[0], want[0]):
            raise AssertionError(f"item {i} read back differs from the source (label {got[1]} vs {want[1]})")


def _reader_main(module, spec, path, rank, world, port, workload, repeats, seed, barrier, results):
    """Body of one reader process (see NOTE [reader protocol])."""
    try:
        import torch

        torch.set_num_threads(1)
        reader = importlib.import_module(module).open_reader(spec, path, rank, world, port)
        _verify(reader, workload, rank)
        for r in range(repeats):
            shard = permutation(workload.n_items, seed, r)[rank::world]
            barrier.wait(BARRIER_TIMEOUT_S)
            t0 = time.perf_counter()
            items, chunk_s = _timed_window(reader, shard, t0)
            results.put(("ok", EpochResult(r, rank, t0, time.perf_counter(), items, chunk_s)))
        reader.close()
    except BaseException:  # noqa: BLE001 - carried to the parent with where it happened
        barrier.abort()
        where = f"reader rank {rank}/{world} ({module}, path {path!r})"
        results.put(("error", f"{where} failed:\n{traceback.format_exc()}"))


def _timed_window(reader, shard: np.ndarray, t0: float) -> tuple[int, list[float]]:
    """Whole passes over ``shard`` until MIN_WINDOW_S passed (see NOTE [reader protocol])."""
    items, chunk_s = 0, []
    while True:
        chunk_s += reader.epoch(shard)
        items += getattr(reader, "items_in_last_epoch", None) or len(shard)  # a reader may read its own split
        if not getattr(reader, "repeatable", True) or time.perf_counter() - t0 >= MIN_WINDOW_S:
            return items, chunk_s


def run_readers(module: str, spec: dict, path: str, world: int, workload, repeats: int,
                seed: int, port: int = 0, timeout_s: float = 900.0) -> list[EpochResult]:
    """Run ``world`` reader processes of ``module`` for ``repeats`` epochs; their results."""
    ctx = context()
    barrier, results = ctx.Barrier(world), ctx.Queue()
    procs = [ctx.Process(target=_reader_main, name=f"reader-{rank}",
                         args=(module, spec, path, rank, world, port, workload, repeats, seed, barrier, results))
             for rank in range(world)]
    try:
        for p in procs:
            p.start()
        return _collect(results, procs, world * repeats, timeout_s)
    finally:
        _reap(procs)


def _collect(results, procs, expected: int, timeout_s: float) -> list[EpochResult]:
    out: list[EpochResult] = []
    deadline = time.monotonic() + timeout_s
    while len(out) < expected:
        try:
            kind, payload = results.get(timeout=1.0)
        except queue_mod.Empty:
            _check_alive(procs, deadline)
            continue
        if kind == "error":
            raise ReaderError(payload)
        out.append(payload)
    return out


def _check_alive(procs, deadline: float) -> None:
    dead = [p for p in procs if p.exitcode not in (None, 0)]
    if dead:
        raise ReaderError(f"{dead[0].name} died with exit code {dead[0].exitcode} before reporting")
    if time.monotonic() > deadline:
        raise ReaderError(f"readers did not finish within the timeout ({len(procs)} processes)")


def _reap(procs, grace_s: float = 10.0) -> None:
    for p in procs:
        p.join(timeout=max(0.1, grace_s / max(1, len(procs))))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5.0)
        if p.is_alive() and p.pid:
            os.kill(p.pid, 9)
            p.join(5.0)
