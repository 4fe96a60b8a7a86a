"""K/V of cached prefixes copied between engines (replicas of one deployment) through Ray's
object store, so an engine that misses a prefix another one holds fetches it instead of
computing it.

Holder (`export_prefix`): lock the cached prefix's pages in its radix tree, have each TP
rank copy its share of those pages into the object store (`WorkerActor.export_pages`),
unlock once every copy is there, and hand out the copies' refs. The lock never outlives
the holder's own call: a fetching engine that dies leaves nothing locked.

Fetcher (`fetch_prefix`): lock its own cached prefix of the prompt (the import extends it),
ask the holder for the pages past it, reserve pages for them (evicting if need be), have
rank r write the copy of the holder's rank r (`WorkerActor.import_pages`: same TP layout,
the engines are replicas), then insert the prefix into its tree. The request submitted next
finds it cached and computes only the rest. Every failure (holder gone, nothing to export,
no pages, a rank failed) ends with the reserved pages freed and the local lock released,
and the request simply computes its prompt: correctness never depends on a fetch.

Pages are reserved only while the holder's copy is already in the object store, and the
write to them is never abandoned part way (no timeout on it: it waits behind at most one
step), so no late write can land in a page that was handed to someone else. Dispatch over
compiled graphs keeps the workers' execution loop busy, so engines dispatching that way
neither export nor import (the request computes).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from kvray import histogram
from kvray.cluster.engine_core import EngineCore
from kvray.cluster.ray_executor import RayExecutor

_log = logging.getLogger(__name__)

EXPORT_TIMEOUT_S = 10.0  # a holder whose copies take longer is given up
FETCH_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class TransferStats:
    """Counters of one engine's prefix fetches (monotonic)."""

    kv_fetches: int = 0  # fetches that imported K/V
    kv_fetch_failures: int = 0  # fetches that fell back to computing
    kv_fetched_tokens: int = 0  # prompt tokens whose K/V was imported, not computed
    kv_exports: int = 0  # prefixes this engine copied out to another
    kv_fetch_seconds_sum: float = 0.0
    # cumulative counts of fetch durations <= each of FETCH_BUCKETS_S, then +Inf
    kv_fetch_seconds_buckets: list[int] = field(
        default_factory=lambda: histogram.empty_buckets(FETCH_BUCKETS_S)
    )

    def observe(self, seconds: float) -> None:
        self.kv_fetch_seconds_sum += seconds
        histogram.observe(self.kv_fetch_seconds_buckets, FETCH_BUCKETS_S, seconds)


def _workers(core: EngineCore) -> list[Any] | None:
    """The TP ranks' actors, if this engine can move pages (plain actor dispatch)."""
    executor = core.executor
    if not isinstance(executor, RayExecutor) or executor.compiled:
        return None
    return list(executor.actors)


async def export_prefix(
    core: EngineCore, stats: TransferStats, input_ids: Sequence[int], start: int
) -> tuple[int, list[Any]] | None:
    """(the cached prefix length, one ref per TP rank to its copy of the pages of tokens
    [start, length)), or None if this engine holds no whole page of it past `start`."""
    with core.cache_locked() as cache:
        workers = _workers(core)
        lease = cache.lease_export(input_ids, start) if workers else None
    if lease is None or not workers:
        return None
    try:
        refs = [w.export_pages.remote(lease.pages) for w in workers]
        ready, _ = await asyncio.to_thread(
            ray.wait, refs, num_returns=len(refs), timeout=EXPORT_TIMEOUT_S, fetch_local=False
        )
        if len(ready) < len(refs):
            return None
    finally:
        with core.cache_locked():
            cache.end_export(lease)
    stats.kv_exports += 1
    return lease.tokens, refs


async def fetch_prefix(
    core: EngineCore, stats: TransferStats, input_ids: Sequence[int], holder: Any
) -> int:
    """Import what `holder` (a SchedulerActor handle) caches of the prompt's prefix beyond
    this engine's cache; returns the tokens imported (0: the request computes them)."""
    t0 = time.perf_counter()
    ids = list(input_ids[: len(input_ids) - 1])  # what a request matches (kvray.scheduler)
    with core.cache_locked() as cache:
        workers = _workers(core)
        lease = cache.lease_import(ids)
    written, added = False, 0
    try:
        if workers is None:
            return 0
        got = await asyncio.wait_for(
            holder.export_prefix.remote(ids, lease.start), EXPORT_TIMEOUT_S + 5.0
        )
        if got is None:
            return 0
        tokens, refs = got
        if len(refs) != len(workers):
            raise RuntimeError(f"the holder has {len(refs)} TP ranks, this engine {len(workers)}")
        with core.cache_locked():
            pages = cache.reserve_import(lease, (tokens - lease.start) // cache.page_size)
        # Not timed out: a write abandoned part way could land after its pages were freed.
        await asyncio.gather(
            *(w.import_pages.remote(pages, ref) for w, ref in zip(workers, refs, strict=True))
        )
        written = True
    except Exception as e:  # noqa: BLE001 - any failure: the request computes its prompt
        _log.warning("prefix fetch failed, computing instead: %s", e)
    finally:
        with core.cache_locked():
            added = cache.end_import(lease, ids, written)
        if written:
            stats.kv_fetches += 1
            stats.kv_fetched_tokens += added
            stats.observe(time.perf_counter() - t0)
        else:
            stats.kv_fetch_failures += 1
    return added
