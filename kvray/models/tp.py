"""The tensor-parallel group a model shard runs in, passed explicitly (no global state).

At `size == 1` every collective returns its input untouched and torch.distributed need not
be initialised, so single-process code and tests pay nothing for TP awareness.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup; None = the default (world) group

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"TP rank {self.rank} is outside a group of size {self.size}")

    @classmethod
    def from_process_group(cls, group: Any = None) -> TPGroup:
        """This process's place in an initialised torch.distributed group."""
        return cls(rank=dist.get_rank(group), size=dist.get_world_size(group), group=group)

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        """Sum `t` over the group, in place; returns `t`."""
        if self.size > 1:
            dist.all_reduce(t, group=self.group)
        return t

    def all_gather(self, t: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's `t` along `dim`, in rank order."""
        if self.size == 1:
            return t
        t = t.contiguous()
        parts = [torch.empty_like(t) for _ in range(self.size)]
        dist.all_gather(parts, t, group=self.group)
        return torch.cat(parts, dim=dim)


SINGLE = TPGroup()
