"""`ModelConfig`: the facts of a Hugging Face `config.json` that the model code needs.

One Llama-family implementation serves Llama, Qwen2 and Qwen3; they differ only in flags
(`qkv_bias`, `o_bias`, `qk_norm`). Anything else (sliding windows, other activations,
partial rotary, other rope types) is rejected here, up front, with a clear error.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
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
    mlp_bias: bool
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
        if cfg.get("use_sliding_window") or any(
            t != "full_attention" for t in cfg.get("layer_types") or ()
        ):
            raise ValueError("sliding-window attention is not supported")

        hidden, heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
        rope_theta, rope_scaling = _parse_rope(cfg)
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
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(cfg["vocab_size"]),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=True if is_qwen2 else attention_bias,
            o_bias=False if is_qwen2 else attention_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_ids=eos_ids,
            dtype=_DTYPES[dtype_name],
        )


def _parse_rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """Rope settings live in `rope_parameters` (transformers >= 5) or in top-level
    `rope_theta` plus `rope_scaling` (older checkpoints); read either."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    if rope_type == "default":
        return theta, None
    if rope_type == "linear":
        return theta, RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        return theta, RopeScaling(
            "llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        )
    raise ValueError(f"unsupported rope type {rope_type!r} (default, linear or llama3)")
