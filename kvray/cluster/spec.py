"""EngineSpec: an EngineConfig resolved against a real checkpoint (one home for the rules
that turn "auto"/None knobs into numbers), shared by the in-process and Ray engines."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from kvray.config import EngineConfig, SchedulerConfig
from kvray.kvcache.base import div_even
from kvray.models import ModelConfig
from kvray.workers.worker import WorkerSpec

_DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def resolve_model_path(model: str | None, progress: bool = True, weights: bool = True) -> Path:
    """A checkpoint directory: `model` itself, or a Hugging Face model id (`org/name`, as
    vLLM takes) through the Hub's local cache, downloading what is missing or stale (only
    the files kvray reads; with HF_HUB_OFFLINE=1 the cache alone, as in vLLM). `weights`
    False: a Hub model's config and tokenizer files only (for a process that only
    tokenizes). None means the embedded SmolLM2 (converted once, cached)."""
    if model is None:
        from kvray.models.embedded import ensure_embedded_model

        return ensure_embedded_model(progress=progress)
    path = Path(model).expanduser()
    if (path / "config.json").is_file():
        return path
    if is_hub_id(model):
        return _from_hub(model, weights)
    raise FileNotFoundError(
        f"{model!r} is not a Hugging Face checkpoint directory (no config.json), nor a "
        "Hugging Face model id (org/name)"
    )


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
# What kvray reads from a checkpoint besides its weights: config, tokenizer and chat
# template files, at the repository's top level (fnmatch's `*` also crosses `/`, so the
# patterns exclude subfolders explicitly).
_HUB_FILES = ["*.json", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
_HUB_IGNORE = ["*/*"]
_INDEX = "model.safetensors.index.json"


def is_hub_id(model: str) -> bool:
    """Whether `model` names a Hugging Face model rather than a local directory."""
    return _HUB_ID.fullmatch(model) is not None and not Path(model).expanduser().exists()


def _index_shards(path: Path) -> list[str]:
    """The weight files model.safetensors.index.json names."""
    return sorted(set(json.loads((path / _INDEX).read_text()).get("weight_map", {}).values()))


def _missing_weights(path: Path) -> list[str]:
    """The safetensors files the checkpoint at `path` names and lacks: the index's shards,
    or, without an index, a "*.safetensors" when there is none."""
    if (path / _INDEX).is_file():
        return [f for f in _index_shards(path) if not (path / f).is_file()]
    return [] if any(path.glob("*.safetensors")) else ["*.safetensors"]


def _from_hub(model: str, weights: bool) -> Path:
    from huggingface_hub import constants, snapshot_download

    # Online, the Hub is asked for the current revision and only what the cache lacks is
    # fetched; offline (HF_HUB_OFFLINE, as the Hub library reads it, or the Hub
    # unreachable) the cached snapshot is used if it holds everything. A snapshot left by
    # AutoConfig/AutoTokenizer holds only some files, so what it holds is checked, not
    # assumed.
    offline = bool(constants.HF_HUB_OFFLINE)

    def fetch(patterns: list[str]) -> Path:
        return Path(
            snapshot_download(
                model,
                allow_patterns=patterns,
                ignore_patterns=_HUB_IGNORE,
                local_files_only=offline,
            )
        )

    try:
        path = fetch(_HUB_FILES)
        if weights and (path / "config.json").is_file():
            # The shards the index names (not a consolidated copy beside them), else all.
            index = (path / _INDEX).is_file()
            path = fetch(_index_shards(path) if index else ["*.safetensors"])
    except Exception as e:  # noqa: BLE001 - offline, unknown, gated: say which, in one line
        why = "(HF_HUB_OFFLINE)" if offline else "and could not be downloaded"
        raise FileNotFoundError(
            f"{model!r} is not a local checkpoint directory, and the Hugging Face model of "
            f"that id is not in the local cache {why} "
            f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
        ) from None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"the Hugging Face model {model!r} has no config.json")
    if weights and (missing := _missing_weights(path)):
        raise FileNotFoundError(
            f"the Hugging Face model {model!r} has no {', '.join(missing[:3])} in {path}"
            + (" (HF_HUB_OFFLINE: the cache alone was read)" if offline else "")
            + " (kvray reads safetensors weights only)"
        )
    return path


def cpu_has_fast_bfloat16() -> bool:
    """Whether this CPU computes bfloat16 matmuls at least as fast as float32: oneDNN's
    bfloat16 kernels need AVX-512 (native BF16 or AMX best). Without them (AVX2 only)
    torch falls back to a reference path: on a 2-core AMD EPYC with AVX2, the embedded
    model's 2,048-token prefill took 5x as long as in float32, and its decode 4.5x."""
    return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve_device(requested: str) -> str:
    """ "auto" is CUDA when this process's torch sees a GPU, else the CPU."""
    if requested != "auto":
        return requested
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(requested: str, checkpoint: torch.dtype, device: str = "cpu") -> str:
    """ "auto" follows the checkpoint, except that float32 checkpoints run in bfloat16
    (as vLLM does), and that on a CPU without fast bfloat16 (`cpu_has_fast_bfloat16`)
    every checkpoint runs in float32; ask for "float32" explicitly for exact-reference
    runs."""
    if requested != "auto":
        return requested
    if device == "cpu" and not cpu_has_fast_bfloat16():
        return "float32"
    if checkpoint == torch.float32:
        return "bfloat16"
    return _DTYPE_NAMES.get(checkpoint, "bfloat16")


