"""LocalEngine: the scheduler and one worker in this process (TP 1, no Ray).

It is the same code path the Ray engine runs (Scheduler -> StepPlan -> ModelWorker ->
StepResult -> Scheduler), minus the actors: tests and offline use exercise the exact
scheduling and worker logic the cluster runs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from kvray.cluster.spec import EngineSpec
from kvray.config import EngineConfig
from kvray.core import FinishReason, RequestRejected, SamplingParams, TokenEvent
from kvray.models import TPGroup
from kvray.scheduler import Scheduler
from kvray.workers.worker import ModelWorker


def validate_prompt(input_ids: Sequence[int], vocab_size: int) -> list[int]:
    """Token ids must be ints in [0, vocab_size)."""
    ids = list(input_ids)
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab_size:
            raise RequestRejected(
                f"token id {t!r} is not in this model's vocabulary [0, {vocab_size})", "prompt"
            )
    return ids


class LocalEngine:
    def __init__(
        self, config: EngineConfig, spec: EngineSpec | None = None, device: str | None = None
    ) -> None:
        if config.tp_size != 1:
            raise ValueError("LocalEngine runs TP 1; use the Ray engine for tp_size > 1")
        self.spec = spec or EngineSpec.resolve(config)
        self.config = config
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.worker = ModelWorker(self.spec.worker_spec(device), TPGroup())
        self.scheduler = Scheduler(
            self.spec.scheduler_config(), self.spec.eos_token_ids, seed=config.seed
        )
        self._rids = itertools.count()

    def add_request(self, input_ids: Sequence[int], sampling: SamplingParams) -> int:
        rid = next(self._rids)
        self.scheduler.add_request(rid, validate_prompt(input_ids, self.spec.vocab_size), sampling)
        return rid

    def abort(self, rid: int, reason: FinishReason = FinishReason.ABORT) -> TokenEvent | None:
        return self.scheduler.abort(rid, reason)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def step(self) -> list[TokenEvent]:
        """Plan, execute and settle one step (synchronously)."""
        plan = self.scheduler.step()
        if plan is None:
            return []
        result = self.worker.execute(plan)
        return self.scheduler.process_result(result) if result is not None else []

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    def flush_cache(self) -> None:
        self.scheduler.flush_cache()
