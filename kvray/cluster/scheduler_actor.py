"""SchedulerActor: one engine's scheduler as a Ray actor, driving its TP workers.

It owns the EngineCore (scheduler + RayExecutor). The worker actors are owned by this
actor and die with it; the placement group is scoped to the job, so the Engine that started
this actor removes it by name when the engine goes.

Life cycle, one way through: CREATED (no workers) -> `start()` builds the TP group, warms
the engine up and starts the step thread -> SERVING -> `shutdown()` stops the thread and
releases the workers -> STOPPED. A call that needs the engine outside SERVING raises
EngineFailed, never an AttributeError.

Two threads touch the core, which is thread safe (one lock, never held while waiting on the
workers): the step thread (`StepThread`) plans steps and waits for their results; the
actor's event loop takes requests (submit, abort, inspection) and hands each request its
events, in one of two ways:
- `subscribe(key)` is an async generator of every event of the requests submitted with
  that `subscriber` key (one per ingress process), a step's worth per item: a server
  streaming N requests from this engine receives one Ray message per step, not N (each
  message costs CPU on both sides, on the same cores as the workers' compute);
- `poll(rids)` returns whatever is ready for those requests (for the offline LLM).
`finished(rid)` returns once a request has ended (the Serve engine replica holds a request
open with it while the tokens go straight to the ingress).
"""

from __future__ import annotations

import asyncio
import enum
import functools
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import ray

from kvray.cluster import kv_transfer
from kvray.cluster.engine_core import EngineCore, EngineFailed
from kvray.cluster.kv_transfer import TransferStats
from kvray.cluster.ray_executor import RayExecutor
from kvray.cluster.request_channel import RequestChannelServer
from kvray.cluster.spec import EngineSpec
from kvray.core import FinishReason, SamplingParams, TokenEvent
from kvray.kvcache.digest import DigestDelta


class Phase(enum.Enum):
    CREATED = "created"
    SERVING = "serving"
    STOPPED = "stopped"