def _eos_ids(path: Path, model_config: ModelConfig) -> tuple[int, ...]:
    """The EOS ids `generate` stops at: generation_config.json's where the checkpoint has
    that file (chat models often name their end-of-turn token only there; one that names
    none stops nowhere, as in transformers), config.json's otherwise."""
    gen = path / "generation_config.json"
    if not gen.is_file():
        return tuple(sorted(set(model_config.eos_token_ids)))
    eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(sorted({int(eos)} if isinstance(eos, int) else {int(t) for t in eos}))


# generation_config.json keys -> the SamplingParams field each one is the default of.
_SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(path: Path) -> dict[str, float | int]:
    """The sampling settings a checkpoint ships in generation_config.json (Qwen3's
    temperature 0.6, top_p 0.95, top_k 20, ...), by SamplingParams field: the defaults of
    a request that leaves them unset, as in vLLM (its `--generation-config auto`). Keys the
    file leaves out, or sets to null, are not defaults; nor is any value SamplingParams
    would refuse (a checkpoint's typo must not fail every request)."""
    from kvray.core import SamplingParams

    gen = path / "generation_config.json"
    if not gen.is_file():
        return {}
    raw = json.loads(gen.read_text())
    out: dict[str, float | int] = {}
    for key, name in _SAMPLING_KEYS.items():
        value = raw.get(key)
        if value is None or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        try:
            SamplingParams(**{name: value})
        except ValueError:
            continue
        out[name] = value
    return out


def check_tp_split(mc: ModelConfig, tp_size: int) -> None:
    """Refuse, before any worker starts, a model whose shapes `tp_size` ranks cannot share:
    query heads and MLP columns split evenly; KV heads split evenly or are replicated."""
    for what, size in (
        ("num_attention_heads", mc.num_heads),
        ("intermediate_size", mc.intermediate_size),
        ("num_key_value_heads", mc.num_kv_heads),
    ):
        try:
            div_even(size, tp_size, allow_replicate=what == "num_key_value_heads")
        except ValueError as e:
            raise ValueError(f"tp_size {tp_size} cannot split the model's {what}: {e}") from None


def check_max_seq_len(mc: ModelConfig, max_seq_len: int | None) -> None:
    """Refuse a `max_seq_len` longer than the model's context (config.json's
    max_position_embeddings, times a linear rope scaling's factor, or a shorter Mistral
    sliding_window, the context kvray serves
    such a model at), as vLLM refuses a max_model_len past the model's: silently serving
    less than was asked for would truncate every client's budget."""
    if max_seq_len is not None and max_seq_len > mc.max_position_embeddings:
        raise ValueError(
            f"max_seq_len {max_seq_len} is longer than the model's context, "
            f"{mc.max_position_embeddings} tokens (config.json's max_position_embeddings, "
            "times a linear rope_scaling factor, or its sliding_window where that is shorter)"
        )


@dataclass(frozen=True)
class EngineSpec:
    config: EngineConfig
    model_path: Path
    model_config: ModelConfig
    dtype: str
    num_pages: int
    max_seq_len: int
    eos_token_ids: tuple[int, ...]
    # The checkpoint's own sampling settings (generation_config.json), the defaults of a
    # request that leaves them unset, as vLLM's (`sampling_defaults`).
    sampling_defaults: tuple[tuple[str, float | int], ...] = ()

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    @classmethod
    def resolve(
        cls, config: EngineConfig, progress: bool = True, device: str | None = None
    ) -> EngineSpec:
        """`device`: where the workers compute ("cpu" or "cuda"; None: `config.device`, its
        auto being CUDA when this process sees a GPU), for the auto dtype."""
        path = resolve_model_path(config.model, progress)
        mc = ModelConfig.from_pretrained(path)
        check_tp_split(mc, config.tp_size)
        check_max_seq_len(mc, config.max_seq_len)
        device = resolve_device(device or config.device)
        dtype = resolve_dtype(config.dtype, mc.dtype, device)
        num_pages = config.num_pages
        if num_pages is None:
            local_kv = div_even(mc.num_kv_heads, config.tp_size, allow_replicate=True)
            itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
            page_bytes = 2 * mc.num_layers * config.page_size * local_kv * mc.head_dim * itemsize
            num_pages = max(int(config.kv_cache_memory_gb * 2**30) // page_bytes, 1)
        max_seq_len = config.max_seq_len or mc.max_position_embeddings
        max_seq_len = min(max_seq_len, num_pages * config.page_size)
        eos = _eos_ids(path, mc)
        defaults = tuple(sampling_defaults(path).items())
        return cls(config, path, mc, dtype, num_pages, max_seq_len, eos, defaults)

    def scheduler_config(self) -> SchedulerConfig:
        return self.config.scheduler_config(self.num_pages, self.max_seq_len)

    def worker_spec(self, device: str) -> WorkerSpec:
        return WorkerSpec(
            config=self.config,
            model_path=str(self.model_path),
            dtype=self.dtype,
            device=device,
            num_pages=self.num_pages,
            max_seq_len=self.max_seq_len,
        )
