"""The per-GPU (or, on CPU, per-TP-rank) worker actor: a ModelWorker behind Ray.

Plain class; `RayExecutor` wraps it with `ray.remote` and places one per bundle of the
engine's placement group.
"""

from __future__ import annotations

import os

import ray
import torch

from kvray.cluster.step_channel import StepServer
from kvray.core import StepPlan, StepResult
from kvray.net import free_port
from kvray.workers.cpu_bind import ThreadBinding, release_omp_team
from kvray.workers.dist import default_backend, init_tp_group
from kvray.workers.worker import ModelWorker, WorkerSpec

TRANSFER_GROUP = "kv_transfer"  # the concurrency group of page exports and imports


class WorkerActor:
    def __init__(self, spec: WorkerSpec, rank: int, world_size: int, num_threads: int) -> None:
        self.spec = spec
        self.rank = rank
        self.world_size = world_size
        # On CPU, the torch threads pinned one per core (where cores are free to claim).
        self.binding: ThreadBinding | None = None
        if not spec.device.startswith("cuda"):
            # Ranks share the node's cores: give each its slice so they do not oversubscribe.
            torch.set_num_threads(max(1, num_threads))
            if spec.config.bind_threads:
                self.binding = ThreadBinding(torch.get_num_threads())
        self.worker: ModelWorker | None = None
        self._channel: StepServer | None = None

    def rendezvous(self) -> tuple[str, int]:
        """Rank 0's address and a free port for the TP group to meet at."""
        import ray

        return ray.util.get_node_ip_address(), free_port()

    def init(self, master_addr: str, master_port: int) -> int:
        tp = init_tp_group(
            master_addr, master_port, self.rank, self.world_size, default_backend(self.spec.device)
        )
        self.worker = ModelWorker(self.spec, tp)
        return os.getpid()

    def execute(self, plan: StepPlan) -> StepResult | None:
        assert self.worker is not None, "execute before init"
        if self.binding is not None:
            self.binding.ensure()  # the team of the thread that steps (once per thread)
        result = self.worker.execute(plan)
        return result if self.rank == 0 else None  # every rank computed it; one answers

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def export_pages(self, pages: list[int]) -> torch.Tensor:
        """A copy of this rank's K/V of whole pages (it goes to the object store)."""
        assert self.worker is not None
        try:
            return self.worker.kvcache.read_pages(pages)
        finally:
            self._release_team()

    @ray.method(concurrency_group=TRANSFER_GROUP)
    def import_pages(self, pages: list[int], kv: torch.Tensor) -> None:
        """Write K/V another engine's same rank exported into this rank's pages."""
        assert self.worker is not None
        try:
            self.worker.kvcache.write_pages(pages, kv)
        finally:
            self._release_team()

    def _release_team(self) -> None:
        """On CPU, end this (non-stepping) thread's OpenMP team: the stepping thread's team
        then keeps its threads spinning between regions (cpu_bind.release_omp_team)."""
        if not self.spec.device.startswith("cuda"):
            release_omp_team()

    def kv_buffer_shape(self) -> tuple[int, ...]:
        assert self.worker is not None
        return self.worker.kv_buffer_shape

    def pid(self) -> int:
        return os.getpid()

    def open_step_channel(self, node_id: str) -> str | None:
        """Where the scheduler, on node `node_id`, connects for this rank's steps
        (`step_channel`); None when it runs on another node (steps then come as actor
        calls)."""
        if node_id != ray.get_runtime_context().get_node_id():
            return None
        self._channel = StepServer(self.execute)
        self._release_team()  # this thread loaded the model; the channel's thread steps
        return self._channel.path

    def pinned_cpus(self) -> tuple[int, ...]:
        """The cores this rank's torch threads are pinned to (empty: not pinned)."""
        return self.binding.cpus if self.binding is not None else ()
