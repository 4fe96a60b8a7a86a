"""Every knob of the engine, validated once (pydantic, frozen).

`EngineConfig` is the one source of truth; `SchedulerConfig` is the slice of it that the
scheduler needs (the scheduler never sees model or device settings).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

CachePolicy = Literal["radix", "naive"]
DType = Literal["auto", "float32", "bfloat16", "float16"]


class SchedulerConfig(BaseModel):
    """What the scheduler needs to hand out pages, rows and per-step token budgets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_pages: int = Field(
        gt=0, description="usable KV pages (the pool has one more, the dummy page)"
    )
    page_size: int = Field(default=16, gt=0, description="tokens per KV page")
    max_running_reqs: int = Field(default=256, gt=0, description="page_table rows")
    max_prefill_tokens: int = Field(
        default=2048, gt=0, description="prefill tokens computed per step (the chunk budget)"
    )
    max_seq_len: int = Field(default=4096, gt=1, description="longest prompt + output")
    cache_policy: CachePolicy = "radix"

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def effective_max_seq_len(self) -> int:
        """A sequence can never be longer than the model allows or the pool holds."""
        return min(self.max_seq_len, self.num_tokens)


class EngineConfig(BaseModel):
    """One engine: model, parallelism, KV pool and scheduling knobs."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str | None = Field(
        default=None, description="HF checkpoint dir; None = embedded SmolLM2"
    )
    tp_size: int = Field(default=1, gt=0)
    dtype: DType = "auto"
    page_size: int = Field(default=16, gt=0)
    num_pages: int | None = Field(default=None, gt=0, description="None = sized from memory")
    kv_cache_memory_gb: float = Field(default=2.0, gt=0, description="used when num_pages is None")
    cache_policy: CachePolicy = "radix"
    max_running_reqs: int = Field(default=256, gt=0)
    max_prefill_tokens: int = Field(default=2048, gt=0)
    max_seq_len: int | None = Field(default=None, gt=1, description="None = the model's context")
    attention_backend: str = "auto"
    seed: int = 0
    device: Literal["auto", "cpu", "cuda"] = "auto"  # auto: CUDA when the cluster has GPUs
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "PACK"

    def scheduler_config(self, num_pages: int, max_seq_len: int) -> SchedulerConfig:
        return SchedulerConfig(
            num_pages=num_pages,
            page_size=self.page_size,
            max_running_reqs=self.max_running_reqs,
            max_prefill_tokens=self.max_prefill_tokens,
            max_seq_len=max_seq_len,
            cache_policy=self.cache_policy,
        )
