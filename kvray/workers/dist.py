"""torch.distributed set-up for one TP rank (NCCL on CUDA, gloo on CPU); no Ray here."""

from __future__ import annotations

import datetime
import socket

import torch
import torch.distributed as dist

from kvray.models import TPGroup


def free_port() -> int:
    """A TCP port that was free a moment ago on this host (for rank 0's rendezvous)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return int(s.getsockname()[1])


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
