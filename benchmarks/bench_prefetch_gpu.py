"""PrefetchRing and sink_loop on one GPU, each against baselines measured in the same run.

Reproduce (prints an environment line, then the tables):

    python benchmarks/bench_prefetch_gpu.py             # defaults: 32 batches x 64 MB, 5 repeats
    python benchmarks/bench_prefetch_gpu.py --quick     # a smoke run in a few seconds

Host-to-device throughput, GB/s (median, min, max over --repeats passes of --batches batches):

- ``H2D ceiling``: ``device.copy_(pinned, non_blocking=True)`` over batches already in pinned
  memory, two device buffers in turn. Pure link bandwidth: no host copy at all.
- ``plain staging loop``: what a loop without the ring does with pageable batches (a DataLoader
  without ``pin_memory``, or a gather from shared memory): copy into one pinned staging buffer, then
  ``copy_(non_blocking=True)`` to the device, then wait before reusing the staging buffer. The same
  work as the ring (one host copy + one H2D copy per batch), serially.
- ``PrefetchRing``: the ring over the same pageable batches (depth 2): the host copy of batch i+1
  overlaps the H2D copy of batch i.
- ``pageable .to()``: ``batch.to(device)`` per batch, the naive way.

The target is ring >= 0.85 x the plain staging loop (same work). Against the ceiling the ring is
bounded by host memcpy bandwidth (it must copy pageable memory into pinned slots); that ratio is
printed for information.

Training steps/s on a small MLP with batches already on the device (median, min, max over sinks of
--sink-size steps, the first sink - warm-up, capture - left out):

- ``per-step .item()``: the usual eager loop, which reads the loss (a host sync) every step;
- ``sink_loop``: no sync inside a sink, one per sink;
- ``sink_loop graph=True``: the step captured once as a CUDA graph and replayed.

Without CUDA the script says so, runs the CPU-side parts (ring vs plain iteration, sink vs .item()
on the CPU) and exits 0.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

try:
    from shmcache.data.prefetch import PrefetchRing
    from shmcache.data.sink import sink_loop
except ModuleNotFoundError:  # run from a checkout without installing: the repository root
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from shmcache.data.prefetch import PrefetchRing
    from shmcache.data.sink import sink_loop

RING_TARGET = 0.85


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    cuda = torch.cuda.is_available()
    print(_environment(cuda))
    if not cuda:
        print("CUDA is absent: the GPU rows are skipped; running the CPU-side parts instead.")
        args.batches, args.batch_mb, args.steps = min(args.batches, 16), min(args.batch_mb, 4), 400
    device = torch.device("cuda" if cuda else "cpu")
    _throughput_table(args, device)
    print()
    _steps_table(args, device)
    return 0


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=32, help="batches per pass")
    parser.add_argument("--batch-mb", type=int, default=64, help="MB per batch")
    parser.add_argument("--repeats", type=int, default=5, help="passes per row (median reported)")
    parser.add_argument("--steps", type=int, default=2000, help="training steps per sink row")
    parser.add_argument("--sink-size", type=int, default=100, help="steps per sink")
    parser.add_argument("--quick", action="store_true", help="small sizes: a smoke run")
    args = parser.parse_args(argv)
    if args.quick:
        args.batches, args.batch_mb, args.repeats, args.steps = 8, 8, 3, 400
    return args


def _environment(cuda: bool) -> str:
    shm = shutil.disk_usage("/dev/shm") if os.path.isdir("/dev/shm") else None
    parts = [
        f"python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"numpy {np.__version__}",
        f"cpus {os.cpu_count()}",
        f"torch threads {torch.get_num_threads()}",
        f"/dev/shm {shm.total / 2**30:.1f} GiB" if shm else "/dev/shm absent",
    ]
    if cuda:
        properties = torch.cuda.get_device_properties(0)
        parts += [
            f"gpu {properties.name} ({properties.total_memory / 2**30:.0f} GiB)",
            f"cuda {torch.version.cuda}",
        ]
    else:
        parts.append("gpu none")
    return "env: " + ", ".join(parts)


# -- statistics and printing ---------------------------------------------------------------------


def _summary(samples: list[float]) -> tuple[float, float, float]:
    return statistics.median(samples), min(samples), max(samples)


def _print_table(title: str, unit: str, rows: list[tuple[str, list[float]]], base: str) -> None:
    medians = {name: statistics.median(samples) for name, samples in rows}
    print(title)
    print(f"  {'':26} {'median':>10} {'min':>10} {'max':>10}   {'x ' + base:>18}")
    for name, samples in rows:
        median, low, high = _summary(samples)
        ratio = median / medians[base]
        print(f"  {name:26} {median:10.2f} {low:10.2f} {high:10.2f}   {ratio:18.2f}  {unit}")


# -- host-to-device throughput -------------------------------------------------------------------


def _throughput_table(args: argparse.Namespace, device: torch.device) -> None:
    cuda = device.type == "cuda"
    numel = args.batch_mb * 2**20 // 4
    pageable = [torch.full((numel,), float(i)) for i in range(args.batches)]
    gigabytes = args.batches * numel * 4 / 1e9
    ring = PrefetchRing(pageable, device=device, depth=2)
    rows: list[tuple[str, list[float]]] = []
    if cuda:
        pinned = [batch.pin_memory() for batch in pageable]
        rows.append(("H2D ceiling", _rates(args, gigabytes, lambda: _ceiling(pinned, device))))
    rows.append(("plain staging loop", _rates(args, gigabytes, lambda: _staging(pageable, device))))
    rows.append(("PrefetchRing", _rates(args, gigabytes, lambda: _drain(ring, device))))
    if cuda:
        rows.append(("pageable .to()", _rates(args, gigabytes, lambda: _to(pageable, device))))
    ring.close()
    what = "host-to-device" if cuda else "CPU ring vs plain copy (no device)"
    title = f"{what} throughput, GB/s ({args.batches} x {args.batch_mb} MB per pass)"
    _print_table(title, "GB/s", rows, "plain staging loop")
    if not cuda:
        print("  (CPU: a smoke test of the ring's thread and slots; the target is for the GPU)")
        return
    medians = {name: statistics.median(samples) for name, samples in rows}
    ratio = medians["PrefetchRing"] / medians["plain staging loop"]
    verdict = "meets" if ratio >= RING_TARGET else "BELOW"
    print(f"  ring / plain staging loop = {ratio:.2f} ({verdict} the {RING_TARGET} target)")
    ceiling = medians["PrefetchRing"] / medians["H2D ceiling"]
    print(f"  ring / H2D ceiling = {ceiling:.2f} (bounded by host memcpy into pinned slots)")


def _rates(args: argparse.Namespace, gigabytes: float, run: Callable[[], None]) -> list[float]:
    run()  # warm-up: pinned slots, allocator pools, CUDA context
    rates = []
    for _ in range(args.repeats):
        started = time.perf_counter()
        run()
        rates.append(gigabytes / (time.perf_counter() - started))
    return rates


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ceiling(pinned: list[torch.Tensor], device: torch.device) -> None:
    targets = [torch.empty_like(pinned[0], device=device) for _ in range(2)]
    _synchronize(device)
    for index, batch in enumerate(pinned):
        targets[index % 2].copy_(batch, non_blocking=True)
    _synchronize(device)


def _staging(pageable: list[torch.Tensor], device: torch.device) -> None:
    cuda = device.type == "cuda"
    staging = torch.empty_like(pageable[0], pin_memory=cuda)
    target = torch.empty_like(pageable[0], device=device)
    _synchronize(device)
    for batch in pageable:
        staging.copy_(batch)
        target.copy_(staging, non_blocking=True)
        _synchronize(device)  # the staging buffer may be rewritten only after the copy
    _synchronize(device)


def _drain(ring: PrefetchRing, device: torch.device) -> None:
    _synchronize(device)
    for _ in ring:
        pass  # the consumer's stream waits on each slot's copy; the host does not
    _synchronize(device)


def _to(pageable: list[torch.Tensor], device: torch.device) -> None:
    _synchronize(device)
    for batch in pageable:
        batch.to(device)
    _synchronize(device)


# -- training steps/s ----------------------------------------------------------------------------


StepFn = Callable[[tuple[torch.Tensor, ...]], torch.Tensor]


def _mlp_step(device: torch.device) -> tuple[StepFn, list[tuple[torch.Tensor, torch.Tensor]]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    generator = torch.Generator().manual_seed(1)
    data = [
        (
            torch.randn(64, 256, generator=generator).to(device),
            torch.randint(0, 10, (64,), generator=generator).to(device),
        )
        for _ in range(16)
    ]

    def step_fn(batch: tuple[torch.Tensor, ...]) -> torch.Tensor:
        x, y = batch
        optimizer.zero_grad(set_to_none=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        return loss

    return step_fn, data


def _per_step_item(args: argparse.Namespace, device: torch.device) -> list[float]:
    step_fn, data = _mlp_step(device)
    rates = []
    for chunk in range(args.steps // args.sink_size):
        started = time.perf_counter()
        for step in range(args.sink_size):
            step_fn(data[step % len(data)]).item()  # the host sync this loop pays every step
        if chunk > 0:  # same warm-up exclusion as the sink rows
            rates.append(args.sink_size / (time.perf_counter() - started))
    return rates


def _sink(args: argparse.Namespace, device: torch.device, graph: bool) -> list[float]:
    step_fn, data = _mlp_step(device)
    epochs = args.steps // args.sink_size
    results = sink_loop(step_fn, data, epochs=epochs, sink_size=args.sink_size, graph=graph)
    return [result.steps / result.wall_s for result in results[1:]]


def _steps_table(args: argparse.Namespace, device: torch.device) -> None:
    if args.steps // args.sink_size < 2:
        args.steps = 2 * args.sink_size
    rows = [
        ("per-step .item()", _per_step_item(args, device)),
        ("sink_loop", _sink(args, device, graph=False)),
    ]
    if device.type == "cuda":
        rows.append(("sink_loop graph=True", _sink(args, device, graph=True)))
    where = "GPU" if device.type == "cuda" else "CPU"
    title = f"training steps/s, small MLP on the {where} ({args.sink_size} steps per sink)"
    _print_table(title, "steps/s", rows, "per-step .item()")


if __name__ == "__main__":
    sys.exit(main())