class StepThread:
    """Steps the core while it has work, on a thread of its own; hands each step's events
    to `deliver` on the event loop `loop`. Sleeps when idle until `wake()`.

    It also notes when it last made progress (`progress_age_s`), for a health check that
    must not queue behind a busy engine's work: a step loop that planned a new step or
    settled one with events, or found nothing to do, has progressed. A loop stuck in a step
    (a worker that never answers) does not, nor one that has work but can neither plan nor
    settle anything. With overlapped steps, planning step N+1 waits for step N-1's result,
    so progress is never more than one step ahead of completed work."""

    def __init__(
        self,
        core: EngineCore,
        loop: asyncio.AbstractEventLoop,
        deliver: Callable[[list[TokenEvent]], None],
    ) -> None:
        self.core = core
        self._loop = loop
        self._deliver = deliver
        self._wake = threading.Event()
        self._stop = False
        self._progress_at = time.monotonic()
        self._thread = threading.Thread(target=self._run, name="kvray-step-loop", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # A step's events are handed over once the next plan is on its way: the hand-over
        # (waking the event loop, which then wants the GIL) overlaps the workers' compute
        # instead of delaying their next plan.
        ready: list[TokenEvent] = []

        def hand_over() -> None:
            nonlocal ready
            if ready:
                self._loop.call_soon_threadsafe(self._deliver, ready)
                ready = []

        while not self._stop:
            if not self.core.has_work:
                hand_over()
                self._progress_at = time.monotonic()  # idle: nothing to be stuck on
                self._wake.wait(0.5)
                self._wake.clear()
                continue
            stats = self.core.scheduler.stats  # kept across a rebuild of the scheduler
            planned = stats.steps
            events = self.core.step(before_wait=hand_over)  # may hand `ready` over
            if events or stats.steps != planned:
                self._progress_at = time.monotonic()
            ready += events
        hand_over()

    def progress_age_s(self) -> float:
        """Seconds since the step loop last progressed (or last found itself idle)."""
        return time.monotonic() - self._progress_at

    def wake(self) -> None:
        """New work arrived."""
        self._wake.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Finish the step in progress and end the thread (blocking)."""
        self._stop = True
        self._wake.set()
        self._thread.join(timeout_s)


class SchedulerActor:
    def __init__(
        self,
        spec: EngineSpec,
        device: str,
        compiled: bool | None = None,
        worker_cpus: float = 1.0,
        pg_name_prefix: str = "",
        worker_threads: int | None = None,
    ) -> None:
        self.spec = spec
        overlap = spec.config.overlap_schedule
        if overlap is None:  # (drafts need every token known: EngineConfig says why)
            overlap = device.startswith("cuda") and spec.config.speculative_tokens == 0
        # Steps in flight at once: with overlap, plan N+1 goes out before N's result is read.
        self.max_inflight = 2 if overlap else 1
        # What start() builds: the TP group's workers (nothing is started before then).
        self._executor = functools.partial(
            RayExecutor,
            spec.worker_spec(device),
            spec.config.tp_size,
            compiled=compiled,
            placement_strategy=spec.config.placement_strategy,
            worker_cpus=worker_cpus,
            worker_threads=worker_threads,
            pg_name_prefix=pg_name_prefix,
        )
        self.phase = Phase.CREATED
        self._core: EngineCore | None = None
        self._steps: StepThread | None = None
        self._queues: dict[int, asyncio.Queue[TokenEvent]] = {}  # polled requests
        # A subscriber's events, waiting for its `subscribe` stream; which requests are whose.
        self._subscribers: dict[str, asyncio.Queue[list[TokenEvent]]] = {}
        self._owners: dict[int, str] = {}
        # A live request's end, set (and dropped) when its finishing event is delivered.
        self._ended: dict[int, asyncio.Event] = {}
        # Set after each step that delivered events (the cache may have changed): wakes
        # the routers waiting in `prefix_digest`.
        self._stepped = asyncio.Event()
        self._transfers = TransferStats()
        # Front ends on this node submit here directly (`request_channel`), once one asks.
        self._channel: RequestChannelServer | None = None

    @property
    def core(self) -> EngineCore:
        if self._core is None or self.phase is not Phase.SERVING:
            raise EngineFailed(f"this engine is {self.phase.value}, not serving")
        return self._core

    async def start(self) -> None:
        """CREATED -> SERVING: build the TP group (off the event loop: it waits on Ray),
        warm the engine up before the first real request, start stepping."""
        if self.phase is not Phase.CREATED:
            raise EngineFailed(f"start() of an engine that is {self.phase.value}")
        executor = await asyncio.to_thread(self._executor)
        core = EngineCore(self.spec, executor, max_inflight=self.max_inflight)
        await asyncio.to_thread(core.warm_up)
        self._core = core
        self._steps = StepThread(core, asyncio.get_running_loop(), self._deliver)
        self.phase = Phase.SERVING

    def _deliver(self, events: list[TokenEvent]) -> None:
        self._stepped.set()
        batches: dict[str, list[TokenEvent]] = {}
        for ev in events:
            key = self._owners.get(ev.rid)
            if key is not None:
                batches.setdefault(key, []).append(ev)
                if ev.finished:
                    del self._owners[ev.rid]
            elif (q := self._queues.get(ev.rid)) is not None:
                q.put_nowait(ev)
            if ev.finished and (ended := self._ended.pop(ev.rid, None)) is not None:
                ended.set()
        for key, batch in batches.items():
            if self._channel is not None and self._channel.send(key, batch):
                continue
            if (sub := self._subscribers.get(key)) is not None:
                sub.put_nowait(batch)

    # -- requests ---------------------------------------------------------------------------------

    async def ready(self) -> bool:
        return self.phase is Phase.SERVING

    async def submit(
        self, input_ids: Sequence[int], sampling: SamplingParams, subscriber: str | None = None
    ) -> int:
        """Queue a request and return its id; its events go to `subscriber`'s stream
        (`subscribe`), or, without one, wait for `poll`. RequestRejected propagates to the
        caller."""
        if subscriber is not None:
            # Events that come before the subscriber's stream opens wait in its queue.
            self._subscribers.setdefault(subscriber, asyncio.Queue())
        return self._queue_request(input_ids, sampling, subscriber)

    def _queue_request(
        self, input_ids: Sequence[int], sampling: SamplingParams, owner: str | None
    ) -> int:
        """Queue a request whose events go to `owner` (a subscriber or request-channel
        key), or without one to a queue of its own for `poll`."""
        rid = self.core.new_rid()
        if owner is None:
            self._queues[rid] = asyncio.Queue()
        else:
            self._owners[rid] = owner
        self._ended[rid] = asyncio.Event()
        try:
            self.core.add_request(input_ids, sampling, rid=rid)
        except BaseException:
            self._queues.pop(rid, None)
            self._owners.pop(rid, None)
            del self._ended[rid]
            raise
        assert self._steps is not None  # SERVING: `core` answered
        self._steps.wake()
        self._stepped.set()  # the load changed
        return rid

    async def abort(self, rid: int, reason: str = "abort") -> TokenEvent | None:
        """End a request; its stream gets the finishing event, which is also returned."""
        return self._abort(rid, reason)

    def _abort(self, rid: int, reason: str) -> TokenEvent | None:
        ev = self.core.abort(rid, FinishReason(reason))
        if ev is not None:
            self._deliver([ev])
        return ev

    async def request_channel(self) -> tuple[str, str]:
        """(this actor's node id, the Unix socket path of its request channel): a front end
        on the same node submits there directly (kvray.cluster.request_channel)."""
        _ = self.core  # raises EngineFailed unless serving
        if self._channel is None:
            # Set before the first await: a concurrent first call must not make a second.
            self._channel = RequestChannelServer(
                submit=self._queue_request,
                abort=self._abort_owned,
                closed=self._channel_closed,
            )
            await self._channel.start()
        return ray.get_runtime_context().get_node_id(), self._channel.path

    def _abort_owned(self, owner: str, rid: int, reason: str) -> None:
        if self._owners.get(rid) == owner:
            self._abort(rid, reason)

    def _channel_closed(self, owner: str) -> None:
        """A front end's channel closed: nobody reads its requests' events any more."""
        for rid in [r for r, o in self._owners.items() if o == owner]:
            if self.phase is Phase.SERVING:
                self._abort(rid, "abort")
            self._owners.pop(rid, None)

    async def finished(self, rid: int) -> None:
        """Return once request `rid` has ended (at once for one unknown or already gone)."""
        ended = self._ended.get(rid)
        if ended is not None:
            await ended.wait()

    async def subscribe(self, key: str) -> AsyncIterator[list[TokenEvent]]:
        """Every event of the requests submitted with subscriber `key`, as they come: each
        item is what was ready (a step's worth, or more if the reader fell behind). Runs
        until the reader goes away; then the queue goes too, and the events of its
        requests still running are dropped (their engine replica's lease aborts them)."""
        queue = self._subscribers.setdefault(key, asyncio.Queue())
        try:
            while True:
                batch = await queue.get()
                while not queue.empty():
                    batch += queue.get_nowait()
                yield batch
        finally:
            if self._subscribers.get(key) is queue:
                del self._subscribers[key]

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
        steps = self._steps
        assert steps is not None  # SERVING: `core` answered
        return {
            **vars(s.stats),
            "num_running": len(s.running),
            "num_waiting": len(s.waiting),
            # Cached-but-evictable pages count as free, as in vLLM.
            "kv_cache_usage": 1.0 - s.cache.available_pages / s.config.num_pages,
            # The prefill budget of the next step and the step-time model behind it.
            **s.budget.info(s.num_decoding, s.num_startable),
            "recoveries": self.core.recoveries,
            "max_inflight_steps": self.max_inflight,
            "pinned_cpus": self.core.executor.pinned_cpus(),
            "step_dispatch": self.core.executor.dispatch,
            # Front ends submitting over the request channel (the rest come through Ray).
            "request_channels": 0 if self._channel is None else self._channel.connections,
            **vars(self._transfers),
            # For /health: a busy engine whose step loop progressed lately is alive, with
            # no probe queued behind its work (kvray.deploy.app.engines_progressing).
            "has_work": s.has_work,
            "progress_age_s": steps.progress_age_s(),
        }

    async def check_integrity(self) -> None:
        self.core.check_integrity()

    async def flush_cache(self) -> None:
        self.core.flush_cache()
        self._stepped.set()

    async def export_prefix(
        self, input_ids: Sequence[int], start: int
    ) -> tuple[int, list[Any]] | None:
        """Copy out the pages of a cached prefix past token `start` (kv_transfer)."""
        return await kv_transfer.export_prefix(self.core, self._transfers, input_ids, start)

    async def fetch_prefix(self, input_ids: Sequence[int], holder: str) -> int:
        """Import from the engine whose scheduler is named `holder` what it caches of
        this prompt beyond this engine's cache (kv_transfer); returns the tokens imported."""
        from kvray.cluster.engine import ACTOR_NAMESPACE

        try:
            actor = await asyncio.to_thread(ray.get_actor, holder, namespace=ACTOR_NAMESPACE)
        except ValueError:
            self._transfers.kv_fetch_failures += 1
            return 0
        added = await kv_transfer.fetch_prefix(self.core, self._transfers, input_ids, actor)
        self._stepped.set()  # the digest changed
        return added

    async def prefix_digest(
        self, epoch: int, seq: int, load: int = -1, wait_s: float = 0.0
    ) -> tuple[DigestDelta | None, int]:
        """(the prefix cache's changes after (epoch, seq) (kvcache.digest), the requests
        running or waiting here), for a router. A long poll: while neither has changed
        (from `load`), waits up to `wait_s` for a step to change them, so a router learns
        of a finished request's prefix within a step without polling fast. The delta is
        None for a cache policy that keeps no digest."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while True:
            core = self.core
            delta = core.prefix_digest(epoch, seq)
            now = core.num_requests
            changed = delta is None or delta.snapshot or delta.seq != seq
            left = deadline - loop.time()
            if changed or now != load or left <= 0:
                return delta, now
            self._stepped.clear()
            try:
                await asyncio.wait_for(self._stepped.wait(), left)
            except TimeoutError:
                pass

    async def is_idle_and_empty(self) -> bool:
        return self.core.is_idle_and_empty()

    async def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        return await asyncio.to_thread(self.core.kv_buffer_shapes)

    async def kill_worker(self, rank: int) -> None:
        assert isinstance(self.core.executor, RayExecutor)
        self.core.executor.kill_worker(rank)

    async def shutdown(self) -> None:
        """-> STOPPED: stop stepping, then release the workers. Safe to call twice."""
        self.phase = Phase.STOPPED
        if self._channel is not None:
            self._channel.close()
        steps, self._steps = self._steps, None
        core, self._core = self._core, None
        if steps is not None:
            await asyncio.to_thread(steps.stop)
        if core is not None:
            await asyncio.to_thread(core.shutdown)
