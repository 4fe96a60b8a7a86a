"""Every setting of an engine, declared once (pydantic, frozen).

`EngineConfig` is the one declaration: each field carries its default, its bounds and its
documentation, and everything else is derived from it — `LLM(**kwargs)`, the `kvray`
command's flags (`kvray.deploy.flags`), the serve config that Ray Serve and the Helm chart
use (`kvray.deploy.settings.ServeConfig` extends it with the server's own settings).
`SchedulerConfig` is the slice the scheduler needs, its fields taken from `EngineConfig`'s,
plus the two numbers only a checkpoint can settle (pool size and longest sequence).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.fields import FieldInfo

CachePolicy = Literal["radix", "naive"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Device = Literal["auto", "cpu", "cuda"]
PlacementStrategy = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]


# vLLM's other names of two dtypes (its --dtype and LLM(dtype=) take them), read as ours.
DTYPE_ALIASES = {"half": "float16", "float": "float32"}


# vLLM's `LLM(...)` / engine-argument names of EngineConfig fields, and those of its
# arguments that change nothing here (accepted with a warning; see kvray.deploy.vllm_flags).
VLLM_ENGINE_ARGS = {
    "tensor_parallel_size": "tp_size",
    "max_model_len": "max_seq_len",
    "max_num_seqs": "max_running_reqs",
    "max_num_batched_tokens": "max_prefill_tokens",
    "block_size": "page_size",
}
VLLM_IGNORED_ARGS = ("trust_remote_code", "gpu_memory_utilization", "enforce_eager")


def cli_aliases(*flags: str, sized: bool = False) -> dict[str, Any]:
    """Extra command-line spellings of a field's flag (its own is --field-name); `sized`:
    the flag also reads token counts as vLLM's do (32k, 1.5k, 32K = 32768)."""
    return {"cli_aliases": list(flags), **({"sized": True} if sized else {})}


def _check_lookup(config: Any) -> Any:
    if config.prompt_lookup_min > config.prompt_lookup_max:
        raise ValueError(
            f"prompt_lookup_min ({config.prompt_lookup_min}) must not exceed "
            f"prompt_lookup_max ({config.prompt_lookup_max})"
        )
    return config


def _check_drafts_without_overlap(config: EngineConfig) -> EngineConfig:
    if config.overlap_schedule and config.speculative_tokens:
        raise ValueError(
            "speculative_tokens needs overlap_schedule off: a request's drafts come from "
            "its tokens, which must all be known when its step is planned (leave "
            "overlap_schedule unset, and it is off whenever speculative_tokens is set)"
        )
    return config


