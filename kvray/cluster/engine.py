"""Engine: one engine on a Ray cluster (a SchedulerActor and its TP worker actors).

The facade a driver holds: it resolves the checkpoint here (so the embedded model's
one-time conversion shows its progress on this console), starts the SchedulerActor, and
forwards requests to it. Data parallelism is several Engines.
"""

from __future__ import annotations

import uuid
import weakref
from collections.abc import Sequence
from typing import Any

import ray
from ray.util.placement_group import remove_placement_group

from kvray.cluster.scheduler_actor import SchedulerActor
from kvray.cluster.spec import EngineSpec
from kvray.config import EngineConfig
from kvray.core import FinishReason, SamplingParams, TokenEvent

ACTOR_NAMESPACE = "kvray"  # where named scheduler actors live


def ensure_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster at `address` (or RAY_ADDRESS), or start a local one."""
    if not ray.is_initialized():
        ray.init(
            address=address,
            num_cpus=num_cpus,
            include_dashboard=False,
            log_to_driver=True,
            configure_logging=False,
        )


def _call(ref: Any, timeout: float | None = None) -> Any:
    """ray.get that re-raises an actor method's own exception (RequestRejected, ...)."""
    try:
        return ray.get(ref, timeout=timeout)
    except ray.exceptions.RayTaskError as e:
        if e.cause is not None:
            raise e.cause from None
        raise


class Engine:
    def __init__(
        self,
        config: EngineConfig,
        *,
        compiled: bool | None = None,
        address: str | None = None,
        worker_cpus: float = 1.0,
        worker_threads: int | None = None,
        progress: bool = True,
        name: str | None = None,
    ) -> None:
        ensure_ray(address)
        self.config = config
        device = config.device
        if device == "auto":
            device = "cuda" if ray.cluster_resources().get("GPU", 0) > 0 else "cpu"
        self.spec = EngineSpec.resolve(config, progress=progress, device=device)
        # A named scheduler can be found by the API server (metrics, stop-string aborts).
        self.name = name
        self.pg_name_prefix = f"kvray-pg-{uuid.uuid4().hex[:12]}"
        self.actor = (
            ray.remote(SchedulerActor)
            .options(
                num_cpus=0,
                max_concurrency=10_000,
                name=name,
                namespace=ACTOR_NAMESPACE if name else None,
            )
            .remote(self.spec, device, compiled, worker_cpus, self.pg_name_prefix, worker_threads)
        )
        # Whatever way this Engine goes (shutdown, garbage collection, interpreter exit),
        # its actor is killed and its placement groups are removed.
        self._finalizer = weakref.finalize(self, _release, self.actor, self.pg_name_prefix)
        try:
            _call(self.actor.start.remote())
        except BaseException:
            self._finalizer()
            raise

    def submit(self, input_ids: Sequence[int], sampling: SamplingParams) -> int:
        return _call(self.actor.submit.remote(list(input_ids), sampling))

    def poll(self, rids: Sequence[int], timeout_s: float = 1.0) -> list[TokenEvent]:
        return _call(self.actor.poll.remote(list(rids), timeout_s))

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> TokenEvent | None:
        return _call(self.actor.abort.remote(rid, reason.value))

    def stats(self) -> dict[str, Any]:
        return _call(self.actor.stats.remote())

    def check_integrity(self) -> None:
        _call(self.actor.check_integrity.remote())

    def flush_cache(self) -> None:
        _call(self.actor.flush_cache.remote())

    def is_idle_and_empty(self) -> bool:
        return _call(self.actor.is_idle_and_empty.remote())

    def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        return _call(self.actor.kv_buffer_shapes.remote())

    def kill_worker(self, rank: int) -> None:
        _call(self.actor.kill_worker.remote(rank))

    def shutdown(self) -> None:
        try:
            _call(self.actor.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - a dead or stuck actor: _release cleans up anyway
            pass
        finally:
            self._finalizer()


def _release(actor: Any, pg_name_prefix: str) -> None:
    """Kill the scheduler actor (its workers die with it) and remove its placement groups."""
    if not ray.is_initialized():
        return
    try:
        ray.kill(actor, no_restart=True)
    except Exception:  # noqa: BLE001 - already gone
        pass
    for info in ray.util.placement_group_table().values():
        name = info.get("name", "")
        if name.startswith(pg_name_prefix) and info.get("state") != "REMOVED":
            try:
                remove_placement_group(ray.util.get_placement_group(name))
            except Exception:  # noqa: BLE001 - removed meanwhile
                pass
