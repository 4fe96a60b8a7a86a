"""A histogram's state as plain numbers, kept by an engine in its stats: cumulative counts
of the observations at or below each bound (Prometheus's `le`), then +Inf, and their sum.
Plain lists travel through Ray with the rest of the stats; the API server's collector adds
up every engine's at scrape time (`kvray.deploy.metrics`)."""

from __future__ import annotations

from collections.abc import Sequence


def empty_buckets(bounds: Sequence[float]) -> list[int]:
    """The counts of no observation: one per bound, and one for +Inf."""
    return [0] * (len(bounds) + 1)


def observe(counts: list[int], bounds: Sequence[float], value: float) -> None:
    """Count `value` in every bucket whose bound it does not exceed (+Inf last: all)."""
    for i, bound in enumerate(bounds):
        if value <= bound:
            counts[i] += 1
    counts[-1] += 1
