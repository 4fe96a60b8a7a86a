"""LocalEngine: the engine core with one worker in this process (TP 1, no Ray).

It runs the same code path as the Ray engine (Scheduler -> StepPlan -> ModelWorker ->
StepResult -> Scheduler), minus the actors, so tests and offline use exercise the exact
scheduling and worker logic the cluster runs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvray.cluster.engine_core import EngineCore
from kvray.cluster.executor import LocalExecutor
from kvray.cluster.spec import EngineSpec, resolve_device
from kvray.config import EngineConfig
from kvray.core import SamplingParams, TokenEvent
from kvray.workers.worker import ModelWorker


class LocalEngine(EngineCore):
    """`device` overrides `config.device` ("auto": CUDA when this process sees a GPU).
    An `EngineClient`: `poll` computes the next step here."""

    def __init__(
        self, config: EngineConfig, spec: EngineSpec | None = None, device: str | None = None
    ) -> None:
        if config.tp_size != 1:
            raise ValueError("LocalEngine runs TP 1; use the Ray engine for tp_size > 1")
        spec = spec or EngineSpec.resolve(config)
        device = resolve_device(device or config.device)
        if device == "cuda" and not torch.cuda.is_available():
            raise ValueError("device is cuda, but this process's torch sees no CUDA GPU")
        # In process the step is computed inside submit: nothing to overlap with.
        super().__init__(spec, LocalExecutor(spec.worker_spec(device)), max_inflight=1)

    @property
    def worker(self) -> ModelWorker:
        assert isinstance(self.executor, LocalExecutor)
        return self.executor.worker

    def submit(self, input_ids: Sequence[int], sampling: SamplingParams) -> int:
        return self.add_request(input_ids, sampling)

    def poll(self, rids: Sequence[int], timeout_s: float = 1.0) -> list[TokenEvent]:
        return self.step()
