"""RayExecutor: a placement group of worker actors forming one TP group.

Per-step dispatch is a Ray Compiled Graph (the plan goes to every rank over shared-memory
channels, ~0.2 ms) or, without one, a direct step channel to each rank (`step_channel`: a
Unix socket, tens of microseconds) where every rank runs on the scheduler's node, else
plain actor calls (~1.2 ms idle, 2-3 ms each way on a busy 2-core node). `compiled=None`
picks by device (`dispatch_compiled`): a compiled graph's channel reads busy-wait (Ray
2.60), so each waiting reader, the scheduler waiting for a result as much as an idle worker
waiting for a plan, keeps a core spinning. On a GPU the cores are spare; on CPU the
workers' compute threads already take every core, and the spinning reader slows each step
(one request's inter-token latency 41 ms against 33 ms with plain calls, embedded model, 2
cores). Actor calls remain the fallback and the way every other call goes (setup,
inspection, K/V transfers).
"""

from __future__ import annotations

import os
import time
from typing import Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from kvray.cluster.actors import TRANSFER_GROUP, WorkerActor
from kvray.cluster.executor import Executor, WorkerFailure
from kvray.cluster.step_channel import StepClient, StepFailed
from kvray.core import StepPlan, StepResult
from kvray.workers import host_memory
from kvray.workers.cpu_bind import worker_omp_env
from kvray.workers.worker import WorkerSpec

_FAILURES: tuple[type[BaseException], ...] = (
    ray.exceptions.RayActorError,
    ray.exceptions.RayChannelError,
    ray.exceptions.RayTaskError,
    ray.exceptions.ObjectLostError,
)


def dispatch_compiled(compiled: bool | None, device: str) -> bool:
    """Whether steps go over a compiled graph: as asked, else on GPUs only."""
    return device.startswith("cuda") if compiled is None else compiled


