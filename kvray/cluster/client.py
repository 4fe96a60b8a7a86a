"""EngineClient: what a front end (the offline `LLM`, tests, benchmarks) calls on an engine,
whichever way it runs: `LocalEngine` in this process, or `Engine` on Ray actors. Both
implement it, so callers never branch on the kind of engine."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvray.core import FinishReason, SamplingParams, TokenEvent


class EngineClient(Protocol):
    def submit(self, input_ids: Sequence[int], sampling: SamplingParams) -> int:
        """Queue a request; returns its id. Raises RequestRejected if it can never fit."""

    def poll(self, rids: Sequence[int], timeout_s: float = 1.0) -> list[TokenEvent]:
        """Events produced since the last poll for any of `rids` (an in-process engine
        computes a step to produce them; a remote one waits up to `timeout_s`)."""

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> TokenEvent | None:
        """End a request; its finishing event, or None if it had already finished."""

    def check_integrity(self) -> None:
        """Assert the scheduler's page accounting."""

    def flush_cache(self) -> None:
        """Drop every unlocked prefix from the prefix cache."""

    def is_idle_and_empty(self) -> bool:
        """No request in flight and, after a flush, every page free."""

    def shutdown(self) -> None:
        """Release the engine's workers."""
