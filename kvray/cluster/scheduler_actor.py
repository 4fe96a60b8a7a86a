"""SchedulerActor: one engine's scheduler as a Ray actor, driving its TP workers.

It owns the EngineCore (scheduler + RayExecutor). The worker actors are owned by this
actor and die with it; the placement group is scoped to the job, so the Engine that started
this actor removes it by name when the engine goes. A loop thread runs the overlapped step
loop; the asyncio side takes requests and hands each one its events: `stream(rid)` is an
async generator (for the Serve front), `poll(rids)` returns whatever is ready (for the
offline LLM).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Sequence
from typing import Any

from kvray.cluster.engine_core import EngineCore
from kvray.cluster.ray_executor import RayExecutor
from kvray.cluster.spec import EngineSpec
from kvray.core import FinishReason, SamplingParams, TokenEvent


class SchedulerActor:
    def __init__(
        self,
        spec: EngineSpec,
        device: str,
        compiled: bool = True,
        worker_cpus: float = 1.0,
        pg_name_prefix: str = "",
    ) -> None:
        self._args = (spec, device, compiled, worker_cpus, pg_name_prefix)
        self._queues: dict[int, asyncio.Queue[TokenEvent]] = {}
        self._wake = threading.Event()
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="kvray-step-loop", daemon=True)

    async def start(self) -> None:
        """Build the TP group (off the event loop: it waits on Ray) and start stepping."""
        spec, device, compiled, worker_cpus, pg_name_prefix = self._args
        executor = await asyncio.to_thread(
            RayExecutor,
            spec.worker_spec(device),
            spec.config.tp_size,
            compiled=compiled,
            placement_strategy=spec.config.placement_strategy,
            worker_cpus=worker_cpus,
            pg_name_prefix=pg_name_prefix,
        )
        self.core = EngineCore(spec, executor, max_inflight=2)
        await asyncio.to_thread(self.core.warm_up)  # before the first real request
        self._loop = asyncio.get_running_loop()
        self._thread.start()

    # -- the step loop (its own thread) --------------------------------------------------------

    def _run(self) -> None:
        while not self._stop:
            if not self.core.has_work:
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            events = self.core.step()
            if events:
                self._loop.call_soon_threadsafe(self._deliver, events)

    def _deliver(self, events: list[TokenEvent]) -> None:
        for ev in events:
            q = self._queues.get(ev.rid)
            if q is not None:
                q.put_nowait(ev)

    # -- requests ---------------------------------------------------------------------------------

    async def ready(self) -> bool:
        return True

    async def submit(self, input_ids: Sequence[int], sampling: SamplingParams) -> int:
        """Queue a request and return its id. RequestRejected propagates to the caller."""
        rid = self.core.new_rid()
        self._queues[rid] = asyncio.Queue()
        try:
            self.core.add_request(input_ids, sampling, rid=rid)
        except BaseException:
            del self._queues[rid]
            raise
        self._wake.set()
        return rid

    async def abort(self, rid: int, reason: str = "abort") -> TokenEvent | None:
        """End a request; its stream gets the finishing event, which is also returned."""
        ev = self.core.abort(rid, FinishReason(reason))
        if ev is not None:
            self._deliver([ev])
        return ev

    async def _next(self, rid: int) -> list[TokenEvent]:
        """Wait for at least one event of `rid`, then take all that are ready."""
        q = self._queues[rid]
        events = [await q.get()]
        while not q.empty():
            events.append(q.get_nowait())
        if events[-1].finished:
            self._queues.pop(rid, None)
        return events

    async def stream(self, rid: int) -> AsyncIterator[list[TokenEvent]]:
        """The events of one request, in batches, until it finishes."""
        while rid in self._queues:
            yield await self._next(rid)

    async def poll(self, rids: Sequence[int], timeout_s: float = 1.0) -> list[TokenEvent]:
        """Every ready event of `rids`, waiting up to `timeout_s` for the first one."""
        live = [r for r in rids if r in self._queues]
        if not live:
            return []
        tasks = [asyncio.ensure_future(self._queues[r].get()) for r in live]
        done, pending = await asyncio.wait(
            tasks, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
        )
        for t in pending:
            t.cancel()
        events: list[TokenEvent] = []
        for rid, t in zip(live, tasks, strict=True):
            if t in done and not t.cancelled():
                events.append(t.result())
            q = self._queues.get(rid)
            while q is not None and not q.empty():
                events.append(q.get_nowait())
        for ev in events:
            if ev.finished:
                self._queues.pop(ev.rid, None)
        return events

    # -- inspection and control -----------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        s = self.core.scheduler
        return {
            **vars(s.stats),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            # Cached-but-evictable pages count as free, as in vLLM.
            "kv_cache_usage": 1.0 - s.cache.available_pages / s.config.num_pages,
            "recoveries": self.core.recoveries,
        }

    async def check_integrity(self) -> None:
        self.core.check_integrity()

    async def flush_cache(self) -> None:
        self.core.flush_cache()

    async def is_idle_and_empty(self) -> bool:
        return self.core.is_idle_and_empty()

    async def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        return await asyncio.to_thread(self.core.kv_buffer_shapes)

    async def kill_worker(self, rank: int) -> None:
        assert isinstance(self.core.executor, RayExecutor)
        self.core.executor.kill_worker(rank)

    async def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread.is_alive():
            await asyncio.to_thread(self._thread.join, 10)
        if hasattr(self, "core"):
            await asyncio.to_thread(self.core.shutdown)
