"""Training on several processes with DistributedDataParallel, as torchrun starts them.

`torchrun --nproc-per-node G -m treeflash_export.cli train ...` sets RANK, WORLD_SIZE,
LOCAL_RANK and the rendezvous address; `train` then joins the process group (gloo on the CPU,
nccl on CUDA, each rank on cuda:LOCAL_RANK) and leaves it when it returns. Without those
variables, or with WORLD_SIZE=1, everything runs in this one process as before.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from ..errors import ConfigError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.size > 1:
            torch.distributed.barrier()

    def shard(self, n: int) -> range:
        """This rank's contiguous share of n items (the first n % size ranks take one more)."""
        per, extra = divmod(n, self.size)
        start = self.rank * per + min(self.rank, extra)
        return range(start, start + per + (self.rank < extra))

    def mean(self, value: torch.Tensor) -> torch.Tensor:
        """The mean of a tensor over the ranks (SUM then divide: gloo has no AVG)."""
        if self.size == 1:
            return value
        value = value.detach().clone()
        torch.distributed.all_reduce(value)
        return value / self.size


def rank_device(device: torch.device, size: int) -> torch.device:
    """Under torchrun each rank takes its own GPU: `--device cuda` means cuda:LOCAL_RANK."""
    if size == 1 or device.type != "cuda":
        return device
    if device.index is not None:
        raise ConfigError(f"--device {device}: under torchrun pass --device cuda; rank r uses cuda:LOCAL_RANK")
    return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))


@contextmanager
def joined(device: torch.device):
    """Yields (World, this rank's device), joined to the process group torchrun describes."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1 or torch.distributed.is_initialized():
        if size > 1:  # the caller joined already (and will leave)
            yield World(torch.distributed.get_rank(), size), rank_device(device, size)
        else:
            yield World(), device
        return
    dev = rank_device(device, size)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    torch.distributed.init_process_group("nccl" if dev.type == "cuda" else "gloo")
    try:
        yield World(torch.distributed.get_rank(), size), dev
    finally:
        torch.distributed.destroy_process_group()
