"""Process-group helpers for multi-process calibration (`torchrun`, `accelerate launch`).

Calibration is distributed when `torch.distributed` is initialized with more than one process: every rank
reads the same data, runs the forward passes of its own share of the batches (batch `b` on rank
`b % world_size`), and the float64 moments are summed across ranks before the PCA. Outside a process group
every helper here is a no-op, so single-process code calls them unconditionally.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def distributed(self) -> bool:
        return self.size > 1

    def owns(self, index: int) -> bool:
        """Whether this rank runs item `index` of a stream every rank iterates in the same order."""
        return index % self.size == self.rank


def world() -> World:
    """This process's rank and the world size; `World(0, 1)` without an initialized process group."""
    if dist.is_available() and dist.is_initialized():
        return World(dist.get_rank(), dist.get_world_size())
    return World()


def is_main_process() -> bool:
    return world().rank == 0


def _collective_device() -> torch.device:
    """NCCL reduces CUDA tensors only (on this rank's device); gloo and others take CPU tensors."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """The element-wise sum of `tensor` over all ranks (a new tensor on `tensor`'s device, same dtype);
    `tensor` itself when not distributed."""
    if not world().distributed:
        return tensor
    buffer = tensor.detach().to(_collective_device(), copy=True).contiguous()
    dist.all_reduce(buffer, op=dist.ReduceOp.SUM)
    return buffer.to(tensor.device)


def all_gather(tensor: torch.Tensor) -> torch.Tensor:
    """`[world_size, *tensor.shape]`: every rank's `tensor`, in rank order (`tensor[None]` when not distributed)."""
    if not world().distributed:
        return tensor.unsqueeze(0)
    buffer = tensor.detach().to(_collective_device()).contiguous()
    parts = [torch.empty_like(buffer) for _ in range(world().size)]
    dist.all_gather(parts, buffer)
    return torch.stack(parts).to(tensor.device)


def launched_distributed() -> bool:
    """Whether this process was started by a launcher (`torchrun`, `accelerate launch`) with WORLD_SIZE > 1."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1")) > 1
    except ValueError:
        return False


def init_from_env() -> bool:
    """Initialize the default process group from the launcher's environment (RANK, WORLD_SIZE, MASTER_ADDR,
    MASTER_PORT) if a launcher started this process and no group exists yet: NCCL on CUDA machines (each rank
    on device LOCAL_RANK), gloo otherwise. Returns True if it created the group (the caller then destroys it)."""
    if not launched_distributed() or not dist.is_available() or dist.is_initialized():
        return False
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        dist.init_process_group("nccl")
    else:
        dist.init_process_group("gloo")
    return True


def destroy() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