class EngineConfig(BaseModel):
    """One engine: model, parallelism, KV pool and scheduling."""

    model_config = ConfigDict(frozen=True, extra="forbid", protected_namespaces=())

    model: str | None = Field(
        default=None,
        description="Hugging Face checkpoint directory, or model id (org/name: from the Hub's "
        "local cache, else downloaded); None: the embedded SmolLM2-135M-Instruct",
    )
    tp_size: int = Field(
        default=1,
        gt=0,
        description="tensor-parallel ranks (GPUs) per engine",
        json_schema_extra=cli_aliases("--tp", "--tensor-parallel-size", "-tp"),
    )
    dtype: DType = Field(
        default="auto",
        description="weights and KV dtype; auto follows the checkpoint, running float32 "
        "checkpoints in bfloat16, but runs float32 on a CPU without fast bfloat16 (no "
        "AVX-512) (ask for float32 for exact-reference runs); vLLM's half and float mean "
        "float16 and float32",
        json_schema_extra={"value_aliases": DTYPE_ALIASES},
    )
    device: Device = Field(
        default="auto", description="where the model runs; auto: CUDA when there is a GPU"
    )
    page_size: int = Field(
        default=16,
        gt=0,
        description="tokens per KV page",
        json_schema_extra=cli_aliases("--block-size"),
    )
    num_pages: int | None = Field(
        default=None, gt=0, description="KV pages per rank; None: sized by kv_cache_memory_gb"
    )
    kv_cache_memory_gb: float = Field(
        default=2.0, gt=0, description="KV pool per rank, in GiB, when num_pages is None"
    )
    cache_policy: CachePolicy = Field(
        default="radix",
        description="prefix cache: radix shares prefixes between requests, naive does not",
        json_schema_extra=cli_aliases("--cache"),
    )
    max_running_reqs: int = Field(
        default=256,
        gt=0,
        description="requests decoding at once (page_table rows)",
        json_schema_extra=cli_aliases("--max-running", "--max-num-seqs"),
    )
    max_prefill_tokens: int = Field(
        default=2048,
        gt=0,
        description="prompt tokens computed per step (the prefill chunk)",
        json_schema_extra=cli_aliases("--max-num-batched-tokens", sized=True),
    )
    itl_target_ms: float | None = Field(
        default=None,
        gt=0,
        description="inter-token-latency target: a step with running decodes computes only as "
        "many prompt tokens as fit in this many ms by a step-time model learned online (but "
        "at least a sixteenth of max_prefill_tokens, so prompts keep advancing when the decodes "
        "alone fill the target, or a sixteenth for every two requests waiting to start "
        "when that is more, so a queue cannot grow without bound); None: every step computes up to "
        "max_prefill_tokens",
    )
    max_seq_len: int | None = Field(
        default=None,
        gt=1,
        description="longest prompt + output; None: the model's context",
        json_schema_extra=cli_aliases("--max-model-len", sized=True),
    )
    speculative_tokens: int = Field(
        default=0,
        ge=0,
        le=16,
        description="n-gram speculative decoding (prompt lookup): each step, a greedy request "
        "drafts up to this many tokens that followed the last occurrence of its latest "
        "tokens earlier in its prompt and output, and one step checks them all, keeping the "
        "draft up to its first token that greedy decoding would not have chosen. The tokens "
        "are exactly those of plain greedy decoding; requests that sample, ask for logprobs "
        "or follow a grammar decode one token a step. 0: off",
    )
    prompt_lookup_max: int = Field(
        default=3, gt=0, description="longest run of a request's latest tokens a draft matches"
    )
    prompt_lookup_min: int = Field(
        default=1, gt=0, description="shortest run of a request's latest tokens a draft matches"
    )
    attention_backend: str = Field(
        default="auto",
        min_length=1,
        description="attention kernels; auto: flash_attn or triton on CUDA, cpu or torch on CPUs",
    )
    overlap_schedule: bool | None = Field(
        default=None,
        description="plan step N+1 while the workers compute step N (the scheduler learns "
        "N's tokens one step late). It hides the scheduler's time behind a GPU's; on CPUs "
        "the workers' threads already take every core, and a request arriving mid-step "
        "then waits for one more step before its prompt is computed. None: on for CUDA "
        "workers, off on CPUs and with speculative_tokens",
    )
    small_batch_kernel: bool | None = Field(
        default=None,
        description="on CPUs with AMX, in bfloat16: multiply decode steps and short prompts "
        "(up to 96-512 rows, fewer for larger weights) with kvray's tile kernel, from a second "
        "copy of every linear weight, where oneDNN is slow; each row's result is then "
        "independent of the batch (and bit-identical to F.linear up to 32 rows); None: on "
        "where that copy takes at most 4 GiB per rank",
    )
    bind_threads: bool = Field(
        default=True,
        description="pin each CPU worker actor's torch threads one per core, on cores no other "
        "kvray worker on the node has claimed (lock files); where too few are free, or a "
        "cgroup CPU quota says the cores are shared, the threads float. In-process engines "
        "never pin",
    )
    step_channel: bool = Field(
        default=True,
        description="send each step to worker actors on the scheduler's node over a direct Unix "
        "socket (tens of microseconds) instead of a Ray actor call (milliseconds, and CPU on the "
        "cores the step computes on); workers on other nodes always get actor calls, and a "
        "compiled graph (--compiled-graph) takes precedence",
    )
    seed: int = Field(default=0, description="seeds requests that bring none of their own")
    placement_strategy: PlacementStrategy = Field(
        default="PACK", description="Ray placement of one engine's TP workers"
    )

    _lookup = model_validator(mode="after")(_check_lookup)
    _drafts = model_validator(mode="after")(_check_drafts_without_overlap)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_alias(cls, value: object) -> object:
        return DTYPE_ALIASES.get(value, value) if isinstance(value, str) else value

    def scheduler_config(self, num_pages: int, max_seq_len: int) -> SchedulerConfig:
        shared = {name: getattr(self, name) for name in SchedulerConfig.shared_fields()}
        return SchedulerConfig(num_pages=num_pages, max_seq_len=max_seq_len, **shared)


def _engine_field(name: str) -> Any:
    """EngineConfig's declaration of `name` (default, bounds, description), to share."""
    field: FieldInfo = EngineConfig.model_fields[name]
    return field


class SchedulerConfig(BaseModel):
    """What the scheduler needs to hand out pages, rows and per-step token budgets."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    num_pages: int = Field(
        gt=0, description="usable KV pages (the pool has one more, the dummy page)"
    )
    max_seq_len: int = Field(gt=1, description="longest prompt + output (resolved)")
    page_size: int = _engine_field("page_size")
    max_running_reqs: int = _engine_field("max_running_reqs")
    max_prefill_tokens: int = _engine_field("max_prefill_tokens")
    itl_target_ms: float | None = _engine_field("itl_target_ms")
    cache_policy: CachePolicy = _engine_field("cache_policy")
    speculative_tokens: int = _engine_field("speculative_tokens")
    prompt_lookup_max: int = _engine_field("prompt_lookup_max")
    prompt_lookup_min: int = _engine_field("prompt_lookup_min")

    _lookup = model_validator(mode="after")(_check_lookup)

    @classmethod
    def shared_fields(cls) -> list[str]:
        """The fields taken from EngineConfig as they are."""
        return [name for name in cls.model_fields if name not in ("num_pages", "max_seq_len")]

    @property
    def num_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def effective_max_seq_len(self) -> int:
        """A sequence can never be longer than the model allows or the pool holds."""
        return min(self.max_seq_len, self.num_tokens)
