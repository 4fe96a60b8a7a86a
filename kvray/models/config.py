"""`ModelConfig`: the facts of a Hugging Face `config.json` that the model code needs.

One Llama-family implementation serves Llama, Mistral, Qwen2 and Qwen3; they differ only
in flags (`qkv_bias`, `o_bias`, `qk_norm`). Mistral is Llama's layers under another name;
a Mistral `sliding_window` shorter than its context becomes the context served (every
token then sees all the tokens before it, as the window would let it: exact). Anything
else (other sliding windows, other activations, partial rotary, other rope types,
quantized weights) is rejected here, up front, with a clear error. Keys a config leaves
out take transformers' defaults for its architecture.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling: "linear" divides every frequency by `factor`; "llama3"
    divides only the low frequencies and blends the middle band (Llama 3.1)."""

    rope_type: Literal["linear", "llama3"]
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None  # None: plain rope
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool  # bias on q/k/v projections (Qwen2: always)
    o_bias: bool  # bias on the output projection (Llama/Qwen3 `attention_bias`)
    mlp_bias: bool  # bias on the MLP projections (Llama `mlp_bias`; Qwen: never)
    qk_norm: bool  # per-head RMSNorm of q and k before rope (Qwen3)
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype  # the checkpoint's dtype (float32 when the config names none)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        with open(Path(path) / "config.json") as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or cfg.get('model_type')!r}; "
                f"kvray supports {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r} (only silu)")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "?") if isinstance(quant, dict) else "?"
            raise ValueError(
                f"quantized checkpoints are not supported (quant_method {method!r}); use a "
                "float32, bfloat16 or float16 one"
            )
        if any(t != "full_attention" for t in _layer_types(cfg)):
            raise ValueError("sliding-window attention is not supported")
        if int(cfg["num_hidden_layers"]) < 1:  # the model's last layer is where logits start
            raise ValueError(f"num_hidden_layers is {cfg['num_hidden_layers']}: need at least 1")

        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        is_qwen = arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM")
        # transformers' defaults where a config leaves these out
        head_dim = cfg.get("head_dim") or (128 if arch == "Qwen3ForCausalLM" else hidden // heads)
        max_positions = int(cfg.get("max_position_embeddings") or (32768 if is_qwen else 2048))
        rope_theta, rope_scaling = _parse_rope(cfg, max_positions)
        if rope_scaling is not None and rope_scaling.rope_type == "linear":
            # Linear scaling stretches the trained positions by its factor: the context is
            # max_position_embeddings times it (as vLLM derives max_model_len).
            max_positions = int(max_positions * rope_scaling.factor)
        window = cfg.get("sliding_window") if arch == "MistralForCausalLM" else None
        if window is not None and int(window) < max_positions:
            max_positions = int(window)
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(eos)
        dtype_name = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if dtype_name not in _DTYPES:
            raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}")
        is_qwen2 = arch == "Qwen2ForCausalLM"
        attention_bias = bool(cfg.get("attention_bias", False))
        return cls(
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=False if is_qwen else bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            dtype=_DTYPES[dtype_name],
        )


def _layer_types(cfg: dict[str, Any]) -> list[str]:
    """Each layer's attention, as transformers reads it: `layer_types` when given, else
    Qwen's `use_sliding_window` (with a window) slides the layers from `max_window_layers`
    on (none, when that is past the last layer)."""
    if cfg.get("layer_types"):
        return list(cfg["layer_types"])
    n = int(cfg.get("num_hidden_layers", 0))
    if cfg.get("use_sliding_window") and cfg.get("sliding_window") is not None:
        first = int(cfg.get("max_window_layers", 28))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(n)]
    return ["full_attention"] * n


def _parse_rope(cfg: dict[str, Any], max_positions: int) -> tuple[float, RopeScaling | None]:
    """Rope settings live in `rope_parameters` (transformers >= 5) or in top-level
    `rope_theta` plus `rope_scaling` (older checkpoints, or one added by hand to a newer
    config); as in transformers, a `rope_scaling` wins, and the theta it lacks is the
    top-level one, else 10000."""
    params = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None

    def number(key: str) -> float:
        if params.get(key) is None:
            raise ValueError(f"{rope_type} rope scaling needs rope_scaling.{key}")
        return float(params[key])

    if rope_type == "linear":
        return theta, RopeScaling("linear", number("factor"))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=number("factor"),
            low_freq_factor=number("low_freq_factor"),
            high_freq_factor=number("high_freq_factor"),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings") or max_positions
            ),
        )
    raise ValueError(f"unsupported rope type {rope_type!r} (default, linear or llama3)")
