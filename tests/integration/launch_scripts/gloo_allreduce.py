"""Worker: join a gloo process group through env:// and all_reduce one tensor.

Usage: gloo_allreduce.py OUTDIR  ->  OUTDIR/rank-<RANK>.txt holding the reduced value
"""

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo", init_method="env://", timeout=timedelta(seconds=30))
    value = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(value)
    with open(os.path.join(sys.argv[1], f"rank-{dist.get_rank()}.txt"), "w") as f:
        f.write(f"{value.item():g} {dist.get_world_size()}\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
