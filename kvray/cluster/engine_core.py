"""EngineCore: the scheduler, an executor and the overlapped step loop (no Ray here).

One `step()` plans the next StepPlan and submits it, then settles the oldest in-flight
step once `max_inflight` are running: 2 with overlap scheduling (GPU workers by default:
the scheduler builds plan N+1 while the workers compute plan N and learns N's tokens one
step late), else 1 (CPU workers, whose threads already take every core, and in process).

It is thread safe: a loop thread calls `step()` while request threads call `add_request`
/ `abort`; the lock is not held while waiting for the workers.

When a worker is lost, the executor rebuilds the TP group and every unfinished request is
replayed from the tokens the scheduler holds (prompt + tokens generated so far, same
seed): clients see a delay, not an error. A request caught in `MAX_REPLAYS` rebuilds in a
row with no new token in between ends with an error instead of being replayed again: a
request that makes its worker fail every time (a deterministic fault) must not keep the
engine rebuilding forever. (Requests batched with it share its fate once they, too, make
no progress between the failures.) If the group cannot be rebuilt within
`recovery_timeout_s`, those requests end with an error and the engine refuses new work.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from kvray.cluster.executor import Executor, WorkerFailure
from kvray.cluster.spec import EngineSpec
from kvray.core import FinishReason, SamplingParams, StepPlan, TokenEvent
from kvray.kvcache.digest import DigestDelta
from kvray.scheduler import Scheduler, SchedulerStats
from kvray.scheduler.cache import CacheManager

MAX_REPLAYS = 3  # rebuilds in a row, with no new token between them, a request may live through


class EngineFailed(RuntimeError):
    """The engine lost its workers and could not rebuild them."""


class EngineCore:
    def __init__(
        self,
        spec: EngineSpec,
        executor: Executor,
        max_inflight: int = 1,
        recovery_timeout_s: float = 120.0,  # as long as the first build may take
    ) -> None:
        self.spec = spec
        self.executor = executor
        self.max_inflight = max_inflight
        self.recovery_timeout_s = recovery_timeout_s
        self.scheduler = self._new_scheduler()
        self._inflight: deque[tuple[StepPlan, Any]] = deque()
        self._lock = threading.RLock()
        self._rids = itertools.count()
        self.recoveries = 0
        # rid -> (rebuilds in a row without a new token, its output length at the last one)
        self._replays: dict[int, tuple[int, int]] = {}
        self.failed: str | None = None

    def _new_scheduler(self) -> Scheduler:
        spec = self.spec
        return Scheduler(
            spec.scheduler_config(), spec.eos_token_ids, spec.config.seed, spec.vocab_size
        )

    # -- requests -------------------------------------------------------------------------------

    def new_rid(self) -> int:
        return next(self._rids)

    def add_request(
        self, input_ids: Sequence[int], sampling: SamplingParams, rid: int | None = None
    ) -> int:
        """Queue a request; raises RequestRejected (the scheduler's check against this
        engine's vocabulary and sequence length) if it can never be served."""
        with self._lock:
            if self.failed is not None:
                raise EngineFailed(self.failed)
            rid = self.new_rid() if rid is None else rid
            self.scheduler.add_request(rid, input_ids, sampling)
            return rid

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> TokenEvent | None:
        with self._lock:
            return self.scheduler.abort(rid, reason)

    @property
    def has_work(self) -> bool:
        with self._lock:
            return self.scheduler.has_work or bool(self._inflight)

    # -- the loop body ---------------------------------------------------------------------------

    def step(self, before_wait: Callable[[], None] | None = None) -> list[TokenEvent]:
        """Plan and submit one step; settle the oldest once the pipeline is full (or
        nothing new could be planned). Returns the events of the settled step.
        `before_wait` runs once the new plan is on its way (or none could be made), before
        this waits for a result: work done there overlaps the workers' compute instead of
        delaying their next plan."""
        with self._lock:
            plan = self.scheduler.step()
            if plan is not None:
                try:
                    self._inflight.append((plan, self.executor.submit(plan)))
                except WorkerFailure:
                    return self._recover()
        if before_wait is not None:
            before_wait()
        with self._lock:
            if not self._inflight:
                return []
            if plan is not None and len(self._inflight) < self.max_inflight:
                return []
            _, handle = self._inflight.popleft()
        try:
            result = self.executor.wait(handle)  # without the lock: requests keep arriving
        except WorkerFailure:
            return self._recover()
        with self._lock:
            if result is None:
                return []
            return self.scheduler.process_result(result)

    def _recover(self) -> list[TokenEvent]:
        """Rebuild the workers and replay every unfinished request."""
        with self._lock:
            self._inflight.clear()
            old = self.scheduler
            live = old.live_requests()
            try:
                self.executor.rebuild(self.recovery_timeout_s)
            except Exception as e:  # noqa: BLE001 - any rebuild failure ends the engine
                self.failed = f"lost a worker and could not rebuild the TP group: {e}"
                for req in live:
                    old.abort(req.rid)
                return [
                    TokenEvent(r.rid, None, finish_reason=FinishReason.ABORT, error=self.failed)
                    for r in live
                ]
            self.scheduler = self._new_scheduler()
            self.scheduler.stats = old.stats  # counters stay monotonic across a rebuild
            self.scheduler.budget.cost = old.budget.cost  # same machine: keep what it learned
            replays: dict[int, tuple[int, int]] = {}
            ended = []
            for req in live:
                count, had = self._replays.get(req.rid, (0, -1))
                n = len(req.output_ids)
                count = count + 1 if n == had else 1
                if count < MAX_REPLAYS:
                    replays[req.rid] = (count, n)
                    self.scheduler.readmit(req)
                    continue
                ended.append(
                    TokenEvent(
                        req.rid,
                        None,
                        finish_reason=FinishReason.ABORT,
                        error=f"the engine's worker failed {MAX_REPLAYS} times while serving "
                        "this request; it is not retried again",
                    )
                )
            self._replays = replays
            self.recoveries += 1
            return ended

    def warm_up(self, num_decodes: int = 8, max_tokens: int = 4) -> None:
        """Run throwaway requests through the whole path once: one full prefill chunk, then
        a batch of decodes, so a server's first real requests do not pay for first-time
        allocations and kernel setup. Afterwards nothing of them is left: the prefix cache
        is flushed and the counters start from zero."""
        cfg = self.spec.scheduler_config()
        capacity = cfg.num_pages * cfg.page_size
        long_len = min(cfg.max_prefill_tokens, cfg.effective_max_seq_len, capacity // 2)
        long_len -= max_tokens
        short_len = min(16, long_len)
        if short_len <= 0:
            return  # a pool too small to hold even a short prompt: nothing to warm
        # Arbitrary distinct prompts (seeded), with ids clear of the special tokens at
        # either end of a vocabulary.
        rng = np.random.default_rng(0)
        vocab = self.spec.vocab_size
        lo, hi = (100, vocab - 100) if vocab > 200 else (0, vocab)
        sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        room = (capacity - long_len - max_tokens) // (short_len + max_tokens + cfg.page_size)
        num_short = max(0, min(num_decodes, room, cfg.max_running_reqs - 1))
        lengths = [long_len] + [short_len] * num_short
        prompts = [rng.integers(lo, hi, n).tolist() for n in lengths]
        for ids in prompts:
            self.add_request(ids, sampling)
        while self.has_work:
            self.step()
        with self._lock:
            if self.failed is None:
                self.scheduler.flush_cache()
                self.scheduler.stats = SchedulerStats()

    # -- inspection ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        with self._lock:
            self.scheduler.check_integrity()

    def flush_cache(self) -> None:
        with self._lock:
            self.scheduler.flush_cache()

    @contextlib.contextmanager
    def cache_locked(self) -> Iterator[CacheManager]:
        """The scheduler's CacheManager, with the core locked (no step is being planned):
        for moving prefixes in and out between steps (kvray.cluster.kv_transfer)."""
        with self._lock:
            yield self.scheduler.cache

    @property
    def num_requests(self) -> int:
        """Requests running or waiting."""
        with self._lock:
            return len(self.scheduler.running) + len(self.scheduler.waiting)

    def prefix_digest(self, epoch: int, seq: int) -> DigestDelta | None:
        """The changes to the prefix cache's digest after (epoch, seq) (kvcache.digest);
        None for a cache policy without one. A rebuild's new scheduler is a new epoch."""
        with self._lock:
            digest = self.scheduler.cache.prefix_cache.digest
            return None if digest is None else digest.since(epoch, seq)

    def is_idle_and_empty(self) -> bool:
        with self._lock:
            return not self._inflight and self.scheduler.is_idle_and_empty()

    def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        with self._lock:  # not during a rebuild
            return self.executor.kv_buffer_shapes()

    def shutdown(self) -> None:
        with self._lock:
            self.executor.shutdown()
