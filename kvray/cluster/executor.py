"""Executors run StepPlans on the model workers: in this process, or on Ray actors.

`submit(plan)` starts a step and returns a handle; `wait(handle)` returns rank 0's
StepResult, in submission order. Up to two steps may be in flight (overlap scheduling).
A lost worker surfaces as `WorkerFailure` from `wait`; `rebuild()` then replaces the whole
TP group (every K/V is gone, so the engine replays its requests).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from kvray.core import StepPlan, StepResult
from kvray.models import TPGroup
from kvray.workers.worker import ModelWorker, WorkerSpec


class WorkerFailure(RuntimeError):
    """A worker died or its TP group broke; the step's result is lost."""


class Executor(ABC):
    @abstractmethod
    def submit(self, plan: StepPlan) -> Any: ...

    @abstractmethod
    def wait(self, handle: Any) -> StepResult | None: ...

    @abstractmethod
    def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        """The KV buffer shape each rank holds, in rank order."""

    def pinned_cpus(self) -> list[tuple[int, ...]]:
        """The cores each rank's torch threads are pinned to, in rank order (empty: the
        threads float). Only worker actors pin (`kvray.workers.cpu_bind`)."""
        return [()]

    @property
    def dispatch(self) -> str:
        """How a step reaches the workers (shown in the engine's stats)."""
        return "in_process"

    def rebuild(self, timeout_s: float) -> None:
        raise WorkerFailure("this executor cannot rebuild its workers")

    def shutdown(self) -> None:  # noqa: B027 (an optional hook)
        """Release the workers."""


class LocalExecutor(Executor):
    """One worker in this process (TP 1): submit computes the step at once."""

    def __init__(self, spec: WorkerSpec) -> None:
        self.spec = spec
        self.worker = ModelWorker(spec, TPGroup())

    def rebuild(self, timeout_s: float) -> None:
        """A fresh worker: every K/V, token-pool and grammar state is gone, as when a TP
        group is rebuilt, so the engine replays its requests from the tokens they hold."""
        self.worker = ModelWorker(self.spec, TPGroup())

    def submit(self, plan: StepPlan) -> StepResult | None:
        return self.worker.execute(plan)

    def wait(self, handle: StepResult | None) -> StepResult | None:
        return handle

    def kv_buffer_shapes(self) -> list[tuple[int, ...]]:
        return [self.worker.kv_buffer_shape]
