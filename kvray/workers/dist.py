"""torch.distributed set-up for one TP rank (NCCL on CUDA, gloo on CPU); no Ray here."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from kvray.models import TPGroup


def default_backend(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def init_tp_group(
    master_addr: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float = 120.0,
) -> TPGroup:
    """Join the TP process group at master_addr:master_port; returns this rank's TPGroup.
    At world_size 1 nothing is initialised (collectives are no-ops)."""
    if world_size == 1:
        return TPGroup()
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    if backend == "nccl":
        torch.cuda.set_device(0)  # Ray exposes exactly one GPU to each worker actor
    return TPGroup.from_process_group()