class RayExecutor(Executor):
    def __init__(
        self,
        spec: WorkerSpec,
        tp_size: int,
        *,
        compiled: bool | None = None,
        placement_strategy: str = "PACK",
        worker_cpus: float = 1.0,
        worker_threads: int | None = None,
        step_timeout_s: float = 600.0,
        ready_timeout_s: float = 120.0,
        pg_name_prefix: str = "",
    ) -> None:
        self.spec = spec
        self.tp_size = tp_size
        self.compiled = dispatch_compiled(compiled, spec.device)
        self.step_timeout_s = step_timeout_s
        # Each rank's resources (a GPU of its own on CUDA), placed as `placement_strategy` says.
        self._bundle = {"CPU": worker_cpus, "GPU": 1.0 if spec.device.startswith("cuda") else 0.0}
        self.placement_strategy = placement_strategy
        # Placement groups outlive the actor that created them (Ray scopes them to the job),
        # so each gets a name the Engine can find and remove if this actor dies uncleanly.
        self.pg_name_prefix = pg_name_prefix
        self.worker_threads = worker_threads
        self._generation = 0
        self.actors: list[Any] = []
        self.pg: Any = None
        self._dag: Any = None
        self._channels: StepClient | None = None
        self._pinned: list[tuple[int, ...]] = []
        self._build(ready_timeout_s)

    # -- life cycle -------------------------------------------------------------------------

    def _build(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        bundle = {name: amount for name, amount in self._bundle.items() if amount > 0}
        self._generation += 1
        self.pg = placement_group(
            [dict(bundle) for _ in range(self.tp_size)],
            strategy=self.placement_strategy,
            name=f"{self.pg_name_prefix}-{self._generation}" if self.pg_name_prefix else "",
        )
        try:
            ray.get(self.pg.ready(), timeout=max(deadline - time.monotonic(), 1))
        except ray.exceptions.GetTimeoutError:
            self.shutdown()
            raise RuntimeError(
                f"cannot place {self.tp_size} TP workers of {bundle} each "
                f"({self.placement_strategy}); cluster resources: {ray.available_resources()}"
            ) from None
        # Torch threads per CPU rank: the node's cores shared by the ranks, unless told.
        threads = self.worker_threads or max(1, (os.cpu_count() or 1) // self.tp_size)
        # Prefix K/V transfers (kv_transfer) run on a thread of their own beside the steps:
        # they touch only pages no step reads or writes meanwhile (locked in the tree, or
        # reserved and not yet in it), so a fetch never waits for a step to finish. (The
        # group is declared under compiled graphs too: the methods name it.)
        remote_cls = ray.remote(concurrency_groups={TRANSFER_GROUP: 1})(WorkerActor)
        # CPU ranks start with tcmalloc preloaded where the node has it (host_memory) and
        # idle OpenMP threads that sleep sooner (cpu_bind.worker_omp_env).
        env = {} if self._bundle["GPU"] else host_memory.preload_env() | worker_omp_env()
        self.actors = [
            remote_cls.options(
                num_cpus=self._bundle["CPU"],
                num_gpus=self._bundle["GPU"],
                max_restarts=0,
                runtime_env={"env_vars": env} if env else None,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=self.pg, placement_group_bundle_index=rank
                ),
            ).remote(self.spec, rank, self.tp_size, threads)
            for rank in range(self.tp_size)
        ]
        try:
            addr, port = ray.get(
                self.actors[0].rendezvous.remote(), timeout=max(deadline - time.monotonic(), 1)
            )
            ray.get(
                [a.init.remote(addr, port) for a in self.actors],
                timeout=max(deadline - time.monotonic(), 1),
            )
            self._pinned = ray.get(
                [a.pinned_cpus.remote() for a in self.actors],
                timeout=max(deadline - time.monotonic(), 1),
            )
        except Exception:
            self.shutdown()
            raise
        if self.compiled:
            from ray.dag import InputNode, MultiOutputNode

            with InputNode() as plan:
                dag = MultiOutputNode([a.execute.bind(plan) for a in self.actors])
            self._dag = dag.experimental_compile()
        elif self.spec.config.step_channel:
            self._channels = self._open_channels(deadline)

    def _open_channels(self, deadline: float) -> StepClient | None:
        """Direct step channels to every rank, if all run on this node; else None."""
        node = ray.get_runtime_context().get_node_id()
        try:
            paths = ray.get(
                [a.open_step_channel.remote(node) for a in self.actors],
                timeout=max(deadline - time.monotonic(), 1),
            )
            # Ranks elsewhere: none is used (a rank that opened one stops at its timeout).
            if any(p is None for p in paths):
                return None
            return StepClient(paths)
        except Exception:
            self.shutdown()
            raise

    @property
    def dispatch(self) -> str:
        """How steps reach the workers: compiled_graph, step_channel or actor_calls."""
        if self._dag is not None:
            return "compiled_graph"
        return "step_channel" if self._channels is not None else "actor_calls"

    def shutdown(self) -> None:
        if self._dag is not None:
            try:
                self._dag.teardown()
            except Exception:
                pass
            self._dag = None
        if self._channels is not None:
            self._channels.close()
            self._channels = None
        for a in self.actors:
            ray.kill(a, no_restart=True)
        self.actors = []
        if self.pg is not None:
            remove_placement_group(self.pg)
            self.pg = None

    def rebuild(self, timeout_s: float) -> None:
        self.shutdown()
        self._build(timeout_s)

    # -- steps ----------------------------------------------------------------------------------

    def submit(self, plan: StepPlan) -> Any:
        try:
            if self._dag is not None:
                return self._dag.execute(plan)
            if self._channels is not None:
                self._channels.send(plan)
                return None  # answers come in order: wait reads the oldest
            return [a.execute.remote(plan) for a in self.actors]
        except (*_FAILURES, OSError) as e:
            raise WorkerFailure(str(e)) from e

    def wait(self, handle: Any) -> StepResult | None:
        try:
            if self._dag is not None:
                return ray.get(handle, timeout=self.step_timeout_s)[0]
            if self._channels is not None:
                result: StepResult | None = self._channels.recv(self.step_timeout_s)
                return result
            # Plain calls: surface any rank's failure at once (a surviving rank would
            # otherwise block in a collective with its dead peer, and so would rank 0's ref).
            pending = list(handle)
            while pending:
                ready, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
                ray.get(ready)
            return ray.get(handle[0])
        except (*_FAILURES, OSError, StepFailed) as e:
            raise WorkerFailure(str(e)) from e

    def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        return ray.get([a.kv_buffer_shape.remote() for a in self.actors])

    def worker_pids(self) -> list[int]:
        return ray.get([a.pid.remote() for a in self.actors])

    def pinned_cpus(self) -> list[tuple[int, ...]]:
        return [tuple(cpus) for cpus in self._pinned]

    def kill_worker(self, rank: int) -> None:
        """Kill one worker actor (for failure tests and drills)."""
        ray.kill(self.actors[rank], no_restart=True)
